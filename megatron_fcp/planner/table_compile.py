"""Vectorised compile for large CP groups: graph edges and wave rounds as numpy columns. Pure, no torch.

Note [Compiling to a table]
---------------------------
Above :data:`~megatron_fcp.planner.compile.CHECK_TREES_MAX_CP` ranks without port limits the
compiler places every tree edge ASAP ("waves", step 3 of Note [Compiling a plan]): edge at depth
``d`` of part ``p`` in round ``d - 1 + p`` (``d - 1`` when the graph does not pipeline parts), and
a round lists, for each block ``(owner, chunk)`` in source order (owners in CP order, chunk 0 then
1), its parts in order, each part's edges of that depth in tree order. The functions here write
exactly those rounds as a :class:`~megatron_fcp.contract.table.TransferTable` (Note [Columnar
plans]) without one Python object per transfer; tests compare them row for row with the object
compiler (``compile._waves`` over ``tree_runs``):

* ``hierarchical`` (:func:`hierarchical_table`): over the group flattened node by node
  (``_RailLayout``), a batch of blocks becomes boolean matrices ``[blocks, cp]``: *readers*
  (``needs_chunk``), one *relay* column per node (the member on the owner's rail, per distinct
  ``(rail, node size, chunk)``) and the home node's columns. Depth 1 is the home node's readers
  plus, on every other node with a reader, its relay; depth 2 is every other reader off the home
  node, sent by its node's relay. ``np.flatnonzero`` lists both in tree order. With ``P`` parts
  round ``k`` holds part ``k-1``'s depth-2 edges and then part ``k``'s depth-1 edges of each
  block, merged by position arithmetic. Example, two nodes of two ranks, non-causal, the block of
  CP rank 0 (flat order 0 1 | 2 3, rail 0)::

      readers   . x | x x      depth 1: 1 (home reader), 2 (node 1's relay)
      relay     x . | x .      depth 2: 3, sent by 2

* ``ring`` (:func:`ring_table`): the block of CP rank ``i`` crosses hop ``k`` (``i+k -> i+k+1``)
  in round ``k`` until its farthest reader; all parts in the same round. Between two changes of
  the set of blocks still travelling a pass writes a ``rounds x blocks`` grid.
* ``full`` (:func:`full_table`): part ``p`` of every block goes from its owner to its readers (CP
  order) in round ``p``.

The graphs' edge lists are arrays too (:func:`hierarchical_edges`, :func:`full_edges`), in the
order the Python builders listed them: an 8,192-rank rail graph has 8.4M edges.
"""

from __future__ import annotations

import numpy as np

from megatron_fcp.contract.needs import needs_chunk
from megatron_fcp.contract.table import TransferTable, small_int

__all__ = ["hierarchical_edges", "full_edges", "hierarchical_table", "ring_table", "full_table"]

BATCH_CELLS = 1 << 21
"""Cells (blocks x ranks) of the boolean matrices built per batch of blocks."""


def hierarchical_edges(lay, cp_order: np.ndarray) -> np.ndarray:
    """Edges of the rail-striped graph as an ``[E, 2]`` array of global ranks, in the order
    ``HierarchicalGraph`` lists them: full mesh inside each node (nodes in ``lay`` order, members
    in rail order, ``a`` then ``b``), then for each rank ``a`` in CP order (``cp_order``: flat
    positions) and each other node, its entry for chunk 0 and, when it differs, for chunk 1
    (``entry_position``; repeats dropped, first kept)."""
    ranks = lay.ranks.astype(small_int(int(lay.ranks.max(initial=0))))
    sizes = np.diff(np.append(lay.starts, len(ranks)))
    N = len(sizes)
    even = bool((sizes == sizes[0]).all()) if N else True
    if even and N:  # full mesh per node, all nodes at once
        S = int(sizes[0])
        m = ranks.reshape(N, S)
        off = ~np.eye(S, dtype=bool)
        parts = [np.stack([np.broadcast_to(m[:, :, None], (N, S, S))[:, off],
                           np.broadcast_to(m[:, None, :], (N, S, S))[:, off]], axis=2).reshape(-1, 2)]
    else:
        parts = []
        for start, size in zip(lay.starts.tolist(), sizes.tolist()):
            mm = ranks[start:start + size]
            a, b = np.repeat(mm, size), np.tile(mm, size)
            parts.append(np.stack([a, b], axis=1)[a != b])
    if N > 1:
        rail = np.asarray(lay.rail_pos, dtype=np.int64)[cp_order][:, None]   # [cp, 1]
        other = np.arange(N - 1)[None, :]
        other = other + (other >= lay.node[cp_order][:, None])               # [cp, N-1]: the other nodes
        size = sizes[other]
        e0 = lay.starts[other] + rail % size                                 # [cp, N-1] flat entry, chunk 0
        src = np.broadcast_to(ranks[cp_order][:, None], e0.shape)
        home_size = lay.size_of[cp_order][:, None]
        e1 = None if even else lay.starts[other] + np.where(size > home_size, (rail + home_size) % size, rail % size)
        if e1 is None or (e1 == e0).all():  # chunk 1 enters where chunk 0 does
            out = np.empty((e0.size, 2), dtype=ranks.dtype)
            out[:, 0], out[:, 1] = src.ravel(), ranks[e0.ravel()]
            parts.append(out)
        else:
            target = np.stack([e0, e1], axis=2)                              # [cp, N-1, 2]
            keep = np.stack([np.ones_like(e0, dtype=bool), e1 != e0], axis=2)
            parts.append(np.stack([np.broadcast_to(src[:, :, None], target.shape)[keep],
                                   ranks[target[keep]]], axis=1))
    return np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64)


