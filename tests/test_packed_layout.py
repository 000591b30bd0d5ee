"""Transformer Engine's packed layout as FCP's safety net (Note [TE's layout as a candidate]).

* ``thd_placement`` is TE's per-document zigzag: the Note's worked example exactly, and every
  rank's causal work is the work the cost model gives TE's ranks (``thd_rank_work``).
* FCP's run of that layout on TE's ring prices as TE's schedule: p2p at degree 1, a2a+p2p at the
  ranks per node, to 1e-9 on a compute-bound batch and never above it elsewhere.
* ``choose_packed_plan`` takes it only where TE's schedule beats FCP's plans, never below TE's
  price; elsewhere the layout is not even built (its gates); ``fcp`` and ``thd`` force a layout;
  a bad layout is refused, naming the choices.
* FP64 numerics of the layout on the in-process harness: out, LSE, dQ, dK, dV against a
  per-document reference (the gloo stage runs are in tests/test_head_parallel_thd.py).
* The runtime runs the layout it chose: placement, stage and plan follow ``--fcp-packed-layout``;
  a windowed layer keeps the batch's tokens and plans its window over them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_fcp.contract.placement import Span, lognormal_lengths, thd_placement
from megatron_fcp.cost.floors import rank_pairs
from megatron_fcp.cost.head_parallel_packed import PackedAsRun
from megatron_fcp.cost.model import AttentionShape
from megatron_fcp.cost.te import simulate_te_a2a_p2p_thd, simulate_te_p2p_thd, te_thd_floor, thd_rank_work
from megatron_fcp.planner import head_parallel
from megatron_fcp.planner.head_parallel import packed_degree_plan
from megatron_fcp.planner.packed_choice import PackedChoice, choose_packed_plan, te_degrees
from megatron_fcp.planner.placing import place_batch_groups
from megatron_fcp.schedule.chains import is_chain_plan
from megatron_fcp.topology import load_topology

LONG = lognormal_lengths(math.log(32768), 1.0, 1 << 20, 0)    # 1M tokens, median 32K: compute-bound at cp = 16
SHORT = lognormal_lengths(math.log(2048), 1.0, 1 << 20, 0)    # median 2K: FCP's own layout wins


def _te(topo, cp, lengths, shape, kind):
    f = simulate_te_p2p_thd if kind == "p2p" else simulate_te_a2a_p2p_thd
    return sum(f(topo, range(cp), lengths, shape, backward=b).total_s for b in (False, True))


def test_thd_placement_is_te_layout():
    """The Note's example (cp = 2, documents [5, 3]): padding at each document's end is not placed."""
    pl = thd_placement([5, 3], 2)
    assert pl.blocks == ((Span(0, 0, 2), Span(1, 0, 1)), (Span(0, 2, 4), Span(0, 4, 5), Span(1, 1, 2), Span(1, 2, 3)))
    for cp, lengths in ((4, [1, 37, 3, 5, 90, 2]), (16, LONG[:9]), (8, SHORT[:50])):
        pl = thd_placement(lengths, cp)
        assert np.array_equal(rank_pairs(pl, cp, 0, True), thd_rank_work(lengths, cp))   # TE's work, rank by rank


def test_te_layout_keeps_the_window_asked_for():
    """place_batch under ``thd`` keeps a window it is given on the placement (it is not dropped)."""
    from megatron_fcp.planner.placing import place_batch

    pl = place_batch("dgx-h100:1", range(4), [37, 5, 90], causal=True, window=(16, 0), layout="thd")
    assert pl.window == (16, 0) and pl.blocks == thd_placement([37, 5, 90], 4).blocks and pl.layout == "thd"


def test_group_layout_is_te_a2a_p2p_layout():
    """At a = ranks per node the groups are the nodes: the group placement is TE's zigzag over the
    nodes with documents padded to twice the CP size, and the members split each group's tokens."""
    topo = load_topology("dgx-h100:2")
    groups = [tuple(range(8)), tuple(range(8, 16))]
    group, member = place_batch_groups(topo, range(16), groups, LONG[:7], layout="thd")
    assert group == thd_placement(LONG[:7], 2, pad_ranks=16)
    assert sum(member.tokens(i) for i in range(16)) == sum(LONG[:7])
    assert [sum(member.tokens(r) for r in g) for g in groups] == [group.tokens(0), group.tokens(1)]


