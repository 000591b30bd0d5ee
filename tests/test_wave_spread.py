"""Two backward-wave decisions of 2026-12-03 (issue 28): the wave timeline's links queue on their own
(Note [Wave pipeline timeline] in megatron_fcp/cost/timeline.py; the emulated cluster keeps
``held_routes``), and the spread packing for ranks whose need set is many budgets (Note [Balanced
waves], "Spread over the waves the bytes need", in megatron_fcp/schedule/waves.py)."""

from __future__ import annotations

import math

import pytest

from megatron_fcp.contract.placement import lognormal_lengths
from megatron_fcp.cost.model import _ResourceIndex
from megatron_fcp.cost.timeline import wave_timeline
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.placing import place_batch
from megatron_fcp.schedule import waves as W
from megatron_fcp.testing.harness import assert_packed_matches_fp64
from megatron_fcp.topology import load_topology

TOPO = "dgx-h100:2"
CP = 8


def _plan(topology: str = "dgx-h100:1", tokens: int = 4096, median: int = 512, block_tokens: int = 64,
          sigma: float = 1.5):
    """A packed batch whose busiest rank needs several budgets: the spread packing's case (found by
    search over seeds, sigmas and sizes once waves held a whole shard: few small batches have it)."""
    lengths = lognormal_lengths(math.log(median), sigma, tokens, 0)
    pl = place_batch(topology, range(CP), lengths, block_tokens=block_tokens, causal=True)
    plan = build_plan(topology, range(CP), "full", causal=True, placement=pl)
    return plan, pl, (lambda b: plan.block_tokens(b) * 64)


def test_spread_packing_runs_where_it_paces_better_and_delivers_everything_once():
    plan, _, size = _plan()
    inp = W._PackInput(plan, size)
    budget = W.wave_budget(plan, size)
    scale = W._spread_scale(inp, budget)
    assert scale is not None and 0 < scale < W.WAVE_CAP_SCALES[0]
    spread, pace, _ = W._pack(inp, budget, scale)
    capped = [W._pack(inp, budget, k) for k in W.WAVE_CAP_SCALES]
    best = min(p for _, p, _ in capped)
    assert pace < best * (1 - W.WAVE_SPREAD_MARGIN)            # so plan_waves runs it
    chosen = W.plan_waves(plan, size)
    assert chosen == spread
    done = [c for w in chosen for c in w.computes]                # every delivery and own block once
    assert len(done) == len(set(done))
    assert set(done) == ({(b, x) for x in plan.ranks for b in plan.needs(x)} | {(b, b.owner) for b in plan.blocks()})
    for w in chosen:                                              # the byte budget binds it as every packing
        load: dict[int, int] = {}
        for _, t in w.transfers:
            load[t.dst] = load.get(t.dst, 0) + size(t.block)
        assert max(load.values(), default=0) <= budget or len({t.block for _, t in w.transfers}) == 1
    work = W.block_work(plan)
    assert W._makespan(chosen, work) < min(W._makespan(ws, work) for ws, _, _ in capped)


def test_no_spread_where_the_need_sets_fit_a_few_waves():
    """A batch of 2K-token documents at 4K tokens per rank: every need set within a budget or two,
    one delivery is not coarse against a wave's share: no spread cap, the capped packings as before."""
    lengths = [2048] * 16
    pl = place_batch(TOPO, range(CP), lengths, causal=True)
    plan = build_plan(TOPO, range(CP), "full", causal=True, placement=pl)
    size = lambda b: plan.block_tokens(b) * 64  # noqa: E731
    inp = W._PackInput(plan, size)
    assert W._spread_scale(inp, W.wave_budget(plan, size)) is None


def test_spread_packing_fp64():
    """The executor's backward over the spread packing: out, LSE, dQ, dK, dV against FP64 per document."""
    plan, pl, size = _plan()
    inp = W._PackInput(plan, size)
    budget = W.wave_budget(plan, size)
    assert W.plan_waves(plan, size) == W._pack(inp, budget, W._spread_scale(inp, budget))[0]
    assert_packed_matches_fp64(plan, pl, seed=3)


@pytest.mark.parametrize("resend", (False, True), ids=("keep", "resend"))
def test_links_queue_on_their_own_unless_routes_are_held(resend):
    """Messages posted together finish, with links that queue on their own, by their most loaded
    resource's time plus latency (the forward's per-round bottleneck, Note [Cost model]); held routes
    (the emulated cluster's gloo over TCP) leave resources idle and take at least as long."""
    plan, _, size = _plan(TOPO, tokens=4096, median=512, sigma=1.0)
    topo = load_topology(TOPO)
    waves = W.plan_waves(plan, size)
    zero = lambda x, b: 0.0  # noqa: E731     no compute: the first wave's messages all post at once
    runs = {held: wave_timeline(plan, waves, topo, kv_bytes=size, grad_bytes=size, job_s=zero, resend=resend,
                                held_routes=held, trace=True) for held in (False, True)}
    assert runs[False]["total_s"] <= runs[True]["total_s"] + 1e-12
    if resend:
        idx = _ResourceIndex(topo)
        load: dict[int, float] = {}
        lat = 0.0
        for _, t in waves[0].transfers:                           # wave 0's re-send, posted at time 0
            rid, l = idx.route(t.src, t.dst)
            lat = max(lat, l)
            for r in rid.tolist():
                load[r] = load.get(r, 0.0) + size(t.block) / idx.bw[r]
        fetch0 = [m for m in runs[False]["messages"] if m[0] == "kv" and m[1] == 0]
        assert fetch0 and all(m[5] == 0.0 for m in fetch0)
        assert max(m[6] for m in fetch0) <= max(load.values()) + lat + 1e-12
