"""Communication graphs over one CP group, and the registry of strategies that build them.

A :class:`CommGraph` is a directed graph (``networkx.DiGraph``) whose vertices are exactly the CP
group's **global** ranks and whose edges are the point-to-point channels a plan may use, each with
``cost`` (seconds for one ``REF_BYTES`` message on an idle route), ``bandwidth`` (bytes/s) and
``kind`` (bottleneck link kind) taken from the :class:`~megatron_fcp.topology.model.Topology`.

A builder is a strategy object (``name``, ``build(topology, cp_ranks) -> CommGraph``). Besides the
edges it knows the *multicast tree* that carries one block from its owner to the ranks that need it
inside its graph (``tree(cg, owner, dests)``), because the good tree is structural: on a
rail-striped graph a block crosses to another node once, on its owner's rail, and fans out there.
Graphs without a builder tree use a generic Steiner heuristic (:func:`steiner_tree`).

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

Every NIC then carries exactly its own GPU's blocks once per remote node; the ``leader`` graph
instead funnels a whole node through one rank, which is only right when the node has one uplink.

Megatron rank order (``tp-cp-ep-dp-pp``) makes CP peers strided by TP; :func:`megatron_cp_groups`
reproduces ``parallel_state``'s CP groups so callers can pass real rank lists.
"""

from __future__ import annotations

import heapq
from itertools import chain
from typing import Callable, Iterable, Mapping, Sequence

import networkx as nx
import numpy as np

from megatron_fcp.topology.model import Topology, TopologyError

__all__ = [
    "CommGraph",
    "GraphBuilder",
    "RingGraph",
    "FullGraph",
    "HierarchicalGraph",
    "LeaderGraph",
    "SpanningGraph",
    "BalancedGraph",
    "BUILDERS",
    "GRAPH_NAMES",
    "get_builder",
    "build_graph",
    "steiner_tree",
    "check_cp_ranks",
    "megatron_cp_groups",
]

TreeEdges = list[tuple[int, int]]
"""Multicast tree as ``(parent, child)`` edges, every parent listed before its children's edges."""


