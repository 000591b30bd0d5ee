"""Placements: which tokens of a packed batch each CP rank holds, as KV blocks. Pure, no ``torch``.

Note [Placements and document need sets]
----------------------------------------
A packed batch is a sequence of documents of lengths ``doc_lengths`` (Megatron's THD format:
``cu_seqlens = [0, L0, L0+L1, ...]``). A *placement* gives every CP rank (by CP index) a tuple of
:class:`Span` blocks, each a token range ``[start, end)`` of one document; the rank's local tokens
are its blocks' tokens in that order, and its queries are exactly those tokens. Attention stays
inside a document: query ``(d, p)`` attends to key ``(d', p')`` iff ``d == d'`` and, if causal,
``p' <= p``.

A rank ``j`` *needs* a block ``b`` of another rank iff some query of ``j`` attends to some key of
``b``: ``j`` holds a span of ``b``'s document, and (causal) that span's last token is not before
``b``'s first token. Plans over a placement move each block exactly to the ranks that need it;
``Block(owner, chunk, 0)`` names the ``chunk``-th block of global rank ``owner``. Under a sliding
window (``window=(left, right)``, positions inside the document, :class:`~megatron_fcp.contract.mask.Mask`)
the rule is the general one: ``j`` needs ``b`` iff some span of ``j`` in ``b``'s document has a
visible pair with ``b`` (:func:`span_pairs` > 0), so a document longer than the window needs only
the ``left`` tokens before each block edge, and a rank whose windows stay inside its own blocks
needs nothing.

:func:`place_packed` builds a placement: documents up to ``block_tokens`` stay whole on one rank
(they need no communication at all), longer ones are cut into near-equal blocks. A rank's need in a
document is ``max end of its blocks - tokens it holds``: a block at start ``p`` alone costs ``p``
tokens, an earlier block of a document whose later block the rank holds costs nothing and lowers
the need. So long documents' blocks go first, latest start first, each to the rank whose need stays
least (or to a holder of the document whose need drops) among ranks with work room; then short
documents, which need nothing, fill the work (largest first, least loaded rank).

For cp = 2, documents [3, 9, 2] and ``block_tokens = 4`` (causal; work = pairs of a block's
queries against its document; mean work 27)::

    long blocks, latest first   d1[6,9) 24      d1[3,6) 15          d1[0,3) 6
    rank (need after)           r0 (6)          r1 (3; r0 full)     r1 (0: r1 holds d1[3,6))
    short documents             d0[0,3) 6 -> r1 (work 21)           d2[0,2) 3 -> r0 (work 24)
    rank 0: d1[6,9) d2[0,2)          work 27    needs d1[0,3), d1[3,6) from rank 1 (6 tokens)
    rank 1: d0[0,3) d1[0,3) d1[3,6)  work 27    needs nothing (d1[6,9) is in its future)

Received tokens per rank (max over mean) stay uneven on lognormal mixes: a rank holding the tail
of the longest document must receive most of it whatever else it holds, and ranks given only short
documents receive nothing; the placement lowers the *largest* need (the receive bottleneck) and
the total, not the ratio (docs/planner.md, "Packed documents").

Note [Busiest receiver lower bound]
-----------------------------------
Max over mean is the wrong yardstick for the busiest receiver (a rank of short documents receives
nothing); :func:`recv_lower_bound` is the yardstick. With work capped at ``c`` x the mean
(``C = c * sum_d W_d / cp``, ``W_d`` = pairs of document d), the rank holding the last query of a
document of ``L`` tokens needs all ``L`` keys (causal) and holds a set ``S`` of them whose queries
cost ``sum_{p in S} (p + 1) <= C``; the most tokens it can hold are the last one (``L`` pairs)
and the ``m`` cheapest, positions ``0..m-1`` (``m(m+1)/2`` pairs), so it must receive at least
``L - 1 - m`` tokens, ``m`` the largest with ``m(m+1)/2 <= C - L`` (without the causal mask every
query costs ``L``: ``L - floor(C / L)``). The bound is the largest of these over documents: a
token-level relaxation (spans need not be contiguous, other documents of the rank are ignored),
valid for every placement that meets the cap. A node of ``g`` ranks is the same with ``g * C``
(tokens entering the node). For cp = 64 and a 58K-token document in a 1M-token batch the holder of
its last query can hold about 21K of its tokens: at least 37K to receive.

:func:`_refine_recv` searches against the busiest receiver after the work balance: it pushes a
block off the neediest rank or pulls there an earlier block of a document it holds (the block's
tokens leave its need; a short document goes the other way to keep the work under
:data:`RECV_WORK_CAP`), never raising the total need. The cap is tight because a packed step is
mostly compute: every 1% of work over the mean costs about 1% of the step, while the received bytes
mostly hide behind it. Pieces stay at least ``block_tokens // 8`` tokens even where that leaves
work above :data:`BALANCE_TARGET` (a 512-token piece at the end of a 44K-token document can pass a
rank's whole mean work when cp = 256 holds 1M tokens): cutting the tail finer spreads it over more
ranks, each of which then needs the whole prefix (docs/planner.md, "Packed documents at scale").
Note [Node-aware placement]
---------------------------
On a CP group that spans nodes, the placement is made in two levels (``place_packed(nodes=...)``):
the blocks (cut as in step 1) go first onto the nodes, each node a bin of ``g`` ranks' work, by
the same greedy and searches as onto ranks (a node's need is the tokens entering it); then each
node's blocks go onto its ``g`` ranks the same way. Why: the flat placement minimises what each
*rank* receives, not what crosses a NIC; on 32 nodes of 8 a 32K-token document of a 1M batch
(4K tokens a rank) lands on ranks of several nodes, and node ingress is 4.6x its bound
(benchmarks/results/packed_scale.json, 2026-12-02). Placed by node first, most documents stay
on one node, and only the ones longer than a node's share cross NICs. Where a node's blocks are
too coarse to balance its ``g`` ranks (work above :data:`BALANCE_TARGET` x the mean: a node
holding 17 pieces of one long document's tail), the node's tokens, in (document, start) order,
are cut instead into ``g`` contiguous runs of equal work (:func:`_split_even`), which balances to
the token at the cost of at most ``g - 1`` extra cuts, each inside one node. Only there: cutting
every node that way whenever its work is above 1.005 x the mean (tried) lifts cp = 16, 32K median
one-pass from 0.986 to 0.995 x TE but raises the ranks' needs (the greedy gives a tail holder cheap
early tokens; a contiguous run does not), and the backward as run falls from 0.985 to 0.925 x TE.

Note [Layer work]
-----------------
The placement is the data layout of the whole layer, not only of its attention: Megatron's
projections and MLP run on the tokens a rank holds (docs/megatron.md, "Packed documents"). Their
work is per token: :func:`~megatron_fcp.cost.model.layer_pairs_per_token` prices a token's linear
layers in attention pairs, 52.2K for a Llama-3-70B layer (26.1K for an 8B-like one), so a token's
projections and MLP cost as much as its attention over 52K keys. Balancing attention alone (this
module's algorithm) puts short documents (few pairs per token) together: the tokens' max over mean
is 2.0-6.5 on 1M-token lognormal batches at cp = 16-256 (1.06-3.3 per head-parallel member at a = 8),
and the layer's busiest rank 1.45-5.4x the mean, where TE's THD layout is even to 1% in both
(benchmarks/results/layer_balance.json, 2026-12-03).

``token_weight = lam`` balances ``pairs + lam * tokens`` instead, every step of
:func:`place_packed` the same with that work: the layer's *sum* is even (max over mean 1.00-1.05).
It is not enough by itself: a layer's ranks meet at its attention (they exchange KV there), and
then a layer lasts about ``max pairs + lam * max tokens``, which is 1.22-1.76x its mean with the
weight (attention alone up to 5.6x). Both resources must be even at once, a two-dimensional
balance: :func:`~megatron_fcp.contract.layer_placement.place_packed_layer` (Note [Layer-balanced
placement]), which the runtime uses by default (``--fcp-packed-balance layer``); this function,
the attention balance, is ``--fcp-packed-balance attention``.

"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple, Sequence

import logging

import numpy as np

from megatron_fcp.contract.blocks import Block
from megatron_fcp.contract.mask import Mask, as_mask, check_window, pair_count
from megatron_fcp.jit import jit

__all__ = ["Span", "Placement", "PACKED_LAYOUTS", "place_packed", "thd_padded_lengths", "thd_placement", "span_pairs",
           "lognormal_lengths", "check_doc_lengths",
           "recv_lower_bound", "DEFAULT_BLOCK_TOKENS", "node_groups", "check_placement_args", "RECV_WORK_CAP", "BALANCE_TARGET", "MIN_BLOCK_WORK"]

PACKED_LAYOUTS = ("fcp", "thd")
"""What lays a packed batch's tokens out (:attr:`Placement.layout`): ``fcp``, FCP's placements
(:func:`place_packed`, :func:`~megatron_fcp.contract.layer_placement.place_balanced`); ``thd``,
Transformer Engine's per-document zigzag (:func:`thd_placement`)."""

