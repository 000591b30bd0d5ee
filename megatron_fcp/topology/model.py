"""Cluster topology: ranks, nodes, links and the shared resources a message crosses.

Pure data (frozen dataclasses) plus routing; no ``torch`` imports.

Note [Topology model]
---------------------
A cluster is ``nodes`` machines that share one :class:`NodeLayout` (a small undirected device graph)
and a non-blocking network fabric between the machines' NICs. A layout's vertices are GPUs
(``gpu0`` .. ``gpu{g-1}``, one per local rank), NICs (named in ``nics``) and any other names, which
are switches (an NVSwitch plane, a PCIe switch, a CPU root complex ...). Every :class:`Link`
joins two vertices and has a ``kind``, a bandwidth *per direction* (bytes/s) and a latency (s).

Routing (cached per layout, so 1,024-rank clusters route in microseconds per pair):

* same node: the cheapest path between the two GPU vertices, where cost is
  ``latency + REF_BYTES / bandwidth`` summed over links; only switch vertices may be transit
  (never another GPU or a NIC);
* different nodes: source GPU -> its NIC (``gpu_nic``, default: the nearest NIC), the NIC's
  egress wire, the destination NIC's ingress wire, that NIC -> destination GPU.

A message therefore traverses a tuple of :class:`Resource` objects, each one *direction* of one
link or of one NIC wire, named ``n{node}:{u}>{v}`` (``n0:gpu3>nvswitch``) or ``n{node}:{nic}>net``
/ ``n{node}:net>{nic}``. Messages that share a resource share its bandwidth; the simulator models
contention on exactly these names. Examples (``dgx-h100``, rail-aligned, one NIC per GPU)::

    n0 gpu3 -> n0 gpu5 : n0:gpu3>nvswitch, n0:nvswitch>gpu5
    n0 gpu3 -> n1 gpu3 : n0:gpu3>nic3, n0:nic3>net, n1:net>nic3, n1:nic3>gpu3

and on ``single-uplink`` every GPU of a node shares ``n{k}:nic0>net``.

Note [NVLink domains]
---------------------
A *host* (a ``node``: one OS, one ``nvidia-smi``, one rank-map entry) and an *NVLink domain* are
different things on GB200/GB300 NVL72: 18 trays (hosts) of 4 GPUs share one NVLink switch fabric.
``Topology.nvlink_domain`` is the number of consecutive hosts per domain (1: every host is its own
domain, the default; 18 on an NVL72 rack); host ``n`` is in domain ``n // nvlink_domain``. The
layout names its ``domain_switch`` vertex (``nvswitch``), which stands for the whole domain's
non-blocking switch fabric. Two ranks on different hosts of one domain route

    n{src}:gpu{a}>nvswitch, n{dst}:nvswitch>gpu{b}

(each GPU's own NVLink port, shared with its intra-host traffic: the fast tier) and cross no NIC;
ranks in different domains go through the NICs as above (the slow tier). Graph builders group CP
ranks by domain (:meth:`Topology.domain_of`), not by host.

Ranks are global ranks ``0..world-1``; ``rank_map[r] = (node, local_rank)``. The default follows
torchrun: ``node = r // gpus_per_node``, ``local_rank = r % gpus_per_node``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

from megatron_fcp.topology.errors import TopologyError
from megatron_fcp.topology.route_ids import RouteIds
from megatron_fcp.topology.units import GB, parse_bandwidth, parse_latency

__all__ = ["LINK_KINDS", "REF_BYTES", "Link", "Nic", "Resource", "Route", "NodeLayout", "Topology"]

LINK_KINDS = ("nvlink", "nvswitch", "pcie", "ib", "ethernet", "loopback")
"""Valid ``kind`` values of links and NICs."""

REF_BYTES = 4 * 2**20
"""Message size used to rank paths: cost = latency + REF_BYTES / bandwidth (a 4 MiB KV block)."""


def _check_kind(kind: str, field_name: str) -> str:
    if kind not in LINK_KINDS:
        raise TopologyError(f"{field_name}: unknown link kind {kind!r}; expected one of {', '.join(LINK_KINDS)}")
    return kind


# ---- building blocks -------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """An undirected link between vertices ``a`` and ``b`` of a node layout.

    ``bandwidth`` is bytes/s in *each* direction (the two directions are separate resources);
    ``latency`` is seconds per traversal.
    """

    a: str
    b: str
    kind: str
    bandwidth: float
    latency: float = 1e-6

    def __post_init__(self) -> None:
        where = f"link {self.a}-{self.b}"
        _check_kind(self.kind, f"{where}.kind")
        object.__setattr__(self, "bandwidth", parse_bandwidth(self.bandwidth, f"{where}.bandwidth"))
        object.__setattr__(self, "latency", parse_latency(self.latency, f"{where}.latency"))
        if self.a == self.b:
            raise TopologyError(f"{where}: a link must join two different vertices")


@dataclass(frozen=True)
class Nic:
    """A network adapter: vertex ``name`` of the layout plus its wire to the fabric.

    ``bandwidth`` is the wire's bytes/s per direction (egress and ingress are separate resources).
    """

    name: str
    kind: str = "ib"
    bandwidth: float = 50 * GB
    latency: float = 2e-6

    def __post_init__(self) -> None:
        where = f"nic {self.name}"
        _check_kind(self.kind, f"{where}.kind")
        object.__setattr__(self, "bandwidth", parse_bandwidth(self.bandwidth, f"{where}.bandwidth"))
        object.__setattr__(self, "latency", parse_latency(self.latency, f"{where}.latency"))


@dataclass(frozen=True)
class Resource:
    """One direction of a link or NIC wire: the unit of contention. ``name`` is unique per topology."""

    name: str
    kind: str
    bandwidth: float
    latency: float
    node: int


@dataclass(frozen=True)
class Route:
    """The resources a message from ``src`` to ``dst`` traverses, in order."""

    src: int
    dst: int
    resources: tuple[Resource, ...]

    @property
    def latency(self) -> float:
        return sum(r.latency for r in self.resources)

    @property
    def bandwidth(self) -> float:
        """Bottleneck bandwidth (bytes/s) of an otherwise idle route."""
        return min((r.bandwidth for r in self.resources), default=math.inf)

    @property
    def kind(self) -> str:
        """Kind of the bottleneck resource (``loopback`` for an empty route)."""
        if not self.resources:
            return "loopback"
        return min(self.resources, key=lambda r: r.bandwidth).kind

    def time(self, nbytes: float) -> float:
        """Alpha-beta time of one ``nbytes`` message on an idle route (cut-through)."""
        return self.latency + nbytes / self.bandwidth

    @property
    def cost(self) -> float:
        """Ranking cost used by graph builders: time of one ``REF_BYTES`` message."""
        return self.time(REF_BYTES)


def _gpu(i: int) -> str:
    return f"gpu{i}"


@dataclass(frozen=True)
class NodeLayout:
    """One machine: ``gpus`` GPU vertices ``gpu0..``, NICs, links; see Note [Topology model].

    ``gpu_nic[i]`` is the index into ``nics`` that local rank ``i`` uses for inter-node traffic;
    empty means "the nearest NIC" (cheapest path, lowest index on ties). ``domain_switch`` names
    the switch vertex that spans an NVLink domain of several hosts (Note [NVLink domains]); empty
    when the host is its own domain.
    """

    gpus: int
    links: tuple[Link, ...]
    nics: tuple[Nic, ...] = ()
    gpu_nic: tuple[int, ...] = ()
    name: str = ""
    domain_switch: str = ""
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "nics", tuple(self.nics))
        object.__setattr__(self, "gpu_nic", tuple(int(i) for i in self.gpu_nic))
        self._validate()
        if not self.gpu_nic and self.nics:
            object.__setattr__(self, "gpu_nic", tuple(self._nearest_nic(i) for i in range(self.gpus)))

    # ---- validation -----------------------------------------------------------------------
    def _validate(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise TopologyError(f"node.gpus: must be an integer >= 1, got {self.gpus!r}")
        nic_names = [n.name for n in self.nics]
        if len(set(nic_names)) != len(nic_names):
            raise TopologyError(f"node.nics: NIC names repeat: {nic_names}")
        gpu_names = {_gpu(i) for i in range(self.gpus)}
        for n in nic_names:
            if n in gpu_names or n.startswith("gpu"):
                raise TopologyError(f"node.nics: NIC name {n!r} clashes with GPU vertex names gpu0..")
        seen = set()
        for ln in self.links:
            for v in (ln.a, ln.b):
                if v.startswith("gpu") and v not in gpu_names:
                    raise TopologyError(
                        f"node.links: link {ln.a}-{ln.b} names {v!r} but the node has gpus gpu0..gpu{self.gpus - 1}"
                    )
            key = frozenset((ln.a, ln.b))
            if key in seen:
                raise TopologyError(f"node.links: link {ln.a}-{ln.b} is listed twice")
            seen.add(key)
        linked = {v for ln in self.links for v in (ln.a, ln.b)}
        for n in nic_names:
            if n not in linked:
                raise TopologyError(f"node.nics: NIC {n!r} is not attached by any link")
        if self.gpu_nic:
            if len(self.gpu_nic) != self.gpus:
                raise TopologyError(
                    f"node.gpu_nic: needs one NIC index per GPU ({self.gpus}), got {len(self.gpu_nic)}"
                )
            for i, k in enumerate(self.gpu_nic):
                if not 0 <= k < len(self.nics):
                    raise TopologyError(f"node.gpu_nic[{i}]: NIC index {k} out of range 0..{len(self.nics) - 1}")
        if self.domain_switch:
            if self.domain_switch not in linked or not self._is_transit(self.domain_switch):
                raise TopologyError(f"node.domain_switch: {self.domain_switch!r} must be a switch vertex of node.links")
            for i in range(self.gpus):
                if self._path(_gpu(i), self.domain_switch) is None:
                    raise TopologyError(f"node.domain_switch: gpu{i} cannot reach {self.domain_switch!r}")
        for i in range(1, self.gpus):
            if self._path(_gpu(0), _gpu(i)) is None:
                raise TopologyError(f"node.links: gpu{i} is not connected to gpu0 (the node graph is disconnected)")
        for i in range(self.gpus):
            for k, nic in enumerate(self.nics):
                if (not self.gpu_nic or self.gpu_nic[i] == k) and self._path(_gpu(i), nic.name) is None:
                    raise TopologyError(f"node.links: gpu{i} cannot reach NIC {nic.name!r}")

    # ---- routing --------------------------------------------------------------------------
    def _adjacency(self) -> dict[str, list[Link]]:
        adj = self._cache.get("adj")
        if adj is None:
            adj = {}
            for ln in self.links:
                adj.setdefault(ln.a, []).append(ln)
                adj.setdefault(ln.b, []).append(ln)
            self._cache["adj"] = adj
        return adj

    def _is_transit(self, v: str) -> bool:
        return not v.startswith("gpu") and v not in {n.name for n in self.nics}

    def _path(self, src: str, dst: str) -> tuple[tuple[str, str, Link], ...] | None:
        """Cheapest vertex path ``src -> dst`` as directed hops ``(u, v, link)``; None if unreachable.

        Dijkstra over the (tiny) node graph; only switch vertices are transit. Ties break on the
        lexicographically smallest vertex sequence so routes are deterministic.
        """
        key = ("path", src, dst)
        if key in self._cache:
            return self._cache[key]
        import heapq

        adj = self._adjacency()
        best: dict[str, tuple[float, tuple[str, ...]]] = {src: (0.0, (src,))}
        heap = [(0.0, (src,), src, ())]
        result = None
        done = set()
        while heap:
            cost, seq, u, hops = heapq.heappop(heap)
            if u in done:
                continue
            done.add(u)
            if u == dst:
                result = hops
                break
            if u != src and not self._is_transit(u):
                continue
            for ln in adj.get(u, ()):
                v = ln.b if ln.a == u else ln.a
                if v in done:
                    continue
                c = cost + ln.latency + REF_BYTES / ln.bandwidth
                nseq = seq + (v,)
                if v not in best or (c, nseq) < best[v]:
                    best[v] = (c, nseq)
                    heapq.heappush(heap, (c, nseq, v, hops + ((u, v, ln),)))
        self._cache[key] = result
        return result

    def _nearest_nic(self, gpu: int) -> int:
        def cost(k: int) -> float:
            p = self._path(_gpu(gpu), self.nics[k].name)
            return math.inf if p is None else sum(h[2].latency + REF_BYTES / h[2].bandwidth for h in p)

        return min(range(len(self.nics)), key=lambda k: (cost(k), k))

    def gpu_path(self, a: int, b: int) -> tuple[tuple[str, str, Link], ...]:
        """Directed hops from local GPU ``a`` to local GPU ``b`` (empty when ``a == b``)."""
        if a == b:
            return ()
        return self._path(_gpu(a), _gpu(b))

    def switch_path(self, gpu: int, inbound: bool = False) -> tuple[tuple[str, str, Link], ...]:
        """Directed hops GPU -> the domain switch (or back when ``inbound``); Note [NVLink domains]."""
        sw = self.domain_switch
        return self._path(sw, _gpu(gpu)) if inbound else self._path(_gpu(gpu), sw)

    def nic_path(self, gpu: int, inbound: bool = False) -> tuple[tuple[str, str, Link], ...]:
        """Directed hops GPU -> its NIC (or NIC -> GPU when ``inbound``)."""
        nic = self.nics[self.gpu_nic[gpu]].name
        return self._path(nic, _gpu(gpu)) if inbound else self._path(_gpu(gpu), nic)


@dataclass(frozen=True)
class Topology:
    """A cluster: ``nodes`` copies of ``layout``, a non-blocking fabric, and a rank map.

    ``rank_map[r] = (node, local_rank)`` for global rank ``r``; default torchrun order. Use
    :meth:`route` for the resources between two ranks (cached). ``nvlink_domain`` is the number of
    consecutive hosts per NVLink domain (Note [NVLink domains]).
    """

    name: str
    layout: NodeLayout
    nodes: int = 1
    rank_map: tuple[tuple[int, int], ...] = ()
    fabric_latency: float = 1e-6
    nvlink_domain: int = 1
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or isinstance(self.nodes, bool) or self.nodes < 1:
            raise TopologyError(f"nodes: must be an integer >= 1, got {self.nodes!r}")
        if not isinstance(self.nvlink_domain, int) or isinstance(self.nvlink_domain, bool) or self.nvlink_domain < 1:
            raise TopologyError(f"nvlink_domain: hosts per NVLink domain must be an integer >= 1, got {self.nvlink_domain!r}")
        if self.nvlink_domain > 1 and not self.layout.domain_switch:
            raise TopologyError(
                f"nvlink_domain: {self.nvlink_domain} hosts per NVLink domain but node.domain_switch is not set; "
                f"name the NVSwitch vertex that spans the domain (e.g. domain_switch: nvswitch)"
            )
        object.__setattr__(self, "fabric_latency", parse_latency(self.fabric_latency, "fabric_latency"))
        g = self.layout.gpus
        if not self.rank_map:
            object.__setattr__(self, "rank_map", tuple((r // g, r % g) for r in range(self.nodes * g)))
        else:
            rm = []
            for r, entry in enumerate(self.rank_map):
                if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                    raise TopologyError(f"rank_map[{r}]: expected [node, local_rank], got {entry!r}")
                node, local = int(entry[0]), int(entry[1])
                if not 0 <= node < self.nodes:
                    raise TopologyError(f"rank_map[{r}]: node {node} out of range 0..{self.nodes - 1}")
                if not 0 <= local < g:
                    raise TopologyError(f"rank_map[{r}]: local_rank {local} out of range 0..{g - 1}")
                rm.append((node, local))
            if len(set(rm)) != len(rm):
                dup = next(x for x in rm if rm.count(x) > 1)
                raise TopologyError(f"rank_map: two ranks map to the same GPU (node {dup[0]}, local_rank {dup[1]})")
            object.__setattr__(self, "rank_map", tuple(rm))
        if self.nodes > 1 and any(n != self.rank_map[0][0] for n, _ in self.rank_map) and not self.layout.nics:
            raise TopologyError("node.nics: ranks span several nodes but the node layout has no NIC")

    # ---- ranks ----------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return len(self.rank_map)

    @property
    def gpus_per_node(self) -> int:
        return self.layout.gpus

    def check_rank(self, r: int, field_name: str = "rank") -> int:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.world:
            raise TopologyError(f"{field_name}: rank {r!r} is not in the topology (world size {self.world})")
        return r

    def node_of(self, r: int) -> int:
        return self.rank_map[r][0]

    def local_rank_of(self, r: int) -> int:
        return self.rank_map[r][1]

    def domain_of(self, r: int) -> int:
        """NVLink domain of rank ``r`` (Note [NVLink domains]): its host when ``nvlink_domain == 1``."""
        return self.rank_map[r][0] // self.nvlink_domain

    def domains_of(self, ranks):
        """NVLink domain of each rank of the integer array ``ranks`` (vectorised :meth:`domain_of`).

        A route leaves through a NIC exactly when its two ends' domains differ (:meth:`route`), so
        ``domains_of(src) != domains_of(dst)`` counts NIC crossings without building routes.
        """
        import numpy as np

        domains = self._cache.get("domain-array")
        if domains is None:
            domains = np.array([n // self.nvlink_domain for n, _ in self.rank_map], dtype=np.int64)
            self._cache["domain-array"] = domains
        return domains[np.asarray(ranks, dtype=np.int64)]

    @property
    def domains(self) -> int:
        return -(-self.nodes // self.nvlink_domain)

    def ranks_of_node(self, node: int) -> tuple[int, ...]:
        return tuple(r for r, (n, _) in enumerate(self.rank_map) if n == node)

    # ---- resources and routes -------------------------------------------------------------
    def _resource(self, node: int, u: str, v: str, kind: str, bw: float, lat: float) -> Resource:
        name = f"n{node}:{u}>{v}"
        res = self._cache.get(name)
        if res is None:
            res = Resource(name, kind, bw, lat, node)
            self._cache[name] = res
        return res

    def _hops(self, node: int, hops) -> tuple[Resource, ...]:
        return tuple(self._resource(node, u, v, ln.kind, ln.bandwidth, ln.latency) for u, v, ln in hops)

    def route_ids(self) -> "RouteIds":
        """This topology's routes as integer columns, filled as pairs are asked for (Note [Route
        ids] in :mod:`megatron_fcp.topology.route_ids`); one per topology."""
        table = self._cache.get("route-ids")
        if table is None:
            table = self._cache.setdefault("route-ids", RouteIds(self))
        return table

    def route(self, src: int, dst: int) -> Route:
        """Resources crossed by a message ``src -> dst`` (global ranks); see Note [Topology model]."""
        key = (src, dst)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        self.check_rank(src, "src")
        self.check_rank(dst, "dst")
        (ns, ls), (nd, ld) = self.rank_map[src], self.rank_map[dst]
        if ns == nd:
            res = self._hops(ns, self.layout.gpu_path(ls, ld))
        elif ns // self.nvlink_domain == nd // self.nvlink_domain:  # Note [NVLink domains]
            res = self._hops(ns, self.layout.switch_path(ls)) + self._hops(nd, self.layout.switch_path(ld, inbound=True))
        else:
            lay = self.layout
            nic_s, nic_d = lay.nics[lay.gpu_nic[ls]], lay.nics[lay.gpu_nic[ld]]
            res = (
                self._hops(ns, lay.nic_path(ls))
                + (self._resource(ns, nic_s.name, "net", nic_s.kind, nic_s.bandwidth, nic_s.latency + self.fabric_latency),
                   self._resource(nd, "net", nic_d.name, nic_d.kind, nic_d.bandwidth, nic_d.latency))
                + self._hops(nd, lay.nic_path(ld, inbound=True))
            )
        route = Route(src, dst, res)
        self._cache[key] = route
        return route

    def gpu_ingress_bandwidth(self, r: int) -> float:
        """Max-flow (bytes/s) into rank ``r``'s GPU from every other GPU of its node and every NIC wire.

        This is the ``B_gpu`` of the lower bound: no schedule can deliver data to the GPU faster.
        """
        local = self.local_rank_of(r)
        key = ("ingress", local)
        if key not in self._cache:
            import networkx as nx

            g = nx.DiGraph()
            for ln in self.layout.links:
                g.add_edge(ln.a, ln.b, capacity=ln.bandwidth)
                g.add_edge(ln.b, ln.a, capacity=ln.bandwidth)
            for i in range(self.layout.gpus):
                if i != local:
                    g.add_edge("__src__", _gpu(i))  # infinite capacity
            if self.nodes > 1:
                for nic in self.layout.nics:
                    g.add_edge("__src__", nic.name, capacity=nic.bandwidth)
            sink = _gpu(local)
            # a NIC only emits what its wire delivers: drop edges into NICs (no bypass of the wire)
            nic_names = {n.name for n in self.layout.nics}
            for u, v in list(g.edges):
                if v in nic_names and u != "__src__":
                    g.remove_edge(u, v)
            if "__src__" not in g or sink not in g:
                self._cache[key] = 0.0
            else:
                self._cache[key] = float(nx.maximum_flow_value(g, "__src__", sink))
        return self._cache[key]

    def node_ingress_bandwidth(self) -> float:
        """Sum of one node's NIC ingress wires (bytes/s), the same on every node: the ``B_out`` of
        the lower bound."""
        return sum(n.bandwidth for n in self.layout.nics)

    # ---- presentation and files ---------------------------------------------------------
    def summary(self) -> str:
        """Human-readable description: nodes, GPUs, links by kind, NICs, rank map shape."""
        lay = self.layout
        kinds: dict[str, list[float]] = {}
        for ln in lay.links:
            kinds.setdefault(ln.kind, []).append(ln.bandwidth)
        lines = [
            f"topology {self.name!r}: {self.nodes} node(s) x {lay.gpus} GPU(s) = {self.world} ranks",
        ]
        if self.nvlink_domain > 1:
            lines.append(f"  NVLink domains: {self.domains} of {self.nvlink_domain} node(s) "
                         f"({self.nvlink_domain * lay.gpus} GPUs) over {lay.domain_switch!r}; NICs only between domains")
        lines += [
            "  links per node: " + ", ".join(
                f"{len(v)} {k} ({_fmt_bw(min(v))}" + (f"..{_fmt_bw(max(v))}" if max(v) != min(v) else "") + "/dir)"
                for k, v in sorted(kinds.items())
            ),
        ]
        if lay.nics:
            nic_bw = sum(n.bandwidth for n in lay.nics)
            lines.append(
                f"  NICs per node: {len(lay.nics)} ({', '.join(sorted({n.kind for n in lay.nics}))}, "
                f"{_fmt_bw(nic_bw)}/dir total); gpu->nic {list(lay.gpu_nic)}"
            )
        if self.world:
            lines.append(
                f"  per-GPU ingress {_fmt_bw(self.gpu_ingress_bandwidth(0))}, per-node inter-node ingress "
                f"{_fmt_bw(self.node_ingress_bandwidth())}"
            )
        default = tuple((r // lay.gpus, r % lay.gpus) for r in range(self.nodes * lay.gpus))
        lines.append("  rank map: " + ("torchrun default (node = rank // gpus)" if self.rank_map == default
                                       else ", ".join(f"{r}:n{n}.{l}" for r, (n, l) in enumerate(self.rank_map))))
        return "\n".join(lines)

    def with_rank_map(self, rank_map: Iterable[tuple[int, int]]) -> "Topology":
        """Same cluster, explicit ``rank_map`` (e.g. from hostnames gathered at run time)."""
        return Topology(self.name, self.layout, self.nodes, tuple(tuple(x) for x in rank_map), self.fabric_latency,
                        self.nvlink_domain)


def _fmt_bw(bw: float) -> str:
    return f"{bw / GB:g} GB/s"
