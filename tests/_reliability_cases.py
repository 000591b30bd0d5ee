"""Worker side of tests/test_reliability_dist.py: one gloo world of 4 processes for all of it.

In this order (a refusal leaves the group usable; a timed-out agreement does not, so that runs
last, on a subgroup nobody uses afterwards):
1. setup_fcp disagreement: ranks configured with different graphs, topologies, block sizes,
   shapes, dtypes or kernels (one rank differs per case) -> FCPAgreementError on every rank;
2. fcp_attention disagreement on first use of a plan: plans, block sizes, shapes, dtypes, causal;
3. delay fuzzing: hypothesis draws >= 50 (delay pattern, plan, dtype) examples, every message of
   every rank is delayed by the pattern; outputs and gradients must equal the undelayed run of
   the same plan bit for bit, and different plans agree within the numerics rule;
4. fully masked query rows through fcp_attention (zigzag and THD, FP32 and BF16);
5. user reports: a length-7 document at cp = 2, packing keeps the document mask;
6. a rank that fails its own checks (3 local tokens at cp = 2) -> its peer's agreement times out
   with a named error, bounded.
"""

from __future__ import annotations

import math
import os
import random
import time
import zlib

import torch
import torch.distributed as dist

TOPOLOGY_2X2 = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "topology_2x2.yaml")
QUANTITIES = ("out", "lse", "dq", "dk", "dv")
FUZZ_EXAMPLES = 60
AGREE_TIMEOUT_S = 30.0  # refusals come at once; generous so a slow rank on 2 shared cores never trips it
FAIL_TIMEOUT_S = 3.0    # the one case that must wait: a peer never joins


def _catch(fn):
    """(error type name, message, seconds) of ``fn()``; ("", "", s) when it returns."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the parent asserts on type and message
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "", "", time.monotonic() - t0


# ---- 1. setup_fcp ----------------------------------------------------------------------------------
SETUP_CASES = {  # name -> (rank that differs, FCPConfig changes, setup_fcp argument changes)
    "agree": (None, {}, {}),
    "graph": (3, {"graph": "full"}, {}),
    "topology": (1, {"topology": "dgx-a100:1"}, {}),
    "block_tokens": (2, {"block_tokens": 4}, {}),
    "shapes": (0, {}, {"heads": 8}),
    "dtype_bytes": (3, {}, {"dtype_bytes": 4}),
    "config": (1, {"kernel": "cpu-flash"}, {}),
}


def _setup_cases(rank: int) -> dict:
    from megatron_fcp.config import FCPConfig
    from megatron_fcp.patches.runtime import reset_fcp, setup_fcp
    from megatron_fcp.planner.megatron_layout import MegatronLayout

    out = {}
    for name, (odd, cfg_over, arg_over) in SETUP_CASES.items():
        cfg = dict(enabled=True, graph="ring", topology="dgx-h100:1", timeout_s=AGREE_TIMEOUT_S)
        args = dict(seq_len=64, heads=4, kv_heads=2, head_dim=8, dtype_bytes=2)
        if rank == odd:
            cfg.update(cfg_over)
            args.update(arg_over)
        out[name] = _catch(lambda: setup_fcp(FCPConfig(**cfg), layout=MegatronLayout(world=4, cp=4),
                                             groups={(0, 1, 2, 3): dist.group.WORLD}, **args))
    calls = []
    real = dist.all_gather
    dist.all_gather = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:  # no live group given: nothing to agree over, skipped on every rank
        setup_fcp(FCPConfig(enabled=True, graph="ring", topology="dgx-h100:1"),
                  layout=MegatronLayout(world=4, cp=4), groups={}, seq_len=64)
    finally:
        dist.all_gather = real
    out["skipped_collectives"] = len(calls)
    reset_fcp()
    return out


# ---- 2. fcp_attention --------------------------------------------------------------------------------
def _zigzag_inputs(seed: str, s: int, dtype, h=2, hk=1, d=8):
    g = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    return [torch.randn(s, 1, n, d, generator=g, dtype=torch.float64).to(dtype) for n in (h, hk, hk, h)]


def _attention_cases(rank: int) -> dict:
    from megatron_fcp.attention.agreement import LastAgreed
    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.layout import zigzag_split
    from megatron_fcp.contract.plan import ring_plan

    ranks, cp, idx = (0, 1, 2, 3), 4, rank
    cases = {  # name -> (rank that differs, keyword changes for it)
        "agree": (None, {}),
        "plan": (1, {"plan": "full"}),
        "block_size": (2, {"plan": ring_plan(ranks, True, parts_per_chunk=2)}),
        "shape": (2, {"s": 64}),
        "dtype": (0, {"dtype": torch.float32}),
        "causal": (3, {"causal": False}),
    }
    out = {}
    for name, (odd, over) in cases.items():
        kw = dict(plan="ring", causal=True, s=32, dtype=torch.float64)
        if rank == odd:
            kw.update(over)
        q, k, v, _ = _zigzag_inputs("agree", kw.pop("s"), kw.pop("dtype"))
        ql, kl, vl = (zigzag_split(x, cp, idx) for x in (q, k, v))
        # a fresh cache per case: the first use of a plan on every rank (what LastAgreed agrees on)
        out[name] = _catch(lambda: fcp_attention_with_lse(ql, kl, vl, cp_group=dist.group.WORLD,
                                                          timeout_s=AGREE_TIMEOUT_S, agreement=LastAgreed(), **kw))
    return out


# ---- 3. delay fuzzing ----------------------------------------------------------------------------------
FUZZ_PLANS = ("ring", "full", "hierarchical")
FUZZ_DTYPES = ("fp64", "bf16")


def _fuzz_patterns() -> list:
    """The (delays, plan, dtype) examples hypothesis draws (derandomized: the same on every rank)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    drawn = []

    @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.lists(st.floats(0.0, 5e-4, allow_nan=False), min_size=1, max_size=8),
           st.sampled_from(FUZZ_PLANS), st.sampled_from(FUZZ_DTYPES))
    def draw(delays, plan, dtype):
        drawn.append((tuple(delays), plan, dtype))

    draw()
    return drawn


