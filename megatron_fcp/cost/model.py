"""Cost model: plans and baselines on a Topology, at the level of shared resources. Pure, no torch.

Note [Cost model]
-----------------
*Communication* uses a **per-round bottleneck** alpha-beta model (not fluid max-min sharing):
the messages of one round run concurrently; each message loads every resource on its route
(:meth:`Topology.route`) with its bytes; the round lasts

    max over resources R of  bytes(R) / bandwidth(R)   +   max route latency in the round
                                                       +   round_overhead_s (default 0)

and rounds run back to back (each rank waits for its transfers of a round before it posts the
next; modelled as a barrier). The alpha of the alpha-beta model is the route latency, paid once
per round; ``round_overhead_s`` adds a fixed launch/sync cost per round for sensitivity studies
(5 us per round costs a 9-round plan about 4% at 128K tokens on 4 DGX-H100 nodes). Resources are shared fairly and fully used within a round
(optimistic), a slow message holds its round back (pessimistic). The same model times FCP plans
and the baselines, so their ratios compare like with like.

*Compute* is forward block attention at ``flops`` FLOP/s: ``2 * pairs * heads * (head_dim +
v_head_dim)`` FLOPs (``QK^T`` on ``head_dim``, ``PV`` on ``v_head_dim``; ``4 * pairs * heads *
head_dim`` when they are equal, MLA aside: :attr:`AttentionShape.pair_flops`) where ``pairs``
counts (query, key) token pairs the plan's mask (causal, full or a sliding window: ``plan.mask``)
allows between the rank's zigzag query chunks and the block (exact integer count,
:meth:`~megatron_fcp.contract.mask.Mask.pairs`), plus ``kernel_overhead_s`` per block.

*Overlap*: a rank computes its own blocks from t=0 (one kernel), then each received block in plan
order, starting no earlier than its arrival: ``end = max(end, arrival) + compute(block)``. A
message of round k arrives at ``start(k) + latency + max over its route of busy(R, k)`` (so a
block on an idle NVLink lands before the round's NIC bottleneck drains). Blocks of one owner
reaching a rank in the same round share one kernel launch (``kernel_overhead_s``), as TE computes
one step's KV pair in one call. The overlapped total is the latest rank's end (never less than
the communication time).

Baselines (Transformer Engine's schedules) and the lower bound are in
:mod:`megatron_fcp.cost.te`; :mod:`megatron_fcp.planner.compare` sets them side by side.

*Sequence lengths* that ``2*cp`` does not divide are padded up to the next multiple, as Megatron
pads (:func:`zigzag_padded_len`); results say so (``meta["padded_seq_len"]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from megatron_fcp.contract.blocks import part_span
from megatron_fcp.contract.needs import block_pairs
from megatron_fcp.contract.plan import Plan, check_cp_ranks
from megatron_fcp.cost.route_table import round_loads
from megatron_fcp.topology import Topology, load_topology

__all__ = [
    "BACKWARD_FLOP_RATIO",
    "AttentionShape",
    "ComputeModel",
    "SimResult",
    "kv_block_bytes",
    "parse_tokens",
    "zigzag_padded_len",
    "pad_for_zigzag",
    "simulate_rounds",
    "simulate_plan",
    "pick_best",
    "check_plan_seq",
    "DEFAULT_FLOPS",
]

DEFAULT_FLOPS = 400e12
"""Sustained attention FLOP/s (about 40% of an H100's dense BF16 peak, flash-attention forward)."""


def parse_tokens(value: "str | int") -> int:
    """``"128k"`` -> 131072, ``"1m"`` -> 1048576, ``"4096"`` -> 4096."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        s = str(value).strip().lower()
        mult = {"k": 1024, "m": 1024 * 1024}.get(s[-1:], 1)
        try:
            n = int(float(s[:-1] if mult > 1 else s) * mult)
        except ValueError:
            raise ValueError(f"seq: cannot parse {value!r}; use e.g. 131072, 128k or 1m") from None
    if n < 1:
        raise ValueError(f"seq: must be >= 1 token, got {value!r}")
    return n


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's sequence and head shape (``dtype_bytes`` per element).

    ``head_dim`` is the head size of queries and keys; ``v_head_dim`` that of values (and of the
    output), None for the same: MLA (DeepSeek-V3: 192 and 128) sets it. A token's K and V then
    take ``kv_heads * (head_dim + v_head_dim)`` elements (:attr:`kv_token_elems`), a (query, key)
    pair ``2 * heads * (head_dim + v_head_dim)`` FLOPs (:attr:`pair_flops`)."""

    seq_len: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("seq_len", "heads", "kv_heads", "head_dim", "dtype_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        v = self.v_head_dim
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"v_head_dim: must be a positive integer or None (= head_dim), got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} must divide heads ({self.heads})")

    @property
    def d_v(self) -> int:
        """Values' head size: ``v_head_dim``, or ``head_dim`` when None."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def kv_token_elems(self) -> int:
        """Elements of one token's K and V: ``kv_heads * (head_dim + d_v)``."""
        return self.kv_heads * (self.head_dim + self.d_v)

    @property
    def pair_flops(self) -> float:
        """Forward FLOPs of one (query, key) pair over all heads: ``2 * heads * (head_dim + d_v)``."""
        return 2.0 * self.heads * (self.head_dim + self.d_v)

    def kv_bytes(self, tokens: float) -> float:
        return tokens * self.kv_token_elems * self.dtype_bytes

    def q_bytes(self, tokens: float) -> float:
        return tokens * self.heads * self.head_dim * self.dtype_bytes

    def o_bytes(self, tokens: float) -> float:
        """The output's (and its gradient's) bytes: ``d_v`` per head."""
        return tokens * self.heads * self.d_v * self.dtype_bytes


def kv_block_bytes(seq_len: int, cp: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2,
                   parts_per_chunk: int = 1, v_head_dim: int | None = None) -> float:
    """Bytes of one KV block (K and V of ``seq_len / (2*cp*parts)`` tokens; the mean block when
    ``parts`` does not divide the chunk: :func:`simulate_plan` prices each part's own tokens).
    ``v_head_dim``: V's head size when it differs from K's (MLA)."""
    d_v = head_dim if v_head_dim is None else v_head_dim
    return seq_len / (2 * cp * parts_per_chunk) * kv_heads * (head_dim + d_v) * dtype_bytes


def zigzag_padded_len(seq_len: int, cp: int) -> int:
    """``seq_len`` rounded up to a multiple of ``2*cp`` (Megatron pads a sequence this way so that
    it splits into ``2*cp`` equal zigzag chunks)."""
    return -(-seq_len // (2 * cp)) * (2 * cp)


def pad_for_zigzag(shape: "AttentionShape", cp: int) -> "tuple[AttentionShape, bool]":
    """``(shape with seq_len padded for cp, whether it was padded)``; see :func:`zigzag_padded_len`."""
    padded = zigzag_padded_len(shape.seq_len, cp)
    return (shape, False) if padded == shape.seq_len else (replace(shape, seq_len=padded), True)


@dataclass(frozen=True)
class ComputeModel:
    """Attention compute speed: ``flops`` FLOP/s and a fixed ``kernel_overhead_s`` per block."""

    flops: float = DEFAULT_FLOPS
    kernel_overhead_s: float = 5e-6

    def __post_init__(self) -> None:
        if not self.flops > 0:
            raise ValueError(f"flops: must be > 0, got {self.flops!r}")
        if not self.kernel_overhead_s >= 0:
            raise ValueError(f"kernel_overhead_s: must be >= 0, got {self.kernel_overhead_s!r}")

    def time(self, pairs: "np.ndarray | float", shape: AttentionShape) -> "np.ndarray | float":
        flop = np.asarray(pairs, dtype=np.float64) * shape.pair_flops
        return np.where(np.asarray(pairs) > 0, flop / self.flops + self.kernel_overhead_s, 0.0)


@dataclass
class SimResult:
    """Outcome of simulating one schedule; see Note [Cost model]."""

    name: str
    comm_s: float
    compute_s: float
    total_s: float
    bytes: float
    rounds: int
    resource_bytes: dict[str, float] = field(default_factory=dict)
    resource_bandwidth: dict[str, float] = field(default_factory=dict)
    timeline: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def utilisation(self) -> dict[str, float]:
        """Per resource: busy fraction of the communication time (bytes / bandwidth / comm_s)."""
        if self.comm_s <= 0:
            return {k: 0.0 for k in self.resource_bytes}
        return {k: b / self.resource_bandwidth[k] / self.comm_s for k, b in self.resource_bytes.items()}

    @property
    def inter_node_bytes(self) -> float:
        return sum(b for k, b in self.resource_bytes.items() if k.endswith(">net"))

    def to_dict(self, detail: bool = False) -> dict:
        d: dict[str, Any] = {
            "comm_s": self.comm_s,
            "compute_s": self.compute_s,
            "total_s": self.total_s,
            "bytes": self.bytes,
            "inter_node_bytes": self.inter_node_bytes,
            "rounds": self.rounds,
        }
        d.update({k: v for k, v in self.meta.items() if isinstance(v, (int, float, str, bool)) or v is None})
        if detail:
            d["resource_bytes"] = dict(self.resource_bytes)
            d["utilisation"] = self.utilisation
            d["timeline"] = self.timeline
        return d


# ---- causal work ------------------------------------------------------------------------------


# ---- communication ------------------------------------------------------------------------------


class _ResourceIndex:
    """Dense ids for resources and cached route id arrays per (src, dst)."""

    def __init__(self, topo: Topology):
        self.topo = topo
        self.ids: dict[str, int] = {}
        self.bw: list[float] = []
        self.names: list[str] = []
        self.routes: dict[tuple[int, int], tuple[np.ndarray, float]] = {}

    def route(self, s: int, d: int) -> tuple[np.ndarray, float]:
        hit = self.routes.get((s, d))
        if hit is None:
            r = self.topo.route(s, d)
            ids = []
            for res in r.resources:
                i = self.ids.get(res.name)
                if i is None:
                    i = self.ids[res.name] = len(self.names)
                    self.names.append(res.name)
                    self.bw.append(res.bandwidth)
                ids.append(i)
            hit = (np.asarray(ids, dtype=np.int64), r.latency)
            self.routes[(s, d)] = hit
        return hit


def simulate_rounds(
    topology: Topology,
    rounds: Sequence[Sequence[tuple[int, int, float]]],
    round_overhead_s: float = 0.0,
    name: str = "rounds",
) -> SimResult:
    """Time rounds of ``(src, dst, bytes)`` messages; see Note [Cost model].

    Returns a SimResult with ``comm_s`` (= ``total_s``; no compute), per-resource bytes and a
    timeline with one entry per round: start, end, bottleneck resource and its busy time.
    """
    idx = _ResourceIndex(topology)
    per_round_ids: list[np.ndarray] = []
    per_round_bytes: list[np.ndarray] = []
    lat: list[float] = []
    total_bytes = 0.0
    for msgs in rounds:
        ids, wts, lmax = [], [], 0.0
        for s, d, b in msgs:
            if s == d or b <= 0:
                continue
            rid, l = idx.route(s, d)
            ids.append(rid)
            wts.append(np.full(len(rid), float(b)))
            lmax = max(lmax, l)
            total_bytes += b
        per_round_ids.append(np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64))
        per_round_bytes.append(np.concatenate(wts) if wts else np.zeros(0))
        lat.append(lmax)
    return _finish_rounds(idx, per_round_ids, per_round_bytes, lat, total_bytes, round_overhead_s, name)


def _finish_rounds(idx, per_round_ids, per_round_bytes, lat, total_bytes, round_overhead_s, name,
                   busy_out: list | None = None) -> SimResult:
    nres = len(idx.names)
    bw = np.asarray(idx.bw, dtype=np.float64)
    res_bytes = np.zeros(nres)
    t = 0.0
    timeline = []
    for k, (ids, wts) in enumerate(zip(per_round_ids, per_round_bytes)):
        if len(ids) == 0:
            timeline.append({"round": k, "start_s": t, "end_s": t, "bottleneck": None, "busy": {}})
            if busy_out is not None:
                busy_out.append(np.zeros(nres))
            continue
        load = np.bincount(ids, weights=wts, minlength=nres)
        res_bytes += load
        busy = load / bw
        if busy_out is not None:
            busy_out.append(busy)
        j = int(np.argmax(busy))
        dur = float(busy[j]) + lat[k] + round_overhead_s
        active = np.nonzero(load)[0]
        timeline.append({
            "round": k, "start_s": t, "end_s": t + dur, "bottleneck": idx.names[j],
            "busy": {idx.names[i]: float(busy[i]) for i in active},
        })
        t += dur
    used = np.nonzero(res_bytes)[0]
    return SimResult(
        name=name, comm_s=t, compute_s=0.0, total_s=t, bytes=total_bytes, rounds=len(per_round_ids),
        resource_bytes={idx.names[i]: float(res_bytes[i]) for i in used},
        resource_bandwidth={idx.names[i]: float(bw[i]) for i in used},
        timeline=timeline,
    )


COLUMNAR_ROUNDS_MIN_CP = 256
"""Above this many ranks :func:`simulate_plan` without compute loads rounds as columns (Note
[Columnar rounds] in :mod:`megatron_fcp.cost.route_table`); up to it, message by message."""


def _finish_loads(idx, load: np.ndarray, lmax: np.ndarray, total_bytes: float, round_overhead_s: float,
                  name: str) -> SimResult:
    """:func:`_finish_rounds` from a ``[round, resource]`` byte matrix and each round's latency."""
    bw = np.asarray(idx.bw, dtype=np.float64)
    busy = load / bw[None, :] if load.size else load
    t = 0.0
    timeline = []
    for k in range(load.shape[0]):
        active = np.nonzero(load[k])[0]
        if not len(active):
            timeline.append({"round": k, "start_s": t, "end_s": t, "bottleneck": None, "busy": {}})
            continue
        j = int(np.argmax(busy[k]))
        dur = float(busy[k, j]) + float(lmax[k]) + round_overhead_s
        timeline.append({"round": k, "start_s": t, "end_s": t + dur, "bottleneck": idx.names[j],
                         "busy": dict(zip([idx.names[i] for i in active], busy[k, active].tolist()))})
        t += dur
    res_bytes = load.sum(axis=0)
    used = np.nonzero(res_bytes)[0]
    return SimResult(name=name, comm_s=t, compute_s=0.0, total_s=t, bytes=total_bytes, rounds=load.shape[0],
                     resource_bytes={idx.names[i]: float(res_bytes[i]) for i in used},
                     resource_bandwidth={idx.names[i]: float(bw[i]) for i in used}, timeline=timeline)


def _plan_arrays(plan: Plan):
    """(round, src, dst, owner, chunk, part) integer arrays of every transfer, plan order (read from
    a table-backed plan's columns without building its rounds)."""
    return plan.transfer_columns()


def simulate_plan(
    plan: Plan,
    topology: "Topology | str",
    shape: AttentionShape,
    *,
    compute: bool = True,
    compute_model: ComputeModel | None = None,
    round_overhead_s: float = 0.0,
    name: str | None = None,
    compute_from_s: float = 0.0,
) -> SimResult:
    """Simulate a forward pass of ``plan`` (comm, compute, overlapped total); see Note [Cost model].
    ``compute_from_s``: no rank computes before then (its queries are still arriving: the
    head-parallel stage's Q all-to-all, Note [Q's all-to-all behind the KV stage]); transfers start
    at 0.

    Block bytes follow ``shape`` and each block's own tokens (sub-blocks of a chunk differ by one
    token when ``parts_per_chunk`` does not divide it), scaled per owner by ``plan.kv_sizes`` when a
    ``balanced`` plan carries relative KV sizes (normalised to mean 1). A sequence that ``2*cp``
    does not divide is padded (:func:`pad_for_zigzag`). For a plan over a placement (a packed
    batch) ``shape.seq_len`` is not used: each block's bytes and each rank's work come from the
    placement's token spans and document masks.
    """
    if not compute_from_s >= 0:
        raise ValueError(f"compute_from_s: seconds >= 0, got {compute_from_s!r}")
    topo = load_topology(topology)
    cm = compute_model or ComputeModel()
    cp, P = plan.cp, plan.parts_per_chunk
    check_cp_ranks(topo, plan.ranks)
    pl = plan.placement
    padded = False
    if pl is None:
        shape, padded = pad_for_zigzag(shape, cp)
        check_plan_seq(plan, shape.seq_len)
    rnd, src, dst, owner, chunk, part = _plan_arrays(plan)
    pos_of = np.full(max(plan.ranks) + 1, -1, dtype=np.int64)  # global rank -> CP index, as an array
    pos_of[list(plan.ranks)] = np.arange(cp)
    owner_i = pos_of[owner]
    if pl is None:  # each part's own tokens (floor/ceil when P does not divide the chunk)
        p0, p1 = part_span(shape.seq_len // (2 * cp), P, part)
        if plan.kv_sizes:
            mean = sum(plan.kv_sizes) / cp
            w_owner = np.array([w / mean for w in plan.kv_sizes])
        else:
            w_owner = np.ones(cp)
        nbytes = ((p1 - p0) * shape.kv_bytes(1)).astype(np.float64) * w_owner[owner_i]
    else:  # a packed batch: each block's own token count
        tokens = {(i, b): sp.tokens for i, b, sp in pl.block_list()}
        nbytes = np.array([tokens[(o, c)] for o, c in zip(owner_i.tolist(), chunk.tolist())],
                          dtype=np.float64) * shape.kv_bytes(1)

    # aggregate bytes per (round, src, dst), then load the routes
    idx = _ResourceIndex(topo)
    n_rounds = plan.num_rounds
    per_round_ids, per_round_bytes, lat = [], [], []
    if len(rnd):
        key = (rnd * cp + pos_of[src]) * cp + pos_of[dst]
        uk, inv = np.unique(key, return_inverse=True)
        agg = np.bincount(inv, weights=nbytes)
    else:
        uk, agg = np.zeros(0, np.int64), np.zeros(0)
    k_of = uk // (cp * cp)
    if not compute and cp > COLUMNAR_ROUNDS_MIN_CP:  # Note [Columnar rounds]
        s_i, d_i = np.divmod(uk % (cp * cp), cp)
        load, lmax = round_loads(idx, topo, plan.ranks, k_of, s_i, d_i, agg, n_rounds)
        res = _finish_loads(idx, load, lmax, float(nbytes.sum()), round_overhead_s, name or f"fcp-{plan.name}")
        res.meta.update(graph=plan.name, parts_per_chunk=P, transfers=int(len(rnd)))
        if padded:
            res.meta["padded_seq_len"] = shape.seq_len
        return res
    starts = np.searchsorted(k_of, np.arange(n_rounds + 1))
    entry_route: list[np.ndarray] = []
    entry_lat: list[float] = []
    for k in range(n_rounds):
        ids, wts, lmax = [], [], 0.0
        for e in range(starts[k], starts[k + 1]):
            s_i, d_i = divmod(int(uk[e]) % (cp * cp), cp)
            rid, l = idx.route(plan.ranks[s_i], plan.ranks[d_i])
            ids.append(rid)
            wts.append(np.full(len(rid), agg[e]))
            lmax = max(lmax, l)
            entry_route.append(rid)
            entry_lat.append(l)
        per_round_ids.append(np.concatenate(ids) if ids else np.zeros(0, np.int64))
        per_round_bytes.append(np.concatenate(wts) if wts else np.zeros(0))
        lat.append(lmax)
    busy_k: list[np.ndarray] = []
    res = _finish_rounds(idx, per_round_ids, per_round_bytes, lat, float(nbytes.sum()), round_overhead_s,
                         name or f"fcp-{plan.name}", busy_k)
    res.meta.update(graph=plan.name, parts_per_chunk=P, transfers=int(len(rnd)))
    if padded:
        res.meta["padded_seq_len"] = shape.seq_len
    if not compute:
        return res

    # arrival of each (round, src, dst) message group: round start + latency + its route's busiest
    # resource in that round (messages on idle NVLink land before the round's NIC bottleneck ends)
    starts_t = np.array([e["start_s"] for e in res.timeline])
    finish = np.array([starts_t[k_of[e]] + entry_lat[e] + float(busy_k[k_of[e]][entry_route[e]].max())
                       for e in range(len(uk))])
    arrival = finish[inv] if len(rnd) else np.zeros(0)

    # compute: own blocks first (one kernel), then received blocks in plan order, each no earlier
    # than its arrival; blocks of one owner arriving at a rank in one round share one kernel
    q_i = pos_of[dst]
    head_dim_flops = shape.pair_flops / cm.flops
    if pl is None:
        pairs = block_pairs(cp, shape.seq_len, P, q_i, owner_i, chunk, part, plan.mask) * w_owner[owner_i]
    else:
        pairs = np.array([pl.pairs(j, i, b) for j, i, b in zip(q_i.tolist(), owner_i.tolist(), chunk.tolist())],
                         dtype=np.float64)
    recv_t = pairs * head_dim_flops
    if len(rnd):
        group = (q_i * cp + owner_i) * max(n_rounds, 1) + rnd
        _, first = np.unique(group, return_index=True)
        recv_t[first] += cm.kernel_overhead_s
    if pl is None:
        own_q = np.repeat(np.arange(cp), 2 * P)
        own_c = np.tile(np.repeat([0, 1], P), cp)
        own_p = np.tile(np.arange(P), 2 * cp)
        own_pairs = block_pairs(cp, shape.seq_len, P, own_q, own_q, own_c, own_p, plan.mask) * w_owner[own_q]
        local = np.bincount(own_q, weights=own_pairs * head_dim_flops, minlength=cp)
    else:
        local = np.array([sum(pl.pairs(j, j, b) for b in range(len(pl.blocks[j]))) for j in range(cp)],
                         dtype=np.float64) * head_dim_flops
    local += cm.kernel_overhead_s
    busy = local + np.bincount(q_i, weights=recv_t, minlength=cp)
    order = np.lexsort((np.arange(len(q_i)), q_i))  # by rank, plan order within rank
    ends = local + compute_from_s
    q_sorted, a_sorted, t_sorted = q_i[order], arrival[order], recv_t[order]
    bounds = np.searchsorted(q_sorted, np.arange(cp + 1))
    for r in range(cp):
        e = ends[r]
        for a, c in zip(a_sorted[bounds[r]:bounds[r + 1]].tolist(), t_sorted[bounds[r]:bounds[r + 1]].tolist()):
            e = max(e, a) + c
        ends[r] = e
    res.compute_s = float(busy.max())
    res.total_s = float(max(ends.max(), res.comm_s, res.compute_s))  # max(): float summation order
    return res


def check_plan_seq(plan: Plan, seq_len: int) -> None:
    """A windowed zigzag plan's need sets were derived for ``plan.seq_len`` tokens: raise ValueError
    naming the fix when it is priced on another (padded) length."""
    if plan.placement is None and plan.mask.windowed and plan.seq_len != seq_len:
        raise ValueError(f"plan {plan.name!r} was built for seq_len={plan.seq_len} under window {plan.window}, "
                         f"priced at {seq_len} tokens (padded): build it with the shape's seq_len")


def pick_best(candidates: "Sequence[tuple[SimResult, Any]]", objective: str = "total"):
    """Best ``(SimResult, x)`` pair: least ``comm_s`` for ``"comm"``; for ``"total"`` the least
    ``comm_s`` among candidates whose ``total_s`` is within 0.1% of the least total (when compute
    hides communication, prefer the plan that leaves the network idle soonest)."""
    if objective == "comm":
        return min(candidates, key=lambda c: c[0].comm_s)
    t_min = min(c[0].total_s for c in candidates)
    close = [c for c in candidates if c[0].total_s <= t_min * (1 + 1e-3)]
    return min(close, key=lambda c: c[0].comm_s)


BACKWARD_FLOP_RATIO = 2.5
"""Backward attention FLOPs over forward (flash-attention: 5 matmuls vs 2)."""
