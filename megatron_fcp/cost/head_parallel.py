"""Forward and backward of every schedule on the cost model, the head-parallel stage included, and
the lower bound over every schedule family compared. Pure, no torch.

The model is :mod:`megatron_fcp.cost.model`'s (Note [Cost model]); backward timelines are
:mod:`megatron_fcp.cost.backward`'s.

Note [Head-parallel cost]
-------------------------
A :class:`~megatron_fcp.contract.head_parallel.HeadParallelPlan` of degree ``a`` (``L2 = seq/cp``
tokens per rank, ``rep`` = its KV replication) is timed as three stages back to back, each a
contention-aware round of :func:`~megatron_fcp.cost.model.simulate_rounds` or a plan:

======== ====================================================== ===============================================
pass     all-to-all in (every ordered pair of a head group)       all-to-all out
======== ====================================================== ===============================================
forward  Q, K, V: ``(q(L2) + rep * kv(L2)) / a``                 O: ``q(L2) / a``
backward dO: ``q(L2) / a``                                       dQ, dK, dV: ``(q(L2) + rep * kv(L2)) / a``
======== ====================================================== ===============================================

(``q(t)`` = bytes of ``t`` tokens of all query heads, ``kv(t)`` of K and V of all KV heads; LSE and
softmax statistics, under 2% of O at d = 128, are not counted.) Between them the KV stage runs: the
:func:`~megatron_fcp.planner.head_parallel.stage_plan` (all ``a`` stages at once, sharing
links) with ``h/a`` query and ``rep * h_kv / a`` KV heads, forward through
:func:`~megatron_fcp.cost.model.simulate_plan` (overlapped with compute) and backward through
:func:`~megatron_fcp.cost.backward.simulate_plan_backward` (dK/dV partials along the
reversed trees in the input dtype, as the executor sends them, in the executor's order). The
all-to-alls are exposed, as in Transformer Engine, but for two: with a KV stage the engine sends
K|V's part of the forward's first all-to-all ahead and Q's behind the stage's start (Note [Q's
all-to-all behind the KV stage] in :mod:`megatron_fcp.attention.head_parallel`), so the stage's
transfers start after K|V's all-to-all and its compute after Q's too; and the backward's last
all-to-all sends dQ's part at the stage's last job, dK|dV's after the stage (Note [dQ's all-to-all
ahead of dK|dV's]), so only what of dQ's outlasts the stage's tail (its end less its last job's
end, ``jobs_end_s`` of the backward's timeline, one pass or the executor's) adds to dK|dV's
(``overlap_q`` for both; the links are the intra-node ones, taken as free of the stage's
traffic).
``a = 1`` is plain FCP (no all-to-all); ``a = cp`` is TE's ``a2a`` (no KV stage).

That backward is one pass from kept KV. The executor walks it in waves (Note [Backward waves] in
:mod:`megatron_fcp.attention.backward_waves`), keeping or re-sending KV; given ``backward`` (a
:class:`~megatron_fcp.schedule.waves.WaveBackward`) the KV stage's backward is timed that way
(:func:`~megatron_fcp.cost.backward.simulate_backward_waves`), which is what the Megatron
runtime prices its choice with. It can differ a lot: with whole chunks a wave gives some ranks
twice the work of others (128K on ``dgx-h100:2``, a = 1, hierarchical: backward 55 ms in one pass,
88 ms in waves; two parts per chunk: 55.5 ms).

Note [Lower bound over schedule families]
-----------------------------------------
The bound :func:`lower_bound_all` reports is the least, over every head-parallel degree ``a`` the
planner may use (``a = 1``: KV distribution alone), of that family's bound for the pass:

* **all-to-alls**: each rank receives ``(a-1)`` peers' shares (the table above) through its own
  ingress (``B_gpu``: NVLink/PCIe max-flow into the GPU from its node), in and out;
* **KV stage** (forward): the need-set bound of :func:`~megatron_fcp.cost.te.lower_bound`
  on the stage placement: the most bytes any rank needs over its ingress, and the most bytes any
  node needs from outside (each block once) over the node's NIC ingress; backward the same need sets
  carry gradients, counted in the KV dtype (TE's ring returns dKV in the input dtype, and so does
  FCP's executor: the bound is the least any compared schedule could send).

A family's stages run one after another, so its bound is their sum, but for Q's part of the
forward's first all-to-all and dQ's part of the backward's last when there is a KV stage: they can
cross the intra-node links while the stage moves KV (Notes [Q's all-to-all behind the KV stage]
and [dQ's all-to-all ahead of dK|dV's]), so those two count K|V's part only.
Ulysses-style schedules move Q and O instead of all KV, which is why a KV-only bound (the old one)
could sit above them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

from megatron_fcp.contract.head_parallel import (
    LOCAL_STAGE,
    HeadParallelPlan,
    check_head_parallel,
    stage_placement,
    stage_plan,
    topology_head_groups,
)
from megatron_fcp.contract.plan import Plan, check_cp_ranks
from megatron_fcp.cost.backward import (chain_compute_floor, resend_limits, simulate_backward_waves, simulate_plan_backward,
                                        wave_backward_floor)
from megatron_fcp.cost.floors import backward_compute_floor, compute_floor, kv_floor, reduction_floor
from megatron_fcp.cost.model import (
    BACKWARD_FLOP_RATIO,
    AttentionShape,
    ComputeModel,
    SimResult,
    pad_for_zigzag,
    simulate_plan,
    simulate_rounds,
)
from megatron_fcp.cost.te import simulate_te_a2a_p2p, simulate_te_a2a_p2p_thd, simulate_te_p2p, simulate_te_p2p_thd
from megatron_fcp.schedule.chains import is_chain_plan
from megatron_fcp.schedule.program import WaveBackward
from megatron_fcp.topology import Topology, load_topology

__all__ = ["PASSES", "check_pass", "combine", "simulate_head_parallel", "HeadParallelPricing", "degree_floor",
           "simulate_te", "a2a_messages", "stage_shape"]

PASSES = ("fwd", "bwd", "fwd+bwd")


def check_pass(pass_: str) -> str:
    if pass_ not in PASSES:
        raise ValueError(f"pass: must be one of {', '.join(PASSES)}, got {pass_!r}")
    return pass_


def combine(name: str, parts: Sequence[SimResult], meta: dict | None = None) -> SimResult:
    """Stages run back to back: seconds, bytes and rounds add up; per-resource bytes merge."""
    res = SimResult(name, sum(p.comm_s for p in parts), sum(p.compute_s for p in parts),
                    sum(p.total_s for p in parts), sum(p.bytes for p in parts), sum(p.rounds for p in parts))
    for p in parts:
        for k, b in p.resource_bytes.items():
            res.resource_bytes[k] = res.resource_bytes.get(k, 0.0) + b
            res.resource_bandwidth[k] = p.resource_bandwidth[k]
    for p in parts:
        res.meta.update({k: v for k, v in p.meta.items() if k not in res.meta})
    res.meta.update(meta or {})
    return res


def a2a_messages(hp: HeadParallelPlan, shape: AttentionShape, which: str) -> list[tuple[int, int, float]]:
    """``(src, dst, bytes)`` of one all-to-all of ``hp``'s head groups; see Note [Head-parallel cost].
    ``which``: ``"qkv"`` (forward in, and dQ/dK/dV backward out), ``"q"`` (Q in, O out, dO in) or
    ``"kv"`` (K|V in, ahead of Q: Note [Q's all-to-all behind the KV stage])."""
    if which not in ("qkv", "q", "kv"):
        raise ValueError(f"which: 'qkv', 'q' or 'kv', got {which!r}")
    a, L2 = hp.degree, shape.seq_len / hp.cp
    per = (shape.q_bytes(L2) / a if which != "kv" else 0.0) + \
        (shape.kv_bytes(L2) * hp.kv_replication / a if which != "q" else 0.0)
    return [(s, d, per) for g in hp.head_groups for s in g for d in g if s != d]


def simulate_head_parallel(
    hp: HeadParallelPlan,
    topology: "Topology | str",
    shape: AttentionShape,
    *,
    pass_: str = "fwd+bwd",
    causal: bool = True,
    compute_model: ComputeModel | None = None,
    round_overhead_s: float = 0.0,
    backward_flop_ratio: float = BACKWARD_FLOP_RATIO,
    grad_dtype_bytes: int | None = None,
    name: str = "fcp",
    backward: WaveBackward | None = None,
    overlap_q: bool = True,
) -> SimResult:
    """Time ``hp`` for ``pass_`` (``fwd``, ``bwd`` or ``fwd+bwd``); see Note [Head-parallel cost].
    ``overlap_q`` (the engine's default): with a KV stage, K|V's all-to-all first and Q's behind the
    stage's start (the stage computes once Q is in; Note [Q's all-to-all behind the KV stage]);
    False: one Q|K|V all-to-all before the stage (TE's a2a+p2p).
    ``meta``: ``graph``, ``head_parallel`` (the degree), ``parts_per_chunk``, ``kv_replication``,
    ``pass``, and per pass ``fwd_total_s`` / ``bwd_total_s`` where computed. ``grad_dtype_bytes``:
    bytes per element of the dK/dV partials the KV stage returns (default ``shape.dtype_bytes``: the
    input dtype, what the executor sends, as Transformer Engine's ring sends dKV; 4 prices FP32
    partials). ``backward``: None times the KV stage's backward in one pass from kept KV; a
    :class:`~megatron_fcp.schedule.waves.WaveBackward` times it as the executor runs it, wave by wave
    with KV kept or re-sent as the executor decides (:func:`_wave_backward`; ``meta["backward_kv"]``
    is the mode priced)."""
    return HeadParallelPricing(hp, topology, shape, pass_=pass_, causal=causal, compute_model=compute_model,
                               round_overhead_s=round_overhead_s, backward_flop_ratio=backward_flop_ratio,
                               grad_dtype_bytes=grad_dtype_bytes, name=name, backward=backward,
                               overlap_q=overlap_q).result()


class HeadParallelPricing:
    """:func:`simulate_head_parallel` in two steps, so a search can stop after the cheap one: the
    forward is priced at construction; :meth:`floor` is a lower bound on :meth:`result`'s
    ``total_s`` from the forward's exact time and a floor on the backward (Note [Backward floors]
    in :mod:`megatron_fcp.cost.floors`; the all-to-alls exact); :meth:`result` prices
    the backward (the expensive step) and returns what :func:`simulate_head_parallel` returns.
    ``one_pass=False`` (a search that needs only times: :func:`~megatron_fcp.planner.choose.choose_schedule`):
    where the backward is priced as the executor runs it (``backward``), the one-pass backward it is
    otherwise reported beside is not priced; times and communication are the same, the stage's
    backward bytes and ``one_pass_bwd_s`` are left out."""

    def __init__(self, hp: HeadParallelPlan, topology: "Topology | str", shape: AttentionShape, *,
                 pass_: str = "fwd+bwd", causal: bool = True, compute_model: ComputeModel | None = None,
                 round_overhead_s: float = 0.0, backward_flop_ratio: float = BACKWARD_FLOP_RATIO,
                 grad_dtype_bytes: int | None = None, name: str = "fcp", backward: WaveBackward | None = None,
                 overlap_q: bool = True, one_pass: bool = True) -> None:
        check_pass(pass_)
        self.hp, self.pass_, self.name, self.backward, self.overlap_q = hp, pass_, name, backward, overlap_q
        self.one_pass = one_pass
        self._floors: dict[str, float] = {}
        self.topo = topo = load_topology(topology)
        self.cm = cm = compute_model or ComputeModel()
        self.round_overhead_s, self.backward_flop_ratio = round_overhead_s, backward_flop_ratio
        self.grad_dtype_bytes = grad_dtype_bytes
        shape, padded = pad_for_zigzag(shape, hp.cp)
        self.shape = shape
        self.sp = sp = stage_plan(hp, shape.seq_len, causal)
        self.sshape = sshape = stage_shape(hp, shape) if hp.degree > 1 else shape
        self.a2a = a2a = hp.degree > 1
        self._a2a_cache: dict[str, SimResult] = {}
        rounds = self._rounds
        meta = {"graph": sp.name if hp.degree == 1 else (hp.kv_plan.name if hp.kv_plan else LOCAL_STAGE),
                "head_parallel": hp.degree, "parts_per_chunk": sp.parts_per_chunk,
                "kv_replication": hp.kv_replication, "pass": pass_}
        if padded:
            meta["padded_seq_len"] = shape.seq_len
        self.meta = meta
        self.out: list[SimResult] = []
        if pass_ in ("fwd", "fwd+bwd"):
            if overlap_q and a2a and hp.kv_plan is not None:
                q_in = rounds("q", "a2a-in-q")[0]            # on the intra links while the stage's KV moves
                kv = simulate_plan(sp, topo, sshape, compute_model=cm, round_overhead_s=round_overhead_s, name=name,
                                   compute_from_s=q_in.total_s)
                hidden = SimResult("a2a-in-q", 0.0, 0.0, 0.0, q_in.bytes, q_in.rounds, dict(q_in.resource_bytes),
                                   dict(q_in.resource_bandwidth))   # its bytes count, its time is in the stage's
                fwd = combine(name, rounds("kv", "a2a-in-kv") + [hidden, kv] + rounds("q", "a2a-out"))
            else:
                kv = simulate_plan(sp, topo, sshape, compute_model=cm, round_overhead_s=round_overhead_s, name=name)
                fwd = combine(name, rounds("qkv", "a2a-in") + [kv] + rounds("q", "a2a-out"))
            meta["fwd_total_s"] = fwd.total_s
            meta["fwd_comm_s"] = fwd.comm_s
            self.out.append(fwd)

    def _rounds(self, which: str, label: str) -> list[SimResult]:
        if not self.a2a:
            return []
        key = which + "/" + label
        if key not in self._a2a_cache:
            self._a2a_cache[key] = simulate_rounds(self.topo, [a2a_messages(self.hp, self.shape, which)],
                                                   self.round_overhead_s, name=label)
        return [self._a2a_cache[key]]

    def _a2a_s(self, which: str) -> float:
        return self._rounds(which, "a2a-" + which)[0].total_s if self.a2a else 0.0

    def floor(self) -> float:
        """A lower bound on :meth:`result`'s ``total_s``: the forward as priced plus a floor on the
        backward (its all-to-alls exact, the KV stage's floor of Note [Backward floors])."""
        if "floor" not in self._floors:
            self._floors["floor"] = self._floor(None)
        return self._floors["floor"]

    def tight_floor(self) -> float:
        """:meth:`floor`, raised where the KV stage's backward streams as chains by the sum of its
        steps' busiest compute (:func:`~megatron_fcp.cost.backward.chain_compute_floor`: the
        backward's program is compiled, its messages not priced; staggered rings compute unevenly
        per step). For a search, after :meth:`floor` has not ruled the candidate out; the program
        is what :meth:`result` reads."""
        if "tight" not in self._floors:
            chain = None
            if self.pass_ != "fwd" and self.chain():
                b = self.backward
                chain = chain_compute_floor(self.sp, self.sshape, compute_model=self.cm, backward_kv=b.backward_kv,
                                            kv_memory_budget=b.kv_memory_budget, micro_batch=b.micro_batch)
            self._floors["tight"] = self.floor() if chain is None else max(self.floor(), self._floor(chain))
        return self._floors["tight"]

    def packed_floor(self) -> float:
        """:meth:`tight_floor`, raised where the KV stage's backward runs in waves by the wave loop's
        chains of posts and completions (:func:`~megatron_fcp.cost.backward.wave_backward_floor`):
        the waves are packed (what :meth:`result` reads next), their messages not simulated. For a
        search, after :meth:`tight_floor` has not ruled the candidate out."""
        if "packed" not in self._floors:
            b, sp = self.backward, self.sp
            wave = None
            if self.packs():
                wave = wave_backward_floor(sp, self.topo, self.sshape, compute_model=self.cm,
                                           backward_kv=b.backward_kv, grad_dtype_bytes=self.grad_dtype_bytes,
                                           round_overhead_s=self.round_overhead_s,
                                           kv_memory_budget=b.kv_memory_budget, micro_batch=b.micro_batch,
                                           buffered_sends=b.buffered_sends)
            self._floors["packed"] = self.tight_floor() if wave is None else max(self.tight_floor(), self._floor(wave))
        return self._floors["packed"]

    def packs(self) -> bool:
        """Whether :meth:`packed_floor` has more to say than :meth:`tight_floor` (the backward is
        priced as the executor runs it and runs in waves)."""
        return self.pass_ != "fwd" and self.backward is not None and self.hp.kv_plan is not None \
            and bool(self.sp.rounds) and not self.chain()

    def _reduction(self) -> float:
        """The reduction floor; for a backward in waves that re-sends KV, with the KV again on every
        resource, less what the receivers may keep (what the program will decide, read before the
        waves are packed, on the program's token bytes: :func:`~megatron_fcp.cost.backward.resend_limits`)."""
        if "reduction" not in self._floors:
            b = self.backward
            limits = resend_limits(self.sp, self.sshape, backward_kv=b.backward_kv,
                                   kv_memory_budget=b.kv_memory_budget, micro_batch=b.micro_batch) \
                if self.packs() else None
            self._floors["reduction"] = reduction_floor(self.sp, self.topo, self.sshape,
                                                        self.grad_dtype_bytes or self.sshape.dtype_bytes,
                                                        resend_limits=limits)
        return self._floors["reduction"]

    def known_floor(self) -> float:
        """The tightest floor computed so far (:meth:`packed_floor`, :meth:`tight_floor` once asked,
        else :meth:`floor`)."""
        return self._floors.get("packed", self._floors.get("tight", self.floor()))

    def chain(self) -> bool:
        """Whether the KV stage's backward is priced as the executor runs it and may stream as chains."""
        if "chain" not in self._floors:
            hp, sp = self.hp, self.sp
            self._floors["chain"] = bool(self.backward is not None and hp.kv_plan is not None and sp.rounds
                                         and is_chain_plan(sp))
        return bool(self._floors["chain"])

    def _floor(self, backward_s: float | None) -> float:
        t = sum(p.total_s for p in self.out)
        if self.pass_ == "fwd":
            return t
        sp, sshape = self.sp, self.sshape
        ratio = min(self.backward_flop_ratio, BACKWARD_FLOP_RATIO) if self.backward is not None \
            else self.backward_flop_ratio
        stage = backward_compute_floor(sp, sshape, self.cm, ratio, waves=self.packs()) if not sp.kv_sizes else 0.0
        if sp.num_rounds and not self.chain():  # a chain's partials travel the forward's direction
            stage = max(stage, self._reduction())
        if backward_s is not None:   # the KV stage's backward as the executor runs it (tight_floor)
            stage = max(stage, backward_s)
        if self.a2a:
            last = "kv" if self.overlap_q else "qkv"  # dQ's part may hide behind the stage's tail
            stage += self._a2a_s("q") + self._a2a_s(last)
        return (t + stage) * (1 - 1e-9)

    def result(self) -> SimResult:
        """The full pricing (:func:`simulate_head_parallel`'s result)."""
        hp, sp, sshape, topo, cm, name = self.hp, self.sp, self.sshape, self.topo, self.cm, self.name
        backward, round_overhead_s, grad_dtype_bytes = self.backward, self.round_overhead_s, self.grad_dtype_bytes
        rounds, meta, out = self._rounds, dict(self.meta), list(self.out)
        if self.pass_ in ("bwd", "fwd+bwd"):
            executor = backward is not None and hp.kv_plan is not None and sp.rounds   # a = cp: no executor, no waves
            if executor and not self.one_pass:   # its times are replaced below: only a search's answer is wanted
                kv = SimResult(name, 0.0, 0.0, 0.0, 0.0, 0)
            else:
                kv = simulate_plan_backward(sp, topo, sshape, compute_model=cm,
                                            backward_flop_ratio=self.backward_flop_ratio,
                                            round_overhead_s=round_overhead_s, name=name,
                                            grad_dtype_bytes=grad_dtype_bytes)
            if executor:
                kv = _wave_backward(kv, sp, topo, sshape, cm, backward, grad_dtype_bytes, round_overhead_s)
                if not self.one_pass:
                    del kv.meta["one_pass_bwd_s"]
                meta["backward_kv"] = kv.meta["backward_kv"]
                meta["backward_form"] = kv.meta["backward_form"]
            jobs_end = kv.meta.pop("jobs_end_s", None)
            if self.overlap_q and self.a2a and jobs_end is not None:  # dQ's all-to-all ahead of dK|dV's, from the last job
                dq, dkv = rounds("q", "a2a-dq")[0], rounds("kv", "a2a-dkv")[0]
                exposed = max(0.0, dq.total_s - (kv.total_s - jobs_end))   # what the stage's tail does not cover
                dq_part = SimResult("a2a-dq", exposed, 0.0, exposed, dq.bytes, dq.rounds, dict(dq.resource_bytes),
                                    dict(dq.resource_bandwidth))
                bwd = combine(name, rounds("q", "a2a-dout") + [kv, dq_part, dkv])
            else:
                bwd = combine(name, rounds("q", "a2a-dout") + [kv] + rounds("qkv", "a2a-dqkv"))
            meta["bwd_total_s"] = bwd.total_s
            meta["bwd_comm_s"] = bwd.comm_s
            out.append(bwd)
        meta["transfers"] = sp.num_transfers()
        return combine(name, out, meta)


def _wave_backward(one_pass: SimResult, sp: Plan, topo: Topology, shape: AttentionShape, cm: ComputeModel,
                   backward: WaveBackward, grad_dtype_bytes: int, round_overhead_s: float) -> SimResult:
    """The KV stage's backward as the executor runs it
    (:func:`~megatron_fcp.cost.backward.simulate_backward_waves` on the stage plan ``sp``: all
    ``a`` stages at once, each cut into the waves its executor walks; ``one_pass``: the same
    stage's one-pass backward, whose dK/dV bytes the waves send too). ``total_s`` is the waves'
    time, ``compute_s`` the sum over waves of the busiest rank's, ``comm_s`` the reductions and
    re-sends; ``backward_kv`` in ``meta`` is the mode the executor picks for ``backward``."""
    w = simulate_backward_waves(sp, topo, shape, compute_model=cm, backward_kv=backward.backward_kv,
                                grad_dtype_bytes=grad_dtype_bytes, round_overhead_s=round_overhead_s,
                                kv_memory_budget=backward.kv_memory_budget, micro_batch=backward.micro_batch,
                                buffered_sends=backward.buffered_sends, held_routes=backward.held_routes)
    one_pass.meta.update(backward_kv=w["backward_kv"], backward_waves=w["waves"], resend_s=w["resend_s"],
                         one_pass_bwd_s=one_pass.total_s, backward_form=w.get("backward", "waves"),
                         jobs_end_s=w["jobs_end_s"])
    one_pass.total_s = w["bwd_s"]
    one_pass.compute_s = float(sum(w["wave_compute_s"]))
    one_pass.comm_s = float(sum(w["wave_reduce_s"]) + w["resend_s"])
    return one_pass


def simulate_te(
    which: str,
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    pass_: str = "fwd+bwd",
    causal: bool = True,
    compute_model: ComputeModel | None = None,
    round_overhead_s: float = 0.0,
    backward_flop_ratio: float = BACKWARD_FLOP_RATIO,
) -> SimResult:
    """Transformer Engine's ``te-p2p`` or ``te-a2a-p2p`` for ``pass_``: the forward of
    :mod:`~megatron_fcp.cost.te`, the backward of
    :mod:`~megatron_fcp.cost.backward` (one document: the zigzag split). Raises ValueError
    where TE cannot run ``te-a2a-p2p``."""
    check_pass(pass_)
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cm = compute_model or ComputeModel()
    shape, _ = pad_for_zigzag(shape, len(ranks))
    kw = dict(causal=causal, compute_model=cm, round_overhead_s=round_overhead_s)
    fwd_fn, bwd_fn = {"te-p2p": (simulate_te_p2p, simulate_te_p2p_thd),
                      "te-a2a-p2p": (simulate_te_a2a_p2p, simulate_te_a2a_p2p_thd)}[which]
    out = []
    meta: dict = {"pass": pass_}
    if pass_ in ("fwd", "fwd+bwd"):
        f = fwd_fn(topo, ranks, shape, **kw)
        meta.update(fwd_total_s=f.total_s, fwd_comm_s=f.comm_s)
        out.append(f)
    if pass_ in ("bwd", "fwd+bwd"):
        b = bwd_fn(topo, ranks, [shape.seq_len], shape, backward=True, backward_flop_ratio=backward_flop_ratio, **kw)
        for k in ("padded_tokens", "padding_overhead", "work_max_over_mean"):
            b.meta.pop(k, None)
        meta.update(bwd_total_s=b.total_s, bwd_comm_s=b.comm_s)
        out.append(b)
    return combine(which, out, meta)


def degree_floor(topology: "Topology | str", cp_ranks: Sequence[int], shape: AttentionShape, degree: int, *,
                 pass_: str = "fwd+bwd", causal: bool = True, compute_model: ComputeModel | None = None,
                 round_overhead_s: float = 0.0, backward_flop_ratio: float = BACKWARD_FLOP_RATIO,
                 backward: WaveBackward | None = None, overlap_q: bool = True, kv_s: float | None = None) -> float:
    """A lower bound on :func:`simulate_head_parallel`'s ``total_s`` for every plan of ``degree``
    on these ranks (any KV-stage graph, stagger or sub-blocks), before any is compiled: the
    all-to-alls exact, the forward's stage the larger of its KV floor and its compute after Q is
    in, the backward's stage its compute (Note [Backward floors] in
    :mod:`megatron_fcp.cost.floors`). ``kv_s``: a floor on the forward stage's KV time known for
    the plans bounded (one graph's: :func:`~megatron_fcp.cost.floors.graph_kv_floor`), taken where
    it is above the placement's."""
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cm = compute_model or ComputeModel()
    shape, _ = pad_for_zigzag(shape, len(ranks))
    rep = check_head_parallel(shape.heads, shape.kv_heads, degree, len(ranks))
    groups = tuple((r,) for r in ranks) if degree == 1 else topology_head_groups(topo, ranks, degree)
    # the head groups alone (no KV plan yet): what the all-to-alls, the stage's placement and shape read
    hp = SimpleNamespace(ranks=ranks, cp=len(ranks), degree=degree, head_groups=groups, kv_replication=rep)
    staged = len(groups) > 1
    placement = stage_placement(hp, shape.seq_len, causal) if degree > 1 else None
    sshape = stage_shape(hp, shape) if degree > 1 else shape

    def a2a(which: str) -> float:
        return simulate_rounds(topo, [a2a_messages(hp, shape, which)], round_overhead_s).total_s if degree > 1 else 0.0

    t = 0.0
    if pass_ in ("fwd", "fwd+bwd"):
        work = compute_floor(placement, len(ranks), sshape, causal, cm, 1.0, launches=True)
        kv = kv_floor(topo, ranks, placement, shape.seq_len, causal, sshape.kv_bytes(1)) if staged else 0.0
        kv = max(kv, kv_s or 0.0)
        if degree > 1 and overlap_q and staged:
            t += a2a("kv") + max(kv, a2a("q") + work) + a2a("q")
        else:
            t += a2a("qkv") + max(kv, work) + a2a("q")
    if pass_ in ("bwd", "fwd+bwd"):
        ratio = min(backward_flop_ratio, BACKWARD_FLOP_RATIO) if backward is not None else backward_flop_ratio
        t += compute_floor(placement, len(ranks), sshape, causal, cm, ratio, launches=True)
        if degree > 1:
            t += a2a("q") + a2a("kv" if overlap_q else "qkv")
    return t * (1 - 1e-9)


def stage_shape(hp: HeadParallelPlan, shape: AttentionShape) -> AttentionShape:
    """The attention shape one KV stage works on: ``h/a`` query heads, ``h_kv * rep / a`` KV heads."""
    a = hp.degree
    return AttentionShape(shape.seq_len, shape.heads // a, shape.kv_heads * hp.kv_replication // a,
                          shape.head_dim, shape.dtype_bytes, shape.v_head_dim)
