"""What an emulated cluster is: rates, the cluster spec, its address plan, its Topology and time scale.

Pure, no ``torch`` and no processes: everything here is tested without root.

Note [Emulated cluster]
-----------------------
Every rank is its own network namespace ``{prefix}r{node}_{local}``; every node has a namespace
``{prefix}n{node}`` holding a Linux bridge ``br0`` (the NVSwitch stand-in), and one spine namespace
``{prefix}sw`` holds the bridge of the inter-node fabric. Links are veth pairs, each end shaped
with ``htb`` (:mod:`megatron_fcp.emulate.netns`) so that both directions run at the link's rate::

    rail  (one NIC per rank, rail aligned; DGX-like)           shared (one uplink per node)
    rank ns: eth0 -> node bridge   (intra rate)                rank ns: eth0 -> node bridge (intra)
             ib0  -> spine bridge  (inter rate)                node ns: uplink -> spine     (inter)

Addresses are private, inside namespaces created for the run: rank (n, l) is ``10.{net}.{n}.{l+1}``.
In ``rail`` eth0 carries the node-local /24 and ib0 the route to the other nodes (same-node
traffic only crosses eth0, cross-node traffic only ib0); in ``shared`` eth0 carries the /16 and
the node bridge forwards cross-node packets through the one uplink. Rank 0 (10.{net}.0.1) is the
rendezvous; gloo binds ``eth0`` (its address is reachable from every rank).

The same cluster as a :class:`~megatron_fcp.topology.Topology` (:func:`emulated_topology`): GPU
``i`` joins the ``nvswitch`` vertex at the intra rate (the rank's eth0: egress and ingress are the
two directions of that link); rail NIC ``nic{i}`` hangs off GPU ``i`` (its ib0), shared NIC
``nic0`` hangs off the bridge (the uplink). Bandwidths are the *goodput* of the shaped rate (TCP
payload of a 1500-byte MTU frame: 1448 of 1514 wire bytes, measured 46.9 of 50 MB/s at 400 Mbit/s),
latencies zero for planning (veth adds microseconds; the kernel here has no ``netem``); predictions
price the per-message time the link probe measures (Note [Probe-fitted latency]).

Time scale: the emulated intra rate stands for NVLink4 (450 GB/s per direction), so one emulated
second is ``1 / time_scale`` real seconds with ``time_scale = 450e9 / (intra bytes/s)`` (360 Mbit/s
-> 10,000). The GPU kernel a sleep stands in for is stretched by the same factor: its emulated
FLOP/s are ``tflops * 1e12 / time_scale`` (400 TFLOP/s -> 40 GFLOP/s at 360 Mbit/s).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_fcp.topology import Link, Nic, NodeLayout, Topology

__all__ = [
    "NVLINK_BYTES_PER_S",
    "NIC_BYTES_PER_S",
    "GOODPUT",
    "NIC_LAYOUTS",
    "parse_rate",
    "format_rate",
    "ClusterSpec",
    "RankAddress",
    "address_plan",
    "emulated_topology",
]

NVLINK_BYTES_PER_S = 450e9
"""What the intra rate stands for: NVLink4 per direction (DGX H100)."""
NIC_BYTES_PER_S = 50e9
"""What the inter rate stands for: one NDR 400 Gb/s NIC (9:1 against NVLink4)."""
GOODPUT = 1448 / 1514
"""TCP payload per shaped wire byte (1500-byte MTU, timestamps on)."""
NIC_LAYOUTS = ("rail", "shared")

_RATE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(bit|kbit|mbit|gbit)\s*", re.IGNORECASE)
_RATE_SCALE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(value: "str | float", flag: str = "rate") -> float:
    """Bits per second from ``tc``'s notation: ``"400mbit"``, ``"1gbit"``, ``"64kbit"``, ``"2.5mbit"``
    (powers of 1000, as ``tc`` reads them); a plain number is bits/s. ValueError names the fix."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bits = float(value)
    else:
        m = _RATE.fullmatch(str(value))
        if m is None:
            raise ValueError(f"{flag}: cannot parse {value!r}; give a rate like 400mbit, 40mbit or 1gbit "
                             f"(bits per second, as tc writes them)")
        bits = float(m.group(1)) * _RATE_SCALE[m.group(2).lower()]
    if not bits >= 8000:
        raise ValueError(f"{flag}: {value!r} is below 8kbit; give a rate like 400mbit")
    return bits


