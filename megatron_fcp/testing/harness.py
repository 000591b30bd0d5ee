"""The in-process multi-rank harness: every CP rank of one attention call, inside one process.

:func:`harness_attention` takes the *global* tensors, shards them (zigzag, or a packed batch's
placement), and runs the FCP executor for every CP rank of an
:class:`~megatron_fcp.testing.inprocess.InProcessGroup`: one thread per virtual rank (on CUDA one
stream each, one GPU), KV blocks and dK/dV partials exchanged by the in-process transport. The
engine code is the production code: :func:`~megatron_fcp.attention.function.build_executor`
validates, agrees (optionally), picks the backward KV mode and builds the ``_Executor`` exactly as
``fcp_attention_with_lse`` does; only the autograd wrapper is left out.

Note [Why the harness drives the executor, not autograd]
--------------------------------------------------------
``loss.backward()`` runs CUDA backward functions on *one* device worker thread shared by every
caller in the process. If virtual rank 0's backward blocks on a receive that virtual rank 1's
backward must post, and rank 1's backward is queued behind rank 0's on that worker, the process
deadlocks. The harness therefore calls the executor's ``forward`` and ``backward`` itself, each
rank in its own thread, with exactly what ``_FCPAttentionFunction`` passes them (the FP32
accumulator ``out``, ``lse``, the kept blocks or None for a re-send, ``dout`` in the input dtype):
results are bitwise those of the autograd path, on CPU and CUDA alike (one code path).

On CPU the harness reproduces the gloo multi-process results bit for bit for the same plan,
inputs, kernel and backward KV mode (tests/test_harness.py), so the numerics matrix runs here
without process start-up; the gloo tests keep the process-group path.
:func:`check_numerics_cases` is the ready-made cp = 4 matrix (fixed length and packed) against an
FP64 reference, for a GPU check script.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from megatron_fcp.attention.agreement import LastAgreed
from megatron_fcp.attention.comm import Transport
from megatron_fcp.attention.function import build_executor
from megatron_fcp.attention.kernels import reference_attention
from megatron_fcp.attention.layout import zigzag_split, zigzag_unsplit
from megatron_fcp.attention.stats import FCPStats
from megatron_fcp.contract.placement import Placement
from megatron_fcp.schedule.program import RING_BUDGET, BackwardProgram
from megatron_fcp.testing.inprocess import InProcessGroup, VirtualRank

__all__ = ["harness_attention", "HarnessResult", "RankResult", "per_document_reference", "check_numerics_cases",
           "assert_packed_matches_fp64", "QUANTITIES"]

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


@dataclass
class RankResult:
    """One virtual rank's shard of the results. Zigzag: out, dq ``[s_local, b, h, d]``; dk, dv
    ``[s_local, b, h_kv, d]``; lse ``[b, h, s_local]``. Packed (THD): out, dq ``[t_local, h, d]``,
    dk, dv ``[t_local, h_kv, d]``, lse ``[h, t_local]``. Gradients are None without ``dout``."""

    rank: int
    index: int                                  # CP index
    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    transport: Transport                        # what the executor posted on (wrappers included)
    stats: FCPStats | None
    backward_kv: str                            # "keep" | "resend", as decided for this call
    kept_bytes: int                             # received KV held from forward to backward
    program: "BackwardProgram | None" = None    # the backward program the executor ran
    dsink: torch.Tensor | None = None           # [h] this rank's rows' sink gradient (softmax_offset given)

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {n: getattr(self, n) for n in QUANTITIES}


@dataclass
class HarnessResult:
    """Every rank's :class:`RankResult` in CP order; :meth:`gathered` rebuilds the global tensors."""

    ranks: list[RankResult]
    placement: Placement | None

    def gathered(self, name: str) -> torch.Tensor:
        """The global ``name`` (one of :data:`QUANTITIES`): zigzag ``[s, ...]`` (lse ``[b, h, s]``),
        packed ``[T, ...]`` (lse ``[h, T]``)."""
        shards = [getattr(r, name) for r in self.ranks]
        if self.placement is None:
            return zigzag_unsplit(shards, seq_dim=2 if name == "lse" else 0)
        if name == "lse":
            return self.placement.unshard([x.transpose(0, 1) for x in shards]).transpose(0, 1)
        return self.placement.unshard(shards)


def _plan_for(plan, ranks: tuple[int, ...]):
    return plan(ranks) if callable(plan) else plan


