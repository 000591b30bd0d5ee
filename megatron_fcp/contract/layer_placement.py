"""A packed batch placed so that attention pairs *and* tokens are even: the layer's balance. Pure.

Note [Layer-balanced placement]
-------------------------------
Note [Layer work] (in :mod:`megatron_fcp.contract.placement`) measures why attention balance is not
enough: the projections and MLP run on the tokens a rank holds, and a layer's ranks meet at its
attention, so a layer lasts about ``max pairs + lam * max tokens``. This placement
(:func:`place_packed_layer`) keeps both maxima within a few percent of their means. No model
dimension is needed: both resources are balanced, each by itself.

1. **Items.** Each document is cut into the fewest near-equal contiguous chunks whose tokens stay
   within :data:`ITEM_SHARE` of a rank's share of tokens and ``block_tokens``, and whose last
   chunk's pairs (about ``c * L`` for ``c`` tokens of an ``L``-token document) within that share of
   a rank's pairs; most short documents are one item, whole. A chunk at position ``p`` has about
   ``p`` pairs a token: early chunks are cheap in pairs, late ones dear, and the greedy mixes them.
2. **Greedy**, items by decreasing ``max(pairs / W, tokens / T)`` (``W``, ``T``: the means per
   bin), each to the bin where it best fills the deficit, ``v . d`` largest, ``v`` the item's
   ``(pairs / W, tokens / T)`` and ``d`` the bin's ``1 - load / mean`` in each (the bin the item
   leaves nearest its share, in squares); bins where either would pass ``1 +``
   :data:`LAYER_TOLERANCE` only if no bin fits. A bin already holding the item's document takes it
   instead if it fits and its ``v . d`` is within :data:`HOLDER_SLACK` ``* |v|^2`` of the best: a
   document's chunks gather on few bins, and an earlier chunk of a document whose later chunk a
   bin holds lowers that bin's need by its tokens (Note [Placements and document need sets]).
3. **Search**: while the worst bin's ``max(pairs / W, tokens / T)`` is above ``1 +``
   :data:`LAYER_TARGET`, move an item from it, or swap one with a lighter one, to the 8 least
   loaded bins, where that lowers the larger of the two bins' scores (ties: an item whose document
   the other bin holds).
4. **Nodes** (``nodes``, as Note [Node-aware placement]): steps 2-3 onto the nodes (bins of ``g``
   ranks' shares), then each node's items onto its ranks. Adjacent chunks of a document that end on
   one rank are joined into one block.

Tried and measured (1M-token lognormal mixes, medians 2K-32K, cp = 16-256, docs/planner.md "Layer
balance"): zigzag *pairs* of chunks as items (every pair of a document the same pairs per token,
TE's trick) balance as well but need 1.04-1.26x the received tokens of contiguous chunks at the
same holder slack (each holder of a pair needs nearly the whole document); always preferring holders fills a bin with one long document's
chunks (all pairs, few tokens) and leaves others at 0.2x the pairs; a quarter share per item
(with pairs) leaves cp = 256 at 1.11x; a holder slack of 16-64 (more need-aware) lets the search fall behind
(1.04-1.09x) and 4x slower.

The price is communication: a document longer than a rank's token share cannot stay whole (at
cp = 256 on 1M tokens a rank holds 4K tokens, less than the 8K median document), so a layer-balanced
placement receives 2.0-2.9x the tokens the attention balance does in total, still far below TE's THD, which
moves every document to every rank.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_fcp.contract.mask import Mask, check_window
from megatron_fcp.contract.placement import (DEFAULT_BLOCK_TOKENS, Placement, Span, check_placement_args,
                                             node_groups, place_packed)
from megatron_fcp.jit import jit

__all__ = ["place_packed_layer", "place_balanced", "BALANCES", "LAYER_TOLERANCE", "LAYER_TARGET"]

BALANCES = ("attention", "layer")
"""What a packed batch's placement balances (``--fcp-packed-balance``): attention pairs alone
(:func:`~megatron_fcp.contract.placement.place_packed`), or pairs and tokens each
(:func:`place_packed_layer`)."""

LAYER_TOLERANCE = 0.03
"""Pairs and tokens, each max over mean, that the greedy fills bins up to."""

LAYER_TARGET = 0.0005
"""Where the search (step 3) stops: the worst bin within 0.05% of the mean in both. At 1% (before
2026-12-03) the node level and the rank level each stopped there and ranks sat at 1.010-1.018x
the mean pairs, which was the whole gap to TE's exactly split THD chunks on compute-bound packed
batches; at 0.2% (2026-12-03): 1.002-1.005 at cp = 16 and 64, 1.007-1.012 at cp = 256, for 1-24%
more received blocks and about 1.5x the placement's time (docs/planner.md, "Waves of a shard"). At
0.05% (2026-12-05) the compute-bound cells' floor moved: cp = 16, 64:8, 32K median, backward work
1.0037 -> 1.0009x the mean (docs/planner.md, "A tighter search")."""

ITEM_SHARE = 0.125
"""The largest item, as a fraction of a rank's share of either resource (measured with zigzag-pair
items: a quarter left cp = 256 at 1.11x, a sixteenth doubled the blocks for 1.015 against 1.02;
docs/planner.md, "Layer balance")."""

HOLDER_SLACK = 4.0
"""How much worse (in squared item sizes) a bin holding the item's document may fit than the best
bin and still take it (step 2)."""


def _items(lengths: Sequence[int], cp: int, block_tokens: int, mask: Mask) -> list[Span]:
    """Step 1: whole documents, and contiguous chunks of the ones too large for one item
    (:func:`_item_columns` as spans)."""
    doc, start, end = _item_columns(lengths, cp, block_tokens, mask)
    return list(map(Span, doc.tolist(), start.tolist(), end.tolist()))


def _item_columns(lengths: Sequence[int], cp: int, block_tokens: int,
                  mask: Mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step 1 as columns ``(document, start, end)``, ``[items]`` int64 each, in document order, then
    start: a document of ``n`` tokens in ``chunks`` near-equal pieces, piece ``i`` from ``i * n //
    chunks``; ``chunks`` the fewest whose tokens stay within ``block_tokens`` and :data:`ITEM_SHARE`
    of a rank's share of tokens and whose pairs (at most ``tokens * reach``, every query seeing up to
    ``reach`` keys: the document, or its window) within that share of a rank's pairs."""
    n_tok = np.asarray(lengths, dtype=np.int64)                              # [documents]
    share_t, share_w = int(n_tok.sum()) / cp, int(mask.pairs(0, n_tok, 0, n_tok).sum()) / cp
    left, right = mask.window
    reach = n_tok
    if mask.windowed:
        ahead = n_tok if left < 0 else np.full_like(n_tok, left)
        behind = np.zeros_like(n_tok) if mask.causal else (n_tok if right < 0 else np.full_like(n_tok, right))
        reach = np.minimum(n_tok, ahead + 1 + behind)
    c = np.minimum(min(block_tokens, ITEM_SHARE * share_t), ITEM_SHARE * share_w / np.maximum(reach, 1))
    chunks = np.minimum(n_tok, np.maximum(1, np.ceil(n_tok / np.maximum(c, 1.0)).astype(np.int64)))
    doc = np.repeat(np.arange(len(n_tok), dtype=np.int64), chunks)          # [items]
    first = np.cumsum(chunks) - chunks                                      # [documents]: first item
    i = np.arange(len(doc), dtype=np.int64) - first[doc]                     # [items]: piece of its document
    n, k = n_tok[doc], chunks[doc]
    return doc, i * n // k, (i + 1) * n // k


