"""The emulated benchmark end to end: plans and predictions, the cluster, the ranks, the results.

:func:`run_bench` (what ``megatron-fcp bench --emulate`` runs):

1. check root, ``ip`` and ``tc`` (:func:`~megatron_fcp.emulate.netns.check_prerequisites`) before
   anything else, so a machine without them gets one clear error and nothing is created;
2. build the workloads' plans on the emulated cluster's Topology and the cost model's predictions
   (:mod:`megatron_fcp.emulate.workloads`);
3. bring the cluster up (:class:`~megatron_fcp.emulate.netns.EmulatedCluster`), run one worker per
   rank in its namespace (:func:`~megatron_fcp.emulate.launcher.run_ranks`), tear the cluster down
   whatever happens;
4. assemble the JSON (:func:`~megatron_fcp.emulate.report.assemble`).
"""

from __future__ import annotations

import json
import pickle
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from megatron_fcp.emulate.launcher import run_ranks
from megatron_fcp.emulate.netns import EmulatedCluster, check_prerequisites, run_prefix
from megatron_fcp.emulate.probe import probe_pairs, summarize
from megatron_fcp.emulate.report import assemble
from megatron_fcp.emulate.spec import ClusterSpec, emulated_topology
from megatron_fcp.emulate.workloads import FcpWorkload, WorkloadShape, lower_bounds, make_workloads
from megatron_fcp.planning import ComputeModel
from megatron_fcp.planning.packed_cost import BACKWARD_FLOP_RATIO

__all__ = ["BenchConfig", "COMPUTE_MODES", "prepare", "run_bench"]

#: how the block kernel runs: "sleep" launches its modelled seconds on an emulated GPU stream (the
#: default), "blocking-sleep" sleeps inside the call, "cpu" computes on the CPU (Note [The emulated
#: GPU stream] in megatron_fcp.emulate.sleep_kernel)
COMPUTE_MODES = ("sleep", "blocking-sleep", "cpu")


@dataclass(frozen=True)
class BenchConfig:
    """One emulated configuration and what to run on it (the ``bench --emulate`` flags)."""

    cluster: ClusterSpec
    shape: WorkloadShape
    workloads: tuple[str, ...] = ("te-p2p", "te-a2a-p2p", "fcp-auto", "fcp-hp")
    repeats: int = 5
    component_repeats: int = 2
    warmup: int = 1
    compute: str = "sleep"
    tflops: float = 400.0
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.component_repeats < 0 or self.warmup < 0:
            raise ValueError("--repeats must be >= 1, --component-repeats and --warmup >= 0")
        if self.compute not in COMPUTE_MODES:
            raise ValueError(f"--compute: {self.compute!r} is not one of {', '.join(COMPUTE_MODES)}")
        if not self.tflops > 0:
            raise ValueError(f"--tflops: must be > 0, got {self.tflops}")

    @property
    def emulated_flops(self) -> float:
        """The GPU's FLOP/s stretched by the cluster's time scale (what the sleep kernel assumes)."""
        return self.tflops * 1e12 / self.cluster.time_scale


def prepare(cfg: BenchConfig):
    """(topology, compute model, workloads with plans, lower bounds, predictions by workload) — pure."""
    topo = emulated_topology(cfg.cluster)
    cm = ComputeModel(flops=cfg.emulated_flops, kernel_overhead_s=0.0)
    workloads = make_workloads(list(cfg.workloads), cfg.shape, topo, cm)
    placement_plan = next((w.plan for w in workloads if isinstance(w, FcpWorkload) and w.plan is not None), None)
    if cfg.shape.doc_lengths and placement_plan is None:
        from megatron_fcp.planning import build_plan, place_packed

        pl = place_packed(list(cfg.shape.doc_lengths), topo.world, block_tokens=cfg.shape.block_tokens,
                          causal=cfg.shape.causal)
        placement_plan = build_plan(topo, range(topo.world), "full", causal=cfg.shape.causal, placement=pl)
    bounds = lower_bounds(cfg.shape, topo, cm, placement_plan)
    predictions = {w.name: w.predict(topo, cm) for w in workloads}
    return topo, cm, workloads, bounds, predictions


def run_bench(cfg: BenchConfig, on_progress: Callable[[str], None] | None = None) -> dict:
    """Run ``cfg`` on an emulated cluster (module docstring); returns the result dict (``runs`` ...)."""
    check_prerequisites()
    if not cfg.cluster.prefix.startswith("fcpe") or cfg.cluster.prefix == "fcpe":
        cfg = replace(cfg, cluster=replace(cfg.cluster, prefix=run_prefix()))
    t_start = time.perf_counter()
    topo, cm, workloads, bounds, predictions = prepare(cfg)
    runnable = [w for w in workloads if w.unavailable is None]
    job = {"workloads": runnable, "repeats": cfg.repeats, "component_repeats": cfg.component_repeats,
           "warmup": cfg.warmup, "compute": cfg.compute, "flops": cfg.emulated_flops,
           "timeout_s": min(cfg.timeout_s, 600.0), "probe": probe_pairs(cfg.cluster)}
    measured: dict = {"times": {}, "modelled_compute_s": {}}
    setup_s = teardown_s = 0.0
    if runnable:
        with tempfile.TemporaryDirectory(prefix="fcp-emu-") as tmp:
            job_path, out_path = str(Path(tmp) / "job.pkl"), str(Path(tmp) / "out.json")
            with open(job_path, "wb") as f:
                pickle.dump(job, f)
            cluster = EmulatedCluster(cfg.cluster)
            try:
                with cluster:
                    setup_s = cluster.setup_s
                    run_ranks(cfg.cluster, job_path, out_path, tmp, cfg.timeout_s, on_progress)
            finally:
                teardown_s = cluster.teardown_s
            with open(out_path) as f:
                measured = json.load(f)
    meta = {"setup_s": setup_s, "teardown_s": teardown_s, "wall_s": time.perf_counter() - t_start,
            "link_probe": summarize(measured.get("link_probe", []), topo),
            "assumptions": {
                "tflops": cfg.tflops, "emulated_flops": cfg.emulated_flops, "time_scale": cfg.cluster.time_scale,
                "backward_flop_ratio": BACKWARD_FLOP_RATIO, "kernel_overhead_s": 0.0, "compute": cfg.compute,
                "intra_stands_for": "NVLink4 450 GB/s per direction", "inter_stands_for": "NDR IB 50 GB/s per NIC",
                "dtype": "bf16", "repeats": cfg.repeats, "component_repeats": cfg.component_repeats}}
    return assemble(cfg.cluster, cfg.shape, workloads, predictions, bounds, measured, meta)
