"""Graph builders: the strategies that connect one CP group, and the one registry of their names.

A builder is a strategy object (``name``, ``build(topology, cp_ranks) -> CommGraph``). Besides the
edges it knows the *multicast tree* that carries one block from its owner to the ranks that need it
inside its graph (``tree(cg, owner, dests)``), because the good tree is structural: on a
rail-striped graph a block crosses to another node once, on its owner's rail, and fans out there.
Builders without a tree of their own use :func:`~megatron_fcp.planner.graph.steiner_tree`.

:data:`BUILDERS` is the registry. :data:`GRAPH_CHOICES` (what ``--fcp-graph``, ``FCPConfig.graph``
and the CLI accept) and :data:`AUTO_CANDIDATES` (what ``auto`` compares) are derived from it.

Note [Rail striping]
--------------------
For a CP group spread over nodes, ``hierarchical`` lists the group's ranks per node by local rank
and pairs position ``k`` of node A with position ``k mod |B|`` of node B (on DGX machines with the
same local ranks per node this is "local rank i talks to local rank i": the same NIC rail). For two
nodes of four ranks (global ranks 0..7, node 0 = 0..3)::

    edges: full mesh inside each node (NVLink), and 0<->4, 1<->5, 2<->6, 3<->7 (one IB rail each)
    block of rank 1, needed everywhere:
        round 0: 1->0, 1->2, 1->3 (NVLink)   1->5 (rail 1)
        round 1: 5->4, 5->6, 5->7 (NVLink fan-out on node 1)

When nodes hold different numbers of CP ranks (8 + 4), blocks from the smaller node enter the larger
one at position ``k mod |B|`` for chunk 0 and ``k + |A|`` for chunk 1 (:func:`entry_position`), so
the larger node's fan-out is not left to its first ``|A|`` ranks alone.

Every NIC then carries exactly its own GPU's blocks once per remote node; the ``leader`` graph
instead funnels a whole node through one rank, which is only right when the node has one uplink.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import networkx as nx
import numpy as np

from megatron_fcp.contract.plan import check_cp_ranks
from megatron_fcp.contract.table import TransferTable
from megatron_fcp.jit import jit
from megatron_fcp.planner.graph import CommGraph, TreeEdges, depths_of, parents_first, prune_bfs, runs_of, steiner_tree
from megatron_fcp.planner.tree_columns import (Readers, TreeColumns, columns_of, entry_position, full_columns,
                                               tier_columns)
from megatron_fcp.planner.table_compile import (
    full_edges,
    full_table,
    hierarchical_edges,
    hierarchical_table,
    ring_table,
)
from megatron_fcp.topology import Topology

__all__ = [
    "GraphBuilder",
    "RingGraph",
    "FullGraph",
    "HierarchicalGraph",
    "LeaderGraph",
    "SpanningGraph",
    "BalancedGraph",
    "EntryGraph",
    "StripeGraph",
    "BUILDERS",
    "GRAPH_CHOICES",
    "AUTO_CANDIDATES",
    "PACKED_AUTO_CANDIDATES",
    "get_builder",
    "build_graph",
]


def _tier_of(topo: Topology, r: int) -> int:
    """The fast tier a rank is in: its NVLink domain, which is its host unless an NVLink fabric spans
    hosts (NVL72; Note [NVLink domains] in :mod:`megatron_fcp.topology.model`). Builders' "nodes"
    are these tiers: full mesh inside, NIC rails between."""
    return topo.domain_of(r)


def _node_groups(topo: Topology, ranks: Sequence[int]) -> dict[int, list[int]]:
    """CP ranks per fast tier (:func:`_tier_of`), each list sorted by (host, local rank): the rail
    order (position k of every tier uses the same local NIC)."""
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(_tier_of(topo, r), []).append(r)
    for lst in groups.values():
        lst.sort(key=lambda r: (topo.node_of(r), topo.local_rank_of(r)))
    return groups


class GraphBuilder:
    """Strategy interface: ``build`` a CommGraph and give each block's multicast ``tree``."""

    name = "base"
    pipeline_parts = True  # stagger a chunk's sub-blocks over rounds (relays pipeline them)
    needs_kv_sizes = False  # True: meaningful only with per-rank KV sizes (not offered by name)
    zigzag_auto = True  # False: auto compares it only for packed batches (zigzag auto plans stay pinned)
    packed_auto = True  # False: packed auto does not compare it either (named only)

    def build(self, topology: Topology, cp_ranks: Sequence[int]) -> CommGraph:
        ranks = check_cp_ranks(topology, cp_ranks)
        edges, meta = self._edges(topology, ranks)
        cg = CommGraph(self.name, ranks, None, topology, self, self.pipeline_parts, meta, edges=edges)
        return cg.check_connected()

    def _edges(self, topo: Topology, ranks: tuple[int, ...]) -> tuple[list[tuple[int, int]], dict]:
        """``(directed edges in insertion order, meta)``; self-loops and repeats are dropped."""
        raise NotImplementedError

    def tree(self, cg: CommGraph, owner: int, dests: Sequence[int], chunk: int = 0) -> TreeEdges:
        return steiner_tree(cg.graph, owner, dests)

    def tree_with_depths(self, cg: CommGraph, owner: int, dests: Sequence[int],
                         chunk: int = 0) -> tuple[TreeEdges, list[int]]:
        """``(tree edges in BFS order, depth of each edge's receiver)``; builders may override."""
        edges = self.tree(cg, owner, dests, chunk)
        return edges, depths_of(edges, owner)

    def tree_runs(self, cg: CommGraph, owner: int, dests: Sequence[int], chunk: int = 0):
        """``(depth, srcs, dsts)`` runs of the tree; builders may override to skip edge tuples."""
        return runs_of(*self.tree_with_depths(cg, owner, dests, chunk))

    def tree_columns(self, cg: CommGraph, owner: np.ndarray, chunk: np.ndarray, readers: Readers) -> TreeColumns:
        """Every block's tree at once (Note [Trees as columns] in
        :mod:`megatron_fcp.planner.tree_columns`): :meth:`tree_with_depths` tree by tree; builders
        whose trees follow a rule over the whole batch override it with array code."""
        return columns_of(owner.tolist(), chunk.tolist(), readers,
                          lambda o, d, c: self.tree_with_depths(cg, o, d, c))

    def sends_direct(self) -> bool:
        """Whether every tree is a star, each block straight from its owner to every reader (so a
        plan's messages are known before it is compiled: Note [Pruning auto])."""
        return False

    def edge_loads(self, cg: CommGraph, owner: np.ndarray, need: np.ndarray,
                   tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Where this builder's trees follow fixed paths, the tokens every graph edge carries in any
        plan compiled from it, before it is compiled: ``(src, dst, tokens)`` (CP indices, one row
        per edge used), from each block's owner (``[blocks]``, CP index), readers (``need``,
        ``[cp, blocks]`` bool) and tokens (``[blocks]``). None where the paths depend on more than
        that. A floor on the plan's communication (Note [Pruning auto])."""
        return None

    def _own_tree(self, cls, *methods: str) -> bool:
        """Whether this builder's trees are ``cls``'s: none of ``methods`` overridden below it (a
        subclass that changes them gets the tree-by-tree :meth:`tree_columns`)."""
        return all(getattr(type(self), m) is getattr(cls, m) for m in methods)

    def wave_table(self, cg: CommGraph, causal: bool, parts_per_chunk: int) -> TransferTable | None:
        """The ASAP waves of this builder's zigzag trees as columns (Note [Compiling to a table] in
        :mod:`megatron_fcp.planner.table_compile`), or None: the compiler then builds objects."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RingGraph(GraphBuilder):
    """Megatron/TE ring: CP rank i -> CP rank i+1. A block travels the ring until its last reader."""

    name = "ring"
    pipeline_parts = False  # TE sends a rank's whole KV every step

    def _edges(self, topo, ranks):
        return [(r, ranks[(i + 1) % len(ranks)]) for i, r in enumerate(ranks)], {}

    def wave_table(self, cg, causal, parts_per_chunk):
        return ring_table(cg, causal, parts_per_chunk)

    def tree(self, cg, owner, dests, chunk=0):
        ranks, cp = cg.ranks, len(cg.ranks)
        i = ranks.index(owner)
        want = set(dests)
        last = max(((ranks.index(d) - i) % cp for d in want), default=0)
        return [(ranks[(i + h) % cp], ranks[(i + h + 1) % cp]) for h in range(last)]

    def edge_loads(self, cg, owner, need, tokens):
        """:meth:`tree`'s chains: block ``b`` crosses hops ``owner, owner + 1, ...`` up to its
        farthest reader downstream, so hop ``j -> j + 1`` carries it when ``(j - owner) mod cp`` is
        below that distance (a cyclic range per block, summed by a difference array)."""
        if not self._own_tree(RingGraph, "tree", "tree_with_depths", "tree_runs", "tree_columns"):
            return None
        cp = len(cg.ranks)
        last = _farthest_reader(need, np.asarray(owner, dtype=np.int64), cp)   # [blocks]: hops downstream
        diff = np.zeros(2 * cp + 1)
        np.add.at(diff, owner, tokens)
        np.add.at(diff, owner + last, -tokens)
        run = np.cumsum(diff)[:2 * cp]
        load = run[:cp] + run[cp:]                                             # [cp]: hop j -> j + 1
        hop = np.arange(cp)
        used = load > 0
        return hop[used], (hop[used] + 1) % cp, load[used]


class FullGraph(GraphBuilder):
    """Every ordered pair is an edge; each block goes straight from its owner to every reader."""

    name = "full"

    def _edges(self, topo, ranks):
        return full_edges(ranks), {}

    def wave_table(self, cg, causal, parts_per_chunk):
        return full_table(cg, causal, parts_per_chunk) if cg.pipeline_parts else None

    def tree(self, cg, owner, dests, chunk=0):
        return [(owner, d) for d in dests]

    def tree_with_depths(self, cg, owner, dests, chunk=0):
        return [(owner, d) for d in dests], [1] * len(dests)

    def tree_runs(self, cg, owner, dests, chunk=0):
        return [(1, [owner] * len(dests), list(dests))]

    def sends_direct(self) -> bool:
        return self._own_tree(FullGraph, "tree_with_depths")

    def tree_columns(self, cg, owner, chunk, readers):
        if self.sends_direct():
            return full_columns(owner, chunk, readers)
        return super().tree_columns(cg, owner, chunk, readers)


class EntryGraph(FullGraph):
    """Every pair is an edge; a block crosses to each other node once, *into one of its readers*.

    Tree: owner -> its node's readers; on every other node holding a reader, owner -> the *entry*
    (the first reader at or after the owner's rail position, cyclically, in rail order) -> that
    node's other readers. Bytes are exactly the need sets (no relay that does not read) and each
    block enters a node once. Meant for packed batches, where a rank on the owner's rail often needs
    nothing of a document; ``hierarchical`` would relay through it. Not in zigzag ``auto``.
    """

    name = "entry"
    zigzag_auto = False

    def _edges(self, topo, ranks):
        edges, _ = super()._edges(topo, ranks)
        groups = _node_groups(topo, ranks)
        pos = {r: k for members in groups.values() for k, r in enumerate(members)}
        return edges, {"groups": groups, "pos": pos, "node_of": {r: _tier_of(topo, r) for r in ranks}}

    def tree_with_depths(self, cg, owner, dests, chunk=0):
        meta = cg.meta
        groups, node_of, pos = meta["groups"], meta["node_of"], meta["pos"]
        home = node_of[owner]
        # the readers per node, in the node's member order (a packed block has few readers: bucket
        # them rather than scan every node's members)
        by_node: dict = {}
        for d in dests:
            if d != owner:
                by_node.setdefault(node_of[d], []).append(d)
        first: TreeEdges = []
        second: TreeEdges = []
        for node, members in groups.items():
            readers = by_node.get(node)
            if not readers:
                continue
            readers = sorted(set(readers), key=pos.__getitem__)
            if node == home:
                first.extend((owner, d) for d in readers)
                continue
            n = len(members)
            rail = pos[owner] % n
            entry = min(readers, key=lambda d: (pos[d] - rail) % n)
            first.append((owner, entry))
            second.extend((entry, d) for d in readers if d != entry)
        return first + second, [1] * len(first) + [2] * len(second)

    def tree(self, cg, owner, dests, chunk=0):
        return self.tree_with_depths(cg, owner, dests, chunk)[0]

    def tree_runs(self, cg, owner, dests, chunk=0):
        return runs_of(*self.tree_with_depths(cg, owner, dests, chunk))

    def tree_columns(self, cg, owner, chunk, readers):
        if self._own_tree(EntryGraph, "tree_with_depths"):
            return tier_columns(cg.meta["groups"], owner, chunk, readers, relay="entry")
        return GraphBuilder.tree_columns(self, cg, owner, chunk, readers)

    def wave_table(self, cg, causal, parts_per_chunk):
        return None  # its trees differ from full's


class StripeGraph(EntryGraph):
    """``entry``, with the copies for other nodes leaving the owner's node through different NICs.

    Tree: owner -> its node's readers; the ``i``-th other node holding a reader (nodes in cyclic
    order after the owner's) is reached through the owner's node member at rail position
    ``pos(owner) + i`` (cyclically): owner -> that *relay* over NVLink (the owner itself for
    ``i = 0``), relay -> the remote node's entry (its first reader at or after the relay's rail
    position), entry -> that node's other readers. On packed batches the early blocks of a document
    that spans ``k`` nodes are read on all of them: ``entry`` sends ``k - 1`` copies through the
    owner's one NIC, which then bounds the round (a busiest sender), while here each leaves through
    its own. Bytes: ``entry``'s plus one NVLink hop per copy whose relay is not a reader.

    Not in packed ``auto``: ``auto`` ranks packed plans by their forward, and ``stripe``'s deeper
    trees make the one-pass backward's dK/dV reduction slower than ``entry``'s (2026-12-02: cp = 256,
    32K median, forward 16.4 ms against 18.6, one-pass backward 44.3 against 36.4; cp = 64, 2K,
    tile-priced, fwd+bwd 11.9 against 9.5 ms). Ask for it by name (``--fcp-graph stripe``).
    """

    name = "stripe"
    zigzag_auto = False
    packed_auto = False

    def tree_with_depths(self, cg, owner, dests, chunk=0):
        meta = cg.meta
        groups, node_of, pos = meta["groups"], meta["node_of"], meta["pos"]
        home = node_of[owner]
        want = set(dests)
        members_home = groups[home]
        n_home = len(members_home)
        order = sorted(groups, key=lambda node: (node - home) % (max(groups) + 1))
        edges: list[tuple[int, int, int]] = []  # (depth, src, dst)
        reached = {owner: 0}
        i = 0
        for node in order:
            members = groups[node]
            readers = [d for d in members if d in want and d != owner]
            if not readers:
                continue
            if node == home:
                for d in readers:
                    if d not in reached:
                        reached[d] = 1
                        edges.append((1, owner, d))
                continue
            relay = members_home[(pos[owner] + i) % n_home]
            i += 1
            if relay not in reached:
                reached[relay] = 1
                edges.append((1, owner, relay))
            n = len(members)
            rail = pos[relay] % n
            entry = min(readers, key=lambda d: (pos[d] - rail) % n)
            reached[entry] = reached[relay] + 1
            edges.append((reached[entry], relay, entry))
            for d in readers:
                if d != entry:
                    reached[d] = reached[entry] + 1
                    edges.append((reached[d], entry, d))
        edges.sort(key=lambda e: e[0])  # BFS order (stable: the order above within a depth)
        return [(u, v) for _, u, v in edges], [d for d, _, _ in edges]


class _RailLayout:
    """A rail-striped CP group flattened node by node, as arrays for vectorised trees.

    Flat order: nodes in ``groups`` order, each node's members in rail (local rank) order.
    ``ranks[k]`` is the global rank at flat position ``k``, ``node[k]`` its node's position,
    ``rail_pos[k]`` its rail position inside the node, ``starts`` each node's first flat
    position, ``index`` global rank -> flat position. ``relay[p][k]`` is the flat position of the
    member of ``k``'s node at rail position ``p mod node size`` (where a block leaving another
    node on rail ``p`` enters ``k``'s node, see Note [Rail striping]); ``is_relay[p][k]`` says
    whether ``k`` is that member.
    """

    def __init__(self, groups: Mapping[int, Sequence[int]]):
        members = list(groups.values())
        sizes = np.array([len(m) for m in members], dtype=np.int64)
        self.ranks = np.array([r for m in members for r in m], dtype=np.int64)
        n = len(self.ranks)
        self.node = np.repeat(np.arange(len(members)), sizes)
        self.starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        self.rail_pos = (np.arange(n) - self.starts[self.node]).tolist()
        self.index = {r: k for k, r in enumerate(self.ranks.tolist())}
        order = np.argsort(self.ranks)
        self._sorted, self._sorted_pos = self.ranks[order], order
        size_of, start_of = sizes[self.node], self.starts[self.node]
        self.size_of, self.start_of = size_of, start_of
        self.relay = [start_of + p % size_of for p in range(int(sizes.max()))]
        self.is_relay = [relay == np.arange(n) for relay in self.relay]
        self._spread: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def relay_for(self, rail: int, home_size: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """``(relay, is_relay)`` for a block of ``chunk`` leaving a node of ``home_size`` ranks on
        ``rail``: :func:`entry_position` on every node (Note [Rail striping], uneven nodes)."""
        if chunk % 2 == 0 or not (self.size_of > home_size).any():
            return self.relay[rail], self.is_relay[rail]
        key = (rail, home_size)
        hit = self._spread.get(key)
        if hit is None:
            relay = self.start_of + entry_position(rail, home_size, self.size_of, chunk)
            hit = self._spread[key] = (relay, relay == np.arange(len(self.ranks)))
        return hit

    def positions(self, ranks: Sequence[int]) -> np.ndarray:
        """Flat positions of ``ranks`` (all members of the group)."""
        return self._sorted_pos[np.searchsorted(self._sorted, np.asarray(ranks, dtype=np.int64))]


class HierarchicalGraph(GraphBuilder):
    """Rail-striped: full mesh inside a node, rail peers across nodes; see Note [Rail striping]."""

    name = "hierarchical"

    def _edges(self, topo, ranks):
        """Full mesh per node, then each rank's rail peers: ``(a, node's member at entry_position(..))``
        for every other node and chunk, in the order ``table_compile.hierarchical_edges`` documents."""
        groups = _node_groups(topo, ranks)
        pos = {r: k for members in groups.values() for k, r in enumerate(members)}
        node_of = {r: _tier_of(topo, r) for r in ranks}
        lay = _RailLayout(groups)
        edges = hierarchical_edges(lay, lay.positions(ranks))
        return edges, {"groups": groups, "pos": pos, "node_of": node_of, "rails": lay}

    def _exit(self, cg: CommGraph, owner: int, chunk: int) -> int:
        """Rank of the owner's node whose rail carries the owner's ``chunk`` off the node."""
        return owner

    def wave_table(self, cg, causal, parts_per_chunk):
        """Columns of the waves when every chunk leaves on its owner's rail (:meth:`tree_runs`)."""
        if not cg.pipeline_parts or any(self._exit(cg, o, c) != o for o in cg.ranks for c in (0, 1)):
            return None
        return hierarchical_table(cg, causal, parts_per_chunk)

    def tree(self, cg, owner, dests, chunk=0):
        return self.tree_with_depths(cg, owner, dests, chunk)[0]

    def tree_runs(self, cg, owner, dests, chunk=0):
        """Same tree as :meth:`tree_with_depths`, as two runs, by masks over the flat layout.

        Over the group flattened node by node (:class:`_RailLayout`), the first run's receivers
        are, in flat order, the owner's node's readers and, on every other node holding a
        reader, its relay (the member on the owner's rail); the second run is every other reader
        off the owner's node, sent by its node's relay. O(cp) numpy work per block.
        """
        if self._exit(cg, owner, chunk) != owner:
            return super().tree_runs(cg, owner, dests, chunk)
        lay: _RailLayout = cg.meta["rails"]
        k = lay.index[owner]
        n = len(lay.ranks)
        if len(dests) == n - 1:  # chunk 0 / no mask: everyone but the owner reads
            reader = np.ones(n, dtype=bool)
            reader[k] = False
        else:
            reader = np.zeros(n, dtype=bool)
            reader[lay.positions(dests)] = True
        home = lay.node == lay.node[k]
        rail = lay.rail_pos[k]
        relay, is_relay = lay.relay_for(rail, int(lay.size_of[k]), chunk)
        node_reads = np.logical_or.reduceat(reader, lay.starts)[lay.node]
        first = np.where(home, reader, is_relay & node_reads)
        second = ~home & reader & ~is_relay
        d1 = lay.ranks[first].tolist()
        runs = [(1, [owner] * len(d1), d1)] if d1 else []
        if second.any():
            runs.append((2, lay.ranks[relay[second]].tolist(), lay.ranks[second].tolist()))
        return runs

    def tree_with_depths(self, cg, owner, dests, chunk=0):
        """Owner -> readers on its node; exit rank -> rail peer per other node -> that node's readers.

        Built directly in BFS order with depths, O(cp) per block (no graph search).
        """
        meta = cg.meta
        groups, node_of = meta["groups"], meta["node_of"]
        home = node_of[owner]
        everyone = len(dests) == len(cg.ranks) - 1  # chunk 0 / no mask: skip membership tests
        want = None if everyone else set(dests)
        exit_rank = self._exit(cg, owner, chunk)
        first: TreeEdges = []
        second: TreeEdges = []
        relays_needed = False
        by_node: dict = {}          # the readers per node, in member order (few for a packed block)
        if not everyone:
            pos = meta["pos"]
            for d in want:
                if d != owner:
                    by_node.setdefault(node_of[d], []).append(d)
            for node, readers in by_node.items():
                readers.sort(key=pos.__getitem__)
        for node, members in groups.items():
            if node == home:
                first.extend([(owner, d) for d in (members if everyone else by_node.get(node, ())) if d != owner])
                continue
            readers = members if everyone else by_node.get(node)
            if not readers:
                continue
            relays_needed = True
            relay = members[entry_position(meta["pos"][exit_rank], len(groups[home]), len(members), chunk)]
            hop = (exit_rank, relay)
            if exit_rank == owner:
                first.append(hop)
            else:
                second.append(hop)
            second.extend([(relay, d) for d in readers if d != relay])
        if not relays_needed or exit_rank == owner:
            return first + second, [1] * len(first) + [2] * len(second)
        # owner -> exit (NVLink) first; the exit's hops are one level deeper
        if (owner, exit_rank) not in first:
            first.append((owner, exit_rank))
        edges = parents_first(first + second, owner)
        return edges, depths_of(edges, owner)

    def tree_columns(self, cg, owner, chunk, readers):
        if self._own_tree(HierarchicalGraph, "tree_with_depths", "_exit"):
            return tier_columns(cg.meta["groups"], owner, chunk, readers, relay="rail")
        return super().tree_columns(cg, owner, chunk, readers)


