"""Every block's multicast tree at once, as integer columns. Pure, no torch.

Note [Trees as columns]
-----------------------
The compiler asks a graph for one tree per block (``CommGraph.tree_with_depths``) and then
checks, balances and prices the trees as flat arrays. A packed batch at cp = 256 has ~3,600
blocks with ~125K tree edges per candidate graph, and ``auto`` builds three candidates: built
tree by tree in Python, as lists of tuples, and then flattened, the trees were a third of a
batch's plan (2026-12-06, cProfile of one cp = 256 ``auto`` plan of 512 packed documents on
dgx-h100:4: 0.13 s of 0.43 s; as columns the plan step fell from 0.39 s to 0.17 s). A builder may
instead give all of a batch's trees as :class:`TreeColumns` (``GraphBuilder.tree_columns``): the
*same* edges in the same order, tree after tree, each tree's edges as its ``tree_with_depths``
lists them. ``full``, ``entry`` and ``hierarchical`` (the packed ``auto`` candidates that survive
the floors at scale) do it with numpy sorts over every (block, reader) pair; any other builder is
asked tree by tree (:func:`columns_of`). ``tests/test_tree_columns.py`` checks each vectorised
builder against its own per-tree answer on uneven groups, rank maps and placements.

Readers come as CSR columns too (:class:`Readers`): tree ``t`` reads ``ranks[ptr[t]:ptr[t + 1]]``.

The rail builders' per-tree rules, as the vectorised forms use them (``g``: a reader's tier in
the graph's ``groups`` order, ``p`` its rail position there, ``n`` the tier's size):

* ``full``: ``(owner, d)`` for every reader, in reader order, depth 1.
* ``entry``: depth 1 ``(owner, d)`` for the owner's tier's readers, and per other tier one edge to
  its *entry*, the reader with the least ``(p - p(owner)) mod n``; depth 2 ``(entry, d)`` for that
  tier's other readers. Edges by (depth, g, p).
* ``hierarchical``: as ``entry``, but the relay is the tier's member at :func:`entry_position` (a
  reader or not).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

__all__ = ["Readers", "TreeColumns", "columns_of", "entry_position", "from_trees", "full_columns", "tier_columns"]


def entry_position(rail, home_size, size, chunk):
    """Rail position where a block leaving a node of ``home_size`` CP ranks on ``rail`` enters a node
    of ``size`` CP ranks: ``rail mod size``; when the receiving node holds more CP ranks than the
    sender's (an uneven CP group), odd chunks enter ``home_size`` positions further on, so the
    fan-out of a small node's blocks is spread over twice as many relays (see Note [Rail striping]
    in :mod:`megatron_fcp.planner.builders`). Ints in, an int out; or numpy arrays (any argument),
    element by element: the one rule the per-tree builders, the rail layout and the columns use."""
    return (rail + home_size * ((size > home_size) & (chunk % 2 == 1))) % size


class Readers(NamedTuple):
    """The readers of many blocks: tree ``t``'s are ``ranks[ptr[t]:ptr[t + 1]]`` (global ranks, in
    CP order, never the block's owner: it holds the block)."""

    ptr: np.ndarray      # int64 [trees + 1]
    ranks: np.ndarray    # int64 [reads]

    def tree_of(self) -> np.ndarray:
        """int64 ``[reads]``: the tree of each read."""
        return np.repeat(np.arange(len(self.ptr) - 1, dtype=np.int64), np.diff(self.ptr))

    def of(self, t: int) -> list[int]:
        return self.ranks[self.ptr[t]:self.ptr[t + 1]].tolist()

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence[int]]) -> "Readers":
        ptr = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in lists], out=ptr[1:])
        return cls(ptr, np.fromiter((r for x in lists for r in x), dtype=np.int64, count=int(ptr[-1])))


class TreeColumns(NamedTuple):
    """Multicast trees as columns: tree ``t`` carries block ``(owner[t], chunk[t])``; its edges
    are the entries with ``tree_of == t``, contiguous, parents first (edge ``(u, v)``, ``depth``
    = hops from the owner to ``v``)."""

    owner: np.ndarray    # int64 [trees]: global rank
    chunk: np.ndarray    # int64 [trees]: the owner's block index (zigzag: its chunk)
    tree_of: np.ndarray  # int64 [edges], ascending
    u: np.ndarray        # int64 [edges]
    v: np.ndarray        # int64 [edges]
    depth: np.ndarray    # int64 [edges]

    @property
    def num_edges(self) -> int:
        return len(self.u)

    def staggered(self, blocks: int) -> "TreeColumns":
        """Each tree's edges ``chunk % blocks`` rounds deeper (a packed plan's ``stagger_blocks``)."""
        if blocks <= 1:
            return self
        return self._replace(depth=self.depth + self.chunk[self.tree_of] % blocks)

    def as_trees(self) -> list[tuple[int, int, list[tuple[int, int]], list[int]]]:
        """``(owner, chunk, edges, depths)`` per tree, as ``tree_with_depths`` gives them."""
        ends = np.searchsorted(self.tree_of, np.arange(len(self.owner) + 1)).tolist()
        us, vs, ds = self.u.tolist(), self.v.tolist(), self.depth.tolist()
        return [(o, c, list(zip(us[a:b], vs[a:b])), ds[a:b])
                for o, c, a, b in zip(self.owner.tolist(), self.chunk.tolist(), ends[:-1], ends[1:])]


