"""Topology detection: ``nvidia-smi topo -m`` text, NCCL topology XML, hostnames, or YAML.

Everything here is pure (text in, data out) except :func:`gather_host_info`, which imports
``torch.distributed`` lazily and runs one ``all_gather_object``. Detection happens in two steps:

1. A parser reads one node's description into a :class:`DetectedNode` - plain data: the link kind
   between every pair of local GPUs and which NIC each GPU uses.
2. :func:`layout_to_topology` replicates that layout over the nodes (the cluster is assumed
   homogeneous) and builds a :class:`~megatron_fcp.topology.model.Topology` through the model's
   public API.

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

Note [Reading nvidia-smi topo -m]
---------------------------------
The matrix has one column per device (``GPU#``, then NICs as ``NIC#`` with a "NIC Legend" or, on
older drivers, as ``mlx5_#``), then affinity columns that we ignore. Cells mean::

    X      self
    NV#    a bonded set of # NVLinks (directly, or through NVSwitch: see below)
    PIX    at most one PCIe bridge (GPUs or GPU+NIC behind the same PCIe switch)
    PXB    several PCIe bridges, no host bridge (a tree of PCIe switches)
    PHB    through a PCIe host bridge (the CPU)
    NODE   across PCIe host bridges inside one NUMA node
    SYS    across the SMP interconnect between NUMA nodes / sockets (QPI/UPI/xGMI)

``nvidia-smi`` prints ``NV12`` for every pair of a DGX-A100 although an A100 has only 12 links:
with NVSwitch the count is the GPU's links into the switch fabric, shared by all its peers. So a
GPU whose NV counts add up to more than :data:`NVLINK_MAX_LINKS_PER_GPU` is switched, and a pair
of switched GPUs is an ``nvswitch`` link; otherwise ``NV#`` is a direct bonded ``nvlink``.

NIC placement: each GPU takes the NIC(s) at its smallest PCIe distance; among equally close NICs
it takes the one with the fewest GPUs so far (so two GPUs behind a switch with two NICs get one
each, as on a DGX-A100). If that distance is PIX or PXB the GPU has a direct (GPUDirect) path;
otherwise it still uses that NIC but through the host (``NicInfo.paths`` records which). Several
GPUs on one NIC means they share one uplink.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Mapping, Sequence

__all__ = [
    "PATH_KINDS",
    "NVLINK_MAX_LINKS_PER_GPU",
    "NVLINK_GBPS_PER_LINK_BY_SM",
    "DEFAULT_NVLINK_GBPS_PER_LINK",
    "DEFAULT_PCIE_GBPS",
    "DEFAULT_NIC_GBPS",
    "DEFAULT_UNIFORM_INTRA_GBPS",
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


class TopologyParseError(ValueError):
    """Input text/XML is malformed; the message names the source, line and field at fault."""


# --- vocabulary ------------------------------------------------------------------------------

#: nvidia-smi path token -> our pair kind, closest first. ``SOC`` is the pre-2017 name of ``SYS``.
PATH_KINDS: Mapping[str, str] = {
    "PIX": "pcie-switch",  # behind one PCIe switch
    "PXB": "pcie-bridges",  # a tree of PCIe switches, no host bridge
    "PHB": "pcie-host",  # through the CPU's host bridge
    "NODE": "pcie-node",  # between host bridges of one NUMA node
    "SYS": "cross-socket",  # across the SMP interconnect
}
_PATH_ALIASES = {"SOC": "SYS"}
_PATH_ORDER = ("PIX", "PXB", "PHB", "NODE", "SYS")  # closest first
_DIRECT_NIC_PATHS = ("PIX", "PXB")  # GPUDirect RDMA-capable placement

#: Most NVLinks one GPU has (V100: 6, A100: 12, H100/B200: 18). More than this summed over a
#: GPU's peers means the count is the GPU's share of an NVSwitch fabric, not per pair.
NVLINK_MAX_LINKS_PER_GPU = 18

#: Nominal NVLink bandwidth per link and direction (GB/s) by SM version of the GPU:
#: P100 NVLink1 20, V100 NVLink2 25, A100 NVLink3 25 (12 links = 300), H100 NVLink4 25
#: (18 links = 450), B200 NVLink5 50 (18 links = 900).
NVLINK_GBPS_PER_LINK_BY_SM: Mapping[int, float] = {60: 20.0, 70: 25.0, 80: 25.0, 90: 25.0, 100: 50.0}
#: Used when the GPU generation is unknown (nvidia-smi text does not name it): NVLink2-4.
DEFAULT_NVLINK_GBPS_PER_LINK = 25.0

#: GPU<->GPU peer bandwidth per direction (GB/s) over PCIe, by path. PCIe 4.0 x16 gives ~25 GB/s
#: through a switch; through the host bridge / across sockets peer traffic is slower.
DEFAULT_PCIE_GBPS: Mapping[str, float] = {
    "PIX": 25.0,
    "PXB": 25.0,
    "PHB": 20.0,
    "NODE": 20.0,
    "SYS": 12.0,
}
#: NIC speed per direction (GB/s) when the source does not say: HDR InfiniBand 200 Gb/s.
DEFAULT_NIC_GBPS = 25.0


# --- intermediate, model-independent structure ------------------------------------------------


@dataclass(frozen=True)
class PairLink:
    """How two local GPUs reach each other.

    ``kind`` is ``nvswitch`` | ``nvlink`` | one of :data:`PATH_KINDS`' values; ``nvlinks`` is the
    bonded NVLink count (0 for PCIe); ``path`` the raw nvidia-smi style token (``NV12``, ``PIX``).
    """

    kind: str
    nvlinks: int
    path: str

    @property
    def is_nvlink(self) -> bool:
        return self.nvlinks > 0


@dataclass(frozen=True)
class NicInfo:
    """One NIC port: its ``name`` (``mlx5_0``), the local GPUs that use it as their uplink, the
    PCIe path token from each of them (``paths[k]`` belongs to ``gpus[k]``: ``PIX``/``PXB`` is a
    direct GPUDirect path, ``PHB``/``NODE``/``SYS`` goes through the host) and its ``speed_gbps``
    per direction (None: the source did not say). A NIC no GPU uses (a storage NIC) has no gpus."""

    name: str
    gpus: tuple[int, ...]
    paths: tuple[str, ...]
    speed_gbps: float | None = None

    @property
    def shared(self) -> bool:
        """True when several GPUs share this NIC as their uplink."""
        return len(self.gpus) > 1

    @property
    def direct_gpus(self) -> tuple[int, ...]:
        """The GPUs that reach this NIC without crossing the host (PIX/PXB)."""
        return tuple(g for g, p in zip(self.gpus, self.paths) if p in _DIRECT_NIC_PATHS)


@dataclass(frozen=True)
class DetectedNode:
    """One node as a parser saw it: GPUs ``0..num_gpus-1`` (local indices), pair links, NICs.

    ``pairs`` maps ``(i, j)`` with ``i < j`` to a :class:`PairLink`; ``gpu_nic[i]`` is the name of
    the NIC GPU ``i`` uses (None when the node has no NIC); ``nvswitch_links[i]`` is the number of
    NVLinks GPU ``i`` has into an NVSwitch fabric (0: none); ``pcie_paths`` maps a frozenset of
    two device names (``gpu3``, ``mlx5_0``) to their PCIe path token wherever the source gives
    one (nvidia-smi hides it behind ``NV#`` for NVLink pairs); ``nvlink_gbps_per_link`` is None
    when the source did not say which GPU generation it is; ``pcie_gbps`` is the devices' PCIe
    link speed per direction when the source gives it (NCCL XML ``link_speed`` x ``link_width``).
    """

    num_gpus: int
    pairs: Mapping[tuple[int, int], PairLink]
    nics: tuple[NicInfo, ...]
    gpu_nic: tuple[str | None, ...]
    nvswitch_links: tuple[int, ...] = ()
    pcie_paths: Mapping[frozenset, str] = field(default_factory=dict)
    nvlink_gbps_per_link: float | None = None
    pcie_gbps: float | None = None
    source: str = ""

    def link(self, i: int, j: int) -> PairLink:
        """The link between local GPUs ``i`` and ``j`` (order does not matter)."""
        if i == j:
            raise ValueError(f"no link from GPU{i} to itself")
        return self.pairs[(min(i, j), max(i, j))]

    def nic(self, name: str) -> NicInfo:
        for nic in self.nics:
            if nic.name == name:
                return nic
        raise KeyError(f"no NIC named {name!r}; NICs: {[n.name for n in self.nics]}")

    def pair_bandwidth_gbps(self, i: int, j: int, pcie_gbps: Mapping[str, float] = DEFAULT_PCIE_GBPS) -> float:
        """Per-direction bandwidth between GPUs ``i`` and ``j``: ``nvlinks * per-link`` for NVLink
        (default per-link speed when the generation is unknown), the PCIe table otherwise."""
        pl = self.link(i, j)
        if pl.is_nvlink:
            per_link = self.nvlink_gbps_per_link or DEFAULT_NVLINK_GBPS_PER_LINK
            return pl.nvlinks * per_link
        return pcie_gbps[pl.path]

    def kind_matrix(self) -> list[list[str]]:
        """``num_gpus x num_gpus`` nvidia-smi style tokens (``X`` on the diagonal)."""
        g = self.num_gpus
        return [["X" if i == j else self.link(i, j).path for j in range(g)] for i in range(g)]

    def uplinks_shared(self) -> bool:
        """True when at least one NIC carries several GPUs (a shared node uplink)."""
        return any(nic.shared for nic in self.nics)


def _classify_nvlinks(
    nv_counts: Mapping[tuple[int, int], int], num_gpus: int
) -> dict[tuple[int, int], str]:
    """``nvswitch`` when both GPUs' NV counts add up past :data:`NVLINK_MAX_LINKS_PER_GPU`
    (the count is their share of a switch fabric), else ``nvlink`` (direct bonded links)."""
    total = [0] * num_gpus
    for (i, j), c in nv_counts.items():
        total[i] += c
        total[j] += c
    switched = [t > NVLINK_MAX_LINKS_PER_GPU for t in total]
    return {p: ("nvswitch" if switched[p[0]] and switched[p[1]] else "nvlink") for p in nv_counts}


def _place_nics(
    gpu_nic_paths: Sequence[Mapping[str, str]], nic_names: Sequence[str], speeds: Mapping[str, float | None]
) -> tuple[tuple[NicInfo, ...], tuple[str | None, ...]]:
    """Give every GPU its closest NIC, balancing GPUs over equally close NICs (see module note).

    ``gpu_nic_paths[g][nic]`` is a path token in :data:`_PATH_ORDER`.
    """
    users: dict[str, list[tuple[int, str]]] = {n: [] for n in nic_names}
    choice: list[str | None] = []
    for g, paths in enumerate(gpu_nic_paths):
        if not paths:
            choice.append(None)
            continue
        best = min(_PATH_ORDER.index(p) for p in paths.values())
        closest = [n for n in nic_names if n in paths and _PATH_ORDER.index(paths[n]) == best]
        nic = min(closest, key=lambda n: (len(users[n]), nic_names.index(n)))
        users[nic].append((g, paths[nic]))
        choice.append(nic)
    nics = tuple(
        NicInfo(
            name=n,
            gpus=tuple(g for g, _ in users[n]),
            paths=tuple(p for _, p in users[n]),
            speed_gbps=speeds.get(n),
        )
        for n in nic_names
    )
    return nics, tuple(choice)


# --- nvidia-smi topo -m ----------------------------------------------------------------------

_NV_RE = re.compile(r"^NV(\d+)$")


def _cell_token(raw: str, where: str) -> str:
    tok = _PATH_ALIASES.get(raw, raw)
    if tok == "X" or tok in PATH_KINDS or _NV_RE.match(tok):
        return tok
    raise TopologyParseError(
        f"{where}: unknown connection {raw!r}; expected X, NV#, PIX, PXB, PHB, NODE or SYS"
    )


def parse_nvidia_smi_topo(
    text: str, *, source: str = "nvidia-smi topo -m", nvlink_gbps_per_link: float | None = None
) -> DetectedNode:
    """Parse the text of ``nvidia-smi topo -m`` into a :class:`DetectedNode`.

    Algorithm: the first line that names ``GPU0`` is the header; its tokens up to ``CPU`` (the
    ``CPU Affinity`` column) are the device columns. Each following row until a blank line or
    ``Legend:`` is ``LABEL cell*``; the first ``len(columns)`` cells are kept and the affinity
    cells after them ignored. GPU rows give the GPU x GPU matrix (checked to be symmetric with
    ``X`` on the diagonal) and the GPU x NIC paths; ``NIC#`` columns are renamed through the
    "NIC Legend" when present. NV counts are classified nvlink/nvswitch and NICs placed as the
    module note describes. ``nvlink_gbps_per_link`` is kept as given (nvidia-smi does not name the
    GPU generation; None means "use the default", see :meth:`DetectedNode.pair_bandwidth_gbps`).

    Raises :class:`TopologyParseError` naming ``source``, the line number and the cell.
    """
    lines = text.splitlines()
    header_idx = next((k for k, ln in enumerate(lines) if re.search(r"(^|\s)GPU0(\s|$)", ln)), None)
    if header_idx is None:
        raise TopologyParseError(f"{source}: no header line naming GPU0 (is this `nvidia-smi topo -m` output?)")
    columns: list[str] = []
    for tok in lines[header_idx].split():
        if tok == "CPU":  # start of "CPU Affinity"
            break
        columns.append(tok)
    gpu_cols = [c for c in columns if re.fullmatch(r"GPU\d+", c)]
    if gpu_cols != [f"GPU{i}" for i in range(len(gpu_cols))] or columns[: len(gpu_cols)] != gpu_cols:
        raise TopologyParseError(
            f"{source}: line {header_idx + 1}: GPU columns must come first as GPU0..GPU{{n-1}}, got {columns}"
        )
    nic_cols = columns[len(gpu_cols) :]
    if len(set(columns)) != len(columns):
        raise TopologyParseError(f"{source}: line {header_idx + 1}: duplicate column in {columns}")
    n_gpu = len(gpu_cols)

    rows: dict[str, tuple[int, list[str]]] = {}
    legend: dict[str, str] = {}
    k = header_idx + 1
    while k < len(lines) and lines[k].strip() and not lines[k].strip().startswith("Legend"):
        toks = lines[k].split()
        label = toks[0]
        where = f"{source}: line {k + 1} ({label})"
        if label not in columns:
            raise TopologyParseError(f"{where}: row label {label!r} is not a column of the header {columns}")
        if label in rows:
            raise TopologyParseError(f"{where}: duplicate row {label!r}")
        cells = toks[1 : 1 + len(columns)]
        if len(cells) < len(columns):
            raise TopologyParseError(f"{where}: {len(cells)} cells, expected {len(columns)} (one per column)")
        rows[label] = (k + 1, [_cell_token(c, f"{where} column {columns[m]}") for m, c in enumerate(cells)])
        k += 1
    for ln in lines[k:]:
        m = re.match(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$", ln)
        if m:
            legend[m.group(1)] = m.group(2)

    missing = [g for g in gpu_cols if g not in rows]
    if missing:
        raise TopologyParseError(f"{source}: no row for {missing}")
    mat = [rows[g][1] for g in gpu_cols]
    for i in range(n_gpu):
        if mat[i][i] != "X":
            raise TopologyParseError(f"{source}: line {rows[gpu_cols[i]][0]} (GPU{i}): diagonal cell is {mat[i][i]!r}, expected X")
        for j in range(i + 1, n_gpu):
            if mat[i][j] == "X" or mat[i][j] != mat[j][i]:
                raise TopologyParseError(
                    f"{source}: GPU{i}/GPU{j} disagree: line {rows[gpu_cols[i]][0]} says {mat[i][j]!r}, "
                    f"line {rows[gpu_cols[j]][0]} says {mat[j][i]!r}"
                )

    nv_counts = {}
    for i in range(n_gpu):
        for j in range(i + 1, n_gpu):
            m = _NV_RE.match(mat[i][j])
            if m:
                nv_counts[(i, j)] = int(m.group(1))
    nv_kind = _classify_nvlinks(nv_counts, n_gpu)
    pairs = {}
    for i in range(n_gpu):
        for j in range(i + 1, n_gpu):
            tok = mat[i][j]
            if (i, j) in nv_counts:
                pairs[(i, j)] = PairLink(nv_kind[(i, j)], nv_counts[(i, j)], tok)
            else:
                pairs[(i, j)] = PairLink(PATH_KINDS[tok], 0, tok)

    nic_names = [legend.get(c, c) for c in nic_cols]
    if len(set(nic_names)) != len(nic_names):
        raise TopologyParseError(f"{source}: NIC legend gives duplicate names {nic_names}")
    pcie_paths: dict[frozenset, str] = {}
    for i in range(n_gpu):
        for j in range(i + 1, n_gpu):
            if mat[i][j] in PATH_KINDS:
                pcie_paths[frozenset((f"gpu{i}", f"gpu{j}"))] = mat[i][j]
    gpu_nic_paths = []
    for i in range(n_gpu):
        line_no, cells = rows[gpu_cols[i]]
        paths = {}
        for c, name in zip(nic_cols, nic_names):
            tok = cells[columns.index(c)]
            if tok not in PATH_KINDS:
                raise TopologyParseError(
                    f"{source}: line {line_no} (GPU{i}) column {c}: GPU-NIC path {tok!r} must be a PCIe path"
                )
            paths[name] = tok
            pcie_paths[frozenset((f"gpu{i}", name))] = tok
        gpu_nic_paths.append(paths)
    for c, name in zip(nic_cols, nic_names):
        if c not in rows:
            continue  # some drivers print no NIC rows; the GPU rows already place the NIC
        line_no, cells = rows[c]
        for m, other in enumerate(columns):
            tok = cells[m]
            if other == c:
                if tok != "X":
                    raise TopologyParseError(f"{source}: line {line_no} ({c}): diagonal cell is {tok!r}, expected X")
                continue
            if tok not in PATH_KINDS:
                raise TopologyParseError(f"{source}: line {line_no} ({c}) column {other}: NIC path {tok!r} must be a PCIe path")
            if other in gpu_cols:
                key = frozenset((f"gpu{gpu_cols.index(other)}", name))
                if pcie_paths[key] != tok:
                    raise TopologyParseError(
                        f"{source}: {other}/{c} disagree: line {rows[other][0]} says {pcie_paths[key]!r}, line {line_no} says {tok!r}"
                    )
            else:
                pcie_paths[frozenset((name, legend.get(other, other)))] = tok

    switched = [0] * n_gpu
    for (i, j), c in nv_counts.items():
        if nv_kind[(i, j)] == "nvswitch":
            switched[i] = max(switched[i], c)
            switched[j] = max(switched[j], c)
    nics, gpu_nic = _place_nics(gpu_nic_paths, nic_names, {})
    return DetectedNode(
        num_gpus=n_gpu,
        pairs=pairs,
        nics=nics,
        gpu_nic=gpu_nic,
        nvswitch_links=tuple(switched),
        pcie_paths=pcie_paths,
        nvlink_gbps_per_link=nvlink_gbps_per_link,
        source=source,
    )


def read_nvidia_smi_topo(timeout_s: float = 20.0) -> str | None:
    """Run ``nvidia-smi topo -m`` and return its text, or None when nvidia-smi is not installed
    or fails (logged). Never raises for a missing tool: detection falls back to the next source."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s, check=True)
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("`nvidia-smi topo -m` failed (%s); falling back to the next topology source", exc)
        return None
    return out.stdout


# --- NCCL topology XML (NCCL_TOPO_DUMP_FILE) --------------------------------------------------

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
    per-link NVLink speed comes from the GPUs' ``sm`` (:data:`NVLINK_GBPS_PER_LINK_BY_SM`).

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
                gpus[dev] = {"chain": list(chain), "links": links, "sm": sm, "rank": child.get("rank")}
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
                    nets.append({"name": name, "chain": dev_chain, "gbps": speed / 8000.0 or None})
            else:
                walk(child, chain)

    walk(root, [])
    if not gpus:
        raise TopologyParseError(f"{source}: no <gpu> element found")
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

    sms = {gpus[d]["sm"] for d in devs if gpus[d]["sm"]}
    per_link = None
    if len(sms) == 1 and next(iter(sms)) // 10 * 10 in NVLINK_GBPS_PER_LINK_BY_SM:
        per_link = NVLINK_GBPS_PER_LINK_BY_SM[next(iter(sms)) // 10 * 10]

    nic_names = [n["name"] for n in nets]
    if len(set(nic_names)) != len(nic_names):
        raise TopologyParseError(f"{source}: duplicate <net name> in {nic_names}")
    gpu_nic_paths = [{n["name"]: _pcie_path(gpus[d]["chain"], n["chain"]) for n in nets} for d in devs]
    chains = {f"gpu{d}": gpus[d]["chain"] for d in devs}
    chains.update({n["name"]: n["chain"] for n in nets})
    names = list(chains)
    pcie_paths = {
        frozenset((a, b)): _pcie_path(chains[a], chains[b]) for k, a in enumerate(names) for b in names[k + 1 :]
    }
    nics, gpu_nic = _place_nics(gpu_nic_paths, nic_names, {n["name"]: n["gbps"] for n in nets})
    dev_speeds = [speeds[c[-1]] for c in chains.values() if c[-1] in speeds]
    return DetectedNode(
        num_gpus=n_gpu,
        pairs=pairs,
        nics=nics,
        gpu_nic=gpu_nic,
        nvswitch_links=tuple(switch_links),
        pcie_paths=pcie_paths,
        nvlink_gbps_per_link=per_link,
        pcie_gbps=min(dev_speeds) if dev_speeds else None,
        source=source,
    )


# --- hostnames -> nodes ----------------------------------------------------------------------


@dataclass(frozen=True)
class HostGroups:
    """Ranks grouped into nodes by hostname.

    ``hosts[k]`` is node ``k``'s hostname (nodes in order of their lowest rank) and ``ranks[k]``
    its global ranks ordered by local rank (``LOCAL_RANK`` when known, else ascending rank).
    """

    hosts: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)

    @property
    def ranks_per_node(self) -> int:
        return len(self.ranks[0])

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.ranks)

    @property
    def contiguous(self) -> bool:
        """True for the launcher's usual layout: node ``k`` holds ranks ``k*g .. k*g+g-1`` in order."""
        g = self.ranks_per_node
        return all(r == tuple(range(k * g, k * g + g)) for k, r in enumerate(self.ranks))

    def node_of(self, rank: int) -> int:
        for k, rs in enumerate(self.ranks):
            if rank in rs:
                return k
        raise KeyError(f"rank {rank} is not in any node ({self.world_size} ranks)")

    def local_rank_of(self, rank: int) -> int:
        return self.ranks[self.node_of(rank)].index(rank)


