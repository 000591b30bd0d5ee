"""Communication graphs over one CP group, and multicast trees inside them.

A :class:`CommGraph` is a directed graph (``networkx.DiGraph``) whose vertices are exactly the CP
group's **global** ranks and whose edges are the point-to-point channels a plan may use, each with
``cost`` (seconds for one ``REF_BYTES`` message on an idle route), ``bandwidth`` (bytes/s) and
``kind`` (bottleneck link kind) taken from the :class:`~megatron_fcp.topology.Topology`.

The strategies that build graphs, and know each block's multicast tree inside them, live in
:mod:`megatron_fcp.planner.builders`; graphs without a builder tree use the generic Steiner
heuristic here (:func:`steiner_tree`).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Iterable, Sequence

import networkx as nx
import numpy as np

from megatron_fcp.contract.blocks import cp_index_of
from megatron_fcp.jit import isin_ints
from megatron_fcp.planner.tree_columns import Readers, TreeColumns, columns_of
from megatron_fcp.topology import Topology

if TYPE_CHECKING:
    from megatron_fcp.planner.builders import GraphBuilder

__all__ = ["CommGraph", "TreeEdges", "steiner_tree", "runs_of", "depths_of", "parents_first",
           "prune_bfs"]

TreeEdges = list[tuple[int, int]]
"""Multicast tree as ``(parent, child)`` edges, every parent listed before its children's edges."""


