"""The executor launches what the model prices (Note [One launch per owner and stage] in
megatron_fcp.schedule.launches): a counting block kernel records each rank's kernel calls in
forward and backward, and they must equal the cost model's launch counts
(``simulate_plan(...).meta["launches"]``; the backward program's:
``simulate_backward_waves(...)["launches"]``, and for waves :func:`rank_jobs`), for a matrix of
plans; the same runs match the FP64 reference within the numerics tolerance (1e-12).

The matrix runs in the in-process harness (bitwise the gloo path: tests/test_harness.py); one
case runs on a gloo world of 4 processes through autograd.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from megatron_fcp.attention.kernels import MathKernel, reference_attention
from megatron_fcp.contract.placement import place_packed
from megatron_fcp.contract.plan import full_plan, ring_plan
from megatron_fcp.cost.backward import simulate_backward_waves
from megatron_fcp.cost.floors import rank_jobs
from megatron_fcp.cost.model import AttentionShape, simulate_plan
from megatron_fcp.schedule.launches import OWN, forward_launches, group_blocks, launch_ids
from megatron_fcp.testing.harness import harness_attention, per_document_reference

import os

from megatron_fcp.topology import load_topology

TOPO_OBJ = load_topology(os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "configs",
                                      "topology_2x2.yaml"))
H, HK, D, B = 4, 2, 8, 2


class CountingKernel(MathKernel):
    """The math kernel, counting calls per (rank, pass); the rank comes from the harness thread
    (set by the transport factory, which runs in the rank's own thread)."""

    name = "math"

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.tls = threading.local()
        self.lock = threading.Lock()

    def transport(self, rank, inner):
        self.tls.rank = rank
        return inner

    def _count(self, what: str) -> None:
        with self.lock:
            self.calls[(self.tls.rank, what)] += 1

    def forward(self, *a, **kw):
        self._count("fwd")
        return super().forward(*a, **kw)

    def backward(self, *a, **kw):
        self._count("bwd")
        return super().backward(*a, **kw)


def test_the_rule_groups_by_stage_and_owner():
    from megatron_fcp.contract.blocks import Block
    a0, a1, b0 = Block(1, 0, 0), Block(1, 0, 1), Block(2, 0, 0)
    got = group_blocks([(OWN, Block(0, 0, 0)), (OWN, Block(0, 1, 0)), (0, a0), (0, b0), (0, a1), (1, Block(1, 1, 0))],
                       rank=0, live=lambda b: b != Block(1, 1, 0))
    assert got == [(OWN, (Block(0, 0, 0), Block(0, 1, 0))), (0, (a0, a1)), (0, (b0,))]
    assert launch_ids([0, 0, 1], [0, 1, 0], [5, 5, 5]).tolist() == [0, 1, 2]
    assert launch_ids([0, 0], [0, 0], [5, 5], [False, False]).tolist() == [-1, -1]


def _plans():
    from megatron_fcp.planner.build import build_plan
    topo = TOPO_OBJ
    r = range(4)
    out = []
    for causal in (True, False):
        for parts in (1, 2, 4):
            out.append((f"ring-{causal}-p{parts}", ring_plan(r, causal, parts), None, causal))
            out.append((f"full-{causal}-p{parts}", full_plan(r, causal, parts), None, causal))
        out.append((f"hier-{causal}-p2", build_plan(topo, r, "hierarchical", causal=causal, parts_per_chunk=2),
                    None, causal))
    out.append(("ring-window-p2", ring_plan(r, True, 2, window=(6, 0), seq_len=64), None, True))
    out.append(("full-window-p4", full_plan(r, True, 4, window=(6, 0), seq_len=64), None, True))
    pl = place_packed([5, 40, 3, 17, 1, 30], 4, block_tokens=8, causal=True)
    out.append(("packed-full", full_plan(r, True, placement=pl), pl, True))
    out.append(("packed-hier", build_plan(topo, r, "hierarchical", placement=pl), pl, True))
    out.append(("packed-ring", build_plan(topo, r, "ring", placement=pl), pl, True))   # relays: groups without work
    return out


PLANS = _plans()


def _run(plan, pl, causal, backward_kv="auto", d_v=D):
    g = torch.Generator().manual_seed(7)
    dims = (D, D, d_v, d_v)                                              # q, k, v, dout (MLA: d_v != d)
    if pl is None:
        s = 2 * 4 * 8                                                    # 8 tokens per chunk: parts of 2..8
        shapes = [(s, B, h, dd) for h, dd in zip((H, HK, HK, H), dims)]
    else:
        shapes = [(pl.total_tokens, h, dd) for h, dd in zip((H, HK, HK, H), dims)]
    q, k, v, do = (torch.randn(*sh, generator=g, dtype=torch.float64) for sh in shapes)
    window = plan.window if plan.mask.windowed else None
    kern = CountingKernel()
    res = harness_attention(q, k, v, do, cp=4, plan=plan, causal=causal, kernel=kern, placement=pl,
                            transport=kern.transport, backward_kv=backward_kv, window=window)
    if pl is None:
        ref = reference_attention(q, k, v, causal=causal, scale=D ** -0.5, dout=do, window=window)
        shape = AttentionShape(q.shape[0], H, HK, D, v_head_dim=None if d_v == D else d_v)
    else:
        ref = per_document_reference(q, k, v, do, pl.doc_lengths, causal, D ** -0.5)
        shape = AttentionShape(pl.total_tokens, H, HK, D)
    return res, ref, kern, shape


@pytest.mark.parametrize("name,plan,pl,causal", PLANS, ids=[p[0] for p in PLANS])
def test_calls_equal_the_models_launches_and_fp64_matches(name, plan, pl, causal):
    res, ref, kern, shape = _run(plan, pl, causal)
    _check(name, plan, pl, res, ref, kern, shape)


@pytest.mark.parametrize("backward_kv", ["keep", "resend"])
def test_mla_and_both_backward_kv_modes(backward_kv):
    plan = full_plan(range(4), True, 2)
    res, ref, kern, shape = _run(plan, None, True, backward_kv=backward_kv, d_v=4)
    _check("full-p2-mla", plan, None, res, ref, kern, shape, backward_kv)


def _check(name, plan, pl, res, ref, kern, shape, backward_kv="auto"):
    for n in ("out", "lse", "dq", "dk", "dv"):
        got = res.gathered(n)
        assert float((got - ref[n]).abs().max()) < 1e-12, (name, n)
    fwd = simulate_plan(plan, TOPO_OBJ, shape).meta["launches"]
    assert [kern.calls[(r, "fwd")] for r in plan.ranks] == fwd, name
    # the rule itself, and fewer calls than blocks wherever a group holds more than one
    assert fwd == [len(forward_launches(plan, r)) for r in plan.ranks]
    bwd = simulate_backward_waves(plan, TOPO_OBJ, shape, backward_kv=backward_kv)
    assert [kern.calls[(r, "bwd")] for r in plan.ranks] == bwd["launches"], (name, bwd["backward"])
    prog = res.ranks[0].program
    if prog.steps is None:                                               # waves: one call per job
        seq = None if pl is not None else shape.seq_len
        assert bwd["launches"] == rank_jobs(plan, seq).astype(int).tolist()


def test_grouping_saves_calls_on_a_ring_with_sub_blocks():
    plan = ring_plan(range(4), True, 4)
    res, _, kern, _ = _run(plan, None, True)
    blocks = [len(plan.needs(r)) + len(plan.local_blocks(r)) for r in plan.ranks]
    calls = [kern.calls[(r, "fwd")] for r in plan.ranks]
    assert calls == [4, 4, 4, 4] and all(b > c for b, c in zip(blocks, calls))   # own + one per owner


@pytest.mark.parametrize("kernel,dtype,tol", [("math", torch.float64, 1e-12), ("cpu-flash", torch.float32, 1e-5)])
@pytest.mark.parametrize("window", [None, (5, 0)])
def test_one_call_on_joined_blocks_equals_the_blocks_merged(kernel, dtype, tol, window):
    """A kernel call on blocks joined on the key axis (two runs of positions: a zigzag owner's two
    chunks, and two sub-blocks of one of them) equals the blocks' calls merged (forward) and summed
    (backward), for the math kernel and the fused CPU one (which cuts the keys at the jump)."""
    from megatron_fcp.attention.dispatch import resolve_kernel
    from megatron_fcp.attention.merge import LseAccumulator
    from megatron_fcp.contract.mask import Mask

    kern = resolve_kernel(kernel, dtype, torch.device("cpu"), head_dim=D, v_head_dim=D)
    mask = Mask.of(True, window)
    g = torch.Generator().manual_seed(3)
    q_pos = torch.cat([torch.arange(8, 16), torch.arange(48, 56)])                 # a zigzag rank's two chunks
    blocks = [torch.arange(0, 4), torch.arange(4, 8), torch.arange(56, 64)]        # sub-blocks, then another chunk
    n, m = q_pos.numel(), sum(x.numel() for x in blocks)
    q, dout = (torch.randn(n, B, H, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    k, v = (torch.randn(m, B, HK, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    k_pos = torch.cat(blocks)
    scale = D ** -0.5
    acc = LseAccumulator.empty(n, B, H, D, torch.float64 if dtype == torch.float64 else torch.float32)
    a = 0
    cuts = []
    for x in blocks:
        z = a + x.numel()
        cuts.append((a, z))
        acc.add(*kern.forward(q, k[a:z], v[a:z], q_pos, x, mask, scale, **kern.prepare_forward(q, HK, scale)))
        a = z
    out_ref, lse_ref = acc.result()
    out, lse = kern.forward(q, k, v, q_pos, k_pos, mask, scale, **kern.prepare_forward(q, HK, scale))
    assert float((out - out_ref).abs().max()) < tol
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))                # rows that see nothing
    seen = ~torch.isneginf(lse_ref)
    assert float((lse[seen] - lse_ref[seen]).abs().max()) < tol
    prep = kern.prepare_backward(q, dout, out_ref, HK)
    dq, dk, dv = kern.backward(dout, q, k, v, out_ref, lse_ref, q_pos, k_pos, mask, scale, **prep)
    dq_ref = torch.zeros_like(dq)
    for (a, z), x in zip(cuts, blocks):
        g_ = kern.backward(dout, q, k[a:z], v[a:z], out_ref, lse_ref, q_pos, x, mask, scale, **prep)
        dq_ref += g_[0]
        assert float((dk[a:z] - g_[1]).abs().max()) < tol and float((dv[a:z] - g_[2]).abs().max()) < tol
    assert float((dq - dq_ref).abs().max()) < tol


@pytest.mark.dist
def test_on_gloo_calls_equal_the_models_launches_with_a_head_parallel_stage():
    """A real 4-process gloo world through autograd: a ring with sub-blocks, and a head-parallel
    stage (degree 2) whose KV stage is a full plan over the group placement; each rank's calls
    equal the model's launches of its plan (the stage: the plan of its head shard), FP64 exact."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import _launch_cases as lc

    from megatron_fcp.testing.launch import run_gloo

    ranks = (0, 1, 2, 3)
    per_rank = run_gloo(lc.worker, 4, timeout_s=300)
    ring = lc.ring_plan_p2(ranks)
    hp = lc.hp_plan(ranks)
    for name in ("ring-p2", "head-parallel"):
        for r, res in enumerate(per_rank):
            assert max(res[name]["err"].values()) < 1e-12, (name, r, res[name]["err"])
            if name == "ring-p2":
                plan, shape = ring, AttentionShape(lc.SEQ, lc.H, lc.HK, lc.D)
            else:
                plan = hp.kv_plan_for(hp.position(r)[1])
                shape = AttentionShape(plan.placement.total_tokens, lc.H // 2, lc.HK, lc.D)
            i = plan.ranks.index(r)
            assert res[name]["fwd"] == simulate_plan(plan, TOPO_OBJ, shape).meta["launches"][i], (name, r)
            assert res[name]["bwd"] == simulate_backward_waves(plan, TOPO_OBJ, shape)["launches"][i], (name, r)
    assert [res["ring-p2"]["fwd"] for res in per_rank] == [4, 4, 4, 4]      # per block: 4 + 3 * 4 = 16


@pytest.mark.parametrize("builder", ["ring", "full", "hierarchical"])
@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_grouped_calls_priced_by_tiles_stay_above_the_floors(builder, parts, causal):
    """Under tile pricing a call on several blocks is priced as that call (call_work_s), with the
    FLOP model's launches, and every floor still sits below the priced totals (forward, the one-pass
    backward, the program's backward: chain or waves)."""
    from megatron_fcp.cost.backward import chain_compute_floor, simulate_plan_backward, wave_backward_floor
    from megatron_fcp.cost.floors import compute_floor
    from megatron_fcp.cost.model import BACKWARD_FLOP_RATIO, ComputeModel
    from megatron_fcp.planner.build import build_plan

    topo = load_topology("dgx-h100:1")
    r = range(8)
    if builder == "hierarchical":
        plan = build_plan(topo, r, "hierarchical", causal=causal, parts_per_chunk=parts)
    else:
        plan = (ring_plan if builder == "ring" else full_plan)(r, causal, parts)
    shape = AttentionShape(8 * 8192, 32, 8, 128)
    tiled, flops = ComputeModel.tiled("h200-fa2"), ComputeModel()
    fwd = simulate_plan(plan, topo, shape, compute_model=tiled)
    assert fwd.meta["launches"] == simulate_plan(plan, topo, shape, compute_model=flops).meta["launches"]
    assert compute_floor(None, 8, shape, plan.mask, tiled, 1.0, launches=True) <= fwd.compute_s * (1 + 1e-12)
    one = simulate_plan_backward(plan, topo, shape, compute_model=tiled)
    assert compute_floor(None, 8, shape, plan.mask, tiled, BACKWARD_FLOP_RATIO, launches=True) <= one.compute_s
    bwd = simulate_backward_waves(plan, topo, shape, compute_model=tiled)
    for floor in (chain_compute_floor(plan, shape, compute_model=tiled),
                  wave_backward_floor(plan, topo, shape, compute_model=tiled)):
        if floor is not None:
            assert floor <= bwd["bwd_s"] * (1 + 1e-12)
    assert compute_floor(None, 8, shape, plan.mask, tiled, BACKWARD_FLOP_RATIO, launches=True) <= bwd["bwd_s"]
