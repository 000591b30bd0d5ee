"""The head-parallel stage on a packed batch on the cost model: all-to-alls of unequal pieces and the
KV stages merged into one plan. Pure, no torch.

Note [Packed head-parallel cost]
--------------------------------
A :class:`~megatron_fcp.contract.head_parallel_packed.PackedHeadParallelPlan` is timed as the
zigzag stage is (Note [Head-parallel cost] in :mod:`megatron_fcp.cost.head_parallel`), three
stages back to back per pass, with the packed batch's sizes:

* **all-to-alls**: member ``m`` of a head group holds ``t_m`` tokens; into the heads it sends
  ``t_m`` tokens of head shard ``i`` to each member ``i``, back each member ``i`` sends it the
  ``t_m`` rows of shard ``i``. Per token and member: ``(q(1) + rep * kv(1)) / a`` for Q|K|V (and
  dQ|dK|dV), ``o(1) / a`` for O and dO. One contention-aware round each
  (:func:`~megatron_fcp.cost.model.simulate_rounds`); none is hidden behind the stage (the engine
  sends one all-to-all each way: Note [Head-parallel execution on packed batches]).
* **KV stage**: :func:`packed_stage_plan` merges the ``a`` stages into one verified Plan on the CP
  ranks over a placement of ``a`` copies of the documents (rank (group ``g``, member ``j``) holds
  group ``g``'s spans of copy ``j``), so copies' need sets keep each stage to itself and the stages
  contend for the same links, as the zigzag stage plan does; forward by
  :func:`~megatron_fcp.cost.model.simulate_plan`, backward by
  :func:`~megatron_fcp.cost.backward.simulate_plan_backward` (one pass, KV kept), with ``h/a``
  query and ``rep * h_kv / a`` KV heads (:func:`~megatron_fcp.cost.head_parallel.stage_shape`).

Note [One copy prices the KV stage]
-----------------------------------
The merged plan holds ``a`` copies of one schedule: copy ``j`` is the KV plan on member ``j`` of
every group (``kv_plan_for(j)``, what the executor runs), with the same blocks, sizes, work and
transfers. Where the copies' routes share no resource and every transfer's route has, copy by
copy, the same latency and the same bandwidths in the same order (:func:`stage_copies_independent`;
every rail-aligned preset: member ``j`` of each group talks over GPU ``j``'s own NVLink port and
NIC), nothing couples them: a round's most loaded link, a wave's packing (each rank's budget and
work; the pace is a maximum over ranks), a message's queueing in the wave timeline and every floor
are the same in each copy as in copy 0, and every maximum over ranks or links is copy 0's. So
:func:`priced_stage_plan` prices copy 0 alone, ``1/a`` of the merged plan's transfers and blocks:
on 135 packed cases (cp = 16-128, ``a`` = 2, 4, 8, three graphs, ``keep``/``resend``/``auto``)
the forward, the wave floor and the backward in waves came out bit for bit as the merged plan's,
2-8x faster (tests/test_head_parallel_thd.py holds a set of them). Where copies share a link (one
NIC per node, ``single-uplink``; GPUs pairs behind a PCIe switch) they contend, the copy alone
would price too little, and the merged plan is priced, as before.

``a = 1`` is the plain packed plan over :func:`~megatron_fcp.planner.placing.place_batch`,
priced by the same two functions. :func:`packed_as_run` prices either with the backward as the
executor runs it (waves), which is what the degree choice ranks by.
"""

from __future__ import annotations

import weakref

import numpy as np