class BalancedGraph(HierarchicalGraph):
    """Rail-striped, but each owner's blocks leave the node on the rail with the least KV load.

    ``kv_sizes`` maps global rank -> relative KV size (uneven sequence lengths, e.g. packed THD
    batches). Every zigzag chunk starts on its owner's rail; then, while it lowers the busiest rail,
    the largest chunk that fits moves from the busiest rail of a node to its least-loaded one (a
    chunk leaving on another rail first crosses NVLink to that rail's GPU). No NIC then carries
    much more than ``total / rails`` bytes, and with equal sizes nothing moves: exactly
    ``hierarchical``. No runtime path supplies KV sizes yet, so it is not offered by name
    (``needs_kv_sizes``); build it with ``BalancedGraph(kv_sizes)`` in Python.
    """

    name = "balanced"
    needs_kv_sizes = True

    def __init__(self, kv_sizes: Mapping[int, float] | None = None):
        self.kv_sizes = dict(kv_sizes or {})
        for r, w in self.kv_sizes.items():
            if not w >= 0:
                raise ValueError(f"kv_sizes[{r}]: must be >= 0, got {w!r}")

    def __repr__(self) -> str:
        return f"BalancedGraph(kv_sizes={self.kv_sizes or None})"

    def _edges(self, topo, ranks):
        edges, meta = super()._edges(topo, ranks)
        exits: dict[tuple[int, int], int] = {}
        for members in meta["groups"].values():
            w = {o: float(self.kv_sizes.get(o, 1.0)) for o in members}
            on: dict[int, list[tuple[int, int]]] = {r: [(r, 0), (r, 1)] for r in members}
            load = {r: 2 * w[r] for r in members}
            while len(members) > 1:
                hi = max(members, key=lambda r: (load[r], -members.index(r)))
                lo = min(members, key=lambda r: (load[r], members.index(r)))
                movable = [it for it in on[hi] if load[lo] + w[it[0]] < load[hi] - 1e-12]
                if not movable:
                    break
                it = max(movable, key=lambda it: (w[it[0]], -members.index(it[0]), -it[1]))
                on[hi].remove(it)
                on[lo].append(it)
                load[hi] -= w[it[0]]
                load[lo] += w[it[0]]
            for r, items in on.items():
                for it in items:
                    exits[it] = r
        meta["exits"] = exits
        meta["kv_sizes"] = dict(self.kv_sizes)
        return edges, meta

    def _exit(self, cg, owner, chunk):
        # zigzag chunks were balanced over rails; a packed batch's blocks leave on their owner's rail
        return cg.meta["exits"].get((owner, chunk), owner)


