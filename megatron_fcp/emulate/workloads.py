"""The emulator's workloads: what each one runs, and what the cost model predicts for it. Pure, no torch.

Workload names (``--workloads``):

* ``te-p2p``: Transformer Engine's p2p ring (:mod:`megatron_fcp.emulate.te_ring`), on Megatron's
  zigzag or, with ``--doc-lengths``, on TE's padded per-document THD layout;
* ``te-a2a``: TE's ``a2a`` (Ulysses over the whole CP group), run by our head-parallel engine at
  degree ``a = cp`` (one head group, no KV stage): one all-to-all of Q|K|V in, local attention of
  ``heads / cp`` heads over the whole sequence (under the window, if any), one all-to-all of O out
  (backward: dO in, dQ|dK|dV out), the schedule TE runs. Only where heads and KV heads divide by
  cp (TE's requirement) and on one sequence (zigzag). Predicted by TE's own model
  (:func:`~megatron_fcp.cost.te.simulate_te_a2a`), which prices exactly that schedule;
* ``te-a2a-p2p``: TE's hierarchical ``a2a+p2p`` (Ulysses inside a node, ring across nodes), run by
  our head-parallel engine (:mod:`megatron_fcp.attention.head_parallel`): degree = ranks per node,
  a node's ranks one head group, the KV stage a ``ring`` over the head groups, received KV kept
  for backward (bf16 dK/dV partials back along the ring, as TE's dKV). See
  Note [te-a2a-p2p on the head-parallel engine]. Packed batches (THD) are predicted only;
* ``fcp-hp``: what the plugin runs by default: the schedule the Megatron runtime settles
  (:func:`~megatron_fcp.patches.schedule.settle_schedule`), i.e.
  :func:`~megatron_fcp.planning.choose_schedule` on the emulated cluster with the emulated compute
  model and the backward the executor runs (:class:`~megatron_fcp.schedule.program.WaveBackward`:
  wave by wave, KV kept or re-sent as ``--backward-kv`` / the ``@keep`` / ``@resend`` suffix
  decide against the ring's memory, partials in bf16): degree, KV-stage graph, parts per chunk
  (degree 1) or stagger (degree > 1). Degree 1 runs as plain FCP over the chosen plan with its
  parts (an :class:`FcpWorkload`, as the plugin does), degree > 1 the head-parallel engine over the
  chosen plan. ``info["choice"]`` is the runtime's report of it (label, predicted ms, runner-up).
  No ``/P`` suffix: the planner picks the blocks. On a packed batch the runtime chooses the degree
  per micro-batch (:func:`packed_hp_choice`, the runtime's
  :func:`~megatron_fcp.planner.packed_choice.choose_packed_plan`): degree 1 is
  ``fcp-auto``'s run (graph ``auto`` over the placement; TE's layout on its ring where that is the choice), degree > 1 the packed head-parallel
  engine over the chosen plan (:class:`PackedHeadParallelWorkload`); a windowed packed batch runs
  without the stage, as the runtime's windowed layers do;
* ``fcp-<graph>`` for every graph builder (:data:`~megatron_fcp.planning.BUILDERS`) and ``fcp-auto``
  (the builder the cost model picks): our executor over the compiled plan, on the zigzag split or,
  with ``--doc-lengths``, over :func:`~megatron_fcp.planner.placing.place_batch`'s placement (THD). A
  suffix ``@keep`` / ``@resend`` / ``@auto`` sets that workload's backward KV mode, overriding
  ``--backward-kv``, and ``/P`` its sub-blocks per zigzag chunk, overriding ``--parts``
  (``fcp-auto@keep/4``).

Under a sliding window (``--window L,R``, :attr:`WorkloadShape.window`; Note [Windowed workloads])
every workload that can run it does: FCP's plans are built under the window, ``fcp-hp`` settles the
windowed choice (degree 1), ``te-a2a`` runs the window in its local attention; ``te-p2p`` and
``te-a2a-p2p`` are not run, as TE refuses them.

Predictions are the cost model's forward + backward on the emulated cluster's Topology
(:func:`~megatron_fcp.emulate.spec.emulated_topology`) with the emulated FLOP/s and no launch
overhead (as the sleep kernel charges). FCP's backward (``fcp-*`` and every KV stage) is priced
as the executor runs it, wave by wave
(:func:`~megatron_fcp.cost.backward.simulate_backward_waves`), in the backward KV mode the
executor picks (:func:`executor_program`: the executor's own backward program, Note [Backward
program]; the workload compiles it once, as every rank would, and hands the mode to the ranks).

The *lower bound* of a configuration is the physical limit with perfect overlap:
``max(compute, communication)`` where compute is the total attention work spread evenly over the
ranks (forward + backward) and communication the need-set lower bound of the forward KV exchange
(:func:`~megatron_fcp.planning.lower_bound`; over a placement the one of
:func:`~megatron_fcp.planner.compare.packed_need_stats`) plus the same for the dK/dV reduction at
the KV's bytes per element, what our executor sends (partials summed in FP32, sent in the input
dtype, as TE's ring). ``lower_bound_all_families_s`` is the bound over every schedule family
(head-parallel degrees included, :func:`~megatron_fcp.planning.lower_bound_all`, dK/dV at the
KV's bytes; on a packed batch :func:`~megatron_fcp.planner.compare.packed_lower_bound_all` over
the placement each degree runs, Note [Packed lower bound over degrees]) with the same compute.

Note [Windowed workloads]
-------------------------
A window is a property of the mask (:class:`~megatron_fcp.contract.mask.Mask`), not of a schedule:
every plan, kernel call and prediction of a windowed configuration takes the same ``Mask.of(causal,
window)``. FCP's plans carry it (``plan.window``, the need sets of Note [Windowed need sets]) and the
executor and the sleep kernel run it (``window=``, :func:`~megatron_fcp.emulate.sleep_kernel.count_pairs`
counts the window's pairs), so the model prices the window's bytes and work as they run. Transformer
Engine runs a sliding window under CP only with ``a2a`` and ``all_gather``
(:func:`~megatron_fcp.cost.te.te_refuses_window`); ``te-p2p`` and ``te-a2a-p2p`` under a window are
reported with TE's reason and neither run nor predicted (a prediction of a schedule TE cannot run
would compare against nothing). ``te-a2a``'s plan is the window-free degree-``cp`` plan (no KV
stage: nothing in it depends on the mask); the window goes to the engine's local attention.

Note [te-a2a-p2p on the head-parallel engine]
---------------------------------------------
TE's ``a2a+p2p`` is the head-parallel stage at degree ``a`` = ranks per node (consecutive ranks,
one node per head group) with a ring over the groups as the KV stage. Our ring compiled over
:func:`~megatron_fcp.planning.group_placement` stops a block at its last reader: on 2 nodes,
causal, node 0 sends only its early chunks; TE sends every chunk. The forward time is the same
(the other direction carries everything and sets the round), which the model shows (forward
predictions equal to TE's own model, ``predicted_te_model_s`` beside). Backward: TE runs the ring
again carrying KV and bf16 dKV; here the KV is kept from forward and the bf16 partials go back
along the reversed ring (TE's dKV bytes, without its KV), wave by wave as the executor runs its
backward (Note [Backward waves]: a wave's reduction overlaps the next wave's gradients, not the
other waves' reductions). ``predicted_s`` is the model of what runs (:func:`predict_head_parallel`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from megatron_fcp.contract.head_parallel import HeadParallelPlan, head_parallel_degrees
from megatron_fcp.contract.head_parallel_packed import PackedHeadParallelPlan
from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.placement import Placement
from megatron_fcp.planner.placing import place_batch
from megatron_fcp.contract.plan import Plan
from megatron_fcp.cost.backward import simulate_backward_waves
from megatron_fcp.cost.head_parallel import simulate_head_parallel, stage_shape
from megatron_fcp.cost.head_parallel_packed import PackedAsRun
from megatron_fcp.cost.model import BACKWARD_FLOP_RATIO, AttentionShape, ComputeModel, pad_for_zigzag, simulate_plan
from megatron_fcp.cost.te import (
    lower_bound,
    simulate_te_a2a,
    simulate_te_a2a_p2p,
    simulate_te_a2a_p2p_thd,
    simulate_te_p2p,
    simulate_te_p2p_thd,
    te_refuses_window,
)
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.builders import BUILDERS
from megatron_fcp.planner.choose import ScheduleChoice, choose_schedule, lower_bound_all
from megatron_fcp.planner.compare import packed_lower_bound_all, packed_need_stats
from megatron_fcp.planner.head_parallel import compile_head_parallel, packed_degree_plan
from megatron_fcp.planner.packed_choice import PackedChoice, choose_packed_plan
from megatron_fcp.planner.placing import layout_graphs
from megatron_fcp.schedule.program import BackwardPolicy, BackwardProgram, WaveBackward, compile_backward
from megatron_fcp.topology import Topology

__all__ = ["WorkloadShape", "Workload", "FcpWorkload", "TeP2PWorkload", "HeadParallelWorkload", "TeA2AWorkload",
           "PackedHeadParallelWorkload", "WORKLOAD_NAMES",
           "make_workloads", "lower_bounds", "predict_head_parallel", "executor_program",
           "fcp_hp_choice"]

DTYPE_BYTES = 2  # the emulated tensors are bf16, as on the GPUs they stand for; dK/dV partials too

GLOO_TCP = {"buffered_sends": True, "held_routes": True}
"""The emulated cluster's transport for the backward's timeline (Note [Wave pipeline timeline] in
:mod:`megatron_fcp.cost.timeline`): gloo's send is complete once its receiver has posted (the socket
takes the bytes then), and a message holds its whole route, which its measured runs follow (the
GPU clusters' default, resources that queue on their own, under-predicted ``fcp-full`` on 2x4 rails
by 17.7%)."""

#: Every workload name ``--workloads`` accepts.
WORKLOAD_NAMES: tuple[str, ...] = ("te-p2p", "te-a2a", "te-a2a-p2p", "fcp-auto", "fcp-hp", *(f"fcp-{g}" for g in BUILDERS))


@dataclass(frozen=True)
class WorkloadShape:
    """One attention layer, named like the CLI flags. ``doc_lengths``: a packed batch (THD), else
    one sequence of ``seq`` tokens (Megatron's zigzag; padded to a multiple of ``2*cp``).
    ``window``: a sliding window ``(left, right)`` (Megatron's ``window_size``; None: none)."""

    seq: int
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    causal: bool = True
    doc_lengths: tuple[int, ...] | None = None
    parts: int = 1
    block_tokens: int = 4096
    backward_kv: str = "auto"
    window: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.window is not None:  # normalized (a causal (W, -1) is (W, 0)); bad windows fail here
            m = Mask.of(self.causal, self.window)
            object.__setattr__(self, "window", m.window if m.windowed else None)

    @property
    def mask(self) -> Mask:
        """The layer's mask: ``causal`` and ``window``."""
        return Mask.of(self.causal, self.window)

    def attention(self) -> AttentionShape:
        seq = sum(self.doc_lengths) if self.doc_lengths else self.seq
        return AttentionShape(seq, self.heads, self.kv_heads, self.head_dim, DTYPE_BYTES)

    def describe(self) -> dict:
        return {"seq": sum(self.doc_lengths) if self.doc_lengths else self.seq, "heads": self.heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "causal": self.causal,
                "doc_lengths": list(self.doc_lengths) if self.doc_lengths else None, "dtype": "bf16",
                "window": list(self.window) if self.window else None}


@dataclass
class Workload:
    """One schedule on one configuration: ``name``, what the ranks run (subclasses) and the prediction.

    ``unavailable``: why it cannot be measured here (None: it can). ``info``: facts for the report
    (graph, rounds, bytes).
    """

    name: str
    shape: WorkloadShape
    ranks: tuple[int, ...]
    unavailable: str | None = None
    info: dict = field(default_factory=dict)

    def predict(self, topo: Topology, cm: ComputeModel) -> dict:
        raise NotImplementedError


def _sum(fwd, bwd) -> dict:
    return {"predicted_s": fwd.total_s + bwd.total_s, "predicted_fwd_s": fwd.total_s, "predicted_bwd_s": bwd.total_s,
            "predicted_comm_s": fwd.comm_s + bwd.comm_s, "predicted_compute_s": fwd.compute_s + bwd.compute_s}


@dataclass
class FcpWorkload(Workload):
    """``fcp-<graph>`` / ``fcp-auto``: our executor over ``plan`` (over ``placement`` when packed).

    ``predict``: the forward (:func:`~megatron_fcp.planning.simulate_plan`) and the backward the
    executor runs, wave by wave with ``backward_kv``
    (:func:`~megatron_fcp.cost.backward.simulate_backward_waves` with :data:`GLOO_TCP`:
    gloo's send is complete once its receiver has posted and the socket holds it; its reductions and, under
    ``resend``, its re-sends counted as communication)."""

    plan: Plan | None = None
    placement: Placement | None = None
    backward_kv: str = "keep"  # the mode the executor will choose (decided here, once, like the ranks)
    requested_kv: str | None = None  # --fcp-backward-kv as given (auto may keep the first step); None: backward_kv

    @property
    def executor_kv(self) -> str:
        """What the runner passes as ``backward_kv`` and the prediction prices."""
        return self.requested_kv or self.backward_kv

    def predict(self, topo: Topology, cm: ComputeModel) -> dict:
        shape = self.shape.attention()
        fwd = simulate_plan(self.plan, topo, shape, compute_model=cm)
        w = simulate_backward_waves(self.plan, topo, shape, compute_model=cm, backward_kv=self.executor_kv,
                                    **GLOO_TCP)
        return {"predicted_s": fwd.total_s + w["bwd_s"], "predicted_fwd_s": fwd.total_s, "predicted_bwd_s": w["bwd_s"],
                "predicted_comm_s": fwd.comm_s + sum(w["wave_reduce_s"]) + w["resend_s"],
                "predicted_compute_s": fwd.compute_s + sum(w["wave_compute_s"]),
                "predicted_bwd_waves": w["waves"], "predicted_resend_s": w["resend_s"]}


@dataclass
class TeP2PWorkload(Workload):
    """``te-p2p``: TE's ring over the zigzag (one sequence) or TE's padded THD layout (packed)."""

    def predict(self, topo: Topology, cm: ComputeModel) -> dict:
        s = self.shape
        shape = s.attention()
        docs = list(s.doc_lengths) if s.doc_lengths else [shape.seq_len]
        try:
            if s.doc_lengths:
                fwd = simulate_te_p2p_thd(topo, self.ranks, docs, shape, causal=s.causal, compute_model=cm,
                                          window=s.window)
            else:
                fwd = simulate_te_p2p(topo, self.ranks, shape, causal=s.causal, compute_model=cm, window=s.window)
        except ValueError as e:  # a window: TE refuses it, and so does its model
            return {"predicted_s": None, "prediction_note": str(e)}
        bwd = simulate_te_p2p_thd(topo, self.ranks, docs, shape, causal=s.causal, backward=True, compute_model=cm)
        return _sum(fwd, bwd)


def predict_head_parallel(hp: HeadParallelPlan, topo: Topology, att: AttentionShape, causal: bool, cm: ComputeModel,
                          backward_kv: str, overlap_q: bool = True) -> dict:
    """Forward + backward of ``hp`` as the engine runs it
    (:func:`~megatron_fcp.planning.simulate_head_parallel`: all-to-all in, the KV stage with every
    stage at once, all-to-all out, exposed; Note [Head-parallel cost]), the KV stage's backward wave
    by wave with ``backward_kv`` (keep / resend, :class:`~megatron_fcp.schedule.program.WaveBackward`),
    dK/dV partials in the KV dtype (the executor's): the model ``choose_schedule`` ranks with.
    ``overlap_q``: Q's all-to-all behind the stage's start (the engine's default; False for
    ``te-a2a-p2p``, which posts one Q|K|V all-to-all as TE does)."""
    res = simulate_head_parallel(hp, topo, att, causal=causal, compute_model=cm, overlap_q=overlap_q,
                                 backward=WaveBackward(backward_kv, **GLOO_TCP))
    m = res.meta
    out = {"predicted_s": res.total_s, "predicted_fwd_s": m["fwd_total_s"], "predicted_bwd_s": m["bwd_total_s"],
           "predicted_comm_s": res.comm_s, "predicted_compute_s": res.compute_s}
    if "backward_waves" in m:  # a KV stage ran (a < cp)
        out.update(predicted_bwd_waves=m["backward_waves"], predicted_resend_s=m["resend_s"])
    return out


def _hp_backward_kv(shape: WorkloadShape, hp: HeadParallelPlan) -> str:
    """The backward KV mode the engine's KV stage picks: :func:`executor_program` on stage 0's
    plan (every stage decides alike), the stage's KV heads, the padded sequence."""
    if hp.kv_plan is None:  # a = cp: no KV stage, nothing kept or re-sent
        return "keep"
    att, _ = pad_for_zigzag(shape.attention(), hp.cp)
    return executor_program(shape.backward_kv, hp.kv_plan_for(0), att.seq_len, stage_shape(hp, att).kv_heads,
                            shape.head_dim).mode


@dataclass
class HeadParallelWorkload(Workload):
    """``te-a2a-p2p`` and ``fcp-hp``: the head-parallel engine over ``hp_plan`` (module docstring).

    ``predict``: :func:`predict_head_parallel` of the plan that runs; for ``te-a2a-p2p`` also TE's own
    model (``predicted_te_model_s``, Note [te-a2a-p2p on the head-parallel engine]); packed
    ``te-a2a-p2p`` (not measurable) gets TE's model only.
    """

    hp_plan: HeadParallelPlan | None = None
    backward_kv: str = "keep"
    requested_kv: str | None = None  # as FcpWorkload's

    @property
    def overlap_q(self) -> bool:
        """Q's all-to-all behind the KV stage's start: the engine's (``fcp-hp``), not TE's schedule."""
        return self.name != "te-a2a-p2p"

    @property
    def executor_kv(self) -> str:
        return self.requested_kv or self.backward_kv

    def _te_model(self, topo: Topology, cm: ComputeModel) -> dict:
        s = self.shape
        shape = s.attention()
        try:
            if s.doc_lengths:
                kw = dict(causal=s.causal, compute_model=cm, window=s.window)
                fwd = simulate_te_a2a_p2p_thd(topo, self.ranks, list(s.doc_lengths), shape, **kw)
                bwd = simulate_te_a2a_p2p_thd(topo, self.ranks, list(s.doc_lengths), shape, backward=True, **kw)
                return _sum(fwd, bwd)
            fwd = simulate_te_a2a_p2p(topo, self.ranks, shape, causal=s.causal, compute_model=cm, window=s.window)
        except ValueError as e:  # TE cannot run it (heads do not divide, or a window)
            return {"predicted_s": None, "prediction_note": str(e)}
        # backward of the zigzag a2a+p2p: the packed model with one document is the same schedule
        bwd = simulate_te_a2a_p2p_thd(topo, self.ranks, [shape.seq_len], shape, causal=s.causal, backward=True,
                                      compute_model=cm)
        return _sum(fwd, bwd)

    def predict(self, topo: Topology, cm: ComputeModel) -> dict:
        te = self._te_model(topo, cm) if self.name == "te-a2a-p2p" else {}
        if self.hp_plan is None:
            return te or {"predicted_s": None}
        out = predict_head_parallel(self.hp_plan, topo, self.shape.attention(), self.shape.causal, cm,
                                    self.executor_kv, overlap_q=self.overlap_q)
        if te.get("predicted_s") is not None:
            out.update(predicted_te_model_s=te["predicted_s"], predicted_te_model_fwd_s=te["predicted_fwd_s"],
                       predicted_te_model_bwd_s=te["predicted_bwd_s"])
        return out


@dataclass
class TeA2AWorkload(HeadParallelWorkload):
    """``te-a2a``: TE's Ulysses over the whole CP group, the head-parallel engine at degree ``cp``
    (module docstring). ``predict``: TE's model of that schedule
    (:func:`~megatron_fcp.cost.te.simulate_te_a2a`, forward and backward: the all-to-alls exposed, the
    local windowed work of the whole sequence over cp) under the shape's mask."""

    def predict(self, topo: Topology, cm: ComputeModel) -> dict:
        if self.hp_plan is None:  # TE cannot run it here (heads, packed): nothing to price
            return {"predicted_s": None, "prediction_note": self.unavailable}
        s = self.shape
        kw = {"causal": s.causal, "window": s.window, "compute_model": cm}
        fwd = simulate_te_a2a(topo, self.ranks, s.attention(), **kw)
        bwd = simulate_te_a2a(topo, self.ranks, s.attention(), backward=True, **kw)
        return _sum(fwd, bwd)


@dataclass
class PackedHeadParallelWorkload(Workload):
    """``fcp-hp`` on a packed batch whose chosen degree is above 1: the packed head-parallel engine
    (:func:`~megatron_fcp.attention.head_parallel_thd.fcp_head_parallel_packed_attention`) over
    ``hp_plan``, each rank holding its tokens of the member placement.

    ``predict``: :class:`~megatron_fcp.cost.head_parallel_packed.PackedAsRun`, what the degree
    choice ranked it by (all-to-alls, the KV stage's forward, its backward in waves), with the
    emulated transport's timeline (:data:`GLOO_TCP`)."""

    hp_plan: PackedHeadParallelPlan | None = None
    backward_kv: str = "keep"
    requested_kv: str | None = None  # as FcpWorkload's

    @property
    def executor_kv(self) -> str:
        return self.requested_kv or self.backward_kv

    def predict(self, topo: Topology, cm: ComputeModel) -> dict:
        run = PackedAsRun(self.hp_plan, topo, self.shape.attention(), compute_model=cm, backward_kv=self.executor_kv,
                          **GLOO_TCP)
        r = run.result(per_wave=True)
        w = r["backward_waves"]
        return {"predicted_s": r["total_s"], "predicted_fwd_s": r["fwd_s"], "predicted_bwd_s": r["bwd_s"],
                "predicted_comm_s": run.forward.comm_s + run.exposed + sum(w["wave_reduce_s"]) + w["resend_s"],
                "predicted_compute_s": run.forward.compute_s + sum(w["wave_compute_s"]),
                "predicted_bwd_waves": w["waves"], "predicted_resend_s": w["resend_s"]}


def _te_a2a(shape: WorkloadShape, topo: Topology, ranks: tuple[int, ...]) -> Workload:
    """TE's a2a where TE can run it: heads and KV heads divisible by cp; one sequence (zigzag)."""
    name, cp = "te-a2a", len(ranks)
    why = None
    if shape.doc_lengths:
        why = ("not available: TE's a2a on packed batches (THD: its per-document chunks) is not emulated, only "
               "on Megatron's zigzag layout")
    elif shape.heads % cp or shape.kv_heads % cp:
        why = (f"not available: TE's a2a needs heads ({shape.heads}) and KV heads ({shape.kv_heads}) divisible by "
               f"the CP size {cp}")
    if why:
        return TeA2AWorkload(name, shape, ranks, unavailable=why)
    att, _ = pad_for_zigzag(shape.attention(), cp)
    hp = compile_head_parallel(topo, ranks, att, cp, "ring", causal=shape.causal,  # no KV stage: mask-free
                               head_groups=[ranks])  # one head group: the whole CP group, across nodes
    w = TeA2AWorkload(name, shape, ranks, hp_plan=hp, backward_kv="keep")
    w.info = {**_hp_info(w), "graph": f"a2a x{cp} (TE a2a)"}
    return w


def _window_refusal(name: str, shape: WorkloadShape) -> str | None:
    """TE's reason for not running ``te-p2p`` / ``te-a2a-p2p`` under the shape's window (None: it runs)."""
    comm = {"te-p2p": "p2p", "te-a2a-p2p": "a2a+p2p"}[name]
    try:
        te_refuses_window(comm, shape.causal, shape.window)
    except ValueError:
        return f"not available: TE refuses sliding windows with cp_comm_type={comm}"
    return None


def _hp_info(w: HeadParallelWorkload) -> dict:
    hp = w.hp_plan
    info = {"graph": f"a2a x{hp.degree}" + (f" + {hp.kv_plan.name}" if hp.kv_plan is not None else "")
            if hp.degree > 1 else (hp.kv_plan.name if hp.kv_plan is not None else "local"),
            "head_parallel": hp.degree, "head_groups": [list(g) for g in hp.head_groups],
            "kv_replication": hp.kv_replication, "backward_kv": w.backward_kv,
            "rounds": len(hp.kv_plan.rounds) if hp.kv_plan is not None else 0}
    if hp.auto is not None:
        info["auto_candidates"] = dict(hp.auto)
    return info


def _te_a2a_p2p(shape: WorkloadShape, topo: Topology, ranks: tuple[int, ...]) -> HeadParallelWorkload:
    """TE's a2a+p2p where TE can run it: equal ranks per node, heads and KV heads divisible by them."""
    name = "te-a2a-p2p"
    per_node = {topo.node_of(r) for r in ranks}
    rpn = len(ranks) // len(per_node)
    why = None
    if shape.doc_lengths:
        why = ("not available: TE's a2a+p2p on packed batches (THD: its per-document chunks, padded) is not emulated, "
               "only on Megatron's zigzag layout; "
               "TE's model is given")
    elif any(sum(topo.node_of(r) == n for r in ranks) != rpn for n in per_node):
        why = "not available: nodes hold different numbers of CP ranks (TE's a2a+p2p needs equal)"
    elif shape.heads % rpn or shape.kv_heads % rpn:
        why = (f"not available: TE's a2a needs heads ({shape.heads}) and KV heads ({shape.kv_heads}) divisible by the "
               f"{rpn} ranks per node")
    if why:
        return HeadParallelWorkload(name, shape, ranks, unavailable=why)
    att, _ = pad_for_zigzag(shape.attention(), len(ranks))
    hp = compile_head_parallel(topo, ranks, att, rpn, "ring", causal=shape.causal)
    w = HeadParallelWorkload(name, shape, ranks, hp_plan=hp, backward_kv="keep")
    w.info = _hp_info(w)
    return w


def fcp_hp_choice(shape: WorkloadShape, topo: Topology, ranks: tuple[int, ...], cm: ComputeModel) -> ScheduleChoice:
    """What the Megatron runtime settles for this shape and cluster
    (:func:`~megatron_fcp.patches.schedule.settle_schedule` under ``--fcp-head-parallel auto
    --fcp-graph auto --fcp-block-tokens 0``): :func:`~megatron_fcp.planning.choose_schedule` with
    the backward the executor runs (``--fcp-backward-kv`` = ``shape.backward_kv``, the ring's memory
    budget, ``b = 1``), partials in bf16, timed on the emulated compute model ``cm``, sends
    and links as gloo's over TCP are (:data:`GLOO_TCP`)."""
    return choose_schedule(topo, ranks, shape.attention(), causal=shape.causal, grad_dtype_bytes=DTYPE_BYTES,
                           backward=WaveBackward(shape.backward_kv, **GLOO_TCP), compute_model=cm,
                           window=shape.window)


def _choice_info(choice: ScheduleChoice) -> dict:
    """The choice as the runtime reports it (``schedule_report``: label, runner-up, predicted ms)."""
    from megatron_fcp.patches.schedule import schedule_report  # torch-free: the plugin's own report

    return {"choice": schedule_report(choice), "auto_candidates": dict(choice.plan.auto or ())}


def packed_hp_choice(shape: WorkloadShape, topo: Topology, ranks: tuple[int, ...],
                     cm: ComputeModel) -> tuple[PackedChoice, dict[int, float], dict]:
    """What the Megatron runtime runs on this packed batch under ``--fcp-head-parallel auto
    --fcp-graph auto --fcp-packed-layout auto`` (:meth:`~megatron_fcp.patches.runtime.FCPRuntime.packed_choice`):
    :func:`~megatron_fcp.planner.packed_choice.choose_packed_plan` over every degree whose
    head groups fit inside nodes, ``shape``'s block tokens and backward KV mode, timed on the
    emulated compute model with gloo's timeline (:data:`GLOO_TCP`). Returns the choice, the seconds
    of every degree simulated in FCP's layout and every choice's compiled plan."""
    plans: dict = {}
    choice, times = choose_packed_plan(topo, ranks, shape.doc_lengths, shape.attention(), graph="auto",
                                       causal=shape.causal, block_tokens=shape.block_tokens,
                                       compute_model=cm, plans=plans, backward_kv=shape.backward_kv, **GLOO_TCP)
    return choice, {c.degree: t for c, t in times.items() if c.layout == "fcp"}, plans


def _fcp_hp(name: str, shape: WorkloadShape, topo: Topology, ranks: tuple[int, ...], cm: ComputeModel,
            placement: Placement | None = None) -> Workload:
    """What the plugin runs (:func:`fcp_hp_choice`): degree 1 an :class:`FcpWorkload` over the chosen
    plan with its parts (the runtime's plain plan), degree > 1 the head-parallel engine over it. A
    packed batch: the runtime chooses its degree (:func:`packed_hp_choice`); degree 1 is
    ``fcp-auto``'s run under this name (graph ``auto`` over the placement), degree > 1 a
    :class:`PackedHeadParallelWorkload`. A windowed packed batch runs without the stage, as the
    runtime's windowed layers do."""
    if shape.doc_lengths:
        choice, times, plans = (PackedChoice(1), {}, {}) if shape.window else packed_hp_choice(shape, topo, ranks, cm)
        degree = choice.degree
        if degree == 1 and choice.layout == "thd":     # TE's layout, backward on TE's ring (Note [TE's layout as a candidate])
            graphs = layout_graphs(choice.layout, "auto")
            w = _fcp(name, graphs.forward, shape, topo, ranks, plans[choice].placement, backward_graph=graphs.backward)
            w.info.update(head_parallel=1, degree_times=times, layout="thd",
                          note="packed batch: the runtime's choice is TE's layout, its backward on TE's ring")
            return w
        if degree == 1:
            w = _fcp(name, "auto", shape, topo, ranks, placement)
            w.info.update(head_parallel=1, degree_times=times,
                          note="packed batch: the runtime's degree choice is 1 (graph auto over the placement)"
                          if not shape.window else "windowed packed batch: the runtime runs it without the stage")
            return w
        hp = plans[choice]
        w = PackedHeadParallelWorkload(name, shape, ranks, hp_plan=hp, requested_kv=shape.backward_kv)
        w.backward_kv = executor_program(shape.backward_kv, hp.kv_plan_for(0), sum(shape.doc_lengths),
                                         stage_shape(hp, shape.attention()).kv_heads, shape.head_dim).mode
        w.info = {"graph": f"a2a x{degree} + {hp.kv_plan.name}" if hp.kv_plan is not None else f"a2a x{degree}",
                  "head_parallel": degree, "head_groups": [list(g) for g in hp.head_groups],
                  "kv_replication": hp.kv_replication, "backward_kv": w.backward_kv,
                  "rounds": len(hp.kv_plan.rounds) if hp.kv_plan is not None else 0, "degree_times": times,
                  "layout": choice.layout}
        return w
    choice = fcp_hp_choice(shape, topo, ranks, cm)
    hp = choice.plan
    if hp.degree == 1:  # as the plugin does: no head-parallel stage, plain FCP over the chosen plan
        plan = hp.kv_plan_for(0)
        w: Workload = FcpWorkload(name, shape, ranks, plan=plan, backward_kv=_backward_kv_mode(shape, plan, None),
                                  requested_kv=shape.backward_kv)
        w.info = {"graph": plan.name, "head_parallel": 1, "rounds": len(plan.rounds),
                  "transfers": plan.num_transfers(), "parts_per_chunk": plan.parts_per_chunk,
                  "backward_kv": w.backward_kv}
    else:
        w = HeadParallelWorkload(name, shape, ranks, hp_plan=hp, backward_kv=_hp_backward_kv(shape, hp),
                                 requested_kv=shape.backward_kv)
        w.info = {**_hp_info(w), "stagger": choice.stagger}
        if choice.stagger > 1:
            w.info["graph"] += f", stagger {choice.stagger}"
    w.info.update(_choice_info(choice))
    if choice.backward_kv is not None and choice.backward_kv != w.backward_kv:  # both read the same plan: never
        w.info["note"] = (f"the planner priced backward {choice.backward_kv}, the executor runs {w.backward_kv} "
                          "(predicted_s prices what runs)")
    return w


def _fcp(name: str, graph: str, shape: WorkloadShape, topo: Topology, ranks: tuple[int, ...],
         placement: Placement | None, backward_graph: str | None = None) -> FcpWorkload:
    att = shape.attention()
    try:
        plan = build_plan(topo, ranks, graph, causal=shape.causal, parts_per_chunk=1 if placement else shape.parts,
                          seq_len=att.seq_len, heads=att.heads, kv_heads=att.kv_heads, head_dim=att.head_dim,
                          dtype_bytes=DTYPE_BYTES, objective="total", placement=placement,
                          window=shape.window, backward_graph=backward_graph)
    except (ValueError, TypeError) as e:
        return FcpWorkload(name, shape, ranks, unavailable=f"not available: {e}")
    w = FcpWorkload(name, shape, ranks, plan=plan, placement=placement, requested_kv=shape.backward_kv)
    w.backward_kv = _backward_kv_mode(shape, plan, placement)
    w.info = {"graph": plan.name, "rounds": len(plan.rounds), "transfers": plan.num_transfers(),
              "parts_per_chunk": plan.parts_per_chunk, "backward_kv": w.backward_kv}
    if plan.backward is not None:
        w.info["backward_graph"] = plan.backward.name
    if plan.auto is not None:
        w.info["auto_candidates"] = {n: t for n, t in plan.auto.times}
    return w


def executor_program(mode: str, plan: Plan, seq_len: int, kv_heads: int, head_dim: int) -> BackwardProgram:
    """The backward program ``fcp_attention_with_lse`` compiles for ``plan`` (``build_executor``,
    Note [Backward program]): ``mode`` against the ring's budget, blocks of a ``seq_len``-token
    (padded) sequence or of the placement, ``kv_heads`` x ``head_dim`` in bf16, b = 1."""
    return compile_backward(plan, 2 * kv_heads * head_dim * DTYPE_BYTES, BackwardPolicy(mode), seq_len=seq_len)


def _backward_kv_mode(shape: WorkloadShape, plan: Plan, placement: Placement | None) -> str:
    """The mode of :func:`executor_program` for an ``fcp-*`` workload over ``plan`` (over its
    placement when packed; else the zigzag padded to a multiple of ``2 * cp``, as the runner's
    shards are)."""
    seq = sum(shape.doc_lengths) if placement is not None else -(-shape.seq // (2 * plan.cp)) * (2 * plan.cp)
    return executor_program(shape.backward_kv, plan, seq, shape.kv_heads, shape.head_dim).mode


def _parse_name(name: str) -> tuple[str, str | None, int | None] | None:
    """``fcp-auto@keep/4`` -> ("fcp-auto", "keep", 4); None when the name is not valid."""
    m = re.fullmatch(r"([a-z0-9-]+)(?:@(auto|keep|resend))?(?:/([1-9][0-9]?))?", name)
    if m is None or m.group(1) not in WORKLOAD_NAMES or (m.group(1)[:4] != "fcp-" and (m.group(2) or m.group(3))):
        return None
    return m.group(1), m.group(2), int(m.group(3)) if m.group(3) else None


def make_workloads(names: list[str], shape: WorkloadShape, topo: Topology,
                   compute_model: ComputeModel | None = None) -> list[Workload]:
    """The workloads ``names`` on ``topo`` (all of its ranks form the CP group); plans built here.
    ``compute_model``: what ``fcp-hp``'s planner times candidates with (the emulated FLOP/s; default
    the cost model's GPU)."""
    unknown = [n for n in names if _parse_name(n) is None]
    if unknown:
        raise ValueError(f"--workloads: unknown {unknown}; choose from {', '.join(WORKLOAD_NAMES)} "
                         f"(an fcp-* name may end in @keep, @resend or @auto, then /PARTS)")
    if any(n.startswith("fcp-hp/") or (n.startswith("fcp-hp@") and "/" in n) for n in names):
        raise ValueError("--workloads: fcp-hp takes no /PARTS (the planner picks sub-blocks or stagger); "
                         "drop the suffix")
    ranks = tuple(range(topo.world))
    placement = None
    if shape.doc_lengths:
        placement = place_batch(topo, ranks, list(shape.doc_lengths), block_tokens=shape.block_tokens,
                                causal=shape.causal, window=shape.window)
    out: list[Workload] = []
    for n in names:
        refused = _window_refusal(n, shape) if n in ("te-p2p", "te-a2a-p2p") else None
        if refused and n == "te-p2p":
            out.append(TeP2PWorkload(n, shape, ranks, unavailable=refused))
        elif refused:
            out.append(HeadParallelWorkload(n, shape, ranks, unavailable=refused))
        elif n == "te-p2p":
            out.append(TeP2PWorkload(n, shape, ranks, info={"graph": "ring (TE p2p)", "rounds": len(ranks) - 1}))
        elif n == "te-a2a":
            out.append(_te_a2a(shape, topo, ranks))
        elif n == "te-a2a-p2p":
            out.append(_te_a2a_p2p(shape, topo, ranks))
        else:
            base, mode, parts = _parse_name(n)
            own = replace(shape, backward_kv=mode or shape.backward_kv, parts=parts or shape.parts)
            if base == "fcp-hp":
                out.append(_fcp_hp(n, own, topo, ranks, compute_model or ComputeModel(), placement))
            else:
                out.append(_fcp(n, base[len("fcp-"):], own, topo, ranks, placement))
    return out


def lower_bounds(shape: WorkloadShape, topo: Topology, cm: ComputeModel, placement_plan: Plan | None = None) -> dict:
    """The configuration's lower bounds (module docstring): ``lower_bound_s`` (dK/dV at the KV's
    bytes) and its parts. ``placement_plan``: a plan over the placement (packed batches; any graph,
    only its placement is used). ``lower_bound_all_families_s``: the same over every head-parallel
    degree (zigzag: :func:`~megatron_fcp.planning.lower_bound_all`; packed, unwindowed:
    :func:`~megatron_fcp.planner.compare.packed_lower_bound_all` over the placement each degree
    runs, :func:`~megatron_fcp.planner.head_parallel.packed_degree_plan`), with the same compute."""
    att = shape.attention()
    ranks = tuple(range(topo.world))
    N = len(ranks)
    mask = shape.mask
    if shape.doc_lengths:
        pl = placement_plan.placement
        comm_fwd = packed_need_stats(placement_plan, topo, att)["lower_bound_s"]
        pairs = float(sum(int(mask.pairs(0, L, 0, L)) for L in pl.doc_lengths))
    else:
        comm_fwd = lower_bound(topo, ranks, att, causal=shape.causal, window=shape.window)["lower_bound_s"]
        S = -(-att.seq_len // (2 * N)) * (2 * N)
        pairs = float(mask.pairs(0, S, 0, S))
    if cm.kernel is not None:  # tiles: the per-pair lower bound of each pass (ComputeModel.pair_s)
        compute = pairs / N * (cm.pair_s(att) + cm.pair_s(att, BACKWARD_FLOP_RATIO))
    else:
        flop_s = 4.0 * att.heads * att.head_dim / cm.flops
        compute = pairs / N * flop_s * (1 + BACKWARD_FLOP_RATIO)
    comm = 2 * comm_fwd  # the dK/dV reduction moves the forward's bytes back (partials in the KV dtype)
    out = {"lower_bound_s": max(compute, comm), "lower_bound_compute_s": compute, "lower_bound_comm_s": comm,
           "lower_bound_comm_fwd_s": comm_fwd}
    if not shape.doc_lengths and not mask.windowed:  # every family (head-parallel degrees too); comm then compute,
        # as the KV-only bound (lower_bound_all has no windowed form: under a window only degree 1 is planned)
        fam = lower_bound_all(topo, ranks, att, causal=shape.causal, pass_="fwd+bwd")
        out["lower_bound_all_families_s"] = max(compute, fam["lower_bound_s"])
        out["lower_bound_all_families_degree"] = fam["degree"]
    elif shape.doc_lengths and not mask.windowed:  # Note [Packed lower bound over degrees]
        plans = {a: placement_plan if a == 1 else
                 packed_degree_plan(topo, ranks, shape.doc_lengths, att, a, graph="full", causal=shape.causal,
                                    block_tokens=shape.block_tokens)
                 for a in head_parallel_degrees(topo, ranks, att.heads, att.kv_heads)}
        fam = packed_lower_bound_all(plans, topo, att)
        out["lower_bound_all_families_s"] = max(compute, fam["lower_bound_s"])
        out["lower_bound_all_families_degree"] = fam["degree"]
        out["lower_bound_per_degree_s"] = {str(a): max(compute, t) for a, t in fam["per_degree"].items()}
    return out