def harness_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None = None, *,
    cp: int | None = None, ranks: Sequence[int] | None = None, plan: Any = None, causal: bool = True,
    softmax_scale: float | None = None, kernel: Any = "math", placement: Placement | None = None,
    backward_kv: str = "auto", kv_memory_budget: int = RING_BUDGET, device: "str | torch.device | None" = None,
    timeout_s: float = 60.0, transport: Callable[[int, Transport], Transport] | None = None,
    stats: bool = False, agree: bool = False, softmax_offset: torch.Tensor | None = None,
    window: "tuple[int, int] | None" = None,
) -> HarnessResult:
    """Run FCP attention (forward, and backward when ``dout`` is given) for every CP rank in one process.

    q, dout: global ``[s, b, h, d]`` (zigzag-sharded here), or packed ``[T, h, d]`` with a
    ``placement`` (sharded by it); k, v: ``[s, b, h_kv, d]`` / ``[T, h_kv, d]``.
    cp / ranks: the group (``ranks`` its global ranks in CP order, default ``range(cp)``; with a
    placement, default ``placement.cp``). plan: as for ``fcp_attention`` (a name, None, a Plan over
    ``ranks``), or a function ``ranks -> Plan``. device: where the ranks run (default q's
    device); ``"cuda"``: one stream per rank on the current GPU. transport: ``(rank, inner) ->
    Transport`` to wrap each rank's in-process transport (e.g. ``CountingTransport(inner)``).
    stats: fill an :class:`FCPStats` per rank. agree: run the agreement step (in process) first.
    softmax_offset: sink logits ``[h]`` (every rank gets them); each rank's ``dsink`` is its rows'
    share in the offset's dtype (the full gradient is their sum: Note [The sink's gradient across
    ranks] in :mod:`megatron_fcp.attention.sinks`).
    window: a sliding window ``(left, right)`` (Megatron's convention), as for ``fcp_attention``.
    Other arguments as for :func:`~megatron_fcp.attention.function.fcp_attention_with_lse`.
    Errors raised by any rank (validation, :class:`~megatron_fcp.attention.comm.CommTimeout`) are re-raised.
    """
    if ranks is None:
        cp = cp if cp is not None else (placement.cp if placement is not None else None)
        if cp is None:
            raise ValueError("harness_attention needs cp= or ranks= (the CP group)")
        ranks = tuple(range(cp))
    ranks = tuple(ranks)
    if cp is not None and cp != len(ranks):
        raise ValueError(f"cp={cp} but ranks {list(ranks)} has {len(ranks)} entries; pass one of them")
    device = torch.device(device) if device is not None else q.device
    group = InProcessGroup(ranks, device)
    thd = placement is not None

    def shard(x: torch.Tensor | None, i: int):
        if x is None:
            return None
        x = placement.shard(x, i) if thd else zigzag_split(x, len(ranks), i)
        return x.to(device)

    inputs = [tuple(shard(x, i) for x in (q, k, v, dout)) for i in range(len(ranks))]
    agreement = LastAgreed() if agree else None
    plan_arg = _plan_for(plan, ranks)

    def one_rank(h: VirtualRank) -> RankResult:
        ql, kl, vl, dl = inputs[h.index]
        inner = h.transport(timeout_s)
        tr = transport(h.rank, inner) if transport is not None else inner
        st = FCPStats() if stats else None
        with torch.no_grad():
            ex = build_executor(ql, kl, vl, cp_group=h, plan=plan_arg, causal=causal, softmax_scale=softmax_scale,
                                transport=tr, stats=st, timeout_s=timeout_s, kernel=kernel, placement=placement,
                                backward_kv=backward_kv, kv_memory_budget=kv_memory_budget, agreement=agreement,
                                softmax_offset=None if softmax_offset is None else softmax_offset.to(device),
                                window=window)
            if thd:  # the engine runs THD as b = 1, like fcp_attention_with_lse
                ql, kl, vl = (x.unsqueeze(1) for x in (ql, kl, vl))               # [t, 1, h(_kv), d]
                dl = dl.unsqueeze(1) if dl is not None else None
            out_acc, lse, kept = ex.forward_saving(ql, kl, vl, dl is not None)   # what autograd saves; compute dtype
            kept_bytes = sum(x.numel() * x.element_size() for x in kept.values()) if kept else 0
            out = out_acc.to(ql.dtype)
            grads, dsink = (None, None, None), None
            if dl is not None:  # the order of _FCPAttentionFunction.backward
                dsink = ex.sink_grad(dl, out_acc, lse)
                dsink = None if dsink is None else dsink.to(softmax_offset.dtype)
                grads = ex.backward(dl, ql, kl, vl, out_acc, lse, kept)
        if thd:
            out, lse = out.squeeze(1), lse.squeeze(0)                              # [t, h, d], [h, t]
            grads = tuple(g.squeeze(1) if g is not None else None for g in grads)
        return RankResult(h.rank, h.index, out, lse, *grads, transport=tr, stats=st, backward_kv=ex.backward_kv,
                          kept_bytes=kept_bytes, program=ex.program, dsink=dsink)

    results = group.run(one_rank, timeout_s=timeout_s * 4)
    if device.type == "cuda":  # made on the ranks' streams, used on the caller's from now on
        caller = torch.cuda.current_stream(device)
        for r in results:
            for x in r.tensors().values():
                if x is not None:
                    x.record_stream(caller)
    return HarnessResult(results, placement)


