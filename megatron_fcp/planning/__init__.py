"""The pure planning half of FCP: topology + CP group -> verified plan, and its predicted cost.

No ``torch`` and no processes: everything here is plain data and numpy, tested without a cluster.
Modules depend on each other in one direction only (a test checks there is no import cycle)::

    blocks      Block, Transfer, PlanError: the units a plan moves
    needs       the causal need rule (which blocks a CP rank must receive)
    placement   packed batches: documents as token spans per rank, document need sets, place_packed
    verify      prove a plan executable and complete
    table       TransferTable: a plan's transfers as numpy columns (large groups)
    table_verify, table_compile
                prove a table-backed plan; the compiler's waves and rail graphs as columns
    plan        the plan contract: Plan (+ ring_plan, full_plan)            <- the executor reads this
    graph       CommGraph and multicast-tree helpers over one CP group
    builders    graph builders and the one registry of graph names
    compile     CommGraph -> multicast trees -> rounds -> Plan
    cost        the alpha-beta cost model of a plan (communication, compute, overlap)
    build       build_plan: topology + graph name (or auto, chosen on the cost model) -> Plan
    baselines   Transformer Engine's p2p and a2a+p2p schedules, the lower bound
    packed_cost TE's schedules on packed documents (THD, padded), backward of TE and FCP schedules
    rounds      rounds vs the edge-colouring bound Delta; one-hop transfers in Delta rounds
    head_parallel, head_parallel_compile, head_parallel_cost, head_parallel_choose
                the head-parallel stage: contract, plans for a degree, fwd/bwd cost, auto
    compare     FCP against TE's schedules side by side (one sequence, or packed documents)
    megatron_layout   Megatron's tp-cp-ep-dp-pp rank order: the CP and TP groups of a run
"""

from megatron_fcp.planning.baselines import lower_bound, simulate_te_a2a_p2p, simulate_te_p2p
from megatron_fcp.planning.blocks import Block, PlanError, Transfer, blocks_of, zigzag_chunk_index
from megatron_fcp.planning.build import build_plan
from megatron_fcp.planning.builders import (
    AUTO_CANDIDATES,
    BUILDERS,
    GRAPH_CHOICES,
    BalancedGraph,
    FullGraph,
    GraphBuilder,
    HierarchicalGraph,
    LeaderGraph,
    RingGraph,
    SpanningGraph,
    build_graph,
    get_builder,
)
from megatron_fcp.planning.compare import compare, compare_head_parallel, compare_packed
from megatron_fcp.planning.head_parallel import HeadParallelPlan
from megatron_fcp.planning.head_parallel_choose import (ScheduleChoice, build_head_parallel_plan, choose_head_parallel,
                                                        choose_schedule)
from megatron_fcp.planning.head_parallel_cost import lower_bound_all, simulate_head_parallel, simulate_te
from megatron_fcp.planning.rounds import plan_delta
from megatron_fcp.planning.table import TransferTable
from megatron_fcp.planning.compile import compile_plan
from megatron_fcp.planning.cost import (
    AttentionShape,
    ComputeModel,
    SimResult,
    causal_pairs,
    kv_block_bytes,
    parse_tokens,
    pick_best,
    simulate_plan,
    simulate_rounds,
    zigzag_padded_len,
)
from megatron_fcp.planning.graph import CommGraph, check_cp_ranks, runs_of, steiner_tree
from megatron_fcp.planning.megatron_layout import MegatronLayout
from megatron_fcp.planning.needs import need_set, needs_chunk
from megatron_fcp.planning.packed_cost import (
    simulate_plan_backward,
    simulate_te_a2a_p2p_thd,
    simulate_te_p2p_thd,
    thd_padded_lengths,
    thd_rank_work,
)
from megatron_fcp.planning.placement import Placement, Span, lognormal_lengths, place_packed
from megatron_fcp.planning.plan import SIMPLE_PLANS, AutoChoice, Plan, full_plan, ring_plan
from megatron_fcp.planning.program import WaveBackward

__all__ = [
    "AUTO_CANDIDATES", "BUILDERS", "GRAPH_CHOICES", "SIMPLE_PLANS", "AttentionShape", "AutoChoice",
    "BalancedGraph", "Block", "CommGraph", "ComputeModel", "FullGraph", "GraphBuilder", "HierarchicalGraph",
    "LeaderGraph", "MegatronLayout", "Plan", "PlanError", "RingGraph", "SimResult", "SpanningGraph",
    "Transfer", "TransferTable", "blocks_of", "build_graph", "build_plan", "check_cp_ranks", "compare", "compile_plan",
    "full_plan", "get_builder", "need_set", "needs_chunk", "parse_tokens", "ring_plan", "simulate_plan",
    "zigzag_chunk_index", "lower_bound", "simulate_te_a2a_p2p", "simulate_te_p2p", "causal_pairs",
    "Placement", "Span", "place_packed", "lognormal_lengths", "compare_packed", "simulate_plan_backward",
    "simulate_te_p2p_thd", "simulate_te_a2a_p2p_thd", "HeadParallelPlan", "build_head_parallel_plan",
    "choose_head_parallel", "compare_head_parallel", "lower_bound_all", "simulate_head_parallel", "simulate_te",
    "plan_delta", "ScheduleChoice", "choose_schedule", "WaveBackward", "thd_padded_lengths", "thd_rank_work", "kv_block_bytes", "pick_best", "simulate_rounds", "zigzag_padded_len", "runs_of", "steiner_tree",
]
