"""Megatron-LM's own ``pretrain()`` with FCP on CPU: the zero-edit launcher and the ``--spec`` route.

The driver, tests/megatron_driver/pretrain_gpt_like.py, is shaped like Megatron-LM's
``pretrain_gpt.py`` of the installed release line and imports nothing from megatron_fcp. Each run
is one ``torchrun`` subprocess (gloo, mock data, a 2-layer GPT, 5 iterations) under
tests/megatron_driver/run_cpu.py, which installs the named CUDA stand-ins and records the ``lm
loss`` of the loss dict the training loop reduced for each iteration:

=============  =====  ====================================================================
run            ranks  how FCP gets in
=============  =====  ====================================================================
``cp1``        1      none: Megatron's own attention, the reference
``launcher``   2      ``-m megatron_fcp.run driver.py ... --fcp`` (cp = 2)
``spec``       4      ``driver.py ... --spec megatron_fcp.spec fcp_layer_spec``, options from
                      ``$MEGATRON_FCP_CONFIG`` (tp = 2 x cp = 2; the driver registers no flags)
``no_fcp``     2      the launcher command without ``--fcp`` (cp = 2): Megatron's own path,
                      which has no CP attention without Transformer Engine and says so
=============  =====  ====================================================================

FCP's losses must match cp = 1 within 1e-5 relative at every iteration (on megatron-core 0.17, whose
own tp = 2 run already differs from tp = 1, the tp = 2 run is compared with Megatron's own tp = 2 x
cp = 1 run, ``tp2cp1``, added there; tests/megatron_driver/pretrain_runs.py), every layer must report
FCP attention, and the run without ``--fcp`` must fail with Megatron's own assertion. Runs where
the wheel has ``megatron.training`` (megatron-core 0.17+, Python 3.12); tests/compat runs it per
release. ``$FCP_PRETRAIN_METRICS_OUT``: write every run's record there (JSON) for the matrix.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.training") is None:
    pytest.skip("megatron.training is not installed: megatron-core wheels ship it from 0.17 on (Python 3.12); "
                "tests/compat/run_matrix.sh runs this file on 0.17-0.19", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.dist]

sys.path.insert(0, str(Path(__file__).resolve().parent / "megatron_driver"))
from pretrain_runs import STEPS, TOLERANCE, max_rel, reference_of, run_pretrain, runs_for  # noqa: E402

MEGATRON_CP_REFUSAL = "Context parallelism is only supported by TEDotProductAttention"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("pretrain")
    from megatron_fcp.patches import _version_tuple, megatron_core_version

    out = {name: run_pretrain(name, tmp, **spec) for name, spec in runs_for(_version_tuple(megatron_core_version())).items()}
    path = os.environ.get("FCP_PRETRAIN_METRICS_OUT")
    if path:
        Path(path).write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ("log", "log_tail")}
                                          for k, v in out.items()}, indent=1))
    return out


def _ok(record: dict) -> None:
    assert record["returncode"] == 0, record["log_tail"]
    assert len(record["losses"]) == STEPS, record


def test_reference_trains(runs):
    _ok(runs["cp1"])
    assert runs["cp1"]["layer_report"] == {}  # no FCP anywhere in the reference


@pytest.mark.parametrize("name", ["launcher", "spec"])
def test_fcp_matches_cp1_and_serves_every_layer(runs, name):
    run, ref = runs[name], runs[reference_of(name, runs)]
    _ok(run)
    _ok(ref)
    assert max_rel(run["losses"], ref["losses"]) <= TOLERANCE, (run["losses"], ref["name"], ref["losses"])
    assert sorted(run["layer_report"]) == ["1", "2"], run["layer_report"]
    assert all(r["attention"] == "fcp" and len(r["cp_ranks"]) == 2 for r in run["layer_report"].values())


def test_without_fcp_megatron_refuses_cp_without_te_itself(runs):
    run = runs["no_fcp"]
    assert run["returncode"] != 0
    assert MEGATRON_CP_REFUSAL in run["log"], run["log_tail"]
    assert "FCP not enabled (no --fcp); ignoring --fcp-graph ring --fcp-topology dgx-h100:1" in run["log"]
    assert run["layer_report"] == {}
