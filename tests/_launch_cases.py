"""The gloo half of tests/test_launches.py: on a 4-process world, through autograd, each rank counts
its block kernel's calls (forward and backward) and reports them with its errors against the FP64
reference. Cases: a zigzag ring with sub-blocks (cp = 4) and a head-parallel stage (degree 2, the
KV stage a full plan over the group placement of two virtual ranks)."""

from __future__ import annotations

import math
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from megatron_fcp.attention.kernels import MathKernel  # noqa: E402

QUANTITIES = ("out", "lse", "dq", "dk", "dv")
H, HK, D, B = 4, 2, 8, 2
SEQ = 64


class CountingKernel(MathKernel):
    """The math kernel counting its calls (one process: one rank)."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()

    def forward(self, *a, **kw):
        self.calls["fwd"] += 1
        return super().forward(*a, **kw)

    def backward(self, *a, **kw):
        self.calls["bwd"] += 1
        return super().backward(*a, **kw)


def inputs():
    g = torch.Generator().manual_seed(11)
    return [torch.randn(SEQ, B, h, D, generator=g, dtype=torch.float64) for h in (H, HK, HK, H)]


def hp_plan(ranks: tuple):
    from _head_parallel_cases import make_hp_plan
    return make_hp_plan(ranks, 2, SEQ, True, "full", H, HK)


def ring_plan_p2(ranks: tuple):
    from megatron_fcp.contract.plan import ring_plan
    return ring_plan(ranks, True, 2)


def worker(rank: int, world: int) -> dict:
    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.head_parallel import create_head_parallel_groups, fcp_head_parallel_attention_with_lse
    from megatron_fcp.attention.kernels import reference_attention
    from megatron_fcp.attention.layout import zigzag_split

    ranks = tuple(range(world))
    q, k, v, do = inputs()
    ref = reference_attention(q, k, v, causal=True, scale=1 / math.sqrt(D), dout=do)
    local = {n: zigzag_split(x, world, rank, seq_dim=2 if n == "lse" else 0) for n, x in ref.items()}
    hp = hp_plan(ranks)
    (groups,) = create_head_parallel_groups([hp])
    out = {}
    for name in ("ring-p2", "head-parallel"):
        kern = CountingKernel()
        ql, kl, vl = (zigzag_split(x, world, rank).requires_grad_() for x in (q, k, v))
        if name == "ring-p2":
            o, lse = fcp_attention_with_lse(ql, kl, vl, cp_group=dist.group.WORLD, plan=ring_plan_p2(ranks),
                                            causal=True, kernel=kern)
        else:
            o, lse = fcp_head_parallel_attention_with_lse(ql, kl, vl, cp_group=dist.group.WORLD, hp_plan=hp,
                                                          groups=groups, causal=True, kernel=kern)
        fwd = kern.calls["fwd"]
        o.backward(zigzag_split(do, world, rank))
        got = {"out": o.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        out[name] = {"fwd": fwd, "bwd": kern.calls["bwd"],
                     "err": {n: (got[n] - local[n]).abs().max().item() for n in QUANTITIES}}
    return out
