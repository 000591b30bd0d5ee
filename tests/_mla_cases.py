"""Worker side of tests/test_mla.py's process-group case, run inside the shared gloo world
(tests/_gloo_world.py): MLA (d_qk = 48, d_v = 32) through ``fcp_attention_with_lse`` and autograd on
real gloo process groups at cp = 4, zigzag (ring plan) and packed (full plan), FP64, against the
single-device reference; and a bad MLA shape refused before any communication."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

D_QK, D_V = 48, 32
DOCS = (1, 37, 3, 5, 50, 2, 13, 7)
QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def _errors(got: dict, want: dict) -> dict:
    return {n: (got[n].double() - want[n]).abs().max().item() for n in QUANTITIES}


def worker(rank: int, world: int) -> dict:
    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.kernels import reference_attention
    from megatron_fcp.attention.layout import zigzag_split
    from megatron_fcp.contract.placement import place_packed
    from megatron_fcp.contract.plan import full_plan
    from megatron_fcp.testing.harness import per_document_reference

    group, ranks = dist.group.WORLD, tuple(range(world))
    scale = 1.0 / math.sqrt(D_QK)
    g = torch.Generator().manual_seed(2026)
    out: dict = {}
    # bad shape first (k and v disagree on tokens): refused before any communication
    try:
        fcp_attention_with_lse(torch.randn(8, 1, 4, D_QK), torch.randn(8, 1, 2, D_QK), torch.randn(6, 1, 2, D_V),
                               cp_group=group, plan="ring")
        out["bad"] = "no error"
    except ValueError as exc:
        out["bad"] = str(exc)
    # zigzag, ring plan, GQA 4:2
    s = 2 * world * 6
    q = torch.randn(s, 2, 4, D_QK, generator=g, dtype=torch.float64)
    k = torch.randn(s, 2, 2, D_QK, generator=g, dtype=torch.float64)
    v = torch.randn(s, 2, 2, D_V, generator=g, dtype=torch.float64)
    do = torch.randn(s, 2, 4, D_V, generator=g, dtype=torch.float64)
    ref = reference_attention(q, k, v, causal=True, scale=scale, dout=do)
    want = {n: zigzag_split(x, world, rank, seq_dim=2 if n == "lse" else 0) for n, x in ref.items()}
    ql, kl, vl = (zigzag_split(x, world, rank).requires_grad_() for x in (q, k, v))
    o, lse = fcp_attention_with_lse(ql, kl, vl, cp_group=group, plan="ring", kernel="math")
    o.backward(zigzag_split(do, world, rank))
    out["zigzag"] = _errors({"out": o.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}, want)
    # packed, full plan, MQA 4:1
    t = sum(DOCS)
    q = torch.randn(t, 4, D_QK, generator=g, dtype=torch.float64)
    k = torch.randn(t, 1, D_QK, generator=g, dtype=torch.float64)
    v = torch.randn(t, 1, D_V, generator=g, dtype=torch.float64)
    do = torch.randn(t, 4, D_V, generator=g, dtype=torch.float64)
    pl = place_packed(DOCS, world, block_tokens=8, causal=True)
    ref = per_document_reference(q, k, v, do, DOCS, True, scale)
    want = {n: (pl.shard(x.transpose(0, 1), rank).transpose(0, 1) if n == "lse" else pl.shard(x, rank))
            for n, x in ref.items()}
    ql, kl, vl = (pl.shard(x, rank).requires_grad_() for x in (q, k, v))
    o, lse = fcp_attention_with_lse(ql, kl, vl, cp_group=group, placement=pl, plan=full_plan(ranks, True, placement=pl),
                                    kernel="math")
    o.backward(pl.shard(do, rank))
    out["packed"] = _errors({"out": o.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}, want)
    return out
