"""Cases of tests/test_sinks.py: attention sinks (Megatron's ``softmax_type``) against a dense reference.

:func:`sink_reference` is plain single-device attention with torch autograd in the inputs' dtype
(FP64 for the reference, BF16 for "plain BF16 attention" of the 2x rule), the sink written the way
megatron-core's ``SoftmaxOne`` writes it: one more column of logits, ``sink_h`` (not scaled),
concatenated to the scaled scores, the softmax taken over both and the column dropped. It shares
nothing with FCP's code. :func:`packed_sink_reference` attends each document alone.

:func:`worker` is the real process-group path (4 gloo processes): ``fcp_attention_with_lse`` through
autograd on zigzag shards (learnable and off-by-one) and over a placement, the head-parallel stage
at a = 2 (a KV stage; also with KV heads repeated, h = 6, h_kv = 3) and a = 4 (local attention over
the whole sequence), and the bad-input
probes, each rank reporting its local errors and its share of dsink (the parent sums the shares:
Note [The sink's gradient across ranks] in megatron_fcp.attention.sinks).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def sink_reference(q, k, v, dout, sink, *, causal: bool, scale: float) -> dict:
    """Dense attention with a sink column: q, dout [s, b, h, d]; k, v [s, b, h_kv, d]; sink [h].
    Returns out [s,b,h,d], lse [b,h,s] (over keys and sink), dq, dk, dv and dsink [h]."""
    s, b, h, _ = q.shape
    g = h // k.shape[2]
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    sk = sink.detach().clone().requires_grad_()
    kr = k.repeat_interleave(g, dim=2).permute(1, 2, 0, 3)                  # [b, h, s, d]
    vr = v.repeat_interleave(g, dim=2).permute(1, 2, 0, 3)
    scores = torch.matmul(q.permute(1, 2, 0, 3), kr.transpose(-1, -2)) * scale  # [b, h, s, s]
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    column = sk.view(1, h, 1, 1).expand(b, h, s, 1)                         # [b, h, s, 1], unscaled
    logits = torch.cat([scores, column], dim=-1)                            # [b, h, s, s+1]
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    out = torch.matmul(probs, vr).permute(2, 0, 1, 3)                       # [s, b, h, d]
    out.backward(dout)
    return {"out": out.detach(), "lse": torch.logsumexp(logits, dim=-1).detach(), "dq": q.grad, "dk": k.grad,
            "dv": v.grad, "dsink": sk.grad}


def packed_sink_reference(q, k, v, dout, sink, lengths: Sequence[int], *, causal: bool, scale: float) -> dict:
    """Each document of a THD batch (q [T, h, d]) attended alone with the sink; lse [h, T]."""
    parts, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        parts.append(sink_reference(q[sl, None], k[sl, None], v[sl, None], dout[sl, None], sink,
                                    causal=causal, scale=scale))
        start += n
    res = {name: torch.cat([p[name][:, 0] for p in parts]) for name in ("out", "dq", "dk", "dv")}
    res["lse"] = torch.cat([p["lse"][0] for p in parts], dim=-1)
    res["dsink"] = sum(p["dsink"] for p in parts)
    return res


def inputs(name: str, s: int, b: int, h: int, hk: int, d: int = 8, *, thd: bool = False, learnable: bool = True):
    """Seeded FP64 q, k, v, dout (zigzag [s, b, h(_kv), d] or THD [s, h(_kv), d]) and a sink [h]:
    random logits around 0 for ``learnable``, zeros for off-by-one."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    qs, ks = ((s, h, d), (s, hk, d)) if thd else ((s, b, h, d), (s, b, hk, d))
    q, do = (torch.randn(*qs, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(*ks, generator=g, dtype=torch.float64) for _ in range(2))
    sink = torch.randn(h, generator=g, dtype=torch.float64) * 2 if learnable else torch.zeros(h, dtype=torch.float64)
    return q, k, v, do, sink


# ---------------------------------------------------------------------------------------------
# the gloo worker
# ---------------------------------------------------------------------------------------------
def _errors(got: dict, ref: dict) -> dict:
    return {n: (got[n].double() - ref[n]).abs().max().item() for n in got}


def _zigzag_case(rank: int, cp: int, plan: str, learnable: bool, backward_kv: str) -> dict:
    """fcp_attention_with_lse through autograd on this rank's zigzag shard (cp = 4, FP64, GQA 4:2)."""
    from megatron_fcp.attention.comm import CountingTransport, GlooTransport
    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.layout import zigzag_split

    name = f"gloo-zigzag-{plan}-{learnable}-{backward_kv}"
    q, k, v, do, sink = inputs(name, 2 * cp * 4, 2, 4, 2)
    scale = 1 / math.sqrt(q.shape[-1])
    ref = sink_reference(q, k, v, do, sink, causal=True, scale=scale)
    ql, kl, vl = (zigzag_split(x, cp, rank).requires_grad_() for x in (q, k, v))
    offset = sink.clone().requires_grad_(learnable)
    transport = CountingTransport(GlooTransport(dist.group.WORLD, timeout_s=60))
    out, lse = fcp_attention_with_lse(ql, kl, vl, cp_group=dist.group.WORLD, plan=plan, causal=True,
                                      transport=transport, backward_kv=backward_kv, softmax_offset=offset,
                                      kernel="math")
    out.backward(zigzag_split(do, cp, rank))
    got = {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    local = {n: zigzag_split(ref[n], cp, rank, seq_dim=2 if n == "lse" else 0) for n in QUANTITIES}
    return {"err": _errors(got, local), "dsink": None if offset.grad is None else offset.grad.clone(),
            "ref_dsink": ref["dsink"], "has_grad": offset.grad is not None, "posts": transport.posts}


def _packed_case(rank: int, cp: int) -> dict:
    """fcp_attention_with_lse over a placement through autograd (FP64, causal, GQA 4:2, learnable)."""
    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.contract.placement import place_packed

    docs = (1, 37, 3, 5, 30, 2, 1, 7, 13, 4)
    pl = place_packed(docs, cp, block_tokens=8, causal=True)
    q, k, v, do, sink = inputs("gloo-packed", pl.total_tokens, 1, 4, 2, thd=True)
    scale = 1 / math.sqrt(q.shape[-1])
    ref = packed_sink_reference(q, k, v, do, sink, docs, causal=True, scale=scale)
    ql, kl, vl = (pl.shard(x, rank).requires_grad_() for x in (q, k, v))
    offset = sink.clone().requires_grad_()
    out, lse = fcp_attention_with_lse(ql, kl, vl, cp_group=dist.group.WORLD, placement=pl, causal=True,
                                      softmax_offset=offset, kernel="math")
    out.backward(pl.shard(do, rank))
    got = {"out": out.detach(), "lse": lse.transpose(0, 1), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    local = {n: pl.shard(ref[n].transpose(0, 1) if n == "lse" else ref[n], rank) for n in QUANTITIES}
    return {"err": _errors(got, local), "dsink": offset.grad.clone(), "ref_dsink": ref["dsink"]}


def _head_parallel_case(rank: int, cp: int, degree: int, groups_by_degree: dict, heads: tuple) -> dict:
    """fcp_head_parallel_attention_with_lse at ``degree`` (FP64, causal, learnable), KV stage full_plan."""
    from _head_parallel_cases import make_hp_plan

    from megatron_fcp.attention.head_parallel import fcp_head_parallel_attention_with_lse
    from megatron_fcp.attention.layout import zigzag_split

    h, hk = heads
    name = f"gloo-hp{degree}-h{h}kv{hk}"
    s = 2 * cp * 4
    q, k, v, do, sink = inputs(name, s, 2, h, hk)
    scale = 1 / math.sqrt(q.shape[-1])
    ref = sink_reference(q, k, v, do, sink, causal=True, scale=scale)
    ranks = tuple(range(cp))
    hp_plan = make_hp_plan(ranks, degree, s, True, "full", h, hk)
    ql, kl, vl = (zigzag_split(x, cp, rank).requires_grad_() for x in (q, k, v))
    offset = sink.clone().requires_grad_()
    out, lse = fcp_head_parallel_attention_with_lse(ql, kl, vl, cp_group=dist.group.WORLD, hp_plan=hp_plan,
                                                    groups=groups_by_degree.get(degree), causal=True,
                                                    kernel="math", softmax_offset=offset)
    out.backward(zigzag_split(do, cp, rank))
    got = {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    local = {n: zigzag_split(ref[n], cp, rank, seq_dim=2 if n == "lse" else 0) for n in QUANTITIES}
    return {"err": _errors(got, local), "dsink": offset.grad.clone(), "ref_dsink": ref["dsink"]}


def _bad_inputs() -> dict:
    """Bad sinks: ValueError naming the fix, before any post."""
    from _attention_cases import probe_bad_inputs

    def t(h=4):
        return torch.randn(8, 2, h, 8)

    qkv = dict(q=t(), k=t(2), v=t(2))
    cases = {
        "shape": (qkv, dict(softmax_offset=torch.zeros(2)), "shape \\(2,\\) but q has 4 query heads"),
        "device": (qkv, dict(softmax_offset=torch.zeros(4, device="meta")), "move it to q's device"),
        "finite": (qkv, dict(softmax_offset=torch.tensor([0.0, float("inf"), 0.0, 0.0])), "non-finite"),
        "dtype": (qkv, dict(softmax_offset=torch.zeros(4, dtype=torch.int64)), "floating-point tensor"),
    }
    return probe_bad_inputs(cases, dist.group.WORLD, plan="ring", causal=True)


def worker(rank: int, world: int) -> dict:
    from _head_parallel_cases import make_hp_plan

    from megatron_fcp.attention.head_parallel import create_head_parallel_groups

    torch.manual_seed(1234 + rank)
    ranks = tuple(range(world))
    groups = create_head_parallel_groups([make_hp_plan(ranks, 2, 2 * world * 4, True, "full", 4, 2)])
    out = {f"zigzag-{plan}-{'learnable' if learn else 'off-by-one'}-{bkv}": _zigzag_case(rank, world, plan, learn, bkv)
           for plan, learn, bkv in (("ring", True, "keep"), ("full", True, "resend"), ("ring", False, "auto"))}
    out["packed"] = _packed_case(rank, world)
    out["hp2"] = _head_parallel_case(rank, world, 2, {2: groups[0]}, (4, 2))
    out["hp4"] = _head_parallel_case(rank, world, 4, {}, (8, 2))
    out["hp2-rep"] = _head_parallel_case(rank, world, 2, {2: groups[0]}, (6, 3))  # KV heads repeated
    out["bad_inputs"] = _bad_inputs()
    return out
