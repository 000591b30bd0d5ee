"""NVLink domains larger than a host, from NVML's fabric info (GB200/GB300 NVL72).

Note [Detecting NVLink domains]
-------------------------------
On an NVL72 rack every GPU reports, through NVML's ``nvmlDeviceGetGpuFabricInfo``, the UUID of
the NVLink fabric cluster it belongs to and its clique id (the partition of that fabric it may
talk to). GPUs with the same ``(cluster UUID, clique id)`` reach each other over NVLink, across
trays. :func:`read_nvlink_fabric` reads that pair for local GPU 0 when ``pynvml`` is importable
and the fabric is registered (never required: it returns None otherwise, and on every machine
without a multi-node NVLink fabric). :func:`gather_host_info` gathers it with the hostnames, and
:func:`domain_size` turns the per-host ids into the model's ``nvlink_domain`` (hosts per domain,
consecutive hosts: Note [NVLink domains] in :mod:`megatron_fcp.topology.model`). Without NVML the
size comes from ``--nvlink-domain`` / the YAML's ``nvlink_domain``, and a guess is reported.
"""

from __future__ import annotations

import logging
from typing import Sequence

__all__ = ["read_nvlink_fabric", "domain_size"]

log = logging.getLogger(__name__)


def read_nvlink_fabric(device: int = 0) -> str | None:
    """``"<cluster uuid>/<clique id>"`` of local GPU ``device`` from NVML, or None when pynvml is
    missing, the driver has no fabric info, or the GPU is not in a registered multi-node fabric
    (an all-zero cluster UUID). Never raises."""
    try:
        import pynvml  # optional: nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device)
            info = pynvml.nvmlDeviceGetGpuFabricInfo(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVMLError, AttributeError on old pynvml: no fabric info
        log.debug("no NVLink fabric info from NVML (%s)", exc)
        return None
    if getattr(info, "state", 3) != 3:  # NVML_GPU_FABRIC_STATE_COMPLETED: registration finished
        return None
    uuid = bytes(info.clusterUuid)
    if not any(uuid):
        return None
    return f"{uuid.hex()}/{int(info.cliqueId)}"


def domain_size(fabric_ids: Sequence[str | None], hosts: Sequence[str] = ()) -> int | None:
    """Hosts per NVLink domain from one fabric id per host (in node order), or None when no host
    has one. Hosts with the same id are one domain; the model needs the domains to be runs of
    consecutive hosts of one size (the last run may be shorter: a partial rack). Raises
    ``ValueError`` naming the hosts and the fix otherwise."""
    if not fabric_ids or all(f is None for f in fabric_ids):
        return None
    names = list(hosts) or [f"node{k}" for k in range(len(fabric_ids))]
    if any(f is None for f in fabric_ids):
        missing = [names[k] for k, f in enumerate(fabric_ids) if f is None]
        raise ValueError(f"NVLink fabric: hosts {missing} report no NVLink fabric while others do; give "
                         f"--fcp-topology a YAML with nvlink_domain, or run within one kind of machine")
    runs: list[tuple[str, int]] = []
    for f in fabric_ids:
        if runs and runs[-1][0] == f:
            runs[-1] = (f, runs[-1][1] + 1)
        else:
            runs.append((f, 1))
    if len({f for f, _ in runs}) != len(runs):
        raise ValueError(f"NVLink fabric: the hosts of one NVLink domain are not consecutive in rank order "
                         f"({[f for f in fabric_ids]}); order the hostfile by rack or give a YAML rank_map")
    size = runs[0][1]
    if any(n != size for _, n in runs[:-1]) or runs[-1][1] > size:
        raise ValueError(f"NVLink fabric: domains of {[n for _, n in runs]} hosts; the model needs equal domains "
                         f"(a shorter last one allowed): describe the cluster with --fcp-topology FILE.yaml")
    return size