_log = logging.getLogger(__name__)
_UNEVEN_LOGGED: list[bool] = []

DEFAULT_BLOCK_TOKENS = 4096
"""Block size of long documents (about 4K tokens keeps a GPU kernel efficient; FCP paper)."""

BALANCE_TARGET = 1.05
"""Work max over mean above which :func:`place_packed` cuts blocks finer and places again."""

MIN_BLOCK_WORK = 0.125
"""The finest ``max_block_work`` :func:`place_packed` halves down to (pieces of 1/8 of a rank's work;
finer ones multiply blocks and planning time for little balance)."""

RECV_WORK_CAP = 1.01
"""Work (max over mean) the busiest-receiver search (:func:`_refine_recv`) may raise a rank to: well
under :data:`BALANCE_TARGET`, since a packed step is mostly compute (Note [Busiest receiver lower
bound])."""


class Span(NamedTuple):
    """Tokens ``[start, end)`` of document ``doc`` (positions inside the document). Immutable,
    ordered by ``(doc, start, end)``, hashed as that triple. A named tuple, not a frozen dataclass:
    a packed batch's placements make ~10^4 spans per degree priced, and a frozen dataclass's
    ``__init__`` (three ``object.__setattr__``) took 6% of cp = 64's degree choice (0.77 us a
    span against 0.28 us; docs/planner.md, "Per-batch planning, twelfth pass")."""

    doc: int
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


def span_pairs(q: Span, k: Span, causal: "bool | Mask") -> int:
    """Query-key pairs of query span ``q`` against key span ``k`` under the document mask (exact);
    ``causal`` may be a :class:`~megatron_fcp.contract.mask.Mask` (positions inside the document)."""
    if q.doc != k.doc or q.tokens <= 0 or k.tokens <= 0:
        return 0
    if isinstance(causal, Mask):
        if causal.windowed:
            return int(causal.pairs(q.start, q.end, k.start, k.end))
        causal = causal.causal
    if not causal:
        return q.tokens * k.tokens
    # sum over queries p in [q.start, q.end) of clamp(p - k.start + 1, 0, k.tokens)
    total = 0
    lo = max(q.start, k.start)
    if lo >= q.end:
        return 0
    ramp_end = min(q.end, k.end)  # queries whose count still grows: p - k.start + 1
    if lo < ramp_end:
        a, b = lo - k.start + 1, ramp_end - 1 - k.start + 1
        total += (a + b) * (ramp_end - lo) // 2
    flat_from = max(lo, k.end)
    if flat_from < q.end:
        total += (q.end - flat_from) * k.tokens
    return total


