"""A backward on another graph (Note [A backward on another graph] in megatron_fcp.contract.plan).

* The contract: ``with_backward`` refuses a plan over other blocks, an unverified one, one with a
  backward of its own, and a forward that misses the backward's first-round deliveries (naming
  ``join_backward``); ``join_backward`` adds exactly those, and the joined forward verifies.
* Every reader of the backward reads ``backward_plan``: the program (its posts are what the
  executor posts, for every rank and backward KV mode), the cost model's backward (the very
  program object, and the backward plan's own price to the bit), and the forward stays the
  forward plan's.
* FP64 numerics of split plans on the in-process harness, over TE's layout and FCP's: out, LSE,
  dQ, dK, dV against a per-document reference, in every backward KV mode.
* TE's layout at cp = 16 (1M tokens, median 32K): the split plan prices as the ring to the bit
  and its forward communication is within 1.5x of the placement's need-set bound (the ring's is 10x).
"""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

from megatron_fcp.attention.comm import CountingTransport
from megatron_fcp.contract.blocks import PlanError
from megatron_fcp.contract.placement import lognormal_lengths, place_packed, thd_placement
from megatron_fcp.cost import backward as cost_backward
from megatron_fcp.cost.head_parallel_packed import PackedAsRun
from megatron_fcp.cost.model import AttentionShape, simulate_plan
from megatron_fcp.planner.build import build_plan, join_backward
from megatron_fcp.planner.compare import packed_lower_bound_all
from megatron_fcp.schedule.chains import is_chain_plan
from megatron_fcp.schedule.program import BackwardPolicy, ProgramPost, compile_backward
from megatron_fcp.testing.harness import QUANTITIES, harness_attention, per_document_reference
from megatron_fcp.topology import load_topology

TOPO = "dgx-h100:1"
DOCS = [33, 5, 5, 17, 12, 3]
H, HK, D = 4, 2, 8
MODES = ("keep", "resend", "auto")


def _placements():
    return {"thd": thd_placement(DOCS, 4), "fcp": place_packed(DOCS, 4, block_tokens=8, causal=True)}


def _split(pl, forward="full", backward="ring"):
    return build_plan(TOPO, range(4), forward, placement=pl, backward_graph=backward)


def test_with_backward_refuses_what_it_cannot_run():
    pl = thd_placement(DOCS, 4)
    ring = build_plan(TOPO, range(4), "ring", placement=pl)
    full = build_plan(TOPO, range(4), "full", placement=pl)
    other = build_plan(TOPO, range(4), "ring", placement=thd_placement(DOCS[:-1], 4))
    with pytest.raises(PlanError, match="same arguments but the graph"):
        full.with_backward(other)
    with pytest.raises(PlanError, match="first round.*join_backward"):
        full.with_backward(ring)                        # the ring relays past ranks that do not read
    joined = join_backward(full, ring)
    with pytest.raises(PlanError, match="backward of its own"):
        full.with_backward(joined)
    unverified = dataclasses.replace(ring, name="ring2")
    with pytest.raises(PlanError, match="verify both plans first"):
        join_backward(full, unverified)
    with pytest.raises(PlanError, match="same arguments but the graph"):   # a copy onto other ranks
        dataclasses.replace(joined, ranks=(4, 5, 6, 7))
    hand_made = dataclasses.replace(full, backward=ring)        # past with_backward: verify() refuses it
    with pytest.raises(PlanError, match="first round.*join_backward"):
        hand_made.verify()
    with pytest.raises(PlanError, match="first round"):        # and so does the executor, before sending
        harness_attention(*(torch.zeros(pl.total_tokens, n, 8, dtype=torch.float64) for n in (2, 1, 1)),
                          cp=4, plan=hand_made, placement=pl)


def test_join_adds_exactly_the_missing_first_round_deliveries():
    for pl in _placements().values():
        full = build_plan(TOPO, range(4), "full", placement=pl)
        ring = build_plan(TOPO, range(4), "ring", placement=pl)
        missing = full.undelivered_first_round(ring)
        joined = join_backward(full, ring)
        assert joined.verified and joined.backward is ring and joined.backward_plan is ring
        assert joined.num_transfers() == full.num_transfers() + len(missing)
        assert joined.rounds[1:] == full.rounds[1:]
        added = joined.rounds[0][len(full.rounds[0]):]
        assert sorted((t.dst, t.block) for t in added) == sorted(missing)
        assert all(t.src == t.block.owner for t in added)          # each from its owner, as the ring sends it
        assert joined.undelivered_first_round(ring) == []
        assert ring.backward_plan is ring and ring.with_backward(None) == ring
        again = pickle.loads(pickle.dumps(joined))
        assert again == joined and again.backward == ring
        assert joined.round_table().splitlines()[-1].startswith("  backward: plan 'ring'")