def full_edges(ranks) -> np.ndarray:
    """All ordered pairs ``(a, b)``, ``a != b``, in CP order (``FullGraph``'s list), int64 ``[E, 2]``."""
    r = np.asarray(ranks, dtype=np.int64)
    a, b = np.repeat(r, len(r)), np.tile(r, len(r))
    return np.stack([a, b], axis=1)[a != b]


def _readers(cp_of: np.ndarray, own: np.ndarray, chunk: np.ndarray, causal: bool) -> np.ndarray:
    """``[blocks, ranks]`` booleans: the rank at each column (CP index ``cp_of``) needs the block."""
    return needs_chunk(cp_of[None, :], own[:, None], chunk[:, None], causal)


def _table(pieces: list[list[tuple]], idx_t, blk_t) -> TransferTable:
    """Concatenate per-round lists of ``(src, dst, block)`` pieces into one table."""
    counts = [sum(len(p[0]) for p in rnd) for rnd in pieces]
    T = sum(counts)
    src, dst, blk = np.empty(T, idx_t), np.empty(T, idx_t), np.empty(T, blk_t)
    at = 0
    for rnd in pieces:
        for s, d, b in rnd:
            n = len(s)
            src[at:at + n], dst[at:at + n], blk[at:at + n] = s, d, b
            at += n
        rnd.clear()
    while counts and not counts[-1]:
        counts.pop()  # trailing empty rounds are not rounds (as in compile._waves)
    return TransferTable(np.concatenate(([0], np.cumsum(counts))).astype(np.int64), src, dst, blk)


def _cp_positions(lay, ranks) -> tuple[np.ndarray, np.ndarray]:
    """``(cp_of [n], flat_of [cp])``: CP index of each flat position, flat position of each CP index."""
    flat_of = lay.positions(ranks)
    cp_of = np.empty_like(flat_of)
    cp_of[flat_of] = np.arange(len(flat_of))
    return cp_of, flat_of


