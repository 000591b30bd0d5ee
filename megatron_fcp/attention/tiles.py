"""Which query rows meet which keys: tiles for the math kernel, pieces for the fused CPU op.

Pure index logic from token positions (and, for packed batches, document ids) under a
:class:`~megatron_fcp.contract.mask.Mask` (causal, full, or a sliding window); no arithmetic on
tensors. Kinds: ``full`` (every row sees every key of the range), ``partial`` (a mask is built
from positions), ``masked`` (nothing visible: skipped), ``causal`` (the fused op's top-left
causal), ``band`` (a sliding-window band the op expresses with flash-attn's
``window_size_left/right``: :func:`flash_window`) and ``math`` (rows the fused op cannot express,
delegated to the math kernel). Every class comes from :meth:`Mask.classify` / :meth:`Mask.key_range`
(the one rule); nothing here re-derives which keys a query sees.

Query rows are cut into *runs*: maximal ranges whose position grows by exactly one per row and
whose document stays the same (a zigzag shard's two chunks are two runs; a placement's spans of
different documents are different runs). Tiles and pieces never cross a run, key chunks never
cross a document, and a (tile, chunk) pair of two documents is masked before positions are
looked at, so attention never crosses a document.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from megatron_fcp.contract.mask import FULL_PAIRS, NO_PAIRS, PARTIAL_PAIRS, Mask, as_mask

__all__ = ["FULL", "PARTIAL", "MASKED", "CAUSAL", "BAND", "MATH", "runs", "key_chunks", "math_tiles",
           "flash_pieces", "flash_window", "sees_any"]

FULL, PARTIAL, MASKED, CAUSAL, BAND, MATH = FULL_PAIRS, PARTIAL_PAIRS, NO_PAIRS, "causal", "band", "math"


def runs(pos, doc=None) -> list[tuple[int, int]]:
    """Maximal index ranges [a, b) over which ``pos`` increases by exactly 1 per step (and, with
    ``doc``, the document stays the same). Vectorised (numpy): shards have 10^5 rows."""
    p = np.asarray(pos, dtype=np.int64)
    if p.size == 0:
        return []
    cut = np.diff(p) != 1
    if doc is not None:
        cut |= np.diff(np.asarray(doc, dtype=np.int64)) != 0
    bounds = [0, *(np.flatnonzero(cut) + 1).tolist(), int(p.size)]
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _is_run(x: np.ndarray) -> bool:
    """Whether ``x`` increases by exactly one per step."""
    return bool(x.size == 0 or (np.diff(x) == 1).all())


def key_chunks(m: int, key_chunk: int, kd: list[int] | None) -> list[tuple[int, int]]:
    """Key chunks ``(c0, c1)`` of at most ``key_chunk`` keys, cut at every document change of ``kd``."""
    if kd is None:
        return [(c, min(c + key_chunk, m)) for c in range(0, m, key_chunk)]
    bounds = []
    for s0, s1 in runs(list(range(m)), kd):                    # one document segment each
        bounds.extend((c, min(c + key_chunk, s1)) for c in range(s0, s1, key_chunk))
    return bounds


def math_tiles(q_pos: torch.Tensor, k_pos: torch.Tensor, mask: "Mask | bool", rows_per_tile: int,
               key_chunk: int, q_doc: torch.Tensor | None = None,
               k_doc: torch.Tensor | None = None) -> Iterator[tuple[int, int, list[tuple[int, int, str]]]]:
    """Yield ``(a, z, chunks)``: query rows a:z and their key chunks ``(c0, c1, kind)`` with kind
    full / partial (fully masked chunks are left out; a tile with no chunk left is not yielded).

    ``mask``: a :class:`~megatron_fcp.contract.mask.Mask` (a bool is ``causal``). Each (tile, chunk)
    pair is classed by :meth:`Mask.classify` on the tile's positions and the chunk's position range;
    a partial chunk whose keys are an increasing run is clipped to :meth:`Mask.key_range` of the
    tile (keys outside it are masked for every row: before a window's left edge, after the last
    query), then classed again. With document ids neither a tile nor a chunk crosses a document
    boundary, and a (tile, chunk) pair of two different documents is masked (skipped) before
    positions are looked at."""
    mask = as_mask(mask)
    qp = q_pos.tolist()
    m = k_pos.numel()
    qd = q_doc.tolist() if q_doc is not None else None
    kd = k_doc.tolist() if k_doc is not None else None
    bounds = key_chunks(m, key_chunk, kd)
    chunk_doc = [kd[c0] for c0, _ in bounds] if kd is not None else None
    masked = mask.causal or mask.windowed                               # else every pair is visible
    if masked:
        kp = k_pos.tolist()
        ranges = [(min(kp[c0:c1]), max(kp[c0:c1])) for c0, c1 in bounds]
        is_run = [kp[c1 - 1] - kp[c0] == c1 - c0 - 1 and ranges[i] == (kp[c0], kp[c1 - 1])
                  for i, (c0, c1) in enumerate(bounds)]
    for ra, rb in runs(qp, qd):
        same = None if qd is None else [d == qd[ra] for d in chunk_doc]  # chunk in this run's document
        for a in range(ra, rb, rows_per_tile):
            z = min(a + rows_per_tile, rb)
            if not masked:
                chunks = [(c0, c1, FULL) for i, (c0, c1) in enumerate(bounds) if same is None or same[i]]
                if chunks:
                    yield a, z, chunks
                continue
            chunks = []
            for i, (c0, c1) in enumerate(bounds):
                if same is not None and not same[i]:
                    continue                                        # another document: masked
                lo, hi = ranges[i]
                kind = mask.classify(qp[a], qp[z - 1], lo, hi)
                if kind == PARTIAL and is_run[i]:
                    # an increasing run of keys: those outside what any row of the tile can see
                    # are masked for every row, so clip the chunk to that range
                    r_lo, r_hi = mask.key_range(qp[a], qp[z - 1])
                    n0, n1 = max(0, r_lo - lo), min(c1 - c0, r_hi - lo + 1)
                    if n1 <= n0:
                        continue
                    c0, c1 = c0 + n0, c0 + n1
                    kind = mask.classify(qp[a], qp[z - 1], kp[c0], kp[c1 - 1])
                if kind != MASKED:
                    chunks.append((c0, c1, kind))
            if chunks:
                yield a, z, chunks


def sees_any(q_pos: torch.Tensor, k_pos: torch.Tensor, mask: "Mask | bool", q_doc: torch.Tensor | None = None,
             k_doc: torch.Tensor | None = None) -> bool:
    """Whether some query may see some key (False: the block is fully masked for these rows and the
    executor skips it). Increasing runs of queries against increasing runs of keys of the same
    document, each pair classed by :meth:`Mask.classify` (exact on runs: True iff a pair is
    visible). No rows or no keys: False."""
    mask = as_mask(mask)
    n, m = q_pos.numel(), k_pos.numel()
    if n == 0 or m == 0:
        return False
    qp, kp = q_pos.numpy(), k_pos.numpy()
    qd = None if q_doc is None else q_doc.numpy()
    kd = None if k_doc is None else k_doc.numpy()
    k_runs = runs(kp, kd)
    for qa, qb in runs(qp, qd):
        for ka, kb in k_runs:
            if qd is not None and int(qd[qa]) != int(kd[ka]):
                continue
            if mask.classify(int(qp[qa]), int(qp[qb - 1]), int(kp[ka]), int(kp[kb - 1])) != MASKED:
                return True
    return False


def flash_window(q0: int, t: int, k0: int, m: int, mask: "Mask | bool") -> tuple[int, int] | None:
    """flash-attn's ``(window_size_left, window_size_right)`` for queries at positions
    ``q0 .. q0+t-1`` against keys at positions ``k0 .. k0+m-1`` under ``mask``, or None when the
    library's window cannot express that band exactly.

    Note [flash-attn's window convention]
    -------------------------------------
    flash-attn (and torch's vendored FlashAttention-2) aligns a window *bottom-right*: query row
    ``i`` of ``t`` sees key index ``j`` of ``m`` iff ``i + (m - t) - wl <= j <= i + (m - t) + wr``
    (-1: that side unbounded; the library first turns any ``w >= m`` into -1). Ours is by position
    (:meth:`Mask.key_range`): row ``i`` sees key indices ``[A + i, B + i]`` with ``A, B`` the first
    row's bounds minus ``k0``. So ``wl = (m - t) - A`` and ``wr = B - (m - t)``; a side is passed
    as -1 when no row is cut there (lower: the last row's bound ``A + t - 1 <= 0``; upper: the first
    row's ``B >= m - 1``). A bounded side must come out ``>= 0`` and ``< m`` (a negative or a
    ``>= m`` value would read as unbounded): otherwise None and the caller runs the math kernel.
    Callers pass only rows that see at least one key of the range (flash-attn gives a row that
    sees nothing ``lse = +inf``)."""
    lo_pos, hi_pos = as_mask(mask).key_range(q0, q0)
    a, b = lo_pos - k0, hi_pos - k0                     # key indices row 0 sees: [a, b]
    wl = -1 if a + t - 1 <= 0 else (m - t) - a
    wr = -1 if b >= m - 1 else b - (m - t)
    if wl != -1 and not 0 <= wl < m:
        return None
    if wr != -1 and not 0 <= wr < m:
        return None
    if wl == -1 and a + t - 1 > 0 or wr == -1 and b < m - 1:
        return None                                     # a bounded side came out exactly -1
    return wl, wr


def flash_pieces(q_pos: torch.Tensor, k_pos: torch.Tensor, mask: "Mask | bool", q_doc: torch.Tensor | None = None,
                 k_doc: torch.Tensor | None = None, bands: bool = False) -> list[tuple[int, int, str, int, int]]:
    """Cut a (query shard, KV block) pair into pieces a fused op can run.

    Returns ``(a, z, kind, k0, k1)``: query rows a:z against keys k0:k1, kind ``full`` (no mask),
    ``causal`` (top-left causal: rows a:z have positions klo..klo+(k1-k0)-1, the keys' own
    positions), ``band`` (a sliding-window band, only with ``bands``: the op's window arguments
    are :func:`flash_window` of the piece's first positions and sizes) or ``math`` (delegated to
    the math kernel with the whole block, ``k0, k1 = 0, m``). Every row is in at most one piece;
    rows that see no key are left out. ``mask``: a :class:`~megatron_fcp.contract.mask.Mask`
    (a bool is ``causal``).

    Without a window (causal or full), without document ids: non-causal is one full piece; causal
    with the block's keys an increasing run klo..khi, per increasing run of query rows: rows before
    klo masked; rows in [klo, khi] ``causal`` if the run reaches back to klo (a query chunk against
    its own block or a sub-block of it, parts_per_chunk > 1), else ``math`` (a run starting inside
    the block: the op has no bottom-right causal); rows after khi ``full``. Keys that are not one
    increasing run: the whole pair is delegated to ``math``. With document ids (``q_doc``,
    ``k_doc``) the same rule runs per query run (which never crosses a document) against the keys
    of its own document, when those are one segment of the block (and, masked, one increasing
    run); rows of a document the block lacks are masked; anything else goes to ``math`` for that
    run's rows.

    With a sliding window, per query run against its key segment (a causal window whose left edge
    lies before the segment for every row of the run is plain causal there, the rule above):
    :meth:`Mask.classify` of the
    whole run first (``full``: one full piece; ``masked``: nothing), else the rows split by
    :meth:`Mask.key_range` into those that see nothing (left out), those that see every key
    (``full``) and the band rows (at most two ranges: the window cuts the block's end, or its
    start). Band rows are a ``band`` piece against the keys they can see when ``bands`` (flash-attn
    and torch's FlashAttention-2 take window arguments) and :func:`flash_window` expresses them,
    else ``math`` (torch's fused CPU op has only top-left causal: ``cpu-flash`` runs windowed band
    rows on the math kernel)."""
    mask = as_mask(mask)
    causal, windowed = mask.causal, mask.windowed
    n, m = q_pos.numel(), k_pos.numel()
    kp, qp = k_pos.numpy(), q_pos.numpy()
    if q_doc is None:
        if not causal and not windowed:
            return [(0, n, FULL, 0, m)]
        if not _is_run(kp):
            return [(0, n, MATH, 0, m)]
        qd, segs = None, {None: (0, m)}
    else:
        qd, kd = q_doc.numpy(), k_doc.numpy()
        segs = {}
        for s0, s1 in runs(np.arange(m), kd):                # key segments of one document each
            d0 = int(kd[s0])
            segs[d0] = (s0, s1) if d0 not in segs else None   # None: split in two places
    pieces: list[tuple[int, int, str, int, int]] = []

    def add_full(a: int, z: int, k0: int, k1: int) -> None:
        last = pieces[-1] if pieces else None
        if last is not None and last[2] == FULL and last[1] == a and last[3:] == (k0, k1):
            pieces[-1] = (last[0], z, FULL, k0, k1)                   # adjacent full rows: one call
        else:
            pieces.append((a, z, FULL, k0, k1))

    for ra, rb in runs(qp, qd):
        doc = None if qd is None else int(qd[ra])
        if doc not in segs:
            continue                                                   # no key of this document
        seg = segs[doc]
        if seg is None or ((causal or windowed) and not _is_run(kp[seg[0]:seg[1]])):
            pieces.append((ra, rb, MATH, 0, m))
            continue
        k0, k1 = seg
        if windowed and not (causal and mask.key_range(int(qp[rb - 1]), int(qp[rb - 1]))[0] <= int(kp[k0])):
            _window_pieces(pieces, add_full, mask, qp, kp, ra, rb, k0, k1, m, bands)
            continue                                        # (else the window starts before the block for
        if not causal:                                      # every row of the run: plain causal here)
            add_full(ra, rb, k0, k1)
            continue
        klo, khi, qlo = int(kp[k0]), int(kp[k1 - 1]), int(qp[ra])
        a = ra + max(0, min(rb - ra, klo - qlo))            # first row with position >= klo
        z = ra + max(0, min(rb - ra, khi - qlo + 1))        # first row with position > khi
        if a < z:
            if int(qp[a]) == klo:
                pieces.append((a, z, CAUSAL, k0, k0 + int(qp[z - 1]) - klo + 1))
            else:
                pieces.append((a, z, MATH, 0, m))
        if z < rb:
            add_full(z, rb, k0, k1)
    return pieces


def _window_pieces(pieces: list, add_full, mask: Mask, qp: np.ndarray, kp: np.ndarray, ra: int, rb: int,
                   k0: int, k1: int, m: int, bands: bool) -> None:
    """The pieces of one query run ``ra:rb`` (positions increasing by one) against its key segment
    ``k0:k1`` (an increasing run) under a windowed ``mask`` (:func:`flash_pieces`)."""
    t, qlo = rb - ra, int(qp[ra])
    klo, khi = int(kp[k0]), int(kp[k1 - 1])
    kind = mask.classify(qlo, qlo + t - 1, klo, khi)
    if kind == MASKED:
        return
    if kind == FULL:
        add_full(ra, rb, k0, k1)
        return
    lo0, hi0 = mask.key_range(qlo, qlo)                     # row i sees positions [lo0 + i, hi0 + i]

    def clamp(x: int, a: int, z: int) -> int:
        return max(a, min(z, x))

    a_vis = clamp(klo - hi0, 0, t)                          # first row whose window reaches klo
    z_vis = clamp(khi - lo0 + 1, 0, t)                      # first row whose window starts after khi
    f0 = clamp(khi - hi0, a_vis, z_vis)                     # rows f0:f1 see every key of the segment
    f1 = clamp(klo - lo0 + 1, a_vis, z_vis)

    def band(pa: int, pz: int) -> None:
        if pa >= pz:
            return
        p_lo, p_hi = max(klo, lo0 + pa), min(khi, hi0 + pz - 1)     # keys these rows can see
        kk0, kk1 = k0 + p_lo - klo, k0 + p_hi - klo + 1
        if bands and flash_window(qlo + pa, pz - pa, p_lo, kk1 - kk0, mask) is not None:
            pieces.append((ra + pa, ra + pz, BAND, kk0, kk1))
        else:
            pieces.append((ra + pa, ra + pz, MATH, 0, m))

    if f0 < f1:
        band(a_vis, f0)
        add_full(ra + f0, ra + f1, k0, k1)
        band(f1, z_vis)
    else:
        band(a_vis, z_vis)
