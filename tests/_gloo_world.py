"""One gloo world of 4 processes for the attention tests' process-group path.

The numerics matrices run in the in-process harness; what must run on real process groups
(tests/test_attention_dist.py, tests/test_attention_thd.py, tests/test_backward_kv.py,
tests/test_mla.py: a few
cases each through autograd and GlooTransport, the bad-input probes, the bit-for-bit cases the
harness must reproduce, the bounded-wait probe) shares this one world, so the suite starts 4
processes once instead of once per file. Order inside a rank: packed cases, backward KV modes,
then the zigzag worker, whose bounded-wait probe breaks a gloo pair and so runs last.
"""

from __future__ import annotations


def worker(rank: int, world: int) -> dict:
    import _attention_cases
    import _backward_kv_cases
    import _mla_cases
    import _thd_cases

    return {
        "thd": _thd_cases.worker(rank, world, _thd_cases.GLOO_CASES),
        "backward_kv": _backward_kv_cases.worker(rank, world),
        "mla": _mla_cases.worker(rank, world),
        "dist": _attention_cases.worker(rank, world, _attention_cases.GLOO_CASES),
    }


def run() -> list[dict]:
    from megatron_fcp.testing.launch import run_gloo

    return run_gloo(worker, 4, timeout_s=480)