def test_build_plan_joins_only_another_graph():
    pl = thd_placement(DOCS, 4)
    assert build_plan(TOPO, range(4), "ring", placement=pl, backward_graph="ring").backward is None
    split = build_plan(TOPO, range(4), "auto", placement=pl, backward_graph="ring")
    assert split.name != "ring" and split.backward.name == "ring" and split.auto is not None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["thd", "fcp"])
def test_split_plan_fp64_posts_and_prices(layout, mode, monkeypatch):
    """Forward on ``full``, backward on the ring: FP64 numerics of every tensor; the forward posts
    the forward plan's rounds, the backward the program's posts, and the program is the backward
    plan's, the one the cost model prices."""
    pl = _placements()[layout]
    plan = _split(pl)
    g = torch.Generator().manual_seed(len(DOCS) + len(mode))
    T = pl.total_tokens
    q, do = (torch.randn(T, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(T, HK, D, generator=g, dtype=torch.float64) for _ in range(2))
    res = harness_attention(q, k, v, do, cp=4, plan=plan, placement=pl, softmax_scale=D ** -0.5, backward_kv=mode,
                            transport=lambda rank, inner: CountingTransport(inner))
    ref = per_document_reference(q, k, v, do, DOCS, True, D ** -0.5)
    for name in QUANTITIES:
        torch.testing.assert_close(res.gathered(name), ref[name], rtol=0, atol=1e-12, msg=name)

    programs = {r.program for r in res.ranks}
    assert len(programs) == 1
    program = programs.pop()
    assert program.plan is plan.backward and program is compile_backward(plan.backward, program.token_bytes,
                                                                          BackwardPolicy(mode))
    for r in res.ranks:
        fwd = [(i, s, rv) for ph, i, s, rv in r.transport.rounds if ph == "forward"]
        assert fwd == [(i, *plan.rank_rounds(r.rank)[i]) for i in range(plan.num_rounds)]
        posted = [ProgramPost(ph, i, s, rv) for ph, i, s, rv in r.transport.rounds if ph != "forward"]
        assert posted == list(program.posts(r.rank))
        assert r.kept_bytes == program.kept_bytes(r.rank)

    compiled = []
    real = cost_backward.compile_backward
    monkeypatch.setattr(cost_backward, "compile_backward",
                        lambda *a, **kw: compiled.append(real(*a, **kw)) or compiled[-1])
    shape = AttentionShape(1, H, HK, D, 8)
    priced = cost_backward.simulate_backward_waves(plan, TOPO, shape, backward_kv=mode)
    assert compiled[0].plan is plan.backward
    assert priced == cost_backward.simulate_backward_waves(plan.backward, TOPO, shape, backward_kv=mode)


def test_te_layout_split_prices_as_the_ring_with_its_forward_near_the_bound():
    """cp = 16, 1M tokens, median 32K, 64:8 on dgx-h100:2 (a grid cell where TE's layout is chosen):
    the need-driven forward with the ring's backward costs what the ring costs, to the bit, and
    moves its forward KV within 1.5x of the placement's need-set bound; the ring's own forward
    is 10x it."""
    topo = load_topology("dgx-h100:2")
    lengths = lognormal_lengths(math.log(32768), 1.0, 1 << 20, 0)
    pl = thd_placement(lengths, 16)
    shape = AttentionShape(1, 64, 8, 128, 2)
    ring = build_plan(topo, range(16), "ring", placement=pl)
    split = build_plan(topo, range(16), "auto", placement=pl, heads=64, kv_heads=8, head_dim=128,
                       backward_graph="ring")
    assert split.backward == ring and is_chain_plan(split.backward_plan)
    a, b = PackedAsRun(split, topo, shape), PackedAsRun(ring, topo, shape)
    got, want = a.result(), b.result()
    assert got["bwd_s"] == want["bwd_s"] and got["waves"] == want["waves"]       # the ring's backward, to the bit
    assert got["fwd_s"] == pytest.approx(want["fwd_s"], rel=1e-12)                # compute-bound: the same forward
    bound = packed_lower_bound_all({1: split}, topo, shape, pass_="fwd")["lower_bound_s"]   # the bench's bound
    assert a.forward.comm_s <= 1.5 * bound < b.forward.comm_s / 5
    assert a.forward.comm_s == simulate_plan(split, topo, shape).comm_s


def test_a_joined_forward_predicted_slower_is_not_taken(monkeypatch):
    """``build_plan(backward_graph=)`` keeps the joined forward only where it is predicted no slower
    than the backward plan's own forward; else it returns that plan alone."""
    from megatron_fcp.planner import build

    pl = thd_placement(DOCS, 4)
    real = build.simulate_plan

    def slower_when_joined(plan, *a, **kw):
        res = real(plan, *a, **kw)
        return dataclasses.replace(res, total_s=res.total_s + 1.0) if plan.backward is not None else res

    monkeypatch.setattr(build, "simulate_plan", slower_when_joined)
    got = build_plan(TOPO, range(4), "full", placement=pl, backward_graph="ring")
    assert got.name == "ring" and got.backward is None


def test_relabel_keeps_the_backward():
    from megatron_fcp.contract.head_parallel import relabel_plan

    for pl in _placements().values():
        joined = _split(pl)
        moved = relabel_plan(joined, (10, 11, 12, 13))
        assert moved.ranks == moved.backward.ranks == (10, 11, 12, 13)
        assert moved.backward.num_transfers() == joined.backward.num_transfers()
        assert moved.verify().undelivered_first_round(moved.backward.verify()) == []


def test_gloo_thd_stage_cases_run_a_split_plan():
    """The head-parallel gloo cases on TE's layout (tests/test_head_parallel_thd.py, FP64 against the
    per-document reference) run KV stages whose backward walks the ring and forward another graph."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _head_parallel_thd_cases import Case, make_plan

    for ranks, case in ((tuple(range(4)), Case(2, "mix", True, layout="thd")),
                        (tuple(range(8)), Case(4, "mix", True, heads=(8, 2), layout="thd"))):
        hp = make_plan(case, ranks)
        assert hp.kv_plan.name == "hierarchical" and hp.kv_plan.backward.name == "ring", case.name


@pytest.mark.parametrize("cp,degree", [(16, 2), (32, 2)])
def test_split_stage_merged_and_one_copy_price_alike(cp, degree):
    """A head-parallel stage on TE's layout: its merged plan carries every copy of the backward
    plan too, and (copies independent on dgx-h100) copy 0 alone prices forward and backward as the
    merged plan, bit for bit."""
    from megatron_fcp.cost.head_parallel import stage_shape
    from megatron_fcp.cost.head_parallel_packed import packed_stage_plan, priced_stage_plan, stage_copies_independent
    from megatron_fcp.planner.head_parallel import compile_packed_head_parallel

    topo = load_topology(f"dgx-h100:{cp // 8}")
    docs = lognormal_lengths(math.log(8192), 1.0, cp * 8192, seed=cp)
    hp = compile_packed_head_parallel(topo, range(cp), docs, 64, 8, degree, "auto", head_dim=128, layout="thd")
    kv = hp.kv_plan
    assert kv.backward is not None and kv.backward.name == "ring" and kv.name != "ring"
    merged = packed_stage_plan(hp)
    assert merged.backward.num_transfers() == degree * kv.backward.num_transfers()
    assert merged.num_transfers() == degree * kv.num_transfers()
    assert stage_copies_independent(hp, topo) and priced_stage_plan(hp, topo) is hp.kv_plan_for(0)
    sshape = stage_shape(hp, AttentionShape(1, 64, 8, 128, 2))
    for mode in MODES:
        got = [cost_backward.simulate_backward_waves(p, topo, sshape, backward_kv=mode, per_wave=False)
               for p in (hp.kv_plan_for(0), merged)]
        assert got[0]["bwd_s"] == got[1]["bwd_s"] and got[0]["waves"] == got[1]["waves"], mode
    assert simulate_plan(hp.kv_plan_for(0), topo, sshape).total_s == simulate_plan(merged, topo, sshape).total_s
