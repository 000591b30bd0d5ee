"""The topology file format: :class:`~megatron_fcp.topology.model.Topology` to and from plain
dicts and YAML, with errors that name the field (``node.links[0].kind``) and the file.

A file holds ``name``, ``nodes``, ``node`` (the :class:`~megatron_fcp.topology.model.NodeLayout`:
``gpus``, ``links``, ``nics``, ``gpu_nic``, ``name``), ``rank_map`` (written only when it is not
the torchrun order), ``fabric_latency`` and ``nvlink_domain`` (hosts per NVLink domain, with
``node.domain_switch``; written only when > 1). A field left out takes the dataclass default, so the
defaults live in :mod:`megatron_fcp.topology.model` only. Bandwidths and latencies accept units
(:func:`~megatron_fcp.topology.units.parse_bandwidth`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from megatron_fcp.topology.errors import TopologyError
from megatron_fcp.topology.model import Link, Nic, NodeLayout, Topology

__all__ = ["to_dict", "from_dict", "to_yaml", "from_yaml"]

_LINK_FIELDS = ("a", "b", "kind", "bandwidth", "latency")
_NIC_FIELDS = ("name", "kind", "bandwidth", "latency")


def _layout_to_dict(layout: NodeLayout) -> dict:
    d: dict[str, Any] = {"gpus": layout.gpus}
    if layout.name:
        d["name"] = layout.name
    d["links"] = [{k: getattr(ln, k) for k in _LINK_FIELDS} for ln in layout.links]
    d["nics"] = [{k: getattr(n, k) for k in _NIC_FIELDS} for n in layout.nics]
    if layout.nics:
        d["gpu_nic"] = list(layout.gpu_nic)
    if layout.domain_switch:
        d["domain_switch"] = layout.domain_switch
    return d


def _build(cls, raw: Mapping, where: str):
    """``cls(**raw)`` with the error prefixed by ``where``; names are strings."""
    kwargs = {k: (str(v) if k in ("a", "b", "name") else v) for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except TopologyError as e:
        raise TopologyError(f"{where}: {e}") from None


def _layout_from_dict(d: Any) -> NodeLayout:
    where = "node"
    if not isinstance(d, Mapping):
        raise TopologyError(f"{where}: expected a mapping with gpus/links/nics, got {type(d).__name__}")
    unknown = set(d) - {"gpus", "links", "nics", "gpu_nic", "name", "domain_switch"}
    if unknown:
        raise TopologyError(f"{where}: unknown field(s) {sorted(unknown)}; expected gpus, links, nics, gpu_nic, name, "
                            f"domain_switch")
    if "gpus" not in d:
        raise TopologyError(f"{where}.gpus: missing (number of GPUs per node)")
    gpus = d["gpus"]
    if not isinstance(gpus, int) or isinstance(gpus, bool):
        raise TopologyError(f"{where}.gpus: must be an integer, got {gpus!r}")
    links = []
    raw_links = d.get("links") or []
    if not isinstance(raw_links, list):
        raise TopologyError(f"{where}.links: expected a list")
    for i, ln in enumerate(raw_links):
        if not isinstance(ln, Mapping):
            raise TopologyError(f"{where}.links[{i}]: expected a mapping with a, b, kind, bandwidth")
        for req in ("a", "b", "kind", "bandwidth"):
            if req not in ln:
                raise TopologyError(f"{where}.links[{i}].{req}: missing")
        extra = set(ln) - set(_LINK_FIELDS)
        if extra:
            raise TopologyError(f"{where}.links[{i}]: unknown field(s) {sorted(extra)}")
        links.append(_build(Link, ln, f"{where}.links[{i}]"))
    nics = []
    raw_nics = d.get("nics") or []
    if not isinstance(raw_nics, list):
        raise TopologyError(f"{where}.nics: expected a list")
    for i, n in enumerate(raw_nics):
        if not isinstance(n, Mapping) or "name" not in n:
            raise TopologyError(f"{where}.nics[{i}].name: missing")
        extra = set(n) - set(_NIC_FIELDS)
        if extra:
            raise TopologyError(f"{where}.nics[{i}]: unknown field(s) {sorted(extra)}")
        nics.append(_build(Nic, n, f"{where}.nics[{i}]"))
    gpu_nic = d.get("gpu_nic") or ()
    if not isinstance(gpu_nic, (list, tuple)) or not all(isinstance(k, int) for k in gpu_nic):
        raise TopologyError(f"{where}.gpu_nic: expected a list of NIC indices, got {gpu_nic!r}")
    return NodeLayout(gpus, tuple(links), tuple(nics), tuple(gpu_nic), str(d.get("name", "")),
                      domain_switch=str(d.get("domain_switch", "")))


def to_dict(topo: Topology) -> dict:
    """Plain-data form of ``topo`` (what :func:`to_yaml` writes)."""
    d: dict[str, Any] = {"name": topo.name, "nodes": topo.nodes, "node": _layout_to_dict(topo.layout)}
    g = topo.layout.gpus
    if topo.rank_map != tuple((r // g, r % g) for r in range(topo.nodes * g)):
        d["rank_map"] = [list(x) for x in topo.rank_map]
    d["fabric_latency"] = topo.fabric_latency
    if topo.nvlink_domain > 1:
        d["nvlink_domain"] = topo.nvlink_domain
    return d


def from_dict(d: Any) -> Topology:
    """A :class:`Topology` from the plain-data form; errors name the field."""
    if not isinstance(d, Mapping):
        raise TopologyError(f"topology: expected a mapping at the top level, got {type(d).__name__}")
    unknown = set(d) - {"name", "nodes", "node", "rank_map", "fabric_latency", "nvlink_domain"}
    if unknown:
        raise TopologyError(f"topology: unknown field(s) {sorted(unknown)}; expected name, nodes, node, rank_map, "
                            f"fabric_latency, nvlink_domain")
    if "node" not in d:
        raise TopologyError("node: missing (the per-node layout: gpus, links, nics)")
    layout = _layout_from_dict(d["node"])
    nodes = d.get("nodes", 1)
    if not isinstance(nodes, int) or isinstance(nodes, bool):
        raise TopologyError(f"nodes: must be an integer, got {nodes!r}")
    rank_map = d.get("rank_map") or ()
    if not isinstance(rank_map, (list, tuple)):
        raise TopologyError("rank_map: expected a list of [node, local_rank] pairs")
    for r, entry in enumerate(rank_map):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in entry
        ):
            raise TopologyError(f"rank_map[{r}]: expected [node, local_rank] integers, got {entry!r}")
    extra = {k: d[k] for k in ("fabric_latency", "nvlink_domain") if k in d}
    return Topology(str(d.get("name", "custom")), layout, nodes, tuple(tuple(e) for e in rank_map), **extra)


def to_yaml(topo: Topology, path: str | Path | None = None) -> str:
    """YAML text of :func:`to_dict`; also written to ``path`` when given."""
    import yaml

    text = yaml.safe_dump(to_dict(topo), sort_keys=False)
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def from_yaml(text_or_path: str | Path) -> Topology:
    """Parse YAML text or a ``.yaml``/``.yml`` file path; errors name the field (and the file)."""
    import yaml

    src = "<yaml>"
    text = str(text_or_path)
    if isinstance(text_or_path, Path) or ("\n" not in text and Path(text).suffix in (".yaml", ".yml")):
        p = Path(text_or_path)
        if not p.exists():
            raise TopologyError(f"topology file {p}: not found")
        src, text = str(p), p.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TopologyError(f"{src}: malformed YAML: {e}") from None
    try:
        return from_dict(data)
    except TopologyError as e:
        raise TopologyError(f"{src}: {e}") from None