def group_ranks_by_host(
    hostnames: Sequence[str],
    *,
    ranks: Sequence[int] | None = None,
    local_ranks: Sequence[int | None] | None = None,
    local_world_sizes: Sequence[int | None] | None = None,
) -> HostGroups:
    """Group ranks into nodes: entry ``i`` of every list describes global rank ``ranks[i]``
    (default ``i``). Pure; :func:`gather_host_info` feeds it from a process group.

    Checks, each a ``ValueError`` that names the host/rank and the fix: every node has the same
    number of ranks; a rank's ``LOCAL_WORLD_SIZE`` (when known) equals the number of ranks that
    share its hostname (a mismatch usually means two machines report the same hostname, e.g.
    containers, or a launcher that set it wrongly); ``LOCAL_RANK`` values on a host are exactly
    ``0..g-1``. Ranks on a node are ordered by ``LOCAL_RANK`` when every rank gave one.
    """
    n = len(hostnames)
    if n == 0:
        raise ValueError("group_ranks_by_host: no hostnames (empty process group?)")
    ranks = list(range(n)) if ranks is None else list(ranks)
    for name, seq in (("ranks", ranks), ("local_ranks", local_ranks), ("local_world_sizes", local_world_sizes)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"group_ranks_by_host: {name} has {len(seq)} entries, hostnames has {n}")
    if len(set(ranks)) != n:
        raise ValueError(f"group_ranks_by_host: duplicate ranks in {ranks}")
    for i, h in enumerate(hostnames):
        if not isinstance(h, str) or not h:
            raise ValueError(f"group_ranks_by_host: rank {ranks[i]} has an empty/invalid hostname {h!r}")

    members: dict[str, list[int]] = {}
    for i, h in enumerate(hostnames):
        members.setdefault(h, []).append(i)  # indices into the lists
    sizes = {h: len(ix) for h, ix in members.items()}

    if local_world_sizes is not None:
        for i, lws in enumerate(local_world_sizes):
            if lws is not None and lws != sizes[hostnames[i]]:
                raise ValueError(
                    f"rank {ranks[i]} on host {hostnames[i]!r} has LOCAL_WORLD_SIZE={lws} but "
                    f"{sizes[hostnames[i]]} ranks report that hostname; if several machines share a "
                    f"hostname (containers), pass distinct names or describe the cluster with --topology FILE.yaml"
                )
    if len(set(sizes.values())) > 1:
        desc = ", ".join(f"{h}: {c}" for h, c in sizes.items())
        raise ValueError(
            f"uneven nodes (ranks per host: {desc}); FCP's topology needs the same number of ranks "
            f"on every node: launch the same --nproc-per-node everywhere or describe the cluster with --topology FILE.yaml"
        )
    g = next(iter(sizes.values()))

    use_local = local_ranks is not None and all(lr is not None for lr in local_ranks)
    if local_ranks is not None and not use_local and any(lr is not None for lr in local_ranks):
        missing = [ranks[i] for i, lr in enumerate(local_ranks) if lr is None]
        raise ValueError(f"LOCAL_RANK is set on some ranks but not on ranks {missing}; set it everywhere or nowhere")
    groups = []
    for h, ix in members.items():
        if use_local:
            seen: dict[int, int] = {}
            for i in ix:
                lr = local_ranks[i]
                if lr in seen:
                    raise ValueError(f"ranks {ranks[seen[lr]]} and {ranks[i]} on host {h!r} both have LOCAL_RANK={lr}")
                seen[lr] = i
            if sorted(seen) != list(range(g)):
                raise ValueError(f"host {h!r}: LOCAL_RANK values {sorted(seen)} are not 0..{g - 1}")
            ordered = [ranks[seen[lr]] for lr in range(g)]
        else:
            ordered = sorted(ranks[i] for i in ix)
        groups.append((h, tuple(ordered)))
    groups.sort(key=lambda hr: min(hr[1]))
    return HostGroups(hosts=tuple(h for h, _ in groups), ranks=tuple(r for _, r in groups))


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def gather_host_info(group=None, *, hostname: str | None = None) -> HostGroups:
    """Gather ``(hostname, LOCAL_RANK, LOCAL_WORLD_SIZE)`` from every rank of ``group`` (default:
    the world) with one ``all_gather_object`` and group them with :func:`group_ranks_by_host`.

    ``hostname`` defaults to ``socket.gethostname()``; an emulated cluster whose "nodes" share one
    kernel passes its own node names. Every rank receives the same list, so a bad layout raises
    the same ``ValueError`` on all ranks (nobody is left waiting). Imports ``torch.distributed``
    here only, so the rest of this module stays importable without it.
    """
    import socket

    import torch.distributed as dist  # lazy: detection parsing must not need torch.distributed

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gather_host_info needs an initialised torch.distributed process group")
    mine = (hostname or socket.gethostname(), _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE"))
    size = dist.get_world_size(group)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    global_ranks = [dist.get_global_rank(group, i) for i in range(size)] if group is not None else list(range(size))
    lrs = [g[1] for g in gathered]
    lwss = [g[2] for g in gathered]
    return group_ranks_by_host(
        [g[0] for g in gathered],
        ranks=global_ranks,
        local_ranks=lrs if any(x is not None for x in lrs) else None,
        local_world_sizes=lwss,
    )


# --- DetectedNode -> Topology ----------------------------------------------------------------

_TREE_LEVEL = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 2, "SYS": 3}
_RDMA_PREFIXES = ("mlx", "ib", "hfi", "bnxt_re", "irdma", "efa", "qedr", "erdma")
#: Latencies (s) of the links we create; NIC latency is the model's default.
_NVLINK_LATENCY = 1e-6
_PCIE_LATENCY = 1e-6
_SYS_LATENCY = 2e-6


