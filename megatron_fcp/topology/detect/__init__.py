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

Note [Guesses are reported]
---------------------------
Whatever detection did not read from the machine is a guess, and every guess is one line that
names the flag (``megatron-fcp topo``) or YAML key that replaces it: a tie in NIC placement
(every GPU-NIC path SYS, as on a GB200 tray; :func:`~.node.place_nics`), two GPUs on the ports
of one card while a NIC as close stays unused, a NIC kind the source does not give, a speed taken
from the defaults (NVLink per link, PCIe, NIC), an NVLink domain size that NVML did not confirm.
:func:`detect_topology_report` returns them; ``megatron-fcp topo`` prints them under
``guesses:``; :func:`detect_topology` (what the plugin calls at setup) logs each once.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Sequence

from megatron_fcp.topology.detect.build import (
    DEFAULT_UNIFORM_INTRA_GBYTES_PER_S,
    NO_GDR_GBYTES_PER_S,
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
    "detect_topology_report",
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


def detect_topology(*args, **kwargs) -> Topology:
    """:func:`detect_topology_report` without the report: each guess is logged once instead
    (Note [Guesses are reported]); the plugin calls this at setup."""
    topo, guesses = detect_topology_report(*args, **kwargs)
    for line in guesses:
        _log_once(line)
    return topo


def detect_topology_report(
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
    gpu_nic: Sequence[str] | None = None,
    nvlink_domain: int | None = None,
) -> tuple[Topology, list[str]]:
    """Describe the cluster; the first source given wins (Note [Resolution order of detect_topology]).
    Returns ``(topology, guesses)``: one line per guess, each naming its fix (Note [Guesses are
    reported]).

    ``source``: ``PRESET[:NODES]`` or a YAML path (:func:`~megatron_fcp.topology.load_topology`).
    ``nccl_xml`` / ``nvidia_smi``: a file path or the text itself. ``probe``: run
    ``nvidia-smi topo -m`` when no file is given. ``hosts``: a :class:`HostGroups` (from
    :func:`gather_host_info`) or a hostname list, giving the node count and rank map; else
    ``nodes`` (default 1). ``gpus_per_node``: ranks per node when no hostnames are given (a
    detected layout keeps local GPUs ``0..gpus_per_node-1``; the uniform assumption uses that
    many GPUs, default 1). Detected layouts are assumed identical on every node. The speeds are
    GB/s (gigabytes per second) per direction and win over what a source says (see
    :func:`layout_to_topology`). ``gpu_nic``: one NIC name per GPU, replacing the detected
    placement. ``nvlink_domain``: hosts per NVLink domain (NVL72: 18); default from the hosts'
    NVML fabric ids (:mod:`.fabric`) when gathered, else 1.
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
        return topo, []

    guesses: list[str] = []
    from megatron_fcp.topology.detect.fabric import domain_size

    fabric_domain = domain_size(hosts.fabric, hosts.hosts) if hosts is not None else None
    if nvlink_domain is not None and fabric_domain is not None and nvlink_domain != fabric_domain:
        raise ValueError(f"nvlink_domain={nvlink_domain} but NVML's fabric ids put {fabric_domain} host(s) in each "
                         f"NVLink domain; drop the setting or fix the hostfile order")
    domain = nvlink_domain or fabric_domain or 1

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
        src = layout.source
        # a NIC placement given by gpu_nic replaces the placement guesses
        guesses += [f"{src}: {g}" for g in layout.guesses if gpu_nic is None or "--gpu-nic" not in g]
        has_nvlink = any(layout.nvswitch_links) or any(p.nvlinks for p in layout.pairs.values())
        if has_nvlink and layout.nvlink_gbytes_per_s_per_link is None and nvlink_gbytes_per_s_per_link is None:
            guesses.append(f"{src}: NVLink {DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK:g} GB/s per link and direction assumed "
                           f"(the source does not name the GPU generation; B200/B300 NVLink5 is 50) - fix with "
                           f"--nvlink-gbytes-per-s or the nvlink/nvswitch link bandwidth in the YAML")
        if layout.pcie_gbytes_per_s is None and pcie_gbytes_per_s is None:
            guesses.append(f"{src}: PCIe {DEFAULT_PCIE_GBYTES_PER_S['PIX']:g} GB/s per direction assumed (4.0 x16) - "
                           f"fix with --pcie-gbytes-per-s or the pcie link bandwidth in the YAML")
        if nic_gbytes_per_s is None and any(n.speed_gbytes_per_s is None for n in layout.nics if n.gpus):
            guesses.append(f"{src}: NIC {DEFAULT_NIC_GBYTES_PER_S:g} GB/s per direction assumed (HDR 200 Gb/s; "
                           f"NDR is 50, XDR/ConnectX-8 100) - fix with --nic-gbytes-per-s or node.nics[].bandwidth in the YAML")
        no_gdr = [n.name for n in layout.nics if n.gpus and n.gdr is False]
        if no_gdr:
            guesses.append(f"{src}: no GPUDirect RDMA (gdr=0) on {', '.join(no_gdr)}: priced as staged through host "
                           f"memory (wire capped at {NO_GDR_GBYTES_PER_S:g} GB/s) - enable GDR (nvidia-peermem) and re-dump, "
                           f"or set node.nics[].bandwidth in the YAML")
        topo = layout_to_topology(layout, nodes=n_nodes, hosts=hosts, gpus=gpus_per_node, name=label,
                                  gpu_nic=gpu_nic, nvlink_domain=domain, **speeds)
        return topo, guesses

    g = hosts.ranks_per_node if hosts is not None else (gpus_per_node or 1)
    intra = DEFAULT_UNIFORM_INTRA_GBYTES_PER_S
    nic = nic_gbytes_per_s or DEFAULT_NIC_GBYTES_PER_S
    guesses.append(
        f"no topology source (YAML/preset, NCCL XML, nvidia-smi): assuming {n_nodes} uniform node(s) x {g} GPU(s), "
        f"NVSwitch {intra:g} GB/s and one {nic:g} GB/s NIC per GPU (per direction); "
        f"pass --topology PRESET:NODES or a YAML file to describe the cluster"
    )
    if domain > 1:
        guesses.append(f"NVLink domain of {domain} hosts over the assumed NVSwitch (from "
                       f"{'NVML fabric ids' if fabric_domain else 'nvlink_domain='}); NVLink speed assumed {intra:g} GB/s")
    return uniform_topology(n_nodes, g, intra_gbytes_per_s=intra, nic_gbytes_per_s=nic, hosts=hosts,
                            nvlink_domain=domain), guesses