def _fuzz(rank: int) -> dict:
    from megatron_fcp.attention.agreement import agree
    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.kernels import reference_attention
    from megatron_fcp.attention.layout import zigzag_split
    from megatron_fcp.attention.comm import CountingTransport, DelayTransport, GlooTransport
    from megatron_fcp.planner.build import build_plan

    ranks, cp, idx = (0, 1, 2, 3), 4, rank
    patterns = _fuzz_patterns()
    agree({"patterns": tuple(patterns)}, what="fuzz patterns")  # the same examples on every rank
    plans = {"ring": "ring", "full": "full",
             "hierarchical": build_plan(TOPOLOGY_2X2, ranks, "hierarchical", causal=True)}
    dtypes = {"fp64": torch.float64, "bf16": torch.bfloat16}
    inputs = {n: _zigzag_inputs("fuzz", 32, dt) for n, dt in dtypes.items()}

    def run(plan: str, dtype: str, transport):
        q, k, v, do = inputs[dtype]
        ql, kl, vl = (zigzag_split(x, cp, idx).requires_grad_() for x in (q, k, v))
        out, lse = fcp_attention_with_lse(ql, kl, vl, cp_group=dist.group.WORLD, plan=plans[plan],
                                          transport=transport, timeout_s=30)
        out.backward(zigzag_split(do, cp, idx))
        return {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}

    base = {(p, d): run(p, d, GlooTransport(dist.group.WORLD, timeout_s=30)) for p in FUZZ_PLANS for d in FUZZ_DTYPES}
    mismatches, messages = [], 0
    for i, (delays, plan, dtype) in enumerate(patterns):
        turn = iter(range(10 ** 9))
        mine = delays[rank % len(delays):] + delays[:rank % len(delays)]  # each rank its own rotation
        counting = CountingTransport(GlooTransport(dist.group.WORLD, timeout_s=30))
        got = run(plan, dtype, DelayTransport(counting, lambda: mine[next(turn) % len(mine)]))
        messages += len(counting.posted)
        bad = [n for n in QUANTITIES if not torch.equal(got[n], base[(plan, dtype)][n])]
        if bad:
            mismatches.append((i, plan, dtype, bad))
    # across plans: FP64 within 1e-12; BF16 within the BF16 rule against the FP64 reference
    ref = reference_attention(*inputs["fp64"][:3], causal=True, scale=1 / math.sqrt(8), dout=inputs["fp64"][3])
    plain = reference_attention(*inputs["bf16"][:3], causal=True, scale=1 / math.sqrt(8), dout=inputs["bf16"][3])
    local = {n: zigzag_split(x, cp, idx, seq_dim=2 if n == "lse" else 0) for n, x in ref.items()}
    local_plain = {n: zigzag_split(x, cp, idx, seq_dim=2 if n == "lse" else 0) for n, x in plain.items()}
    cross = {}
    for p in FUZZ_PLANS:
        for n in QUANTITIES:
            scale = max(1.0, local[n].abs().max().item())
            e64 = (base[(p, "fp64")][n] - base[("ring", "fp64")][n]).abs().max().item()
            e16 = (base[(p, "bf16")][n].double() - local[n]).abs().max().item()
            b16 = (local_plain[n].double() - local[n]).abs().max().item()
            cross[(p, n)] = (e64 <= 1e-12 * scale, e16 <= min(2 * b16 + 2 ** -8 * scale, 2 ** -6 * scale))
    return {"examples": len(patterns), "distinct": len(set(patterns)), "mismatches": mismatches,
            "messages": messages, "cross": cross,
            "plans": sorted({p for _, p, _ in patterns}), "dtypes": sorted({d for _, _, d in patterns})}