def _nic_kind(name: str) -> str:
    """``ib`` for RDMA device names (``mlx5_0``, ``ib0``, ``hfi1_0`` ...), else ``ethernet``."""
    return "ib" if name.lower().startswith(_RDMA_PREFIXES) else "ethernet"


def _pcie_tree_links(devices: Sequence[str], paths: Mapping[frozenset, str], leaf_gbps: float) -> list:
    """Rebuild a PCIe tree over ``devices`` from pairwise path tokens and return model Links.

    Algorithm (the tokens form an ultrametric: PIX < PXB < PHB/NODE < SYS): for level 0 (PIX),
    1 (PXB) and 2 (PHB/NODE) group devices by union-find over pairs at that level or closer.
    Every PIX/PXB group of two or more devices that is not the same set as a group one level down
    becomes a PCIe switch vertex ``pcisw#``; every level-2 group becomes a root complex ``cpu#``
    (one per NUMA node/socket). Each device or vertex links to the smallest vertex strictly above
    it. Root complexes are joined pairwise by an SMP link (SYS). Pairs with no token (NVLink pairs
    in nvidia-smi) only meet where other tokens put them. Bandwidths per direction: links into a
    switch ``leaf_gbps``; into a root complex ``DEFAULT_PCIE_GBPS['NODE']``; SMP
    ``DEFAULT_PCIE_GBPS['SYS']`` (both capped at ``leaf_gbps``) - so with the default leaf speed
    the bottleneck between two GPUs is the table's value for their token.
    """
    from megatron_fcp.topology.model import GB, Link

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

    bw_into = {0: leaf_gbps, 1: leaf_gbps, 2: min(leaf_gbps, DEFAULT_PCIE_GBPS["NODE"])}
    smp_gbps = min(leaf_gbps, DEFAULT_PCIE_GBPS["SYS"])
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
            links.append(Link(f"cpu{i}", f"cpu{j}", "pcie", smp_gbps * GB, _SYS_LATENCY))
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


