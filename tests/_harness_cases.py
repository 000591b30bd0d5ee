"""Cases the in-process harness must reproduce bit for bit from real gloo process groups.

Each case is one attention call at cp = 4 (a plan, inputs, a kernel, a backward KV mode): the
gloo side (:func:`gloo_bitwise`, inside a worker of tests/test_attention_dist.py) runs it through
``fcp_attention_with_lse`` and autograd on its process group; :func:`harness_bitwise` runs it in
one process with :func:`megatron_fcp.testing.harness.harness_attention`. The test compares
out, lse, dq, dk, dv per rank with ``torch.equal``.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import torch

QUANTITIES = ("out", "lse", "dq", "dk", "dv")
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
TOPOLOGY_2X2 = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "topology_2x2.yaml")
DOCS = (1, 37, 3, 5, 90, 2, 1, 7, 13, 61, 4, 1, 2)


@dataclass(frozen=True)
class BitCase:
    layout: str           # "zigzag" | "packed"
    plan: str             # "ring" | "full" | "spanning" (pcie-box preset, relays) | "hier" (2x2 YAML)
    causal: bool
    dtype: str
    kernel: str = "math"
    backward_kv: str = "keep"

    @property
    def name(self) -> str:
        return (f"{self.layout}-{self.plan}-{'causal' if self.causal else 'full'}-{self.dtype}-{self.kernel}"
                f"-{self.backward_kv}")


CASES = [
    BitCase("zigzag", "ring", True, "fp32"),
    BitCase("zigzag", "full", False, "bf16", "cpu-flash"),
    BitCase("zigzag", "spanning", True, "fp32", backward_kv="resend"),
    BitCase("zigzag", "spanning", True, "fp64"),
    BitCase("zigzag", "hier", True, "fp32", "cpu-flash", backward_kv="auto"),
    BitCase("packed", "full", True, "fp32"),
    BitCase("packed", "hier", True, "bf16", "cpu-flash", backward_kv="resend"),
    BitCase("packed", "full", False, "fp64"),
]


def _setup(case: BitCase, ranks: tuple):
    """(global q, k, v, dout in the case dtype, placement or None, plan argument)."""
    from megatron_fcp.contract.placement import place_packed
    from megatron_fcp.planner.build import build_plan

    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    dt = DTYPES[case.dtype]
    placement = None
    if case.layout == "packed":
        placement = place_packed(DOCS, len(ranks), block_tokens=8, causal=case.causal)
        shapes = [(placement.total_tokens, h, 8) for h in (4, 2, 2, 4)]
    else:
        shapes = [(64, 2, h, 8) for h in (4, 2, 2, 4)]
    q, k, v, do = (torch.randn(*s, generator=g, dtype=torch.float64).to(dt) for s in shapes)
    if case.plan in ("ring", "full"):
        plan = case.plan if placement is None or case.plan == "full" else None
    else:
        topo = "pcie-box:1" if case.plan == "spanning" else TOPOLOGY_2X2
        builder = "spanning" if case.plan == "spanning" else "hierarchical"
        parts = 2 if placement is None else 1
        plan = build_plan(topo, ranks, builder, causal=case.causal, parts_per_chunk=parts, placement=placement)
    return (q, k, v, do), placement, plan


def gloo_bitwise(group, ranks: tuple, rank: int) -> dict:
    """This gloo rank's out, lse, dq, dk, dv for every case (the autograd path)."""
    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.layout import zigzag_split

    idx = ranks.index(rank)
    res = {}
    for case in CASES:
        (q, k, v, do), pl, plan = _setup(case, ranks)
        shard = (lambda x: pl.shard(x, idx)) if pl is not None else (lambda x: zigzag_split(x, len(ranks), idx))
        ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
        out, lse = fcp_attention_with_lse(ql, kl, vl, cp_group=group, plan=plan, causal=case.causal,
                                          kernel=case.kernel, placement=pl, backward_kv=case.backward_kv)
        out.backward(shard(do))
        res[case.name] = {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    return res


def harness_bitwise(case: BitCase, ranks: tuple = (0, 1, 2, 3)) -> list[dict]:
    """Every rank's out, lse, dq, dk, dv for ``case``, from the in-process harness."""
    from megatron_fcp.testing.harness import harness_attention

    (q, k, v, do), pl, plan = _setup(case, ranks)
    res = harness_attention(q, k, v, do, ranks=ranks, plan=plan, causal=case.causal, kernel=case.kernel,
                            placement=pl, backward_kv=case.backward_kv)
    return [r.tensors() for r in res.ranks]