# ---- 4. fully masked query rows --------------------------------------------------------------------------
def _row_mask_kernel(masked_pos=None, masked_docs=None):
    """The math kernel with some query rows seeing no key at all: rows at ``masked_pos`` (global
    zigzag positions; causal) get position -1, rows of ``masked_docs`` (THD) document id -1."""
    from megatron_fcp.attention.kernels import MathKernel

    def remap(q_pos, q_doc):
        if masked_pos is not None:
            q_pos = torch.where(torch.isin(q_pos, torch.tensor(masked_pos)), torch.full_like(q_pos, -1), q_pos)
        if masked_docs is not None and q_doc is not None:
            q_doc = torch.where(torch.isin(q_doc, torch.tensor(masked_docs)), torch.full_like(q_doc, -1), q_doc)
        return q_pos, q_doc

    class RowMask(MathKernel):
        def forward(self, q, k, v, q_pos, k_pos, causal, scale, q_doc=None, **prep):
            q_pos, q_doc = remap(q_pos, q_doc)
            return super().forward(q, k, v, q_pos, k_pos, causal, scale, q_doc=q_doc, **prep)

        def backward(self, dout, q, k, v, out, lse, q_pos, k_pos, causal, scale, q_doc=None, **prep):
            q_pos, q_doc = remap(q_pos, q_doc)
            return super().backward(dout, q, k, v, out, lse, q_pos, k_pos, causal, scale, q_doc=q_doc, **prep)

    return RowMask()