# ---------------------------------------------------------------------------------------------
# references and the ready-made numerics matrix
# ---------------------------------------------------------------------------------------------
def assert_packed_matches_fp64(plan: Any, placement: Placement, *, seed: int, heads: int = 4, kv_heads: int = 2,
                               head_dim: int = 8, atol: float = 1e-10) -> None:
    """Seeded FP64 q, k, v, dO for ``placement``'s documents, ``plan`` over it run by
    :func:`harness_attention`, and every one of :data:`QUANTITIES` checked against
    :func:`per_document_reference` (causal): AssertionError naming the tensor otherwise."""
    g = torch.Generator().manual_seed(seed)
    lengths = list(placement.doc_lengths)
    T = sum(lengths)
    q, do = (torch.randn(T, heads, head_dim, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(T, kv_heads, head_dim, generator=g, dtype=torch.float64) for _ in range(2))
    ref = per_document_reference(q, k, v, do, lengths, True, 1.0 / math.sqrt(head_dim))
    res = harness_attention(q, k, v, do, ranks=plan.ranks, placement=placement, plan=plan, causal=True)
    for name in QUANTITIES:
        torch.testing.assert_close(res.gathered(name), ref[name], rtol=0, atol=atol, msg=name)


def per_document_reference(q, k, v, do, lengths: Sequence[int], causal: bool, scale: float,
                           window: "tuple[int, int] | None" = None) -> dict:
    """Each document of a packed batch attended alone by plain torch autograd (in the inputs'
    dtype; ``window`` inside each document), concatenated: out, dq ``[T, h, d]``, dk, dv
    ``[T, h_kv, d]``, lse ``[h, T]``."""
    parts, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        parts.append(reference_attention(q[sl, None], k[sl, None], v[sl, None], causal=causal, scale=scale,
                                         dout=do[sl, None], window=window))
        start += n
    res = {name: torch.cat([p[name][:, 0] for p in parts]) for name in ("out", "dq", "dk", "dv")}
    res["lse"] = torch.cat([p["lse"][0] for p in parts], dim=-1)
    return res


#: Per-dtype absolute caps on top of the 2x rule (relative to max(1, max|ref|)): a lost block or
#: gradient breaks them even where plain low-precision attention is itself far off.
_CAPS = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9}

#: Packed document lengths of the ready-made matrix (short and long, lengths divisible by nothing).
CHECK_DOCS = (1, 37, 3, 5, 90, 2, 1, 7, 13, 61, 4, 1, 2)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _judge(got: dict, ref: dict, base: dict | None, dtype: torch.dtype) -> dict:
    """Errors vs the FP64 reference and the bound each must meet: FP64: 1e-12 x max(1, max|ref|);
    other dtypes: 2 x (plain attention in that dtype's error) + flash-attn's rounding slack
    2|(x + 0.3 - 0.3) - x|, never above the dtype's cap x max(1, max|ref|); FP32 may use the cap."""
    out = {"max_err": {}, "ref_max": {}, "base_err": {}, "bound": {}}
    for n in QUANTITIES:
        ref_max = ref[n].abs().max().item() if ref[n].numel() else 0.0
        cap = _CAPS[dtype] * max(1.0, ref_max)
        if base is None:
            bound = cap
        else:
            r = ref[n].to(dtype)
            slack = 2 * _err(r + 0.3 - 0.3, r)
            bound = min(2 * _err(base[n], ref[n]) + slack, cap)
            if dtype == torch.float32:
                bound = max(bound, cap)
            out["base_err"][n] = _err(base[n], ref[n])
        out["max_err"][n], out["ref_max"][n], out["bound"][n] = _err(got[n], ref[n]), ref_max, bound
    out["ok"] = all(out["max_err"][n] <= out["bound"][n] for n in QUANTITIES)
    return out


