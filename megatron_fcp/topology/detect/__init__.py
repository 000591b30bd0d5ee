"""Topology detection: ``nvidia-smi topo -m`` text, NCCL topology XML, hostnames, or YAML.

Everything here is pure (text in, data out) except :func:`gather_host_info`, which imports
``torch.distributed`` lazily and runs one ``all_gather_object``. Detection happens in two steps:

1. A parser reads one node's description into a :class:`DetectedNode` - plain data: the link kind
   between every pair of local GPUs and which NIC each GPU uses.
2. :func:`layout_to_topology` replicates that layout over the nodes (the cluster is assumed
   homogeneous) and builds a :class:`~megatron_fcp.topology.model.Topology` through the model's
   public API.

The package's modules: :mod:`.node` (:class:`DetectedNode` and the default speeds),
:mod:`.nvidia_smi` and :mod:`.nccl_xml` (the parsers), :mod:`.hosts` (hostnames -> nodes) and
:mod:`.build` (DetectedNode -> Topology). This module holds :func:`detect_topology`, which picks
the source, and re-exports the public names of the others.

Note [Resolution order of detect_topology]
------------------------------------------
The first source that is given wins::

    1. source="PRESET:NODES" or a YAML path   -> load_topology(source); the user's word wins
    2. nccl_xml=PATH (NCCL_TOPO_DUMP_FILE)     -> parse_nccl_topo_xml, replicated over the nodes
    3. nvidia_smi=TEXT|PATH, or probe=True     -> parse_nvidia_smi_topo, replicated over the nodes
    4. nothing                                 -> uniform nodes, default link speeds (logged once)

The node count and rank map come from ``hosts`` (a :class:`HostGroups` from
:func:`gather_host_info`, or a hostname list) when given, else ``nodes`` (default 1) with the
torchrun rank map. Speeds a source does not give are logged once with the value assumed.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Sequence

from megatron_fcp.topology.detect.build import (
    DEFAULT_UNIFORM_INTRA_GBYTES_PER_S,
    check_speeds,
    layout_to_topology,
    uniform_topology,
)
from megatron_fcp.topology.detect.hosts import HostGroups, gather_host_info, group_ranks_by_host
from megatron_fcp.topology.detect.nccl_xml import parse_nccl_topo_xml
from megatron_fcp.topology.detect.node import (
    DEFAULT_NIC_GBYTES_PER_S,
    DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK,
    DEFAULT_PCIE_GBYTES_PER_S,
    NVLINK_GBYTES_PER_S_PER_LINK_BY_SM,
    PATH_KINDS,
    DetectedNode,
    NicInfo,
    PairLink,
    TopologyParseError,
)
from megatron_fcp.topology.detect.nvidia_smi import (
    NVLINK_MAX_LINKS_PER_GPU,
    parse_nvidia_smi_topo,
    read_nvidia_smi_topo,
)
from megatron_fcp.topology.model import Topology
from megatron_fcp.topology.presets import PRESETS, load_topology

__all__ = [
    "PATH_KINDS",
    "NVLINK_MAX_LINKS_PER_GPU",
    "NVLINK_GBYTES_PER_S_PER_LINK_BY_SM",
    "DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK",
    "DEFAULT_PCIE_GBYTES_PER_S",
    "DEFAULT_NIC_GBYTES_PER_S",
    "DEFAULT_UNIFORM_INTRA_GBYTES_PER_S",
    "PairLink",
    "NicInfo",
    "DetectedNode",
    "HostGroups",
    "TopologyParseError",
    "parse_nvidia_smi_topo",
    "parse_nccl_topo_xml",
    "read_nvidia_smi_topo",
    "group_ranks_by_host",
    "gather_host_info",
    "layout_to_topology",
    "uniform_topology",
    "detect_topology",
]

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _log_once(msg: str) -> None:
    """Log each distinct assumption once per process (the cache is the memory; tests clear it)."""
    log.warning(msg)


def _text_or_file(value: str | os.PathLike) -> tuple[str, str]:
    """(text, source name): a path to a file is read; a string with a newline is the text itself."""
    if isinstance(value, os.PathLike) or ("\n" not in str(value)):
        path = os.fspath(value)
        if not os.path.exists(path):
            raise FileNotFoundError(f"topology input {path}: not found")
        with open(path, encoding="utf-8") as fh:
            return fh.read(), path
    return str(value), "<text>"


def detect_topology(
    source: str | os.PathLike | None = None,
    *,
    nccl_xml: str | os.PathLike | None = None,
    nvidia_smi: str | os.PathLike | None = None,
    probe: bool = False,
    hosts: HostGroups | Sequence[str] | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    nvlink_gbytes_per_s_per_link: float | None = None,
    pcie_gbytes_per_s: float | None = None,
    nic_gbytes_per_s: float | None = None,
) -> Topology:
    """Describe the cluster; the first source given wins (Note [Resolution order of detect_topology]).

    ``source``: ``PRESET[:NODES]`` or a YAML path (:func:`~megatron_fcp.topology.load_topology`).
    ``nccl_xml`` / ``nvidia_smi``: a file path or the text itself. ``probe``: run
    ``nvidia-smi topo -m`` when no file is given. ``hosts``: a :class:`HostGroups` (from
    :func:`gather_host_info`) or a hostname list, giving the node count and rank map; else
    ``nodes`` (default 1). ``gpus_per_node``: ranks per node when no hostnames are given (a
    detected layout keeps local GPUs ``0..gpus_per_node-1``; the uniform assumption uses that
    many GPUs, default 1). Detected layouts are assumed identical on every node. The speeds are
    GB/s (gigabytes per second) per direction and win over what a source says (see
    :func:`layout_to_topology`).
    """
    speeds = dict(nvlink_gbytes_per_s_per_link=nvlink_gbytes_per_s_per_link, pcie_gbytes_per_s=pcie_gbytes_per_s,
                  nic_gbytes_per_s=nic_gbytes_per_s)
    check_speeds(**speeds)
    if hosts is not None and not isinstance(hosts, HostGroups):
        hosts = group_ranks_by_host(list(hosts))
    if hosts is not None and nodes is not None and nodes != hosts.num_nodes:
        raise ValueError(f"nodes={nodes} but the hostnames name {hosts.num_nodes} node(s) {list(hosts.hosts)}")
    n_nodes = hosts.num_nodes if hosts is not None else (nodes or 1)
    if hosts is not None and gpus_per_node is not None and gpus_per_node != hosts.ranks_per_node:
        raise ValueError(f"gpus_per_node={gpus_per_node} but the hostnames give {hosts.ranks_per_node} rank(s) per node")

    if source is not None:
        spec = str(source)
        if spec in PRESETS:  # bare preset name: take the node count from hosts/nodes
            spec = f"{spec}:{n_nodes}"
        topo = load_topology(spec)
        if nodes is not None and topo.nodes != nodes:
            raise ValueError(f"topology {topo.name!r} has {topo.nodes} node(s) but nodes={nodes} was asked for; "
                             f"give the count once (PRESET:NODES)")
        if hosts is not None:
            if (topo.nodes, topo.gpus_per_node) != (hosts.num_nodes, hosts.ranks_per_node):
                raise ValueError(
                    f"topology {topo.name!r} has {topo.nodes} node(s) x {topo.gpus_per_node} GPU(s) but the process "
                    f"group has {hosts.num_nodes} host(s) x {hosts.ranks_per_node} rank(s); fix the YAML/preset node count"
                )
            default = tuple((r // topo.gpus_per_node, r % topo.gpus_per_node) for r in range(topo.world))
            if topo.rank_map == default and not hosts.contiguous:  # an explicit rank_map in YAML wins
                topo = topo.with_rank_map((hosts.node_of(r), hosts.local_rank_of(r)) for r in range(hosts.world_size))
        return topo

    layout = None
    if nccl_xml is not None:
        text, name = _text_or_file(nccl_xml)
        layout = parse_nccl_topo_xml(text, source=name)
        label = f"nccl-xml:{os.path.basename(name)}"
    elif nvidia_smi is not None:
        text, name = _text_or_file(nvidia_smi)
        layout = parse_nvidia_smi_topo(text, source=name)
        label = f"nvidia-smi:{os.path.basename(name)}"
    elif probe:
        text = read_nvidia_smi_topo()
        if text is not None:
            layout = parse_nvidia_smi_topo(text, source="nvidia-smi topo -m")
            label = "nvidia-smi:local"
    if layout is not None:
        assumed = []
        has_nvlink = any(layout.nvswitch_links) or any(p.nvlinks for p in layout.pairs.values())
        if has_nvlink and layout.nvlink_gbytes_per_s_per_link is None and nvlink_gbytes_per_s_per_link is None:
            assumed.append(f"{DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK:g} GB/s per NVLink "
                           "(GPU generation unknown; nvlink_gbytes_per_s_per_link=)")
        if layout.pcie_gbytes_per_s is None and pcie_gbytes_per_s is None:
            assumed.append(f"PCIe {DEFAULT_PCIE_GBYTES_PER_S['PIX']:g} GB/s (4.0 x16; pcie_gbytes_per_s=)")
        if nic_gbytes_per_s is None and any(n.speed_gbytes_per_s is None for n in layout.nics if n.gpus):
            assumed.append(f"NIC {DEFAULT_NIC_GBYTES_PER_S:g} GB/s (HDR 200 Gb/s; nic_gbytes_per_s=)")
        if assumed:
            _log_once(f"{layout.source}: assuming " + ", ".join(assumed) + " per direction")
        return layout_to_topology(layout, nodes=n_nodes, hosts=hosts, gpus=gpus_per_node, name=label, **speeds)

    g = hosts.ranks_per_node if hosts is not None else (gpus_per_node or 1)
    intra = DEFAULT_UNIFORM_INTRA_GBYTES_PER_S
    nic = nic_gbytes_per_s or DEFAULT_NIC_GBYTES_PER_S
    _log_once(
        f"no topology source (YAML/preset, NCCL XML, nvidia-smi): assuming {n_nodes} uniform node(s) x {g} GPU(s), "
        f"NVSwitch {intra:g} GB/s and one {nic:g} GB/s NIC per GPU (per direction); "
        f"pass --topology PRESET:NODES or a YAML file to describe the cluster"
    )
    return uniform_topology(n_nodes, g, intra_gbytes_per_s=intra, nic_gbytes_per_s=nic, hosts=hosts)
