"""Worker side of tests/test_head_parallel_thd.py: the head-parallel stage on packed batches, gloo.

Every rank builds the case's packed batch (FP64, seeded by the case name, the same everywhere),
the plan with ``compile_packed_head_parallel`` (pure, identical on every rank), its process groups
(``create_head_parallel_groups``, collective, once per head-group partition) and the FP64
per-document reference; runs ``fcp_head_parallel_packed_attention_with_lse`` through autograd on
its shard of the member placement and reports its errors for out, LSE, dQ, dK, dV. Bad input is
probed first (a call that communicated before refusing would derail every case after it).
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

QUANTITIES = ("out", "lse", "dq", "dk", "dv")
TOPOLOGY_2X2 = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "topology_2x2.yaml")
TOPOLOGIES = {4: TOPOLOGY_2X2, 8: "dgx-h100:1"}
DOCS = {
    "mix": (1, 37, 3, 5, 90, 2, 1, 7, 13, 61, 4, 1, 2),   # short and long, lengths divisible by nothing
    "one": (53,),                                        # one document cut over every group
    "tiny": (1, 2),                                      # members without tokens
}


@dataclass(frozen=True)
class Case:
    degree: int
    docs: str
    causal: bool
    heads: tuple = (4, 2)
    graph: str = "hierarchical"
    dtype: str = "fp64"
    kernel: str = "math"
    sink: bool = False
    layout: str = "fcp"      # "thd": TE's per-document zigzag over the groups, on TE's ring

    @property
    def name(self) -> str:
        return (f"a{self.degree}-{self.docs}-{'causal' if self.causal else 'full'}-h{self.heads[0]}kv{self.heads[1]}-"
                f"{self.graph}-{self.dtype}-{self.kernel}{'-sink' if self.sink else ''}-{self.layout}")


def make_plan(case: Case, ranks: tuple):
    from megatron_fcp.planner.head_parallel import compile_packed_head_parallel

    return compile_packed_head_parallel(TOPOLOGIES[len(ranks)], ranks, DOCS[case.docs], *case.heads, case.degree,
                                        case.graph, causal=case.causal, block_tokens=8, layout=case.layout)


def _inputs(case: Case):
    h, hk = case.heads
    t, d = sum(DOCS[case.docs]), 8
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    return [torch.randn(t, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk, h)]


def _sink_reference(q, k, v, do, lengths, causal, scale, offset):
    """Per document, plain autograd with a sink column (logit ``offset[h]``, no value)."""
    outs, lses = [], []
    start = 0
    qa, ka, va = (x.clone().requires_grad_(True) for x in (q, k, v))
    for n in lengths:
        sl = slice(start, start + n)
        qh, kh, vh = qa[sl].transpose(0, 1), ka[sl].transpose(0, 1), va[sl].transpose(0, 1)   # [h, n, d]
        kh = kh.repeat_interleave(q.shape[1] // k.shape[1], 0)
        vh = vh.repeat_interleave(q.shape[1] // k.shape[1], 0)
        s = qh @ kh.transpose(1, 2) * scale                                                     # [h, n, n]
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        s = torch.cat([s, offset.view(-1, 1, 1).expand(-1, n, 1)], dim=-1)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None])[..., :n]
        outs.append((p @ vh).transpose(0, 1))
        lses.append(lse.detach())
        start += n
    out = torch.cat(outs)
    out.backward(do)
    return {"out": out.detach(), "lse": torch.cat(lses, -1), "dq": qa.grad, "dk": ka.grad, "dv": va.grad}


def _run_case(case: Case, group, ranks: tuple, rank: int, hp_groups: dict) -> dict:
    from megatron_fcp.attention.head_parallel_thd import (
        fcp_head_parallel_packed_attention_with_lse,
    )
    from megatron_fcp.attention.stats import FCPStats
    from megatron_fcp.testing.harness import per_document_reference

    hp = make_plan(case, ranks)
    idx = ranks.index(rank)
    dt = {"fp64": torch.float64, "fp32": torch.float32}[case.dtype]
    q, k, v, do = (x.to(dt).double() for x in _inputs(case))             # the reference in FP64 of the same values
    scale = 1.0 / math.sqrt(q.shape[-1])
    lengths = DOCS[case.docs]
    offset = torch.linspace(-1.0, 1.0, q.shape[1], dtype=torch.float64) if case.sink else None
    if offset is None:
        ref = per_document_reference(q, k, v, do, lengths, case.causal, scale)
    else:
        ref = _sink_reference(q, k, v, do, lengths, case.causal, scale, offset)
    pl = hp.placement
    local = {n: (pl.shard(x.t(), idx).t() if n == "lse" else pl.shard(x, idx)) for n, x in ref.items()}
    ql, kl, vl, dl = (pl.shard(x, idx).to(dt).requires_grad_(True) for x in (q, k, v, do))
    stats = FCPStats()
    out, lse = fcp_head_parallel_packed_attention_with_lse(
        ql, kl, vl, cp_group=group, hp_plan=hp, groups=hp_groups.get(hp.head_groups), causal=case.causal,
        kernel=case.kernel, stats=stats, softmax_offset=None if offset is None else offset.to(dt))
    out.backward(dl.detach())
    got = {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    err = {n: ((got[n].double() - local[n].double()).abs().max().item() if local[n].numel() else 0.0)
           for n in QUANTITIES}
    return {"err": err, "ref_max": {n: local[n].abs().max().item() if local[n].numel() else 0.0 for n in QUANTITIES},
            "tokens": ql.shape[0], "a2a_bytes": stats.head_parallel_bytes_sent, "groups": hp.num_groups}


def _bad_inputs(group, ranks: tuple, hp_groups: dict) -> dict:
    """Each probe must raise ValueError on every rank before any communication."""
    from megatron_fcp.attention.head_parallel_thd import (
        fcp_head_parallel_packed_attention_with_lse,
    )

    case = Case(2, "mix", True)
    hp = make_plan(case, ranks)
    idx = ranks.index(dist.get_rank())
    t = hp.placement.tokens(idx)
    groups = hp_groups.get(hp.head_groups)

    def call(t=t, h=4, hk=2, **kw):
        q, k, v = torch.randn(t, h, 8), torch.randn(t, hk, 8), torch.randn(t, hk, 8)
        kw = {"cp_group": group, "hp_plan": hp, "groups": groups, **kw}
        fcp_head_parallel_packed_attention_with_lse(q, k, v, **kw)

    probes = {
        "tokens": lambda: call(t=t + 1),
        "heads": lambda: call(h=3, hk=1),          # 3 query heads over a = 2
        "rep": lambda: call(h=4, hk=1),            # the plan was built for h_kv = 2 (no KV replication)
        "causal": lambda: call(causal=False),
        "plan": lambda: call(hp_plan="not a plan"),
    }
    out = {}
    for name, fn in probes.items():
        try:
            fn()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def worker(rank: int, world: int, cases: list) -> dict:
    from megatron_fcp.attention.head_parallel import create_head_parallel_groups

    torch.manual_seed(1234 + rank)
    ranks = tuple(range(world))
    partitions = sorted({make_plan(c, ranks).head_groups for c in cases + [Case(2, "mix", True)]})
    mine = create_head_parallel_groups(partitions)   # None for one head group: the CP group serves
    hp_groups = {p: g for p, g in zip(partitions, mine) if g is not None}
    results = {"bad_inputs": _bad_inputs(dist.group.WORLD, ranks, hp_groups)}
    results.update({c.name: _run_case(c, dist.group.WORLD, ranks, rank, hp_groups) for c in cases})
    return results
