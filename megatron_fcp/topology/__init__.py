"""Cluster topology: the model (:mod:`.model`, :mod:`.units`, :mod:`.errors`), preset clusters
(:mod:`.presets`), detection (:mod:`.detect`) and communication graphs (:mod:`.graph`).

Import the model's names from here; ``graph`` and ``detect`` are imported on use.
"""

from megatron_fcp.topology.errors import TopologyError  # noqa: F401
from megatron_fcp.topology.model import (  # noqa: F401
    LINK_KINDS,
    REF_BYTES,
    Link,
    Nic,
    NodeLayout,
    Resource,
    Route,
    Topology,
)
from megatron_fcp.topology.presets import PRESETS, load_topology, preset  # noqa: F401
from megatron_fcp.topology.units import GB, parse_bandwidth, parse_latency  # noqa: F401

__all__ = [
    "GB", "LINK_KINDS", "PRESETS", "REF_BYTES", "Link", "Nic", "NodeLayout", "Resource", "Route",
    "Topology", "TopologyError", "load_topology", "parse_bandwidth", "parse_latency", "preset",
]