def _assign(doc: np.ndarray, start: np.ndarray, w: np.ndarray, t: np.ndarray, n: int, tolerance: float,
            target: float, candidates: int = 8) -> list[np.ndarray]:
    """Steps 2-3: item indices per bin, in the order the bin took them; ``doc[k]``, ``start[k]``,
    ``w[k]``, ``t[k]``: item ``k``'s document, first token, pairs and tokens. The loops are
    :func:`_assign_kernel`, compiled (Note [Compiled planning loops] in :mod:`megatron_fcp.jit`)."""
    W, T = w.sum() / n, t.sum() / n
    W, T = W or 1.0, T or 1.0
    # largest share first, then document and start: a stable sort on (-max(w/W, t/T), doc, start)
    order = np.lexsort((start, doc, -np.maximum(np.asarray(w, dtype=np.float64) / W, np.asarray(t, dtype=np.float64) / T)))
    members, sizes = _assign_kernel(order.astype(np.int64), np.asarray(w, dtype=np.float64),
                                    np.asarray(t, dtype=np.float64), np.asarray(doc, dtype=np.int64), n, float(W),
                                    float(T), 1.0 + tolerance, float(target), candidates, HOLDER_SLACK)
    return [members[r, :sizes[r]] for r in range(n)]


@jit
def _assign_kernel(order, w, t, doc, n, W, T, cap, target, candidates, holder_slack):
    """Steps 2-3 of Note [Layer-balanced placement] over arrays: returns ``members [n, items]`` and
    ``sizes [n]``, bin ``r`` holding items ``members[r, :sizes[r]]`` in the order they came.

    Greedy (step 2), items in ``order``: the bin with the largest ``v . d`` among those that stay
    within ``cap`` in both resources (any bin if none does), unless a bin holding the item's
    document fits and comes within ``holder_slack * |v|^2`` of it (the best such, ties the lowest
    bin). Search (step 3): while the worst bin's ``max(pairs / W, tokens / T)`` is above ``1 +
    target``, the move of one of its items to, or swap with one of, the ``candidates`` least
    loaded bins that most lowers the larger of the two bins' scores (ties: an item whose document
    the other bin holds, then the earliest item), for up to ``8 n + 64`` steps.

    Note [Swaps by weight]: the swaps with one bin are not all tried. A swap whose ``v`` is above the
    best move or swap found so far (``best_v``) is never taken, so each item of the worst bin only
    looks at the other bin's items whose pairs put ``v`` at or below the least of ``best_v`` and
    the best swap with this bin so far: an interval of pairs, found by bisection over the bin's
    items sorted by pairs (widened far past rounding). Within an item, ties go to the lowest other
    item, the first minimum the full double loop keeps, so the bins come out the same (tested
    against the full loop; 2026-12-07: the node-level search of cp = 256, 512 documents, 4,951
    items on 32 bins, 62 -> 17 ms)."""
    m = order.shape[0]
    n_docs = doc.max() + 1 if m else 1
    held = np.zeros((n_docs, n), dtype=np.int64)     # [documents, bins]: items of the document in the bin
    members = np.empty((n, max(m, 1)), dtype=np.int64)
    sizes = np.zeros(n, dtype=np.int64)
    lw = np.zeros(n)
    lt = np.zeros(n)
    room = np.empty(n)
    fits = np.empty(n, dtype=np.bool_)
    keys = np.empty(max(m, 1))                      # step 3: a bin's items' pairs, and sorted
    wsort = np.empty(max(m, 1))
    for k in order:                                 # step 2
        d = doc[k]
        vw = w[k] / W
        vt = t[k] / T
        for r in range(n):
            fits[r] = ((lw[r] + w[k]) / W <= cap) and ((lt[r] + t[k]) / T <= cap)
            room[r] = vw * (1.0 - lw[r] / W) + vt * (1.0 - lt[r] / T)   # the item against each bin's deficit
            if not fits[r]:
                room[r] = room[r] - 1e9
        best = int(np.argmax(room))
        slack = holder_slack * (vw * vw + vt * vt)
        pick = -1
        for h in range(n):                          # a bin holding the document, if near enough
            if held[d, h] > 0 and fits[h] and room[h] >= room[best] - slack:
                if pick < 0 or room[h] > room[pick]:
                    pick = h
        r = best if pick < 0 else pick
        lw[r] += w[k]
        lt[r] += t[k]
        members[r, sizes[r]] = k
        sizes[r] += 1
        held[d, r] += 1
    for _ in range(8 * n + 64):                     # step 3
        score = np.maximum(lw / W, lt / T)
        a = int(np.argmax(score))
        if score[a] <= 1.0 + target or sizes[a] == 0 or n == 1:
            break
        rank = np.argsort(score, kind="mergesort")
        na = sizes[a]
        best_v = np.inf
        best_away = True
        best_kind = -1                              # 0: move, 1: swap
        best_i = best_b = best_j = -1
        seen = 0
        for q in range(n):
            b = rank[q]
            if b == a:
                continue
            if seen == candidates:
                break
            seen += 1
            # move item i of a to b
            mi = -1
            mv = np.inf
            m_away = True
            for i in range(na):
                k = members[a, i]
                v = max(max((lw[a] - w[k]) / W, (lt[a] - t[k]) / T), max((lw[b] + w[k]) / W, (lt[b] + t[k]) / T))
                away = held[doc[k], b] == 0
                if mi < 0 or v < mv or (v == mv and (not away) and m_away):
                    mi, mv, m_away = i, v, away
            if best_kind < 0 or mv < best_v or (mv == best_v and (not m_away) and best_away):
                best_v, best_away, best_kind, best_i, best_b, best_j = mv, m_away, 0, mi, b, -1
            if sizes[b] == 0:
                continue
            # swap item i of a with item j of b, by weight (Note [Swaps by weight] above)
            nb = sizes[b]
            for j in range(nb):
                keys[j] = w[members[b, j]]
            perm = np.argsort(keys[:nb])
            for q in range(nb):
                wsort[q] = keys[perm[q]]
            si = sj = 0
            sv = np.inf
            for i in range(na):
                ka = members[a, i]
                thr = min(sv, best_v)
                p0 = 0
                p1 = nb
                if thr < np.inf:
                    # (lw[b] + dw) / W <= thr and (lw[a] - dw) / W <= thr, dw = w[ka] - w[kb], widened
                    # far beyond the rounding of either side
                    slack = 1e-9 * (abs(lw[a]) + abs(lw[b]) + abs(w[ka]) + abs(thr * W)) + 1e-300
                    lo = lw[b] + w[ka] - thr * W - slack
                    hi = thr * W - lw[a] + w[ka] + slack
                    if hi < lo:
                        continue
                    p0 = np.searchsorted(wsort[:nb], lo)
                    p1 = np.searchsorted(wsort[:nb], hi, side="right")
                bj = -1
                bv = np.inf
                for q in range(p0, p1):
                    j = perm[q]
                    kb = members[b, j]
                    dw = w[ka] - w[kb]
                    dt = t[ka] - t[kb]
                    if dw <= 0 and dt <= 0:
                        continue
                    v = max(max((lw[a] - dw) / W, (lt[a] - dt) / T), max((lw[b] + dw) / W, (lt[b] + dt) / T))
                    if v < bv or (v == bv and j < bj):
                        bv = v
                        bj = j
                if bj >= 0 and bv < sv:
                    si, sj, sv = i, bj, bv
            s_away = held[doc[members[a, si]], b] == 0
            if sv < best_v or (sv == best_v and (not s_away) and best_away):
                best_v, best_away, best_kind, best_i, best_b, best_j = sv, s_away, 1, si, b, sj
        if best_v >= score[a] - 1e-12:
            break
        b = best_b
        k = members[a, best_i]
        kb = members[b, best_j] if best_kind == 1 else -1
        _take(members, sizes, held, doc, lw, lt, w, t, a, best_i)      # a's item to the end of b
        _put(members, sizes, held, doc, lw, lt, w, t, b, k)
        if best_kind == 1:                                              # b's item to the end of a
            _take(members, sizes, held, doc, lw, lt, w, t, b, best_j)
            _put(members, sizes, held, doc, lw, lt, w, t, a, kb)
    return members, sizes


