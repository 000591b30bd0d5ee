"""From Megatron's process groups to one verified FCP plan per CP group, settled before training.

Megatron's rank layout (``tp-cp-ep-dp-pp``) is :class:`megatron_fcp.planning.MegatronLayout`; see
its Note [Megatron's rank order and CP groups].

Settling
--------
:func:`setup_fcp` runs on every rank after ``parallel_state.initialize_model_parallel`` and
before the model is built. It reads the layout from ``parallel_state``, validates it against the
topology (clear errors before any communication), builds and verifies the plan of **every** CP
group (pure, identical on all ranks, so any communicator a plan needs is created in the same
order everywhere) and keeps them in a :class:`FCPRuntime`. The attention looks plans up by CP
group; a group that was not settled (the groups were re-created after setup) raises
:class:`FCPStateError` instead of running with a stale plan. Which head-parallel degree, graph and
block size they run is the planner's choice (:mod:`megatron_fcp.patches.schedule`, Note [The
runtime runs the planner's choice]).

Note [Head-parallel degree of a packed batch]
---------------------------------------------
Under ``--fcp-head-parallel auto`` a run without a settled schedule (packed runs: no sequence
length at setup) lets each packed batch choose its degree: the candidates are the degrees whose
head groups fit inside nodes and split the heads per tensor-parallel rank
(:func:`~megatron_fcp.contract.head_parallel.head_parallel_degrees`, CP group 0), and a batch runs
the one of least predicted forward + backward time for its documents
(:func:`~megatron_fcp.planner.head_parallel.choose_packed_head_parallel` inside
:func:`~megatron_fcp.planner.packed_choice.choose_packed_plan`, the configured graph,
``--fcp-packed-balance``, and the backward as it runs under ``--fcp-backward-kv`` and
``--fcp-kv-memory-budget``), and its layout by ``--fcp-packed-layout``: under ``auto`` FCP's
placement, or Transformer Engine's per-document zigzag, its backward on TE's ring, where TE's
schedule is predicted faster (:func:`~megatron_fcp.planner.packed_choice.choose_packed_plan`, Note [TE's layout
as a candidate]); the batch's placement, stage and causal plan follow the layout.
The choice is a pure function of the lengths, so every rank makes the same one; the per-batch
agreement compares the stage with the placement. The layout (``shard_packed_batch``, RoPE) and
every layer follow the batch's degree (:meth:`FCPRuntime.packed_degree`); the process groups of
every candidate are created at setup. The choice compiles every degree's stage; the chosen one,
where it is what :meth:`FCPRuntime.packed_head_parallel` would compile (the runtime's head groups,
head size and dtype), is the one the batch runs, with its placement: it is not compiled twice. An
explicit degree runs on every batch.

Note [Planning a packed batch ahead]
------------------------------------
A packed batch's plans are per batch (its documents decide them) and take 0.16-0.7 s at cp = 64 and
1.3-10 s at cp = 256 to make (docs/planner.md, "Per-batch planning, fourth pass"); made when the
batch reaches :func:`~megatron_fcp.patches.packed.shard_packed_batch`, they stall the step.
:meth:`FCPRuntime.prefetch_packed` (through
:func:`~megatron_fcp.patches.packed.prefetch_packed_batch`) makes them for a batch the data loader
will hand over later, in one background thread, while the current step runs: the degree choice,
the placement, and the plan of every mask the model has (with a head-parallel stage, the stage).
It runs the very methods the step would call, on a copy of the runtime whose packed cache is its
own (so nothing is shared while it runs), compiles the backward programs the executor will ask
for those plans on this rank (``compile_backward`` caches them per plan object and compiles
outside its lock, so the step's own lookups never wait on it), and hands back that cache: the first lookup of the
batch (:meth:`FCPRuntime.packed_degree` and the others) takes those entries, waiting for them if
planning is still under way, and re-raises any error planning raised, where planning on the spot
would have raised it. So the plans are the same objects' equals either way (tested), and every
rank still agrees on them once per micro-batch. A thread shares the interpreter: it gains what the
step spends outside Python (CUDA kernels, NCCL and gloo waits release the GIL), and while it
plans the cyclic collector is paused for the whole process (``gc_paused`` is process-wide).
Bad input (lengths, a group not in the layout) is refused by the call, before anything runs.

Note [Per-layer plans]
----------------------
A model may mix masks: ``window_size`` with ``window_attn_skip_freq`` gives sliding-window layers
between full-attention ones (gpt-oss, Gemma 2/3), by megatron-core's own rule
(:func:`~megatron_fcp.patches.te_spec.layer_window`). Each distinct mask gets its own plan:

* full-attention layers run the settled schedule (head-parallel degree, graph, parts: the planner's
  choice of Note [The runtime runs the planner's choice]);
* a windowed layer runs a plan built under its window (``build_plan(..., window=, seq_len=)``), which
  moves each block only to the ranks whose window reaches it: with a window shorter than a zigzag
  chunk that is a halo of neighbour blocks, and a rank whose window lies inside its own shard
  receives nothing. Its schedule (graph and parts per chunk) is the planner's choice for that
  window, settled at setup as the full layers' is (``settle_schedule(..., window=)``: every graph
  and block size priced forward + backward under the window's need sets and work), and it runs
  **without** the head-parallel stage: the stage's all-to-all moves a (a-1)/a share of every
  token's Q, K, V and output, while a window's need is its halo, so the stage is not priced for
  windowed layers yet.

:func:`setup_fcp` builds the windowed plans of the model's windows (``windows=``, from the model
config by :func:`~megatron_fcp.patches.megatron` at model build) at the settled length with the
full-attention plan, and the setup agreement compares them all. The layer report says which layer
runs which plan (``window`` and ``plan`` per layer). Packed batches are laid out once per
micro-batch (one placement for every layer); a windowed layer's plan is over that same placement
with the window's need sets.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_fcp.attention.agreement import AgreementCache, LastAgreed, agree
from megatron_fcp.attention.stats import FCPStats
from megatron_fcp.config import FCPConfig
from megatron_fcp.contract.blocks import PlanError
from megatron_fcp.contract.head_parallel import (
    HeadParallelPlan,
    check_head_parallel,
    group_placement,
    head_groups_for,
    head_parallel_degrees,
    relabel_plan,
)
from megatron_fcp.contract.head_parallel_packed import PackedHeadParallelPlan
from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.placement import DEFAULT_BLOCK_TOKENS, Placement, check_doc_lengths
from megatron_fcp.planner.placing import LayoutGraphs, layout_graphs, place_batch, place_batch_groups
from megatron_fcp.contract.plan import Plan
from megatron_fcp.cost.model import AttentionShape
from megatron_fcp.patches.schedule import schedule_report, search_share, settle_schedule
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.choose import ScheduleChoice
from megatron_fcp.planner.head_parallel import compile_head_parallel, compile_packed_head_parallel
from megatron_fcp.planner.packed_choice import PackedChoice, choose_packed_plan
from megatron_fcp.planner.megatron_layout import MegatronLayout
from megatron_fcp.schedule.program import BackwardPolicy, compile_backward
from megatron_fcp.topology import TopologyError, load_topology

__all__ = [
    "FCPStateError",
    "layout_from_parallel_state",
    "FCPRuntime",
    "resolve_topology",
    "build_group_plan",
    "group_head_parallel_plan",
    "rank_map_table",
    "setup_fcp",
    "setup_fingerprint",
    "current_runtime",
    "reset_fcp",
]

logger = logging.getLogger("megatron_fcp.runtime")

PACKED_CACHE_ENTRIES = 64
PREFETCH_ENTRIES = 8
"""Packed batches planned ahead and not yet looked up that :meth:`FCPRuntime.prefetch_packed`
keeps (a loader prefetches one or two); past it the oldest is dropped (cancelled if not started)."""
"""Placements and plans of packed batches kept per process (least recently used dropped first)."""


class FCPStateError(RuntimeError):
    """FCP was set up in the wrong order (see docs/megatron.md, "Order of setup")."""


# ---- layout --------------------------------------------------------------------------------------
def layout_from_parallel_state() -> MegatronLayout:
    """The layout of an initialised megatron-core ``parallel_state`` (checked against its CP group)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    if not ps.model_parallel_is_initialized():
        raise FCPStateError(
            "megatron parallel_state is not initialised: call "
            "parallel_state.initialize_model_parallel(...) before setup_fcp()"
        )
    layout = MegatronLayout(
        world=dist.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
    )
    mine = tuple(ps.get_context_parallel_global_ranks())
    expected = layout.cp_group_of(dist.get_rank())
    if mine != expected:
        raise FCPStateError(
            f"parallel_state's CP group {list(mine)} differs from the tp-cp-ep-dp-pp layout's "
            f"{list(expected)}; megatron_fcp supports Megatron's default rank order only"
        )
    return layout


