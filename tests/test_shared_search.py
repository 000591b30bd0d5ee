"""The runtime's schedule search split over the job's ranks (Note [Sharing the search] in
megatron_fcp/planner/choose.py) gives every rank the single-process search's answer."""

from __future__ import annotations

import json

import pytest

from megatron_fcp.cost.model import AttentionShape
from megatron_fcp.planner.choose import SearchShare, choose_schedule
from megatron_fcp.planner.megatron_layout import MegatronLayout
from megatron_fcp.schedule.program import WaveBackward
from megatron_fcp.testing.shared_search import run_shared_search

# (preset, CP ranks, shape, constraints): GQA and MHA, a compute-bound length, one node and two,
# a fixed degree, a sliding window (degree 1 only)
CELLS = [
    ("dgx-h100:1", 8, AttentionShape(32768, 32, 8, 128, 2), {}),
    pytest.param("pcie-box:2", 16, AttentionShape(32768, 32, 2, 128, 2), {}, marks=pytest.mark.slow),
    ("dgx-a100:2", 12, AttentionShape(131072, 32, 32, 128, 2), {"degree": 4}),
    ("dgx-h100:1", 8, AttentionShape(65536, 16, 4, 128, 2), {"window": (4096, 0)}),
]


def _facts(choice):
    """Everything a choice says but its plan (compared as a whole where it is at hand)."""
    return (choice.label, choice.total_s, choice.fwd_s, choice.bwd_s, choice.runner_up, choice.backward_kv,
            choice.backward_form, choice.degree, choice.graph, choice.parts, choice.stagger, choice.seq_len)


@pytest.mark.parametrize("preset,cp,shape,opts", CELLS)
def test_a_shared_search_is_the_single_process_answer(preset, cp, shape, opts):
    """Every rank of a search shared over 2 and 5 ranks: the same choice, runner-up, times and
    plan as one process searching alone; what both price has the same predictions (the shared
    search prices cheap candidates first, so it may price fewer); round 1 deals the base
    candidates evenly."""
    alone = choose_schedule(preset, range(cp), shape, backward=WaveBackward(), **opts)
    for n in (2, 5):
        run = run_shared_search(n, preset, range(cp), shape, backward=WaveBackward(), **opts)
        choices, sent = run.choices, run.sent
        assert all(_facts(c) == _facts(alone) and c.plan == alone.plan for c in choices)
        priced = dict(choices[0].plan.auto)
        assert {alone.label, alone.runner_up[0]} <= set(priced)           # the choice and runner-up are priced
        assert all(priced[k] == t for k, t in alone.plan.auto if k in priced)   # with the same predictions
        assert len({len(s) for s in sent}) == 1                      # every rank took part in every gather
        first = [sum(e[0] != "follow-up floor" for e in o[0]) for o in run.objects]   # round 1: each base
        assert max(first) - min(first) <= 1                                             # candidate once, evenly


def test_search_share_refuses_a_rank_outside_its_size():
    with pytest.raises(ValueError, match="rank must be in 0..size-1"):
        SearchShare(3, 3, lambda obj: [obj])


def _gloo_search(rank: int, world: int, preset: str, cp: int, seq: int) -> dict:
    import torch.distributed as dist

    from megatron_fcp.attention.agreement import gather_json
    from megatron_fcp.patches.schedule import search_share

    floats = gather_json([rank, 0.1 + rank / 3, {"x": [1e-300, 2.5e300]}], what="test")
    share = search_share(MegatronLayout(world=world, tp=1, pp=1, cp=world), {tuple(range(world)): dist.group.WORLD})
    assert search_share(MegatronLayout(world=world, tp=1, pp=1, cp=world), {}) is None  # no live group: alone
    shape = AttentionShape(seq, 32, 8, 128, 2)
    shared = choose_schedule(preset, range(cp), shape, backward=WaveBackward(), share=share)
    dist.barrier()
    return {"floats": floats, "share": (share.rank, share.size), "facts": _facts(shared)}


@pytest.mark.slow
@pytest.mark.dist
def test_the_runtime_shares_the_search_over_gloo():
    """Three gloo processes: ``gather_json`` returns every rank's object with floats exact;
    ``search_share`` spans the world; the shared choice is the one-process choice."""
    from megatron_fcp.testing.launch import run_gloo

    out = run_gloo(_gloo_search, 3, "dgx-h100:1", 8, 32768, timeout_s=240)
    alone = choose_schedule("dgx-h100:1", range(8), AttentionShape(32768, 32, 8, 128, 2), backward=WaveBackward())
    for r, o in enumerate(out):
        assert o["share"] == (r, 3)
        assert o["floats"] == [[k, 0.1 + k / 3, {"x": [1e-300, 2.5e300]}] for k in range(3)]
        assert tuple(json.loads(json.dumps(o["facts"]))) == tuple(json.loads(json.dumps(_facts(alone))))


def test_a_rank_owning_several_candidates_to_pack_hands_the_others_to_idle_ranks():
    """_deal_dear: each owner keeps its first candidate to pack; its further ones go to the ranks
    owning none this round, in turn from where the compile jobs left off; with no idle rank left
    they stay with their owner."""
    from megatron_fcp.planner.choose import _deal_dear

    assert _deal_dear([3, 3, 5, 3], 8, 6) == [3, 6, 5, 7]        # idle in turn from 6: 6, 7, 0, 1, ...
    assert _deal_dear([0, 1, 2], 4, 0) == [0, 1, 2]              # one each: nothing moves
    assert _deal_dear([0, 0, 0, 1], 3, 0) == [0, 2, 0, 1]        # rank 2 was the only idle one
    assert _deal_dear([], 4, 0) == []


def test_compile_jobs_go_first_to_ranks_holding_no_candidate_still_to_price():
    """_deal_cheap: in turn from where the last round left off, first over the ranks that hold no
    compiled candidate still to pack or price, then over every rank in the same turn."""
    from megatron_fcp.planner.choose import _deal_cheap

    assert _deal_cheap(3, 8, 6, set()) == [6, 7, 0]                   # nobody holds: plain turn
    assert _deal_cheap(4, 6, 1, {2, 3}) == [1, 4, 5, 0]               # holders 2, 3 skipped
    assert _deal_cheap(5, 4, 0, {0, 1}) == [2, 3, 0, 1, 2]            # free ones first, then the turn again
    assert _deal_cheap(0, 4, 0, {1}) == []
    holders = {r for r in range(16) if r % 3 == 0}
    out = _deal_cheap(10, 16, 5, holders)
    assert len(set(out)) == 10 and not holders & set(out)             # enough free ranks: no holder gets one


def test_the_search_pauses_the_collector_and_nested_or_concurrent_pauses_restore_it_once():
    """gc_paused (used by choose_schedule and compile_plan): the collector stays off until the
    last of several nested or concurrent pauses closes, and comes back only if it was on."""
    import gc
    import threading

    from megatron_fcp.contract.blocks import gc_paused

    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other():
        with gc_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        assert inside.wait(10) and not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()          # the other thread's pause is still open
    release.set()
    t.join(10)
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()      # it was off before: it stays off
    finally:
        gc.enable()