@pytest.mark.parametrize("cp,heads,kv_heads,degree,kind", [(16, 32, 4, 1, "p2p"), (16, 64, 8, 8, "a2a+p2p")])
def test_fcp_on_te_layout_prices_as_te(cp, heads, kv_heads, degree, kind):
    """Compute-bound (median 32K): FCP's plan of TE's layout, its backward on TE's ring (a chain: it
    streams as TE's ring backward), prices as TE's schedule, to 1e-9; its ring floor is below both.
    The forward moves the KV on the configured graph (at degree 8 over two groups, the same hops)."""
    topo = load_topology(f"dgx-h100:{cp // 8}")
    shape = AttentionShape(1, heads, kv_heads, 128, 2)
    plan = packed_degree_plan(topo, range(cp), LONG, shape, degree, layout="thd")
    run = PackedAsRun(plan, topo, shape)
    assert is_chain_plan(run.sp.backward_plan) and run.sp.backward is not None
    got, te = run.result()["total_s"], _te(topo, cp, LONG, shape, kind)
    assert abs(got - te) <= 1e-9 * te, (got, te)
    assert te_thd_floor(topo, range(cp), LONG, shape, kind) <= te


def test_fcp_on_te_layout_never_above_te():
    """Where communication shows (median 2K, cp = 16), FCP's run of TE's layout is at most TE's
    price: the same calls, and the ring stops at a block's last reader."""
    topo = load_topology("dgx-h100:2")
    shape = AttentionShape(1, 64, 8, 128, 2)
    for degree, kind in ((1, "p2p"), (8, "a2a+p2p")):
        plan = packed_degree_plan(topo, range(16), SHORT[:120], shape, degree, layout="thd")
        got, te = PackedAsRun(plan, topo, shape).result()["total_s"], _te(topo, 16, SHORT[:120], shape, kind)
        assert got <= te * (1 + 1e-9), (degree, got, te)


def test_te_layout_chain_computes_own_blocks_in_one_step():
    """On TE's layout the chain backward computes each rank's own blocks in one step (one call, as
    TE's ring does); over FCP's layout of the same tokens they may spread (Note [Streaming chain
    backward], "Own blocks"). A placement names its layout, and only two."""
    import dataclasses

    from megatron_fcp.planner.build import build_plan
    from megatron_fcp.schedule.chains import chain_steps

    def own_steps(plan):
        size = lambda b: plan.block_tokens(b) * 64  # noqa: E731
        steps = chain_steps(plan, size, pace=math.inf)
        return {r: {s for s, st in enumerate(steps) for b, x in st.computes if x == r and b.owner == r}
                for r in plan.ranks}

    pl = thd_placement(LONG, 16)            # the cp = 16 cell where spreading cost three launches
    assert pl.layout == "thd"
    got = own_steps(build_plan("dgx-h100:2", range(16), "ring", placement=pl))
    assert all(len(s) == 1 for s in got.values())
    spread = own_steps(build_plan("dgx-h100:2", range(16), "ring", placement=dataclasses.replace(pl, layout="fcp")))
    assert any(len(s) > 1 for s in spread.values())
    with pytest.raises(ValueError, match="must be one of fcp, thd"):
        dataclasses.replace(pl, layout="te")


def test_te_degrees():
    shape = AttentionShape(1, 64, 8, 128, 2)
    assert te_degrees("dgx-h100:2", range(16), shape, [1, 2, 4, 8]) == {1: "p2p", 8: "a2a+p2p"}
    assert te_degrees("dgx-h100:2", range(16), shape, [2, 4]) == {}
    assert te_degrees("dgx-h100:2", range(16), AttentionShape(1, 12, 4, 128, 2), [1, 2, 4, 8]) == {1: "p2p"}


def test_choice_takes_te_layout_where_te_wins():
    """Median 32K at cp = 16: FCP's own plans are above TE's p2p (0.990x before); the choice runs
    TE's layout at degree 1 and comes out at TE's price, not below it."""
    topo = load_topology("dgx-h100:2")
    shape = AttentionShape(1, 64, 8, 128, 2)
    plans: dict = {}
    best, times = choose_packed_plan(topo, range(16), LONG, shape, graph="auto", plans=plans)
    te = min(_te(topo, 16, LONG, shape, k) for k in ("p2p", "a2a+p2p"))
    assert best == PackedChoice(1, "thd")
    fcp = min(t for c, t in times.items() if c.layout == "fcp")
    assert times[best] < fcp and te / times[best] >= 1 - 1e-9
    assert plans[best].placement == thd_placement(LONG, 16) and plans[best].backward_plan.name == "ring"
    assert plans[best].name != "ring"            # the forward on a need-driven graph (Note [A backward on another graph])
    forced, _ = choose_packed_plan(topo, range(16), LONG, shape, graph="auto", layout="fcp")
    assert forced.layout == "fcp"