def check_numerics_cases(device: "str | torch.device" = "cpu", dtype: torch.dtype = torch.bfloat16,
                         kernel: Any = "math", *, tokens: int = 512, batch: int = 1, head_dim: int = 64,
                         heads: int = 8, seed: int = 0) -> list[dict]:
    """cp = 4 in the harness against an FP64 reference: returns one dict per case with per-tensor
    max errors (out, lse, dq, dk, dv), the bound each must meet and ``ok``.

    Fixed length (zigzag, ``tokens`` global tokens, ``batch`` sequences): the ring (causal, MHA),
    the full schedule (not causal, GQA 4:1) and a compiled plan (``build_plan`` on the
    ``pcie-box`` preset, spanning trees with relays, two parts per chunk; causal, GQA 2:1).
    Packed: :data:`CHECK_DOCS` placed by ``place_packed`` (causal, GQA 2:1, full schedule) and the
    same batch not causal over a compiled plan. Reference: ``reference_attention`` in FP64 (per
    document for packed batches) on ``device``; the 2x rule compares with plain attention in
    ``dtype`` (see :func:`_judge`).
    """
    from megatron_fcp.contract.placement import place_packed
    from megatron_fcp.planner.build import build_plan

    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    cp, ranks = 4, tuple(range(4))
    scale = 1.0 / math.sqrt(head_dim)
    results = []

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device)

    def judge(name, layout, tokens_, hk, causal, inputs, ref, base, **where):
        """Run one case in the harness (``where``: ranks or placement, and the plan) and record it."""
        t0 = time.perf_counter()
        res = harness_attention(*(x.to(dtype) for x in inputs), causal=causal, softmax_scale=scale, kernel=kernel,
                                device=device, **where)
        got = {n: res.gathered(n) for n in QUANTITIES}
        results.append(dict(case=name, layout=layout, cp=cp, tokens=tokens_, heads=(heads, hk), causal=causal,
                            dtype=str(dtype), kernel=str(kernel), device=str(device),
                            seconds=time.perf_counter() - t0, **_judge(got, ref, base, dtype)))

    zigzag = [
        ("zigzag-ring-causal-mha", "ring", True, heads),
        ("zigzag-full-noncausal-gqa4", "full", False, max(heads // 4, 1)),
        ("zigzag-spanning-causal-gqa2", lambda rs: build_plan("pcie-box:1", rs, "spanning", causal=True,
                                                              parts_per_chunk=2), True, max(heads // 2, 1)),
    ]
    for name, plan, causal, hk in zigzag:
        q, do = randn(tokens, batch, heads, head_dim), randn(tokens, batch, heads, head_dim)
        k, v = randn(tokens, batch, hk, head_dim), randn(tokens, batch, hk, head_dim)
        ref = reference_attention(q, k, v, causal=causal, scale=scale, dout=do)
        base = None if dtype == torch.float64 else reference_attention(
            *(x.to(dtype) for x in (q, k, v)), causal=causal, scale=scale, dout=do.to(dtype))
        judge(name, "zigzag", tokens, hk, causal, (q, k, v, do), ref, base, ranks=ranks, plan=plan)
    for name, causal, hk, builder in (("packed-full-causal-gqa2", True, max(heads // 2, 1), None),
                                      ("packed-spanning-noncausal-mha", False, heads, "spanning")):
        pl = place_packed(CHECK_DOCS, cp, block_tokens=16, causal=causal)
        plan = None if builder is None else build_plan("pcie-box:1", ranks, builder, causal=causal, placement=pl)
        t = pl.total_tokens
        q, do, k, v = randn(t, heads, head_dim), randn(t, heads, head_dim), randn(t, hk, head_dim), randn(t, hk, head_dim)
        ref = per_document_reference(q, k, v, do, CHECK_DOCS, causal, scale)
        base = None if dtype == torch.float64 else per_document_reference(
            *(x.to(dtype) for x in (q, k, v, do)), CHECK_DOCS, causal, scale)
        judge(name, "packed", t, hk, causal, (q, k, v, do), ref, base, placement=pl, plan=plan)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m megatron_fcp.testing.harness --device cuda --dtype bf16 --kernel math``: run
    :func:`check_numerics_cases`, print one JSON list; exit code 1 if a case misses its bound."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m megatron_fcp.testing.harness", description=main.__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=("fp64", "fp32", "bf16", "fp16"))
    p.add_argument("--kernel", default="math")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args(argv)
    dtype = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    rows = check_numerics_cases(a.device, dtype, a.kernel, tokens=a.tokens, heads=a.heads, head_dim=a.head_dim)
    print(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
