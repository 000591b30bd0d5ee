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

*Compute by tiles* (opt-in, :meth:`ComputeModel.tiled`; Note [Tile-priced kernels] in
:mod:`megatron_fcp.cost.tiles`): a block's seconds are those of the kernel calls that compute it
-- one call per increasing run of its reader's query rows (a zigzag rank's two chunks are two
runs, a packed rank's spans of the block's document one each) against the block's keys -- priced
from the (query tile, key tile) pairs they touch, and the launch cost is the calibration's
``launch_s``. A call on several blocks (*Launches* below) is priced as that call, not as the sum
of its blocks: its keys joined into increasing runs (a chunk's sub-blocks are one run, a zigzag
owner's two chunks two), every (query run, key run) of one document priced as above
(:func:`call_work_s`; its blocks' prices scaled to it, :func:`grouped_call_scale`), as the
emulator's sleep kernel prices the call it gets. Under the FLOP model work adds up, so grouping
changes no price. Every path that prices block compute (this forward, the backward timelines of
:mod:`megatron_fcp.cost.backward`, the floors of :mod:`megatron_fcp.cost.floors`, TE's schedules in
:mod:`megatron_fcp.cost.te`, the emulator's sleep kernel) goes through :meth:`ComputeModel.work_s` /
:func:`zigzag_block_work` / :meth:`ComputeModel.launch_s`, so they agree; the floors use
:meth:`ComputeModel.pair_s`, which under tiles is a per-pair *lower bound* (a tile pair costs at
least ``min(1, partial_cost) * tile_s`` for at most ``q_tile * k_tile`` pairs).

*Overlap*: a rank computes its own blocks from t=0 (one kernel), then each received block in plan
order, starting no earlier than its arrival: ``end = max(end, arrival) + compute(block)``. A
message of round k arrives at ``start(k) + latency + max over its route of busy(R, k)`` (so a
block on an idle NVLink lands before the round's NIC bottleneck drains).

*Launches*: one kernel launch (``kernel_overhead_s``, or the calibration's ``launch_s``) per
call the executor makes, and the calls come from one rule,
:func:`~megatron_fcp.schedule.launches.launch_ids` (Note [One launch per owner and stage] in
:mod:`megatron_fcp.schedule.launches`): a rank's own blocks are one call, the blocks of one owner
reaching it in one round another (as TE computes one step's KV pair in one call), and a group
without work (a block only relayed, or outside every query's window) makes none. The backward
models count the same way (one pass, chains; a backward in waves calls once per job). The
overlapped total is the latest rank's end (never less than the communication time).

Baselines (Transformer Engine's schedules) and the lower bound are in
:mod:`megatron_fcp.cost.te`; :mod:`megatron_fcp.planner.compare` sets them side by side.

*Sequence lengths* that ``2*cp`` does not divide are padded up to the next multiple, as Megatron
pads (:func:`zigzag_padded_len`); results say so (``meta["padded_seq_len"]``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from megatron_fcp.contract.blocks import Block, part_span
from megatron_fcp.contract.mask import FULL, Mask, as_mask
from megatron_fcp.contract.needs import block_pairs
from megatron_fcp.contract.plan import Plan, check_cp_ranks
from megatron_fcp.cost.route_table import round_loads
from megatron_fcp.cost.tiles import TileCosts, TileCounts, count_tiles
from megatron_fcp.jit import jit, unique_ints
from megatron_fcp.schedule.launches import launch_ids, launch_starts, local_stage
from megatron_fcp.topology import Topology, load_topology
from megatron_fcp.topology.route_ids import ResourceIds, first_use_ids

__all__ = [
    "BACKWARD_FLOP_RATIO",
    "AttentionShape",
    "ComputeModel",
    "KernelCalibration",
    "KERNEL_CALIBRATIONS",
    "zigzag_block_work",
    "kernel_block_tokens",
    "call_work_s",
    "key_runs",
    "grouped_call_scale",
    "SimResult",
    "kv_block_bytes",
    "parse_tokens",
    "zigzag_padded_len",
    "pad_for_zigzag",
    "simulate_rounds",
    "ScaledRound",
    "simulate_plan",
    "pick_best",
    "check_plan_seq",
    "DEFAULT_FLOPS",
    "layer_pairs_per_token",
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
class KernelCalibration:
    """Tile constants of one (device, kernel, dtype, head size) for both passes (Note [Tile-priced
    kernels] in :mod:`megatron_fcp.cost.tiles`). ``head_dim``: the mean of the fitted runs' Q/K and V
    head sizes; a shape with other head sizes scales the per-tile costs by ``(head_dim + d_v) /
    (2 * head_dim)`` (a tile pair's matmuls are linear in the head size)."""

    name: str
    fwd: TileCosts
    bwd: TileCosts
    head_dim: int = 128
    source: str = ""

    def scaled(self, factor: float, launches: bool = True) -> "KernelCalibration":
        """Every constant times ``factor`` (an emulated cluster's time scale; ``launches=False``
        drops the launch cost, as the emulator drops the FLOP model's: a stretched launch would
        dwarf the small emulated shapes' work)."""
        def one(c: TileCosts) -> TileCosts:
            return replace(c, tile_s=c.tile_s * factor, q_tile_s=c.q_tile_s * factor, k_tile_s=c.k_tile_s * factor,
                           merge_s=c.merge_s * factor, launch_s=c.launch_s * factor if launches else 0.0)
        return replace(self, name=f"{self.name}x{factor:g}" + ("" if launches else "-nolaunch"), fwd=one(self.fwd),
                       bwd=one(self.bwd))


KERNEL_CALIBRATIONS: dict[str, KernelCalibration] = {
    # benchmarks/results/tile_fit.json, "h200" (python benchmarks/fit_tiles.py; docs/planner.md §4b):
    # PyTorch's flash SDPA (flash-attn 2) on an H200, BF16, d 128, GQA 32:8; per-query-tile cost
    # tied to the tile pair's by the FlashAttention-2 H100 curve (the H200 runs are all >= 32K tokens)
    "h200-fa2": KernelCalibration(
        name="h200-fa2",
        fwd=TileCosts(tile_s=2.5074536268537667e-08, q_tile_s=2.0306179616456935e-08, k_tile_s=0.0,
                      merge_s=1.4285298198183158e-09, launch_s=8.7538096230451e-07, partial_cost=0.5,
                      label="H200 cuda-flash bf16 d128 fwd"),
        bwd=TileCosts(tile_s=6.545232476352814e-08, q_tile_s=5.300543342971209e-08, k_tile_s=0.0,
                      merge_s=2.199384098570071e-09, launch_s=6.007364804682367e-05, partial_cost=0.5,
                      label="H200 cuda-flash bf16 d128 bwd"),
        head_dim=128,
        source="benchmarks/results/tile_fit.json (h200)"),
}
"""Named kernel calibrations for :meth:`ComputeModel.tiled`."""


@functools.lru_cache(maxsize=1 << 16)
def _tiles(n: int, m: int, delta: int, mask: Mask, q_tile: int, k_tile: int) -> TileCounts:
    """:func:`~megatron_fcp.cost.tiles.count_tiles` of ``n`` rows at ``delta`` against ``m`` keys at 0
    (a call's count depends only on where its rows start relative to its keys)."""
    return count_tiles(n, m, delta, 0, mask, q_tile, k_tile)


@functools.lru_cache(maxsize=256)
def _scaled_costs(k: KernelCalibration, dims: int, flop_ratio: float) -> TileCosts:
    """:meth:`ComputeModel.tile_costs` for head sizes summing to ``dims`` (memoised: on every call's path)."""
    base = k.fwd if flop_ratio == 1.0 else k.bwd
    s = dims / (2.0 * k.head_dim)
    if flop_ratio != 1.0:
        s *= flop_ratio / BACKWARD_FLOP_RATIO
    return replace(base, tile_s=base.tile_s * s, q_tile_s=base.q_tile_s * s, k_tile_s=base.k_tile_s * s,
                   merge_s=base.merge_s * s)


@dataclass(frozen=True)
class ComputeModel:
    """Attention compute speed: ``flops`` FLOP/s and a fixed ``kernel_overhead_s`` per block; or,
    with ``kernel`` set (:meth:`tiled`), kernel calls priced by the tiles they touch (Note [Cost
    model], *Compute by tiles*; ``flops`` and ``kernel_overhead_s`` are then not used for blocks)."""

    flops: float = DEFAULT_FLOPS
    kernel_overhead_s: float = 5e-6
    kernel: KernelCalibration | None = None

    def __post_init__(self) -> None:
        if not self.flops > 0:
            raise ValueError(f"flops: must be > 0, got {self.flops!r}")
        if not self.kernel_overhead_s >= 0:
            raise ValueError(f"kernel_overhead_s: must be >= 0, got {self.kernel_overhead_s!r}")

    @classmethod
    def tiled(cls, calibration: "str | KernelCalibration" = "h200-fa2", **kw) -> "ComputeModel":
        """A compute model pricing kernel calls by tiles with a named calibration
        (:data:`KERNEL_CALIBRATIONS`) or a given one."""
        if isinstance(calibration, str):
            if calibration not in KERNEL_CALIBRATIONS:
                raise ValueError(f"calibration: unknown {calibration!r}; known: {sorted(KERNEL_CALIBRATIONS)}")
            calibration = KERNEL_CALIBRATIONS[calibration]
        return cls(kernel=calibration, **kw)

    @property
    def label(self) -> str:
        """``flops`` or the calibration's name, for reports."""
        return f"tiles:{self.kernel.name}" if self.kernel is not None else f"flops:{self.flops / 1e12:g}T"

    def time(self, pairs: "np.ndarray | float", shape: AttentionShape) -> "np.ndarray | float":
        """Seconds of blocks of ``pairs`` (query, key) pairs, one launch each: the FLOP model only
        (the tile model needs a block's geometry: :meth:`work_s`)."""
        if self.kernel is not None:
            raise ValueError("ComputeModel.time prices by pairs; a tiled model prices a call's geometry: use work_s")
        flop = np.asarray(pairs, dtype=np.float64) * shape.pair_flops
        return np.where(np.asarray(pairs) > 0, flop / self.flops + self.kernel_overhead_s, 0.0)

    def tile_costs(self, shape: AttentionShape, flop_ratio: float = 1.0) -> TileCosts | None:
        """The calibration's constants for ``shape``'s head sizes and a pass of ``flop_ratio`` times
        the forward's FLOPs (1: the forward; else the backward's constants scaled by ``flop_ratio /
        BACKWARD_FLOP_RATIO``); None for the FLOP model."""
        if self.kernel is None:
            return None
        return _scaled_costs(self.kernel, shape.head_dim + shape.d_v, float(flop_ratio))

    def launch_s(self, flop_ratio: float = 1.0) -> float:
        """Seconds of one kernel launch in a pass of ``flop_ratio`` (``kernel_overhead_s``, or the
        calibration's ``launch_s``)."""
        if self.kernel is None:
            return self.kernel_overhead_s
        return (self.kernel.fwd if flop_ratio == 1.0 else self.kernel.bwd).launch_s

    def pair_s(self, shape: AttentionShape, flop_ratio: float = 1.0) -> float:
        """Seconds per (query, key) pair over all heads: exact for the FLOP model; for tiles a lower
        bound on any call's work per visible pair (each tile pair costs at least ``min(1,
        partial_cost) * tile_s`` per head and holds at most ``q_tile * k_tile`` pairs)."""
        c = self.tile_costs(shape, flop_ratio)
        if c is None:
            return shape.pair_flops / self.flops * flop_ratio
        return shape.heads * min(1.0, c.partial_cost) * c.tile_s / (c.q_tile * c.k_tile)

    def work_s(self, rows: int, q0: int, keys: int, k0: int, shape: AttentionShape, mask: "bool | Mask",
               flop_ratio: float = 1.0, merged: bool = True) -> float:
        """Seconds of one kernel call's work, launch not included: ``rows`` queries at ``q0..``
        against ``keys`` keys at ``k0..`` under ``mask`` (``merged``: its rows go through the
        engine's LSE merge). FLOP model: its pairs times :meth:`pair_s`."""
        mask = as_mask(mask)
        c = self.tile_costs(shape, flop_ratio)
        if c is None:
            return float(mask.pairs(q0, q0 + rows, k0, k0 + keys)) * self.pair_s(shape, flop_ratio)
        return _call_work(c, shape.heads, int(rows), int(q0) - int(k0), int(keys), mask, merged)

    def spans_work_s(self, q_spans, k_span, shape: AttentionShape, mask: "bool | Mask",
                     flop_ratio: float = 1.0) -> float:
        """Work of one reader's query spans (objects with ``doc``, ``start``, ``end``: a packed
        placement's) against one key span: a call per span of the key's document (memoised per
        spans object, key span and pass)."""
        c = self.tile_costs(shape, flop_ratio)
        if c is None:
            return float(sum(self.work_s(q.end - q.start, q.start, k_span.end - k_span.start, k_span.start, shape,
                                         mask, flop_ratio) for q in q_spans if q.doc == k_span.doc))
        mask = as_mask(mask)
        key = (id(q_spans), k_span, c, shape.heads, mask)
        hit = _SPANS.get(key)
        if hit is not None and hit[0] is q_spans:
            return hit[1]
        m, k0 = k_span.end - k_span.start, k_span.start
        w = float(sum(_call_work(c, shape.heads, q.end - q.start, q.start - k0, m, mask, True)
                      for q in q_spans if q.doc == k_span.doc))
        if len(_SPANS) > 1 << 18:
            _SPANS.clear()
        _SPANS[key] = (q_spans, w)
        return w


_SPANS: dict = {}
"""(id of a spans tuple, key span, costs, heads, mask) -> (the tuple, seconds): :meth:`ComputeModel.spans_work_s`."""


def _call_work(c: TileCosts, heads: int, rows: int, delta: int, keys: int, mask: Mask, merged: bool) -> float:
    """One call's tile-priced work (launch not included): ``rows`` rows starting ``delta`` after its keys."""
    if rows <= 0 or keys <= 0:
        return 0.0
    t = _tiles(rows, keys, delta, mask, c.q_tile, c.k_tile)
    if t.q_tiles == 0:
        return 0.0
    return heads * (c.tile_s * (t.full + c.partial_cost * t.partial) + c.q_tile_s * t.q_tiles
                    + c.k_tile_s * t.k_tiles + (c.merge_s * rows if merged else 0.0))


def zigzag_block_work(cm: ComputeModel, shape: AttentionShape, cp: int, P: int, q_index, owner_index, chunk, part,
                      mask: "bool | Mask", flop_ratio: float = 1.0) -> np.ndarray:
    """Seconds of work (launches not included) of rank ``q_index``'s two zigzag query chunks on
    block (owner, chunk, part) of Megatron's zigzag split of ``shape.seq_len`` tokens, vectorised
    like :func:`~megatron_fcp.contract.needs.block_pairs`: the FLOP model's pairs times
    :meth:`ComputeModel.pair_s` (the same floats as before tiles), or one tile-priced call per
    query chunk that sees the block."""
    if cm.kernel is None:
        return block_pairs(cp, shape.seq_len, P, q_index, owner_index, chunk, part, mask) * cm.pair_s(shape, flop_ratio)
    mask = as_mask(mask)
    L = shape.seq_len // (2 * cp)
    q, o, c, p = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (q_index, owner_index, chunk, part)))
    g = np.where(c == 0, o, 2 * cp - 1 - o)
    p0, p1 = part_span(L, P, p)
    k0, m = g * L + p0, p1 - p0
    out = np.zeros(q.shape, dtype=np.float64)
    memo: dict[tuple[int, int], float] = {}
    for qc in (q, 2 * cp - 1 - q):
        delta = (qc * L - k0).ravel().tolist()
        mm = m.ravel().tolist()
        vals = []
        for d, mk in zip(delta, mm):
            key = (d, mk)
            if key not in memo:
                memo[key] = cm.work_s(L, d, mk, 0, shape, mask, flop_ratio)
            vals.append(memo[key])
        out += np.asarray(vals, dtype=np.float64).reshape(q.shape)
    return out


def key_runs(spans: "Sequence[tuple[int, int, int]]") -> list[tuple[int, int, int]]:
    """A call's keys (or rows) ``(doc, start, end)`` per block as increasing runs, taken in
    (document, position) order as the fused kernels take them (item 6 of the note in
    :mod:`megatron_fcp.attention.fused`): a block that starts where the one before it ends, in the
    same document, extends it (the runs a kernel and the emulator's sleep kernel see:
    ``call_runs``)."""
    out: list[tuple[int, int, int]] = []
    for doc, a, z in sorted(spans):
        if out and out[-1][0] == doc and out[-1][2] == a:
            out[-1] = (doc, out[-1][1], z)
        else:
            out.append((doc, a, z))
    return out


def call_work_s(cm: ComputeModel, shape: AttentionShape, q_runs, k_spans, mask: "bool | Mask",
                flop_ratio: float = 1.0, memo: dict | None = None, merged: bool = True) -> float:
    """Seconds of work (launch not included) of one kernel call on several blocks (Note [One launch
    per owner and stage] in :mod:`megatron_fcp.schedule.launches`): ``q_runs`` the reader's query
    runs and ``k_spans`` the blocks' keys, both ``(doc, start, end)`` (zigzag: doc 0, global
    positions), the keys joined into runs (:func:`key_runs`); every (query run, key run) of one
    document is priced as one block's call. For one block it is the block's price
    (:func:`zigzag_block_work`, :meth:`ComputeModel.spans_work_s`). ``memo``: a dict reused across
    calls of one shape, mask and pass (a run pair's price depends on its sizes and offset only).
    ``merged`` False: the call's rows are the answer, not a partial for the LSE merge (a
    head-parallel stage at ``a = cp``: :func:`~megatron_fcp.schedule.launches.local_stage`)."""
    memo = {} if memo is None else memo
    total = 0.0
    q_runs = key_runs(q_runs)
    for kd, ka, kz in key_runs(k_spans):
        for qd, qa, qz in q_runs:
            if qd != kd:
                continue
            key = (qz - qa, qa - ka, kz - ka)
            w = memo.get(key)
            if w is None:
                w = memo[key] = cm.work_s(qz - qa, qa - ka, kz - ka, 0, shape, mask, flop_ratio, merged)
            total += w
    return float(total)


def _block_columns(blocks) -> tuple[list[int], list[int], list[int]]:
    """Blocks as (owner, chunk, part) columns."""
    return [b.owner for b in blocks], [b.chunk for b in blocks], [b.part for b in blocks]


def grouped_call_scale(cm: ComputeModel, shape: AttentionShape, plan: Plan, stage, reader, owner, chunk, part,
                       work, flop_ratio: float = 1.0) -> np.ndarray:
    """Per entry -- a block (``owner`` global rank, ``chunk``, ``part``) computed by CP index
    ``reader`` in ``stage`` with ``work`` seconds -- the factor that makes a call's entries add up
    to the grouped call's tile price (:func:`call_work_s`) instead of the sum of its blocks' (1 for
    a call of one block, and always under the FLOP model, whose work is additive)."""
    work = np.asarray(work, dtype=np.float64)
    scale = np.ones(len(work))
    if cm.kernel is None or not len(work):
        return scale
    reader, owner, chunk, part = (np.asarray(x, dtype=np.int64).ravel() for x in (reader, owner, chunk, part))
    ids = launch_ids(stage, reader, owner, work > 0)
    order = np.argsort(ids, kind="stable")                         # each call's entries, in entry order
    ids_s = ids[order]
    cuts = np.flatnonzero(np.diff(ids_s)) + 1
    cp, pl = plan.cp, plan.placement
    pos = np.full(max(plan.ranks) + 1, -1, dtype=np.int64)
    pos[list(plan.ranks)] = np.arange(cp)
    mask = pl.mask if pl is not None else plan.mask
    memo: dict = {}
    merged = not local_stage(plan)  # a = cp: a rank's one call is its answer, no LSE merge
    if pl is None:
        L = shape.seq_len // (2 * cp)
        o = pos[owner]
        g = np.where(chunk == 0, o, 2 * cp - 1 - o)
        p0, p1 = part_span(L, plan.parts_per_chunk, part)
        k0, k1 = (g * L + p0).tolist(), (g * L + p1).tolist()
    for idx in np.split(order, cuts):
        if len(idx) < 2 or ids[idx[0]] < 0:
            continue
        idx = idx.tolist()
        j = int(reader[idx[0]])
        if pl is not None:
            q_runs = [(sp.doc, sp.start, sp.end) for sp in pl.blocks[j]]
            k_spans = [(sp.doc, sp.start, sp.end) for sp in (pl.blocks[pos[owner[i]]][chunk[i]] for i in idx)]
        else:
            q_runs = [(0, j * L, (j + 1) * L), (0, (2 * cp - 1 - j) * L, (2 * cp - j) * L)]
            k_spans = [(0, k0[i], k1[i]) for i in idx]
        total = float(work[idx].sum())
        if total > 0:
            scale[idx] = call_work_s(cm, shape, q_runs, k_spans, mask, flop_ratio, memo, merged) / total
    return scale


FLOP_MODEL_BLOCK_TOKENS = 4096
"""The block size without a kernel model (:data:`~megatron_fcp.contract.placement.DEFAULT_BLOCK_TOKENS`)."""


def layer_pairs_per_token(shape: AttentionShape, hidden: int, ffn_hidden: int, *, gated: bool = False,
                          experts_per_token: int = 1) -> float:
    """The forward FLOPs of one token's token-wise layer parts, in attention (query, key) pairs of
    ``shape`` (:attr:`AttentionShape.pair_flops`): what :func:`~megatron_fcp.contract.placement.place_packed`'s
    ``token_weight`` takes (Note [Layer work] there).

    Per token and tensor-parallel rank (``shape``'s heads are the rank's; ``ffn_hidden`` the rank's
    share of the MLP, per expert): the QKV projection ``2 * hidden * (heads * head_dim + kv_heads *
    (head_dim + d_v))``, the output projection ``2 * heads * d_v * hidden`` and the MLP ``2 * (2 if
    gated else 1) * hidden * ffn_hidden + 2 * ffn_hidden * hidden`` times ``experts_per_token``.
    Llama-3-70B (hidden 8192, ffn 28672, SwiGLU, 64:8 heads of 128): 52.2K pairs per token, so a
    token's linear layers cost as much as its attention over 52K keys."""
    for name, v in (("hidden", hidden), ("ffn_hidden", ffn_hidden), ("experts_per_token", experts_per_token)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be a positive integer, got {v!r}")
    qkv = 2.0 * hidden * (shape.heads * shape.head_dim + shape.kv_token_elems)
    proj = 2.0 * shape.heads * shape.d_v * hidden
    mlp = 2.0 * hidden * ffn_hidden * ((2 if gated else 1) + 1) * experts_per_token
    return (qkv + proj + mlp) / shape.pair_flops


def block_efficiency(cm: ComputeModel, tokens: int, shape: AttentionShape) -> float:
    """Of a ``tokens`` x ``tokens`` full-mask block call (a block read by a later query chunk, merged,
    one launch), forward plus backward: the work at the kernel's tile-pair rate over its priced
    time (launch included). 1.0 for the FLOP model."""
    if cm.kernel is None:
        return 1.0
    ideal = actual = 0.0
    for ratio in (1.0, BACKWARD_FLOP_RATIO):
        c = cm.tile_costs(shape, ratio)
        ideal += shape.heads * c.tile_s * tokens * tokens / (c.q_tile * c.k_tile)
        actual += cm.work_s(tokens, 10 * tokens, tokens, 0, shape, FULL, ratio) + cm.launch_s(ratio)
    return ideal / actual


def kernel_block_tokens(cm: ComputeModel, shape: AttentionShape, efficiency: float = 0.8,
                        limit: int = 1 << 16) -> int:
    """Default block tokens for a kernel calibration and device (Note [Cost model], compute by
    tiles): the fewest tokens, the kernel's tile times a power of two (so blocks split evenly into
    tiles and into halves for sub-blocks), whose full block runs at ``efficiency`` of the tile rate
    or better (:func:`block_efficiency`: launches, the per-query-tile cost and the merge
    amortised), at most ``limit``; :data:`FLOP_MODEL_BLOCK_TOKENS` for the FLOP model, which cannot
    see block shape. Smaller blocks balance and pipeline better, larger ones compute faster: this
    is the smallest that costs the kernel at most ``1 - efficiency``."""
    if not 0 < efficiency < 1:
        raise ValueError(f"efficiency: a fraction in (0, 1), got {efficiency!r}")
    if cm.kernel is None:
        return FLOP_MODEL_BLOCK_TOKENS
    c = cm.tile_costs(shape)
    n = int(np.lcm(c.q_tile, c.k_tile))
    while n < limit and block_efficiency(cm, n, shape) < efficiency:
        n *= 2
    return min(n, limit)


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
        self.resources = ResourceIds()
        self.ids: dict[str, int] = self.resources.index   # name -> id
        self.bw: list[float] = self.resources.bandwidths  # id -> bandwidth (bytes/s)
        self.names: list[str] = self.resources.names      # id -> name
        self.routes: dict[tuple[int, int], tuple[np.ndarray, float]] = {}

    def route(self, s: int, d: int) -> tuple[np.ndarray, float]:
        hit = self.routes.get((s, d))
        if hit is None:
            r = self.topo.route(s, d)
            hit = (np.array([self.resources.id(res.name, res.bandwidth) for res in r.resources], dtype=np.int64),
                   r.latency)
            self.routes[(s, d)] = hit
        return hit

    def route_columns(self, src, dst) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The routes ``src[i] -> dst[i]`` (global ranks) at once, from the topology's
        :class:`~megatron_fcp.topology.route_ids.RouteIds`: ``(resources per route, their ids one
        route after another, each route's latency)``, new resources numbered in order of first use,
        as calling :meth:`route` pair by pair would number them (Note [Route ids])."""
        table = self.topo.route_ids()
        rows = table.rows(src, dst)
        lens, topo_ids = table.gather(rows)
        local, first_used = first_use_ids(topo_ids)
        used = first_used.tolist()                              # topology ids, first-use order -> ours
        mine = np.array(self.resources.ids([table.names[g] for g in used],
                                           table.resource_bandwidth[first_used].tolist()), dtype=np.int64)
        return lens, mine[local], table.latency[rows]


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
    loads: dict[int, tuple] = {}   # id(round) -> its loads: a ring repeats one round object, routed once
    for msgs in rounds:
        got = loads.get(id(msgs))
        if got is None:
            got = loads[id(msgs)] = _round_loads(idx, msgs)
        ids, wts, lmax, nbytes = got
        per_round_ids.append(ids)
        per_round_bytes.append(wts)
        lat.append(lmax)
        total_bytes += nbytes
    return _finish_rounds(idx, per_round_ids, per_round_bytes, lat, total_bytes, round_overhead_s, name)


def _round_loads(idx: _ResourceIndex, msgs) -> tuple[np.ndarray, np.ndarray, float, float]:
    """One round's ``(src, dst, bytes)`` messages as (resource ids, bytes on each, the largest
    route latency, bytes sent): every message's bytes on every resource of its route."""
    sent = [(s, d, b) for s, d, b in msgs if s != d and b > 0]
    total = 0.0
    for _, _, b in sent:
        total += b
    if not sent:
        return np.zeros(0, dtype=np.int64), np.zeros(0), 0.0, total
    src, dst, nbytes = zip(*sent)
    ids, wts, lmax = _routed(idx, np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64),
                             np.array(nbytes, dtype=np.float64))
    return ids, wts, lmax, total


def _routed(idx: _ResourceIndex, src: np.ndarray, dst: np.ndarray, weights: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, float]:
    """Messages ``src[i] -> dst[i]`` (at least one) on their routes: (resource ids, route after
    route; each message's weight on every resource of its route; the largest route latency)."""
    hops, ids, latency = idx.route_columns(src, dst)
    return ids, np.repeat(weights, hops), max(0.0, float(latency.max()))


class ScaledRound:
    """One round of messages whose sizes are fixed up to a common factor, routed once and priced at
    any factor: ``simulate(unit)`` is ``simulate_rounds(topology, [[(src[i], dst[i], units[i] * unit)
    ...]])``, the same result to the bit (the messages in the same order, each size the same
    product, the resources numbered as that call numbers them). The all-to-alls of a head-parallel
    stage are such rounds: Q|K|V in and dO in move the same rows between the same members, O out
    and dQ|dK|dV back the reverse, each at its own bytes per row (before 2026-12-07 each of the four
    was routed on its own: 4 ms of cp = 64's packed degree choice)."""

    def __init__(self, topology: Topology, src: np.ndarray, dst: np.ndarray, units: np.ndarray):
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)   # [messages]
        units = np.asarray(units, dtype=np.float64)                                    # [messages]
        keep = (src != dst) & (units > 0)
        self._idx = _ResourceIndex(topology)
        self._units = units[keep]
        # [route entries] each: resource ids and the message's units on them
        self._ids, self._unit_rep, self._lmax = _routed(self._idx, src[keep], dst[keep], self._units) \
            if len(self._units) else (np.zeros(0, dtype=np.int64), np.zeros(0), 0.0)

    def simulate(self, unit: float, round_overhead_s: float = 0.0, name: str = "rounds") -> SimResult:
        """The round priced at ``unit`` bytes per unit (:func:`simulate_rounds`' result)."""
        if unit <= 0:
            return simulate_rounds(self._idx.topo, [[]], round_overhead_s, name)
        total = 0.0
        for b in (self._units * unit).tolist():   # in message order, as simulate_rounds adds them
            total += b
        return _finish_rounds(self._idx, [self._ids], [self._unit_rep * unit], [self._lmax], total,
                              round_overhead_s, name)


def round_comm_s(idx: _ResourceIndex, msgs, round_overhead_s: float = 0.0) -> float:
    """``simulate_rounds(topology, [msgs], round_overhead_s).comm_s`` on a shared
    :class:`_ResourceIndex` (its routes looked up once for many rounds): the busiest resource's
    bytes over its bandwidth, plus the round's largest latency and the overhead; 0 for a round with
    nothing to send."""
    ids, wts, lmax, _ = _round_loads(idx, msgs)
    if not len(ids):
        return 0.0
    busy = np.bincount(ids, weights=wts, minlength=len(idx.bw)) / np.asarray(idx.bw, dtype=np.float64)
    return float(busy.max()) + lmax + round_overhead_s


def _finish_rounds(idx, per_round_ids, per_round_bytes, lat, total_bytes, round_overhead_s, name,
                   busy_out: list | None = None) -> SimResult:
    nres = len(idx.names)
    bw = np.asarray(idx.bw, dtype=np.float64)
    res_bytes = np.zeros(nres)
    t = 0.0
    timeline = []
    same: dict[int, tuple] = {}    # id(a round's bytes array) -> its loads, busy times, bottleneck, busy names
    for k, (ids, wts) in enumerate(zip(per_round_ids, per_round_bytes)):
        if len(ids) == 0:
            timeline.append({"round": k, "start_s": t, "end_s": t, "bottleneck": None, "busy": {}})
            if busy_out is not None:
                busy_out.append(np.zeros(nres))
            continue
        got = same.get(id(wts))
        if got is None:       # a round object repeated (a ring: simulate_rounds) is loaded once
            load = np.bincount(ids, weights=wts, minlength=nres)
            busy = load / bw
            j = int(np.argmax(busy))
            used = np.flatnonzero(load)
            busy_names = dict(zip([idx.names[i] for i in used.tolist()], busy[used].tolist()))
            got = same[id(wts)] = (load, busy, j, busy_names)
        load, busy, j, busy_names = got
        res_bytes += load
        if busy_out is not None:
            busy_out.append(busy)
        dur = float(busy[j]) + lat[k] + round_overhead_s
        timeline.append({"round": k, "start_s": t, "end_s": t + dur, "bottleneck": idx.names[j],
                         "busy": busy_names})   # shared by a repeated round's entries: read only
        t += dur
    used = np.flatnonzero(res_bytes).tolist()
    names = [idx.names[i] for i in used]
    return SimResult(
        name=name, comm_s=t, compute_s=0.0, total_s=t, bytes=total_bytes, rounds=len(per_round_ids),
        resource_bytes=dict(zip(names, res_bytes[used].tolist())),
        resource_bandwidth=dict(zip(names, bw[used].tolist())),
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
        nbytes = pl.tokens_of(owner_i, chunk).astype(np.float64) * shape.kv_bytes(1)

    # aggregate bytes per (round, src, dst), then load the routes
    idx = _ResourceIndex(topo)
    n_rounds = plan.num_rounds
    per_round_ids, per_round_bytes, lat = [], [], []
    if len(rnd):
        key = (rnd * cp + pos_of[src]) * cp + pos_of[dst]
        uk, _, inv = unique_ints(key, n_rounds * cp * cp)
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
    # each (round, src, dst) entry's route: looked up once per pair, in order of first use (the
    # resource ids follow it), then gathered into every round's flat resource list
    pair = uk % (cp * cp)
    _, first_use, pair_inv = unique_ints(pair, cp * cp)
    by_use = np.argsort(first_use)
    pair_slot = np.empty(len(by_use), dtype=np.int64)
    pair_slot[by_use] = np.arange(len(by_use))
    used = pair[first_use[by_use]]                                               # [pairs], first-use order
    rank_arr = np.asarray(plan.ranks, dtype=np.int64)
    r_len, r_ids, r_lat = idx.route_columns(rank_arr[used // cp], rank_arr[used % cp])
    entry_pair = pair_slot[pair_inv]                                             # [entries]
    r_ptr = np.concatenate([[0], np.cumsum(r_len)])
    entry_lat = r_lat[entry_pair]
    e_len = r_len[entry_pair]
    e_at = np.concatenate([[0], np.cumsum(e_len)])                               # entry -> its flat start
    flat = np.repeat(r_ptr[entry_pair] - e_at[:-1], e_len) + np.arange(int(e_at[-1]))
    flat_ids, flat_w = r_ids[flat], np.repeat(agg, e_len)
    for k in range(n_rounds):
        a, b = int(e_at[starts[k]]), int(e_at[starts[k + 1]])
        per_round_ids.append(flat_ids[a:b])
        per_round_bytes.append(flat_w[a:b])
        lat.append(float(entry_lat[starts[k]:starts[k + 1]].max(initial=0.0)))
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
    if len(uk):
        busy_of = np.stack(busy_k)[np.repeat(k_of, e_len), flat_ids]            # [flat]: its resource's busy time
        finish = starts_t[k_of] + entry_lat + np.maximum.reduceat(busy_of, e_at[:-1])
    else:
        finish = np.zeros(0)
    arrival = finish[inv] if len(rnd) else np.zeros(0)

    # compute: own blocks first (one kernel), then received blocks in plan order, each no earlier
    # than its arrival; blocks of one owner arriving at a rank in one round share one kernel
    q_i = pos_of[dst]
    if pl is None:
        own_q = np.repeat(np.arange(cp), 2 * P)
        own_c = np.tile(np.repeat([0, 1], P), cp)
        own_p = np.tile(np.arange(P), 2 * cp)
    if cm.kernel is not None:  # Note [Cost model], compute by tiles: the calls' geometry
        if pl is None:
            recv_t = zigzag_block_work(cm, shape, cp, P, q_i, owner_i, chunk, part, plan.mask)
            own_w = zigzag_block_work(cm, shape, cp, P, own_q, own_q, own_c, own_p, plan.mask)
            own_blocks = [Block(plan.ranks[j], c, p) for j, c, p in zip(own_q.tolist(), own_c.tolist(), own_p.tolist())]
            own_j = own_q
        else:
            pm = pl.mask
            recv_t = np.array([cm.spans_work_s(pl.blocks[j], pl.blocks[i][b], shape, pm)
                               for j, i, b in zip(q_i.tolist(), owner_i.tolist(), chunk.tolist())], dtype=np.float64)
            own_j = np.array([j for j in range(cp) for _ in pl.blocks[j]], dtype=np.int64)
            own_blocks = [Block(plan.ranks[j], b, 0) for j in range(cp) for b in range(len(pl.blocks[j]))]
            own_w = np.array([cm.spans_work_s(pl.blocks[j], pl.blocks[j][blk.chunk], shape, pm)
                              for j, blk in zip(own_j.tolist(), own_blocks)], dtype=np.float64)
        # a call on several blocks is priced as the call (Note [One launch per owner and stage])
        recv_t = recv_t * grouped_call_scale(cm, shape, plan, rnd, q_i, owner, chunk, part, recv_t)
        own_w = own_w * grouped_call_scale(cm, shape, plan, np.full(len(own_j), -1), own_j,
                                           *_block_columns(own_blocks), own_w)
        if pl is None:                                     # a balanced plan's relative KV sizes
            recv_t, own_w = recv_t * w_owner[owner_i], own_w * w_owner[own_q]
        local = np.bincount(own_j, weights=own_w, minlength=cp).astype(np.float64)
    else:
        head_dim_flops = shape.pair_flops / cm.flops
        if pl is None:
            pairs = block_pairs(cp, shape.seq_len, P, q_i, owner_i, chunk, part, plan.mask) * w_owner[owner_i]
        else:
            pairs = pl.pairs_of(q_i, owner_i, chunk).astype(np.float64)
        recv_t = pairs * head_dim_flops
        if pl is None:
            own_pairs = block_pairs(cp, shape.seq_len, P, own_q, own_q, own_c, own_p, plan.mask) * w_owner[own_q]
            local = np.bincount(own_q, weights=own_pairs * head_dim_flops, minlength=cp)
        else:
            own = np.repeat(np.arange(cp), [len(x) for x in pl.blocks])          # every rank's own blocks
            own_b = np.concatenate([np.arange(len(x)) for x in pl.blocks]) if cp else own
            local = np.bincount(own, weights=pl.pairs_of(own, own, own_b).astype(np.float64),
                                minlength=cp) * head_dim_flops
    # one launch per (round, rank, owner) with work, and one for a rank's own blocks: the
    # executor's calls (Note [One launch per owner and stage] in megatron_fcp.schedule.launches)
    first = launch_starts(rnd, q_i, owner_i, recv_t > 0) if len(rnd) else np.zeros(0, np.int64)
    recv_t[first] += cm.launch_s()
    res.meta["launches"] = (np.bincount(q_i[first], minlength=cp) + (local > 0)).tolist()  # per CP rank
    local += np.where(local > 0, cm.launch_s(), 0.0)
    busy = local + np.bincount(q_i, weights=recv_t, minlength=cp)
    order = np.lexsort((np.arange(len(q_i)), q_i))  # by rank, plan order within rank
    ends = local + compute_from_s
    q_sorted, a_sorted, t_sorted = q_i[order], arrival[order], recv_t[order]
    bounds = np.searchsorted(q_sorted, np.arange(cp + 1))
    _compute_ends(ends, bounds, np.ascontiguousarray(a_sorted, dtype=np.float64),
                  np.ascontiguousarray(t_sorted, dtype=np.float64))
    res.compute_s = float(busy.max())
    res.total_s = float(max(ends.max(), res.comm_s, res.compute_s))  # max(): float summation order
    return res


@jit
def _compute_ends(ends, bounds, arrival, work):
    """Each CP rank's compute timeline in place: rank ``r`` starts at ``ends[r]`` (its own blocks
    done) and runs its received blocks ``bounds[r]:bounds[r + 1]`` in order, each no earlier than
    its ``arrival``, for its ``work`` seconds; ``ends[r]`` becomes when the last one finishes.
    Compiled (Note [Compiled planning loops]): one visit per received block, 135K at cp = 256."""
    for r in range(ends.shape[0]):
        e = ends[r]
        for i in range(bounds[r], bounds[r + 1]):
            e = max(e, arrival[i]) + work[i]
        ends[r] = e


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
