"""What a detection source says about one node, before it becomes a Topology.

:class:`DetectedNode` is plain data (no model objects): the link kind between every pair of local
GPUs, the PCIe path between devices, which NIC each GPU uses and the speeds the source gave. The
parsers (:mod:`.nvidia_smi`, :mod:`.nccl_xml`) produce it; :mod:`.build` turns it into a
:class:`~megatron_fcp.topology.model.Topology`. The default speeds assumed when a source does not
give them live here, in GB/s (gigabytes per second) per direction.

Note [NIC placement]
--------------------
Each GPU takes the NIC(s) at its smallest PCIe distance; among equally close NICs it takes the one
with the fewest GPUs so far (so two GPUs behind a switch with two NICs get one each, as on a
DGX-A100). If that distance is PIX or PXB the GPU has a direct (GPUDirect) path; otherwise it
still uses that NIC but through the host (``NicInfo.paths`` records which). Several GPUs on one NIC
means they share one uplink. Both parsers place NICs with :func:`place_nics`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

__all__ = [
    "PATH_KINDS",
    "NVLINK_GBYTES_PER_S_PER_LINK_BY_SM",
    "DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK",
    "DEFAULT_PCIE_GBYTES_PER_S",
    "DEFAULT_NIC_GBYTES_PER_S",
    "TopologyParseError",
    "PairLink",
    "NicInfo",
    "DetectedNode",
]


class TopologyParseError(ValueError):
    """Input text/XML is malformed; the message names the source, line and field at fault."""


#: nvidia-smi path token -> our pair kind, closest first. (nvidia-smi's ``SOC`` is ``SYS``.)
PATH_KINDS: Mapping[str, str] = {
    "PIX": "pcie-switch",  # behind one PCIe switch
    "PXB": "pcie-bridges",  # a tree of PCIe switches, no host bridge
    "PHB": "pcie-host",  # through the CPU's host bridge
    "NODE": "pcie-node",  # between host bridges of one NUMA node
    "SYS": "cross-socket",  # across the SMP interconnect
}
_PATH_ORDER = ("PIX", "PXB", "PHB", "NODE", "SYS")  # closest first
_DIRECT_NIC_PATHS = ("PIX", "PXB")  # GPUDirect RDMA-capable placement

#: Nominal NVLink bandwidth per link and direction (GB/s) by the GPU's SM version (NCCL XML's
#: ``sm`` attribute, ``major * 10 + minor``). Looked up exactly: an SM not listed has no NVLink at
#: these rates (sm89 Ada, sm120 Blackwell workstation) or is unknown, and the default is used and
#: reported. Sources (vendor data sheets, total bidirectional / 2 / links):
#:   sm60 P100 NVLink1: 160 GB/s over 4 links -> 20
#:   sm70 V100 NVLink2: 300 GB/s over 6 links -> 25
#:   sm75 TU102 (Quadro RTX 8000/6000) NVLink bridge: 100 GB/s over 2 links -> 25
#:   sm80 A100 NVLink3: 600 GB/s over 12 links -> 25
#:   sm86 GA102 (RTX A6000/A40/3090) NVLink bridge: 112.5 GB/s over 4 links -> 14.0625
#:   sm90 H100/H200/H20 NVLink4: 900 GB/s over 18 links -> 25
#:   sm100 B200 and sm103 B300 NVLink5: 1.8 TB/s over 18 links -> 50
NVLINK_GBYTES_PER_S_PER_LINK_BY_SM: Mapping[int, float] = {
    60: 20.0, 70: 25.0, 75: 25.0, 80: 25.0, 86: 14.0625, 90: 25.0, 100: 50.0, 103: 50.0,
}
#: Used when the GPU generation is unknown (nvidia-smi text does not name it): NVLink2-4.
DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK = 25.0

#: GPU<->GPU peer bandwidth per direction (GB/s) over PCIe, by path. PCIe 4.0 x16 gives ~25 GB/s
#: through a switch; through the host bridge / across sockets peer traffic is slower.
DEFAULT_PCIE_GBYTES_PER_S: Mapping[str, float] = {
    "PIX": 25.0,
    "PXB": 25.0,
    "PHB": 20.0,
    "NODE": 20.0,
    "SYS": 12.0,
}
#: NIC speed per direction (GB/s) when the source does not say: HDR InfiniBand 200 Gb/s.
DEFAULT_NIC_GBYTES_PER_S = 25.0


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
    direct GPUDirect path, ``PHB``/``NODE``/``SYS`` goes through the host) and its
    ``speed_gbytes_per_s`` per direction (GB/s; None: the source did not say). ``kind`` is the
    model's NIC kind (``ib`` = an RDMA device: InfiniBand, RoCE or EFA; ``ethernet`` = a socket
    NIC) or None when the source cannot tell; ``gdr`` False when the source says GPUDirect RDMA is
    off for it (traffic is staged through host memory), None when it does not say; ``numa`` the
    NUMA node it hangs off when known. A NIC no GPU uses (a storage NIC) has no gpus."""

    name: str
    gpus: tuple[int, ...]
    paths: tuple[str, ...]
    speed_gbytes_per_s: float | None = None
    kind: str | None = None
    gdr: bool | None = None
    numa: int | None = None

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
    one (nvidia-smi hides it behind ``NV#`` for NVLink pairs); ``nvlink_gbytes_per_s_per_link`` is
    None when the source did not say which GPU generation it is; ``pcie_gbytes_per_s`` is the
    devices' PCIe link speed per direction when the source gives it (NCCL XML ``link_speed`` x
    ``link_width``). Speeds are GB/s (gigabytes per second). ``numa[i]`` is GPU ``i``'s NUMA node
    when the source gives it. ``guesses`` are one-line reports of what the parser had to guess
    (a tie in NIC placement, a NIC kind), each naming the flag or YAML key that fixes it
    (Note [Guesses are reported] in :mod:`megatron_fcp.topology.detect`).
    """

    num_gpus: int
    pairs: Mapping[tuple[int, int], PairLink]
    nics: tuple[NicInfo, ...]
    gpu_nic: tuple[str | None, ...]
    nvswitch_links: tuple[int, ...] = ()
    pcie_paths: Mapping[frozenset, str] = field(default_factory=dict)
    nvlink_gbytes_per_s_per_link: float | None = None
    pcie_gbytes_per_s: float | None = None
    source: str = ""
    numa: tuple[int | None, ...] = ()
    guesses: tuple[str, ...] = ()

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

    def pair_bandwidth_gbytes_per_s(
        self, i: int, j: int, pcie_by_path: Mapping[str, float] = DEFAULT_PCIE_GBYTES_PER_S
    ) -> float:
        """Per-direction bandwidth between GPUs ``i`` and ``j``: ``nvlinks * per-link`` for NVLink
        (default per-link speed when the generation is unknown), the PCIe table otherwise."""
        pl = self.link(i, j)
        if pl.is_nvlink:
            per_link = self.nvlink_gbytes_per_s_per_link or DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK
            return pl.nvlinks * per_link
        return pcie_by_path[pl.path]

    def kind_matrix(self) -> list[list[str]]:
        """``num_gpus x num_gpus`` nvidia-smi style tokens (``X`` on the diagonal)."""
        g = self.num_gpus
        return [["X" if i == j else self.link(i, j).path for j in range(g)] for i in range(g)]

    def uplinks_shared(self) -> bool:
        """True when at least one NIC carries several GPUs (a shared node uplink)."""
        return any(nic.shared for nic in self.nics)


def _nic_numa(
    gpu_nic_paths: Sequence[Mapping[str, str]],
    nic_names: Sequence[str],
    gpu_numa: Sequence[int | None],
    nic_pairs: Mapping[frozenset, str],
) -> tuple[dict[str, int | None], bool]:
    """NUMA node of each NIC and whether it was inferred from NIC order.

    1. that of the GPUs it reaches without crossing sockets (path not SYS);
    2. else that of a NIC it reaches without crossing sockets;
    3. else, when no NIC is placed so (every GPU-NIC path SYS, as on a GB200 tray whose GPU
       memory is a NUMA node of its own), the NIC groups that reach each other without SYS are
       matched to the GPUs' NUMA nodes in order (lowest NIC index to the lowest node) when their
       counts agree: an inference, reported by :func:`place_nics`.
    None when nothing tells (or the sources disagree)."""
    numa: dict[str, int | None] = {}
    for n in nic_names:
        seen = {gpu_numa[g] for g, p in enumerate(gpu_nic_paths)
                if g < len(gpu_numa) and gpu_numa[g] is not None and p.get(n, "SYS") != "SYS"}
        numa[n] = seen.pop() if len(seen) == 1 else None
    for n in nic_names:
        if numa[n] is None:
            seen = {numa[m] for m in nic_names if m != n and numa[m] is not None
                    and nic_pairs.get(frozenset((n, m)), "SYS") != "SYS"}
            numa[n] = seen.pop() if len(seen) == 1 else None
    nodes = sorted({x for x in gpu_numa if x is not None})
    if nic_names and all(v is None for v in numa.values()) and len(nodes) > 1:
        groups: list[list[str]] = []
        for n in nic_names:
            home = next((grp for grp in groups if any(nic_pairs.get(frozenset((n, m)), "SYS") != "SYS" for m in grp)), None)
            if home is None:
                groups.append([n])
            else:
                home.append(n)
        if len(groups) == len(nodes):
            for node_id, grp in zip(nodes, groups):
                for n in grp:
                    numa[n] = node_id
            return numa, True
    return numa, False


def _cards(nic_names: Sequence[str], nic_pairs: Mapping[frozenset, str]) -> dict[str, int]:
    """Card index of each NIC: NICs one PCIe bridge apart (PIX: two ports of one adapter, or two
    adapters behind one switch) share a card and so its PCIe link."""
    card = {n: k for k, n in enumerate(nic_names)}
    for pair, tok in nic_pairs.items():
        a, b = tuple(pair)
        if tok == "PIX" and a in card and b in card:
            old, new = card[a], card[b]
            for n in card:
                if card[n] == old:
                    card[n] = new
    return card


def place_nics(
    gpu_nic_paths: Sequence[Mapping[str, str]],
    nic_names: Sequence[str],
    speeds: Mapping[str, float | None],
    *,
    gpu_numa: Sequence[int | None] = (),
    nic_pairs: Mapping[frozenset, str] | None = None,
    kinds: Mapping[str, str | None] | None = None,
    gdr: Mapping[str, bool | None] | None = None,
) -> tuple[tuple[NicInfo, ...], tuple[str | None, ...], tuple[str, ...]]:
    """Give every GPU its closest NIC, balancing GPUs over equally close NICs (Note [NIC placement]).

    ``gpu_nic_paths[g][nic]`` is a path token in :data:`_PATH_ORDER`; ``speeds[nic]`` is the NIC's
    GB/s per direction, or None when the source did not say; ``gpu_numa[g]`` the GPU's NUMA node
    (None: unknown); ``nic_pairs`` the NIC-NIC path tokens (frozenset of two names -> token).

    Among the equally close NICs a GPU takes, in this order: one on its own NUMA node (unknown
    counts as neither), one on the card with the fewest GPUs so far (:func:`_cards`), the NIC with
    the fewest GPUs so far, the first. Returns ``(nics, gpu_nic, guesses)``: a guess line for every
    GPU that had no direct (PIX/PXB) NIC and several equally close ones, and one when GPUs use two
    NICs of one card while a NIC as close to them stays unused.
    """
    nic_pairs = nic_pairs or {}
    numa, inferred = _nic_numa(gpu_nic_paths, nic_names, gpu_numa, nic_pairs)
    card = _cards(nic_names, nic_pairs)
    users: dict[str, list[tuple[int, str]]] = {n: [] for n in nic_names}
    card_users: dict[int, int] = {}
    choice: list[str | None] = []
    guesses: list[str] = []
    candidates: dict[int, list[str]] = {}
    for g, paths in enumerate(gpu_nic_paths):
        if not paths:
            choice.append(None)
            continue
        best = min(_PATH_ORDER.index(p) for p in paths.values())
        closest = [n for n in nic_names if n in paths and _PATH_ORDER.index(paths[n]) == best]
        gn = gpu_numa[g] if g < len(gpu_numa) else None

        def key(n: str) -> tuple:
            same = 1 if gn is None or numa[n] is None else (0 if numa[n] == gn else 2)
            return (same, card_users.get(card[n], 0), len(users[n]), nic_names.index(n))

        nic = min(closest, key=key)
        candidates[g] = closest
        users[nic].append((g, paths[nic]))
        card_users[card[nic]] = card_users.get(card[nic], 0) + 1
        choice.append(nic)
        if len(closest) > 1 and _PATH_ORDER[best] not in _DIRECT_NIC_PATHS:
            how = "its NUMA node, then card load" if gn is not None and numa[nic] == gn else "card load"
            guesses.append(
                f"gpu{g} -> {nic}: a tie, {len(closest)} NICs equally close ({_PATH_ORDER[best]}: "
                f"{', '.join(closest)}); picked by {how}, then order - fix with --gpu-nic "
                f"NIC,NIC,... (one per GPU) or node.gpu_nic in the YAML (--yaml-out)"
            )
    if inferred:
        guesses.append(
            "NIC NUMA nodes: no GPU reaches a NIC without crossing sockets, so the NIC groups "
            f"{sorted(set(numa.values()))} were matched to the GPUs' NUMA nodes in NIC order - fix with --gpu-nic "
            "or node.gpu_nic in the YAML if the NICs are numbered otherwise"
        )
    for c in sorted(set(card.values())):
        members = [n for n in nic_names if card[n] == c and users[n]]
        on_card = [g for n in members for g, _ in users[n]]
        unused = [n for n in nic_names if not users[n] and any(n in candidates[g] for g in on_card)]
        if len(members) > 1 and unused:
            guesses.append(
                f"{' and '.join(members)} share one card (PIX) and carry GPUs "
                f"{sorted(g for n in members for g, _ in users[n])} while {', '.join(unused)} carry none: "
                f"they share that card's PCIe link - fix with --gpu-nic or node.gpu_nic in the YAML if other NICs are meant"
            )
    nics = tuple(
        NicInfo(
            name=n,
            gpus=tuple(g for g, _ in users[n]),
            paths=tuple(p for _, p in users[n]),
            speed_gbytes_per_s=speeds.get(n),
            kind=(kinds or {}).get(n),
            gdr=(gdr or {}).get(n),
            numa=numa[n],
        )
        for n in nic_names
    )
    return nics, tuple(choice), tuple(guesses)
