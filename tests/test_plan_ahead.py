"""Note [Planning a packed batch ahead] (megatron_fcp/patches/runtime.py): a packed batch planned in
the background gives the step the plans it would have made itself, without making them again; bad
input is refused at the call; a planning error surfaces where planning on the spot would raise."""

from __future__ import annotations

import pytest

from megatron_fcp.config import FCPConfig
from megatron_fcp.contract.placement import lognormal_lengths
from megatron_fcp.patches import runtime as runtime_mod
from megatron_fcp.patches.runtime import FCPStateError, reset_fcp, setup_fcp
from megatron_fcp.planner.megatron_layout import MegatronLayout

RANKS = tuple(range(8))


def _runtime(**cfg):
    reset_fcp()
    return setup_fcp(FCPConfig(enabled=True, topology="dgx-h100:1", graph="hierarchical", block_tokens=64, **cfg),
                     layout=MegatronLayout(world=8, cp=8), groups={}, heads=8, kv_heads=2, head_dim=16)


def _lookups(rt, docs):
    """What a step asks the runtime for one packed batch (packed_attention's calls)."""
    degree = rt.packed_degree(RANKS, docs)
    placement = rt.packed_placement(docs, cp_ranks=RANKS)
    if degree > 1:
        hp = rt.packed_head_parallel(RANKS, docs, causal=True, heads=8, kv_heads=2)
        return degree, placement, hp.kv_plan, hp
    return degree, placement, rt.packed_plan(RANKS, docs), None


def _count_planning(monkeypatch) -> list[str]:
    """Every planning call the runtime makes from now on, by name."""
    calls: list[str] = []
    for name in ("choose_packed_head_parallel", "place_batch", "place_batch_groups", "build_group_plan",
                 "compile_packed_head_parallel"):
        original = getattr(runtime_mod, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)
        monkeypatch.setattr(runtime_mod, name, spy)
    return calls


@pytest.mark.parametrize("head_parallel", ["auto", 1])
def test_a_batch_planned_ahead_is_the_batch_planned_on_the_spot(monkeypatch, head_parallel):
    """Per batch (some choosing a stage, some not): the prefetch's plans equal a fresh runtime's,
    and the step's lookups plan nothing more."""
    batches = [tuple(lognormal_lengths(5.0, 1.0, 2048, seed=s)) for s in range(5)]
    fresh = _runtime(head_parallel=head_parallel)
    want = [_lookups(fresh, docs) for docs in batches]
    rt = _runtime(head_parallel=head_parallel)
    futures = [rt.prefetch_packed(RANKS, docs) for docs in batches]
    assert all(f is rt.prefetch_packed(RANKS, docs) for f, docs in zip(futures, batches))  # not planned twice
    for f in futures:
        f.result(timeout=120)
    calls = _count_planning(monkeypatch)
    got = [_lookups(rt, docs) for docs in batches]
    assert calls == [] and not rt.prefetches
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert [g[3] for g in got] == [w[3] for w in want]
    if head_parallel == "auto":
        assert {g[0] for g in got} - {1}, "no batch chose a stage: the test checks half of what it claims"
    reset_fcp()


def test_a_lookup_waits_for_the_batch_under_way_and_raises_its_error(monkeypatch):
    """The step's lookup takes the prefetch's result, waiting for it; an error planning raised in
    the background is raised by that lookup."""
    import threading

    rt = _runtime()
    docs = tuple(lognormal_lengths(5.0, 1.0, 2048, seed=7))
    gate = threading.Event()
    original = runtime_mod.choose_packed_head_parallel

    def slow_then_fail(*args, **kwargs):
        gate.wait(timeout=30)
        raise ValueError("planning failed: fix the documents")

    monkeypatch.setattr(runtime_mod, "choose_packed_head_parallel", slow_then_fail)
    fut = rt.prefetch_packed(RANKS, docs)
    assert not fut.done()
    gate.set()
    with pytest.raises(ValueError, match="planning failed"):
        rt.packed_degree(RANKS, docs)
    monkeypatch.setattr(runtime_mod, "choose_packed_head_parallel", original)
    assert rt.packed_degree(RANKS, docs) >= 1          # planned on the spot afterwards
    reset_fcp()


def test_bad_input_is_refused_at_the_call():
    rt = _runtime()
    with pytest.raises(ValueError, match="document"):
        rt.prefetch_packed(RANKS, (5, 0, 7))
    with pytest.raises(FCPStateError, match="not a CP group"):
        rt.prefetch_packed((0, 1, 2, 3), (5, 7))
    assert not rt.prefetches and rt.planner_thread is None
    reset_fcp()


def test_batches_planned_but_never_used_are_dropped_oldest_first(monkeypatch):
    """More prefetches than PREFETCH_ENTRIES without a lookup: the oldest go, the newest stay."""
    import threading

    rt = _runtime()
    gate = threading.Event()
    original = runtime_mod._plan_ahead
    monkeypatch.setattr(runtime_mod, "_plan_ahead", lambda *a: (gate.wait(timeout=30), original(*a))[1])
    batches = [tuple(lognormal_lengths(5.0, 1.0, 2048, seed=100 + s)) for s in range(runtime_mod.PREFETCH_ENTRIES + 3)]
    futures = [rt.prefetch_packed(RANKS, docs) for docs in batches]
    kept = [key[1] for key in rt.prefetches]
    assert kept == batches[3:]
    assert all(f.cancelled() for f in futures[1:3])            # queued behind the first: never started
    gate.set()
    assert rt.packed_degree(RANKS, batches[-1]) >= 1 and batches[-1] not in [k[1] for k in rt.prefetches]
    reset_fcp()