@dataclass(frozen=True)
class Placement:
    """Blocks of a packed batch per CP rank; see Note [Placements and document need sets].

    doc_lengths: tokens of each document, in batch order (all >= 1).
    blocks: ``blocks[i]`` are CP rank i's KV blocks, in local token order.
    causal: the mask the need sets follow.
    window: the sliding window ``(left, right)`` inside each document (Megatron's convention, -1:
        unbounded; ``(-1, -1)``: none). :attr:`mask` is ``causal`` and ``window`` together.
    layout: what laid the tokens out: ``"fcp"`` (FCP's placements) or ``"thd"`` (Transformer
        Engine's per-document zigzag, :func:`thd_placement`). The chain backward of a ``thd``
        placement computes each rank's own blocks in one call, as TE's ring does (Note [Streaming
        chain backward] in :mod:`megatron_fcp.schedule.chains`, "Own blocks").
    """

    doc_lengths: tuple[int, ...]
    blocks: tuple[tuple[Span, ...], ...]
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    layout: str = "fcp"
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __getstate__(self) -> dict:
        """Pickled without :attr:`_cache`: it holds derived arrays and weak references (to the
        topology and graph objects a cached floor or tree was computed for), and a copy in another
        process recomputes what it reads."""
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state

    def __post_init__(self) -> None:
        if self.layout not in PACKED_LAYOUTS:
            raise ValueError(f"placement layout {self.layout!r}: must be one of {', '.join(PACKED_LAYOUTS)}")
        object.__setattr__(self, "doc_lengths", tuple(int(x) for x in self.doc_lengths))
        object.__setattr__(self, "blocks", tuple(tuple(r) for r in self.blocks))
        object.__setattr__(self, "window", Mask(bool(self.causal), *check_window(self.window)).window)
        check_doc_lengths(self.doc_lengths)
        if not self.blocks:
            raise ValueError("placement: needs at least one CP rank")
        if self._tiles_documents():
            return
        self._raise_not_tiling()   # the slow walk below names the first fault

    def _tiles_documents(self) -> bool:
        """Whether the blocks are Spans that tile every document exactly once (checked over arrays:
        sorted by (document, start, end), each document's spans start at 0, follow on without gap
        or overlap and end at its length)."""
        if not all(isinstance(s, Span) for rank_blocks in self.blocks for s in rank_blocks) or \
                not any(self.blocks):
            return False
        doc, start, end = self.block_spans()
        n_docs = len(self.doc_lengths)
        if doc.min() < 0 or doc.max() >= n_docs:
            return False
        length = np.asarray(self.doc_lengths, dtype=np.int64)
        order = np.lexsort((end, start, doc))
        doc, start, end = doc[order], start[order], end[order]
        first = np.ones(len(doc), dtype=bool)
        first[1:] = doc[1:] != doc[:-1]                                  # [spans]: a document's first span
        last = np.ones(len(doc), dtype=bool)
        last[:-1] = first[1:]                                            # [spans]: a document's last span
        follows = np.ones(len(doc), dtype=bool)
        follows[1:] = start[1:] == end[:-1]
        return bool(np.count_nonzero(first) == n_docs and (start < end).all()
                    and (start[first] == 0).all() and (end[last] == length[doc[last]]).all()
                    and (follows | first).all())

    def _raise_not_tiling(self) -> None:
        covered: dict[int, list[tuple[int, int]]] = {}
        for i, rank_blocks in enumerate(self.blocks):
            for s in rank_blocks:
                if not isinstance(s, Span):
                    raise ValueError(f"placement: rank {i} holds {s!r}, not a Span")
                if not 0 <= s.doc < len(self.doc_lengths) or not 0 <= s.start < s.end <= self.doc_lengths[s.doc]:
                    raise ValueError(f"placement: rank {i} block {s} is not a non-empty range of a document")
                covered.setdefault(s.doc, []).append((s.start, s.end))
        for d, length in enumerate(self.doc_lengths):
            ranges = sorted(covered.get(d, []))
            pos = 0
            for a, b in ranges:
                if a != pos:
                    raise ValueError(f"placement: document {d} tokens [{min(a, pos)}, {max(a, pos)}) are "
                                     f"{'held twice' if a < pos else 'held by no rank'}")
                pos = b
            if pos != length:
                raise ValueError(f"placement: document {d} tokens [{pos}, {length}) are held by no rank")

    # ---- shape -------------------------------------------------------------------------------
    @property
    def mask(self) -> Mask:
        """The position mask inside each document: ``causal`` and ``window``."""
        m = self._cache.get("mask")
        if m is None:
            m = self._cache["mask"] = Mask(self.causal, *self.window)
        return m

    @property
    def cp(self) -> int:
        return len(self.blocks)

    @property
    def total_tokens(self) -> int:
        return sum(self.doc_lengths)

    def tokens(self, cp_index: int) -> int:
        """Local tokens of CP rank ``cp_index``."""
        return self.rank_tokens()[cp_index]

    def rank_tokens(self) -> tuple[int, ...]:
        """Every CP rank's local tokens (computed once per placement)."""
        got = self._cache.get("rank tokens")
        if got is None:
            got = self._cache["rank tokens"] = tuple(sum(s.end - s.start for s in b) for b in self.blocks)
        return got

    def block_starts(self, cp_index: int) -> tuple[int, ...]:
        """Local token offset of each of CP rank ``cp_index``'s blocks."""
        out, pos = [], 0
        for s in self.blocks[cp_index]:
            out.append(pos)
            pos += s.tokens
        return tuple(out)

    @cached_property
    def doc_starts(self) -> np.ndarray:
        """Offset of each document in the packed batch (``cu_seqlens[:-1]``)."""
        return np.concatenate(([0], np.cumsum(self.doc_lengths)[:-1])).astype(np.int64)

    def token_index(self, cp_index: int) -> np.ndarray:
        """Packed-batch index (int64 ``[tokens(cp_index)]``) of each local token of CP rank ``cp_index``."""
        parts = [np.arange(s.start, s.end, dtype=np.int64) + self.doc_starts[s.doc] for s in self.blocks[cp_index]]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def positions(self, cp_index: int) -> np.ndarray:
        """Position inside its document (int64) of each local token of CP rank ``cp_index`` (RoPE)."""
        parts = [np.arange(s.start, s.end, dtype=np.int64) for s in self.blocks[cp_index]]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def doc_ids(self, cp_index: int) -> np.ndarray:
        """Document (int64) of each local token of CP rank ``cp_index``."""
        parts = [np.full(s.tokens, s.doc, dtype=np.int64) for s in self.blocks[cp_index]]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def shard(self, x: Any, cp_index: int) -> Any:
        """CP rank ``cp_index``'s tokens of a packed ``[t, ...]`` array or tensor (a copy)."""
        if x.shape[0] != self.total_tokens:
            raise ValueError(f"placement.shard: tensor has {x.shape[0]} tokens, the batch has {self.total_tokens}")
        return x[self.token_index(cp_index)]

    def unshard(self, shards: Sequence[Any]) -> Any:
        """Inverse of :meth:`shard`: the packed ``[t, ...]`` batch from every rank's shard."""
        if len(shards) != self.cp:
            raise ValueError(f"placement.unshard: {len(shards)} shards for cp = {self.cp}")
        for i, x in enumerate(shards):
            if x.shape[0] != self.tokens(i):
                raise ValueError(f"placement.unshard: shard {i} has {x.shape[0]} tokens, rank {i} holds {self.tokens(i)}")
        src = next((x for x in shards if x.shape[0]), shards[0])
        out = src[np.zeros(self.total_tokens, dtype=np.int64)]  # a new array/tensor of the right type and shape
        for i, x in enumerate(shards):
            if x.shape[0]:
                out[self.token_index(i)] = x
        return out

    # ---- needs -------------------------------------------------------------------------------
    def block_list(self) -> tuple[tuple[int, int, Span], ...]:
        """Every block as ``(owner CP index, index in the owner's blocks, span)``, owner by owner."""
        if "blocks" not in self._cache:
            self._cache["blocks"] = tuple((i, b, s) for i, rank_blocks in enumerate(self.blocks)
                                          for b, s in enumerate(rank_blocks))
        return self._cache["blocks"]

    def need_matrix(self) -> np.ndarray:
        """``[cp, n_blocks]`` booleans: CP rank j needs block ``n`` of :meth:`block_list`."""
        if "need" not in self._cache:
            docs, starts, ends = self.block_spans()                             # [n_blocks] each
            owners = self.block_owners()
            # last_q[j, d]: the latest query position CP rank j holds in document d (-1: none)
            last_q = np.full((self.cp, len(self.doc_lengths)), -1, dtype=np.int64)
            np.maximum.at(last_q, (owners, docs), ends - 1)
            need = _need_table(last_q, docs, starts, owners, bool(self.causal))    # [cp, n_blocks]
            if self.mask.windowed:
                need = self._window_need(self.block_list(), docs, owners) & need  # the window only removes pairs
            need.flags.writeable = False
            self._cache["need"] = need
        return self._cache["need"]

    def _window_need(self, blocks, docs: np.ndarray, owners: np.ndarray) -> np.ndarray:
        """``[cp, n_blocks]``: CP rank j has a visible pair with block n under the window (Note
        [Placements and document need sets]), exact pair counts of every (query span, key span)
        pair of one document, reduced over each rank's spans."""
        s = np.array([b[2].start for b in blocks], dtype=np.int64)
        e = np.array([b[2].end for b in blocks], dtype=np.int64)
        out = np.zeros((self.cp, len(blocks)), dtype=bool)
        for d in np.unique(docs).tolist():
            idx = np.flatnonzero(docs == d)                                      # spans of document d
            seen = self.mask.pairs(s[idx][:, None], e[idx][:, None], s[idx][None, :], e[idx][None, :]) > 0
            np.logical_or.at(out, (owners[idx][:, None], idx[None, :]), seen)    # [spans of d] x [spans of d]
        return out

    def needs(self, ranks: Sequence[int], rank: int) -> frozenset[Block]:
        """Blocks global ``rank`` must receive (``ranks``: the CP group in CP order)."""
        ranks = tuple(ranks)
        key = ("needs", ranks, rank)
        if key not in self._cache:
            blocks = self.block_list()
            row = self.need_matrix()[ranks.index(rank)]
            self._cache[key] = frozenset(Block(ranks[blocks[n][0]], blocks[n][1], 0)
                                         for n in np.flatnonzero(row).tolist())
        return self._cache[key]

    def pairs(self, j: int, i: int, b: int) -> int:
        """Query-key pairs of CP rank ``j``'s queries against block ``b`` of CP rank ``i`` (exact), read
        from :meth:`pair_matrix`."""
        return int(self.pair_matrix()[j, self._block_offsets()[i] + b])

    def blocks_per_rank(self) -> np.ndarray:
        """int64 ``[cp]``: how many blocks each CP rank holds (read-only)."""
        got = self._cache.get("blocks per rank")
        if got is None:
            got = self._cache["blocks per rank"] = np.array([len(x) for x in self.blocks], dtype=np.int64)
            got.flags.writeable = False
        return got

    def block_tokens(self) -> np.ndarray:
        """int64 ``[n_blocks]``, read-only: each block's tokens, :meth:`block_list` order."""
        got = self._cache.get("block tokens")
        if got is None:
            got = self._cache["block tokens"] = np.array([s.tokens for _, _, s in self.block_list()], dtype=np.int64)
            got.flags.writeable = False
        return got

    def block_spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int64 ``(document, start, end)`` ``[n_blocks]`` each, read-only: every block's span,
        :meth:`block_list` order."""
        got = self._cache.get("block spans")
        if got is None:
            spans = [s for rank_blocks in self.blocks for s in rank_blocks]
            got = tuple(np.fromiter((getattr(s, f) for s in spans), dtype=np.int64, count=len(spans))
                        for f in ("doc", "start", "end"))
            for col in got:
                col.flags.writeable = False
            self._cache["block spans"] = got
        return got

    def block_owners(self) -> np.ndarray:
        """int64 ``[n_blocks]``, read-only: each block's owner (CP index), :meth:`block_list` order."""
        got = self._cache.get("block owners")
        if got is None:
            got = self._cache["block owners"] = np.repeat(np.arange(len(self.blocks), dtype=np.int64),
                                                          self.blocks_per_rank())
            got.flags.writeable = False
        return got

    def tokens_of(self, i, b) -> np.ndarray:
        """int64: the tokens of each block ``(i[k], b[k])`` (owner's CP index, index in its blocks),
        for arrays of blocks at once."""
        return self.block_tokens()[self._block_offsets()[np.asarray(i, dtype=np.int64)] + np.asarray(b, dtype=np.int64)]

    def _block_offsets(self) -> np.ndarray:
        """int64 ``[cp]``: the column of each CP rank's first block in :meth:`block_list` order."""
        got = self._cache.get("block offsets")
        if got is None:
            sizes = self.blocks_per_rank()
            got = self._cache["block offsets"] = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        return got

    def pair_matrix(self) -> np.ndarray:
        """``[cp, n_blocks]`` int64: :meth:`pairs` of every CP rank against every block of
        :meth:`block_list` (exact, read-only), computed once: for each document, every (query span,
        key span) pair of its spans (:func:`_span_pair_matrix`, compiled), summed per query span's
        owner."""
        got = self._cache.get("pair matrix")
        if got is not None:
            return got
        docs, start, end = self.block_spans()                         # [n_blocks] each
        owners = self.block_owners()
        n = len(docs)
        order = np.argsort(docs, kind="stable")                       # spans grouped by document
        size = np.bincount(docs, minlength=len(self.doc_lengths))     # spans per document
        first = np.concatenate(([0], np.cumsum(size)))                # group g is order[first[g]:first[g + 1]]
        lo, hi = self.mask.offsets
        out = _span_pair_matrix(order, first, start, end, owners, self.cp, lo, hi).reshape(self.cp, n)
        out.flags.writeable = False
        self._cache["pair matrix"] = out
        return out

    def pairs_of(self, j, i, b) -> np.ndarray:
        """:meth:`pairs` of many ``(j, i, b)`` at once (int64 ``[n]``, exact): a gather from
        :meth:`pair_matrix` (one table of every pair is cheaper to build than a batch of them:
        0.23 against 0.34 s for cp = 256's 125K transfers, 2026-12-06)."""
        j, i, b = (np.asarray(x, dtype=np.int64).ravel() for x in (j, i, b))
        return self.pair_matrix()[j, self._block_offsets()[i] + b]

    def work(self) -> np.ndarray:
        """Attention work (query-key pairs under the mask) of each CP rank's queries (int64 ``[cp]``)."""
        out = np.zeros(self.cp, dtype=np.int64)
        by_doc: dict[int, list[Span]] = {}
        for rank_blocks in self.blocks:
            for s in rank_blocks:
                by_doc.setdefault(s.doc, []).append(s)
        for j, rank_blocks in enumerate(self.blocks):
            out[j] = sum(span_pairs(q, k, self.mask) for q in rank_blocks for k in by_doc[q.doc])
        return out

    def summary(self) -> str:
        work = self.work()
        toks = [self.tokens(i) for i in range(self.cp)]
        mean = work.mean() if self.cp else 0
        return (f"placement: {len(self.doc_lengths)} documents, {self.total_tokens} tokens, cp={self.cp}, "
                f"{sum(len(b) for b in self.blocks)} blocks; tokens/rank {min(toks)}..{max(toks)}; "
                f"work max/mean {work.max() / mean if mean else 1.0:.3f}")