def hierarchical_table(cg, causal: bool, P: int) -> TransferTable:
    """The waves of ``HierarchicalGraph`` trees (every chunk leaves on its owner's rail) as a
    table; see Note [Compiling to a table]. Rows equal ``compile._waves`` over ``tree_runs``.

    Per batch of blocks (source order ``b = 2 * i + chunk``), over flat positions: ``second``
    starts as the readers, ``first`` as nothing; on every node the relay column (one per node,
    from the block's ``(rail, home size, chunk)``) gets ``first = node has a reader`` and
    ``second = False``; the home node's columns get ``first = reader``, ``second = False``.
    ``np.flatnonzero`` lists each in tree order; senders are the owner (depth 1) or the relay of
    the receiver's node (depth 2). Two passes: the first keeps the masks bit-packed and counts
    them, so the second writes every row straight into its place (no pieces to concatenate: the
    table's memory is touched once).
    """
    lay = cg.meta["rails"]
    cp = len(cg.ranks)
    n, nb = len(lay.ranks), 2 * cp * P
    idx_t, blk_t = small_int(cp), small_int(nb)
    cp_of, flat_of = _cp_positions(lay, cg.ranks)
    cp_of_t = cp_of.astype(idx_t)
    # relay tables, one row per distinct (rail, home size, chunk) of the blocks
    keys: dict[tuple, int] = {}
    relay_rows = []
    kid = np.empty(2 * cp, dtype=np.int64)
    rail_of, size_of = np.asarray(lay.rail_pos)[flat_of].tolist(), lay.size_of[flat_of].tolist()
    for b in range(2 * cp):
        key = (rail_of[b >> 1], size_of[b >> 1], b & 1)
        k = keys.get(key)
        if k is None:
            k = keys[key] = len(relay_rows)
            relay_rows.append(lay.relay_for(*key)[0])
        kid[b] = k
    relay_flat = np.stack(relay_rows)                  # [keys, n]: flat position of the relay serving k
    relay_cp = cp_of_t[relay_flat].ravel()             # [keys * n]: its CP index
    relay_col = relay_flat[:, lay.starts]              # [keys, nodes]: the relay column of each node
    home_start = lay.start_of[flat_of][np.arange(2 * cp) >> 1]
    home_size = lay.size_of[flat_of][np.arange(2 * cp) >> 1]
    span = np.arange(int(lay.size_of.max(initial=1)))
    step = max(1, BATCH_CELLS // max(n, 1))
    batches = [np.arange(b0, min(b0 + step, 2 * cp)) for b0 in range(0, 2 * cp, step)]
    packed, n1, n2 = [], [], []
    for bb in batches:  # pass 1: masks, bit-packed, and their counts
        B = len(bb)
        reader = _readers(cp_of, bb >> 1, bb & 1, causal)                 # [B, n]
        first = np.zeros_like(reader)                                     # [B, n] depth 1
        rows = np.arange(B)[:, None]
        rc = relay_col[kid[bb]]                                           # [B, nodes]
        first[rows, rc] = np.logical_or.reduceat(reader, lay.starts, axis=1)
        second = reader                                                   # [B, n] depth 2 (reader reused)
        home = span[None, :] < home_size[bb][:, None]                     # [B, S]
        hr, hc = np.broadcast_to(rows, home.shape)[home], (home_start[bb][:, None] + span[None, :])[home]
        first[hr, hc] = reader[hr, hc]
        second[rows, rc] = False
        second[hr, hc] = False
        packed.append((np.packbits(first), np.packbits(second)))
        n1.append(int(np.count_nonzero(first)))
        n2.append(int(np.count_nonzero(second)))
    # round 0: part 0 at depth 1; round k (1..P-1): part k-1 at depth 2 then part k at depth 1,
    # block by block; round P: part P-1 at depth 2
    n1, n2 = np.array(n1, dtype=np.int64), np.array(n2, dtype=np.int64)
    per_round = [n1] + [n1 + n2] * (P - 1) + [n2]                        # [rounds][batches]
    counts = [int(c.sum()) for c in per_round]
    while counts and not counts[-1]:
        counts.pop()  # trailing empty rounds are not rounds (as in compile._waves)
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    T = int(starts[-1])
    src, dst, blk = np.empty(T, idx_t), np.empty(T, idx_t), np.empty(T, blk_t)
    at = [int(starts[k]) for k in range(len(counts))]                     # write position per round
    for bb, (p1, p2) in zip(batches, packed):  # pass 2: rows straight into place
        B = len(bb)
        base = np.arange(B, dtype=np.int64) * n
        f1 = np.flatnonzero(np.unpackbits(p1, count=B * n))
        f2 = np.flatnonzero(np.unpackbits(p2, count=B * n))
        k1 = np.diff(np.searchsorted(f1, np.append(base, B * n)))
        k2 = np.diff(np.searchsorted(f2, np.append(base, B * n)))
        b_of = (bb * P).astype(blk_t)
        run1 = (np.repeat((bb >> 1).astype(idx_t), k1), cp_of_t[f1 - np.repeat(base, k1)], np.repeat(b_of, k1))
        run2 = (relay_cp[f2 + np.repeat(kid[bb] * n - base, k2)], cp_of_t[f2 - np.repeat(base, k2)],
                np.repeat(b_of, k2))
        outs = [run1]
        if P > 1:
            merged, which = _merge_by_block(np.repeat(np.arange(B), k2), np.repeat(np.arange(B), k1), run2, run1, B)
            outs += [(merged[0], merged[1], merged[2] + (k - 1) + which) for k in range(1, P)]
        outs.append((run2[0], run2[1], run2[2] + (P - 1)))
        for k, (s, d, b) in enumerate(outs[:len(counts)]):
            e = at[k] + len(s)
            src[at[k]:e], dst[at[k]:e], blk[at[k]:e] = s, d, b
            at[k] = e
    return TransferTable(starts, src, dst, blk)


def _merge_by_block(ra: np.ndarray, rb: np.ndarray, a: tuple, b: tuple, n_rows: int):
    """Columns ``a`` (rows ``ra``) and ``b`` (rows ``rb``), both sorted by row, merged so each row
    lists its ``a`` entries before its ``b`` entries; also ``which`` (0 from ``a``, 1 from ``b``)."""
    na, nb_ = np.bincount(ra, minlength=n_rows), np.bincount(rb, minlength=n_rows)
    seg = np.cumsum(na + nb_) - (na + nb_)            # first output position of each row
    sa, sb = np.cumsum(na) - na, np.cumsum(nb_) - nb_  # first input position of each row
    pos_a = seg[ra] + np.arange(len(ra)) - sa[ra]
    pos_b = seg[rb] + na[rb] + np.arange(len(rb)) - sb[rb]
    out = []
    for x, y in zip(a, b):
        m = np.empty(len(x) + len(y), dtype=np.result_type(x, y))
        m[pos_a], m[pos_b] = x, y
        out.append(m)
    which = np.zeros(len(ra) + len(rb), dtype=out[2].dtype)
    which[pos_b] = 1
    return out, which


def ring_table(cg, causal: bool, P: int) -> TransferTable:
    """The waves of ``RingGraph`` trees as a table: block ``b`` of CP rank ``i`` crosses hop
    ``k`` (``i+k -> i+k+1``, mod cp) in round ``k`` for ``k`` below its farthest reader's
    distance; a round lists blocks in source order, each block's parts in order."""
    cp = len(cg.ranks)
    nb = 2 * cp * P
    idx_t, blk_t = small_int(cp), small_int(nb)
    last = np.zeros(2 * cp, dtype=np.int64)  # hops each block travels: to its farthest reader
    step = max(1, BATCH_CELLS // max(cp, 1))
    dist = np.arange(cp)
    for b0 in range(0, 2 * cp, step):
        bb = np.arange(b0, min(b0 + step, 2 * cp))
        own = bb >> 1
        reader = _readers(dist, own, bb & 1, causal)                                # [B, cp]
        below = reader & (dist[None, :] < own[:, None])  # readers reached after wrapping around
        top_below = cp - 1 - np.argmax(below[:, ::-1], axis=1)
        top = cp - 1 - np.argmax(reader[:, ::-1], axis=1)
        last[bb] = np.where(below.any(axis=1), top_below - own + cp, np.where(reader.any(axis=1), top - own, 0))
    R = int(last.max(initial=0))
    counts = P * (2 * cp - np.searchsorted(np.sort(last), np.arange(R), side="right"))  # blocks with last > k
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    T = int(starts[-1])
    src, dst, blk = np.empty(T, idx_t), np.empty(T, idx_t), np.empty(T, blk_t)
    # between two distinct values of ``last`` the same blocks travel: rounds x blocks x parts grids
    bounds = sorted({0, R, *last[(last > 0) & (last < R)].tolist()})
    wrap = (np.arange(2 * cp + 1) % max(cp, 1)).astype(idx_t)               # CP index of position x mod cp
    for lo, hi in zip(bounds, bounds[1:]):
        active = np.flatnonzero(last > lo)                                   # [A] blocks, source order
        own = np.repeat(active >> 1, P)[None, :]                             # [1, A*P]
        b = (active[:, None] * P + np.arange(P)[None, :]).reshape(1, -1)     # [1, A*P] block ids
        G = max(1, BATCH_CELLS // (len(active) * P))
        for k0 in range(lo, hi, G):
            ks = np.arange(k0, min(k0 + G, hi))[:, None]
            grid = (len(ks), own.shape[1])
            a, e = int(starts[k0]), int(starts[k0 + len(ks)])
            hop = own + ks                                                   # [G, A*P]: i + k
            np.take(wrap, hop, out=src[a:e].reshape(grid))
            hop += 1
            np.take(wrap, hop, out=dst[a:e].reshape(grid))
            blk[a:e].reshape(grid)[...] = b
    return TransferTable(starts, src, dst, blk)


def full_table(cg, causal: bool, P: int) -> TransferTable:
    """The waves of ``FullGraph`` trees as a table: in round ``p`` part ``p`` of every block goes
    from its owner to each reader (CP order), blocks in source order."""
    cp = len(cg.ranks)
    nb = 2 * cp * P
    idx_t, blk_t = small_int(cp), small_int(nb)
    dist = np.arange(cp)
    runs = []
    step = max(1, BATCH_CELLS // max(cp, 1))
    for b0 in range(0, 2 * cp, step):
        bb = np.arange(b0, min(b0 + step, 2 * cp))
        r, c = np.nonzero(_readers(dist, bb >> 1, bb & 1, causal))
        runs.append(((bb[r] >> 1).astype(idx_t), c.astype(idx_t), (bb[r] * P).astype(blk_t)))
    pieces = [[(s, d, b + p) for s, d, b in runs] for p in range(P)]
    return _table(pieces, idx_t, blk_t)
