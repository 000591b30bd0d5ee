"""``megatron-fcp topo``: print a cluster topology (preset, YAML, nvidia-smi or NCCL XML) and
optionally write it as YAML for editing.

Sources follow :func:`megatron_fcp.topology.detect.detect_topology`'s order: ``--topology`` >
``--from-nccl-xml`` > ``--from-nvidia-smi`` > ``nvidia-smi topo -m`` on this machine > a uniform
assumption (logged). The printout shows the nodes and their ranks, the link kind and bottleneck
bandwidth between every pair of local GPUs of node 0, the NICs with the GPUs that use them, and
every guess detection made, each with the flag or YAML key that fixes it (Note [Guesses are
reported] in :mod:`megatron_fcp.topology.detect`).
"""

from __future__ import annotations

import argparse
import logging
import sys

NAME = "topo"
HELP = "print a cluster topology (preset, YAML, nvidia-smi or NCCL XML) and optionally write YAML"

_KIND_ABBREV = {"nvswitch": "NVS", "nvlink": "NV", "pcie": "PCIe", "ib": "IB", "ethernet": "Eth", "loopback": "X"}


_DEPRECATED_FLAGS = {
    "--nvlink-gbps": "--nvlink-gbytes-per-s",
    "--pcie-gbps": "--pcie-gbytes-per-s",
    "--nic-gbps": "--nic-gbytes-per-s",
}
"""Old flag -> its replacement (same value, gigabytes/s). The old flags still work, are hidden
from ``--help`` and print a warning when used: "gbps" reads as gigabits/s."""


