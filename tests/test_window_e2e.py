"""End to end with sliding windows: interleaved window / full layers with FCP match cp = 1.

The shared 4-process gloo world (tests/_megatron_world.py, part ``window``) trains the example's tiny
GPT 10 steps (FP32) with ``--window-size 16,0 --window-attn-skip-freq 2``: by megatron-core's rule
layer 1 is windowed (each query sees itself and the 16 tokens before it) and layer 2 full, as in
gpt-oss or Gemma, with learnable sinks on both layers (gpt-oss); packed batches run the window
alone. References are Megatron's own windowed attention at cp = 1 (its local
``DotProductAttention``, the band mask built on the CPU by our shim) and, for packed batches, SDPA per
document with the window's mask.

* cp = 4: losses and grad norms within 1e-5 relative per step; the layer report gives layer 1 a
  windowed plan and layer 2 the full one (here with the head-parallel stage the planner chose);
  the windowed layer's receives are exactly its windowed plan's, fewer than a causal plan's.
* tp = 2 x cp = 2: losses and grad norms within 1e-5 of Megatron's tp = 2 at cp = 1.
* packed batches at cp = 4: the window inside each document, within 1e-5 of cp = 1; one agreement
  per micro-batch covers both layers' plans; and at tp = 2 x cp = 2 within 1e-5 of tp = 2, cp = 1.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _megatron_world import STEPS, TOPO_2X2  # noqa: E402  (the runs' arguments live there)

from megatron_fcp.config import FCPConfig  # noqa: E402
from megatron_fcp.patches.runtime import build_group_plan  # noqa: E402
from megatron_fcp.topology import load_topology  # noqa: E402

E2E_PARTS = ("window",)  # what this file asks of the shared world (tests/conftest.py)


@pytest.fixture(scope="module")
def runs(megatron_e2e_world):
    return [r["window"] for r in megatron_e2e_world["ranks"]]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _close(run: dict, ref: dict, what: str = "cp=1", grads: bool = True) -> None:
    assert len(run["losses"]) == len(ref["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(run["losses"], ref["losses"])):
        assert _rel(a, b) <= 1e-5, f"step {step}: loss {a} vs {what} {b}"
    if grads:
        for step, (a, b) in enumerate(zip(run["grad_norms"], ref["grad_norms"])):
            assert _rel(a, b) <= 1e-5, f"step {step}: grad norm {a} vs {what} {b}"


@pytest.mark.dist
@pytest.mark.slow
def test_interleaved_window_cp4_matches_cp1(runs):
    ref, fcp = runs[0]["cp1"], runs[0]["cp4"]
    assert fcp["fcp"]["cp"] == 4 and fcp["fcp"]["fcp_modules"] == 2
    _close(fcp, ref)
    assert ref["losses"][-1] < ref["losses"][0] - 0.2  # it learns
    layers = fcp["fcp"]["layers"]
    assert layers["1"]["attention"] == "fcp" and layers["1"]["window"] == [16, 0]
    assert layers["2"]["attention"] == "fcp" and layers["2"]["window"] is None
    # layer 1 runs the plan built under its window: each rank receives exactly that plan's transfers
    # into it (calls alternate layer 1, layer 2), fewer in all than the causal plan of the same graph
    config, topo = FCPConfig(enabled=True, graph="hierarchical"), load_topology(TOPO_2X2)
    windowed = build_group_plan(config, topo, (0, 1, 2, 3), causal=True, seq_len=64, window=(16, 0))
    causal = build_group_plan(config, topo, (0, 1, 2, 3), causal=True, seq_len=64)
    assert windowed.num_transfers() < causal.num_transfers()
    for rank, r in enumerate(runs):
        received = r["cp4"]["forward_recvs"]
        assert len(received) == 2 * 4 * STEPS
        into = sum(1 for _, t in windowed.transfers() if t.dst == rank)
        assert set(received[0::2]) == {into}, (rank, set(received[0::2]), into)


@pytest.mark.dist
@pytest.mark.slow
def test_interleaved_window_tp2_cp2_matches_tp2_cp1(runs):
    """Against Megatron's own tp = 2 at cp = 1: with learnable sinks tp = 2 is another model from
    step 0 (Megatron draws each TP rank's sinks from the same generator: tests/test_sinks_e2e.py)."""
    tp_ref, both = runs[0]["tp2cp1"], runs[0]["tp2cp2"]
    assert (both["fcp"]["tp"], both["fcp"]["cp"]) == (2, 2)
    _close(both, tp_ref, "tp=2,cp=1")


@pytest.mark.dist
@pytest.mark.slow
def test_packed_window_cp4_matches_cp1(runs):
    ref, fcp = runs[0]["packed_cp1"], runs[0]["packed_cp4"]
    assert fcp["fcp"]["packed"] and fcp["fcp"]["cp"] == 4
    _close(fcp, ref)
    assert fcp["agreements"] == 4 * STEPS  # one per micro-batch for both layers' plans, not one per layer


@pytest.mark.dist
@pytest.mark.slow
def test_packed_window_tp2_cp2_matches_tp2_cp1(runs):
    ref, both = runs[0]["packed_tp2cp1"], runs[0]["packed_tp2cp2"]
    assert both["fcp"]["packed"] and (both["fcp"]["tp"], both["fcp"]["cp"]) == (2, 2)
    _close(both, ref, "tp=2,cp=1")
