"""The runs of Megatron-LM's ``pretrain()`` with the driver: flags, configurations, one subprocess each.

Shared by tests/test_megatron_pretrain.py (CPU) and benchmarks/gpu_check.py (CUDA, section
``pretrain``). A run is ``torchrun run_cpu.py <target> <MEGATRON_FLAGS> --context-parallel-size
.. --tensor-model-parallel-size ..``; rank 0's record (losses of the loop's own loss dict, layer
report, stand-ins) comes back with the return code, seconds and the log.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DRIVER = str(HERE / "pretrain_gpt_like.py")
TOLERANCE = 1e-5
STEPS = 5
#: a 2-layer GPT, mock data, gloo, every fusion off (CPU has none); the same on CUDA
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
FCP_YAML = "fcp:\n  graph: ring\n  topology: dgx-h100:1\n"
LAUNCHER = ["-m", "megatron_fcp.run", DRIVER]
#: name -> ranks, cp, tp, the target and its own flags; yaml: options via $MEGATRON_FCP_CONFIG
RUNS = {
    "cp1": dict(ranks=1, cp=1, tp=1, argv=[DRIVER]),
    "launcher": dict(ranks=2, cp=2, tp=1, argv=[*LAUNCHER, "--fcp", *FCP_FLAGS]),
    "spec": dict(ranks=4, cp=2, tp=2, argv=[DRIVER, "--spec", "megatron_fcp.spec", "fcp_layer_spec"], yaml=True),
    "no_fcp": dict(ranks=2, cp=2, tp=1, argv=[*LAUNCHER, *FCP_FLAGS]),
}
#: Megatron's own tp = 2 x cp = 1 run: the reference of the tp = 2 runs on releases whose own tp = 2
#: run does not reproduce tp = 1's losses (megatron-core 0.17.1: 4.845 vs 4.545 at iteration 1, no
#: FCP involved; 0.18 and 0.19 match tp = 1 to 1e-7)
TP2_REFERENCE = dict(ranks=2, cp=1, tp=2, argv=[DRIVER])
TP2_REFERENCE_BEFORE = (0, 18)


def runs_for(version: tuple[int, int]) -> dict:
    """The runs for a megatron-core ``(major, minor)``: :data:`RUNS`, plus ``tp2cp1`` where needed."""
    return {**RUNS, "tp2cp1": TP2_REFERENCE} if version < TP2_REFERENCE_BEFORE else dict(RUNS)


def reference_of(name: str, records: dict) -> str:
    """Which run ``name`` is compared with: ``tp2cp1`` for tp = 2 runs where it exists, else ``cp1``."""
    return "tp2cp1" if records[name]["tp"] == 2 and "tp2cp1" in records else "cp1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def run_pretrain(name: str, tmp: Path, *, ranks: int, cp: int, tp: int, argv: list[str], yaml: bool = False,
                 timeout_s: int = 420) -> dict:
    """One torchrun subprocess in ``tmp``; rank 0's record plus return code, seconds and log."""
    metrics = tmp / f"{name}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "FCP_PRETRAIN_METRICS": str(metrics),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    if yaml:
        path = tmp / "fcp.yaml"
        path.write_text(FCP_YAML)
        env["MEGATRON_FCP_CONFIG"] = str(path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-port", str(_free_port()), str(HERE / "run_cpu.py"), *argv, *MEGATRON_FLAGS,
           "--context-parallel-size", str(cp), "--tensor-model-parallel-size", str(tp)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, log = None, f"timed out after {timeout_s} s\n{exc.stdout or ''}{exc.stderr or ''}"
    record = json.loads(metrics.read_text()) if metrics.exists() else {"losses": [], "error": "no metrics written"}
    record.update(name=name, returncode=rc, seconds=round(time.perf_counter() - t0, 1), ranks=ranks, cp=cp, tp=tp,
                  log=log if isinstance(log, str) else str(log))
    record["log_tail"] = record["log"][-3000:]
    return record