def _check_speeds(**speeds: float | None) -> None:
    for arg, value in speeds.items():
        if value is not None and not value > 0:
            raise ValueError(f"{arg}={value!r}: a bandwidth must be > 0 GB/s (leave it unset for the default)")


def layout_to_topology(
    node: DetectedNode,
    *,
    nodes: int = 1,
    hosts: HostGroups | None = None,
    gpus: int | None = None,
    nvlink_gbps_per_link: float | None = None,
    pcie_gbps: float | None = None,
    nic_gbps: float | None = None,
    name: str | None = None,
):
    """Build a :class:`~megatron_fcp.topology.model.Topology` of ``nodes`` copies of ``node``.

    Vertices are ``gpu#`` (local GPU index = local rank, torchrun's convention), the NICs some GPU
    uses (storage NICs are left out: they carry no GPU traffic), ``nvswitch`` when GPUs are
    switched, and the PCIe switches / root complexes that :func:`_pcie_tree_links` rebuilds.
    NVLink bandwidth = links x per-link speed (``nvlink_gbps_per_link`` overrides what the source
    said; default :data:`DEFAULT_NVLINK_GBPS_PER_LINK`). PCIe device links (GPU/NIC to switch):
    ``pcie_gbps``, else the source's, else ``DEFAULT_PCIE_GBPS['PIX']``. NIC speed: ``nic_gbps``,
    else the source's, else :data:`DEFAULT_NIC_GBPS`. Explicit arguments win over the source.
    ``gpus`` keeps local GPUs ``0..gpus-1`` (fewer ranks than GPUs per node). ``hosts`` (from
    hostnames, covering the whole world) sets the node count and the rank map.
    """
    from megatron_fcp.topology.model import GB, Link, Nic, NodeLayout, Topology, TopologyError

    _check_speeds(nvlink_gbps_per_link=nvlink_gbps_per_link, pcie_gbps=pcie_gbps, nic_gbps=nic_gbps)

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
    per_link = nvlink_gbps_per_link or node.nvlink_gbps_per_link or DEFAULT_NVLINK_GBPS_PER_LINK
    gpu_names = [f"gpu{i}" for i in range(g)]
    links = []
    switched = [i for i in range(g) if node.nvswitch_links and node.nvswitch_links[i] > 0]
    if len(switched) >= 2:
        for i in switched:
            links.append(Link(f"gpu{i}", "nvswitch", "nvswitch", node.nvswitch_links[i] * per_link * GB, _NVLINK_LATENCY))
    for (i, j), pl in sorted(node.pairs.items()):
        if j < g and pl.kind == "nvlink":
            links.append(Link(f"gpu{i}", f"gpu{j}", "nvlink", pl.nvlinks * per_link * GB, _NVLINK_LATENCY))

    used = []
    for i in range(g):
        nic = node.gpu_nic[i]
        if nic is not None and nic not in used:
            used.append(nic)
    leaf = pcie_gbps or node.pcie_gbps or DEFAULT_PCIE_GBPS["PIX"]
    links += _pcie_tree_links(gpu_names + used, node.pcie_paths, leaf)
    nics = []
    for nic_name in used:
        info = node.nic(nic_name)
        speed = nic_gbps or info.speed_gbps or DEFAULT_NIC_GBPS
        nics.append(Nic(nic_name, _nic_kind(nic_name), speed * GB))
    gpu_nic = tuple(used.index(node.gpu_nic[i]) for i in range(g)) if used else ()
    layout = NodeLayout(g, tuple(links), tuple(nics), gpu_nic, name or node.source)
    rank_map = _rank_map(hosts) if hosts is not None else ()
    try:
        return Topology(name or node.source, layout, nodes, rank_map)
    except TopologyError as exc:
        raise TopologyError(f"{node.source}: {exc}") from None


