"""Parser of NCCL's topology dump (``NCCL_TOPO_DUMP_FILE``, one node) into a
:class:`~.node.DetectedNode`; see :func:`parse_nccl_topo_xml` for the algorithm.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Sequence

from megatron_fcp.topology.detect.node import (
    NVLINK_GBYTES_PER_S_PER_LINK_BY_SM,
    PATH_KINDS,
    DetectedNode,
    PairLink,
    TopologyParseError,
    place_nics,
)

__all__ = ["parse_nccl_topo_xml"]

_NVS_CLASS = "0x068000"  # NVSwitch (PCI class "bridge, other")
_GPU_CLASSES = ("0x030200", "0x030000")  # 3D controller / VGA
_P9_CPU_CLASS = "0x068001"  # POWER9 NVLink to CPU: not a GPU peer


def _int_attr(el: ET.Element, name: str, where: str, default: int | None = None) -> int:
    raw = el.get(name)
    if raw is None:
        if default is not None:
            return default
        raise TopologyParseError(f"{where}: <{el.tag}> lacks attribute {name!r}")
    try:
        return int(raw, 0)
    except ValueError:
        raise TopologyParseError(f"{where}: <{el.tag} {name}={raw!r}> is not an integer") from None


_PATH_RANK = ("PIX", "PXB", "PHB", "NODE", "SYS")
_RDMA_NAME_PREFIXES = ("mlx", "rdmap", "efa", "hfi", "bnxt_re", "irdma", "qedr", "erdma", "ionic", "ib")


def _gdr(raw: str | None) -> bool | None:
    """NCCL's ``gdr`` attribute: "1" GPUDirect RDMA on, "0" off, absent: not said."""
    return None if raw is None else raw.strip() not in ("0", "")


def _net_kind(net: ET.Element) -> str | None:
    """Model NIC kind from a ``<net>``'s attributes: ``ib`` for an RDMA device (a non-zero port
    ``guid``, as verbs devices - InfiniBand, RoCE, EFA - report; or GPUDirect on), ``ethernet`` for
    NCCL's socket transport (``guid`` 0 and no GPUDirect); None when the dump says neither. The
    name only confirms (``mlx5_*``, ``rdmap*`` for EFA)."""
    guid = (net.get("guid") or "").strip().lower()
    gdr = _gdr(net.get("gdr"))
    if guid and guid not in ("0x0", "0"):
        return "ib"
    if gdr:
        return "ib"
    if guid in ("0x0", "0"):
        return "ib" if (net.get("name") or "").lower().startswith(_RDMA_NAME_PREFIXES) else "ethernet"
    return None


def _numa_of_chain(chain: Sequence[str]) -> int | None:
    """NUMA id from the ``cpu{numaid}@...`` head of an ancestor chain."""
    head = chain[0] if chain else ""
    num = head[3:].split("@", 1)[0] if head.startswith("cpu") else ""
    return int(num) if num.isdigit() else None


def _pcie_path(a: Sequence[str], b: Sequence[str]) -> str:
    """nvidia-smi style path between two devices given their ancestor chains
    ``[cpu-id, pci-busid, ..., own-busid]`` (the last element is the device itself)."""
    if a[0] != b[0]:
        return "SYS"
    pa, pb = a[1:-1], b[1:-1]  # bridges above each device, top first
    common = 0
    while common < min(len(pa), len(pb)) and pa[common] == pb[common]:
        common += 1
    if common == 0:
        # meet at the CPU: through one host bridge when a device hangs off the root complex
        # directly, else between two host bridges of the same NUMA node
        return "PHB" if not pa or not pb else "NODE"
    below = (len(pa) - common) + (len(pb) - common)  # bridges crossed under the common one
    return "PIX" if below == 0 else "PXB"


def _note_pcie_speed(el: ET.Element, speeds: dict[str, float]) -> None:
    """Record a ``<pci>``'s link bandwidth per direction (GB/s): ``GT/s * width / 8 * 128/130``
    (PCIe 3-5 line coding); silently skipped when NCCL wrote no or unknown attributes."""
    m = re.match(r"\s*([0-9.]+)\s*GT/s", el.get("link_speed", ""))
    width = el.get("link_width", "")
    if m and width.isdigit() and int(width) > 0:
        speeds[(el.get("busid") or "").lower()] = float(m.group(1)) * int(width) / 8 * 128 / 130


