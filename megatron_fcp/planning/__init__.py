"""The public face of FCP's pure half: the names a user plans with, resolved on first use.

The code lives in sub-packages by job (none imports ``torch``)::

    megatron_fcp.contract   blocks, need rules, placements, the Plan and its proofs
    megatron_fcp.planner    graph builders, compile to rounds, Megatron's rank layout, head-parallel plans
    megatron_fcp.schedule   the backward program: every backward decision, made once
    megatron_fcp.cost       the cost model: plans' and programs' timelines, TE's schedules, the choice

``from megatron_fcp.planning import build_plan, Plan, simulate_plan`` keeps working; importing this
package imports nothing until a name is used.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Block": "megatron_fcp.contract.blocks",
    "PlanError": "megatron_fcp.contract.blocks",
    "Transfer": "megatron_fcp.contract.blocks",
    "blocks_of": "megatron_fcp.contract.blocks",
    "zigzag_chunk_index": "megatron_fcp.contract.blocks",
    "HeadParallelPlan": "megatron_fcp.contract.head_parallel",
    "need_set": "megatron_fcp.contract.needs",
    "needs_chunk": "megatron_fcp.contract.needs",
    "Placement": "megatron_fcp.contract.placement",
    "Span": "megatron_fcp.contract.placement",
    "lognormal_lengths": "megatron_fcp.contract.placement",
    "place_packed": "megatron_fcp.contract.placement",
    "place_packed_layer": "megatron_fcp.contract.layer_placement",
    "AutoChoice": "megatron_fcp.contract.plan",
    "Plan": "megatron_fcp.contract.plan",
    "SIMPLE_PLANS": "megatron_fcp.contract.plan",
    "full_plan": "megatron_fcp.contract.plan",
    "ring_plan": "megatron_fcp.contract.plan",
    "TransferTable": "megatron_fcp.contract.table",
    "ScheduleChoice": "megatron_fcp.planner.choose",
    "build_head_parallel_plan": "megatron_fcp.planner.choose",
    "choose_head_parallel": "megatron_fcp.planner.choose",
    "choose_schedule": "megatron_fcp.planner.choose",
    "compare": "megatron_fcp.planner.compare",
    "compare_head_parallel": "megatron_fcp.planner.compare",
    "compare_packed": "megatron_fcp.planner.compare",
    "lower_bound_all": "megatron_fcp.cost.head_parallel",
    "simulate_head_parallel": "megatron_fcp.cost.head_parallel",
    "simulate_te": "megatron_fcp.cost.head_parallel",
    "AttentionShape": "megatron_fcp.cost.model",
    "ComputeModel": "megatron_fcp.cost.model",
    "SimResult": "megatron_fcp.cost.model",
    "causal_pairs": "megatron_fcp.cost.model",
    "kv_block_bytes": "megatron_fcp.cost.model",
    "parse_tokens": "megatron_fcp.cost.model",
    "pick_best": "megatron_fcp.cost.model",
    "simulate_plan": "megatron_fcp.cost.model",
    "simulate_rounds": "megatron_fcp.cost.model",
    "zigzag_padded_len": "megatron_fcp.cost.model",
    "simulate_plan_backward": "megatron_fcp.cost.backward",
    "simulate_te_a2a_p2p_thd": "megatron_fcp.cost.backward",
    "simulate_te_p2p_thd": "megatron_fcp.cost.backward",
    "thd_padded_lengths": "megatron_fcp.cost.backward",
    "thd_rank_work": "megatron_fcp.cost.backward",
    "lower_bound": "megatron_fcp.cost.te",
    "simulate_te_a2a_p2p": "megatron_fcp.cost.te",
    "simulate_te_p2p": "megatron_fcp.cost.te",
    "build_plan": "megatron_fcp.planner.build",
    "AUTO_CANDIDATES": "megatron_fcp.planner.builders",
    "BUILDERS": "megatron_fcp.planner.builders",
    "BalancedGraph": "megatron_fcp.planner.builders",
    "FullGraph": "megatron_fcp.planner.builders",
    "GRAPH_CHOICES": "megatron_fcp.planner.builders",
    "GraphBuilder": "megatron_fcp.planner.builders",
    "HierarchicalGraph": "megatron_fcp.planner.builders",
    "LeaderGraph": "megatron_fcp.planner.builders",
    "RingGraph": "megatron_fcp.planner.builders",
    "SpanningGraph": "megatron_fcp.planner.builders",
    "build_graph": "megatron_fcp.planner.builders",
    "get_builder": "megatron_fcp.planner.builders",
    "compile_plan": "megatron_fcp.planner.compile",
    "place_batch": "megatron_fcp.planner.placing",
    "CommGraph": "megatron_fcp.planner.graph",
    "check_cp_ranks": "megatron_fcp.planner.graph",
    "runs_of": "megatron_fcp.planner.graph",
    "steiner_tree": "megatron_fcp.planner.graph",
    "MegatronLayout": "megatron_fcp.planner.megatron_layout",
    "plan_delta": "megatron_fcp.planner.rounds",
    "WaveBackward": "megatron_fcp.schedule.program",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_fcp.planning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
