"""Run a Megatron-LM pretrain script under test: CUDA stand-ins (on CPU) and the loop's own losses.

    torchrun --nproc-per-node 2 tests/megatron_driver/run_cpu.py -m megatron_fcp.run \\
        tests/megatron_driver/pretrain_gpt_like.py <Megatron flags> --fcp ...
    torchrun --nproc-per-node 2 tests/megatron_driver/run_cpu.py tests/megatron_driver/pretrain_gpt_like.py ...

Testing support (tests/test_megatron_pretrain.py, benchmarks/gpu_check.py), not product code:

1. without CUDA, installs :mod:`cpu_standins` (each named; the list goes to the metrics);
2. wraps ``megatron.training.training:training_log`` to record, per iteration, the ``lm loss`` of
   the loss dict the training loop reduced for that iteration (Megatron's *printed* ``lm loss``
   averages over the logging interval; the dict does not);
3. runs the target as ``__main__`` (``-m MODULE`` or a script path), like ``python`` would;
4. rank 0 writes ``$FCP_PRETRAIN_METRICS`` (JSON): losses, grad norms, the FCP layer report
   (which attention serves each layer), the stand-ins, the megatron-core version, and the exit
   status -- also when the run fails, so the test can read Megatron's own error.
"""

from __future__ import annotations

import inspect
import json
import os
import runpy
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def _capture_losses(record: dict) -> None:
    import megatron.training.training as training

    original = training.training_log
    signature = inspect.signature(original)

    def training_log(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        loss = bound.get("loss_dict", {}).get("lm loss")
        if loss is not None:
            it = int(bound["iteration"])
            record["losses"][str(it)] = float(loss.item() if hasattr(loss, "item") else loss)
            norm = bound.get("grad_norm")
            record["grad_norms"][str(it)] = None if norm is None else float(norm)
        return original(*args, **kwargs)

    training.training_log = training_log


def _layer_report() -> dict:
    try:
        from megatron_fcp.patches.runtime import current_runtime
    except ImportError:
        return {}
    runtime = current_runtime()
    return {} if runtime is None else {str(k): v for k, v in runtime.layer_report.items()}


def main() -> int:
    import torch

    argv = sys.argv[1:]
    record: dict = {"losses": {}, "grad_norms": {}, "standins": [], "cuda": torch.cuda.is_available()}
    if not record["cuda"]:
        sys.path.insert(0, HERE)
        from cpu_standins import install_cpu_standins

        record["standins"] = install_cpu_standins()
    from megatron_fcp.patches import megatron_core_version

    record["megatron_core"] = megatron_core_version()
    rc = 0
    try:
        _capture_losses(record)
        if argv[:1] == ["-m"]:
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if rc:
            record["error"] = f"SystemExit({exc.code!r})"
    except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised
        rc = 1
        record["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        raise
    finally:
        record["rc"] = rc
        record["layer_report"] = _layer_report()
        record["losses"] = [record["losses"][k] for k in sorted(record["losses"], key=int)]
        record["grad_norms"] = [record["grad_norms"][k] for k in sorted(record["grad_norms"], key=int)]
        path = os.environ.get("FCP_PRETRAIN_METRICS")
        if path and os.environ.get("RANK", "0") == "0":
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(record, fh, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