from megatron_fcp.contract.blocks import gc_paused
from megatron_fcp.contract.head_parallel import LOCAL_STAGE
from megatron_fcp.contract.head_parallel_packed import PackedHeadParallelPlan
from megatron_fcp.contract.placement import Placement, Span
from megatron_fcp.contract.plan import Plan
from megatron_fcp.contract.table import TransferTable, block_layout, small_int
from megatron_fcp.cost.backward import simulate_backward_waves, simulate_plan_backward, wave_backward_floor
from megatron_fcp.cost.floors import backward_compute_floor
from megatron_fcp.cost.head_parallel import combine, stage_shape
from megatron_fcp.cost.model import (
    BACKWARD_FLOP_RATIO,
    AttentionShape,
    ComputeModel,
    ScaledRound,
    SimResult,
    simulate_plan,
)
from megatron_fcp.memo import memo
from megatron_fcp.schedule.chains import is_chain_plan
from megatron_fcp.schedule.waves import RING_BUDGET
from megatron_fcp.topology import Topology, load_topology

__all__ = ["packed_stage_plan", "stage_copies_independent", "priced_stage_plan", "packed_a2a_messages",
           "simulate_packed_head_parallel", "packed_as_run", "PackedAsRun"]


def packed_stage_plan(hp: PackedHeadParallelPlan) -> Plan:
    """Every KV stage of ``hp`` merged into one verified Plan on ``hp.ranks`` (Note [Packed
    head-parallel cost]): ``a`` copies of the documents, rank (``g``, ``j``) holding group ``g``'s
    spans of copy ``j``; each KV-plan transfer once per member, the members' copies of a transfer
    next to each other. Built as a transfer table from the KV plan's columns (Note [Columnar plans]
    in :mod:`megatron_fcp.contract.table`), once per ``hp`` object. A KV plan whose backward walks
    another (Note [A backward on another graph] in :mod:`megatron_fcp.contract.plan`) has that one
    merged the same way and joined."""
    cache = memo(hp)                                      # Note [Caches live with their object]
    hit = cache.get("merged_stage_plan")
    if hit is not None:
        return hit
    a, n = hp.degree, len(hp.group_placement.doc_lengths)
    gp = hp.group_placement
    pos = {r: (g, j) for g, group in enumerate(hp.head_groups) for j, r in enumerate(group)}
    blocks = tuple(tuple(Span(s.doc + pos[r][1] * n, s.start, s.end) for s in gp.blocks[pos[r][0]]) for r in hp.ranks)
    placement = Placement(gp.doc_lengths * a, blocks, gp.causal, gp.window, gp.layout)
    name = _stage_name(hp)
    if hp.kv_plan is None or not hp.kv_plan.num_transfers():
        plan = Plan(hp.ranks, (), gp.causal, 1, name=name, placement=placement).verify()
    else:
        plan = _merged_copies(hp, hp.kv_plan, placement, name)
        if hp.kv_plan.backward is not None:
            plan = plan.with_backward(_merged_copies(hp, hp.kv_plan.backward, placement, hp.kv_plan.backward.name))
    cache["merged_stage_plan"] = plan
    return plan


def _merged_copies(hp: PackedHeadParallelPlan, kv_plan: Plan, placement: Placement, name: str) -> Plan:
    """``kv_plan``'s transfers once per member (:func:`packed_stage_plan`'s table), verified."""
    a = hp.degree
    rnd, src, dst, owner, chunk, _ = kv_plan.transfer_columns()         # [T]: group indices (virtual ranks)
    cp_of = {r: i for i, r in enumerate(hp.ranks)}
    member = np.array([[cp_of[r] for r in group] for group in hp.head_groups], dtype=np.int64)   # [G, a]: CP index
    j = np.tile(np.arange(a, dtype=np.int64), len(rnd))                                      # [T * a]
    src, dst, owner, chunk = (np.repeat(c, a) for c in (src, dst, owner, chunk))
    offset, _, nb = block_layout(placement.blocks_per_rank(), 1)
    idx = small_int(max(len(hp.ranks), nb))
    starts = np.searchsorted(rnd, np.arange(kv_plan.num_rounds + 1)).astype(np.int64) * a
    table = TransferTable(starts, member[src, j].astype(idx), member[dst, j].astype(idx),
                          (offset[member[owner, j]] + chunk).astype(idx))
    return Plan(hp.ranks, None, placement.causal, 1, name=name, placement=placement, table=table).verify()