class LeaderGraph(GraphBuilder):
    """One leader per node (its first CP rank): full mesh inside nodes, leaders fully connected.

    A block leaves its node through the node's leader and enters each other node through that
    node's leader. Right only where a node has one uplink (``single-uplink``, ``pcie-box``).
    """

    name = "leader"

    def _edges(self, topo, ranks):
        groups = {}
        for r in ranks:
            groups.setdefault(_tier_of(topo, r), []).append(r)  # CP order: leader = first CP rank
        edges = [(a, b) for members in groups.values() for a in members for b in members]
        leaders = {n: m[0] for n, m in groups.items()}
        edges += [(a, b) for a in leaders.values() for b in leaders.values()]
        return edges, {"leaders": leaders}

    def tree(self, cg, owner, dests, chunk=0):
        topo = cg.topology
        leaders = cg.meta["leaders"]
        home = _tier_of(topo, owner)
        by_node: dict[int, list[int]] = {}
        for d in dests:
            by_node.setdefault(_tier_of(topo, d), []).append(d)
        edges: TreeEdges = [(owner, d) for d in by_node.pop(home, [])]
        if not by_node:
            return edges
        out = leaders[home]
        if out != owner and (owner, out) not in edges:
            edges.append((owner, out))
        for node in sorted(by_node):
            lead = leaders[node]
            edges.append((out, lead))
            edges.extend((lead, d) for d in by_node[node] if d != lead)
        return parents_first(edges, owner)


