"""gc_paused as a decorator: the per-batch planning entry points run with the cyclic collector off
and give it back as they found it, on return and on raise (the context manager's own rules, nesting
and threads, are tested in test_shared_search.py)."""

from __future__ import annotations

import gc

import pytest

from megatron_fcp.contract.blocks import gc_paused


def test_the_collector_is_off_inside_and_restored_after():
    seen = []

    @gc_paused()
    def inner():
        seen.append(gc.isenabled())
        return 7

    @gc_paused()
    def outer():
        seen.append(gc.isenabled())
        out = inner()
        seen.append(gc.isenabled())      # the inner call leaves it to the outermost
        return out

    assert gc.isenabled()
    assert outer() == 7 and seen == [False, False, False] and gc.isenabled()


def test_restored_when_the_call_raises():
    @gc_paused()
    def bad():
        raise ValueError("no")

    assert gc.isenabled()
    with pytest.raises(ValueError, match="no"):
        bad()
    assert gc.isenabled()


def test_a_caller_that_turned_it_off_keeps_it_off():
    @gc_paused()
    def f():
        return gc.isenabled()

    gc.disable()
    try:
        assert f() is False and not gc.isenabled()
    finally:
        gc.enable()


def test_the_planning_entry_points_pause_it(monkeypatch):
    """What the runtime calls per batch (placement, plan, degree choice, backward program) runs with
    the collector off: the functions they call see it off, and it is on again afterwards."""
    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.cost.model import AttentionShape
    from megatron_fcp.planner import build, head_parallel, placing
    from megatron_fcp.schedule import program

    seen: dict[str, list[bool]] = {}

    def record(module, name):
        original = getattr(module, name)

        def spy(*args, **kwargs):
            seen.setdefault(name, []).append(gc.isenabled())
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)

    record(placing, "place_balanced")        # inside place_batch
    record(build, "compile_plan")            # inside build_plan
    record(program, "plan_waves")            # inside compile_backward
    from megatron_fcp.cost import head_parallel_packed
    record(head_parallel_packed, "simulate_backward_waves")   # the degree choice's pricing
    lengths = lognormal_lengths(7.0, 1.0, 8 * 2048, 0)
    shape = AttentionShape(1, heads=8, kv_heads=2, head_dim=32, dtype_bytes=2)
    pl = placing.place_batch("dgx-h100:1", range(8), lengths)
    plan = build.build_plan("dgx-h100:1", range(8), "auto", placement=pl)
    program.compile_backward(plan, shape.kv_bytes(1))
    degree, priced = head_parallel.choose_packed_head_parallel("dgx-h100:1", range(8), lengths, shape, graph="auto")
    assert degree in priced and gc.isenabled()
    assert set(seen) == {"place_balanced", "compile_plan", "plan_waves", "simulate_backward_waves"}
    assert not any(v for calls in seen.values() for v in calls)