def _stage_name(hp: PackedHeadParallelPlan) -> str:
    """The merged stage plan's name: ``hp{a}-{the KV plan's graph}``."""
    return f"hp{hp.degree}-{hp.kv_plan.name if hp.kv_plan is not None else LOCAL_STAGE}"


def stage_copies_independent(hp: PackedHeadParallelPlan, topology: "Topology | str") -> bool:
    """Whether the ``a`` copies of ``hp``'s KV stage run on ``topology`` without touching each other
    (Note [One copy prices the KV stage]): over every (sender, receiver) pair of the KV plan, copy
    ``j``'s route (member ``j`` of each group) has copy 0's latency, length and resource bandwidths
    in order, and no resource is on the routes of two copies; the pairs of the plan its backward
    walks too. False without a KV stage."""
    if hp.kv_plan is None or hp.degree == 1 or not hp.kv_plan.num_transfers():
        return False
    topo = load_topology(topology)
    G = len(hp.head_groups)
    keys = []
    for plan in {id(p): p for p in (hp.kv_plan, hp.kv_plan.backward_plan)}.values():   # both passes' pairs
        _, src, dst, _, _, _ = plan.transfer_columns()                  # [T]: group indices
        keys.append(src.astype(np.int64) * G + dst)
    pairs = np.divmod(np.unique(np.concatenate(keys)), G)                # [2, distinct pairs], sorted
    member = np.array(hp.head_groups, dtype=np.int64)                    # [G, a]: global ranks
    table = topo.route_ids()
    rows = [table.rows(member[pairs[0], j], member[pairs[1], j]) for j in range(hp.degree)]
    lens0, ids0 = table.gather(rows[0])         # columns read after every rows() call above
    owner_of: dict[int, int] = {}
    for j, r in enumerate(rows):
        lens, ids = table.gather(r)
        if not (np.array_equal(lens, lens0) and np.array_equal(table.latency[r], table.latency[rows[0]])
                and np.array_equal(table.resource_bandwidth[ids], table.resource_bandwidth[ids0])):
            return False
        for i in np.unique(ids).tolist():
            if owner_of.setdefault(i, j) != j:
                return False
    return True


def priced_stage_plan(hp: PackedHeadParallelPlan, topology: "Topology | str") -> Plan:
    """The plan ``hp``'s KV stage is priced on: copy 0 alone (``hp.kv_plan_for(0)``) where the copies
    are independent (:func:`stage_copies_independent`), else every copy merged
    (:func:`packed_stage_plan`); the same prices either way (Note [One copy prices the KV stage]).
    The one place that decision is made: the forward, the one-pass backward, the waves and their
    floor all price this plan. Cached per ``hp`` object and topology."""
    topo = load_topology(topology)
    cache, key = memo(hp), ("priced_stage_plan", id(topo))   # Note [Caches live with their object]
    hit = cache.get(key)
    if hit is not None and hit[0]() is topo:
        return hit[1]
    plan = hp.kv_plan_for(0) if stage_copies_independent(hp, topo) else packed_stage_plan(hp)
    cache[key] = (weakref.ref(topo), plan)
    return plan


def packed_a2a_messages(hp: PackedHeadParallelPlan, shape: AttentionShape, which: str) -> list[tuple[int, int, float]]:
    """``(src, dst, bytes)`` of one all-to-all: ``which`` is ``"qkv-in"`` (Q|K|V to heads),
    ``"qkv-out"`` (dQ|dK|dV back), ``"o-in"`` (dO to heads) or ``"o-out"`` (O back). In: member
    ``m`` sends its rows of shard ``i`` to member ``i``; out: shard ``i``'s rows of ``m`` go back to
    ``m`` (groups in order, then ``m``, then ``i``)."""
    src, dst, rows = _a2a_rows(hp, _a2a_direction(which))
    per = _a2a_bytes_per_row(hp, shape, which)
    return list(zip(src.tolist(), dst.tolist(), (rows.astype(np.float64) * per).tolist()))