class SpanningGraph(GraphBuilder):
    """Maximum-bandwidth spanning tree (both directions), for irregular PCIe / mixed machines.

    Edge weight is the route cost (latency + REF_BYTES/bandwidth); Kruskal keeps the cheapest
    edges, so GPU pairs behind one PCIe switch are joined directly, switches are bridged once and
    nodes are joined by a single edge. Candidate edges: all pairs inside a node, and rail pairs
    (see Note [Rail striping]) across nodes, which keeps 1,024-rank groups fast. A block follows the
    unique tree paths from its owner, pruned to the branches that lead to readers.
    """

    name = "spanning"

    def _edges(self, topo, ranks):
        groups = _node_groups(topo, ranks)
        cand = nx.Graph()
        cand.add_nodes_from(ranks)
        order = {r: i for i, r in enumerate(ranks)}
        seen: dict[tuple[int, int, bool], float] = {}

        def cost(a: int, b: int) -> float:  # a pair's cost depends on its local ranks and whether nodes differ
            key = (topo.local_rank_of(a), topo.local_rank_of(b), topo.node_of(a) == topo.node_of(b))
            if key not in seen:
                seen[key] = max(topo.route(a, b).cost, topo.route(b, a).cost)
            return seen[key]

        for members in groups.values():
            for i, a in enumerate(members):
                for b in members[i + 1:]:
                    cand.add_edge(a, b, cost=cost(a, b))
        nodes = sorted(groups)
        for x, na in enumerate(nodes):
            for nb in nodes[x + 1:]:
                A, B = groups[na], groups[nb]
                for k in range(max(len(A), len(B))):
                    a, b = A[k % len(A)], B[k % len(B)]
                    if not cand.has_edge(a, b):
                        cand.add_edge(a, b, cost=cost(a, b))
        # deterministic Kruskal: ties broken by CP order
        mst = nx.Graph()
        mst.add_nodes_from(ranks)
        uf = nx.utils.UnionFind(ranks)
        for a, b, c in sorted(cand.edges(data="cost"), key=lambda e: (e[2], min(order[e[0]], order[e[1]]),
                                                                       max(order[e[0]], order[e[1]]))):
            if uf[a] != uf[b]:
                uf.union(a, b)
                mst.add_edge(a, b)
        return [e for a, b in mst.edges for e in ((a, b), (b, a))], {"tree": mst}

    def tree(self, cg, owner, dests, chunk=0):
        return prune_bfs(cg.meta["tree"], owner, dests)

    def edge_loads(self, cg, owner, need, tokens):
        """:meth:`tree`'s paths on the spanning tree: removing tree edge ``(p, v)`` splits off
        ``v``'s subtree, and a block crosses ``p -> v`` when its owner is outside the subtree and a
        reader inside, ``v -> p`` when the owner is inside and a reader outside. Matrix work of
        ``cp**2 * blocks``; None above :data:`TREE_LOADS_MAX` of it (the floor is not tightened)."""
        if not self._own_tree(SpanningGraph, "tree", "tree_with_depths", "tree_runs", "tree_columns"):
            return None
        ranks = cg.ranks
        cp = len(ranks)
        if cp < 2 or cp * cp * need.shape[1] > TREE_LOADS_MAX:
            return None
        pos = {r: i for i, r in enumerate(ranks)}
        parent = {ranks[0]: None}
        order = [ranks[0]]
        for u in order:                                  # BFS from CP rank 0: parents, then subtrees
            for v in sorted(cg.meta["tree"][u]):
                if v not in parent:
                    parent[v] = u
                    order.append(v)
        inside = np.zeros((cp, cp), dtype=bool)          # [v, rank]: rank in v's subtree
        for v in reversed(order):
            inside[pos[v], pos[v]] = True
            if parent[v] is not None:
                inside[pos[parent[v]]] |= inside[pos[v]]
        child = np.array([pos[v] for v in order[1:]], dtype=np.int64)          # [cp - 1]: tree edges
        par = np.array([pos[parent[v]] for v in order[1:]], dtype=np.int64)
        sub = inside[child]                                                    # [cp - 1, cp]
        readers_in = sub.astype(np.float64) @ need.astype(np.float64)          # [cp - 1, blocks]
        owner_in = sub[:, owner]                                               # [cp - 1, blocks]
        down = (~owner_in & (readers_in > 0)) @ tokens                         # [cp - 1]: p -> v
        up = (owner_in & (readers_in < need.sum(axis=0))) @ tokens             # [cp - 1]: v -> p
        src, dst, load = np.concatenate([par, child]), np.concatenate([child, par]), np.concatenate([down, up])
        used = load > 0
        return src[used], dst[used], load[used]


