"""The emulated benchmark end to end: plans and predictions, the cluster, the ranks, the results.

:func:`run_bench` (what ``megatron-fcp bench --emulate`` runs):

1. check root, ``ip`` and ``tc`` (:func:`~megatron_fcp.emulate.netns.check_prerequisites`) before
   anything else, so a machine without them gets one clear error and nothing is created;
2. build the workloads' plans on the emulated cluster's Topology and the cost model's predictions
   (:mod:`megatron_fcp.emulate.workloads`);
3. bring the cluster up (:class:`~megatron_fcp.emulate.netns.EmulatedCluster`), run one worker per
   rank in its namespace (:func:`~megatron_fcp.emulate.launcher.run_ranks`), tear the cluster down
   whatever happens;
4. price the same plans again on the Topology with the link probe's per-message latency
   (:func:`predict_calibrated`, Note [Probe-fitted latency] in :mod:`megatron_fcp.emulate.probe`);
5. assemble the JSON (:func:`~megatron_fcp.emulate.report.assemble`).
"""

from __future__ import annotations

import json
import pickle
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from megatron_fcp.cost.model import BACKWARD_FLOP_RATIO, KERNEL_CALIBRATIONS, ComputeModel
from megatron_fcp.emulate.launcher import run_ranks
from megatron_fcp.emulate.netns import EmulatedCluster, check_prerequisites, run_prefix
from megatron_fcp.emulate.probe import calibrated_topology, probe_pairs, summarize
from megatron_fcp.emulate.report import assemble
from megatron_fcp.emulate.spec import ClusterSpec, emulated_topology
from megatron_fcp.emulate.workloads import FcpWorkload, WorkloadShape, lower_bounds, make_workloads

__all__ = ["BenchConfig", "COMPUTE_MODES", "MIN_STEP_S", "MAX_SLOWDOWN", "paced", "prepare", "predict_calibrated",
           "run_bench"]

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
    kernel: str | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.component_repeats < 0 or self.warmup < 0:
            raise ValueError("--repeats must be >= 1, --component-repeats and --warmup >= 0")
        if self.compute not in COMPUTE_MODES:
            raise ValueError(f"--compute: {self.compute!r} is not one of {', '.join(COMPUTE_MODES)}")
        if not self.tflops > 0:
            raise ValueError(f"--tflops: must be > 0, got {self.tflops}")
        if self.kernel is not None and self.kernel not in KERNEL_CALIBRATIONS:
            raise ValueError(f"--kernel-model: unknown {self.kernel!r}; known: {', '.join(sorted(KERNEL_CALIBRATIONS))}")

    @property
    def emulated_flops(self) -> float:
        """The GPU's FLOP/s stretched by the cluster's time scale (what the sleep kernel assumes)."""
        return self.tflops * 1e12 / self.cluster.time_scale

    def compute_model(self) -> ComputeModel:
        """The emulated GPU's compute model: the FLOP model at :attr:`emulated_flops`, or (``kernel``)
        the named tile calibration stretched by the time scale, launches left out as the FLOP
        model's are (Note [Tile-priced kernels]; the sleep kernel sleeps what it prices)."""
        if self.kernel is None:
            return ComputeModel(flops=self.emulated_flops, kernel_overhead_s=0.0)
        cal = KERNEL_CALIBRATIONS[self.kernel].scaled(self.cluster.time_scale, launches=False)
        return ComputeModel.tiled(cal, flops=self.emulated_flops, kernel_overhead_s=0.0)


def prepare(cfg: BenchConfig):
    """(topology, compute model, workloads with plans, lower bounds, predictions by workload) — pure."""
    topo = emulated_topology(cfg.cluster)
    cm = cfg.compute_model()
    workloads = make_workloads(list(cfg.workloads), cfg.shape, topo, cm)
    placement_plan = next((w.plan for w in workloads if isinstance(w, FcpWorkload) and w.plan is not None), None)
    if cfg.shape.doc_lengths and placement_plan is None:
        from megatron_fcp.planner.build import build_plan
        from megatron_fcp.planner.placing import place_batch

        pl = place_batch(topo, range(topo.world), list(cfg.shape.doc_lengths), block_tokens=cfg.shape.block_tokens,
                         causal=cfg.shape.causal)
        placement_plan = build_plan(topo, range(topo.world), "full", causal=cfg.shape.causal, placement=pl)
    bounds = lower_bounds(cfg.shape, topo, cm, placement_plan)
    predictions = {w.name: w.predict(topo, cm) for w in workloads}
    return topo, cm, workloads, bounds, predictions