class CommGraph:
    """A builder's graph over the CP group ``ranks`` (global ranks in CP order).

    Builders hand over their edges as a list (``edges``, in insertion order, self-loops and
    repeats dropped); the networkx graph (``graph``, edge attributes from the topology) is built
    on first use, since compiling a plan only needs the builder's trees: a 1,024-rank rail graph
    has ~137K edges that a plain compile never looks up. A CommGraph can also wrap a ready
    ``nx.DiGraph``.
    """

    def __init__(
        self,
        name: str,
        ranks: tuple[int, ...],
        graph: nx.DiGraph | None = None,
        topology: Topology | None = None,
        builder: "GraphBuilder | None" = None,
        pipeline_parts: bool = True,
        meta: dict | None = None,
        *,
        edges: Iterable[tuple[int, int]] | None = None,
    ):
        if (graph is None) == (edges is None):
            raise ValueError(f"graph {name!r}: give exactly one of graph= (networkx) or edges= (a list)")
        self.name = name
        self.ranks = tuple(ranks)
        self.topology = topology
        self.builder = builder
        self.pipeline_parts = pipeline_parts
        """Whether sub-blocks of one chunk are staggered over rounds (pipelining relays)."""
        self.meta = meta if meta is not None else {}
        self._graph = graph
        self._edges = None if edges is None else list(dict.fromkeys((a, b) for a, b in edges if a != b))

    @property
    def edges(self) -> list[tuple[int, int]]:
        """Directed edges ``(a, b)`` in insertion order."""
        if self._edges is None:
            self._edges = list(self._graph.edges)
        return self._edges

    @property
    def graph(self) -> nx.DiGraph:
        """The networkx graph: vertices = ``ranks``, edges carry ``cost``, ``bandwidth``, ``kind``."""
        if self._graph is None:
            g = nx.DiGraph()
            g.add_nodes_from(self.ranks)
            g.add_edges_from((a, b, _edge_attrs(self.topology, a, b)) for a, b in self._edges)
            self._graph = g
        return self._graph

    def __repr__(self) -> str:
        return f"CommGraph({self.name!r}, cp={len(self.ranks)}, edges={len(self.edges)})"

    def tree(self, owner: int, dests: Sequence[int], chunk: int = 0) -> TreeEdges:
        """Multicast tree from ``owner`` to ``dests`` (for the owner's zigzag ``chunk``) using only
        this graph's edges."""
        if not dests:
            return []
        if self.builder is not None:
            return self.builder.tree(self, owner, dests, chunk)
        return steiner_tree(self.graph, owner, dests)

    def tree_with_depths(self, owner: int, dests: Sequence[int], chunk: int = 0) -> tuple[TreeEdges, list[int]]:
        """:meth:`tree` plus the depth (hops from the owner) of each edge's receiver."""
        if not dests:
            return [], []
        if self.builder is not None:
            return self.builder.tree_with_depths(self, owner, dests, chunk)
        edges = steiner_tree(self.graph, owner, dests)
        return edges, _depths_of(edges, owner)

    def tree_runs(self, owner: int, dests: Sequence[int], chunk: int = 0):
        """The tree as runs ``(depth, srcs, dsts)`` of equal depth, shallowest first."""
        if not dests:
            return []
        if self.builder is not None:
            return self.builder.tree_runs(self, owner, dests, chunk)
        edges = steiner_tree(self.graph, owner, dests)
        return runs_of(edges, _depths_of(edges, owner))

    def edge_list(self) -> list[tuple[int, int]]:
        return sorted(self.edges)

    def check_connected(self) -> "CommGraph":
        """Raise ValueError naming two ranks if some rank cannot reach another.

        Algorithm: vertices must be exactly ``ranks``; then a breadth-first search from
        ``ranks[0]`` along the edges and one against them (:func:`_unreached`) must reach every
        rank (strong connectivity). Errors name the smallest rank ``ranks[0]`` cannot reach, else
        the first rank in CP order that cannot reach ``ranks[0]``.
        """
        ranks, edges = self.ranks, self.edges
        vertices = set(self._graph.nodes) if self._graph is not None else set(chain(ranks, chain.from_iterable(edges)))
        if vertices != set(ranks):
            extra = sorted(vertices - set(ranks))
            missing = sorted(set(ranks) - vertices)
            raise ValueError(f"graph {self.name!r}: vertices must be the CP group; extra {extra}, missing {missing}")
        if len(ranks) < 2:
            return self
        r = np.asarray(ranks, dtype=np.int64)
        order = np.argsort(r)
        flat = np.fromiter(chain.from_iterable(edges), dtype=np.int64, count=2 * len(edges))
        ends = order[np.searchsorted(r[order], flat)].reshape(-1, 2)  # CP index of both ends
        lost = _unreached(len(ranks), ends[:, 0], ends[:, 1])
        if lost.any():
            first = min(ranks[i] for i in np.nonzero(lost)[0])
            raise ValueError(f"graph {self.name!r} is disconnected: rank {ranks[0]} cannot reach rank {first}")
        lost = _unreached(len(ranks), ends[:, 1], ends[:, 0])
        if lost.any():
            r = ranks[int(np.argmax(lost))]
            raise ValueError(f"graph {self.name!r} is disconnected: rank {r} cannot reach rank {ranks[0]}")
        return self

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for _, _, k in self.graph.edges(data="kind"):
            kinds[k] = kinds.get(k, 0) + 1
        out_deg = [d for _, d in self.graph.out_degree()]
        return (
            f"graph {self.name!r}: {len(self.ranks)} ranks, {self.graph.number_of_edges()} directed edges "
            f"({', '.join(f'{v} {k}' for k, v in sorted(kinds.items()))}), out-degree "
            f"{min(out_deg, default=0)}..{max(out_deg, default=0)}"
        )


def check_cp_ranks(topology: Topology | None, cp_ranks: Iterable[int]) -> tuple[int, ...]:
    """Validate a CP group: non-empty, distinct integers, all inside the topology."""
    try:
        ranks = tuple(cp_ranks)
    except TypeError:
        raise ValueError(f"cp_ranks: expected a list of global ranks, got {cp_ranks!r}") from None
    if not ranks:
        raise ValueError("cp_ranks: the CP group is empty")
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool):
            raise ValueError(f"cp_ranks: rank {r!r} is not an integer")
    if len(set(ranks)) != len(ranks):
        dup = next(r for r in ranks if ranks.count(r) > 1)
        raise ValueError(f"cp_ranks: rank {dup} appears twice in {list(ranks)}")
    if topology is not None:
        bad = [r for r in ranks if not 0 <= r < topology.world]
        if bad:
            raise TopologyError(
                f"cp_ranks: rank {bad[0]} is missing from topology {topology.name!r} (world size {topology.world})"
            )
    return ranks