@jit
def _farthest_reader(need, owner, cp):
    """``[blocks]``: the most ring hops downstream of its owner (``(j - owner) mod cp``) at which a
    reader of each block sits (``need[j, b]``), 0 for none; one pass over ``need``."""
    last = np.zeros(need.shape[1], dtype=np.int64)
    for j in range(need.shape[0]):
        for b in range(need.shape[1]):
            if need[j, b]:
                d = (j - owner[b]) % cp
                if d > last[b]:
                    last[b] = d
    return last


TREE_LOADS_MAX = 2 ** 25
"""The most matrix work (``cp**2 * blocks``) :meth:`SpanningGraph.edge_loads` does; above it the
graph's floor is the need-set floor alone (at cp = 256, 512 documents the generic floor already
puts ``spanning`` out)."""


BUILDERS: dict[str, Callable[..., GraphBuilder]] = {
    "ring": RingGraph,
    "full": FullGraph,
    "hierarchical": HierarchicalGraph,
    "leader": LeaderGraph,
    "spanning": SpanningGraph,
    "balanced": BalancedGraph,
    "entry": EntryGraph,
    "stripe": StripeGraph,
}
"""The registry: graph name -> builder class. Everything else that names graphs derives from it."""

AUTO_CANDIDATES: tuple[str, ...] = tuple(n for n, b in BUILDERS.items() if not b.needs_kv_sizes and b.zigzag_auto)
"""Builders ``auto`` compiles and compares (a builder that needs KV sizes cannot run without them)."""