class CommGraph:
    """A builder's graph over the CP group ``ranks`` (global ranks in CP order).

    Builders hand over their edges as a list (``edges``, in insertion order, self-loops and
    repeats dropped) or as an integer array ``[E, 2]`` of distinct edges (self-loops dropped; the
    list is then built on first use of :attr:`edges`: an 8,192-rank rail graph has 8.4M edges);
    the networkx graph (``graph``, edge attributes from the topology) is built on first use, since
    compiling a plan only needs the builder's trees: a 1,024-rank rail graph has ~137K edges that a
    plain compile never looks up. A CommGraph can also wrap a ready ``nx.DiGraph``.
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
        self._edge_array = None
        self._edge_set: set[tuple[int, int]] | None = None
        if isinstance(edges, np.ndarray):
            arr = np.asarray(edges).reshape(-1, 2)
            if arr.dtype.kind not in "iu":
                raise ValueError(f"graph {name!r}: an edge array must hold integers, got {arr.dtype}")
            loops = arr[:, 0] == arr[:, 1]
            self._edge_array, self._edges = (arr[~loops] if loops.any() else arr), None
        else:
            self._edges = None if edges is None else list(dict.fromkeys((a, b) for a, b in edges if a != b))

    @property
    def edges(self) -> list[tuple[int, int]]:
        """Directed edges ``(a, b)`` in insertion order."""
        if self._edges is None:
            if self._edge_array is not None:
                self._edges = list(map(tuple, self._edge_array.tolist()))
            else:
                self._edges = list(self._graph.edges)
        return self._edges

    def edge_array(self) -> np.ndarray:
        """The edges as an integer ``[E, 2]`` array (insertion order)."""
        if self._edge_array is None:
            self._edge_array = np.array(self.edges, dtype=np.int64).reshape(-1, 2)
        return self._edge_array

    def num_edges(self) -> int:
        return len(self._edge_array) if self._edge_array is not None else len(self.edges)

    @property
    def graph(self) -> nx.DiGraph:
        """The networkx graph: vertices = ``ranks``, edges carry ``cost``, ``bandwidth``, ``kind``."""
        if self._graph is None:
            g = nx.DiGraph()
            g.add_nodes_from(self.ranks)
            g.add_edges_from((a, b, _edge_attrs(self.topology, a, b)) for a, b in self.edges)
            self._graph = g
        return self._graph

    def has_edge(self, a: int, b: int) -> bool:
        """Whether ``a -> b`` is an edge (a set of the edges; the networkx graph is not built for it)."""
        if self._graph is not None:
            return self._graph.has_edge(a, b)
        if self._edge_set is None:
            self._edge_set = set(self.edges)
        return (a, b) in self._edge_set

    def has_edges(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """:meth:`has_edge` of ``src[i] -> dst[i]`` at once (bool ``[pairs]``)."""
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        if self._graph is not None:
            return np.array([self._graph.has_edge(a, b) for a, b in zip(src.tolist(), dst.tolist())], dtype=bool)
        edges = self.edge_array().astype(np.int64)       # may be a small integer type: widen before keys
        span = int(max(src.max(initial=0), dst.max(initial=0), edges.max(initial=0))) + 1
        return isin_ints(src * span + dst, edges[:, 0] * span + edges[:, 1], span * span)

    def bandwidth(self, a: int, b: int) -> float:
        """Edge ``a -> b``'s ``bandwidth`` attribute, as :attr:`graph` holds it (read from the route
        when the graph was given as edges, without building the networkx graph)."""
        if self._graph is not None:
            return float(self._graph[a][b].get("bandwidth", 0.0))
        return float(_edge_attrs(self.topology, a, b)["bandwidth"])

    def bandwidths(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """:meth:`bandwidth` of edges ``src[i] -> dst[i]`` at once (float64 ``[edges]``): read from
        the topology's route columns (Note [Route ids] in :mod:`megatron_fcp.topology.route_ids`),
        or edge by edge when the graph wraps a networkx graph or has no topology."""
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        if self._graph is None and self.topology is not None:
            table = self.topology.route_ids()
            rows = table.rows(src, dst)          # first: it may replace the columns read below
            return table.bandwidth[rows]
        return np.array([self.bandwidth(a, b) for a, b in zip(src.tolist(), dst.tolist())], dtype=np.float64)

    def __repr__(self) -> str:
        return f"CommGraph({self.name!r}, cp={len(self.ranks)}, edges={self.num_edges()})"

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
        return edges, depths_of(edges, owner)

    def tree_columns(self, owner: np.ndarray, chunk: np.ndarray, readers: Readers) -> TreeColumns:
        """The trees of blocks ``(owner[t], chunk[t])`` to ``readers`` (each tree's readers non-empty),
        as columns (Note [Trees as columns] in :mod:`megatron_fcp.planner.tree_columns`): the
        edges :meth:`tree_with_depths` gives, tree after tree."""
        if self.builder is not None:
            return self.builder.tree_columns(self, owner, chunk, readers)
        return columns_of(owner.tolist(), chunk.tolist(), readers, self.tree_with_depths)

    def tree_runs(self, owner: int, dests: Sequence[int], chunk: int = 0):
        """The tree as runs ``(depth, srcs, dsts)`` of equal depth, shallowest first."""
        if not dests:
            return []
        if self.builder is not None:
            return self.builder.tree_runs(self, owner, dests, chunk)
        edges = steiner_tree(self.graph, owner, dests)
        return runs_of(edges, depths_of(edges, owner))

    def edge_list(self) -> list[tuple[int, int]]:
        return sorted(self.edges)

    def check_connected(self) -> "CommGraph":
        """Raise ValueError naming two ranks if some rank cannot reach another.

        Algorithm: vertices must be exactly ``ranks``; then a breadth-first search from
        ``ranks[0]`` along the edges and one against them (:func:`_unreached`) must reach every
        rank (strong connectivity). Errors name the smallest rank ``ranks[0]`` cannot reach, else
        the first rank in CP order that cannot reach ``ranks[0]``.
        """
        ranks = self.ranks
        flat = self.edge_array().ravel()
        ends = cp_index_of(ranks)(flat)  # CP index of every end, -1 outside the group
        if self._graph is not None:
            vertices = set(self._graph.nodes)
        else:  # the vertices of an edge list are the ranks and the edges' ends
            vertices = set(ranks) if (ends >= 0).all() else set(ranks) | set(flat[ends < 0].tolist())
        if vertices != set(ranks):
            extra = sorted(vertices - set(ranks))
            missing = sorted(set(ranks) - vertices)
            raise ValueError(f"graph {self.name!r}: vertices must be the CP group; extra {extra}, missing {missing}")
        if len(ranks) < 2:
            return self
        ends = ends.reshape(-1, 2)
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
    """Edge attributes from the route; cached per (same node, same NVLink domain, local a, local b)
    since every node shares one layout (a 1,024-rank rail graph has ~130K edges but ~130 distinct
    routes)."""
    if topo is None:
        return {"cost": 1.0, "bandwidth": 1.0, "kind": "loopback"}
    (na, la), (nb, lb) = topo.rank_map[a], topo.rank_map[b]
    key = ("edge-attrs", na == nb, topo.domain_of(a) == topo.domain_of(b), la, lb)
    attrs = topo._cache.get(key)
    if attrs is None:
        route = topo.route(a, b)
        attrs = {"cost": route.cost, "bandwidth": route.bandwidth, "kind": route.kind}
        topo._cache[key] = attrs
    return attrs


def prune_bfs(adj_graph, owner: int, dests: Sequence[int]) -> TreeEdges:
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


def depths_of(edges: TreeEdges, owner: int) -> list[int]:
    depth = {owner: 0}
    out = []
    for u, v in edges:
        d = depth[u] + 1
        depth[v] = d
        out.append(d)
    return out


def parents_first(edges: TreeEdges, root: int) -> TreeEdges:
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
    return parents_first(edges, owner)