@jit
def _take(members, sizes, held, doc, lw, lt, w, t, r, i):
    """Remove the ``i``-th item of bin ``r`` (the later ones move up)."""
    k = members[r, i]
    members[r, i:sizes[r] - 1] = members[r, i + 1:sizes[r]].copy()
    sizes[r] -= 1
    held[doc[k], r] -= 1
    lw[r] -= w[k]
    lt[r] -= t[k]


@jit
def _put(members, sizes, held, doc, lw, lt, w, t, r, k):
    """Append item ``k`` to bin ``r``."""
    members[r, sizes[r]] = k
    sizes[r] += 1
    held[doc[k], r] += 1
    lw[r] += w[k]
    lt[r] += t[k]


def place_packed_layer(doc_lengths: Sequence[int], cp: int, *, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                       causal: bool = True, window: Sequence[int] | None = None,
                       nodes: Sequence[int] | None = None) -> Placement:
    """Place a packed batch on ``cp`` ranks with attention pairs and tokens each within a few
    percent of their means (Note [Layer-balanced placement]). ``block_tokens``: the longest item;
    ``window``: a sliding window ``(left, right)``, pairs counted under it; ``nodes``: node id per CP
    index (step 4, as :func:`~megatron_fcp.contract.placement.place_packed`'s). Any lengths work."""
    lengths = check_placement_args(doc_lengths, cp, block_tokens)
    mask = Mask(bool(causal), *check_window(window))
    groups = node_groups(nodes, cp)
    i_doc, i_start, i_end = _item_columns(lengths, cp, block_tokens, mask)        # [items] each
    # each item's queries against its whole document (= span_pairs, exact int64, then float64)
    w = mask.pairs(i_start, i_end, 0, np.asarray(lengths, dtype=np.int64)[i_doc]).astype(np.float64)
    t = (i_end - i_start).astype(np.float64)
    bin_of = np.empty(len(i_doc), dtype=np.int64)                                  # [items]: its CP index
    if groups is None:
        for r, b in enumerate(_assign(i_doc, i_start, w, t, cp, LAYER_TOLERANCE, LAYER_TARGET)):
            bin_of[b] = r
    else:
        for members, node_items in zip(groups, _assign(i_doc, i_start, w, t, len(groups), LAYER_TOLERANCE,
                                                       LAYER_TARGET)):
            inner = _assign(i_doc[node_items], i_start[node_items], w[node_items], t[node_items], len(members),
                            LAYER_TOLERANCE, LAYER_TARGET)
            for r, b in zip(members, inner):
                bin_of[node_items[b]] = r
    return Placement(lengths, _merged(bin_of, i_doc, i_start, i_end, cp), mask.causal, mask.window)