def check_doc_lengths(doc_lengths: Sequence[int]) -> None:
    """Raise ValueError naming the fix unless ``doc_lengths`` is a non-empty list of integers >= 1."""
    if len(doc_lengths) == 0:
        raise ValueError("doc_lengths: the batch is empty; give at least one document")
    if all(type(n) is int for n in doc_lengths) and min(doc_lengths) >= 1:
        return                                              # plain ints (a placement's own): nothing to name
    for d, n in enumerate(doc_lengths):
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise ValueError(f"doc_lengths[{d}] = {n!r}: every document needs at least 1 token "
                             "(drop empty documents from cu_seqlens)")


def thd_padded_lengths(doc_lengths: Sequence[int], cp: int) -> np.ndarray:
    """Each document's length rounded up to a multiple of ``2*cp`` (int64), as Transformer Engine pads
    a THD batch under context parallelism (``cu_seqlens_padded``)."""
    check_doc_lengths(doc_lengths)
    L = np.asarray(doc_lengths, dtype=np.int64)
    return -(-L // (2 * cp)) * (2 * cp)


def thd_placement(doc_lengths: Sequence[int], n: int, *, pad_ranks: int | None = None,
                  causal: bool = True) -> Placement:
    """Transformer Engine's layout of a packed batch over ``n`` ranks (Note [Transformer Engine on a
    packed batch] in :mod:`megatron_fcp.cost.te`): document ``d`` padded to ``P_d``, a multiple of
    ``2 * pad_ranks`` (default ``n``; TE's ``a2a+p2p`` pads to its whole CP size and rings over
    ``n`` nodes), cut into ``2n`` chunks of ``P_d / 2n`` tokens; rank ``i`` holds chunks ``i`` and
    ``2n-1-i`` of every document, in document order. Padding sits at a document's end and is not
    placed: a chunk keeps its real tokens, and a chunk with none is left out. Every rank then holds
    the same causal work of every document, as TE's ranks do."""
    lengths = check_placement_args(doc_lengths, n, 1)
    P = thd_padded_lengths(lengths, n if pad_ranks is None else pad_ranks)
    L = np.asarray(lengths, dtype=np.int64)
    chunk = P // (2 * n)                                                     # [D] tokens per chunk
    blocks = []
    for i in range(n):
        first, second = ((np.minimum(c * chunk, L).tolist(), np.minimum((c + 1) * chunk, L).tolist())
                         for c in (i, 2 * n - 1 - i))                        # its two chunks: [D] starts, ends
        blocks.append(tuple(Span(d, a, b) for d in range(len(L))
                            for a, b in ((first[0][d], first[1][d]), (second[0][d], second[1][d])) if b > a))
    return Placement(lengths, tuple(blocks), causal, layout="thd")


def check_placement_args(doc_lengths: Sequence[int], cp: int, block_tokens: int) -> tuple[int, ...]:
    """The document lengths as ints, after checking them, the CP size and the block size (ValueError
    naming the argument): what every placement takes."""
    lengths = tuple(int(x) if not isinstance(x, bool) and int(x) == x else x for x in doc_lengths)
    check_doc_lengths(lengths)
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp: must be a positive integer, got {cp!r}")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens: must be a positive integer, got {block_tokens!r}")
    return lengths