def _masked_rows(rank: int) -> dict:
    """Every query of CP rank 2 masked (Megatron-LM 1764's 'every token on a rank'), plus a few
    rows elsewhere; zigzag (ring) and THD (full plan over a placement), FP32 and BF16."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from _thd_cases import per_document_reference

    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.kernels import reference_attention
    from megatron_fcp.attention.layout import zigzag_positions, zigzag_split
    from megatron_fcp.contract.placement import place_packed

    cp, idx, res = 4, rank, {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        tol = 1e-5 if dtype_name == "fp32" else 2 ** -6
        # zigzag: causal, s = 32
        q, k, v, do = _zigzag_inputs("masked", 32, torch.float64)
        masked = sorted(set(zigzag_positions(8, cp, 2).tolist()) | {5, 30})
        keep = torch.ones(32, dtype=torch.bool)
        keep[masked] = False
        do_m = do * keep[:, None, None, None]
        ref = reference_attention(q, k, v, causal=True, scale=1 / math.sqrt(8), dout=do_m)
        ql, kl, vl = (zigzag_split(x, cp, idx).to(dtype).requires_grad_() for x in (q, k, v))
        out, lse = fcp_attention_with_lse(ql, kl, vl, cp_group=dist.group.WORLD, plan="ring",
                                          kernel=_row_mask_kernel(masked_pos=masked), check_numerics=True)
        (out.float() * zigzag_split(do_m, cp, idx).float()).sum().backward()
        res[("zigzag", dtype_name)] = _masked_report(
            {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad},
            {n: zigzag_split(x, cp, idx, seq_dim=2 if n == "lse" else 0) for n, x in ref.items()},
            zigzag_split(keep, cp, idx), tol, lse_dims=(0,))
        # THD: documents placed by FCP; every document with a token on CP rank 2 is masked
        lengths = (5, 9, 2, 7, 3, 6)
        pl = place_packed(lengths, cp, block_tokens=4)
        docs = sorted({int(d) for d in pl.doc_ids(2)})
        doc_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        keep_t = ~torch.isin(doc_of, torch.tensor(docs))
        g = torch.Generator().manual_seed(11)
        qt, kt, vt, dot = (torch.randn(sum(lengths), n, 8, generator=g, dtype=torch.float64) for n in (2, 1, 1, 2))
        dot_m = dot * keep_t[:, None, None]
        ref_t = per_document_reference(qt, kt, vt, dot_m, lengths, True, 1 / math.sqrt(8))
        qs, ks, vs = (pl.shard(x, idx).to(dtype).requires_grad_() for x in (qt, kt, vt))
        out, lse = fcp_attention_with_lse(qs, ks, vs, cp_group=dist.group.WORLD, placement=pl, plan="full",
                                          kernel=_row_mask_kernel(masked_docs=docs), check_numerics=True)
        (out.float() * pl.shard(dot_m, idx).float()).sum().backward()
        ref_local = {n: (pl.shard(x.transpose(0, 1), idx).transpose(0, 1) if n == "lse" else pl.shard(x, idx))
                     for n, x in ref_t.items()}
        res[("thd", dtype_name)] = _masked_report(
            {"out": out.detach(), "lse": lse, "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}, ref_local,
            torch.as_tensor(pl.shard(keep_t, idx)), tol, lse_dims=(), masked_docs=docs, tokens=qs.shape[0])
    return res


def _masked_report(got, ref, keep, tol, lse_dims, **extra) -> dict:
    """Masked rows: out/dq exactly 0, lse -inf; unmasked rows and dk/dv within tol of the reference."""
    gone = ~keep
    lse_rows = got["lse"].movedim(-1, 0)                                  # [n, ...]
    rep = {
        "finite": all(bool(torch.isfinite(got[n]).all()) for n in ("out", "dq", "dk", "dv"))
                  and not bool(torch.isnan(got["lse"]).any()),
        "masked_rows": int(gone.sum()),
        "masked_out_zero": bool((got["out"][gone] == 0).all()),
        "masked_dq_zero": bool((got["dq"][gone] == 0).all()),
        "masked_lse_neginf": bool(torch.isneginf(lse_rows[gone]).all()),
        **extra,
    }
    errs = {}
    for n in ("out", "dq"):
        scale = max(1.0, ref[n].abs().max().item())
        errs[n] = (got[n][keep].double() - ref[n][keep]).abs().max().item() / scale if keep.any() else 0.0
    for n in ("dk", "dv"):
        errs[n] = (got[n].double() - ref[n]).abs().max().item() / max(1.0, ref[n].abs().max().item())
    rep["errors"] = errs
    rep["within_tol"] = all(e <= tol for e in errs.values())
    return rep


# ---- 5. user reports ----------------------------------------------------------------------------------------
def _length7(group, ranks: tuple, rank: int) -> dict:
    """TE 1929/1930: a sequence of 7 tokens at cp = 2 must be attended as 7 tokens."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from _thd_cases import per_document_reference

    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.contract.placement import place_packed

    pl = place_packed((7,), 2, block_tokens=2)
    idx = ranks.index(rank)
    g = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(7, n, 8, generator=g, dtype=torch.float64) for n in (2, 1, 1, 2))
    ref = per_document_reference(q, k, v, do, (7,), True, 1 / math.sqrt(8))
    qs, ks, vs = (pl.shard(x, idx).requires_grad_() for x in (q, k, v))
    out, _ = fcp_attention_with_lse(qs, ks, vs, cp_group=group, placement=pl, plan="full")
    out.backward(pl.shard(do, idx))
    err = max((a.double() - pl.shard(ref[n], idx)).abs().max().item() if a.numel() else 0.0
              for n, a in (("out", out.detach()), ("dq", qs.grad), ("dk", ks.grad), ("dv", vs.grad)))
    return {"tokens": pl.tokens(idx), "total": pl.total_tokens, "err": err}