def _unreached(n: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Mask of vertices ``0..n-1`` that vertex 0 cannot reach along edges ``src[i] -> dst[i]``.

    Algorithm: breadth-first search by levels, each level one vectorised pass over all edges
    (levels <= diameter: 2-3 for rail graphs, ``n`` for a ring).
    """
    reached = np.zeros(n, dtype=bool)
    reached[0] = True
    frontier = reached.copy()
    while frontier.any():
        nxt = np.zeros(n, dtype=bool)
        nxt[dst[frontier[src]]] = True
        frontier = nxt & ~reached
        reached |= frontier
    return ~reached


def _edge_attrs(topo: Topology | None, a: int, b: int) -> dict:
    """Edge attributes from the route; cached per (same node, local a, local b) since every node
    shares one layout (a 1,024-rank rail graph has ~130K edges but ~130 distinct routes)."""
    if topo is None:
        return {"cost": 1.0, "bandwidth": 1.0, "kind": "loopback"}
    (na, la), (nb, lb) = topo.rank_map[a], topo.rank_map[b]
    key = ("edge-attrs", na == nb, la, lb)
    attrs = topo._cache.get(key)
    if attrs is None:
        route = topo.route(a, b)
        attrs = {"cost": route.cost, "bandwidth": route.bandwidth, "kind": route.kind}
        topo._cache[key] = attrs
    return attrs


def _node_groups(topo: Topology, ranks: Sequence[int]) -> dict[int, list[int]]:
    """CP ranks per node, each list sorted by local rank (the rail order)."""
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(topo.node_of(r), []).append(r)
    for lst in groups.values():
        lst.sort(key=topo.local_rank_of)
    return groups


class GraphBuilder:
    """Strategy interface: ``build`` a CommGraph and give each block's multicast ``tree``."""

    name = "base"
    pipeline_parts = True

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
        return edges, _depths_of(edges, owner)

    def tree_runs(self, cg: CommGraph, owner: int, dests: Sequence[int], chunk: int = 0):
        """``(depth, srcs, dsts)`` runs of the tree; builders may override to skip edge tuples."""
        return runs_of(*self.tree_with_depths(cg, owner, dests, chunk))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RingGraph(GraphBuilder):
    """Megatron/TE ring: CP rank i -> CP rank i+1. A block travels the ring until its last reader."""

    name = "ring"
    pipeline_parts = False  # TE sends a rank's whole KV every step

    def _edges(self, topo, ranks):
        return [(r, ranks[(i + 1) % len(ranks)]) for i, r in enumerate(ranks)], {}

    def tree(self, cg, owner, dests, chunk=0):
        ranks, cp = cg.ranks, len(cg.ranks)
        i = ranks.index(owner)
        want = set(dests)
        last = max(((ranks.index(d) - i) % cp for d in want), default=0)
        return [(ranks[(i + h) % cp], ranks[(i + h + 1) % cp]) for h in range(last)]


class FullGraph(GraphBuilder):
    """Every ordered pair is an edge; each block goes straight from its owner to every reader."""

    name = "full"

    def _edges(self, topo, ranks):
        return [(a, b) for a in ranks for b in ranks if a != b], {}

    def tree(self, cg, owner, dests, chunk=0):
        return [(owner, d) for d in dests]

    def tree_with_depths(self, cg, owner, dests, chunk=0):
        return [(owner, d) for d in dests], [1] * len(dests)

    def tree_runs(self, cg, owner, dests, chunk=0):
        return [(1, [owner] * len(dests), list(dests))]


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
        self.relay = [start_of + p % size_of for p in range(int(sizes.max()))]
        self.is_relay = [relay == np.arange(n) for relay in self.relay]

    def positions(self, ranks: Sequence[int]) -> np.ndarray:
        """Flat positions of ``ranks`` (all members of the group)."""
        return self._sorted_pos[np.searchsorted(self._sorted, np.asarray(ranks, dtype=np.int64))]


class HierarchicalGraph(GraphBuilder):
    """Rail-striped: full mesh inside a node, rail peers across nodes; see Note [Rail striping]."""

    name = "hierarchical"

    def _edges(self, topo, ranks):
        groups = _node_groups(topo, ranks)
        edges = [(a, b) for members in groups.values() for a in members for b in members if a != b]
        pos = {r: k for members in groups.values() for k, r in enumerate(members)}
        node_of = {r: topo.node_of(r) for r in ranks}
        for a in ranks:
            for node, members in groups.items():
                if node != node_of[a]:
                    edges.append((a, members[pos[a] % len(members)]))
        return edges, {"groups": groups, "pos": pos, "node_of": node_of, "rails": _RailLayout(groups)}

    def _exit(self, cg: CommGraph, owner: int, chunk: int) -> int:
        """Rank of the owner's node whose rail carries the owner's ``chunk`` off the node."""
        return owner

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
        relay, is_relay = lay.relay[rail], lay.is_relay[rail]
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
        for node, members in groups.items():
            if node == home:
                first.extend([(owner, d) for d in members if d != owner and (everyone or d in want)])
                continue
            readers = members if everyone else [d for d in members if d in want]
            if not readers:
                continue
            relays_needed = True
            relay = members[meta["pos"][exit_rank] % len(members)]
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
        edges = _parents_first(first + second, owner)
        return edges, _depths_of(edges, owner)


class BalancedGraph(HierarchicalGraph):
    """Rail-striped, but each owner's blocks leave the node on the rail with the least KV load.

    ``kv_sizes`` maps global rank -> relative KV size (uneven sequence lengths, e.g. packed THD
    batches). Every zigzag chunk starts on its owner's rail; then, while it lowers the busiest rail,
    the largest chunk that fits moves from the busiest rail of a node to its least-loaded one (a
    chunk leaving on another rail first crosses NVLink to that rail's GPU). No NIC then carries
    much more than ``total / rails`` bytes, and with equal sizes nothing moves: exactly
    ``hierarchical``.
    """

    name = "balanced"

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
        return cg.meta["exits"][(owner, chunk)]


class LeaderGraph(GraphBuilder):
    """One leader per node (its first CP rank): full mesh inside nodes, leaders fully connected.

    A block leaves its node through the node's leader and enters each other node through that
    node's leader. Right only where a node has one uplink (``single-uplink``, ``pcie-box``).
    """

    name = "leader"

    def _edges(self, topo, ranks):
        groups = {}
        for r in ranks:
            groups.setdefault(topo.node_of(r), []).append(r)  # CP order: leader = first CP rank
        edges = [(a, b) for members in groups.values() for a in members for b in members]
        leaders = {n: m[0] for n, m in groups.items()}
        edges += [(a, b) for a in leaders.values() for b in leaders.values()]
        return edges, {"leaders": leaders}

    def tree(self, cg, owner, dests, chunk=0):
        topo = cg.topology
        leaders = cg.meta["leaders"]
        home = topo.node_of(owner)
        by_node: dict[int, list[int]] = {}
        for d in dests:
            by_node.setdefault(topo.node_of(d), []).append(d)
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
        return _parents_first(edges, owner)


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
        for members in groups.values():
            for i, a in enumerate(members):
                for b in members[i + 1:]:
                    cand.add_edge(a, b, cost=max(topo.route(a, b).cost, topo.route(b, a).cost))
        nodes = sorted(groups)
        for x, na in enumerate(nodes):
            for nb in nodes[x + 1:]:
                A, B = groups[na], groups[nb]
                for k in range(max(len(A), len(B))):
                    a, b = A[k % len(A)], B[k % len(B)]
                    if not cand.has_edge(a, b):
                        cand.add_edge(a, b, cost=max(topo.route(a, b).cost, topo.route(b, a).cost))
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
        return _prune_bfs(cg.meta["tree"], owner, dests)


def _prune_bfs(adj_graph, owner: int, dests: Sequence[int]) -> TreeEdges:
    """BFS tree of ``adj_graph`` from ``owner`` keeping only branches that reach a dest."""
    parent = {owner: None}
    order = [owner]
    for u in order:
        for v in sorted(adj_graph[u]):
            if v not in parent:
                parent[v] = u
                order.append(v)
    keep = set()
    for d in dests:
        if d not in parent:
            raise ValueError(f"rank {d} is unreachable from rank {owner} in the graph")
        while d is not None and d not in keep:
            keep.add(d)
            d = parent[d]
    return [(parent[v], v) for v in order if v in keep and v != owner]


def runs_of(edges: TreeEdges, depths: list[int]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Split a BFS-ordered tree (non-decreasing depths) into runs ``(depth, srcs, dsts)``."""
    runs = []
    start = 0
    for i in range(1, len(depths) + 1):
        if i == len(depths) or depths[i] != depths[start]:
            us, vs = zip(*edges[start:i])
            runs.append((depths[start], us, vs))
            start = i
    return runs


def _depths_of(edges: TreeEdges, owner: int) -> list[int]:
    depth = {owner: 0}
    out = []
    for u, v in edges:
        d = depth[u] + 1
        depth[v] = d
        out.append(d)
    return out


def _parents_first(edges: TreeEdges, root: int) -> TreeEdges:
    """Order tree edges so every parent's incoming edge precedes its outgoing ones (BFS order)."""
    children: dict[int, list[int]] = {}
    for a, b in edges:
        children.setdefault(a, []).append(b)
    out, frontier = [], [root]
    while frontier:
        nxt = []
        for u in frontier:
            for v in children.get(u, ()):
                out.append((u, v))
                nxt.append(v)
        frontier = nxt
    if len(out) != len(edges):
        raise AssertionError(f"multicast edges do not form a tree rooted at {root}: {edges}")
    return out


def steiner_tree(graph: nx.DiGraph, owner: int, dests: Sequence[int], weight: str = "cost") -> TreeEdges:
    """Shortest-path heuristic for a directed Steiner tree (Takahashi–Matsuyama).

    Start from ``{owner}``; repeatedly run a multi-source Dijkstra from the current tree (tree
    vertices at distance 0) and attach the nearest remaining dest by its shortest path. Relays
    appear only where the graph has no direct edge. At most 2x the optimal tree cost.
    """
    in_tree = {owner}
    remaining = set(dests) - in_tree
    edges: TreeEdges = []
    while remaining:
        dist = {v: 0.0 for v in in_tree}
        prev: dict[int, int] = {}
        heap = [(0.0, v) for v in sorted(in_tree)]
        heapq.heapify(heap)
        found = None
        done = set()
        while heap:
            d, u = heapq.heappop(heap)
            if u in done:
                continue
            done.add(u)
            if u in remaining:
                found = u
                break
            for v in sorted(graph.successors(u)):
                nd = d + graph[u][v].get(weight, 1.0)
                if v not in in_tree and (v not in dist or nd < dist[v]):
                    dist[v] = nd
                    prev[v] = u
                    heapq.heappush(heap, (nd, v))
        if found is None:
            raise ValueError(f"rank {min(remaining)} is unreachable from rank {owner} in the graph")
        path = [found]
        while path[-1] not in in_tree:
            path.append(prev[path[-1]])
        path.reverse()
        for a, b in zip(path, path[1:]):
            edges.append((a, b))
            in_tree.add(b)
            remaining.discard(b)
    return _parents_first(edges, owner)


BUILDERS: dict[str, Callable[[], GraphBuilder]] = {
    "ring": RingGraph,
    "full": FullGraph,
    "hierarchical": HierarchicalGraph,
    "leader": LeaderGraph,
    "spanning": SpanningGraph,
    "balanced": BalancedGraph,
}
"""Registry: graph name -> builder factory. ``auto`` (in :mod:`megatron_fcp.planner`) picks among these."""

GRAPH_NAMES = (*BUILDERS, "auto")


def get_builder(name: "str | GraphBuilder", **kwargs) -> GraphBuilder:
    """Builder instance for ``name`` (kwargs go to its constructor, e.g. ``kv_sizes`` for balanced)."""
    if isinstance(name, GraphBuilder):
        return name
    if name not in BUILDERS:
        raise ValueError(f"graph: unknown builder {name!r}; choose one of {', '.join(GRAPH_NAMES)}")
    return BUILDERS[name](**kwargs)


def build_graph(topology: Topology, cp_ranks: Sequence[int], graph: "str | GraphBuilder" = "hierarchical") -> CommGraph:
    """``get_builder(graph).build(topology, cp_ranks)``."""
    if graph == "auto":
        raise ValueError("graph: 'auto' chooses among plans; use megatron_fcp.plan.build_plan(..., graph='auto')")
    return get_builder(graph).build(topology, cp_ranks)


def megatron_cp_groups(world: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> list[list[int]]:
    """CP groups of Megatron's ``parallel_state`` for order ``tp-cp-ep-dp-pp``.

    Rank ``r`` decomposes as ``r = tp_i + tp*(cp_i + cp*(dp_i + dp*pp_i))`` (``ep`` only splits
    the data-parallel extent for MoE layers and does not change attention's CP groups); a CP group
    fixes ``(tp_i, dp_i, pp_i)`` and varies ``cp_i``, so its members are strided by ``tp``.
    Groups are listed as parallel_state creates them (by ``pp_i``, then ``dp_i``, then ``tp_i``).
    """
    for name, v in (("world", world), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be a positive integer, got {v!r}")
    if world % (tp * pp * cp):
        raise ValueError(f"world: {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    dp = world // (tp * pp * cp)
    groups = []
    for pp_i in range(pp):
        for dp_i in range(dp):
            for tp_i in range(tp):
                groups.append([tp_i + tp * (cp_i + cp * (dp_i + dp * pp_i)) for cp_i in range(cp)])
    return groups