def parse_nccl_topo_xml(text: str, *, source: str = "NCCL topology XML") -> DetectedNode:
    """Parse NCCL's topology dump (``NCCL_TOPO_DUMP_FILE``) into a :class:`DetectedNode`.

    Algorithm: walk ``<system><cpu><pci>...`` keeping each element's ancestor chain. A ``<gpu>``
    (its parent ``<pci>`` is the GPU; local index ``dev``) records its ``<nvlink target count
    tclass>`` children; a ``<nic>`` records its ``<net name speed>`` ports (speed in Mb/s).
    NVLinks whose ``tclass`` is NVSwitch (0x068000) make the GPU switched with
    ``sum(count)`` links into the fabric; a switched pair gets ``min`` of the two sums. NVLinks to
    another GPU's bus id are direct. Other pairs get the PCIe path from the ancestor chains: same
    parent bridge PIX, a deeper common bridge PXB, only the CPU PHB, different CPUs SYS. The
    per-link NVLink speed comes from the GPUs' ``sm`` (:data:`NVLINK_GBYTES_PER_S_PER_LINK_BY_SM`).

    NICs: each ``<net>`` is a port with its ``speed`` (Mb/s), kind (:func:`_net_kind`: from
    ``guid``/``gdr``, not the name alone) and ``gdr`` (``gdr="0"`` on the ``<net>`` or on the
    GPUs: no GPUDirect RDMA, so the NIC is marked and priced as staged through host memory, see
    :func:`~.build.layout_to_topology`). A socket NIC repeated with the same attributes under
    every ``<cpu>`` (newer NCCL) is one NIC reached from each of those CPUs. A file with no
    ``<gpu>`` is a static ``NCCL_TOPO_FILE``: the error says to produce a dump instead.

    Raises :class:`TopologyParseError` naming the element and attribute at fault.
    """
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise TopologyParseError(f"{source}: not well-formed XML: {exc}") from None
    if root.tag != "system":
        raise TopologyParseError(f"{source}: root element is <{root.tag}>, expected <system>")

    gpus: dict[int, dict] = {}
    nets: list[dict] = []
    speeds: dict[str, float] = {}  # busid -> GB/s per direction of that device's PCIe link
    bus_to_dev: dict[str, int] = {}

    def walk(el: ET.Element, chain: list[str]) -> None:
        for child in el:
            if child.tag == "cpu":
                cid = child.get("numaid", str(len(chain)))
                walk(child, [f"cpu{cid}@{id(child)}"])
            elif child.tag == "pci":
                _note_pcie_speed(child, speeds)
                busid = (child.get("busid") or "").lower()
                if not busid:
                    raise TopologyParseError(f"{source}: <pci> under {chain[-1] if chain else 'system'} lacks attribute 'busid'")
                walk(child, chain + [busid])
            elif child.tag == "gpu":
                where = f"{source}: <gpu> in pci {chain[-1] if len(chain) > 1 else '?'}"
                if len(chain) < 2:
                    raise TopologyParseError(f"{where}: <gpu> must sit inside a <pci> element")
                dev = _int_attr(child, "dev", where)
                if dev in gpus:
                    raise TopologyParseError(f"{where}: duplicate gpu dev={dev}")
                links = []
                for nv in child.findall("nvlink"):
                    target = (nv.get("target") or "").lower()
                    if not target:
                        raise TopologyParseError(f"{where} dev={dev}: <nvlink> lacks attribute 'target'")
                    links.append((target, _int_attr(nv, "count", f"{where} dev={dev} nvlink {target}"), nv.get("tclass", "")))
                sm = _int_attr(child, "sm", where, default=0)
                gpus[dev] = {"chain": list(chain), "links": links, "sm": sm, "gdr": _gdr(child.get("gdr"))}
                bus_to_dev[chain[-1]] = dev
            elif child.tag == "nic":
                for net in child.findall("net"):
                    name = net.get("name")
                    if not name:
                        raise TopologyParseError(f"{source}: <net> in pci {chain[-1] if chain else '?'} lacks attribute 'name'")
                    speed = _int_attr(net, "speed", f"{source}: <net name={name!r}>", default=0)
                    if speed < 0:
                        raise TopologyParseError(f"{source}: <net name={name!r}> speed={speed} must be >= 0 (Mb/s)")
                    # the enclosing <pci> is the NIC device itself (one per port-group)
                    dev_chain = list(chain) if len(chain) > 1 else list(chain) + [f"nic:{name}"]
                    attrs = {k: net.get(k) for k in ("dev", "port", "guid", "gdr", "speed")}
                    if len(chain) <= 1:  # a socket NIC right under a <cpu>: newer NCCL repeats it under every <cpu>
                        same = next((n for n in nets if n["name"] == name and n["attrs"] == attrs and n["host"]), None)
                        if same is not None:
                            same["chains"].append(dev_chain)
                            continue
                    nets.append({"name": name, "chain": dev_chain, "chains": [dev_chain], "attrs": attrs,
                                 "host": len(chain) <= 1, "gbytes_per_s": speed / 8000.0 or None,
                                 "kind": _net_kind(net), "gdr": _gdr(net.get("gdr"))})
            else:
                walk(child, chain)

    walk(root, [])
    if not gpus:
        raise TopologyParseError(
            f"{source}: no <gpu> element: this is a static topology file (NCCL_TOPO_FILE, as clouds ship them "
            f"to describe their PCIe tree), not NCCL's dump of what it found; run one NCCL job on a node with "
            f"NCCL_TOPO_DUMP_FILE=/tmp/nccl_topo.xml (keep NCCL_TOPO_FILE set if the cloud needs it) and pass "
            f"/tmp/nccl_topo.xml"
        )
    devs = sorted(gpus)
    if devs != list(range(len(devs))):
        raise TopologyParseError(f"{source}: gpu dev ids must be 0..{len(devs) - 1}, got {devs}")
    n_gpu = len(devs)

    switch_links = [0] * n_gpu
    direct: dict[tuple[int, int], int] = {}
    for d in devs:
        for target, count, tclass in gpus[d]["links"]:
            if tclass == _NVS_CLASS:
                switch_links[d] += count
            elif target in bus_to_dev:
                peer = bus_to_dev[target]
                key = (min(d, peer), max(d, peer))
                direct[key] = max(direct.get(key, 0), count)
            elif tclass in _GPU_CLASSES:
                raise TopologyParseError(f"{source}: gpu dev={d}: nvlink target {target} is a GPU not in this file")
            elif tclass == _P9_CPU_CLASS:
                continue  # NVLink to a POWER9 CPU: no GPU peer
            else:
                raise TopologyParseError(f"{source}: gpu dev={d}: nvlink target {target} has unknown tclass {tclass!r}")

    pairs: dict[tuple[int, int], PairLink] = {}
    for i in range(n_gpu):
        for j in range(i + 1, n_gpu):
            if switch_links[i] and switch_links[j]:
                c = min(switch_links[i], switch_links[j])
                pairs[(i, j)] = PairLink("nvswitch", c, f"NV{c}")
            elif (i, j) in direct:
                c = direct[(i, j)]
                pairs[(i, j)] = PairLink("nvlink", c, f"NV{c}")
            else:
                tok = _pcie_path(gpus[i]["chain"], gpus[j]["chain"])
                pairs[(i, j)] = PairLink(PATH_KINDS[tok], 0, tok)

    guesses: list[str] = []
    sms = {gpus[d]["sm"] for d in devs if gpus[d]["sm"]}
    per_link = None
    has_nvlink = any(switch_links) or bool(direct)
    if len(sms) == 1 and next(iter(sms)) in NVLINK_GBYTES_PER_S_PER_LINK_BY_SM:
        per_link = NVLINK_GBYTES_PER_S_PER_LINK_BY_SM[next(iter(sms))]
    elif has_nvlink:
        guesses.append(f"NVLink speed: GPU sm {sorted(sms) or 'not given'} is not in the per-generation table; "
                       f"default used - fix with --nvlink-gbytes-per-s or the YAML's nvlink link bandwidth")

    nic_names = [n["name"] for n in nets]
    if len(set(nic_names)) != len(nic_names):
        dup = sorted({x for x in nic_names if nic_names.count(x) > 1})
        raise TopologyParseError(f"{source}: <net name> {dup} listed twice with different dev/port/guid/speed "
                                 f"(nets {nic_names}); a NIC must be one <net> per port")
    if any(gpus[d]["gdr"] is False for d in devs):  # a GPU without GPUDirect: no NIC reads it directly
        for n in nets:
            n["gdr"] = False
    gpu_nic_paths = [{n["name"]: min((_pcie_path(gpus[d]["chain"], c) for c in n["chains"]), key=_PATH_RANK.index)
                      for n in nets} for d in devs]
    chains = {f"gpu{d}": gpus[d]["chain"] for d in devs}
    chains.update({n["name"]: n["chain"] for n in nets})
    names = list(chains)
    pcie_paths = {
        frozenset((a, b)): _pcie_path(chains[a], chains[b]) for k, a in enumerate(names) for b in names[k + 1 :]
    }
    numa = tuple(_numa_of_chain(gpus[d]["chain"]) for d in devs)
    nic_pairs = {p: t for p, t in pcie_paths.items() if not any(v.startswith("gpu") for v in p)}
    nics, gpu_nic, placed = place_nics(
        gpu_nic_paths, nic_names, {n["name"]: n["gbytes_per_s"] for n in nets}, gpu_numa=numa, nic_pairs=nic_pairs,
        kinds={n["name"]: n["kind"] for n in nets}, gdr={n["name"]: n["gdr"] for n in nets})
    guesses += placed
    dev_speeds = [speeds[c[-1]] for c in chains.values() if c[-1] in speeds]
    return DetectedNode(
        num_gpus=n_gpu,
        pairs=pairs,
        nics=nics,
        gpu_nic=gpu_nic,
        nvswitch_links=tuple(switch_links),
        pcie_paths=pcie_paths,
        nvlink_gbytes_per_s_per_link=per_link,
        pcie_gbytes_per_s=min(dev_speeds) if dev_speeds else None,
        source=source,
        numa=numa,
        guesses=tuple(guesses),
    )
