"""Cluster topology (:mod:`.model`), detection (:mod:`.detect`) and communication graphs (:mod:`.graph`).

The model is re-exported here; ``graph`` and ``detect`` are imported on use.
"""

from megatron_fcp.topology.model import (  # noqa: F401
    GB,
    LINK_KINDS,
    PRESETS,
    REF_BYTES,
    Link,
    Nic,
    NodeLayout,
    Resource,
    Route,
    Topology,
    TopologyError,
    load_topology,
    parse_bandwidth,
    parse_latency,
    preset,
)

__all__ = [
    "GB", "LINK_KINDS", "PRESETS", "REF_BYTES", "Link", "Nic", "NodeLayout", "Resource", "Route",
    "Topology", "TopologyError", "load_topology", "parse_bandwidth", "parse_latency", "preset",
]