# --- detect_topology -------------------------------------------------------------------------

#: Hostnames-only fallback: GPUs on one NVSwitch at this many GB/s per direction (NVLink3, 12
#: links) and one HDR NIC per GPU (:data:`DEFAULT_NIC_GBPS`), as on a DGX-A100.
DEFAULT_UNIFORM_INTRA_GBPS = 300.0


@functools.lru_cache(maxsize=None)
def _log_once(msg: str) -> None:
    """Log each distinct assumption once per process (the cache is the memory; tests clear it)."""
    log.warning(msg)


def uniform_topology(nodes: int, gpus_per_node: int, *, intra_gbps: float = DEFAULT_UNIFORM_INTRA_GBPS,
                     nic_gbps: float = DEFAULT_NIC_GBPS, hosts: HostGroups | None = None):
    """The hostnames-only assumption: ``nodes`` nodes of ``gpus_per_node`` GPUs on one NVSwitch
    (``intra_gbps`` per direction) with one NIC per GPU (``nic_gbps``), rail-aligned."""
    from megatron_fcp.topology.model import GB, Link, Nic, NodeLayout, Topology

    links, nics = [], []
    for i in range(gpus_per_node):
        if gpus_per_node > 1:
            links.append(Link(f"gpu{i}", "nvswitch", "nvswitch", intra_gbps * GB, _NVLINK_LATENCY))
        links.append(Link(f"gpu{i}", f"nic{i}", "pcie", DEFAULT_PCIE_GBPS["PIX"] * GB, _PCIE_LATENCY))
        nics.append(Nic(f"nic{i}", "ib", nic_gbps * GB))
    layout = NodeLayout(gpus_per_node, tuple(links), tuple(nics), tuple(range(gpus_per_node)), "uniform")
    rank_map = _rank_map(hosts) if hosts is not None else ()
    return Topology(f"uniform:{nodes}", layout, nodes, rank_map)


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
    nvlink_gbps_per_link: float | None = None,
    pcie_gbps: float | None = None,
    nic_gbps: float | None = None,
):
    """Describe the cluster; the first source given wins (Note [Resolution order of detect_topology]).

    ``source``: ``PRESET[:NODES]`` or a YAML path (:func:`~megatron_fcp.topology.model.load_topology`).
    ``nccl_xml`` / ``nvidia_smi``: a file path or the text itself. ``probe``: run
    ``nvidia-smi topo -m`` when no file is given. ``hosts``: a :class:`HostGroups` (from
    :func:`gather_host_info`) or a hostname list, giving the node count and rank map; else
    ``nodes`` (default 1). ``gpus_per_node``: ranks per node when no hostnames are given (a
    detected layout keeps local GPUs ``0..gpus_per_node-1``; the uniform assumption uses that
    many GPUs, default 1). Detected layouts are assumed identical on every node.
    """
    from megatron_fcp.topology.presets import PRESETS, load_topology

    _check_speeds(nvlink_gbps_per_link=nvlink_gbps_per_link, pcie_gbps=pcie_gbps, nic_gbps=nic_gbps)
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
        if has_nvlink and layout.nvlink_gbps_per_link is None and nvlink_gbps_per_link is None:
            assumed.append(f"{DEFAULT_NVLINK_GBPS_PER_LINK:g} GB/s per NVLink (GPU generation unknown; nvlink_gbps_per_link=)")
        if layout.pcie_gbps is None and pcie_gbps is None:
            assumed.append(f"PCIe {DEFAULT_PCIE_GBPS['PIX']:g} GB/s (4.0 x16; pcie_gbps=)")
        if nic_gbps is None and any(n.speed_gbps is None for n in layout.nics if n.gpus):
            assumed.append(f"NIC {DEFAULT_NIC_GBPS:g} GB/s (HDR 200 Gb/s; nic_gbps=)")
        if assumed:
            _log_once(f"{layout.source}: assuming " + ", ".join(assumed) + " per direction")
        return layout_to_topology(layout, nodes=n_nodes, hosts=hosts, gpus=gpus_per_node, name=label,
                                  nvlink_gbps_per_link=nvlink_gbps_per_link, pcie_gbps=pcie_gbps, nic_gbps=nic_gbps)

    g = hosts.ranks_per_node if hosts is not None else (gpus_per_node or 1)
    intra = DEFAULT_UNIFORM_INTRA_GBPS
    nic = nic_gbps or DEFAULT_NIC_GBPS
    _log_once(
        f"no topology source (YAML/preset, NCCL XML, nvidia-smi): assuming {n_nodes} uniform node(s) x {g} GPU(s), "
        f"NVSwitch {intra:g} GB/s and one {nic:g} GB/s NIC per GPU (per direction); "
        f"pass --topology PRESET:NODES or a YAML file to describe the cluster"
    )
    return uniform_topology(n_nodes, g, intra_gbps=intra, nic_gbps=nic, hosts=hosts)
