"""The emulator's pieces that run on gloo processes (no root): Transformer Engine's p2p ring re-implemented
on our transports and kernels (``te-p2p``), checked against FP64 single-device attention, forward and
backward, on Megatron's zigzag and on TE's padded per-document THD layout; what it sends per round;
the sleep kernel through it; and the worker's alternating loop (sleep and real CPU kernels, packed
and zigzag) on plain loopback gloo."""

from __future__ import annotations

import pytest

from megatron_fcp.emulate.probe import PROBE_BYTES, PROBE_REPEATS
from megatron_fcp.testing.launch import run_gloo
from tests import _emulate_cases

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # every test here starts gloo processes
CP = 4
TOL = 1e-10  # FP64 against FP64: only the merge order differs


@pytest.fixture(scope="module")
def results():
    return run_gloo(_emulate_cases.worker, CP, timeout_s=240)


@pytest.mark.parametrize("case", ["zigzag_causal", "zigzag_full"])
def test_te_ring_matches_fp64_reference_on_zigzag(results, case):
    for rank, r in enumerate(results):
        for q in ("out", "lse", "dq", "dk", "dv"):
            assert r[case][q] < TOL, f"rank {rank} {case} {q}: max error {r[case][q]:.3g}"


def test_te_ring_sends_what_transformer_engine_sends(results):
    """Forward: cp-1 rounds of one KV pair; backward: KV, then KV+dKV, ..., then the dKV home."""
    for r in results:
        kv = r["zigzag_causal"]["kv_bytes"]
        sent = r["zigzag_causal"]["sent"]
        assert sent["te-forward"] == [kv] * (CP - 1)
        assert sent["te-backward"] == [kv] + [2 * kv] * (CP - 2) + [kv]


def test_te_ring_on_padded_documents_matches_per_document_reference(results):
    for rank, r in enumerate(results):
        for q, e in r["thd"].items():
            assert e < TOL, f"rank {rank} THD {q}: max error {e:.3g}"


def test_sleep_kernel_through_the_ring(results):
    for r in results:
        s = r["sleep"]
        assert s["shape"] == (8, 1, 4, 8) and s["dtype"] == "torch.bfloat16" and s["finite"]
        assert s["grad_shape"] == (8, 1, 4, 8)
        assert s["fwd_s"] == pytest.approx(s["expected_fwd_s"], rel=1e-9)
        assert s["bwd_s"] == pytest.approx(2.5 * s["expected_fwd_s"], rel=1e-9)


def test_head_parallel_runners_match_fp64_reference():
    """te-a2a-p2p (a2a in each 2-rank node, ring over the nodes) and fcp-hp on loopback gloo."""
    res = run_gloo(_emulate_cases.head_parallel_worker, CP, timeout_s=240)
    for rank, r in enumerate(res):
        assert r["te-a2a-p2p-True"]["degree"] == 2
        for case, errs in r.items():
            for q in ("out", "lse", "dq", "dk", "dv"):
                assert errs[q] < TOL, f"rank {rank} {case} {q}: max error {errs[q]:.3g}"


def test_worker_loop_runs_head_parallel_workloads():
    """The worker's loop with te-a2a-p2p and fcp-hp on 2 x 2 ranks: every mode timed (compute only
    with the all-to-alls replaced, then restored: the next overlapped run still communicates)."""
    from megatron_fcp.emulate.spec import ClusterSpec, emulated_topology
    from megatron_fcp.emulate.workloads import WorkloadShape, make_workloads

    wl = make_workloads(["te-a2a-p2p", "fcp-hp"], WorkloadShape(128, 4, 2, 16), emulated_topology(ClusterSpec(2, 2)))
    job = {"workloads": wl, "repeats": 2, "component_repeats": 1, "warmup": 1, "compute": "sleep",
           "flops": 1e12, "timeout_s": 60}
    times = run_gloo(_emulate_cases.worker_job, CP, job, timeout_s=120)[0]["times"]
    for name in ("te-a2a-p2p", "fcp-hp"):
        assert [len(times[name][m]) for m in ("overlap", "comm", "compute")] == [2, 1, 1]
        assert all(t > 0 for m in times[name].values() for t in m)


@pytest.mark.parametrize("compute, docs", [("sleep", (300, 20, 200)), ("blocking-sleep", None), ("cpu", None)])
def test_worker_loop_alternates_and_times_every_mode(compute, docs):
    from megatron_fcp.emulate.spec import ClusterSpec, emulated_topology
    from megatron_fcp.emulate.workloads import WorkloadShape, make_workloads

    topo = emulated_topology(ClusterSpec(1, 2))
    shape = WorkloadShape(256, 2, 1, 16, True, docs, block_tokens=128)
    wl = make_workloads(["te-p2p", "fcp-auto"], shape, topo)
    job = {"workloads": wl, "repeats": 2, "component_repeats": 1, "warmup": 1, "compute": compute,
           "flops": 1e9, "timeout_s": 60, "probe": [("intra", 0, 1)] if compute == "sleep" else []}
    res = run_gloo(_emulate_cases.worker_job, 2, job, timeout_s=120)
    times = res[0]["times"]
    # Note [Link probe]: rank 1 timed rank 0's isolated messages, every size, gathered on every rank
    probe = res[0]["link_probe"]
    assert probe == res[1]["link_probe"]
    if compute == "sleep":
        assert [(e["link"], e["src"], e["dst"], e["bytes"]) for e in probe] == [("intra", 0, 1, n) for n in PROBE_BYTES]
        assert all(len(e["times_s"]) == PROBE_REPEATS and min(e["times_s"]) > 0 for e in probe)
    else:
        assert probe == []
    for name in ("te-p2p", "fcp-auto"):
        assert len(times[name]["overlap"]) == 2 and len(times[name]["comm"]) == 1 and len(times[name]["compute"]) == 1
        assert all(t > 0 for m in times[name].values() for t in m)
    modelled = res[0]["modelled_compute_s"]
    assert (set(modelled) == {"te-p2p", "fcp-auto"}) == (compute != "cpu")
    for name, seconds in modelled.items():  # the timer stops when the (emulated) device is done
        assert seconds > 0.005 and min(times[name]["overlap"] + times[name]["compute"]) >= seconds - 1e-3


def test_windowed_runners_match_fp64_reference():
    """te-a2a (Ulysses over the CP group), fcp-auto and fcp-hp under a sliding window are exact."""
    res = run_gloo(_emulate_cases.window_worker, CP, timeout_s=240)
    for rank, r in enumerate(res):
        for case, errs in r.items():
            for q in ("out", "dq", "dk", "dv"):
                assert errs[q] < TOL, f"rank {rank} {case} {q}: max error {errs[q]:.3g}"


def test_packed_head_parallel_runner_matches_fp64_reference_and_runs_in_the_loop():
    """fcp-hp on a packed batch runs the runtime's degree (2 here) through the packed head-parallel
    engine: exact against per-document FP64 attention (out, lse, dq, dk, dv), every rank holding its
    member placement's tokens; the worker times it overlapped, communication-only and compute-only."""
    res = run_gloo(_emulate_cases.packed_head_parallel_worker, CP, timeout_s=240)
    assert sum(r["tokens"] for r in res) == 30 + 7 + 50 + 9
    for rank, r in enumerate(res):
        assert r["degree"] == 2
        for q in ("out", "lse", "dq", "dk", "dv"):
            assert r[q] < TOL, f"rank {rank} {q}: max error {r[q]:.3g}"
        assert [len(r["times"][m]) for m in ("overlap", "comm", "compute")] == [2, 1, 1]
        assert all(t > 0 for m in r["times"].values() for t in m)