def format_rate(bits: float) -> str:
    """``tc``'s notation for bits/s, exact to the kbit: 400e6 -> ``"400mbit"``, 2.5e6 -> ``"2500kbit"``."""
    kbit = int(round(bits / 1e3))
    for unit, scale in (("gbit", 1_000_000), ("mbit", 1_000)):
        if kbit % scale == 0:
            return f"{kbit // scale}{unit}"
    return f"{kbit}kbit"


@dataclass(frozen=True)
class ClusterSpec:
    """An emulated cluster: ``nodes`` x ``ranks_per_node`` ranks, NIC layout, link rates (bits/s).

    ``prefix`` starts every namespace name of this cluster (a run's own, so that teardown deletes
    exactly what it made); ``net`` is the second octet of its private 10.x.0.0/16.
    """

    nodes: int
    ranks_per_node: int
    nic: str = "rail"
    intra_bps: float = 360e6
    inter_bps: float = 40e6
    prefix: str = "fcpe"
    net: int = 213

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be an integer >= 1, got {v!r}")
        if self.nodes > 250 or self.ranks_per_node > 250:
            raise ValueError("--nodes and --ranks-per-node: at most 250 each (one /24 per node)")
        if self.nic not in NIC_LAYOUTS:
            raise ValueError(f"--nic: {self.nic!r} is not one of {NIC_LAYOUTS} (rail: one NIC per rank; "
                             f"shared: one uplink per node)")
        for name in ("intra_bps", "inter_bps"):
            parse_rate(getattr(self, name), f"--{name[:5]}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", self.prefix):
            raise ValueError(f"prefix {self.prefix!r}: 1-10 lowercase letters/digits, starting with a letter")
        if not 1 <= self.net <= 254:
            raise ValueError(f"net {self.net}: the second octet of 10.x.0.0/16 must be 1..254")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def time_scale(self) -> float:
        """Real seconds are emulated seconds / time_scale: NVLink4 bytes/s over the intra bytes/s."""
        return NVLINK_BYTES_PER_S / (self.intra_bps / 8)

    def describe(self) -> dict:
        """The cluster fields of the benchmark JSON, named like the CLI flags."""
        return {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "nic": self.nic,
                "intra": format_rate(self.intra_bps), "inter": format_rate(self.inter_bps),
                "time_scale": self.time_scale}


@dataclass(frozen=True)
class RankAddress:
    """Where rank ``rank`` (node-major: ``node * ranks_per_node + local``) lives."""

    rank: int
    node: int
    local: int
    netns: str
    ip: str
    gloo_ifname: str = "eth0"


def address_plan(spec: ClusterSpec) -> list[RankAddress]:
    """One :class:`RankAddress` per rank, node-major (rank 0 first: the rendezvous)."""
    return [RankAddress(n * spec.ranks_per_node + l, n, l, f"{spec.prefix}r{n}_{l}", f"10.{spec.net}.{n}.{l + 1}")
            for n in range(spec.nodes) for l in range(spec.ranks_per_node)]


def emulated_topology(spec: ClusterSpec, intra_latency_s: float = 0.0, inter_latency_s: float = 0.0) -> Topology:
    """The cluster as the cost model sees it (Note [Emulated cluster]); bandwidths in bytes/s.

    ``intra_latency_s`` / ``inter_latency_s``: the per-message time of one message alone on an intra /
    inter route beyond its bytes (0 by default: planning; the link probe's fit for predictions, Note
    [Probe-fitted latency] in :mod:`megatron_fcp.emulate.probe`). A route crosses two links of its
    kind (up to the switch and down, or NIC to NIC), so each link gets half."""
    g = spec.ranks_per_node
    intra = spec.intra_bps / 8 * GOODPUT
    inter = spec.inter_bps / 8 * GOODPUT
    lat_link, lat_nic = intra_latency_s / 2, inter_latency_s / 2
    free = 1000 * max(intra, inter)  # an unshaped hop (ib0 is the NIC itself; bridge to uplink)
    links = [Link(f"gpu{i}", "nvswitch", "nvswitch", intra, lat_link) for i in range(g)]
    if spec.nic == "rail":
        links += [Link(f"gpu{i}", f"nic{i}", "pcie", free, 0.0) for i in range(g)]
        nics = tuple(Nic(f"nic{i}", "ethernet", inter, lat_nic) for i in range(g))
        layout = NodeLayout(g, tuple(links), nics, tuple(range(g)), "emulated-rail")
    else:
        links.append(Link("nvswitch", "nic0", "pcie", free, 0.0))
        layout = NodeLayout(g, tuple(links), (Nic("nic0", "ethernet", inter, lat_nic),), (), "emulated-shared")
    name = f"emulated-{spec.nic}:{spec.nodes}x{g}"
    return Topology(name, layout, spec.nodes, (), 0.0)