def lognormal_lengths(mean: float, sigma: float, total: int, seed: int = 0) -> list[int]:
    """Document lengths of a seeded lognormal mix: draw ``round(exp(N(mean, sigma)))`` (at least 1)
    from ``numpy.random.default_rng(seed)`` until the lengths sum to ``total`` tokens; the last one
    is trimmed so that they sum to exactly ``total``. ``mean``/``sigma`` are of the log length
    (median length ``exp(mean)``)."""
    if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total < 1:
        raise ValueError(f"lognormal: TOTAL must be a positive integer of tokens, got {total!r}")
    if not np.isfinite(mean) or not (np.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"lognormal: MEAN must be finite and SIGMA >= 0, got {mean!r}, {sigma!r}")
    rng = np.random.default_rng(seed)
    out: list[int] = []
    left = int(total)
    while left > 0:
        draw = rng.lognormal(mean, sigma, 256)
        for x in np.maximum(1, np.rint(np.minimum(draw, 2.0 ** 62))).astype(np.int64).tolist():
            n = min(x, left)
            out.append(n)
            left -= n
            if left == 0:
                break
    return out


def recv_lower_bound(doc_lengths: Sequence[int], cp: int, *, causal: bool = True, work_cap: float = 1.05,
                     ranks_per_group: int = 1) -> int:
    """Tokens the busiest receiver of *any* placement of ``doc_lengths`` on ``cp`` ranks with work
    at most ``work_cap`` x the mean must receive; see Note [Busiest receiver lower bound].
    ``ranks_per_group`` > 1: the same for a group of that many ranks (a node: tokens entering it
    from other nodes, its capacity ``ranks_per_group`` x a rank's)."""
    check_doc_lengths(doc_lengths)
    L = np.asarray(doc_lengths, dtype=np.float64)
    total = float((L * (L + 1) / 2).sum()) if causal else float((L * L).sum())
    cap = work_cap * total / cp * max(int(ranks_per_group), 1)
    if causal:  # the holder of query L-1 pays L for it; then m(m+1)/2 <= cap - L for positions 0..m-1
        room = np.maximum(cap - L, 0)
        m = np.floor((np.sqrt(1 + 8 * room) - 1) / 2)
        m = np.where(m * (m + 1) / 2 > room, m - 1, m)                # the square root's rounding,
        m = np.where((m + 1) * (m + 2) / 2 <= room, m + 1, m)         # either way
        held = 1 + m
    else:  # every query of d costs L_d pairs
        held = np.floor(cap / L)
    return int(max(0.0, float(np.max(L - np.minimum(held, L)))))


