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
    """What rank 0's step asks the runtime for one packed batch (packed_attention's calls and the
    executor's backward programs)."""
    degree = rt.packed_degree(RANKS, docs)
    placement = rt.packed_placement(docs, cp_ranks=RANKS)
    programs = [(p.mode, p.waves, p.steps) for p in rt.packed_programs(RANKS, docs, rank=0)]
    if degree > 1:
        hp = rt.packed_head_parallel(RANKS, docs, causal=True, heads=8, kv_heads=2)
        return degree, placement, hp.kv_plan, hp, programs
    return degree, placement, rt.packed_plan(RANKS, docs), None, programs


def _count_planning(monkeypatch) -> list[str]:
    """Every planning call the runtime makes from now on, by name (backward programs too)."""
    from megatron_fcp.schedule import program as program_mod

    calls: list[str] = []
    original_compile = program_mod._compile
    monkeypatch.setattr(program_mod, "_compile", lambda *a: calls.append("compile_backward") or original_compile(*a))
    for name in ("choose_packed_plan", "place_batch", "place_batch_groups", "build_group_plan",
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
    futures = [rt.prefetch_packed(RANKS, docs, rank=0) for docs in batches]
    assert all(f is rt.prefetch_packed(RANKS, docs) for f, docs in zip(futures, batches))  # not planned twice
    for f in futures:
        f.result(timeout=120)
    calls = _count_planning(monkeypatch)
    got = [_lookups(rt, docs) for docs in batches]
    assert calls == [] and not rt.prefetches
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert [g[3] for g in got] == [w[3] for w in want]
    assert [g[4] for g in got] == [w[4] for w in want] and all(g[4] for g in got)
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
    original = runtime_mod.choose_packed_plan

    def slow_then_fail(*args, **kwargs):
        gate.wait(timeout=30)
        raise ValueError("planning failed: fix the documents")

    monkeypatch.setattr(runtime_mod, "choose_packed_plan", slow_then_fail)
    fut = rt.prefetch_packed(RANKS, docs)
    assert not fut.done()
    gate.set()
    with pytest.raises(ValueError, match="planning failed"):
        rt.packed_degree(RANKS, docs)
    monkeypatch.setattr(runtime_mod, "choose_packed_plan", original)
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


def test_the_step_finds_the_backward_program_compiled_ahead(monkeypatch):
    """The executor's backward program of a batch planned ahead (degree 1: the layer plan, the run's
    K|V bytes, --fcp-backward-kv) was compiled in the background: the step compiles nothing."""
    from megatron_fcp.schedule import program as program_mod

    rt = _runtime(head_parallel=1)
    docs = tuple(lognormal_lengths(5.0, 1.0, 2048, seed=11))
    rt.prefetch_packed(RANKS, docs).result(timeout=120)
    compiled = []
    original = program_mod._compile
    monkeypatch.setattr(program_mod, "_compile", lambda *a: compiled.append(a) or original(*a))
    plan = rt.packed_plan(RANKS, docs)
    policy = program_mod.BackwardPolicy(rt.config.backward_kv, rt.config.kv_memory_budget)
    got = program_mod.compile_backward(plan, rt.packed_shape.kv_bytes(1), policy)
    assert compiled == [] and got in program_mod.compiled_programs(plan)
    reset_fcp()


def test_compiles_run_outside_the_lock_once_per_plan(monkeypatch):
    """compile_backward: threads asking for one program compile it once and share it; a thread
    compiling one plan does not hold up a lookup of another plan's cached program."""
    import threading

    from megatron_fcp.contract.placement import place_packed
    from megatron_fcp.planner.build import build_plan
    from megatron_fcp.schedule import program as program_mod

    def plan_of(seed):
        pl = place_packed(lognormal_lengths(6.0, 1.0, 8 * 1024, seed), 8, block_tokens=256)
        return build_plan("dgx-h100:1", range(8), "full", placement=pl)

    slow, ready = plan_of(1), plan_of(2)
    cached = program_mod.compile_backward(ready, 4096)
    inside, release = threading.Event(), threading.Event()
    calls = []
    original = program_mod._compile

    def gated(plan, *rest):
        calls.append(plan)
        if plan is slow:
            inside.set()
            release.wait(timeout=30)
        return original(plan, *rest)

    monkeypatch.setattr(program_mod, "_compile", gated)
    results = []
    threads = [threading.Thread(target=lambda: results.append(program_mod.compile_backward(slow, 4096)))
               for _ in range(3)]
    for t in threads:
        t.start()
    assert inside.wait(timeout=30)
    assert program_mod.compile_backward(ready, 4096) is cached      # not held up by the compile under way
    release.set()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 3 and all(r is results[0] for r in results)
    assert [p for p in calls if p is slow] == [slow]                 # compiled once for the three
