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

FCP's losses must match cp = 1 within 1e-5 relative at every iteration, every layer must report
FCP attention, and the run without ``--fcp`` must fail with Megatron's own assertion. Runs where
the wheel has ``megatron.training`` (megatron-core 0.17+, Python 3.12); tests/compat runs it per
release. ``$FCP_PRETRAIN_METRICS_OUT``: write every run's record there (JSON) for the matrix.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.training") is None:
    pytest.skip("megatron.training is not installed: megatron-core wheels ship it from 0.17 on (Python 3.12); "
                "tests/compat/run_matrix.sh runs this file on 0.17-0.19", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.dist]

ROOT = Path(__file__).resolve().parents[1]
DRIVER_DIR = ROOT / "tests" / "megatron_driver"
DRIVER = str(DRIVER_DIR / "pretrain_gpt_like.py")
TOLERANCE = 1e-5
STEPS = 5
MEGATRON_FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--train-iters", str(STEPS), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "constant",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
    "--make-vocab-size-divisible-by", "32",  # the same padded vocabulary at tp = 1 and tp = 2
    "--split", "100,0,0", "--distributed-backend", "gloo", "--transformer-impl", "local",
    "--use-cpu-initialization", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--position-embedding-type", "rope", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
    "--no-rope-fusion", "--no-create-attention-mask-in-dataloader", "--eval-iters", "0", "--eval-interval", "1000",
    "--log-interval", "1", "--seed", "1234",
]
FCP_FLAGS = ["--fcp-graph", "ring", "--fcp-topology", "dgx-h100:1"]
LAUNCHER = ["-m", "megatron_fcp.run", DRIVER]
RUNS = {
    "cp1": dict(ranks=1, cp=1, tp=1, argv=[DRIVER]),
    "launcher": dict(ranks=2, cp=2, tp=1, argv=[*LAUNCHER, "--fcp", *FCP_FLAGS]),
    "spec": dict(ranks=4, cp=2, tp=2, argv=[DRIVER, "--spec", "megatron_fcp.spec", "fcp_layer_spec"], yaml=True),
    "no_fcp": dict(ranks=2, cp=2, tp=1, argv=[*LAUNCHER, *FCP_FLAGS]),
}
MEGATRON_CP_REFUSAL = "Context parallelism is only supported by TEDotProductAttention"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pretrain(name: str, tmp: Path, *, ranks: int, cp: int, tp: int, argv: list[str], yaml: bool = False,
                 timeout_s: int = 420) -> dict:
    """One torchrun subprocess; returns rank 0's record plus the log tail and seconds."""
    metrics = tmp / f"{name}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "FCP_PRETRAIN_METRICS": str(metrics), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if yaml:
        path = tmp / "fcp.yaml"
        path.write_text("fcp:\n  graph: ring\n  topology: dgx-h100:1\n")
        env["MEGATRON_FCP_CONFIG"] = str(path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-port", str(_free_port()), str(DRIVER_DIR / "run_cpu.py"), *argv, *MEGATRON_FLAGS,
           "--context-parallel-size", str(cp), "--tensor-model-parallel-size", str(tp)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s)
    record = json.loads(metrics.read_text()) if metrics.exists() else {"losses": [], "error": "no metrics written"}
    record.update(name=name, returncode=proc.returncode, seconds=round(time.perf_counter() - t0, 1),
                  ranks=ranks, cp=cp, tp=tp, log=proc.stdout + proc.stderr)
    record["log_tail"] = record["log"][-3000:]
    return record


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("pretrain")
    out = {name: run_pretrain(name, tmp, **spec) for name, spec in RUNS.items()}
    path = os.environ.get("FCP_PRETRAIN_METRICS_OUT")
    if path:
        Path(path).write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ("log", "log_tail")}
                                          for k, v in out.items()}, indent=1))
    return out


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _ok(record: dict) -> None:
    assert record["returncode"] == 0, record["log_tail"]
    assert len(record["losses"]) == STEPS, record


def test_reference_trains(runs):
    _ok(runs["cp1"])
    assert runs["cp1"]["layer_report"] == {}  # no FCP anywhere in the reference


@pytest.mark.parametrize("name", ["launcher", "spec"])
def test_fcp_matches_cp1_and_serves_every_layer(runs, name):
    run = runs[name]
    _ok(run)
    assert max_rel(run["losses"], runs["cp1"]["losses"]) <= TOLERANCE, (run["losses"], runs["cp1"]["losses"])
    assert sorted(run["layer_report"]) == ["1", "2"], run["layer_report"]
    assert all(r["attention"] == "fcp" and len(r["cp_ranks"]) == 2 for r in run["layer_report"].values())


def test_without_fcp_megatron_refuses_cp_without_te_itself(runs):
    run = runs["no_fcp"]
    assert run["returncode"] != 0
    assert MEGATRON_CP_REFUSAL in run["log"], run["log_tail"]
    assert "FCP not enabled (no --fcp); ignoring --fcp-graph ring --fcp-topology dgx-h100:1" in run["log"]
    assert run["layer_report"] == {}