# ---- topology and plans ----------------------------------------------------------------------------
def resolve_topology(spec: str, world: int):
    """Load the topology named by ``spec`` (``--fcp-topology``) and check it covers ``world`` ranks.

    ``auto``: :func:`megatron_fcp.topology.detect.detect_topology` from the ranks' hostnames
    (collective: every rank must call it) or ``LOCAL_WORLD_SIZE`` before the group exists.
    """
    try:
        if spec == "auto":
            topology = _auto_topology(world)
        else:
            topology = load_topology(spec)
    except TopologyError as exc:
        raise ValueError(f"--fcp-topology {spec!r}: {exc}") from exc
    if topology.world < world:
        raise ValueError(
            f"topology {topology.name!r} describes {topology.world} ranks but the job has {world}: "
            "give --fcp-topology a cluster with at least as many GPUs (e.g. PRESET:NODES with more "
            "nodes) or run fewer processes"
        )
    if topology.world > world:
        logger.info("topology %s has %d ranks; this job uses the first %d", topology.name, topology.world, world)
    return topology


def _auto_topology(world: int):
    """Detect: nodes from the hostnames of all ranks (one ``all_gather_object`` when the default
    group exists, else ``LOCAL_WORLD_SIZE``), links from ``nvidia-smi topo -m`` when CUDA is up."""
    from megatron_fcp.topology import detect  # noqa: PLC0415 - only a run that asks for detection reads machines
    probe = torch.cuda.is_available()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world:
        return detect.detect_topology(hosts=detect.gather_host_info(), probe=probe)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    if local < 1 or world % local:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world}")
    return detect.detect_topology(nodes=world // local, gpus_per_node=local, probe=probe)


def build_group_plan(
    config: FCPConfig,
    topology: Any,
    cp_ranks: tuple[int, ...],
    *,
    causal: bool = True,
    parts_per_chunk: int = 1,
    seq_len: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype_bytes: int = 2,
    placement: Placement | None = None,
    window: tuple[int, int] | None = None,
    graph: str | None = None,
    backward_graph: str | None = None,
) -> Plan:
    """Build the plan of one CP group with the configured graph (``graph``: another; verified as it
    is built); ``placement``: a packed batch's placement instead of Megatron's zigzag split;
    ``window``: a sliding window (Megatron's ``(left, right)``): the plan moves each block only to
    the ranks whose window reaches it (a zigzag plan then needs ``seq_len``, the padded global
    sequence); ``backward_graph``: the graph the backward walks (None: the forward's; Note [A
    backward on another graph] in :mod:`megatron_fcp.contract.plan`)."""
    extra = {} if window is None else {"window": tuple(window)}
    plan = build_plan(
        topology, tuple(cp_ranks), graph or config.graph, causal=causal, parts_per_chunk=parts_per_chunk,
        seq_len=seq_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
        placement=placement, backward_graph=backward_graph, **extra,
    )
    if tuple(plan.ranks) != tuple(cp_ranks):
        raise PlanError(f"planner returned ranks {list(plan.ranks)} for CP group {list(cp_ranks)}")
    return plan


def group_head_parallel_plan(config: FCPConfig, topology: Any, cp_ranks: tuple[int, ...], degree: int, seq_len: int,
                             *, causal: bool = True, heads: int, kv_heads: int, head_dim: int | None = None,
                             dtype_bytes: int = 2, graph: str | None = None, stagger: int = 1) -> HeadParallelPlan:
    """The head-parallel plan of one CP group (Note [Head-parallel stage] in
    :mod:`megatron_fcp.contract.head_parallel`): the planner's head groups
    (:func:`~megatron_fcp.planner.head_parallel.head_groups_for`) and the KV stage's plan over the group
    placement of ``seq_len`` tokens on virtual ranks (every stage runs the same schedule).
    ``graph`` (default: the configured one): a builder name compiles the stage as the planner
    does (:func:`~megatron_fcp.planner.head_parallel.compile_head_parallel`, chunks
    ``stagger``-ed), so the runtime runs the plan the planner timed; ``"auto"`` lets
    :func:`~megatron_fcp.planning.build_plan` pick the graph over member 0's stage ranks.
    ``heads`` / ``kv_heads``: this rank's (per tensor-parallel partition)."""
    cp_ranks = tuple(cp_ranks)
    rep = check_head_parallel(heads, kv_heads, degree, len(cp_ranks))
    groups = head_groups_for(topology, cp_ranks, degree)
    graph = graph or config.graph
    if degree > 1 and graph != "auto":
        shape = AttentionShape(seq_len, heads, kv_heads, head_dim or 1, dtype_bytes)
        return compile_head_parallel(topology, cp_ranks, shape, degree, graph, causal=causal, head_groups=groups,
                                     stagger=stagger)
    kv_plan = None
    if len(groups) > 1:
        placement = group_placement(cp_ranks, groups, seq_len, causal)
        stage = tuple(g[0] for g in groups)
        plan = build_group_plan(config, topology, stage, causal=causal, seq_len=seq_len, heads=heads // degree,
                                kv_heads=kv_heads * rep // degree, head_dim=head_dim, dtype_bytes=dtype_bytes,
                                placement=placement)
        kv_plan = relabel_plan(plan, range(len(groups)))
    return HeadParallelPlan(cp_ranks, degree, groups, kv_plan, rep)


def rank_map_table(layout: MegatronLayout, topology: Any) -> str:
    """Per CP group: CP rank -> global rank -> (node, local rank) on ``topology``."""
    lines = [f"megatron layout world={layout.world} tp={layout.tp} pp={layout.pp} cp={layout.cp} "
             f"dp={layout.dp} on {topology.name} ({topology.world} ranks)"]
    for i, group in enumerate(layout.cp_groups()):
        cells = [f"cp{c}=r{r}(n{topology.node_of(r)}.{topology.local_rank_of(r)})" for c, r in enumerate(group)]
        nodes = sorted({topology.node_of(r) for r in group})
        lines.append(f"  CP group {i}: " + " ".join(cells) + f"  nodes {nodes}")
    return "\n".join(lines)


# ---- runtime -------------------------------------------------------------------------------------
@dataclass
class FCPRuntime:
    """What :func:`setup_fcp` settled: config, layout, topology and verified plans per CP group."""

    config: FCPConfig
    layout: MegatronLayout
    topology: Any
    seq_len: int | None
    plan_args: dict = field(default_factory=dict)
    plans: dict[tuple[tuple[int, ...], bool, int], Plan] = field(default_factory=dict)
    windows: tuple[tuple[int, int], ...] = ()  # the model's distinct sliding windows (setup_fcp)
    window_schedules: dict[tuple[int, int], ScheduleChoice | None] = field(default_factory=dict)  # settled per window
    window_plans: dict[tuple, Plan] = field(default_factory=dict)  # (ranks, causal, window, parts, seq_len) -> plan
    groups: dict[tuple[int, ...], Any] = field(default_factory=dict)  # CP ranks -> the group object
    transport_factory: Any = None  # group -> Transport per call; None = the backend's default
    transports: dict[int, Any] = field(default_factory=dict)  # id(group) -> default transport
    packed: OrderedDict = field(default_factory=OrderedDict)  # packed batches: key -> placement / plan
    agreement: AgreementCache = field(default_factory=AgreementCache)
    packed_epoch: int | None = None  # advanced once per micro-batch by shard_packed_batch
    record_stats: bool = False  # keep each layer's FCPStats of its latest call (layer_stats)
    stats: dict[int, FCPStats] = field(default_factory=dict)

    def layer_stats(self, layer_number: int) -> FCPStats | None:
        """A fresh :class:`FCPStats` for this layer's call when ``record_stats`` is on (it replaces
        the layer's previous call's), else None."""
        if not self.record_stats:
            return None
        self.stats[layer_number] = FCPStats()
        return self.stats[layer_number]
    plan_agreement: LastAgreed = field(default_factory=LastAgreed)  # zigzag: first use of a plan variant
    layer_report: dict[int, dict] = field(default_factory=dict)  # layer number -> what serves its attention
    hp_groups: dict[tuple[int, ...], Any] = field(default_factory=dict)  # CP ranks -> HeadParallelGroups
    hp_plans: dict[tuple, HeadParallelPlan] = field(default_factory=dict)
    hp_degree: int | None = None  # settled by setup_fcp (auto: the planner's choice)
    schedule: ScheduleChoice | None = None  # the planner's choice settled by setup_fcp (None: none made)
    micro_batch: int = 1  # sequences per attention call (prices --fcp-kv-memory-budget in bytes)
    #: --fcp-head-parallel auto without a settled schedule (packed runs): the degrees each packed batch
    #: chooses from (Note [Head-parallel degree of a packed batch]); () = the run's one degree
    packed_degrees: tuple[int, ...] = ()
    packed_shape: AttentionShape | None = None  # per tensor-parallel rank (heads known at setup); seq_len set per batch
    packed_hp_groups: dict[tuple, Any] = field(default_factory=dict)  # (CP ranks, degree) -> HeadParallelGroups
    #: batches planned ahead (Note [Planning a packed batch ahead]): (CP ranks, lengths, causal) -> the
    #: background planning's cache entries
    prefetches: dict[tuple, Future] = field(default_factory=dict)
    planner_thread: ThreadPoolExecutor | None = None  # created by the first prefetch_packed

    def head_parallel_degree(self) -> int:
        """The head-parallel degree of this run (``--fcp-head-parallel``, ``auto`` settled at setup;
        1: no stage)."""
        return self.hp_degree if self.hp_degree is not None else self.config.head_parallel_degree(self.layout.cp)

    def head_parallel(self, group: Any, *, causal: bool, s_local: int, heads: int, kv_heads: int,
                      window: tuple[int, int] | None = None):
        """``(HeadParallelPlan, HeadParallelGroups)`` of the live CP group ``group`` (registered by
        :meth:`plan_for_group`) for this call's shapes, or None without a head-parallel stage.
        Plans are built once per shape (pure); the groups were created at :func:`setup_fcp`.
        Windowed layers run without the stage (Note [Per-layer plans])."""
        from megatron_fcp.attention.head_parallel import HeadParallelGroups  # noqa: PLC0415

        degree = self.head_parallel_degree()
        if degree == 1 or window is not None:
            return None
        ranks = tuple(dist.get_process_group_ranks(group))
        key = (ranks, bool(causal), int(s_local), int(heads), int(kv_heads))
        if key not in self.hp_plans:
            self.hp_plans[key] = self._build_stage(ranks, degree, s_local * len(ranks), causal, heads, kv_heads)
        plan = self.hp_plans[key]
        groups = self.hp_groups.get(ranks) or HeadParallelGroups.of_cp_group(plan, group)
        if groups is None:
            raise FCPStateError(f"the head-parallel process groups of CP group {list(ranks)} were not created: "
                                "call setup_fcp() on every rank of the job (it creates them collectively)")
        return plan, groups

    def _build_stage(self, ranks: tuple[int, ...], degree: int, seq_len: int, causal: bool, heads: int,
                     kv_heads: int) -> HeadParallelPlan:
        """A CP group's head-parallel plan: with a settled schedule its graph and stagger, else the
        configured graph (Note [The runtime runs the planner's choice])."""
        c = self.schedule
        return group_head_parallel_plan(
            self.config, self.topology, ranks, degree, seq_len, causal=causal, heads=heads, kv_heads=kv_heads,
            head_dim=self.plan_args.get("head_dim"), dtype_bytes=self.plan_args.get("dtype_bytes", 2),
            graph=c.graph if c is not None else None, stagger=c.stagger if c is not None else 1)

    def report_layer(self, layer: int, fallback_reason: str | None = None, *, cp_group: Any = None,
                     window: tuple[int, int] | None = None) -> dict:
        """Record (and log at INFO, once per layer and state) what serves ``layer``'s CP attention:
        FCP with the settled plan of this rank's CP group for the layer's mask (``window``: its sliding
        window, Note [Per-layer plans]), or Megatron's own attention and why."""
        if fallback_reason is not None:
            entry = {"attention": "megatron", "reason": fallback_reason}
        else:
            plan = self._settled_plan_of(cp_group, window)
            entry = {"attention": "fcp", "graph": self.config.graph,
                     "window": None if window is None else list(window),
                     "plan": None if plan is None else plan.name,
                     "cp_ranks": None if plan is None else list(plan.ranks),
                     "rounds": None if plan is None else len(plan.rounds),
                     "head_parallel": self.head_parallel_degree() if window is None else 1}
            c = self.schedule if window is None else self.window_schedules.get(tuple(window))
            entry.update(schedule=None if c is None else c.label,
                         predicted_ms=None if c is None else round(c.total_s * 1e3, 4))
        if self.layer_report.get(layer) != entry:
            self.layer_report[layer] = entry
            if entry["attention"] == "fcp":
                logger.info("megatron_fcp: layer %d: FCP attention%s, plan %r (asked graph %r) over CP ranks %s, "
                            "%s rounds", layer, "" if window is None else f" with window {tuple(window)}",
                            entry["plan"], entry["graph"], entry["cp_ranks"], entry["rounds"])
            else:
                logger.warning("megatron_fcp: layer %d: Megatron's own attention (--fcp-fallback megatron): %s",
                               layer, fallback_reason)
        return entry

    def _settled_plan_of(self, cp_group: Any, window: tuple[int, int] | None = None) -> Plan | None:
        try:
            ranks = tuple(dist.get_process_group_ranks(cp_group))
        except Exception:  # noqa: BLE001 - no live group (hand-made layouts in tests): this rank's group
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            ranks = self.layout.cp_group_of(rank) if rank < self.layout.world else None
        if window is not None:
            return next((p for k, p in self.window_plans.items() if k[0] == ranks and k[1] and k[2] == tuple(window)),
                        None)
        return next((p for (r, c, _), p in self.plans.items() if r == ranks and c), None)

    # ---- packed batches (THD): one placement and plan per document-length list, cached --------------
    def prefetch_packed(self, cp_ranks: tuple[int, ...] | None, doc_lengths: tuple[int, ...], *,
                        causal: bool = True, rank: int | None = None) -> Future:
        """Start planning packed batch ``doc_lengths`` of CP group ``cp_ranks`` in the background
        (Note [Planning a packed batch ahead]): its degree, placement, the plans of every mask of
        the model (the stage's too, for the run's heads) and ``rank``'s backward programs
        (:meth:`packed_programs`; ``rank`` default: torch.distributed's). Returns the planning's
        future (its result is the cache entries). Checks the lengths and the group now, before
        anything runs; a batch already planned or under way is not planned again. ``cp_ranks``
        None: this rank's CP group."""
        cp_ranks = tuple(int(r) for r in (self._own_cp_group() if cp_ranks is None else cp_ranks))
        lengths = tuple(int(x) for x in doc_lengths)
        check_doc_lengths(lengths)
        if cp_ranks not in self.layout.cp_groups():
            raise FCPStateError(f"prefetch_packed: CP group {list(cp_ranks)} is not a CP group of this run's layout "
                                f"({self.layout.cp_groups()[:2]}...); pass the ranks of this rank's CP group")
        key = (cp_ranks, lengths, bool(causal))
        got = self.prefetches.get(key)
        if got is None:
            if self.planner_thread is None:
                self.planner_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fcp-plan-ahead")
            ahead = dataclasses.replace(self, packed=OrderedDict(), prefetches={}, planner_thread=None)
            got = self.prefetches[key] = self.planner_thread.submit(_plan_ahead, ahead, *key, rank)
            while len(self.prefetches) > PREFETCH_ENTRIES:    # batches planned but never used: drop the oldest
                self.prefetches.pop(next(iter(self.prefetches))).cancel()
        return got

    def packed_programs(self, cp_ranks: tuple[int, ...], doc_lengths: tuple[int, ...], *, causal: bool = True,
                        rank: int | None = None) -> list:
        """The plans a step runs for packed batch ``doc_lengths`` (every mask's; with a head-parallel
        stage, the stage for the run's heads) and the backward programs global ``rank``'s executor
        compiles for them (its K|V bytes, ``--fcp-backward-kv``, ``--fcp-kv-memory-budget``;
        ``compile_backward`` caches them per plan object, so the executor finds them compiled).
        ``rank`` default: torch.distributed's; without it the stage's program (per head shard) is
        left to the first call, and without the head counts of ``setup_fcp`` every program (and
        the stage). Returns the programs."""
        shape = self.packed_shape
        if rank is None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
        policy = BackwardPolicy(self.config.backward_kv, self.config.kv_memory_budget)
        degree = self.packed_degree(cp_ranks, doc_lengths, causal=causal)
        programs = []
        if degree > 1 and shape is not None:
            hp = self.packed_head_parallel(cp_ranks, doc_lengths, causal=causal, heads=shape.heads,
                                           kv_heads=shape.kv_heads)
            if hp.kv_plan is not None and rank in hp.ranks:   # this rank's KV stage: h_kv * rep / a heads
                stage = dataclasses.replace(shape, kv_heads=shape.kv_heads * hp.kv_replication // degree)
                programs.append(compile_backward(hp.kv_plan_for(hp.position(rank)[1]), stage.kv_bytes(1), policy))
        for window in ((None,) if degree == 1 else ()) + tuple(self.windows):
            plan = self.packed_plan(cp_ranks, doc_lengths, causal=causal, window=window)
            if shape is not None:
                programs.append(compile_backward(plan, shape.kv_bytes(1), policy))
        return programs

    def _own_cp_group(self) -> tuple[int, ...]:
        """This rank's CP group in the layout (rank 0's without torch.distributed)."""
        return self.layout.cp_group_of(dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)

    def _take_prefetched(self, cp_ranks: tuple[int, ...], doc_lengths: tuple[int, ...], causal: bool) -> None:
        """The entries a prefetch made for this batch, into the cache (waiting for them, and raising
        what planning raised); nothing when the batch was not planned ahead."""
        if not self.prefetches:
            return
        done = self.prefetches.pop((tuple(cp_ranks), tuple(doc_lengths), bool(causal)), None)
        if done is not None:
            for key, value in done.result().items():
                if key not in self.packed:
                    self._remember(key, value)

    def packed_placement(self, doc_lengths: tuple[int, ...], *, causal: bool = True,
                         cp_ranks: tuple[int, ...] | None = None) -> Placement:
        """The placement of a packed batch over this run's CP size (deterministic, the same on every
        rank; cached by the lengths). Long documents are cut into ``--fcp-block-tokens`` blocks
        (0: :data:`~megatron_fcp.contract.placement.DEFAULT_BLOCK_TOKENS`). With a head-parallel
        stage (degree > 1) it is the member placement of CP group ``cp_ranks`` (default: this
        rank's): the documents placed over the head groups, each group's tokens split among its
        members (Note [Head-parallel stage on packed batches] in
        :mod:`megatron_fcp.contract.head_parallel_packed`), so data, RoPE and every layer follow it."""
        if cp_ranks is None:
            cp_ranks = self._own_cp_group()
        self._take_prefetched(cp_ranks, doc_lengths, causal)
        degree, layout = self.packed_choice(tuple(cp_ranks), doc_lengths, causal=causal)
        key = ("placement", tuple(doc_lengths), bool(causal), None if degree == 1 else tuple(cp_ranks), layout)
        if key not in self.packed:
            block = self.config.block_tokens or DEFAULT_BLOCK_TOKENS
            if degree == 1:
                placement = place_batch(self.topology, tuple(cp_ranks), doc_lengths, block_tokens=block, causal=causal,
                                        balance=self.config.packed_balance, layout=layout)
            else:
                groups = head_groups_for(self.topology, tuple(cp_ranks), degree)
                placement = place_batch_groups(self.topology, tuple(cp_ranks), groups, doc_lengths,
                                               block_tokens=block, causal=causal,
                                               balance=self.config.packed_balance, layout=layout)[1]
            self._remember(key, placement)
        self.packed.move_to_end(key)
        return self.packed[key]

    def packed_degree(self, cp_ranks: tuple[int, ...], doc_lengths: tuple[int, ...], *, causal: bool = True) -> int:
        """The head-parallel degree of a packed batch on CP group ``cp_ranks``
        (:meth:`packed_choice`'s)."""
        return self.packed_choice(cp_ranks, doc_lengths, causal=causal).degree

    def packed_choice(self, cp_ranks: tuple[int, ...], doc_lengths: tuple[int, ...], *,
                      causal: bool = True) -> PackedChoice:
        """The head-parallel degree and layout of a packed batch on CP group ``cp_ranks`` (cached): under
        ``--fcp-head-parallel auto`` the batch's own, by ``--fcp-packed-layout``
        (:func:`~megatron_fcp.planner.packed_choice.choose_packed_plan`; Note [Head-parallel degree
        of a packed batch]); with one degree (explicit or the only one that fits) that degree, in
        FCP's layout unless ``--fcp-packed-layout thd`` (nothing is priced per batch)."""
        forced = self.config.packed_layout
        if self.layout.cp == 1:
            return PackedChoice(1, "fcp")
        if not self.packed_degrees:
            return PackedChoice(self.head_parallel_degree(), "thd" if forced == "thd" else "fcp")
        self._take_prefetched(cp_ranks, doc_lengths, causal)
        key = ("choice", tuple(cp_ranks), tuple(doc_lengths), bool(causal))
        if key not in self.packed:
            shape = dataclasses.replace(self.packed_shape, seq_len=sum(doc_lengths))
            compiled: dict = {}
            best, _ = choose_packed_plan(self.topology, tuple(cp_ranks), tuple(doc_lengths), shape,
                                         layout=forced, degrees=self.packed_degrees, graph=self.config.graph,
                                         causal=causal, block_tokens=self.config.block_tokens or DEFAULT_BLOCK_TOKENS,
                                         plans=compiled, placement_balance=self.config.packed_balance,
                                         backward_kv=self.config.backward_kv,
                                         kv_memory_budget=self.config.kv_memory_budget)
            self._remember(key, best)
            hp = compiled.get(best)
            if best.degree > 1 and self._compiles_as_runtime(hp, tuple(cp_ranks), shape):
                # the chosen stage, compiled as packed_head_parallel would: the batch runs it as it is
                self._remember(("hp", tuple(cp_ranks), tuple(doc_lengths), bool(causal), shape.heads,
                                shape.kv_heads), hp)
                self._remember(("placement", tuple(doc_lengths), bool(causal), tuple(cp_ranks), best.layout),
                               hp.placement)
        self.packed.move_to_end(key)
        return self.packed[key]

    def _compiles_as_runtime(self, hp: Any, cp_ranks: tuple[int, ...], shape: AttentionShape) -> bool:
        """Whether the degree choice's plan ``hp`` is the one :meth:`packed_head_parallel` would
        compile for ``shape``'s heads: the runtime's head groups, head size and dtype."""
        return (isinstance(hp, PackedHeadParallelPlan)
                and self.plan_args.get("head_dim") == shape.head_dim
                and self.plan_args.get("dtype_bytes", 2) == shape.dtype_bytes
                and tuple(map(tuple, hp.head_groups)) == tuple(map(tuple, head_groups_for(self.topology, cp_ranks,
                                                                                             hp.degree))))

    def packed_groups(self, cp_ranks: tuple[int, ...], degree: int) -> Any:
        """This rank's head-parallel process groups of CP group ``cp_ranks`` at ``degree`` (created at
        setup), or None (degree 1 or ``cp``: the CP group serves)."""
        found = self.packed_hp_groups.get((tuple(cp_ranks), degree))
        if found is None and degree == self.head_parallel_degree():
            found = self.hp_groups.get(tuple(cp_ranks))
        return found

    def packed_head_parallel(self, cp_ranks: tuple[int, ...], doc_lengths: tuple[int, ...], *, causal: bool,
                             heads: int, kv_heads: int) -> PackedHeadParallelPlan:
        """The head-parallel stage of CP group ``cp_ranks`` on a packed batch (degree > 1; cached by
        the lengths and head counts): the KV stage built with the configured graph over the group
        placement whose member split is :meth:`packed_placement` (checked)."""
        if tuple(cp_ranks) not in self.layout.cp_groups():
            raise FCPStateError(f"CP group {list(cp_ranks)} is not a CP group of this run's layout; call setup_fcp() again")
        self._take_prefetched(cp_ranks, doc_lengths, causal)
        key = ("hp", tuple(cp_ranks), tuple(doc_lengths), bool(causal), int(heads), int(kv_heads))
        if key not in self.packed:
            degree, layout = self.packed_choice(tuple(cp_ranks), doc_lengths, causal=causal)
            hp = compile_packed_head_parallel(
                self.topology, tuple(cp_ranks), doc_lengths, heads, kv_heads, degree, self.config.graph, causal=causal,
                head_groups=head_groups_for(self.topology, tuple(cp_ranks), degree),
                block_tokens=self.config.block_tokens or DEFAULT_BLOCK_TOKENS,
                head_dim=self.plan_args.get("head_dim"), dtype_bytes=self.plan_args.get("dtype_bytes", 2),
                placement_balance=self.config.packed_balance, layout=layout)
            if hp.placement != self.packed_placement(doc_lengths, causal=causal, cp_ranks=tuple(cp_ranks)):
                raise FCPStateError("the packed head-parallel plan's member placement differs from the batch's layout")
            self._remember(key, hp)
        self.packed.move_to_end(key)
        return self.packed[key]

    def packed_plan(self, cp_ranks: tuple[int, ...], doc_lengths: tuple[int, ...], *, causal: bool = True,
                    window: tuple[int, int] | None = None) -> Plan:
        """The verified plan of CP group ``cp_ranks`` for a packed batch (cached by the lengths and the
        layer's mask). Every layer's plan is over the batch's one placement (the tokens are laid out
        once per micro-batch, by :meth:`packed_placement`); a windowed layer's plan moves only what
        its window needs over that same placement (Note [Per-layer plans])."""
        if tuple(cp_ranks) not in self.layout.cp_groups():
            raise FCPStateError(f"CP group {list(cp_ranks)} is not a CP group of this run's layout; call setup_fcp() again")
        window = None if window is None else tuple(window)
        self._take_prefetched(cp_ranks, doc_lengths, causal)
        key = ("plan", tuple(cp_ranks), tuple(doc_lengths), bool(causal), window)
        if key not in self.packed:
            placement = self.packed_placement(doc_lengths, causal=causal, cp_ranks=tuple(cp_ranks))
            graphs = LayoutGraphs(self.config.graph)
            if window is not None:  # the same blocks, need sets under the layer's window
                placement = dataclasses.replace(placement, window=window)
            else:                   # TE's layout: its backward on TE's ring (Note [TE's layout as a candidate])
                layout = self.packed_choice(tuple(cp_ranks), doc_lengths, causal=causal).layout
                graphs = layout_graphs(layout, self.config.graph)
            self._remember(key, build_group_plan(self.config, self.topology, tuple(cp_ranks), causal=causal,
                                                 placement=placement, graph=graphs.forward,
                                                 backward_graph=graphs.backward, **self.plan_args))
        self.packed.move_to_end(key)
        return self.packed[key]

    def _remember(self, key: tuple, value: Any) -> None:
        self.packed[key] = value
        while len(self.packed) > PACKED_CACHE_ENTRIES:
            self.packed.popitem(last=False)

    def parts_per_chunk(self, s_local: int) -> int:
        """Sub-blocks per zigzag chunk for a local sequence of ``s_local`` tokens (2 chunks).

        At the settled length with a settled schedule: the planner's choice (Note [The runtime
        runs the planner's choice]). Otherwise (no shapes at setup, or another length) the rule:
        ``--fcp-block-tokens 0`` (the default) means whole chunks, except where the backward may
        re-send KV (``--fcp-backward-kv`` auto or resend, cp > 2): there each chunk is cut in two,
        which balances the backward waves' work (Note [Backward waves]; in the cost model fwd+bwd
        goes from 1.33x to 1.07x one-pass keep on dgx-h100:2 at 128K, the forward unchanged). An odd
        chunk is cut into halves one token apart (Note [Sub-block sizes] in contract/blocks.py)."""
        c = self.schedule
        if c is not None and s_local * self.layout.cp == c.seq_len:
            return c.parts
        chunk = s_local // 2
        if (self.config.block_tokens == 0 and self.config.backward_kv != "keep" and self.layout.cp > 2
                and chunk >= 2):
            return 2
        return self.config.parts_per_chunk(chunk)

    def plan(self, cp_ranks: tuple[int, ...], *, causal: bool, parts_per_chunk: int = 1) -> Plan:
        """The settled plan; other (causal, parts) variants of a settled group are built once."""
        key = (tuple(cp_ranks), bool(causal), int(parts_per_chunk))
        if key not in self.plans:
            if tuple(cp_ranks) not in {k[0] for k in self.plans}:
                raise FCPStateError(
                    f"no FCP plan was settled for CP group {list(cp_ranks)}: call setup_fcp() after "
                    "initialize_model_parallel() and before building the model"
                )
            self.plans[key] = self._build(cp_ranks, causal, parts_per_chunk)
            logger.info("built FCP plan variant %s on first use", key)
        return self.plans[key]

    def window_plan(self, cp_ranks: tuple[int, ...], *, causal: bool, window: tuple[int, int], s_local: int) -> Plan:
        """The plan of a windowed layer (Note [Per-layer plans]): at the settled length the window's
        settled schedule (graph, parts), built at setup; other lengths once on first use with the
        configured graph and the parts rule (a window's need sets depend on the length)."""
        seq_len = s_local * len(cp_ranks)
        c = self.window_schedules.get(tuple(window))
        parts = c.parts if c is not None and seq_len == c.seq_len else self.parts_per_chunk(s_local)
        key = (tuple(cp_ranks), bool(causal), tuple(window), parts, seq_len)
        if key not in self.window_plans:
            if tuple(cp_ranks) not in {k[0] for k in self.plans}:
                raise FCPStateError(
                    f"no FCP plan was settled for CP group {list(cp_ranks)}: call setup_fcp() after "
                    "initialize_model_parallel() and before building the model"
                )
            self.window_plans[key] = self._build(cp_ranks, causal, parts, window=tuple(window), seq_len=seq_len)
            logger.info("built FCP plan for window %s (%d tokens) on first use", tuple(window), seq_len)
        return self.window_plans[key]

    def plan_for_group(self, group: Any, *, causal: bool, s_local: int, window: tuple[int, int] | None = None) -> Plan:
        """Plan of the live CP process group ``group``.

        Raises :class:`FCPStateError` when ``group`` was destroyed, or when Megatron's current CP
        group over the same ranks is a different (re-created) communicator: a model built before
        the groups changed must be rebuilt, never run on a stale plan or communicator.
        """
    
        try:
            ranks = tuple(dist.get_process_group_ranks(group))
        except (KeyError, RuntimeError, ValueError) as exc:
            raise FCPStateError(
                "this attention's CP process group was destroyed (destroy_model_parallel?); the CP "
                "groups were re-created after setup_fcp(): call setup_fcp() again and rebuild the model"
            ) from exc
        live = _megatron_cp_group()
        if live is not None and live is not group and tuple(dist.get_process_group_ranks(live)) == ranks:
            raise FCPStateError(
                f"CP group {list(ranks)} was re-created after this model was built; call setup_fcp() "
                "again and rebuild the model"
            )
        settled = self.groups.setdefault(ranks, group)  # first use registers a lazily settled group
        if settled is not group:
            raise FCPStateError(
                f"CP group {list(ranks)} was re-created after setup_fcp(); the settled plan belongs "
                "to the old communicator. Call setup_fcp() again and rebuild the model"
            )
        if window is not None:
            return self.window_plan(ranks, causal=causal, window=window, s_local=s_local)
        return self.plan(ranks, causal=causal, parts_per_chunk=self.parts_per_chunk(s_local))

    def _build(self, cp_ranks: tuple[int, ...], causal: bool, parts: int, *, window: tuple[int, int] | None = None,
               seq_len: int | None = None) -> Plan:
        """A plain (no head-parallel stage) plan: a = 1's settled graph, else the configured one.
        Windowed: the window's settled graph at its settled length, else the configured one
        (``auto``: the builder the cost model prices fastest under the window), over ``seq_len``
        tokens (Note [Per-layer plans])."""
        c = self.schedule
        if window is not None:
            w = self.window_schedules.get(tuple(window))
            config = self.config.replace(graph=w.graph) if w is not None and w.seq_len == seq_len else self.config
            return build_group_plan(config, self.topology, cp_ranks, causal=causal, parts_per_chunk=parts,
                                    seq_len=seq_len, window=window, **self.plan_args)
        config = self.config.replace(graph=c.graph) if c is not None and c.degree == 1 else self.config
        return build_group_plan(config, self.topology, cp_ranks, causal=causal,
                                parts_per_chunk=parts, seq_len=self.seq_len, **self.plan_args)

    def summary(self, rank: int | None = None) -> str:
        """The graph chosen and the round table of ``rank``'s CP group (default: group 0)."""
        groups = self.layout.cp_groups()
        ranks = groups[0] if rank is None else self.layout.cp_group_of(rank)
        plan = next((p for (r, c, _), p in self.plans.items() if r == ranks and c), None)
        if plan is None:
            return (f"FCP: cp={self.layout.cp}: no CP communication (Megatron's own attention); "
                    f"topology={self.topology.name}")
        head = (f"FCP: graph={plan.name} (asked {self.config.graph}) topology={self.topology.name} "
                f"cp={self.layout.cp} tp={self.layout.tp} groups={len(groups)}"
                + (f" head_parallel={self.head_parallel_degree()} (the KV stage runs its own plan across "
                   f"head groups)" if self.head_parallel_degree() > 1 else ""))
        if self.schedule is not None:
            head += "\nschedule: " + self.schedule.describe()
        hp = next((p for k, p in self.hp_plans.items() if k[0] == ranks and k[1] and p.kv_plan), None)
        if hp is not None:  # the KV stage of rank's head shard (member 0's by default)
            stage = hp.kv_plan_for(hp.position(rank)[1] if rank in hp.ranks else 0)
            return head + f"\nKV stage across {hp.num_groups} head groups of {hp.degree}:\n" + stage.round_table()
        return head + "\n" + plan.round_table()

    def schedule_report(self) -> dict | None:
        """The settled schedule as plain data (None without one): degree, graph, parts, stagger,
        predicted fwd+bwd milliseconds, the runner-up."""
        return schedule_report(self.schedule)


_RUNTIME: FCPRuntime | None = None  # process-wide, like megatron's parallel_state


def _plan_ahead(ahead: FCPRuntime, cp_ranks: tuple[int, ...], lengths: tuple[int, ...], causal: bool,
                rank: int | None) -> OrderedDict:
    """What the step's lookups make for a packed batch, made on ``ahead`` (a copy of the runtime
    with a cache of its own: Note [Planning a packed batch ahead]), and the backward programs the
    executor of ``rank`` will compile for them (:meth:`FCPRuntime.packed_programs`); returns that cache."""
    ahead.packed_placement(lengths, causal=causal, cp_ranks=cp_ranks)
    ahead.packed_programs(cp_ranks, lengths, causal=causal, rank=rank)
    return ahead.packed


def setup_fcp(
    config: FCPConfig,
    *,
    seq_len: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype_bytes: int = 2,
    layout: MegatronLayout | None = None,
    v_head_dim: int | None = None,
    groups: dict[tuple[int, ...], Any] | None = None,
    micro_batch: int = 1,
    windows: tuple[tuple[int, int], ...] = (),
) -> FCPRuntime:
    """Settle FCP for this process: validate, build + verify every CP group's causal plan.

    Call on every rank after ``initialize_model_parallel`` and before building the model (the
    defaults read ``parallel_state``; ``layout``/``groups`` let tests and tools pass their own).
    With the shapes known the head-parallel degree, graph and block size are the planner's choice
    under the flags given (Note [The runtime runs the planner's choice] in
    :mod:`megatron_fcp.patches.schedule`; ``micro_batch``: sequences per call, which prices an
    explicit ``--fcp-kv-memory-budget``; ``v_head_dim``: V's head size when it differs from
    ``head_dim``, multi-latent attention, which prices the KV bytes). ``windows``: the model's
    distinct sliding windows (Megatron's ``(left, right)``; Note [Per-layer plans]): each gets its
    plan at the settled length, built and agreed here with the full-attention plan.
    Raises ``ValueError``/``PlanError`` naming the flag to change before any communication.
    Then the ranks of this rank's live CP group agree on :func:`setup_fingerprint` (one bounded
    collective; skipped without a live group): ranks configured differently raise
    :class:`~megatron_fcp.attention.agreement.FCPAgreementError` naming the first field that differs and
    which ranks hold which value, instead of deadlocking in the first attention.
    """
    global _RUNTIME
    if layout is None:
        layout = layout_from_parallel_state()
        if groups is None:
            groups = _live_cp_groups()
    if seq_len is not None and seq_len % (2 * layout.cp):
        raise ValueError(
            f"--seq-length {seq_len} must be divisible by 2 x --context-parallel-size = {2 * layout.cp} "
            "(Megatron's zigzag split)"
        )
    topology = resolve_topology(config.topology, layout.world)
    runtime = FCPRuntime(
        config, layout, topology, seq_len,
        plan_args=dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes),
        groups=dict(groups or {}), micro_batch=micro_batch,
        windows=tuple(sorted({tuple(int(x) for x in w) for w in windows})),
    )
    for window in runtime.windows:
        Mask.of(True, window)  # ValueError naming the fix before anything else
    if seq_len is not None:
        config.parts_per_chunk(seq_len // (2 * layout.cp))  # ValueError naming the flag, before anything else
    degree = config.head_parallel_degree(layout.cp)
    tp_heads, tp_kv = (heads // layout.tp, max(1, (kv_heads or heads) // layout.tp)) if heads is not None else (0, 0)
    if degree > 1 and heads is not None:
        try:
            check_head_parallel(tp_heads, tp_kv, degree, layout.cp)
        except ValueError as exc:
            raise ValueError(f"--fcp-head-parallel {degree} with {tp_heads} query / {tp_kv} KV heads per "
                             f"tensor-parallel rank: {exc}") from exc
    share = search_share(layout, runtime.groups, config.timeout_s)
    if share is not None:  # the shared search's inputs first: ranks that differ would post other gathers
        agree(setup_inputs(runtime), None, what="FCP setup", timeout_s=config.timeout_s)
    runtime.schedule = settle_schedule(config, layout, topology, seq_len=seq_len, heads=heads, kv_heads=kv_heads,
                                       head_dim=head_dim, dtype_bytes=dtype_bytes, micro_batch=micro_batch,
                                       v_head_dim=v_head_dim, share=share)
    for window in runtime.windows:  # each windowed mask its own schedule (Note [Per-layer plans])
        runtime.window_schedules[window] = settle_schedule(
            config, layout, topology, seq_len=seq_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            dtype_bytes=dtype_bytes, micro_batch=micro_batch, v_head_dim=v_head_dim, window=window, share=share)
    degree = runtime.hp_degree = runtime.schedule.degree if runtime.schedule is not None else degree
    if config.head_parallel == "auto" and runtime.schedule is None and layout.cp > 1 and heads is not None \
            and head_dim is not None:  # packed runs: each batch chooses (Note [Head-parallel degree of a packed batch])
        cands = tuple(head_parallel_degrees(topology, layout.cp_groups()[0], tp_heads, tp_kv))
        runtime.packed_degrees = cands if len(cands) > 1 else ()   # one candidate: nothing to choose
    if layout.cp > 1 and heads is not None and head_dim is not None:  # what a packed batch prices and plans ahead
        runtime.packed_shape = AttentionShape(1, tp_heads, tp_kv, head_dim, dtype_bytes, v_head_dim)
    parts = runtime.parts_per_chunk(seq_len // layout.cp) if seq_len is not None else 1
    if layout.cp > 1:
        for cp_ranks in layout.cp_groups():
            runtime.plans[(cp_ranks, True, parts)] = runtime._build(cp_ranks, True, parts)
            if seq_len is not None:
                for window in runtime.windows:
                    runtime.window_plan(cp_ranks, causal=True, window=window, s_local=seq_len // layout.cp)
            if degree > 1 and heads is not None and seq_len is not None:  # the stage's plan at the settled length
                key = (cp_ranks, True, seq_len // layout.cp, tp_heads, tp_kv)
                runtime.hp_plans[key] = runtime._build_stage(cp_ranks, degree, seq_len, True, tp_heads, tp_kv)
        _agree_at_setup(runtime, parts)
        if 1 < degree < layout.cp and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() == layout.world:
            _create_head_parallel_groups(runtime, degree)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() == layout.world:
            _create_packed_head_parallel_groups(runtime)
    _RUNTIME = runtime
    return runtime


def setup_inputs(runtime: FCPRuntime) -> dict[str, Any]:
    """What :func:`setup_fcp` plans from, which every rank must hold identically: the causes of
    :func:`setup_fingerprint`, agreed first over the job when the schedule search is shared
    (a rank with other inputs would post other gathers)."""
    config = runtime.config.to_dict()
    config.pop("topology")  # a file path may differ per rank; the loaded topology is compared
    return {
        "topology": runtime.topology,
        "layout": (runtime.layout.world, runtime.layout.tp, runtime.layout.pp, runtime.layout.cp),
        "graph": config.pop("graph"),
        "block_tokens": config.pop("block_tokens"),
        "seq_len": runtime.seq_len,
        "shapes": tuple((k, v) for k, v in sorted(runtime.plan_args.items()) if k != "dtype_bytes"),
        "dtype_bytes": runtime.plan_args.get("dtype_bytes"),
        "config": tuple(sorted(config.items())),
        "micro_batch": runtime.micro_batch,
        "window_sizes": runtime.windows,
    }


def setup_fingerprint(runtime: FCPRuntime, cp_ranks: tuple[int, ...], parts: int) -> dict[str, Any]:
    """What the ranks of CP group ``cp_ranks`` must hold identically after :func:`setup_fcp`, in
    the order a disagreement is reported (causes before the plan they lead to)."""
    plan = runtime.plans[(tuple(cp_ranks), True, parts)]
    return {
        **setup_inputs(runtime),
        "schedule": None if runtime.schedule is None else runtime.schedule.label,
        "plan": (plan.name, plan.ranks, plan.causal, plan.parts_per_chunk, plan.rounds),
        "windows": tuple((key[2:], p.name, p.rounds) for key, p in sorted(runtime.window_plans.items())
                         if key[0] == tuple(cp_ranks)),
        "window_schedules": tuple((w, None if c is None else c.label) for w, c in sorted(runtime.window_schedules.items())),
    }


def _agree_at_setup(runtime: FCPRuntime, parts: int) -> None:
    """One bounded agreement across this rank's live CP group (see :mod:`megatron_fcp.attention.agreement`).

    Skipped when there is no live group to agree over: ``torch.distributed`` not initialised, or
    ``groups`` (tests and tools settling a hand-made layout) holds no group of this rank. That
    decision is the same on every rank of a group: each passes its own live group or none."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    rank = dist.get_rank()
    for cp_ranks, group in runtime.groups.items():
        if rank in cp_ranks and group is not None:
            agree(setup_fingerprint(runtime, cp_ranks, parts), group, what="FCP setup",
                  timeout_s=runtime.config.timeout_s)
            logger.info("FCP setup agreed across CP group %s", list(cp_ranks))
            return


def _create_head_parallel_groups(runtime: FCPRuntime, degree: int) -> None:
    """Create every CP group's head groups and KV-stage groups (collective over the whole world:
    every rank creates every group, in layout order) and keep this rank's."""
    from megatron_fcp.attention.head_parallel import create_head_parallel_groups  # noqa: PLC0415

    cp_groups = runtime.layout.cp_groups()
    mine = create_head_parallel_groups([head_groups_for(runtime.topology, r, degree) for r in cp_groups],
                                       timeout_s=runtime.config.timeout_s)
    runtime.hp_groups = {r: g for r, g in zip(cp_groups, mine) if g is not None}
    logger.info("FCP head-parallel stage: degree %d, head groups of CP group 0: %s", degree,
                head_groups_for(runtime.topology, cp_groups[0], degree))


def _create_packed_head_parallel_groups(runtime: FCPRuntime) -> None:
    """The process groups of every degree a packed batch may choose under ``auto`` (collective over
    the whole world, degrees ascending, CP groups in layout order)."""
    from megatron_fcp.attention.head_parallel import create_head_parallel_groups  # noqa: PLC0415

    cp_groups = runtime.layout.cp_groups()
    for a in runtime.packed_degrees:
        if 1 < a < runtime.layout.cp:
            mine = create_head_parallel_groups([head_groups_for(runtime.topology, r, a) for r in cp_groups],
                                               timeout_s=runtime.config.timeout_s)
            runtime.packed_hp_groups.update({(r, a): g for r, g in zip(cp_groups, mine) if g is not None})


def _megatron_cp_group() -> Any:
    """megatron-core's current CP group, or None when parallel_state is not initialised."""
    try:
        from megatron.core import parallel_state as ps  # noqa: PLC0415
    except ImportError:
        return None
    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_context_parallel_group(check_initialized=False)


def _live_cp_groups() -> dict[tuple[int, ...], Any]:
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    return {tuple(ps.get_context_parallel_global_ranks()): ps.get_context_parallel_group()}


def current_runtime() -> FCPRuntime | None:
    return _RUNTIME


def reset_fcp() -> None:
    """Forget the settled runtime (e.g. after ``destroy_model_parallel``); its planning-ahead
    thread, if any, stops after the batch it is planning (batches queued behind it are dropped)."""
    global _RUNTIME
    if _RUNTIME is not None and _RUNTIME.planner_thread is not None:
        _RUNTIME.planner_thread.shutdown(wait=False, cancel_futures=True)
    _RUNTIME = None
