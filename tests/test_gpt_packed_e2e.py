"""End to end on packed batches (THD): the example's tiny GPT with FCP matches cp = 1.

One 4-process gloo group (the world tests/_megatron_world.py shares with the other end-to-end tests)
trains 10 steps five times on the same packed batches (FP32; documents of
seeded lognormal lengths, 256 tokens a sequence):

* cp = 1 (dp 4): each document attended alone on one rank (SDPA per document) with Megatron's own
  THD RoPE -- an implementation independent of FCP's executor, placement and RoPE shim;
* cp = 4 with FCP on the hierarchical graph of a 2 x 2 topology (dp 1): tokens laid out by FCP's
  placement (short documents whole, long ones in 16-token blocks), RoPE by document position;
  under the default ``--fcp-head-parallel auto`` each batch runs the degree (1 or 2) the cost model
  predicts fastest for its documents (Note [Head-parallel degree of a packed batch]);
* cp = 4 with the head-parallel stage, a = 2 (Note [Head-parallel stage on packed batches]);
* cp = 4 in Transformer Engine's layout (``--fcp-packed-layout thd``, Note [TE's layout as a candidate]);
* tp = 2, cp = 1 and tp = 2, cp = 2 with FCP.

Losses must agree within 1e-5 relative per step (grad norms of tp = 2 against tp = 2, cp = 1, as in
test_gpt_e2e). The agreement collective runs once per micro-batch, not once per layer.
"""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
PACKED = os.path.join(EXAMPLES, "configs", "tiny_cpu_cp4_packed.yaml")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import pretrain_gpt_fcp as ex  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _megatron_world import STEPS  # noqa: E402  (the runs' arguments live there)

E2E_PARTS = ("packed",)  # what this file asks of the shared world (tests/conftest.py)


@pytest.fixture(scope="module")
def runs(megatron_e2e_world):
    return [r["packed"] for r in megatron_e2e_world["ranks"]]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.dist
@pytest.mark.slow
def test_packed_cp4_matches_cp1(runs):
    ref, fcp = runs[0]["cp1"], runs[0]["cp4"]
    assert fcp["fcp"]["packed"] and fcp["fcp"]["cp"] == 4 and fcp["fcp"]["graph"] == "hierarchical"
    assert fcp["fcp"]["fcp_modules"] == 2 and fcp["fcp"]["transfers"] > 0
    # every micro-batch after the first was planned while the one before it ran (Note [Planning a
    # packed batch ahead]); the losses below are those of plans made in the background
    assert fcp["fcp"]["planned_ahead"] == len(fcp["losses"]) * fcp["fcp"]["microbatches"] - 1
    for step, (a, b) in enumerate(zip(fcp["losses"], ref["losses"])):
        assert _rel(a, b) <= 1e-5, f"step {step}: loss {a} vs cp=1 {b}"
    for step, (a, b) in enumerate(zip(fcp["grad_norms"], ref["grad_norms"])):
        assert _rel(a, b) <= 1e-5, f"step {step}: grad norm {a} vs cp=1 {b}"
    assert ref["losses"][-1] < ref["losses"][0] - 0.1  # it learns
    # one agreement per micro-batch (4 per step), not one per layer (2 layers)
    assert fcp["agreements"] == 4 * STEPS


@pytest.mark.dist
@pytest.mark.slow
def test_packed_head_parallel_a2_matches_cp1(runs):
    """cp = 4 with --fcp-head-parallel 2: documents placed over the two head groups (one per node of
    the 2 x 2 topology), all-to-alls inside each, the KV stage across them."""
    ref, hp = runs[0]["cp1"], runs[0]["cp4hp2"]
    assert hp["fcp"]["packed"] and hp["fcp"]["cp"] == 4 and hp["fcp"]["head_parallel"] == 2
    assert hp["fcp"]["kv_memory"]["head_parallel_bytes_sent"] > 0
    for step, (a, b) in enumerate(zip(hp["losses"], ref["losses"])):
        assert _rel(a, b) <= 1e-5, f"step {step}: loss {a} vs cp=1 {b}"
    for step, (a, b) in enumerate(zip(hp["grad_norms"], ref["grad_norms"])):
        assert _rel(a, b) <= 1e-5, f"step {step}: grad norm {a} vs cp=1 {b}"


@pytest.mark.dist
@pytest.mark.slow
def test_packed_te_layout_matches_cp1(runs):
    """cp = 4 with --fcp-packed-layout thd: every batch in Transformer Engine's per-document zigzag,
    its backward on TE's ring (Note [TE's layout as a candidate]); the data path and RoPE follow that
    placement. Losses and grad norms within 1e-5 of cp = 1."""
    ref, thd = runs[0]["cp1"], runs[0]["cp4thd"]
    assert thd["fcp"]["packed"] and thd["fcp"]["packed_layout"] == "thd" and thd["fcp"]["transfers"] > 0
    assert thd["fcp"]["backward_graph"] == "ring"          # the forward on the configured graph
    for step, (a, b) in enumerate(zip(thd["losses"], ref["losses"])):
        assert _rel(a, b) <= 1e-5, f"step {step}: loss {a} vs cp=1 {b}"
    for step, (a, b) in enumerate(zip(thd["grad_norms"], ref["grad_norms"])):
        assert _rel(a, b) <= 1e-5, f"step {step}: grad norm {a} vs cp=1 {b}"


@pytest.mark.dist
@pytest.mark.slow
def test_packed_tp2_cp2_matches_cp1(runs):
    ref, tp_ref, both = runs[0]["cp1"], runs[0]["tp2cp1"], runs[0]["tp2cp2"]
    assert (both["fcp"]["tp"], both["fcp"]["cp"]) == (2, 2)
    for step, (a, b) in enumerate(zip(both["losses"], ref["losses"])):
        assert _rel(a, b) <= 1e-5, f"step {step}: loss {a} vs cp=1 {b}"
    for step, (a, b) in enumerate(zip(both["grad_norms"], tp_ref["grad_norms"])):
        assert _rel(a, b) <= 1e-5, f"step {step}: grad norm {a} vs tp=2,cp=1 {b}"


def test_packed_run_config_errors():
    args, fcp = ex.parse_args(["--config", PACKED, "--micro-batch-size", "2"])
    with pytest.raises(ValueError, match="--packed needs --micro-batch-size 1"):
        ex.validate_run(args, fcp, world=4)
    args, fcp = ex.parse_args(["--config", PACKED, "--no-fcp"])
    with pytest.raises(ValueError, match="needs --fcp"):
        ex.validate_run(args, fcp, world=4)