PACKED_AUTO_CANDIDATES: tuple[str, ...] = tuple(n for n, b in BUILDERS.items()
                                                if not b.needs_kv_sizes and b.packed_auto)
"""Builders ``auto`` compares for a packed batch (a plan over a placement): adds ``entry``."""

GRAPH_CHOICES: tuple[str, ...] = ("auto", *(n for n, b in BUILDERS.items() if not b.needs_kv_sizes))
"""What a user may ask for by name (``--fcp-graph``, ``FCPConfig.graph``, the CLI's ``--graph``)."""


def get_builder(name: "str | GraphBuilder", **kwargs) -> GraphBuilder:
    """Builder instance for ``name`` (kwargs go to its constructor, e.g. ``kv_sizes`` for balanced)."""
    if isinstance(name, GraphBuilder):
        return name
    if name not in BUILDERS:
        raise ValueError(f"graph: unknown builder {name!r}; choose one of {', '.join(GRAPH_CHOICES)}")
    return BUILDERS[name](**kwargs)


def build_graph(topology: Topology, cp_ranks: Sequence[int], graph: "str | GraphBuilder" = "hierarchical") -> CommGraph:
    """``get_builder(graph).build(topology, cp_ranks)``."""
    if graph == "auto":
        raise ValueError("graph: 'auto' chooses among plans; use megatron_fcp.planning.build_plan(..., graph='auto')")
    return get_builder(graph).build(topology, cp_ranks)