def _document_mask(rank: int) -> dict:
    """Packing with CP keeps the document mask: FCP's THD result is the per-document attention and
    far from attention over the whole packed sequence (what dropping the mask would compute)."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from _thd_cases import per_document_reference

    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.kernels import reference_attention
    from megatron_fcp.contract.placement import place_packed

    lengths = (11, 5, 9, 7)
    pl = place_packed(lengths, 4, block_tokens=4)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lengths), n, 8, generator=g, dtype=torch.float64) for n in (2, 1, 1))
    docs = per_document_reference(q, k, v, torch.zeros_like(q), lengths, True, 1 / math.sqrt(8))["out"]
    whole = reference_attention(q[:, None], k[:, None], v[:, None], causal=True, scale=1 / math.sqrt(8))["out"][:, 0]
    out = fcp_attention_with_lse(*(pl.shard(x, rank) for x in (q, k, v)), cp_group=dist.group.WORLD,
                                 placement=pl, plan="full")[0]
    return {"err_vs_documents": (out - pl.shard(docs, rank)).abs().max().item(),
            "diff_vs_mask_dropped": (out - pl.shard(whole, rank)).abs().max().item()}


# ---- 6. a rank fails its own checks --------------------------------------------------------------------------
def _local_failure(group, ranks: tuple, rank: int) -> tuple:
    """Global length 7 at cp = 2 split by hand as 4 + 3: the rank with 3 tokens refuses locally
    (ValueError); the other one waits in the agreement and must raise within the timeout."""
    from megatron_fcp.attention.function import fcp_attention_with_lse

    n = 4 if ranks.index(rank) == 0 else 3
    x = torch.randn(n, 1, 2, 8, dtype=torch.float64)
    return _catch(lambda: fcp_attention_with_lse(x, x[:, :, :1], x[:, :, :1], cp_group=group, plan="ring",
                                                 timeout_s=FAIL_TIMEOUT_S))


def _switch_alone(group, ranks: tuple, rank: int) -> tuple:
    """After the group agreed on the ring, the second rank alone switches to the direct plan: it
    agrees (its facts changed), its peer skips (its facts did not) and posts the ring's transfers.
    Neither may hang: the switcher's agreement and the peer's transfer wait both raise in time."""
    from megatron_fcp.attention.agreement import LastAgreed
    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.layout import zigzag_split

    cache, idx = LastAgreed(), ranks.index(rank)
    q, k, v, _ = _zigzag_inputs("switch", 16, torch.float64)
    ql, kl, vl = (zigzag_split(x, 2, idx) for x in (q, k, v))
    fcp_attention_with_lse(ql, kl, vl, cp_group=group, plan="ring", agreement=cache, timeout_s=FAIL_TIMEOUT_S)
    plan = "full" if idx == 1 else "ring"
    return _catch(lambda: fcp_attention_with_lse(ql, kl, vl, cp_group=group, plan=plan, agreement=cache,
                                                 timeout_s=FAIL_TIMEOUT_S))


def worker(rank: int, world: int) -> dict:
    torch.manual_seed(1234 + rank)
    random.seed(rank)
    pair_a, pair_b = dist.new_group([0, 1]), dist.new_group([2, 3])
    res = {"setup": _setup_cases(rank), "attention": _attention_cases(rank), "fuzz": _fuzz(rank),
           "masked": _masked_rows(rank), "document_mask": _document_mask(rank)}
    if rank in (2, 3):
        res["length7"] = _length7(pair_b, (2, 3), rank)
        res["switch_alone"] = _switch_alone(pair_b, (2, 3), rank)  # last: breaks pair_b
    if rank in (0, 1):
        res["local_failure"] = _local_failure(pair_a, (0, 1), rank)  # last: breaks pair_a
    return res
