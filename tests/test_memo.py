"""Note [Caches live with their object] (megatron_fcp.memo): what the planner derives from a plan is
freed with the plan, found again while it lives, and not pickled."""

from __future__ import annotations

import gc
import pickle
import weakref

from megatron_fcp.contract.placement import lognormal_lengths
from megatron_fcp.cost.head_parallel_packed import PackedAsRun, priced_stage_plan
from megatron_fcp.cost.model import AttentionShape
from megatron_fcp.memo import MEMO_ATTR, memo
from megatron_fcp.planner.head_parallel import packed_degree_plan
from megatron_fcp.planner.packed_choice import choose_packed_plan
from megatron_fcp.schedule.program import compile_backward, compiled_programs
from megatron_fcp.topology import load_topology

SHAPE = AttentionShape(1, heads=8, kv_heads=4, head_dim=16, dtype_bytes=2)


def _lengths(seed: int) -> list[int]:
    return lognormal_lengths(6.0, 1.0, 16 * 1024, seed=seed)


def test_a_plans_answers_are_found_again_and_freed_with_it():
    topo = load_topology("dgx-h100:2")
    hp = packed_degree_plan(topo, range(16), _lengths(0), SHAPE, 2, graph="auto")
    run = PackedAsRun(hp, topo, SHAPE)
    run.result()
    stage = priced_stage_plan(hp, topo)
    assert priced_stage_plan(hp, topo) is stage                   # found again on the same object
    program = compile_backward(stage, SHAPE.kv_bytes(1))
    assert compile_backward(stage, SHAPE.kv_bytes(1)) is program
    assert compiled_programs(stage)[-1] is program                # the pricing compiled its own first
    assert memo(stage) and memo(hp)                               # kept on the objects themselves
    refs = [weakref.ref(x) for x in (hp, stage, program)]
    del hp, run, stage, program
    gc.collect()
    assert [r() for r in refs] == [None, None, None]              # a program refers to its plan: a cycle, freed


def test_planning_many_batches_keeps_no_earlier_batch():
    """Each batch's plans and programs are gone once the caller drops them (before 2026-12-07 module
    caches kept 256-1,024 plans' answers: ~50 MB a batch at cp = 256)."""
    topo = load_topology("dgx-h100:2")
    refs = []
    for seed in range(4):
        plans: dict = {}
        choose_packed_plan(topo, range(16), _lengths(seed), SHAPE, graph="auto", plans=plans)
        assert plans
        refs += [weakref.ref(p) for p in plans.values()]
        del plans
    gc.collect()
    assert all(r() is None for r in refs)


def test_pickling_drops_the_memo():
    topo = load_topology("dgx-h100:2")
    hp = packed_degree_plan(topo, range(16), _lengths(1), SHAPE, 2, graph="auto")
    PackedAsRun(hp, topo, SHAPE).result()
    stage = priced_stage_plan(hp, topo)
    compile_backward(stage, SHAPE.kv_bytes(1))
    assert MEMO_ATTR in hp.__dict__ and MEMO_ATTR in stage.__dict__
    hp2, stage2 = pickle.loads(pickle.dumps(hp)), pickle.loads(pickle.dumps(stage))
    assert MEMO_ATTR not in hp2.__dict__ and MEMO_ATTR not in stage2.__dict__
    assert hp2 == hp and stage2 == stage                          # the memo is not part of equality
    assert compiled_programs(stage2) == ()