def _a2a_direction(which: str) -> str:
    kind, _, direction = which.partition("-")
    if kind not in ("qkv", "o") or direction not in ("in", "out"):
        raise ValueError(f"which: 'qkv-in', 'qkv-out', 'o-in' or 'o-out', got {which!r}")
    return direction


def _a2a_bytes_per_row(hp: PackedHeadParallelPlan, shape: AttentionShape, which: str) -> float:
    """Bytes one token's row carries in all-to-all ``which`` (its heads' share of one member's)."""
    a, rep = hp.degree, hp.kv_replication
    if which.startswith("qkv"):
        return (shape.q_bytes(1) + shape.kv_bytes(1) * rep) / a
    return shape.o_bytes(1) / a


def _a2a_rows(hp: PackedHeadParallelPlan, direction: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The all-to-all's messages as columns ``(src, dst, rows)`` (global ranks; int64 ``[messages]``):
    every ordered pair of distinct members ``(m, i)`` of every group whose ``m`` holds tokens, in
    group, ``m``, ``i`` order; ``rows``: ``m``'s tokens; ``"in"`` sends ``m -> i``, ``"out"``
    ``i -> m``."""
    a = hp.degree
    member = np.array(hp.head_groups, dtype=np.int64).reshape(-1, a)                  # [G, a]: global ranks
    tokens = hp.member_token_table()                                                  # [G, a]
    m, i = np.divmod(np.arange(a * a, dtype=np.int64), a)                             # [a * a]: m-major
    off = m != i
    m, i = m[off], i[off]
    rows = tokens[:, m].reshape(-1)                                                   # [G * a(a-1)]
    src, dst = member[:, m].reshape(-1), member[:, i].reshape(-1)
    keep = rows > 0
    src, dst, rows = src[keep], dst[keep], rows[keep]
    return (src, dst, rows) if direction == "in" else (dst, src, rows)


def _a2a_round(hp: PackedHeadParallelPlan, topo: Topology, direction: str) -> ScaledRound:
    """The stage's all-to-all in ``direction`` routed once, priced per byte of a row (the two
    all-to-alls of a direction move the same rows: :class:`~megatron_fcp.cost.model.ScaledRound`).
    Cached per ``hp`` object, topology and direction."""
    cache, key = memo(hp), ("a2a_round", id(topo), direction)   # Note [Caches live with their object]
    hit = cache.get(key)
    if hit is not None and hit[0]() is topo:
        return hit[1]
    src, dst, rows = _a2a_rows(hp, direction)
    rnd = ScaledRound(topo, src, dst, rows)
    cache[key] = (weakref.ref(topo), rnd)
    return rnd


def _a2a(hp: PackedHeadParallelPlan, topo: Topology, shape: AttentionShape, which: str,
         round_overhead_s: float = 0.0) -> SimResult:
    """One all-to-all of the stage (:func:`packed_a2a_messages`), a contention-aware round
    (:func:`~megatron_fcp.cost.model.simulate_rounds`' price)."""
    return _a2a_round(hp, topo, _a2a_direction(which)).simulate(_a2a_bytes_per_row(hp, shape, which),
                                                                round_overhead_s, name="a2a-" + which)


def _stage_forward(hp: PackedHeadParallelPlan, topo: Topology, shape: AttentionShape, cm: ComputeModel,
                   round_overhead_s: float = 0.0, name: str = "fcp") -> SimResult:
    """The stage's forward (Note [Packed head-parallel cost]): Q|K|V in, the merged KV stage, O out."""
    kv_f = simulate_plan(priced_stage_plan(hp, topo), topo, stage_shape(hp, shape), compute_model=cm,
                         round_overhead_s=round_overhead_s, name=name)
    return combine(name, [_a2a(hp, topo, shape, "qkv-in", round_overhead_s), kv_f,
                          _a2a(hp, topo, shape, "o-out", round_overhead_s)])


def simulate_packed_head_parallel(hp: PackedHeadParallelPlan, topology: "Topology | str", shape: AttentionShape, *,
                                  compute_model: ComputeModel | None = None, round_overhead_s: float = 0.0,
                                  backward_flop_ratio: float = BACKWARD_FLOP_RATIO,
                                  grad_dtype_bytes: int | None = None, name: str = "fcp") -> SimResult:
    """Forward + backward of ``hp`` (Note [Packed head-parallel cost]); ``shape``: the attention's
    heads, KV heads, head size and dtype (``seq_len`` is not read: the documents set it).
    ``meta``: ``head_parallel``, ``graph``, ``kv_replication``, ``fwd_total_s``, ``bwd_total_s``."""
    topo = load_topology(topology)
    cm = compute_model or ComputeModel()
    sp = priced_stage_plan(hp, topo)
    kv_b = simulate_plan_backward(sp, topo, stage_shape(hp, shape), compute_model=cm,
                                  backward_flop_ratio=backward_flop_ratio, grad_dtype_bytes=grad_dtype_bytes,
                                  round_overhead_s=round_overhead_s, name=name)
    fwd = _stage_forward(hp, topo, shape, cm, round_overhead_s, name)
    bwd = combine(name, [_a2a(hp, topo, shape, "o-in", round_overhead_s), kv_b,
                         _a2a(hp, topo, shape, "qkv-out", round_overhead_s)])
    merged_transfers = hp.kv_plan.num_transfers() * hp.degree if hp.kv_plan is not None else 0
    meta = {"head_parallel": hp.degree, "graph": _stage_name(hp), "kv_replication": hp.kv_replication,
            "fwd_total_s": fwd.total_s, "bwd_total_s": bwd.total_s, "transfers": merged_transfers}
    return combine(name, [fwd, bwd], meta)


@gc_paused()
def packed_as_run(plan: "Plan | PackedHeadParallelPlan", topology: "Topology | str", shape: AttentionShape, *,
                  compute_model: ComputeModel | None = None, backward_kv: str = "auto",
                  kv_memory_budget: int = RING_BUDGET, buffered_sends: bool = False,
                  held_routes: bool = False) -> dict:
    """Forward + backward of a packed batch's plan as the executor runs them: the forward as
    :func:`~megatron_fcp.cost.model.simulate_plan` / :func:`simulate_packed_head_parallel` price it, the backward in
    waves under ``kv_memory_budget`` (:func:`~megatron_fcp.cost.backward.simulate_backward_waves`,
    ``backward_kv``) instead of their one pass. For a head-parallel stage the waves run on the
    merged stage plan with the stage's heads, between the same all-to-alls. What
    :func:`~megatron_fcp.planner.head_parallel.choose_packed_head_parallel` ranks degrees by.
    ``buffered_sends``, ``held_routes``: the transport's timeline rules
    (:class:`~megatron_fcp.schedule.program.WaveBackward`; both on for the emulated cluster's gloo
    over TCP). Returns ``fwd_s``, ``bwd_s``, ``total_s``, ``waves`` and ``backward_kv`` (the mode run)."""
    return PackedAsRun(plan, topology, shape, compute_model=compute_model, backward_kv=backward_kv,
                       kv_memory_budget=kv_memory_budget, buffered_sends=buffered_sends,
                       held_routes=held_routes).result()


class PackedAsRun:
    """:func:`packed_as_run` in two steps, so that a search can rule a plan out before simulating
    its backward (Note [Pruning the packed degree choice] in
    :mod:`megatron_fcp.planner.head_parallel`): the forward (and a stage's exposed all-to-alls)
    is priced at construction; :meth:`floor` adds a floor on the backward in waves
    (:func:`~megatron_fcp.cost.backward.wave_backward_floor`: the waves packed, their messages not
    simulated; 0 for a backward that streams as chains); :meth:`result` adds the backward itself.
    ``floor() <= result()["total_s"]`` (the floor's own guarantee, tested; held routes only add
    waits to a timeline, so the floor, which has none, holds under them too).
    ``forward``: the forward's :class:`~megatron_fcp.cost.model.SimResult`; ``exposed``: the
    backward's all-to-alls (0 for ``a = 1``)."""

    def __init__(self, plan: "Plan | PackedHeadParallelPlan", topology: "Topology | str", shape: AttentionShape, *,
                 compute_model: ComputeModel | None = None, backward_kv: str = "auto",
                 kv_memory_budget: int = RING_BUDGET, buffered_sends: bool = False, held_routes: bool = False):
        self.topo = load_topology(topology)
        self.cm = compute_model or ComputeModel()
        self.backward_kv, self.kv_memory_budget = backward_kv, kv_memory_budget
        self.timeline = {"buffered_sends": buffered_sends, "held_routes": held_routes}
        if isinstance(plan, PackedHeadParallelPlan):
            self.sp, self.sshape = priced_stage_plan(plan, self.topo), stage_shape(plan, shape)
            self.forward = _stage_forward(plan, self.topo, shape, self.cm)
            self.exposed = sum(_a2a(plan, self.topo, shape, w).total_s for w in ("o-in", "qkv-out"))
        else:
            self.sp, self.sshape, self.exposed = plan, shape, 0.0
            self.forward = simulate_plan(plan, self.topo, shape, compute_model=self.cm)

    @property
    def fwd(self) -> float:
        """The forward's seconds (exposed all-to-alls included)."""
        return self.forward.total_s

    def compute_floor(self) -> float:
        """A floor on :meth:`result`'s ``total_s`` before the backward's waves are packed: the
        forward, the exposed all-to-alls and the busiest rank's backward work and launches
        (:func:`~megatron_fcp.cost.floors.backward_compute_floor`: once per job in waves, at least
        once per owner for a chain). Below :meth:`floor` for a backward in waves (their floor adds
        every job too), above it for one that streams as chains (whose :meth:`floor` prices no
        backward)."""
        sp = self.sp.backward_plan
        waves = bool(sp.num_transfers()) and not is_chain_plan(sp)
        jobs = backward_compute_floor(sp, self.sshape, self.cm, BACKWARD_FLOP_RATIO, waves=waves)
        return (self.fwd + self.exposed + jobs) * (1 - 1e-9)

    def floor(self) -> float:
        """A floor on :meth:`result`'s ``total_s``."""
        wave = wave_backward_floor(self.sp, self.topo, self.sshape, compute_model=self.cm,
                                   backward_kv=self.backward_kv, kv_memory_budget=self.kv_memory_budget,
                                   buffered_sends=self.timeline["buffered_sends"])
        return self.fwd + self.exposed + (wave or 0.0)

    def result(self, per_wave: bool = False) -> dict:
        """``fwd_s``, ``bwd_s``, ``total_s``, ``waves``, ``backward_kv``: :func:`packed_as_run`'s.
        ``per_wave``: also ``backward_waves``, the stage's
        :func:`~megatron_fcp.cost.backward.simulate_backward_waves` with its per-wave reports."""
        waves = simulate_backward_waves(self.sp, self.topo, self.sshape, compute_model=self.cm,
                                        backward_kv=self.backward_kv, kv_memory_budget=self.kv_memory_budget,
                                        per_wave=per_wave, **self.timeline)
        bwd = self.exposed + waves["bwd_s"]
        out = {"fwd_s": self.fwd, "bwd_s": bwd, "total_s": self.fwd + bwd, "waves": waves["waves"],
               "backward_kv": waves["backward_kv"]}
        if per_wave:
            out["backward_waves"] = waves
        return out