#: Note [Rates the host keeps up with]: the shortest predicted step a configuration may have, and
#: the most its rates are divided by to get there
MIN_STEP_S = 0.5
MAX_SLOWDOWN = 4


def paced(cfg: BenchConfig, min_step_s: float = MIN_STEP_S, max_slowdown: int = MAX_SLOWDOWN) -> BenchConfig:
    """``cfg`` with both link rates divided by the smallest power of two ``k <= max_slowdown`` that makes
    its fastest workload's predicted step (forward + backward) at least ``min_step_s`` emulated seconds.

    Note [Rates the host keeps up with]
    -----------------------------------
    Eight ranks share two cores. Each rank's host work per step (the executor's Python, gloo's
    sends and receives, the kernels' bookkeeping: about 20-25 ms of CPU at 256 tokens per rank) does
    not shrink with the links' rates, while every emulated time grows as the rates fall. At 360 / 40
    Mbit/s a step of 0.08-0.3 s is host-bound: 256 tokens per rank measured +75% against the model for
    ``fcp-hp`` (eight ranks' CPU alone needs 92 ms of the two cores), 2x4 MHA ``fcp-hp`` +13%, and a
    16 KB intra message alone 2-3x its bytes' time (Note [Link probe]); at a quarter of the rates the
    256-token step measured +12% and the 16 KB message 1.0x, at half of them 2x4 MHA ``fcp-hp`` +3%
    (same code, same plans). Dividing both rates by ``k`` keeps the 9:1 ratio and
    multiplies the time scale (and the sleep kernels) by ``k``: the regime, the plans and every ratio
    between workloads stay as they are (the planning Topology has no latency), only the host's share
    of a step shrinks. ``k`` stops at ``max_slowdown`` (lower rates shape small packets less faithfully:
    at 10 Mbit/s an inter 16 KB message runs 0.77x its bytes' time) and every configuration's JSON says
    its rates and time scale. ``--compute cpu`` keeps its rates (its kernels are real CPU work, not
    scaled sleeps)."""
    if cfg.compute == "cpu":
        return cfg
    _, _, workloads, _, predictions = prepare(cfg)
    steps = [predictions[w.name]["predicted_s"] for w in workloads
             if w.unavailable is None and predictions[w.name].get("predicted_s")]
    fastest, k = min(steps, default=min_step_s), 1
    while fastest * k < min_step_s and 2 * k <= max_slowdown:
        k *= 2
    c = cfg.cluster
    return replace(cfg, cluster=replace(c, intra_bps=c.intra_bps / k, inter_bps=c.inter_bps / k))


def predict_calibrated(cfg: BenchConfig, workloads, cm, nominal: dict, probe: list) -> tuple[dict, dict]:
    """Each workload's prediction on the Topology with the probe-fitted latencies (its plan unchanged),
    with ``predicted_nominal_s`` (``nominal``: :func:`prepare`'s, on the planning Topology, latency 0)
    beside ``predicted_s``; and the fit. ``probe``: :func:`~megatron_fcp.emulate.probe.run_probe`'s
    entries (none: the fit is 0 and the two predictions agree)."""
    topo, fit = calibrated_topology(cfg.cluster, probe)
    out = {w.name: {**w.predict(topo, cm), "predicted_nominal_s": nominal[w.name].get("predicted_s")}
           for w in workloads}
    return out, fit


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
           "compute_model": cm if cm.kernel is not None else None,
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
    probe = measured.get("link_probe", [])
    predictions, fit = predict_calibrated(cfg, workloads, cm, predictions, probe)
    meta = {"setup_s": setup_s, "teardown_s": teardown_s, "wall_s": time.perf_counter() - t_start,
            "link_probe": summarize(probe, topo), "latency_fit": fit,
            "assumptions": {
                "tflops": cfg.tflops, "emulated_flops": cfg.emulated_flops, "time_scale": cfg.cluster.time_scale,
                "backward_flop_ratio": BACKWARD_FLOP_RATIO, "kernel_overhead_s": 0.0, "compute": cfg.compute,
                "kernel_model": cm.label,
                "intra_stands_for": "NVLink4 450 GB/s per direction", "inter_stands_for": "NDR IB 50 GB/s per NIC",
                "dtype": "bf16", "repeats": cfg.repeats, "component_repeats": cfg.component_repeats}}
    return assemble(cfg.cluster, cfg.shape, workloads, predictions, bounds, measured, meta)