def place_balanced(doc_lengths: Sequence[int], cp: int, *, balance: str, **place_kw) -> Placement:
    """The placement that balances ``balance`` (:data:`BALANCES`): ``"layer"``,
    :func:`place_packed_layer` (``place_kw``: ``block_tokens``, ``causal``, ``window``, ``nodes``);
    ``"attention"``, :func:`~megatron_fcp.contract.placement.place_packed` (any of its knobs)."""
    if balance not in BALANCES:
        raise ValueError(f"balance: one of {', '.join(map(repr, BALANCES))}, got {balance!r} (--fcp-packed-balance)")
    if balance == "attention":
        return place_packed(doc_lengths, cp, **place_kw)
    extra = sorted(set(place_kw) - {"block_tokens", "causal", "window", "nodes"})
    if extra:
        raise ValueError(f"{', '.join(extra)}: knobs of the attention balance (place_packed); balance='layer' "
                         "takes block_tokens, causal, window and nodes only")
    return place_packed_layer(doc_lengths, cp, **place_kw)


def _merged(bin_of: np.ndarray, doc: np.ndarray, start: np.ndarray, end: np.ndarray,
            n: int) -> tuple[tuple[Span, ...], ...]:
    """Each of ``n`` bins' items (``bin_of[k]``: item ``k``'s bin) as spans in (document, start)
    order, adjacent chunks of one document joined into one block (the same tokens and need, fewer
    blocks to move and launch)."""
    k = np.lexsort((end, start, doc, bin_of))                       # [items]: by bin, then Span order
    b, d, s, e = bin_of[k], doc[k], start[k], end[k]
    new = np.ones(len(k), dtype=bool)                               # [items]: begins a span
    new[1:] = (b[1:] != b[:-1]) | (d[1:] != d[:-1]) | (s[1:] != e[:-1])
    head = np.flatnonzero(new)                                      # [spans]
    tail = np.append(head[1:], len(k)) - 1
    spans = list(map(Span, d[head].tolist(), s[head].tolist(), e[tail].tolist()))
    cut = np.searchsorted(b[head], np.arange(n + 1))                # [n + 1]: each bin's first span
    return tuple(tuple(spans[lo:hi]) for lo, hi in zip(cut[:-1].tolist(), cut[1:].tolist()))
