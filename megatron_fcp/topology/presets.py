"""Preset clusters and :func:`load_topology`, the one parser of ``--topology`` specs.

A preset is a function ``nodes -> Topology`` in :data:`PRESETS`; its docstring gives the hardware
it stands for and where its numbers come from (nominal per-direction bandwidths).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from megatron_fcp.topology import serialize
from megatron_fcp.topology.errors import TopologyError
from megatron_fcp.topology.model import Link, Nic, NodeLayout, Topology
from megatron_fcp.topology.units import GB

__all__ = ["PRESETS", "NVL72_TRAYS", "preset", "load_topology"]


def _nvswitch_node(gpus: int, nvlink_bw: float, nic_bw: float, nic_kind: str, pcie_bw: float, name: str,
                   domain_switch: str = "") -> NodeLayout:
    """DGX-style: every GPU on one NVSwitch plane; NIC ``i`` next to GPU ``i`` (rail-aligned).
    ``domain_switch="nvswitch"`` when the plane spans several hosts (Note [NVLink domains])."""
    links = [Link(f"gpu{i}", "nvswitch", "nvswitch", nvlink_bw, 1e-6) for i in range(gpus)]
    nics = []
    for i in range(gpus):
        links.append(Link(f"gpu{i}", f"nic{i}", "pcie", pcie_bw, 1e-6))
        nics.append(Nic(f"nic{i}", nic_kind, nic_bw, 2e-6))
    return NodeLayout(gpus, tuple(links), tuple(nics), tuple(range(gpus)), name, domain_switch=domain_switch)


def _dgx_a100(nodes: int = 1) -> Topology:
    """DGX A100: 8 GPUs, NVSwitch (NVLink3 300 GB/s/dir), 8x HDR 200 Gb/s (25 GB/s) NICs, rail-aligned."""
    return Topology("dgx-a100", _nvswitch_node(8, 300 * GB, 25 * GB, "ib", 32 * GB, "dgx-a100"), nodes)


def _dgx_h100(nodes: int = 1) -> Topology:
    """DGX H100: 8 GPUs, NVSwitch (NVLink4 450 GB/s/dir), 8x NDR 400 Gb/s (50 GB/s) NICs, rail-aligned."""
    return Topology("dgx-h100", _nvswitch_node(8, 450 * GB, 50 * GB, "ib", 64 * GB, "dgx-h100"), nodes)


def _hgx_b200(nodes: int = 1) -> Topology:
    """HGX/DGX B200: 8 GPUs, NVSwitch (NVLink5, 18 links x 50 = 900 GB/s/dir), 8x ConnectX-7
    400 Gb/s (50 GB/s) NICs, rail-aligned, PCIe 5.0 x16 (64 GB/s). Sources: docs/topology.md."""
    return Topology("hgx-b200", _nvswitch_node(8, 900 * GB, 50 * GB, "ib", 64 * GB, "hgx-b200"), nodes)


def _hgx_b300(nodes: int = 1) -> Topology:
    """HGX/DGX B300: 8 GPUs, NVSwitch (NVLink5, 900 GB/s/dir), 8x ConnectX-8 800 Gb/s (100 GB/s)
    NICs, rail-aligned, PCIe 6.0 x16 (128 GB/s raw). Sources: docs/topology.md."""
    return Topology("hgx-b300", _nvswitch_node(8, 900 * GB, 100 * GB, "ib", 128 * GB, "hgx-b300"), nodes)


NVL72_TRAYS = 18
"""Compute trays (hosts) of one GB200/GB300 NVL72 rack: 18 x 4 GPUs = 72 in one NVLink domain."""


def _gb200_nvl72(nodes: int = NVL72_TRAYS) -> Topology:
    """GB200 NVL72: ``nodes`` compute trays (hosts) of 4 B200 GPUs; every 18 trays (a rack) are one
    NVLink domain (NVLink5 900 GB/s/dir per GPU through the NVLink switch trays); 4x ConnectX-7
    400 Gb/s (50 GB/s) NICs per tray, one per GPU, for traffic between racks. Sources: docs/topology.md."""
    layout = _nvswitch_node(4, 900 * GB, 50 * GB, "ib", 64 * GB, "gb200-nvl72", domain_switch="nvswitch")
    return Topology("gb200-nvl72", layout, nodes, nvlink_domain=NVL72_TRAYS)


def _gb300_nvl72(nodes: int = NVL72_TRAYS) -> Topology:
    """GB300 NVL72: as :func:`_gb200_nvl72` with B300 GPUs (NVLink5 900 GB/s/dir) and 4x
    ConnectX-8 800 Gb/s (100 GB/s) NICs per tray. Sources: docs/topology.md."""
    layout = _nvswitch_node(4, 900 * GB, 100 * GB, "ib", 64 * GB, "gb300-nvl72", domain_switch="nvswitch")
    return Topology("gb300-nvl72", layout, nodes, nvlink_domain=NVL72_TRAYS)


def _pcie_box(nodes: int = 1) -> Topology:
    """PCIe server: 8 GPUs, pairs behind 4 PCIe4 switches (x16 ~25 GB/s), switches under one root
    complex (x16 uplinks), one 100 Gb/s (12.5 GB/s) Ethernet NIC on the root complex."""
    links = []
    for i in range(8):
        links.append(Link(f"gpu{i}", f"pcisw{i // 2}", "pcie", 25 * GB, 1e-6))
    for s in range(4):
        links.append(Link(f"pcisw{s}", "cpu", "pcie", 25 * GB, 1e-6))
    links.append(Link("cpu", "nic0", "pcie", 25 * GB, 1e-6))
    layout = NodeLayout(8, tuple(links), (Nic("nic0", "ethernet", 12.5 * GB, 5e-6),), (), "pcie-box")
    return Topology("pcie-box", layout, nodes)


def _single_uplink(nodes: int = 2) -> Topology:
    """n nodes of 8 NVSwitch GPUs (300 GB/s/dir) sharing ONE 200 Gb/s (25 GB/s) NIC per node."""
    links = [Link(f"gpu{i}", "nvswitch", "nvswitch", 300 * GB, 1e-6) for i in range(8)]
    links += [Link(f"gpu{i}", "pcie", "pcie", 32 * GB, 1e-6) for i in range(8)]
    links.append(Link("pcie", "nic0", "pcie", 32 * GB, 1e-6))
    layout = NodeLayout(8, tuple(links), (Nic("nic0", "ib", 25 * GB, 2e-6),), (), "single-uplink")
    return Topology("single-uplink", layout, nodes)


PRESETS: dict[str, Callable[[int], Topology]] = {
    "dgx-a100": _dgx_a100,
    "dgx-h100": _dgx_h100,
    "hgx-b200": _hgx_b200,
    "hgx-b300": _hgx_b300,
    "gb200-nvl72": _gb200_nvl72,
    "gb300-nvl72": _gb300_nvl72,
    "pcie-box": _pcie_box,
    "single-uplink": _single_uplink,
}
"""Preset name -> ``factory(nodes) -> Topology``."""


def preset(name: str, nodes: int = 1) -> Topology:
    """A preset cluster with ``nodes`` nodes (see :data:`PRESETS`)."""
    if name not in PRESETS:
        raise TopologyError(f"topology: unknown preset {name!r}; choose one of {', '.join(PRESETS)} or give a YAML path")
    if not isinstance(nodes, int) or nodes < 1:
        raise TopologyError(f"nodes: must be an integer >= 1, got {nodes!r}")
    topo = PRESETS[name](nodes)
    return Topology(f"{name}:{nodes}", topo.layout, nodes, (), topo.fabric_latency, topo.nvlink_domain)


def load_topology(spec: "str | Path | Topology") -> Topology:
    """``"PRESET"``/``"PRESET:NODES"`` (``"dgx-h100:2"``), a YAML file path, or a Topology (returned)."""
    if isinstance(spec, Topology):
        return spec
    text = str(spec)
    if isinstance(spec, Path) or text.endswith((".yaml", ".yml")) or "/" in text:
        return serialize.from_yaml(Path(text))
    name, _, count = text.partition(":")
    if name not in PRESETS:
        raise TopologyError(
            f"topology: {text!r} is neither a preset ({', '.join(PRESETS)}, as PRESET:NODES) nor a .yaml path"
        )
    if count:
        try:
            nodes = int(count)
        except ValueError:
            raise TopologyError(f"topology: node count in {text!r} must be an integer (e.g. dgx-h100:2)") from None
    else:
        nodes = 1
    return preset(name, nodes)
