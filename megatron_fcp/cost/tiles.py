"""Kernel time by tile shape: what a fused attention call costs on a GPU, from the tiles it touches.

Note [Tile-priced kernels]
--------------------------
A flash-attention kernel (flash-attn 2/3, cuDNN, PyTorch's flash SDPA) walks a call's query rows in
tiles of ``q_tile`` rows and, per query tile, its keys in tiles of ``k_tile``; a tile pair whose
keys are all masked is skipped, one that is partly masked (the causal diagonal, a window's edges)
is computed whole and masked elementwise. So a call's time is not its FLOPs over a peak rate but::

    t(call) = launch_s
            + heads * ( tile_s * (full + partial_cost * partial)     # tile pairs computed
                      + q_tile_s * q_tiles )                          # per query tile: load Q,
                                                                      # finish softmax, write O, LSE
            + heads * merge_s * rows                                  # the engine's LSE merge of
                                                                      # this call's rows (blockwise)

with ``full`` / ``partial`` the (query tile, key tile) pairs whose keys are all / partly visible
under the call's :class:`~megatron_fcp.contract.mask.Mask`, and ``q_tiles`` the query tiles that
touch any key. A tile pays in full even when the call has fewer rows or keys than the tile: a
16-token chunk costs a whole tile pair, which is why TE's THD layout (every document cut into
``2 * cp`` chunks) pays for tiles it barely fills, and why FCP's whole short documents do not. The
``q_tile_s`` term makes throughput rise with length and saturate, the shape of the published
FlashAttention-2/3 curves (docs/planner.md §4b): at ``n`` keys per query tile the
efficiency is ``1 / (1 + (q_tile_s / tile_s) * k_tile / n)``.

The backward has the same form with its own constants (``dq`` and ``dk, dv`` per tile pair, a
per-key-tile term for dK/dV written once per call) and ``merge_s`` there prices the accumulation
of the call's dq, dk, dv into the rank's gradients.

Constants are fitted per (device, kernel, dtype, head size) by :func:`fit_tile_costs` from
measured pairs of one fused call and the engine's blockwise computation over the same tokens
(``benchmarks/gpu_check.py``'s ``speed`` section; ``benchmarks/fit_tiles.py`` fits and writes
``benchmarks/results/tile_fit.json``). Pure numpy, no torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import numpy as np

from megatron_fcp.contract.mask import CAUSAL, Mask

__all__ = ["TileCounts", "TileCosts", "count_tiles", "Call", "zigzag_calls", "fused_calls", "calls_time",
           "fit_tile_costs"]


@dataclass(frozen=True)
class TileCounts:
    """Tiles one call touches: tile pairs all visible / partly visible, query and key tiles touched."""

    full: int
    partial: int
    q_tiles: int
    k_tiles: int

    def __add__(self, other: "TileCounts") -> "TileCounts":
        return TileCounts(self.full + other.full, self.partial + other.partial, self.q_tiles + other.q_tiles,
                          self.k_tiles + other.k_tiles)


def count_tiles(n: int, m: int, q0: int, k0: int, mask: Mask = CAUSAL, q_tile: int = 128,
                k_tile: int = 128) -> TileCounts:
    """Tiles of one call: ``n`` query rows at positions ``q0 .. q0+n-1`` against ``m`` keys at
    ``k0 .. k0+m-1`` (both increasing runs, as the engine's pieces are), tiled from the call's first
    row and key. Vectorised over query tiles; exact (a test checks it against every token pair)."""
    if n <= 0 or m <= 0:
        return TileCounts(0, 0, 0, 0)
    lo, hi = mask.offsets
    i = np.arange(-(-n // q_tile), dtype=np.int64)
    q_lo = q0 + i * q_tile
    q_hi = np.minimum(q_lo + q_tile, q0 + n) - 1
    k_last = k0 + m - 1
    # keys any row of the tile sees, clipped to the call's keys
    a = np.maximum(q_lo + lo, k0)
    b = np.minimum(q_hi + hi, k_last)
    seen = a <= b
    j_a = np.where(seen, (a - k0) // k_tile, 0)
    j_b = np.where(seen, (b - k0) // k_tile, -1)
    touched = np.where(seen, j_b - j_a + 1, 0)
    # tiles whose every key every row sees: inside [q_hi + lo, q_lo + hi]
    f_a = np.maximum(q_hi + lo, k0)
    f_b = np.minimum(q_lo + hi, k_last)
    j_first = -(-(f_a - k0) // k_tile)                                  # first tile starting at or after f_a
    last_tile = (k_last - k0) // k_tile
    j_last = np.where(f_b >= k_last, last_tile, (f_b - k0 + 1) // k_tile - 1)  # last tile ending by f_b
    full = np.where(seen & (f_a <= f_b), np.maximum(j_last - j_first + 1, 0), 0)
    k_tiles = int(j_b[seen].max() - j_a[seen].min() + 1) if seen.any() else 0  # a band: contiguous
    return TileCounts(int(full.sum()), int((touched - full).sum()), int(seen.sum()), k_tiles)


@dataclass(frozen=True)
class Call:
    """One kernel launch: ``rows`` queries at ``q0..`` against ``keys`` keys at ``k0..``."""

    rows: int
    q0: int
    keys: int
    k0: int


def fused_calls(seq_len: int) -> list[Call]:
    """One fused call over the whole sequence (the baseline the blockwise computation is held to)."""
    return [Call(seq_len, 0, seq_len, 0)]


def zigzag_calls(seq_len: int, cp: int, mask: Mask = CAUSAL) -> list[Call]:
    """The engine's kernel calls over a CP group's zigzag shards, every rank's (whole chunks, a = 1):
    per rank and per KV block it needs (its own included), one call per increasing run of the query
    rows that see the block (Note [Zigzag blocks and causal need sets]; a shard's two chunks are
    two runs). What ``benchmarks/gpu_check.py``'s ``speed`` section times on one GPU."""
    L = seq_len // (2 * cp)
    calls = []
    for rank in range(cp):
        runs = [rank * L, (2 * cp - 1 - rank) * L]                     # the shard's two query chunks
        for g in range(2 * cp):                                        # every chunk's block
            k0 = g * L
            for q0 in runs:
                if mask.pairs(q0, q0 + L, k0, k0 + L) > 0:
                    calls.append(Call(L, q0, L, k0))
    return calls


@dataclass(frozen=True)
class TileCosts:
    """Fitted constants of Note [Tile-priced kernels] for one (device, kernel, dtype, head size) and
    one pass (forward or backward). Seconds; ``tile_s`` / ``q_tile_s`` / ``k_tile_s`` / ``merge_s``
    per head."""

    tile_s: float
    q_tile_s: float = 0.0
    k_tile_s: float = 0.0
    merge_s: float = 0.0
    launch_s: float = 0.0
    partial_cost: float = 1.0
    q_tile: int = 128
    k_tile: int = 128
    label: str = ""

    def call_time(self, call: Call, heads: int, mask: Mask = CAUSAL, merged: bool = True) -> float:
        """Seconds of one call (``merged``: its rows go through the engine's merge)."""
        c = count_tiles(call.rows, call.keys, call.q0, call.k0, mask, self.q_tile, self.k_tile)
        if c.q_tiles == 0:
            return 0.0
        per_head = (self.tile_s * (c.full + self.partial_cost * c.partial) + self.q_tile_s * c.q_tiles
                    + self.k_tile_s * c.k_tiles + (self.merge_s * call.rows if merged else 0.0))
        return self.launch_s + heads * per_head

    def features(self, calls: Sequence[Call], heads: int, mask: Mask = CAUSAL, merged: bool = True) -> np.ndarray:
        """``[5]``: what multiplies (tile_s, q_tile_s, k_tile_s, merge_s, launch_s) in the calls' time."""
        out = np.zeros(5)
        for call in calls:
            c = count_tiles(call.rows, call.keys, call.q0, call.k0, mask, self.q_tile, self.k_tile)
            if c.q_tiles == 0:
                continue
            out += [heads * (c.full + self.partial_cost * c.partial), heads * c.q_tiles, heads * c.k_tiles,
                    heads * call.rows if merged else 0.0, 1.0]
        return out


def calls_time(costs: TileCosts, calls: Iterable[Call], heads: int, mask: Mask = CAUSAL, merged: bool = True) -> float:
    """Seconds of a sequence of calls on one device (one stream: they add)."""
    return float(sum(costs.call_time(c, heads, mask, merged) for c in calls))


def fit_tile_costs(samples: Sequence[tuple[Sequence[Call], int, bool, float]], *, mask: Mask = CAUSAL,
                   q_tile: int = 128, k_tile: int = 128, partial_costs: Sequence[float] = (0.5, 0.75, 1.0),
                   free: Sequence[str] = ("tile_s", "q_tile_s", "merge_s", "launch_s"),
                   q_tile_ratio: float | None = None, label: str = "") -> TileCosts:
    """Least-squares constants from ``samples`` ``(calls, heads, merged, measured seconds)``, in
    *relative* error (each sample weighted by 1 / its time, so short and long runs count alike),
    every constant >= 0 (an exact active-set search over the few free constants), ``partial_cost``
    by grid. ``q_tile_ratio``: tie ``q_tile_s = ratio * tile_s`` (a ratio from another source, e.g.
    a published throughput-vs-length curve, where the samples are all long and cannot show it).
    Returns the best fit."""
    names = ("tile_s", "q_tile_s", "k_tile_s", "merge_s", "launch_s")
    if q_tile_ratio is not None:
        free = tuple(n for n in free if n != "q_tile_s")
    cols = [names.index(n) for n in free]
    y = np.array([s[3] for s in samples], dtype=np.float64)
    best: tuple[float, TileCosts] | None = None
    for pc in partial_costs:
        base = TileCosts(tile_s=0.0, partial_cost=pc, q_tile=q_tile, k_tile=k_tile, label=label)
        F = np.array([base.features(calls, heads, mask, merged) for calls, heads, merged, _ in samples])
        if q_tile_ratio is not None:                                   # tile_s's column carries q tiles too
            F[:, 0] += q_tile_ratio * F[:, 1]
        X = F[:, cols]
        Xw, yw = X / y[:, None], np.ones_like(y)
        for keep in itertools.chain.from_iterable(itertools.combinations(range(len(cols)), r)
                                                  for r in range(len(cols), 0, -1)):
            coef = np.zeros(len(cols))
            sol, *_ = np.linalg.lstsq(Xw[:, keep], yw, rcond=None)
            if (sol < 0).any():
                continue
            coef[list(keep)] = sol
            err = float(np.sum((Xw @ coef - yw) ** 2))
            if best is None or err < best[0] - 1e-15:
                fitted = {names[c]: float(v) for c, v in zip(cols, coef)}
                if q_tile_ratio is not None:
                    fitted["q_tile_s"] = q_tile_ratio * fitted.get("tile_s", 0.0)
                best = (err, replace(base, **fitted))
    if best is None:
        raise ValueError("fit_tile_costs: no non-negative fit (are the samples' times positive?)")
    return best[1]
