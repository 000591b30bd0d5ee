"""Parser of ``nvidia-smi topo -m`` text (one node) into a :class:`~.node.DetectedNode`.

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

What real machines print, and how it is read (:func:`parse_nvidia_smi_topo`): ANSI escapes are
stripped; adjacent cells and headers printed without a separator (``NODENODE``, ``NIC8NIC9``) are
cut on the cell tokens and column names; the affinity columns are found by their header names; a
row with a missing or extra cell is refused (its columns cannot be placed without guessing), never
shifted; affinity values that do not fit the header only lose that GPU's NUMA node (reported).

NIC placement follows Note [NIC placement] in :mod:`.node`.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from typing import Mapping

from megatron_fcp.topology.detect.node import (
    PATH_KINDS,
    DetectedNode,
    PairLink,
    TopologyParseError,
    place_nics,
)

__all__ = ["NVLINK_MAX_LINKS_PER_GPU", "parse_nvidia_smi_topo", "read_nvidia_smi_topo"]

log = logging.getLogger(__name__)

_PATH_ALIASES = {"SOC": "SYS"}  # the pre-2017 name of SYS

#: Most NVLinks one GPU has (V100: 6, A100: 12, H100/B200: 18). More than this summed over a
#: GPU's peers means the count is the GPU's share of an NVSwitch fabric, not per pair.
NVLINK_MAX_LINKS_PER_GPU = 18


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


_NV_RE = re.compile(r"^NV(\d+)$")
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # CSI sequences: colours, underline, reset
_CELL_TOKENS = r"NV\d+|PIX|PXB|PHB|NODE|SYS|SOC|X"
#: The affinity columns nvidia-smi prints after the device columns, recognised by their header.
_AFFINITY_RE = re.compile(r"CPU\s*Affinity|GPU\s*NUMA\s*ID|NUMA(?:\s*Affinity)?")
#: Where a glued header chunk (``NIC8NIC9``, ``mlx5_0mlx5_1``) is cut: before every device-name
#: prefix other than at its start.
_NAME_CUT_RE = re.compile(r"(?<=.)(?=GPU\d|NIC\d|mlx\d|rdmap|hfi\d|bnxt_re|irdma|efa_|qedr|erdma|ionic)")
_FIX = ("save the output unedited (`nvidia-smi topo -m > topo.txt`, not copied from a terminal) "
        "or correct that line")


def _cell_token(raw: str, where: str) -> str:
    tok = _PATH_ALIASES.get(raw, raw)
    if tok == "X" or tok in PATH_KINDS or _NV_RE.match(tok):
        return tok
    raise TopologyParseError(
        f"{where}: unknown connection {raw!r}; expected X, NV#, PIX, PXB, PHB, NODE or SYS"
    )


def _header(line: str, where: str) -> tuple[list[str], list[str]]:
    """(device columns, affinity columns) of the header line (ANSI escapes already stripped).

    The affinity part starts at the first ``CPU Affinity`` / ``NUMA Affinity`` / ``GPU NUMA ID``;
    before it, whitespace-separated chunks are cut before each device-name prefix, so a glued
    ``NIC8NIC9`` is two columns."""
    m = _AFFINITY_RE.search(line)
    dev_part, tail = (line[: m.start()], line[m.start():]) if m else (line, "")
    columns = [name for chunk in dev_part.split() for name in _NAME_CUT_RE.split(chunk) if name]
    affinity = [re.sub(r"\s+", " ", a) for a in _AFFINITY_RE.findall(tail)]
    affinity = ["NUMA Affinity" if a == "NUMA" else a for a in affinity]  # some guides shorten the header
    left = _AFFINITY_RE.sub("", tail).strip()
    if left:
        raise TopologyParseError(
            f"{where}: header text {left!r} after the device columns is not CPU Affinity, NUMA Affinity "
            f"or GPU NUMA ID; {_FIX}"
        )
    return columns, affinity


def _split_row(line: str, columns: list[str]) -> tuple[list[str], list[str]]:
    """``(tokens, tail)`` of a matrix row: ``tokens`` the row label and the connection cells, each
    whitespace chunk cut into column names and cell tokens (``NODENODE`` -> NODE, NODE); ``tail``
    the chunks that are not made of those (affinity values such as ``0-55,112-167``, ``0``,
    ``N/A``), which must all come after the cells."""
    names = "|".join(re.escape(c) for c in sorted(columns, key=len, reverse=True))
    piece = re.compile(rf"(?:{names})|{_CELL_TOKENS}")
    whole = re.compile(rf"(?:(?:{names})|{_CELL_TOKENS})+")
    tokens: list[str] = []
    tail: list[str] = []
    for chunk in line.split():
        if not tail and whole.fullmatch(chunk):
            tokens += piece.findall(chunk)
        elif not tail and tokens and chunk != "N/A" and re.fullmatch(r"[A-Z][A-Za-z0-9_]*", chunk):
            tokens.append(chunk)  # an unknown connection: _cell_token names it and its column
        elif re.fullmatch(r"\d+N/A", chunk):  # NUMA Affinity glued to GPU NUMA ID: "0N/A"
            tail += [chunk[:-3], "N/A"]
        else:
            tail.append(chunk)
    return tokens, tail


def _numa_of(value: str) -> int | None:
    """The GPU's home NUMA node from its NUMA Affinity value: ``0``, or the first node of a list
    such as GB200's ``0,3-9,11-17`` (the CPU node first, then the GPU memory nodes); None for
    ``N/A`` or a range."""
    head = value.split(",", 1)[0]
    return int(head) if head.isdigit() else None


def parse_nvidia_smi_topo(
    text: str, *, source: str = "nvidia-smi topo -m", nvlink_gbytes_per_s_per_link: float | None = None
) -> DetectedNode:
    """Parse the text of ``nvidia-smi topo -m`` into a :class:`DetectedNode`.

    Algorithm: ANSI escapes (a terminal's underline/colour codes) are removed. The first line
    that names ``GPU0`` is the header: device columns, then the affinity columns recognised by
    their names (``CPU Affinity``, ``NUMA Affinity``, ``GPU NUMA ID``); a glued header chunk
    (``NIC8NIC9``) is cut before each device-name prefix. Each following row until a blank line or
    ``Legend:`` is ``LABEL cell* affinity*``: chunks are cut into column names and cell tokens
    (``NODENODE`` is two cells, ``NV18NV18`` too) and the chunks that are not made of them are the
    affinity values. A row must have exactly one cell per device column, and a GPU row exactly one
    value per affinity column; otherwise the row is refused with its line, the counts and the fix
    (a missing or extra cell cannot be placed, so columns are never shifted). GPU rows give the
    GPU x GPU matrix (checked symmetric with ``X`` on the diagonal), the GPU x NIC paths and each
    GPU's NUMA node; ``NIC#`` columns are renamed through the "NIC Legend" when present. NV counts
    are classified nvlink/nvswitch and NICs placed as Note [NIC placement] describes, the NUMA
    nodes breaking ties. ``nvlink_gbytes_per_s_per_link`` (GB/s) is kept as given (nvidia-smi does
    not name the GPU generation; None means "use the default", see
    :meth:`DetectedNode.pair_bandwidth_gbytes_per_s`).

    Raises :class:`TopologyParseError` naming ``source``, the line number, the cause and the fix.
    """
    lines = [_ANSI_RE.sub("", ln).replace("\x1b", "") for ln in text.splitlines()]
    cells_re = re.compile(rf"(?:{_CELL_TOKENS})+")
    header_idx = next((k for k, ln in enumerate(lines) if re.search(r"(?<![A-Za-z])GPU0(?!\d)", ln)
                       and not any(cells_re.fullmatch(c) for c in ln.split())), None)
    if header_idx is None:
        raise TopologyParseError(f"{source}: no header line naming GPU0 (is this `nvidia-smi topo -m` output?)")
    columns, affinity = _header(lines[header_idx], f"{source}: line {header_idx + 1}")
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
    numa: list[int | None] = [None] * n_gpu
    guesses: list[str] = []
    legend: dict[str, str] = {}
    k = header_idx + 1
    while k < len(lines) and lines[k].strip() and not lines[k].strip().startswith("Legend"):
        tokens, tail = _split_row(lines[k], columns)
        label = tokens[0] if tokens else lines[k].split()[0]
        where = f"{source}: line {k + 1} ({label})"
        if label not in columns:
            raise TopologyParseError(f"{where}: row label {label!r} is not a column of the header {columns}")
        if label in rows:
            raise TopologyParseError(f"{where}: duplicate row {label!r}")
        cells = tokens[1:]
        if len(cells) != len(columns):
            more = "an extra cell" if len(cells) > len(columns) else "a missing cell"
            raise TopologyParseError(
                f"{where}: {len(cells)} cells, expected {len(columns)} (one per device column "
                f"{columns[0]}..{columns[-1]}): {more} cannot be placed without guessing which column moved; {_FIX}"
            )
        if label in gpu_cols and len(tail) != len(affinity):
            # affinity values are not paths: a missing one (Slurm prints no CPU Affinity for GPUs
            # outside the job's cpuset) or a glued pair cannot shift a connection cell, but which
            # value is which is unknown, so the NUMA node is not used
            guesses.append(f"line {k + 1} ({label}): {len(tail)} affinity value(s) {tail} for the header's "
                           f"{affinity}; {label}'s NUMA node is unknown, so NIC ties ignore it - fix with "
                           f"--gpu-nic if a tie is reported")
        elif label in gpu_cols and "NUMA Affinity" in affinity:
            numa[gpu_cols.index(label)] = _numa_of(tail[affinity.index("NUMA Affinity")])
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
    nic_pairs = {p: t for p, t in pcie_paths.items() if not any(v.startswith("gpu") for v in p)}
    # nvidia-smi lists the RDMA devices (ibverbs) only: every NIC column is an RDMA NIC
    nics, gpu_nic, placed = place_nics(gpu_nic_paths, nic_names, {}, gpu_numa=numa, nic_pairs=nic_pairs,
                                       kinds={n: "ib" for n in nic_names})
    guesses += placed
    unnamed = [n for n in nic_names if re.fullmatch(r"NIC\d+", n)]
    if unnamed:
        guesses.append(f"NIC kind of {', '.join(unnamed)}: no device name (no NIC Legend); taken as RDMA (kind ib), "
                       f"as nvidia-smi lists RDMA devices only - fix with node.nics[].kind in the YAML (--yaml-out)")
    return DetectedNode(
        num_gpus=n_gpu,
        pairs=pairs,
        nics=nics,
        gpu_nic=gpu_nic,
        nvswitch_links=tuple(switched),
        pcie_paths=pcie_paths,
        nvlink_gbytes_per_s_per_link=nvlink_gbytes_per_s_per_link,
        source=source,
        numa=tuple(numa),
        guesses=tuple(guesses),
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
