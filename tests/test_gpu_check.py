"""benchmarks/gpu_check.py's shared pieces on CPU, so the GPU check does not rot between GPU runs:
the cp = 4 blockwise computation (the executor's arithmetic, rank by rank) against FP64 for
fixed-length and packed inputs, and the summary the script prints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_blockwise_numerics_on_cpu_meet_the_rule():
    rows = gpu_check.section_numerics(torch.device("cpu"), [torch.float32], small=True)
    kernels = {(r["kernel"], r["case"]) for r in rows}
    assert {("math", "fixed"), ("math", "packed"), ("cpu-flash", "fixed"), ("cpu-flash", "packed")} <= kernels
    for r in rows:
        for n in gpu_check.QUANT:
            assert r[n]["ok"] and r[n]["err"] < 1e-5, (r["kernel"], r["case"], n, r[n])
    summary = gpu_check.summarize({"numerics": rows})
    assert summary["numerics_all_ok"] and summary["numerics_cases"] == len(rows) and not summary["numerics_failures"]


def test_a_wrong_result_fails_the_rule():
    """The 2x rule is not vacuous: a perturbed output is judged not ok."""
    ref = {n: torch.zeros(4, dtype=torch.float64) for n in gpu_check.QUANT}
    plain = {n: torch.full((4,), 1e-3) for n in gpu_check.QUANT}
    got = dict(plain, out=torch.full((4,), 1e-2))
    verdict = gpu_check.compare(got, ref, plain)
    assert not verdict["out"]["ok"] and all(verdict[n]["ok"] for n in gpu_check.QUANT if n != "out")


def test_a_failed_run_keeps_the_exception_line():
    """The GPT section's traceback keeps what failed (the last line), not only where it started."""
    frames = "".join(f"[rank0]:   File \"m.py\", line {i}, in f{i}\n[rank0]:     f{i + 1}()\n" for i in range(200))
    text = ("INFO starting\n[rank0]: Traceback (most recent call last):\n" + frames
            + "[rank0]: RuntimeError: expected scalar type BFloat16 but found Float\n"
            + "E1130 torch.distributed.elastic.multiprocessing.api: failed\nTraceback (most recent call last):\n"
            + "  File \"run.py\", line 1\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: x\n")
    tb = gpu_check.first_traceback(text, keep=500)
    assert tb.endswith("RuntimeError: expected scalar type BFloat16 but found Float")
    assert len(tb) <= 504 and "ChildFailedError" not in tb
    assert gpu_check.first_traceback("all good\n") is None


def test_pretrain_section_skips_with_the_reason_where_it_cannot_run():
    """Without megatron.training (megatron-core < 0.17) or without CUDA the section says why."""
    res = gpu_check.section_pretrain(torch.device("cpu"))
    assert "skipped" in res and ("megatron.training" in res["skipped"] or "CPU" in res["skipped"])
    assert gpu_check.summarize({"pretrain": res})["pretrain"] == res["skipped"]