def _doc_blocks(length: int, block_tokens: int, cap: float = float("inf"), causal: "bool | Mask" = True,
                min_tokens: int = 1, token_weight: float = 0.0) -> list[tuple[int, int]]:
    """A document cut into ``ceil(length / block_tokens)`` near-equal ``[start, end)`` blocks, then
    each block whose work (its queries against the document, plus ``token_weight`` per token: Note
    [Layer work]) exceeds ``cap`` cut further into near-equal pieces of at least ``min_tokens``
    tokens (a long document's last blocks)."""
    n = -(-length // block_tokens)
    bounds = [i * length // n for i in range(n + 1)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        w = span_pairs(Span(0, a, b), Span(0, 0, length), causal) + token_weight * (b - a)
        k = max(1, min(int(-(-w // cap)) if cap < float("inf") else 1, (b - a) // max(min_tokens, 1)))
        out.extend((a + i * (b - a) // k, a + (i + 1) * (b - a) // k) for i in range(k))
    return out


class _Loads:
    """Per-rank attention work and need (tokens a rank must receive) under moves of blocks.

    A rank's need in document ``d`` is ``max end of its blocks of d`` (causal; ``L_d`` without the
    mask) minus the tokens of ``d`` it holds: blocks tile their document, so every block starting
    before the rank's last query is needed.
    """

    def __init__(self, lengths, cp, causal: "bool | Mask"):
        self.mask = as_mask(causal)
        self.lengths, self.causal = lengths, self.mask.causal
        self.work = [0] * cp
        self.need = [0] * cp
        self.docs: list[dict[int, list[Span]]] = [{} for _ in range(cp)]

    def _doc_need(self, spans: list[Span], d: int) -> int:
        if not spans:
            return 0
        if self.mask.windowed:  # the union of the spans' key ranges, less what the rank holds
            last, covered = -1, 0
            for a, b in sorted(self.mask.key_range(s.start, s.end - 1) for s in spans):
                a, b = max(a, last + 1, 0), min(b, self.lengths[d] - 1)
                if b >= a:
                    covered += b - a + 1
                    last = b
            return covered - sum(s.tokens for s in spans)
        top = max(s.end for s in spans) if self.causal else self.lengths[d]
        return top - sum(s.tokens for s in spans)

    def delta(self, r: int, s: Span, add: bool) -> int:
        """Change of rank r's need if block s is added (``add``) or removed."""
        spans = self.docs[r].get(s.doc, [])
        after = spans + [s] if add else [x for x in spans if x != s]
        return self._doc_need(after, s.doc) - self._doc_need(spans, s.doc)

    def apply(self, r: int, s: Span, w: int, add: bool) -> None:
        self.need[r] += self.delta(r, s, add)
        self.work[r] += w if add else -w
        spans = self.docs[r].setdefault(s.doc, [])
        if add:
            spans.append(s)
        else:
            spans.remove(s)
            if not spans:
                del self.docs[r][s.doc]


def _refine(loads: _Loads, placed: list[list[Span]], wk: dict, need_weight: float, max_iter: int,
            candidates: int = 8, good_enough: float = 1.005, movable=None) -> None:
    """Local search: move (or swap) a block of the worst rank to one of the least loaded ranks while
    that lowers the larger of the two ranks' scores, score = max(work / mean work,
    1 + need_weight * (need / mean need - 1)), until the worst score is at most ``good_enough``.
    Deterministic (ties by rank, then block order). ``movable(span)``: only these blocks move."""
    cp = len(placed)
    can = movable or (lambda s: True)
    mean_w = sum(loads.work) / cp

    def score(w, n, mean_n):
        sw = w / mean_w if mean_w else 1.0
        return max(sw, 1 + need_weight * (n / mean_n - 1)) if mean_n else sw

    for _ in range(max_iter):
        mean_n = sum(loads.need) / cp if need_weight else 0
        scores = [score(loads.work[r], loads.need[r], mean_n) for r in range(cp)]
        a = max(range(cp), key=lambda r: (scores[r], -r))
        if scores[a] <= good_enough:
            return
        targets = sorted((r for r in range(cp) if r != a), key=lambda r: (scores[r], r))[:candidates]
        best = None  # (value, kind, s, b, t)
        for s in placed[a]:
            if not can(s):
                continue
            w = wk[s]
            da = loads.delta(a, s, False) if need_weight else 0
            for b in targets:
                nb = loads.need[b] + loads.delta(b, s, True) if need_weight else 0
                v = max(score(loads.work[a] - w, loads.need[a] + da, mean_n), score(loads.work[b] + w, nb, mean_n))
                if best is None or v < best[0]:
                    best = (v, "move", s, b, None)
        if best is None or best[0] >= scores[a] - 1e-12:
            for s in placed[a]:
                if not can(s):
                    continue
                for b in targets:
                    for t in placed[b]:
                        if wk[s] <= wk[t] or not can(t):
                            continue
                        if need_weight:
                            loads.apply(a, s, wk[s], False)
                            loads.apply(b, t, wk[t], False)
                            na = loads.need[a] + loads.delta(a, t, True)
                            nb = loads.need[b] + loads.delta(b, s, True)
                            loads.apply(b, t, wk[t], True)
                            loads.apply(a, s, wk[s], True)
                        else:
                            na = nb = 0
                        v = max(score(loads.work[a] - wk[s] + wk[t], na, mean_n),
                                score(loads.work[b] + wk[s] - wk[t], nb, mean_n))
                        if best is None or v < best[0]:
                            best = (v, "swap", s, b, t)
        if best is None or best[0] >= scores[a] - 1e-12:
            return
        _, kind, s, b, t = best
        loads.apply(a, s, wk[s], False)
        placed[a].remove(s)
        loads.apply(b, s, wk[s], True)
        placed[b].append(s)
        if kind == "swap":
            loads.apply(b, t, wk[t], False)
            placed[b].remove(t)
            loads.apply(a, t, wk[t], True)
            placed[a].append(t)


def _refine_recv(loads: _Loads, placed: list[list[Span]], wk: dict, cap: float, max_iter: int,
                 is_long) -> None:
    """Local search against the busiest receiver (Note [Busiest receiver lower bound]): while some
    move lowers the largest need, take the rank ``a`` with the most need (ties: lowest index) and
    apply the best of

    * *push*: a block of ``a`` to another rank ``b`` (the non-holder of its document with the least
      need after, or a holder), when both needs after stay below ``a``'s;
    * *pull*: an earlier block ``t`` of a document ``a`` holds, from its rank ``b``, to ``a`` (its
      tokens leave ``a``'s need); if ``a``'s work would pass ``cap``, the smallest short document
      of ``a`` that makes room goes to ``b`` in exchange, or else a block of another document;

    every rank's work staying at most ``cap`` and the total need not growing (spreading a
    document's tail over more ranks makes each of them need its prefix); best = least max(need a,
    need b) after, then least total need. Causal or full masks (windows keep the greedy result)."""
    cp = len(placed)
    owner: dict[Span, int] = {s: r for r in range(cp) for s in placed[r]}
    by_doc: dict[int, list[Span]] = {}
    for s in owner:
        if is_long(s):
            by_doc.setdefault(s.doc, []).append(s)
    causal = loads.causal

    def fresh(s: Span) -> int:  # need added to a rank that holds nothing of s.doc
        return s.start if causal else loads.lengths[s.doc] - s.tokens

    for _ in range(max_iter):
        need = loads.need
        a = max(range(cp), key=lambda r: (need[r], -r))
        na = need[a]
        if na <= 0:
            return
        by_need = sorted(range(cp), key=lambda r: (need[r], r))
        best = None  # (max need after, total change, kind, s, b, u)
        for s in placed[a]:
            if not is_long(s):
                continue
            da = loads.delta(a, s, False)
            w = wk[s]
            holders = {owner[x] for x in by_doc[s.doc]} - {a}
            cands = [(b, loads.delta(b, s, True)) for b in holders if loads.work[b] + w <= cap]
            f = fresh(s)
            for b in by_need:
                if b != a and b not in holders and loads.work[b] + w <= cap:
                    cands.append((b, f))
                    break
            for b, db in cands:
                v = (max(na + da, need[b] + db), da + db)
                if v[0] < na and v[1] <= 0 and (best is None or v < best[:2]):
                    best = (*v, "push", s, b, None)
        top = {}
        for s in placed[a]:
            if is_long(s):
                top[s.doc] = max(top.get(s.doc, 0), s.end)
        shorts = sorted((u for u in placed[a] if not is_long(u)), key=lambda u: (wk[u], u))
        for d in top:
            for t in by_doc[d]:
                b = owner[t]
                if b == a or (causal and t.start >= top[d]):
                    continue
                da = loads.delta(a, t, True)
                db = loads.delta(b, t, False)
                v = (max(na + da, need[b] + db), da + db)
                if not v[0] < na or v[1] > 0 or (best is not None and v >= best[:2]):
                    continue
                excess = loads.work[a] + wk[t] - cap
                if excess <= 0:
                    best = (*v, "pull", t, b, None)
                    continue
                u = next((x for x in shorts if wk[x] >= excess and loads.work[b] - wk[t] + wk[x] <= cap), None)
                if u is not None:
                    best = (*v, "pull", t, b, u)
                    continue
                for x in placed[a]:  # no short document makes room: a block of a goes to b instead
                    if x.doc == d or wk[x] < excess or loads.work[b] - wk[t] + wk[x] > cap:
                        continue
                    loads.apply(a, t, wk[t], True)
                    loads.apply(b, t, wk[t], False)
                    ea, eb = loads.delta(a, x, False), loads.delta(b, x, True)
                    loads.apply(b, t, wk[t], True)
                    loads.apply(a, t, wk[t], False)
                    w2 = (max(na + da + ea, need[b] + db + eb), da + db + ea + eb)
                    if w2[0] < na and w2[1] <= 0 and (best is None or w2 < best[:2]):
                        best = (*w2, "pull", t, b, x)
        if best is None:
            return
        _, _, kind, s, b, u = best
        src, dst = (a, b) if kind == "push" else (b, a)
        loads.apply(src, s, wk[s], False)
        placed[src].remove(s)
        loads.apply(dst, s, wk[s], True)
        placed[dst].append(s)
        owner[s] = dst
        if u is not None:
            loads.apply(a, u, wk[u], False)
            placed[a].remove(u)
            loads.apply(b, u, wk[u], True)
            placed[b].append(u)
            owner[u] = b


def node_groups(nodes: Sequence[int] | None, cp: int) -> list[list[int]] | None:
    """CP indices per node, nodes in order of first appearance; None where a node-aware placement
    would equal the flat one (no ``nodes``, one node, one rank per node) or cannot balance (nodes of
    unequal size: the first level gives every node the same share of work), the latter logged once."""
    if nodes is None:
        return None
    nodes = list(nodes)
    if len(nodes) != cp:
        raise ValueError(f"nodes: one node id per CP index ({cp}), got {len(nodes)}; pass "
                         "Topology.domains_of(cp_ranks)")
    groups: dict = {}
    for j, n in enumerate(nodes):
        groups.setdefault(n, []).append(j)
    out = list(groups.values())
    if len(out) in (1, cp):
        return None
    if len({len(g) for g in out}) > 1:
        if not _UNEVEN_LOGGED:
            _UNEVEN_LOGGED.append(True)
            _log.info("place_packed: CP ranks per node differ (%s); placing flat, without node awareness "
                      "(numerics are the same)", sorted({len(g) for g in out}))
        return None
    return out


def _split_even(spans: Sequence[Span], doc_span: dict, mask: Mask, n: int,
                token_weight: float = 0.0) -> list[list[Span]]:
    """``spans`` in (document, start) order as one stream of tokens, cut into ``n`` contiguous runs of
    equal work (each token's queries against its document, plus ``token_weight``: Note [Layer
    work]): the ``k``-th cut is the token boundary nearest to ``k / n`` of the stream's work (found
    by bisection on :func:`span_pairs`, so any mask), so every run is within one token's work of the
    share. The second level of a node-aware placement where the first level's blocks are too coarse
    to balance a node's ranks (Note [Node-aware placement])."""
    order = sorted(spans)

    def cost(s: Span) -> float:
        return span_pairs(s, doc_span[s.doc], mask) + token_weight * s.tokens

    works = [cost(s) for s in order]
    total = sum(works)
    out: list[list[Span]] = [[] for _ in range(n)]
    r, before = 0, 0  # current run; work of the stream before the current span
    for s, w in zip(order, works):
        a = s.start
        while r < n - 1 and before + w >= total * (r + 1) / n:  # the next cut falls in this span
            goal = total * (r + 1) / n - before
            lo, hi = s.start, s.end  # work of [start, lo) <= goal < work of [start, hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if cost(Span(s.doc, s.start, mid)) <= goal:
                    lo = mid
                else:
                    hi = mid
            below = cost(Span(s.doc, s.start, lo)) if lo > s.start else 0.0
            above = cost(Span(s.doc, s.start, hi))
            cut = lo if goal - below <= above - goal else hi
            cut = max(cut, a)
            if cut > a:
                out[r].append(Span(s.doc, a, cut))
            a, r = cut, r + 1
        if a < s.end:
            out[r].append(Span(s.doc, a, s.end))
        before += w
    return out


def _assign(spans: Sequence[Span], wk: dict, lengths: tuple, n: int, mask: Mask, is_long, *, tolerance: float,
            need_weight: float, refine: bool, long_slack: float,
            recv_refine: bool) -> tuple[list[list[Span]], np.ndarray]:
    """Steps 2-4 of :func:`place_packed`: ``spans`` (blocks already cut; ``wk[s]`` = attention work of
    ``s``'s queries against its document) onto ``n`` bins, returning each bin's spans and work. A bin
    is a rank, or a node of ranks (the first level of a node-aware placement): need is counted per
    bin the same way, as tokens entering it."""
    causal = mask.causal
    mean = sum(wk[s] for s in spans) / n
    placed: list[list[Span]] = [[] for _ in range(n)]
    work = np.zeros(n)
    need = np.zeros(n)
    held: dict[int, dict[int, tuple[int, int]]] = {}  # document -> rank -> (max end, tokens held)
    windowed = _Loads(lengths, n, mask) if mask.windowed else None  # the need under a window
    for s in sorted((s for s in spans if is_long(s)), key=lambda s: (-s.start, -wk[s], s.doc)):
        w = wk[s]
        after = need + (s.start if causal else lengths[s.doc] - s.tokens)  # need after, on a rank without s.doc
        hold = held.setdefault(s.doc, {})
        for r, (top, toks) in hold.items():
            end = max(top, s.end) if causal else lengths[s.doc]
            after[r] = need[r] - ((top if causal else end) - toks) + end - toks - s.tokens
        if windowed is not None:
            after = np.array([need[r] + windowed.delta(r, s, True) for r in range(n)], dtype=np.float64)
        room = work + w <= mean * (1 + long_slack)
        cut = [r for r in hold if room[r] and after[r] < need[r]]
        if cut:  # an earlier block of a document whose later block r holds: r's need drops; take the neediest
            r = max(cut, key=lambda r: (need[r], -r))
        elif room.any():
            r = int(np.argmin(np.where(room, after, np.inf)))
        else:
            r = int(np.argmin(work))
        top, toks = hold.get(r, (0, 0))
        hold[r] = (max(top, s.end), toks + s.tokens)
        need[r] = after[r]
        if windowed is not None:
            windowed.apply(r, s, w, True)
        work[r] += w
        placed[r].append(s)
    heap = [(float(work[r]), r) for r in range(n)]  # short documents: least loaded first (LPT on work)
    heapq.heapify(heap)
    for s in sorted((s for s in spans if not is_long(s)), key=lambda s: (-wk[s], s.doc)):
        _, r = heapq.heappop(heap)
        work[r] += wk[s]
        placed[r].append(s)
        heapq.heappush(heap, (float(work[r]), r))
    if refine and n > 1:
        loads = _Loads(lengths, n, mask)
        for r in range(n):
            for s in placed[r]:
                loads.apply(r, s, wk[s], True)
        _refine(loads, placed, wk, 0.0, max_iter=2 * n + 32, movable=lambda s: not is_long(s))  # need unchanged
        if max(loads.work) > (1 + tolerance) * mean:  # too few short documents: move long blocks too
            _refine(loads, placed, wk, need_weight, max_iter=2 * n + 32)
        if recv_refine and not mask.windowed:
            _refine_recv(loads, placed, wk, max(RECV_WORK_CAP * mean, max(loads.work)), 4 * n + 64, is_long)
        work = np.asarray(loads.work, dtype=np.float64)
    return placed, work


def place_packed(
    doc_lengths: Sequence[int],
    cp: int,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    causal: bool = True,
    tolerance: float = 0.02,
    max_block_work: float = 0.25,
    need_weight: float = 0.0,
    refine: bool = True,
    long_slack: float = 0.0,
    window: Sequence[int] | None = None,
    recv_refine: bool = True,
    nodes: Sequence[int] | None = None,
    token_weight: float = 0.0,
) -> Placement:
    """Place a packed batch on ``cp`` ranks; see Note [Placements and document need sets].

    Algorithm (deterministic):

    1. cut documents longer than ``block_tokens`` into near-equal blocks, and cut further any of
       their blocks whose attention work exceeds ``max_block_work`` x the mean work per rank (the
       last blocks of a long document; pieces of at least ``block_tokens // 8`` tokens); if work
       still exceeds :data:`BALANCE_TARGET` x the mean after step 4, place again with
       ``max_block_work`` halved (down to :data:`MIN_BLOCK_WORK`);
    2. blocks of long documents, latest start first (most need first; ties: work, document): each
       goes to a rank whose work stays within ``(1 + long_slack)`` x the mean work per rank; if a
       rank holding a later block of the same document qualifies and its need drops (an earlier
       block shortens the prefix it must receive), the neediest such rank; else the rank whose need
       after is least (ties: lowest index); if none has room, the least loaded. Need = tokens a rank
       must receive (:class:`_Loads`);
    3. short documents (need nothing wherever they go), largest work first, to the least loaded rank;
    4. ``refine``: local search (:func:`_refine`) moving or swapping short documents only (the need
       stays) between the rank with the most work and the least loaded ones until work max/mean
       <= 1.005; if work still exceeds ``1 + tolerance`` x the mean (few short documents), the
       search runs again over all blocks, a rank's score the larger of its work over the mean and
       ``1 + need_weight x (need / mean need - 1)`` (default ``need_weight`` 0: work alone);
       then (``recv_refine``, causal or full masks) :func:`_refine_recv` lowers the largest need
       with work kept under :data:`RECV_WORK_CAP` x the mean (or the work reached, if larger);
       see Note [Busiest receiver lower bound];
    5. order each rank's blocks by (document, start).

    ``window`` (``(left, right)`` inside each document, Megatron's convention): work and need follow
    the windowed mask (a block's need is the window's reach before its edge, :class:`_Loads`).

    ``nodes`` (node id per CP index, e.g. :meth:`Topology.domains_of` of the CP ranks): steps 2-4 run
    twice, first with the nodes as bins, then over each node's ranks with that node's blocks; see
    Note [Node-aware placement]. Without it (or with one node, or one rank per node) the placement
    is flat.

    ``token_weight`` (>= 0, pairs per token): the work balanced is the *layer's*, each block's
    attention pairs plus ``token_weight`` per token for the layer's token-wise parts (projections,
    MLP), which run on the tokens the placement gives a rank; see Note [Layer work] and
    :func:`~megatron_fcp.cost.model.layer_pairs_per_token`. 0 (default): attention alone.

    This balances attention work (with ``token_weight``, a weighted sum); the placement the runtime
    uses by default balances pairs and tokens each (:func:`~megatron_fcp.contract.layer_placement.place_packed_layer`).

    Any lengths work: no divisibility rule, documents of length 1, ranks left without tokens.
    """
    lengths = check_placement_args(doc_lengths, cp, block_tokens)
    if not tolerance >= 0:
        raise ValueError(f"tolerance: must be >= 0, got {tolerance!r}")
    if not max_block_work > 0:
        raise ValueError(f"max_block_work: must be > 0, got {max_block_work!r}")
    if isinstance(token_weight, bool) or not isinstance(token_weight, (int, float)) or not token_weight >= 0:
        raise ValueError(f"token_weight: attention pairs per token, a number >= 0, got {token_weight!r}; "
                         "use megatron_fcp.cost.model.layer_pairs_per_token for a model's, or 0 for attention alone")
    tw = float(token_weight)
    mask = Mask(bool(causal), *check_window(window))
    doc_span = {d: Span(d, 0, n) for d, n in enumerate(lengths)}
    total = sum(span_pairs(s, s, mask) for s in doc_span.values()) + tw * sum(lengths)
    cap = max_block_work * total / cp
    spans = [Span(d, a, b) for d, n in enumerate(lengths)
             for a, b in (_doc_blocks(n, block_tokens, cap, mask, max(1, block_tokens // 8), tw)
                          if n > block_tokens else [(0, n)])]
    # the layer's work of s (Note [Layer work]): its queries against its whole doc, and its tokens
    wk = {s: span_pairs(s, doc_span[s.doc], mask) + tw * s.tokens for s in spans}
    is_long = lambda s: lengths[s.doc] > block_tokens  # noqa: E731
    kw = dict(tolerance=tolerance, need_weight=need_weight, refine=refine, long_slack=long_slack,
              recv_refine=recv_refine)
    groups = node_groups(nodes, cp)
    if groups is None:
        placed, work = _assign(spans, wk, lengths, cp, mask, is_long, **kw)
    else:  # Note [Node-aware placement]: documents onto nodes first, then each node's blocks onto its ranks
        by_node, _ = _assign(spans, wk, lengths, len(groups), mask, is_long, **kw)
        placed = [[] for _ in range(cp)]
        for members, node_spans in zip(groups, by_node):
            inner, w = _assign(node_spans, wk, lengths, len(members), mask, is_long, **kw)
            if len(members) > 1 and w.max() > BALANCE_TARGET * total / cp:  # pieces too coarse for g ranks
                inner = _split_even(node_spans, doc_span, mask, len(members), tw)
            for r, p in zip(members, inner):
                placed[r] = p
        work = np.array([sum(span_pairs(s, doc_span[s.doc], mask) + tw * s.tokens for s in p) for p in placed],
                        dtype=np.float64)
    mean = total / cp
    if refine and cp > 1 and work.max() > BALANCE_TARGET * mean and max_block_work / 2 >= MIN_BLOCK_WORK:
        # few documents per rank (cp = 256 on a 1M-token batch): pieces too coarse to balance; halve them
        return place_packed(lengths, cp, block_tokens=block_tokens, causal=causal, tolerance=tolerance,
                            max_block_work=max_block_work / 2, need_weight=need_weight, refine=refine,
                            long_slack=long_slack, window=window, recv_refine=recv_refine, nodes=nodes,
                            token_weight=tw)
    return Placement(lengths, tuple(tuple(sorted(p)) for p in placed), causal, mask.window)


@jit
def _need_table(last_q, docs, starts, owners, causal):
    """:meth:`Placement.need_matrix` without the window, ``[cp, n_blocks]``: rank ``j`` needs block
    ``b`` when it does not own it and holds a query of its document at or after the block's start
    (any query of the document when not causal); ``last_q[j, d]``: rank ``j``'s last query position
    in document ``d`` (-1: none). One pass, no ``[cp, n_blocks]`` integer table."""
    cp, n = last_q.shape[0], docs.shape[0]
    out = np.zeros((cp, n), dtype=np.bool_)
    for j in range(cp):
        for b in range(n):
            if owners[b] != j:
                q = last_q[j, docs[b]]
                out[j, b] = q >= starts[b] if causal else q >= 0
    return out


@jit
def _span_pair_matrix(order, first, start, end, owners, cp, lo, hi):
    """int64 ``[cp * n]``: entry ``x * n + k``, the visible pairs of CP rank ``x``'s spans against
    span ``k`` (:func:`~megatron_fcp.contract.mask.pair_count` under offsets ``(lo, hi)``), over the
    (query, key) pairs of spans of one document: document ``g``'s spans are
    ``order[first[g]:first[g + 1]]``; ``start``, ``end``, ``owners`` per span. Exact (int64)."""
    n = start.shape[0]
    out = np.zeros(cp * n, dtype=np.int64)
    for g in range(first.shape[0] - 1):
        for a in range(first[g], first[g + 1]):
            q = order[a]
            row = owners[q] * n
            for b in range(first[g], first[g + 1]):
                k = order[b]
                out[row + k] += pair_count(start[q], end[q], start[k], end[k], lo, hi)
    return out