def columns_of(owner: Sequence[int], chunk: Sequence[int], readers: Readers,
               tree: Callable[[int, Sequence[int], int], tuple[list, list]]) -> TreeColumns:
    """Trees built one at a time by ``tree(owner, readers, chunk) -> (edges, depths)`` (a graph's
    ``tree_with_depths``), as columns."""
    return from_trees([(o, c) + tuple(tree(o, readers.of(t), c)) for t, (o, c) in enumerate(zip(owner, chunk))])


def from_trees(trees: Sequence[tuple[int, int, Sequence[tuple[int, int]], Sequence[int]]]) -> TreeColumns:
    """``(owner, chunk, edges, depths)`` per tree (:meth:`TreeColumns.as_trees`' form) as columns."""
    lens = [len(e) for _, _, e, _ in trees]
    E = sum(lens)
    T = len(trees)
    return TreeColumns(np.fromiter((o for o, _, _, _ in trees), dtype=np.int64, count=T),
                       np.fromiter((c for _, c, _, _ in trees), dtype=np.int64, count=T),
                       np.repeat(np.arange(T, dtype=np.int64), lens),
                       np.fromiter((u for _, _, e, _ in trees for u, _ in e), dtype=np.int64, count=E),
                       np.fromiter((v for _, _, e, _ in trees for _, v in e), dtype=np.int64, count=E),
                       np.fromiter((d for _, _, _, ds in trees for d in ds), dtype=np.int64, count=E))


def full_columns(owner: np.ndarray, chunk: np.ndarray, readers: Readers) -> TreeColumns:
    """``full``: every reader straight from the owner, in reader order."""
    tree_of = readers.tree_of()
    return TreeColumns(owner, chunk, tree_of, owner[tree_of], readers.ranks.copy(),
                       np.ones(len(tree_of), dtype=np.int64))


def tier_columns(groups: dict[int, Sequence[int]], owner: np.ndarray, chunk: np.ndarray, readers: Readers,
                 relay: str) -> TreeColumns:
    """``entry`` (``relay="entry"``) or ``hierarchical`` (``relay="rail"``) over ``groups`` (tier ->
    members in rail order), by the rules of Note [Trees as columns]."""
    members = list(groups.values())
    sizes = np.array([len(m) for m in members], dtype=np.int64)
    flat = np.array([r for m in members for r in m], dtype=np.int64)
    start = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    span = int(max(flat.max(initial=0), owner.max(initial=0), readers.ranks.max(initial=0))) + 1
    g_of = np.full(span, -1, dtype=np.int64)       # global rank -> tier index (groups order)
    p_of = np.full(span, -1, dtype=np.int64)       # global rank -> rail position in its tier
    g_of[flat] = np.repeat(np.arange(len(members), dtype=np.int64), sizes)
    p_of[flat] = np.arange(len(flat), dtype=np.int64) - np.repeat(start, sizes)

    t = readers.tree_of()                                                   # [reads]
    d = readers.ranks                                                       # never the tree's owner
    g, p = g_of[d], p_of[d]
    home_g = g_of[owner]                                                    # [trees]
    home = g == home_g[t]
    n = sizes[g]
    rail = p_of[owner][t]                                                   # the owner's rail position
    remote = np.nonzero(~home)[0]
    # one (tree, remote tier) per group of reads: sorted by tree, tier, then the entry key
    if relay == "entry":
        key = (p[remote] - rail[remote]) % n[remote]
    else:
        key = p[remote]
    G, width = len(members), int(sizes.max(initial=1))                      # key, tier and depth bounds
    order = remote[np.argsort((t[remote] * G + g[remote]) * width + key, kind="stable")]  # lexsort by (t, g, key)
    tg = t[order] * G + g[order]
    head = np.ones(len(order), dtype=bool)
    head[1:] = tg[1:] != tg[:-1]
    group_id = np.cumsum(head) - 1                                          # [remote reads]: its (tree, tier)
    heads = order[head]                                                     # first read of each group
    gt, gg = t[heads], g[heads]                                             # [groups]
    if relay == "entry":
        relay_rank = d[heads]                                               # the entry: a reader
    else:
        relay_rank = flat[start[gg] + entry_position(rail[heads], sizes[home_g[gt]], sizes[gg], chunk[gt])]
    relay_of = np.empty(len(d), dtype=np.int64)
    relay_of[order] = relay_rank[group_id]
    # edges: home reads (depth 1), one hop per (tree, remote tier) to its relay (depth 1), the
    # remote reads other than the relay (depth 2)
    second = order[d[order] != relay_of[order]]
    e_tree = np.concatenate([t[home], gt, t[second]])
    e_u = np.concatenate([owner[t[home]], owner[gt], relay_of[second]])
    e_v = np.concatenate([d[home], relay_rank, d[second]])
    e_depth = np.concatenate([np.ones(int(home.sum()) + len(gt), dtype=np.int64),
                              np.full(len(second), 2, dtype=np.int64)])
    e_g = np.concatenate([g[home], gg, g[second]])
    by = np.argsort(((e_tree * 3 + e_depth) * G + e_g) * width + p_of[e_v], kind="stable")  # by (tree, depth, g, p)
    return TreeColumns(owner, chunk, e_tree[by], e_u[by], e_v[by], e_depth[by])
