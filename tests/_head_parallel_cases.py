"""Worker side of tests/test_head_parallel_dist.py: every case inside one 4-process gloo world.

cp = 4 on the world group; head-parallel degree a in {1, 2, 4}; the head groups and KV-stage groups
of a = 2 are created once (collectively) at the start. Each rank rebuilds the global tensors from
the case's seed, computes the FP64 reference (and for BF16 plain PyTorch attention in BF16) and
runs fcp_head_parallel_attention_with_lse on its zigzag shard; the parent takes maxima over ranks.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")
TOPOLOGY = "dgx-h100:1"  # the KV stage's compiled plans run over virtual ranks 0..G-1 of one node


@dataclass(frozen=True)
class Case:
    degree: int           # head-parallel degree a
    kv: str               # KV-stage plan: "full" (full_plan), "ring" / "hierarchical" (build_plan graphs),
                          # "zigzag" (degree 1: compile_head_parallel's zigzag plan, 3 uneven parts per chunk)
    causal: bool
    heads: tuple          # (h, h_kv)
    dtype: str            # key of DTYPES
    kernel: str = "math"
    tokens: int = 4       # tokens per zigzag chunk
    swapped: bool = False  # head groups ((1, 0), (3, 2)): member order differs from the groups' rank order
    d_v: int = 8          # V's head size (q and k have 8); another value is MLA's

    @property
    def name(self) -> str:
        return (f"a{self.degree}-{self.kv}-{'causal' if self.causal else 'full'}-h{self.heads[0]}kv{self.heads[1]}"
                f"-{self.dtype}" + (f"-{self.kernel}" if self.kernel != "math" else "")
                + ("-swapped" if self.swapped else "") + (f"-dv{self.d_v}" if self.d_v != 8 else ""))


def make_hp_plan(ranks: tuple, degree: int, seq_len: int, causal: bool, kv: str, heads: int, kv_heads: int,
                 swapped: bool = False):
    """The HeadParallelPlan of a case: consecutive head groups (each reversed if ``swapped``), the
    named KV-stage plan; ``kv="zigzag"`` (degree 1): ``compile_head_parallel``'s plan, the
    ``hierarchical`` graph with 3 parts per chunk (4-token chunks: parts of 1, 1 and 2 tokens)."""
    from megatron_fcp.contract.plan import full_plan
    from megatron_fcp.cost.model import AttentionShape
    from megatron_fcp.planner.build import build_plan
    from megatron_fcp.planner.head_parallel import compile_head_parallel
    from megatron_fcp.contract.head_parallel import (HeadParallelPlan, check_head_parallel,
                                                     consecutive_head_groups, group_placement)

    if kv == "zigzag":
        return compile_head_parallel(TOPOLOGY, ranks, AttentionShape(seq_len, heads, kv_heads, 8), degree,
                                     "hierarchical", causal=causal, parts_per_chunk=3)
    groups = consecutive_head_groups(ranks, degree)
    if swapped:
        groups = tuple(tuple(reversed(g)) for g in groups)
    rep = check_head_parallel(heads, kv_heads, degree, len(ranks))
    kv_plan = None
    if len(groups) > 1:
        placement = group_placement(ranks, groups, seq_len, causal)
        virtual = tuple(range(len(groups)))
        if kv == "full":
            kv_plan = full_plan(virtual, causal, placement=placement)
        else:
            kv_plan = build_plan(TOPOLOGY, virtual, kv, causal=causal, placement=placement)
    return HeadParallelPlan(tuple(ranks), degree, groups, kv_plan, rep)


def _inputs(case: Case, cp: int):
    h, hk = case.heads
    b, d = 2, 8
    s = 2 * cp * case.tokens
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    q, do = (torch.randn(s, b, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k = torch.randn(s, b, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(s, b, hk, case.d_v, generator=g, dtype=torch.float64)
    if case.d_v != d:
        do = torch.randn(s, b, h, case.d_v, generator=g, dtype=torch.float64)
    dt = DTYPES[case.dtype]
    return [x.to(dt) for x in (q, k, v, do)]


def _run_case(case: Case, group, ranks: tuple, rank: int, hp_groups: dict) -> dict:
    from megatron_fcp.attention.head_parallel import fcp_head_parallel_attention, fcp_head_parallel_attention_with_lse
    from megatron_fcp.attention.head_parallel_a2a import _HeadComm
    from megatron_fcp.attention.kernels import reference_attention
    from megatron_fcp.attention.layout import zigzag_split
    from megatron_fcp.attention.stats import FCPStats
    from megatron_fcp.attention.comm import CountingTransport, GlooTransport

    cp, idx = len(ranks), ranks.index(rank)
    q, k, v, do = _inputs(case, cp)
    scale = 1.0 / math.sqrt(q.shape[-1])
    ref = reference_attention(q.double(), k.double(), v.double(), causal=case.causal, scale=scale, dout=do.double())
    local = {n: zigzag_split(x, cp, idx, seq_dim=2 if n == "lse" else 0) for n, x in ref.items()}
    res = {"ref_max": {n: local[n].abs().max().item() for n in QUANTITIES}}
    if case.dtype == "bf16":
        base = reference_attention(q, k, v, causal=case.causal, scale=scale, dout=do)
        res["base_err"] = {n: (zigzag_split(base[n], cp, idx, seq_dim=2 if n == "lse" else 0).double()
                               - local[n]).abs().max().item() for n in QUANTITIES}
        dt = DTYPES[case.dtype]
        res["atol"] = {n: 2 * ((local[n].to(dt) + 0.3 - 0.3) - local[n].to(dt)).abs().max().item()
                       for n in QUANTITIES}
    hp = make_hp_plan(ranks, case.degree, q.shape[0], case.causal, case.kv, *case.heads, swapped=case.swapped)
    key = "swapped" if case.swapped else case.degree
    order: list[str] = []  # all-to-alls finished and stage rounds posted, in order

    class Ordered(CountingTransport):
        def post(self, round_sends, round_recvs, *, round_index, phase="forward"):
            order.append(f"post {phase} {round_index}")
            return super().post(round_sends, round_recvs, round_index=round_index, phase=phase)

        def wait(self, handle):
            order.append("wait")
            return super().wait(handle)

    transport = Ordered(GlooTransport(dist.group.WORLD if case.degree == 1 else hp_groups[key].kv_group,
                                      timeout_s=60)) if hp.kv_plan is not None else None
    stats = FCPStats()
    ql, kl, vl = (zigzag_split(x, cp, idx).requires_grad_() for x in (q, k, v))
    finish, start = _HeadComm.finish, _HeadComm.start

    def logged_finish(self, p, out=None):
        order.append(p.what)
        return finish(self, p, out)

    def logged_start(self, x, what):
        order.append(f"start {what}")
        return start(self, x, what)

    _HeadComm.finish, _HeadComm.start = logged_finish, logged_start
    try:
        out, lse = fcp_head_parallel_attention_with_lse(
            ql, kl, vl, cp_group=group, hp_plan=hp, groups=hp_groups.get(key), causal=case.causal,
            kernel=case.kernel, transport=transport, stats=stats)
        res["a2a_order"] = [e for e in order if not e.startswith("start ") and e != "wait"]
        del order[:]
        out.backward(zigzag_split(do, cp, idx))
    finally:
        _HeadComm.finish, _HeadComm.start = finish, start
    res["a2a_order_backward"] = list(order)
    got = {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    res["dtypes"] = {n: str(t.dtype) for n, t in got.items()}
    res["finite"] = all(bool(torch.isfinite(t).all()) for t in got.values())
    res["err"] = {n: (got[n].double() - local[n]).abs().max().item() for n in QUANTITIES}
    res["a2a_bytes"] = stats.head_parallel_bytes_sent
    if transport is not None:  # the KV stage ran exactly its plan's transfers (forward and backward)
        plan_j = hp.kv_plan_for(hp.position(rank)[1])
        want = {(r, t) for r, t in plan_j.transfers() if rank in (t.src, t.dst)}
        fwd = [(p.round_index, p.transfer) for p in transport.posted if p.phase == "forward"]
        # backward: exactly the posts of the program the stage's executor compiled (Note [Backward program])
        from megatron_fcp.schedule.program import ProgramPost, compiled_programs

        (program,) = compiled_programs(plan_j)
        posted = [ProgramPost(ph, i, s, r) for ph, i, s, r in transport.rounds if ph != "forward"]
        bwd = posted == list(program.posts(rank)) and any(p.sends or p.recvs for p in posted)
        res["stage_posts"] = ((len(fwd), set(fwd) == want, bwd), (len(want), True, True))
    if case.dtype == "fp64":
        again = fcp_head_parallel_attention(*(zigzag_split(x, cp, idx) for x in (q, k, v)), cp_group=group,
                                            hp_plan=hp, groups=hp_groups.get(key), causal=case.causal)
        res["out_only_equal"] = bool(torch.equal(again, got["out"]))
        qs, ks, vs = (zigzag_split(x, cp, idx).requires_grad_() for x in (q, k, v))
        serial = fcp_head_parallel_attention(qs, ks, vs, cp_group=group, hp_plan=hp, groups=hp_groups.get(key),
                                             causal=case.causal, overlap_q=False)  # one Q|K|V all-to-all, TE's order
        res["serial_q_equal"] = bool(torch.equal(serial, got["out"]))
        serial.backward(zigzag_split(do, cp, idx))                      # one dQ|dK|dV all-to-all, TE's order
        res["serial_grads_equal"] = all(bool(torch.equal(x.grad, got[n])) for n, x in
                                        (("dq", qs), ("dk", ks), ("dv", vs)))
    return res


def _bad_inputs(group, ranks: tuple, hp_groups: dict) -> dict:
    """Each bad call must raise ValueError naming the fix before any communication (a plan whose
    construction is itself refused counts as refused)."""
    from megatron_fcp.attention.head_parallel import fcp_head_parallel_attention
    from megatron_fcp.contract.head_parallel import HeadParallelPlan

    def t(s=16, b=2, h=4, d=8, dtype=torch.float32):
        return torch.randn(s, b, h, d, dtype=dtype)

    good = make_hp_plan(ranks, 2, 64, True, "full", 4, 2)
    cases = {
        "heads_not_divisible": (lambda: make_hp_plan(ranks, 4, 64, True, "full", 6, 6), {}, None,
                                "must divide the query heads 6"),
        "heads_vs_degree": (lambda: good, {}, (t(h=5), t(h=5), t(h=5)), "must divide the query heads 5"),
        "replication_mismatch": (lambda: good, {}, (t(h=4), t(h=1), t(h=1)), "kv_replication=1 .* need 2"),
        "seq_len": (lambda: good, {}, (t(s=8), t(s=8, h=2), t(s=8, h=2)), "rebuild it for this sequence length"),
        "odd_seq": (lambda: good, {}, (t(s=15), t(s=15, h=2), t(s=15, h=2)), "must be even"),
        "causal": (lambda: good, {"causal": False}, None, "causal=True but attention runs with causal=False"),
        "no_groups": (lambda: good, {"groups": None}, None, "create_head_parallel_groups"),
        "ranks": (lambda: make_hp_plan(tuple(reversed(ranks)), 2, 64, True, "full", 4, 2), {}, None,
                  "not the CP group's ranks"),
        "degree": (lambda: HeadParallelPlan(ranks, 3, ((0, 1, 2), (3,)), None), {}, None, "groups of 3"),
        "kv_heads": (lambda: good, {}, (t(h=4), t(h=3), t(h=3)), "multiple of KV heads"),
        "dtype": (lambda: good, {}, (t(), t(h=2, dtype=torch.float64), t(h=2)), "dtypes differ"),
        "zigzag_parts": (lambda: make_hp_plan(ranks, 1, 64, True, "zigzag", 4, 2), {"groups": None},
                         (t(s=4), t(s=4, h=2), t(s=4, h=2)), "into 3 parts, more than it has tokens"),
    }
    out = {}
    for name, (plan_fn, kwargs, tensors, expect) in cases.items():
        q, k, v = tensors or (t(), t(h=2), t(h=2))
        kw = dict(cp_group=group, groups=hp_groups[2], causal=True)
        kw.update(kwargs)
        try:
            fcp_head_parallel_attention(q, k, v, hp_plan=plan_fn(), **kw)
            out[name] = ("no error", expect)
        except Exception as e:  # noqa: BLE001 - the parent checks the type and the text
            out[name] = (f"{type(e).__name__}: {e}", expect)
    return out


def _timeout_probe(rank: int, hp_groups: dict) -> str | None:
    """Rank 0 starts a head-group all-to-all that rank 1 never joins: the bounded wait must raise
    CommTimeout naming the head group. Runs last: a timed-out gloo collective breaks the group."""
    from _attention_cases import expect_timeout

    from megatron_fcp.attention.head_parallel_a2a import _HeadComm

    return expect_timeout(rank, lambda: _HeadComm(hp_groups[2].head_group, (0, 1), 0.5, None).exchange(
        torch.zeros(2, 3), "probe"))


def _pairwise_all_to_all_check(rank: int) -> tuple[bool, bool]:
    """Note [All-to-all on gloo]: the engine's per-peer all-to-all gives what ``all_to_all_single``
    gives, bitwise; and through ``_HeadComm`` a member order other than the group's is honoured
    (slot m goes to member m, slot m of the result came from member m)."""
    from datetime import timedelta

    from megatron_fcp.attention.head_parallel_a2a import _HeadComm, _pairwise_all_to_all

    group = dist.group.WORLD
    order = tuple(dist.get_process_group_ranks(group))
    x = torch.randn(4, 3, 5, dtype=torch.float64)                                 # [a, ...]: slot i for rank i
    want, got = torch.empty_like(x), torch.empty_like(x)
    dist.all_to_all_single(want, x, group=group)
    assert _pairwise_all_to_all(got, x, group, order).wait(timedelta(seconds=60))
    members = (2, 0, 3, 1)
    me = members.index(rank)
    mine = torch.stack([torch.full((3, 5), 100.0 * rank + m, dtype=torch.float64) for m in range(4)])
    y = _HeadComm(group, members, 60.0, None).exchange(mine, "check")          # [a, 3, 5]
    expect = torch.stack([torch.full((3, 5), 100.0 * members[m] + me, dtype=torch.float64) for m in range(4)])
    return torch.equal(got, want), torch.equal(y, expect)


def worker(rank: int, world: int, cases: list) -> dict:
    from megatron_fcp.attention.head_parallel import create_head_parallel_groups

    torch.manual_seed(1234 + rank)
    ranks = tuple(range(world))
    # degree 2 needs its own groups ({0,1}, {2,3} and KV stages {0,2}, {1,3}); 1 and 4 use the CP group
    mine = create_head_parallel_groups([make_hp_plan(ranks, 2, 8 * world, True, "full", 4, 4),
                                        make_hp_plan(ranks, 2, 8 * world, True, "full", 4, 4, swapped=True)])
    hp_groups = {2: mine[0], "swapped": mine[1]}
    # bad inputs first: a call that communicated before refusing would derail every case after it
    results = {"bad_inputs": _bad_inputs(dist.group.WORLD, ranks, hp_groups)}
    results.update({c.name: _run_case(c, dist.group.WORLD, ranks, rank, hp_groups) for c in cases})
    results["groups"] = {"head": dist.get_process_group_ranks(hp_groups[2].head_group),
                         "kv": dist.get_process_group_ranks(hp_groups[2].kv_group)}
    results["pairwise_a2a"] = _pairwise_all_to_all_check(rank)
    results["timeout"] = _timeout_probe(rank, hp_groups)
    return results
