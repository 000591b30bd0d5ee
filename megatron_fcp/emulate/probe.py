"""The link probe: how long one isolated message takes on each kind of emulated link, against the model.

Note [Link probe]
-----------------
Every emulated run starts with it (before the warm-up), so the JSON says how faithful its links were
(Note [Link bursts] in :mod:`megatron_fcp.emulate.netns`: a token bucket with credit let messages
through an idle link far faster than its rate, and no workload's time showed it). For each kind of
link the cluster has, one pair of ranks (:func:`probe_pairs`: ranks 0 and 1 inside node 0, ranks 0
and ``ranks_per_node``, the same rail, across nodes) and each size of :data:`PROBE_BYTES`,
:data:`PROBE_REPEATS` times::

    every rank: barrier
    receiver:   post the receive                      sender: sleep IDLE_S (the link idles, the
                                                              receive is posted), t0, send the message
    receiver:   wait, t1; receive t0 (a second message); time = t1 - t0 (one machine, one clock)

:func:`summarize` sets each median beside the cost model's time for the same message on the
emulated Topology (bytes over the route's narrowest bandwidth, at the goodput the model assumes,
plus its latency): ``ratio`` = measured / modelled. Measured on this machine over the 14
configurations of ``benchmarks/bench_emulated.py`` (2026-12-01, last run): inter 64 KB 0.92-0.94,
256 KB 0.94-0.99 (16 KB 0.76-0.85: the 4 KB token bucket is a larger share of a small message);
intra at 360 Mbit/s 16 KB 1.24-1.75x, 64 KB 1.03-1.09x, 256 KB 0.99-1.01x (host and kernel time
per message), at 180 and 90 Mbit/s 16 KB 0.89-1.2x. (The run before the gloo watcher threads:
16 KB intra 2.0-3.2x.)

Note [Probe-fitted latency]
---------------------------
The cost model is alpha-beta: a message of ``n`` bytes on a route takes ``latency + n / bandwidth``
(the latency once per round or per message, Note [Cost model]). The emulated links' bandwidth is
set by ``tc`` and the model has it (at TCP goodput); their alpha is not set anywhere: it is what
one message costs the two cores, the ranks' TCP stacks and the bridges: 0.05-0.14 ms inside a node
at 360 Mbit/s in the last run (0.3-0.6 ms in the one before), 0 at lower rates, and nothing
measurable across (the inter links run at or slightly above the modelled goodput).
:func:`fit_latency` takes it from the probe of the same run, with the bandwidth held at the
model's::

    alpha(kind) = max(0, median over the probed sizes of (measured - bytes / bandwidth))

intra first; the inter alpha is then fitted over what the intra alpha leaves (a ``shared`` uplink's
route crosses the node's switch too). :func:`calibrated_topology` is the emulated Topology with
those latencies; the benchmark's ``predicted_s`` is the cost model on it, for the plans made on the
nominal Topology (latency 0: the planner's choices do not depend on this machine's CPU), and
``predicted_nominal_s`` is the prediction without it. Both are predictions: the workloads' own
times are never used. (0.5 ms emulated is 50 ns at the time scale of 10,000: far below a real
link's microseconds, so the fit adds no latency regime the emulator does not have.)
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

from megatron_fcp.emulate.spec import ClusterSpec, emulated_topology
from megatron_fcp.topology import Topology

__all__ = ["PROBE_BYTES", "PROBE_REPEATS", "IDLE_S", "probe_pairs", "run_probe", "modelled_s", "summarize",
           "fit_latency", "calibrated_topology"]

PROBE_BYTES = (16384, 65536, 262144)
"""Message sizes probed: a small KV block, a typical one, a large one (bytes)."""
PROBE_REPEATS = 3
IDLE_S = 0.05
"""How long the link idles before each message: long enough for a token bucket to refill."""


def probe_pairs(spec: ClusterSpec) -> list[tuple[str, int, int]]:
    """``(link, sender, receiver)`` for each kind of link ``spec`` has: ``intra`` (ranks 0 -> 1) when a
    node has two ranks or more, ``inter`` (0 -> ``ranks_per_node``: node 0 to node 1, the same rail)
    when there are two nodes or more."""
    pairs = []
    if spec.ranks_per_node > 1:
        pairs.append(("intra", 0, 1))
    if spec.nodes > 1:
        pairs.append(("inter", 0, spec.ranks_per_node))
    return pairs


def run_probe(pairs: Sequence[tuple[str, int, int]], sizes: Sequence[int] = PROBE_BYTES,
              repeats: int = PROBE_REPEATS, idle_s: float = IDLE_S) -> list[dict]:
    """Time isolated messages (Note [Link probe]); every rank of the default group calls it. Returns
    ``[{"link", "src", "dst", "bytes", "times_s"}]`` on every rank (gathered)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = []
    for link, src, dst in pairs:
        for nbytes in sizes:
            times = []
            for _ in range(repeats):
                buf = torch.zeros(nbytes, dtype=torch.uint8)
                t0 = torch.zeros(1, dtype=torch.float64)
                dist.barrier()
                if rank == dst:
                    handle = dist.irecv(buf, src)
                    handle.wait()
                    t1 = time.perf_counter()
                    dist.recv(t0, src)
                    times.append(t1 - float(t0.item()))
                elif rank == src:
                    time.sleep(idle_s)
                    t0[0] = time.perf_counter()
                    dist.send(buf, dst)
                    dist.send(t0, dst)
            if rank == dst:
                mine.append({"link": link, "src": src, "dst": dst, "bytes": nbytes, "times_s": times})
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [e for part in gathered for e in part]


def modelled_s(topo: Topology, src: int, dst: int, nbytes: int) -> float:
    """The cost model's time for one message alone on its route: bytes over the narrowest resource,
    plus the route's latency."""
    route = topo.route(src, dst)
    return nbytes / route.bandwidth + route.latency


def summarize(measured: Sequence[dict], topo: Topology) -> list[dict]:
    """:func:`run_probe`'s entries with ``median_s``, ``modelled_s`` and ``ratio`` (median / modelled)."""
    out = []
    for e in measured:
        med = statistics.median(e["times_s"]) if e["times_s"] else None
        model = modelled_s(topo, e["src"], e["dst"], e["bytes"])
        out.append({**e, "median_s": med, "modelled_s": model, "ratio": med / model if med is not None else None})
    return out


def fit_latency(measured: Sequence[dict], topo: Topology, link: str) -> float:
    """The per-message seconds of ``link`` ("intra" / "inter") beyond the model's time on ``topo``
    (Note [Probe-fitted latency]): the median over the probed sizes of measured - modelled, at least
    0; 0 when the run did not probe that link."""
    extra = [statistics.median(e["times_s"]) - modelled_s(topo, e["src"], e["dst"], e["bytes"])
             for e in measured if e["link"] == link and e["times_s"]]
    return max(0.0, statistics.median(extra)) if extra else 0.0


def calibrated_topology(spec: ClusterSpec, measured: Sequence[dict]) -> tuple[Topology, dict]:
    """The emulated Topology with the probe-fitted latencies (Note [Probe-fitted latency]) and the
    fit ``{"intra_latency_s", "inter_latency_s"}`` (route latencies, seconds)."""
    intra = fit_latency(measured, emulated_topology(spec), "intra")
    inter = fit_latency(measured, emulated_topology(spec, intra_latency_s=intra), "inter")
    fit = {"intra_latency_s": intra, "inter_latency_s": inter}
    return emulated_topology(spec, intra_latency_s=intra, inter_latency_s=inter), fit
