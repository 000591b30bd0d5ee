"""FCP under Megatron's activation recomputation: the example's tiny GPT at cp = 4 with selective
recomputation (core attention recomputed in backward) and with full-layer recomputation matches
cp = 1 within 1e-5 relative loss over 10 steps, and the recomputation really runs (each attention
is called twice per micro-batch: forward, then again inside backward, communication included).
Both with the default backward KV mode (auto: re-send at cp = 4) and with keep. The trainings run in
the world tests/_megatron_world.py shares with the other end-to-end tests (the cp = 1 reference is
trained once there for this file and test_gpt_e2e)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _megatron_world import RECOMPUTE as RUNS  # noqa: E402  (the runs' arguments live there)
from _megatron_world import STEPS  # noqa: E402

E2E_PARTS = ("recompute",)  # what this file asks of the shared world (tests/conftest.py)


@pytest.fixture(scope="module")
def runs(megatron_e2e_world):
    return [r["recompute"] for r in megatron_e2e_world["ranks"]]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_recomputation_matches_cp1(runs, name):
    ref, run = runs[0]["cp1"], runs[0][name]
    for step, (a, b) in enumerate(zip(run["losses"], ref["losses"])):
        assert abs(a - b) / abs(b) <= 1e-5, f"{name} step {step}: loss {a} vs cp=1 {b}"
    per_pass = 2 * 4 * STEPS  # 2 layers x 4 micro-batches x 10 steps
    assert run["calls"] == (per_pass if name == "none" else 2 * per_pass), "recomputation did not run"