class _DeprecatedFlag(argparse.Action):
    """Store the value under the replacement's ``dest`` and print a one-line deprecation warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"megatron-fcp topo: warning: {option_string} is deprecated, use {_DEPRECATED_FLAGS[option_string]} "
              f"(same value, gigabytes/s)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", metavar="PRESET:NODES|FILE.yaml",
                   help="a preset (dgx-a100, dgx-h100, hgx-b200, hgx-b300, gb200-nvl72, gb300-nvl72, pcie-box, "
                        "single-uplink) with a node count (hosts; an NVL72 rack is 18), or a YAML file; "
                        "wins over every detected source")
    p.add_argument("--from-nvidia-smi", metavar="FILE", help="text saved from `nvidia-smi topo -m` on one node")
    p.add_argument("--from-nccl-xml", metavar="FILE",
                   help="NCCL topology dump of one node (run once with NCCL_TOPO_DUMP_FILE=FILE)")
    p.add_argument("--nodes", type=int, metavar="N",
                   help="number of identical nodes for a detected layout (default 1; must match PRESET:NODES)")
    p.add_argument("--gpus-per-node", type=int, metavar="G",
                   help="ranks per node: keep local GPUs 0..G-1 of a detected node (default: all), or the GPU "
                        "count of the uniform assumption when nothing is detected (default 1)")
    from megatron_fcp.topology.detect import (
        DEFAULT_NIC_GBYTES_PER_S,
        DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK,
        DEFAULT_PCIE_GBYTES_PER_S,
    )

    p.add_argument("--nvlink-gbytes-per-s", type=float, metavar="GB/s",
                   help="NVLink bandwidth per link and direction in gigabytes/s when the source cannot tell "
                        f"(default {DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK:g})")
    p.add_argument("--pcie-gbytes-per-s", type=float, metavar="GB/s",
                   help="PCIe bandwidth per direction of GPU/NIC links in gigabytes/s when the source cannot tell "
                        f"(default {DEFAULT_PCIE_GBYTES_PER_S['PIX']:g}, PCIe 4.0 x16)")
    p.add_argument("--nic-gbytes-per-s", type=float, metavar="GB/s",
                   help="NIC bandwidth per direction in gigabytes/s, overriding the source (default: the source's, "
                        f"else {DEFAULT_NIC_GBYTES_PER_S:g} = HDR 200 Gb/s)")
    p.add_argument("--gpu-nic", metavar="NIC,NIC,...",
                   help="the NIC each GPU uses, one name per GPU in local-rank order (e.g. mlx5_0,mlx5_3,...), "
                        "replacing the detected placement (see the guesses it prints)")
    p.add_argument("--nvlink-domain", type=int, metavar="HOSTS",
                   help="hosts per NVLink domain (GB200/GB300 NVL72: 18 trays); default from NVML's fabric info "
                        "when gathered, else 1 (every host its own domain)")
    for old, new in _DEPRECATED_FLAGS.items():
        p.add_argument(old, type=float, dest=new.lstrip("-").replace("-", "_"), action=_DeprecatedFlag,
                       help=argparse.SUPPRESS)
    p.add_argument("--yaml-out", metavar="FILE", help="write the topology as YAML (edit it, pass it back with --topology)")


def _gbytes_per_s_text(bw: float) -> str:
    return f"{bw / 1e9:.4g}"


def _ranks_text(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


def describe(topo) -> str:
    """The full printout for a :class:`~megatron_fcp.topology.model.Topology` (also used by tests)."""
    lay = topo.layout
    lines = [topo.summary(), "", "nodes:"]
    for n in range(topo.nodes):
        lines.append(f"  node {n}: ranks {_ranks_text(topo.ranks_of_node(n))}")

    node0 = topo.ranks_of_node(0)
    by_local = {topo.local_rank_of(r): r for r in node0}
    g = lay.gpus
    lines += ["", "links between the GPUs of node 0 (bottleneck kind, GB/s per direction):"]
    cells = [[""] * g for _ in range(g)]
    for i in range(g):
        for j in range(g):
            if i == j:
                cells[i][j] = "X"
            elif i in by_local and j in by_local:
                route = topo.route(by_local[i], by_local[j])
                cells[i][j] = f"{_KIND_ABBREV.get(route.kind, route.kind)} {_gbytes_per_s_text(route.bandwidth)}"
            else:
                cells[i][j] = "-"
    width = max(6, max(len(c) for row in cells for c in row) + 2)
    lines.append((" " * 7 + "".join(f"gpu{j}".ljust(width) for j in range(g))).rstrip())
    for i in range(g):
        lines.append(f"  gpu{i}".ljust(7) + "".join(c.ljust(width) for c in cells[i]).rstrip())
    lines.append("  (NVS = through NVSwitch, NV = direct NVLink, PCIe = PCIe/host path)")

    lines += ["", "NICs per node:"]
    if not lay.nics:
        lines.append("  none (single-node only)")
    for k, nic in enumerate(lay.nics):
        users = [i for i in range(g) if lay.gpu_nic[i] == k]
        share = "shared uplink" if len(users) > 1 else "one GPU"
        lines.append(
            f"  {nic.name:<10} {nic.kind:<8} {_gbytes_per_s_text(nic.bandwidth):>6} GB/s  gpus {users}  ({share})"
        )
    return "\n".join(lines)


def describe_source(node) -> str:
    """The detected node as the source reported it: nvidia-smi style tokens per GPU pair, and the
    NIC each GPU uses with its PCIe path (``node`` is a :class:`~megatron_fcp.topology.detect.DetectedNode`)."""
    mat = node.kind_matrix()
    g = node.num_gpus
    width = max(6, max(len(c) for row in mat for c in row) + 2)
    lines = [f"as reported by {node.source} (PIX one PCIe switch, PXB several, PHB/NODE via the CPU, "
             f"SYS across sockets, NV# bonded NVLinks):",
             (" " * 7 + "".join(f"gpu{j}".ljust(width) for j in range(g))).rstrip()]
    for i in range(g):
        lines.append(f"  gpu{i}".ljust(7) + "".join(c.ljust(width) for c in mat[i]).rstrip())
    kinds: dict[str, int] = {}
    for pl in node.pairs.values():
        kinds[pl.kind] = kinds.get(pl.kind, 0) + 1
    lines.append("  pair kinds: " + ", ".join(f"{k} x{c}" for k, c in sorted(kinds.items())))
    for nic in node.nics:
        if nic.gpus:
            via = ", ".join(f"gpu{gi} {p}" for gi, p in zip(nic.gpus, nic.paths))
            lines.append(f"  {nic.name}: {via}")
    unused = [n.name for n in node.nics if not n.gpus]
    if unused:
        lines.append(f"  not used by any GPU (left out): {', '.join(unused)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from megatron_fcp.topology import TopologyError, serialize
    from megatron_fcp.topology.detect import TopologyParseError, detect_topology_report

    logging.basicConfig(level=logging.WARNING, format="megatron-fcp topo: %(message)s")
    given = [name for name, val in (("--topology", args.topology), ("--from-nccl-xml", args.from_nccl_xml),
                                    ("--from-nvidia-smi", args.from_nvidia_smi)) if val]
    try:
        topo, guesses = detect_topology_report(
            args.topology,
            nccl_xml=args.from_nccl_xml,
            nvidia_smi=args.from_nvidia_smi,
            probe=not given,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            nvlink_gbytes_per_s_per_link=args.nvlink_gbytes_per_s,
            pcie_gbytes_per_s=args.pcie_gbytes_per_s,
            nic_gbytes_per_s=args.nic_gbytes_per_s,
            gpu_nic=args.gpu_nic.split(",") if args.gpu_nic else None,
            nvlink_domain=args.nvlink_domain,
        )
    except (TopologyError, TopologyParseError, ValueError, FileNotFoundError) as exc:
        print(f"megatron-fcp topo: error: {exc}", file=sys.stderr)
        return 2
    if given:
        used = given[0]
    elif topo.name.startswith("uniform"):
        used = "uniform assumption (no nvidia-smi on this machine)"
    else:
        used = "`nvidia-smi topo -m` on this machine"
    if len(given) > 1:
        print(f"source: {used} (ignored: {', '.join(given[1:])}; see the resolution order in docs/topology.md)")
    else:
        print(f"source: {used}")
    print(describe(topo))
    if guesses:
        print("\nguesses (not read from the machine; each names its fix):")
        for line in guesses:
            print(f"  - {line}")
    if given and given[0] != "--topology":
        from megatron_fcp.topology.detect import parse_nccl_topo_xml, parse_nvidia_smi_topo

        path = args.from_nccl_xml or args.from_nvidia_smi
        parse = parse_nccl_topo_xml if args.from_nccl_xml else parse_nvidia_smi_topo
        with open(path, encoding="utf-8") as fh:
            print("\n" + describe_source(parse(fh.read(), source=path)))
    if args.yaml_out:
        serialize.to_yaml(topo, args.yaml_out)
        print(f"\nwrote {args.yaml_out}")
    return 0
