"""A :class:`~megatron_fcp.topology.model.Topology` from a :class:`~.node.DetectedNode`
(:func:`layout_to_topology`), or from nothing but a node count (:func:`uniform_topology`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from megatron_fcp.topology.detect.hosts import HostGroups
from megatron_fcp.topology.detect.node import (
    DEFAULT_NIC_GBYTES_PER_S,
    DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK,
    DEFAULT_PCIE_GBYTES_PER_S,
    DetectedNode,
)
from megatron_fcp.topology.errors import TopologyError
from megatron_fcp.topology.model import Link, Nic, NodeLayout, Topology
from megatron_fcp.topology.units import GB

__all__ = ["DEFAULT_UNIFORM_INTRA_GBYTES_PER_S", "NO_GDR_GBYTES_PER_S", "layout_to_topology", "uniform_topology"]

#: Hostnames-only fallback: GPUs on one NVSwitch at this many GB/s per direction (NVLink3, 12
#: links) and one HDR NIC per GPU (:data:`DEFAULT_NIC_GBYTES_PER_S`), as on a DGX-A100.
DEFAULT_UNIFORM_INTRA_GBYTES_PER_S = 300.0

_TREE_LEVEL = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 2, "SYS": 3}
_RDMA_PREFIXES = ("mlx", "ib", "hfi", "bnxt_re", "irdma", "efa", "rdmap", "qedr", "erdma", "ionic")
#: NIC wire cap (GB/s per direction) when the source says GPUDirect RDMA is off (``gdr="0"``):
#: the NIC reads a bounce buffer in host memory that the GPU wrote over PCIe, so a GPU's traffic
#: crosses the host bridge twice; priced as the host-bridge path rate of the PCIe table.
NO_GDR_GBYTES_PER_S = DEFAULT_PCIE_GBYTES_PER_S["PHB"]
#: Latencies (s) of the links we create; NIC latency is the model's default.
_NVLINK_LATENCY = 1e-6
_PCIE_LATENCY = 1e-6
_SYS_LATENCY = 2e-6


def _nic_kind(name: str) -> str:
    """Fallback when the source gave no kind: ``ib`` for RDMA device names (``mlx5_0``, ``ib0``,
    ``rdmap*`` EFA ...), else ``ethernet``."""
    return "ib" if name.lower().startswith(_RDMA_PREFIXES) else "ethernet"


def _pcie_tree_links(devices: Sequence[str], paths: Mapping[frozenset, str], leaf_gbytes_per_s: float) -> list:
    """Rebuild a PCIe tree over ``devices`` from pairwise path tokens and return model Links.

    Algorithm (the tokens form an ultrametric: PIX < PXB < PHB/NODE < SYS): for level 0 (PIX),
    1 (PXB) and 2 (PHB/NODE) group devices by union-find over pairs at that level or closer.
    Every PIX/PXB group of two or more devices that is not the same set as a group one level down
    becomes a PCIe switch vertex ``pcisw#``; every level-2 group becomes a root complex ``cpu#``
    (one per NUMA node/socket). Each device or vertex links to the smallest vertex strictly above
    it. Root complexes are joined pairwise by an SMP link (SYS). Pairs with no token (NVLink pairs
    in nvidia-smi) only meet where other tokens put them. Bandwidths per direction (GB/s): links
    into a switch ``leaf_gbytes_per_s``; into a root complex ``DEFAULT_PCIE_GBYTES_PER_S['NODE']``;
    SMP ``DEFAULT_PCIE_GBYTES_PER_S['SYS']`` (both capped at ``leaf_gbytes_per_s``) - so with the
    default leaf speed the bottleneck between two GPUs is the table's value for their token.
    """
    groups_by_level: list[list[frozenset]] = []
    for level in range(3):
        parent = {d: d for d in devices}

        def find(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for pair, tok in paths.items():
            a, b = tuple(pair)
            if a in parent and b in parent and _TREE_LEVEL[tok] <= level:
                parent[find(a)] = find(b)
        members: dict[str, set] = {}
        for d in devices:
            members.setdefault(find(d), set()).add(d)
        groups_by_level.append(sorted((frozenset(m) for m in members.values()), key=lambda g: devices.index(min(g, key=devices.index))))

    vertices: list[tuple[int, frozenset, str]] = []  # (level, members, vertex name)
    n_sw = 0
    for level in (0, 1):
        below = set(groups_by_level[level - 1]) if level else set()
        for grp in groups_by_level[level]:
            if len(grp) >= 2 and grp not in below:
                vertices.append((level, grp, f"pcisw{n_sw}"))
                n_sw += 1
    roots = groups_by_level[2]
    for k, grp in enumerate(roots):
        vertices.append((2, grp, f"cpu{k}"))

    def up(members: frozenset, level: int) -> tuple[int, str]:
        """Smallest vertex strictly above (level > ``level``) containing ``members``."""
        cands = [(lv, len(g), name) for lv, g, name in vertices if lv > level and members <= g]
        lv, _, name = min(cands)
        return lv, name

    bw_into = {0: leaf_gbytes_per_s, 1: leaf_gbytes_per_s, 2: min(leaf_gbytes_per_s, DEFAULT_PCIE_GBYTES_PER_S["NODE"])}
    smp_gbytes_per_s = min(leaf_gbytes_per_s, DEFAULT_PCIE_GBYTES_PER_S["SYS"])
    links = []
    for d in devices:
        lv, name = up(frozenset((d,)), -1)
        links.append(Link(d, name, "pcie", bw_into[lv] * GB, _PCIE_LATENCY))
    for level, grp, name in vertices:
        if level == 2:
            continue
        lv, parent_name = up(grp, level)
        links.append(Link(name, parent_name, "pcie", bw_into[lv] * GB, _PCIE_LATENCY))
    for i in range(len(roots)):
        for j in range(i + 1, len(roots)):
            links.append(Link(f"cpu{i}", f"cpu{j}", "pcie", smp_gbytes_per_s * GB, _SYS_LATENCY))
    return links


def _rank_map(hosts: HostGroups) -> tuple[tuple[int, int], ...]:
    """``rank_map[r] = (node, local_rank)`` for the Topology; ``hosts`` must cover ranks 0..W-1."""
    everyone = sorted(r for rs in hosts.ranks for r in rs)
    if everyone != list(range(hosts.world_size)):
        raise ValueError(
            f"hostnames cover ranks {everyone}, not 0..{hosts.world_size - 1}: a Topology describes the whole "
            f"world, so gather the hostnames over the default process group"
        )
    return tuple((hosts.node_of(r), hosts.local_rank_of(r)) for r in range(hosts.world_size))


def check_speeds(**speeds: float | None) -> None:
    for arg, value in speeds.items():
        if value is not None and not value > 0:
            raise ValueError(f"{arg}={value!r}: a bandwidth must be > 0 GB/s (leave it unset for the default)")


def layout_to_topology(
    node: DetectedNode,
    *,
    nodes: int = 1,
    hosts: HostGroups | None = None,
    gpus: int | None = None,
    nvlink_gbytes_per_s_per_link: float | None = None,
    pcie_gbytes_per_s: float | None = None,
    nic_gbytes_per_s: float | None = None,
    gpu_nic: Sequence[str] | None = None,
    nvlink_domain: int = 1,
    name: str | None = None,
) -> Topology:
    """Build a :class:`~megatron_fcp.topology.model.Topology` of ``nodes`` copies of ``node``.

    Vertices are ``gpu#`` (local GPU index = local rank, torchrun's convention), the NICs some GPU
    uses (storage NICs are left out: they carry no GPU traffic), ``nvswitch`` when GPUs are
    switched, and the PCIe switches / root complexes that :func:`_pcie_tree_links` rebuilds.
    Speeds are GB/s (gigabytes per second) per direction. NVLink bandwidth = links x per-link
    speed (``nvlink_gbytes_per_s_per_link`` overrides what the source said; default
    :data:`DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK`). PCIe device links (GPU/NIC to switch):
    ``pcie_gbytes_per_s``, else the source's, else ``DEFAULT_PCIE_GBYTES_PER_S['PIX']``. NIC speed:
    ``nic_gbytes_per_s``, else the source's, else :data:`DEFAULT_NIC_GBYTES_PER_S`. Explicit
    arguments win over the source.
    ``gpus`` keeps local GPUs ``0..gpus-1`` (fewer ranks than GPUs per node). ``hosts`` (from
    hostnames, covering the whole world) sets the node count and the rank map. ``gpu_nic`` (one
    NIC name per kept GPU) replaces the detected NIC placement. A NIC the source marks without
    GPUDirect RDMA (``gdr="0"``) gets its wire capped at the host-staging rate
    :data:`NO_GDR_GBYTES_PER_S` (the data crosses host memory twice). ``nvlink_domain``: hosts
    per NVLink domain (:class:`~megatron_fcp.topology.model.Topology`; 1 = the host is the
    domain).
    """
    check_speeds(nvlink_gbytes_per_s_per_link=nvlink_gbytes_per_s_per_link, pcie_gbytes_per_s=pcie_gbytes_per_s,
                 nic_gbytes_per_s=nic_gbytes_per_s)

    g = node.num_gpus if gpus is None else gpus
    if hosts is not None:
        nodes = hosts.num_nodes
        if gpus is not None and gpus != hosts.ranks_per_node:
            raise ValueError(f"gpus={gpus} but the hostnames give {hosts.ranks_per_node} rank(s) per node")
        g = hosts.ranks_per_node
    if not 1 <= g <= node.num_gpus:
        raise ValueError(
            f"{node.source}: {g} ranks per node but the node has {node.num_gpus} GPU(s); "
            f"describe the cluster with --topology FILE.yaml"
        )
    per_link = (nvlink_gbytes_per_s_per_link or node.nvlink_gbytes_per_s_per_link
                or DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK)
    gpu_names = [f"gpu{i}" for i in range(g)]
    links = []
    switched = [i for i in range(g) if node.nvswitch_links and node.nvswitch_links[i] > 0]
    if len(switched) >= 2:
        for i in switched:
            links.append(Link(f"gpu{i}", "nvswitch", "nvswitch", node.nvswitch_links[i] * per_link * GB, _NVLINK_LATENCY))
    for (i, j), pl in sorted(node.pairs.items()):
        if j < g and pl.kind == "nvlink":
            links.append(Link(f"gpu{i}", f"gpu{j}", "nvlink", pl.nvlinks * per_link * GB, _NVLINK_LATENCY))

    choice = list(node.gpu_nic[:g])
    if gpu_nic is not None:
        names = [n.name for n in node.nics]
        if len(gpu_nic) != g or any(n not in names for n in gpu_nic):
            raise ValueError(f"gpu_nic={list(gpu_nic)}: give one NIC per GPU ({g}) from {names}")
        choice = list(gpu_nic)
    used = []
    for i in range(g):
        nic = choice[i]
        if nic is not None and nic not in used:
            used.append(nic)
    leaf = pcie_gbytes_per_s or node.pcie_gbytes_per_s or DEFAULT_PCIE_GBYTES_PER_S["PIX"]
    links += _pcie_tree_links(gpu_names + used, node.pcie_paths, leaf)
    nics = []
    for nic_name in used:
        info = node.nic(nic_name)
        speed = nic_gbytes_per_s or info.speed_gbytes_per_s or DEFAULT_NIC_GBYTES_PER_S
        if info.gdr is False:
            speed = min(speed, NO_GDR_GBYTES_PER_S)
        nics.append(Nic(nic_name, info.kind or _nic_kind(nic_name), speed * GB))
    nic_index = tuple(used.index(choice[i]) for i in range(g)) if used else ()
    domain_switch = "nvswitch" if nvlink_domain > 1 and len(switched) >= 2 else ""
    if nvlink_domain > 1 and not domain_switch:
        raise ValueError(f"{node.source}: nvlink_domain={nvlink_domain} hosts but the node's GPUs are not on an "
                         f"NVSwitch; an NVLink domain spans hosts only through NVLink switches")
    layout = NodeLayout(g, tuple(links), tuple(nics), nic_index, name or node.source, domain_switch=domain_switch)
    rank_map = _rank_map(hosts) if hosts is not None else ()
    try:
        return Topology(name or node.source, layout, nodes, rank_map, nvlink_domain=nvlink_domain)
    except TopologyError as exc:
        raise TopologyError(f"{node.source}: {exc}") from None


def uniform_topology(
    nodes: int,
    gpus_per_node: int,
    *,
    intra_gbytes_per_s: float = DEFAULT_UNIFORM_INTRA_GBYTES_PER_S,
    nic_gbytes_per_s: float = DEFAULT_NIC_GBYTES_PER_S,
    hosts: HostGroups | None = None,
    nvlink_domain: int = 1,
) -> Topology:
    """The hostnames-only assumption: ``nodes`` nodes of ``gpus_per_node`` GPUs on one NVSwitch
    (``intra_gbytes_per_s`` GB/s per direction) with one NIC per GPU (``nic_gbytes_per_s``),
    rail-aligned."""
    links, nics = [], []
    for i in range(gpus_per_node):
        if gpus_per_node > 1:
            links.append(Link(f"gpu{i}", "nvswitch", "nvswitch", intra_gbytes_per_s * GB, _NVLINK_LATENCY))
        links.append(Link(f"gpu{i}", f"nic{i}", "pcie", DEFAULT_PCIE_GBYTES_PER_S["PIX"] * GB, _PCIE_LATENCY))
        nics.append(Nic(f"nic{i}", "ib", nic_gbytes_per_s * GB))
    switch = "nvswitch" if nvlink_domain > 1 and gpus_per_node > 1 else ""
    if nvlink_domain > 1 and not switch:
        raise ValueError(f"nvlink_domain={nvlink_domain}: an NVLink domain of hosts needs several GPUs per host")
    layout = NodeLayout(gpus_per_node, tuple(links), tuple(nics), tuple(range(gpus_per_node)), "uniform",
                        domain_switch=switch)
    rank_map = _rank_map(hosts) if hosts is not None else ()
    return Topology(f"uniform:{nodes}", layout, nodes, rank_map, nvlink_domain=nvlink_domain)
