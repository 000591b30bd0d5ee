"""Sliding windows on real process groups: zigzag cp = 4 through ``fcp_attention_with_lse`` and autograd.

Each rank builds the same global FP64 inputs, runs its zigzag shard through the public API (gloo,
the default transport, agreement on), backpropagates, and reports per tensor its shard's max error
against the single-device FP64 reference and the reference's max.
"""

from __future__ import annotations

import math

CASES = [  # (name, causal, window, plan, backward_kv)
    ("causal-w5-ring-keep", True, (5, 0), "ring", "keep"),
    ("causal-w13-full-resend", True, (13, 0), "full", "resend"),
    ("left3-right4-ring-resend", False, (3, 4), "ring", "resend"),
]


def worker(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.kernels import reference_attention
    from megatron_fcp.attention.layout import zigzag_split

    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(7)
    s, b, h, hk, d = 2 * world * 6, 2, 4, 2, 8
    q, do = (torch.randn(s, b, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(s, b, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
    scale = 1.0 / math.sqrt(d)
    report = {}
    for name, causal, window, plan, backward_kv in CASES:
        ref = reference_attention(q, k, v, causal=causal, scale=scale, dout=do, window=window)
        ql, kl, vl = (zigzag_split(x, world, rank).requires_grad_() for x in (q, k, v))
        out, lse = fcp_attention_with_lse(ql, kl, vl, cp_group=group, plan=plan, causal=causal, kernel="math",
                                          backward_kv=backward_kv, window=window)
        out.backward(zigzag_split(do, world, rank))
        got = {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        want = {n: zigzag_split(ref[n], world, rank, seq_dim=2 if n == "lse" else 0) for n in got}
        report[name] = {n: ((got[n].double() - want[n]).abs().max().item(), want[n].abs().max().item())
                        for n in got}
    report.update(_head_parallel(rank, world, group, (q, k, v, do), scale))
    return report


def _head_parallel(rank: int, world: int, group, inputs, scale) -> dict:
    """The head-parallel stage passes the window through: degree 4 (Ulysses: the local kernel over
    the whole sequence) and degree 2 (a KV stage over the group placement), GQA 4:2."""
    from _head_parallel_cases import make_hp_plan

    from megatron_fcp.attention.head_parallel import (
        create_head_parallel_groups,
        fcp_head_parallel_attention_with_lse,
    )
    from megatron_fcp.attention.kernels import reference_attention
    from megatron_fcp.attention.layout import zigzag_split

    q, k, v, do = inputs
    ranks, s = tuple(range(world)), q.shape[0]
    report = {}
    plans = {4: make_hp_plan(ranks, 4, s, True, "full", 4, 2), 2: make_hp_plan(ranks, 2, s, True, "full", 4, 2)}
    groups = {2: create_head_parallel_groups([plans[2]])[0], 4: None}
    window = (5, 0)
    ref = reference_attention(q, k, v, causal=True, scale=scale, dout=do, window=window)
    for degree, hp in plans.items():
        ql, kl, vl = (zigzag_split(x, world, rank).requires_grad_() for x in (q, k, v))
        out, lse = fcp_head_parallel_attention_with_lse(ql, kl, vl, cp_group=group, hp_plan=hp, groups=groups[degree],
                                                        causal=True, softmax_scale=scale, kernel="math",
                                                        window=window)
        out.backward(zigzag_split(do, world, rank))
        got = {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        want = {n: zigzag_split(ref[n], world, rank, seq_dim=2 if n == "lse" else 0) for n in got}
        report[f"head-parallel-a{degree}-w5"] = {
            n: ((got[n].double() - want[n]).abs().max().item(), want[n].abs().max().item()) for n in got}
    return report


def run() -> list[dict]:
    from megatron_fcp.testing.launch import run_gloo

    return run_gloo(worker, 4, timeout_s=240)