def test_choice_leaves_te_layout_unbuilt_where_fcp_wins(monkeypatch):
    """Median 2K at cp = 64: TE's ring alone takes longer than FCP's plan (gate 1), so TE's layout is
    never built; ``layout="thd"`` builds it at every degree and takes the fastest."""
    topo = load_topology("dgx-h100:8")
    shape = AttentionShape(1, 64, 8, 128, 2)
    built = []
    real = head_parallel.packed_degree_plan

    def spy(*args, **kwargs):
        built.append(kwargs.get("layout", "fcp"))
        return real(*args, **kwargs)

    monkeypatch.setattr("megatron_fcp.planner.packed_choice.packed_degree_plan", spy)
    best, times = choose_packed_plan(topo, range(64), SHORT, shape, graph="auto", degrees=[1, 8])
    assert best.layout == "fcp" and "thd" not in built and all(c.layout == "fcp" for c in times)
    fcp_time = times[best]
    assert te_thd_floor(topo, range(64), SHORT, shape, "a2a+p2p") >= fcp_time
    thd, thd_times = choose_packed_plan(topo, range(64), SHORT, shape, degrees=[8], layout="thd")
    assert thd == PackedChoice(8, "thd") and list(thd_times) == [thd] and thd_times[thd] > fcp_time


def test_choice_refuses_a_bad_layout():
    with pytest.raises(ValueError, match="auto, fcp, thd"):
        choose_packed_plan("dgx-h100:1", range(8), [10, 20], AttentionShape(1, 8, 8, 16, 2), layout="te")
    with pytest.raises(ValueError, match="fcp, thd"):
        packed_degree_plan("dgx-h100:1", range(8), [10, 20], AttentionShape(1, 8, 8, 16, 2), 1, layout="zigzag")


@pytest.mark.parametrize("docs", ([33, 5, 5, 17], [3, 2, 33, 7, 1, 12]))
def test_te_layout_fp64_numerics(docs):
    """FCP's executor on TE's layout and ring (cp = 4): out, LSE, dQ, dK, dV against an FP64
    per-document reference, the backward streaming as chains with the first step kept."""
    from megatron_fcp.planner.build import build_plan
    from megatron_fcp.testing.harness import harness_attention, per_document_reference

    pl = thd_placement(docs, 4)
    plan = build_plan("dgx-h100:1", range(4), "ring", placement=pl)
    assert is_chain_plan(plan)
    h, hk, d = 4, 2, 8
    g = torch.Generator().manual_seed(len(docs))
    q, k, v, do = (torch.randn(pl.total_tokens, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk, h))
    run = harness_attention(q, k, v, do, cp=4, plan=plan, placement=pl, softmax_scale=d ** -0.5, backward_kv="auto")
    ref = per_document_reference(q, k, v, do, docs, True, d ** -0.5)
    for name in ("out", "lse", "dq", "dk", "dv"):
        got = run.gathered(name)
        assert (got - ref[name]).abs().max().item() <= 1e-12 * max(1.0, ref[name].abs().max().item()), name


def test_runtime_runs_the_layout_it_chose():
    """``--fcp-packed-layout thd``: the runtime's placement is TE's layout and its causal plan's
    backward TE's ring, at degree 1 and at degree 2 (the stage's group placement TE's zigzag over the groups);
    ``fcp`` keeps FCP's placement."""
    from megatron_fcp.config import FCPConfig
    from megatron_fcp.patches.runtime import reset_fcp, setup_fcp
    from megatron_fcp.planner.megatron_layout import MegatronLayout

    docs = (37, 5, 90, 13, 61, 4)
    ranks = (0, 1, 2, 3)
    try:
        for degree in (1, 2):
            for layout in ("thd", "fcp"):
                reset_fcp()
                rt = setup_fcp(FCPConfig(enabled=True, topology="dgx-h100:1", graph="hierarchical",
                                         head_parallel=degree, packed_layout=layout),
                               layout=MegatronLayout(world=4, cp=4), groups={}, heads=4, kv_heads=2, head_dim=8)
                assert rt.packed_choice(ranks, docs) == PackedChoice(degree, layout)
                pl = rt.packed_placement(docs, cp_ranks=ranks)
                if degree == 1:
                    plan = rt.packed_plan(ranks, docs)
                    assert (pl == thd_placement(docs, 4)) == (layout == "thd")
                    assert plan.name == "hierarchical" and plan.placement == pl   # the forward: the configured graph
                    assert (plan.backward_plan.name == "ring") == (layout == "thd")
                    # a windowed layer: the same tokens, its window's need sets, the configured graph
                    windowed = rt.packed_plan(ranks, docs, window=(16, 0))
                    assert windowed.placement.blocks == pl.blocks and windowed.placement.window == (16, 0)
                    assert windowed.name == "hierarchical"
                else:
                    hp = rt.packed_head_parallel(ranks, docs, causal=True, heads=4, kv_heads=2)
                    assert hp.placement == pl
                    assert (hp.group_placement == thd_placement(docs, 2, pad_ranks=4)) == (layout == "thd")
                    assert hp.kv_plan.name == "hierarchical"                     # the forward: the configured graph
                    assert (hp.kv_plan.backward_plan.name == "ring") == (layout == "thd")
    finally:
        reset_fcp()
