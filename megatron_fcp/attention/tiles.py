"""Which query rows meet which keys: tiles for the math kernel, pieces for the fused CPU op.

Pure index logic from token positions (and, for packed batches, document ids); no arithmetic on
tensors. Kinds: ``full`` (every row sees every key of the range), ``partial`` (a mask is built
from positions), ``masked`` (nothing visible: skipped), ``causal`` (the fused op's top-left
causal) and ``math`` (rows the fused op cannot express, delegated to the math kernel).

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

__all__ = ["FULL", "PARTIAL", "MASKED", "CAUSAL", "MATH", "runs", "key_chunks", "math_tiles", "flash_pieces"]

FULL, PARTIAL, MASKED, CAUSAL, MATH = "full", "partial", "masked", "causal", "math"


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


def _classify(q_lo: int, q_hi: int, k_lo: int, k_hi: int, causal: bool) -> str:
    """Kind of a (query tile, key chunk) pair from position ranges (query ranges are increasing runs)."""
    if not causal or q_lo >= k_hi:
        return FULL
    if q_hi < k_lo:
        return MASKED
    return PARTIAL


def key_chunks(m: int, key_chunk: int, kd: list[int] | None) -> list[tuple[int, int]]:
    """Key chunks ``(c0, c1)`` of at most ``key_chunk`` keys, cut at every document change of ``kd``."""
    if kd is None:
        return [(c, min(c + key_chunk, m)) for c in range(0, m, key_chunk)]
    bounds = []
    for s0, s1 in runs(list(range(m)), kd):                    # one document segment each
        bounds.extend((c, min(c + key_chunk, s1)) for c in range(s0, s1, key_chunk))
    return bounds


def math_tiles(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, rows_per_tile: int,
               key_chunk: int, q_doc: torch.Tensor | None = None,
               k_doc: torch.Tensor | None = None) -> Iterator[tuple[int, int, list[tuple[int, int, str]]]]:
    """Yield ``(a, z, chunks)``: query rows a:z and their key chunks ``(c0, c1, kind)`` with kind
    full / partial (fully masked chunks are left out; a tile with no chunk left is not yielded).

    With document ids neither a tile nor a chunk crosses a document boundary, and a (tile, chunk)
    pair of two different documents is masked (skipped) before positions are looked at."""
    qp = q_pos.tolist()
    m = k_pos.numel()
    qd = q_doc.tolist() if q_doc is not None else None
    kd = k_doc.tolist() if k_doc is not None else None
    bounds = key_chunks(m, key_chunk, kd)
    chunk_doc = [kd[c0] for c0, _ in bounds] if kd is not None else None
    if causal:
        kp = k_pos.tolist()
        ranges = [(min(kp[c0:c1]), max(kp[c0:c1])) for c0, c1 in bounds]
        is_run = [kp[c1 - 1] - kp[c0] == c1 - c0 - 1 and ranges[i] == (kp[c0], kp[c1 - 1])
                  for i, (c0, c1) in enumerate(bounds)]
    for ra, rb in runs(qp, qd):
        same = None if qd is None else [d == qd[ra] for d in chunk_doc]  # chunk in this run's document
        for a in range(ra, rb, rows_per_tile):
            z = min(a + rows_per_tile, rb)
            if not causal:
                chunks = [(c0, c1, FULL) for i, (c0, c1) in enumerate(bounds) if same is None or same[i]]
                if chunks:
                    yield a, z, chunks
                continue
            chunks = []
            for i, (c0, c1) in enumerate(bounds):
                if same is not None and not same[i]:
                    continue                                        # another document: masked
                lo, hi = ranges[i]
                kind = _classify(qp[a], qp[z - 1], lo, hi, True)
                if kind == PARTIAL and is_run[i]:
                    # an increasing run of keys: those after the tile's last query are masked
                    # for every row, so clip the chunk there
                    c1 = c0 + max(0, min(c1 - c0, qp[z - 1] - lo + 1))
                    kind = _classify(qp[a], qp[z - 1], lo, kp[c1 - 1], True)
                if kind != MASKED:
                    chunks.append((c0, c1, kind))
            if chunks:
                yield a, z, chunks


def flash_pieces(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, q_doc: torch.Tensor | None = None,
                 k_doc: torch.Tensor | None = None) -> list[tuple[int, int, str, int, int]]:
    """Cut a (query shard, KV block) pair into pieces torch's fused CPU op can run.

    Returns ``(a, z, kind, k0, k1)``: query rows a:z against keys k0:k1, kind ``full`` (no mask),
    ``causal`` (top-left causal: rows a:z have positions klo..klo+(k1-k0)-1, the keys' own
    positions) or ``math`` (delegated to the math kernel with the whole block, ``k0, k1 = 0, m``).
    Every row is in at most one piece; rows that see no key are left out. Without
    document ids: non-causal is one full piece; causal with the block's keys an increasing run
    klo..khi, per increasing run of query rows: rows before klo masked; rows in [klo, khi]
    ``causal`` if the run reaches back to klo (a query chunk against its own block or a sub-block
    of it, parts_per_chunk > 1), else ``math`` (a run starting inside the block: the op has no
    bottom-right causal); rows after khi ``full``. Keys that are not one increasing run: the whole
    pair is delegated to ``math``. With document ids (``q_doc``, ``k_doc``) the same rule runs per
    query run (which never crosses a document) against the keys of its own document, when those
    are one segment of the block (and, causal, one increasing run); rows of a document the block
    lacks are masked; anything else goes to ``math`` for that run's rows.
    """
    n, m = q_pos.numel(), k_pos.numel()
    kp, qp = k_pos.numpy(), q_pos.numpy()
    if q_doc is None:
        if not causal:
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
        if seg is None or (causal and not _is_run(kp[seg[0]:seg[1]])):
            pieces.append((ra, rb, MATH, 0, m))
            continue
        k0, k1 = seg
        if not causal:
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
