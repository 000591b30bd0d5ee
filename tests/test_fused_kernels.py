"""The fused-kernel layer on CPU: the shared piece/varlen logic, the CUDA bindings' argument plumbing
(against CPU emulations of the ops), the ops' schemas, and ``auto``'s dispatch and gating.

The CUDA ops cannot run here; what can go wrong above them (which rows and keys each call gets,
varlen segments, the LSE layouts of varlen ops, casts, GQA, accumulation into FP32) runs here with
the op replaced by an exact emulation that follows the op's documented contract.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from megatron_fcp.attention import dispatch
from megatron_fcp.attention.dispatch import BLOCK_KERNELS, choose_kernel, resolve_kernel
from megatron_fcp.attention.fused import CpuFlashKernel, CudaFlashKernel, FusedPiecesKernel
from megatron_fcp.attention.fused_ops import (
    CpuFlashOps,
    FlashAttnOps,
    LoopVarlenOps,
    TorchCudaEfficientOps,
    TorchCudaFlashOps,
    lse_rows_from_varlen,
    lse_varlen_from_rows,
)
from megatron_fcp.attention.kernels import block_attention_backward, block_attention_forward

F64 = torch.float64
QUANT = ("out", "lse", "dq", "dk", "dv")


def _packed_case(seed=0, docs=(5, 9, 3, 12, 1, 7), b=1, h=4, hk=2, d=16):
    """A packed shard against its own block: queries and keys are the same tokens of several documents."""
    g = torch.Generator().manual_seed(seed)
    n = sum(docs)
    q, do = (torch.randn(n, b, h, d, generator=g, dtype=F64) for _ in range(2))
    k, v = (torch.randn(n, b, hk, d, generator=g, dtype=F64) for _ in range(2))
    pos = torch.cat([torch.arange(L) for L in docs])
    doc = torch.cat([torch.full((L,), i) for i, L in enumerate(docs)])
    return q, k, v, do, pos, doc


def _run(kernel, q, k, v, do, q_pos, k_pos, causal, dtype, **docs):
    args = [x.to(dtype) for x in (q, k, v)]
    out, lse = kernel.forward(*args, q_pos, k_pos, causal, 0.3, **docs)
    grads = kernel.backward(do.to(dtype), *args, out, lse, q_pos, k_pos, causal, 0.3, **docs)
    return dict(zip(QUANT, (out, lse, *grads)))


def _reference(q, k, v, do, q_pos, k_pos, causal, **docs):
    out, lse = block_attention_forward(q, k, v, q_pos, k_pos, causal, 0.3, **docs)
    grads = block_attention_backward(do, q, k, v, out, lse, q_pos, k_pos, causal, 0.3, **docs)
    return dict(zip(QUANT, (out, lse, *grads)))


def _max_err(a, b):
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    return (a.double()[fin] - b[fin]).abs().max().item() if fin.any() else 0.0


class _LoopVarlenCpuKernel(FusedPiecesKernel):
    """cpu-flash with a (looped) varlen form: runs the varlen grouping code on CPU."""

    name = "cpu-flash-varlen"
    _OPS = LoopVarlenOps(CpuFlashOps())

    def ops_for(self, dtype):
        return self._OPS if self._OPS.op_dtype(dtype) else None


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_grouping_matches_the_fp64_reference(causal):
    """One varlen call per kind over every document of a packed shard: out, lse, dq, dk, dv."""
    q, k, v, do, pos, doc = _packed_case()
    ref = _reference(q, k, v, do, pos, pos, causal, q_doc=doc, k_doc=doc)
    got = _run(_LoopVarlenCpuKernel(), q, k, v, do, pos, pos, causal, torch.float32, q_doc=doc, k_doc=doc)
    dense = _run(BLOCK_KERNELS["cpu-flash"], q, k, v, do, pos, pos, causal, torch.float32, q_doc=doc, k_doc=doc)
    for name in QUANT:
        assert got[name].dtype == torch.float32
        assert _max_err(got[name], ref[name]) < 2e-5, name
        assert _max_err(got[name], dense[name].double()) < 2e-5, name


def test_varlen_grouping_with_a_foreign_block_and_gaps():
    """Queries of several documents against a block holding parts of some of them: rows of
    documents the block lacks stay 0 / -inf, the rest match the reference."""
    q, k, v, do, pos, doc = _packed_case(seed=1, docs=(6, 10, 4, 8))
    keys = torch.cat([torch.arange(6, 16), torch.arange(20, 28)])          # doc 1 whole, doc 3 whole
    kk, vv, kp, kd = k[keys], v[keys], pos[keys], doc[keys]
    ref = _reference(q, kk, vv, do, pos, kp, True, q_doc=doc, k_doc=kd)
    got = _run(_LoopVarlenCpuKernel(), q, kk, vv, do, pos, kp, True, torch.float32, q_doc=doc, k_doc=kd)
    for name in QUANT:
        assert _max_err(got[name], ref[name]) < 2e-5, name
    assert torch.isneginf(got["lse"][:, :, :6]).all() and (got["out"][:6] == 0).all()


@pytest.mark.parametrize("dim", [2, 3])
def test_varlen_lse_layouts_round_trip(dim):
    """[h, T] (FlashAttention-2 >= 2.4) and [S, h, max_q] (older builds) both map to rows and back."""
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    rows = torch.randn(2, 9)
    op_layout = lse_varlen_from_rows(rows, dim, cu, max_q=5)
    assert op_layout.shape == ((2, 9) if dim == 2 else (3, 2, 5))
    assert torch.equal(lse_rows_from_varlen(op_layout, cu, 9), rows)


# ---------------------------------------------------------------------------------------------
# the CUDA bindings' plumbing, with the ops emulated on CPU by their documented contracts
# ---------------------------------------------------------------------------------------------
def _attend(q, k, v, causal, scale):
    """q [t,h,d], k/v [m,hk,d] -> o [t,h,d], lse [h,t] (bottom-right causal, FP64 math)."""
    g = q.shape[1] // k.shape[1]
    kr, vr = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("thd,mhd->htm", q.double(), kr) * scale
    if causal:
        t, m = q.shape[0], k.shape[0]
        vis = torch.arange(m)[None, :] <= torch.arange(t)[:, None] + (m - t)
        s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.einsum("htm,mhd->thd", torch.exp(s - lse[..., None]), vr), lse


def _attend_grad(do, q, k, v, out, lse, causal, scale):
    g = q.shape[1] // k.shape[1]
    kr, vr = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("thd,mhd->htm", q.double(), kr) * scale
    if causal:
        t, m = q.shape[0], k.shape[0]
        s = s.masked_fill(~(torch.arange(m)[None, :] <= torch.arange(t)[:, None] + (m - t)), -math.inf)
    p = torch.exp(s - lse.double()[..., None])
    dd = (do.double() * out.double()).sum(-1).t()                            # [h, t]
    dp = torch.einsum("thd,mhd->htm", do.double(), vr)
    ds = p * (dp - dd[..., None])
    dq = torch.einsum("htm,mhd->thd", ds, kr) * scale
    dk = torch.einsum("htm,thd->mhd", ds, q.double()).unflatten(1, (k.shape[1], g)).sum(2) * scale
    dv = torch.einsum("htm,thd->mhd", p, do.double()).unflatten(1, (k.shape[1], g)).sum(2)
    return dq, dk, dv


class _FakeAten:
    """``_flash_attention_forward/backward`` and ``_efficient_attention_forward/backward`` on CPU,
    following the ops' schemas (positional order, return tuples, layouts; LSE padded to 32 for the
    efficient op; varlen LSE as [h, T] or, ``old_varlen_lse``, [S, h, max_q])."""

    def __init__(self, old_varlen_lse=False):
        self.old = old_varlen_lse
        self.calls = []

    @staticmethod
    def _segs(cu_q, cu_k, t, m):
        if cu_q is None:
            return [(0, t, 0, m)]
        a, b = cu_q.tolist(), cu_k.tolist()
        return [(a[i], a[i + 1], b[i], b[i + 1]) for i in range(len(a) - 1)]

    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug, *, scale):
        assert dropout_p == 0.0 and debug is False and q.stride(-1) == 1
        self.calls.append(("flash_fwd", cu_q is not None))
        dense = cu_q is None
        assert dense or (q.dim() == 3 and cu_q.dtype == torch.int32)
        outs, lses = [], []
        for b in range(1 if not dense else q.shape[0]):
            qb, kb, vb = (q[b], k[b], v[b]) if dense else (q, k, v)
            o = torch.empty(qb.shape, dtype=torch.float64)
            lse = torch.empty(qb.shape[1], qb.shape[0], dtype=torch.float64)
            for a, z, k0, k1 in self._segs(cu_q, cu_k, qb.shape[0], kb.shape[0]):
                o[a:z], lse[:, a:z] = _attend(qb[a:z], kb[k0:k1], vb[k0:k1], is_causal, scale)
            outs.append(o)
            lses.append(lse)
        if dense:
            o, lse = torch.stack(outs), torch.stack(lses)                      # [b,t,h,d], [b,h,t]
        else:
            o, lse = outs[0], lses[0]
            if self.old:
                lse = lse_varlen_from_rows(lse, 3, cu_q, max_q)
        return o.to(q.dtype), lse.float(), torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64), None

    def _flash_attention_backward(self, do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                                  rng, unused, *, scale):
        assert out.dtype == q.dtype == do.dtype and lse.dtype == torch.float32 and lse.is_contiguous()
        self.calls.append(("flash_bwd", cu_q is not None))
        dense = cu_q is None
        if not dense:
            lse = lse_rows_from_varlen(lse, cu_q, q.shape[0])
        res = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
        for b in range(q.shape[0] if dense else 1):
            sel = (lambda x: x[b]) if dense else (lambda x: x)
            qb, kb, vb, ob, dob = map(sel, (q, k, v, out, do))
            lb = lse[b] if dense else lse
            for a, z, k0, k1 in self._segs(cu_q, cu_k, qb.shape[0], kb.shape[0]):
                dq, dk, dv = _attend_grad(dob[a:z], qb[a:z], kb[k0:k1], vb[k0:k1], ob[a:z], lb[:, a:z],
                                          is_causal, scale)
                sel(res[0])[a:z] = dq
                sel(res[1])[k0:k1] += dk
                sel(res[2])[k0:k1] += dv
        return tuple(r.to(q.dtype) for r in res)

    def _efficient_attention_forward(self, q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask_type, lse_on,
                                     *, scale):
        assert bias is None and cu_q is None and lse_on and q.shape[2] == k.shape[2]
        self.calls.append(("eff_fwd", False))
        o, lse, *_ = self._flash_attention_forward(q, k, v, None, None, 0, 0, 0.0, mask_type == 1, False, scale=scale)
        t = q.shape[1]
        pad = lse.new_zeros(*lse.shape[:2], -(-t // 32) * 32)
        pad[:, :, :t] = lse
        return o, pad, torch.zeros(()), torch.zeros(()), t, k.shape[1]

    def _efficient_attention_backward(self, do, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, lse, dropout_p, seed,
                                      offset, mask_type, bias_grad, *, scale):
        assert lse.shape[-1] % 32 == 0 and q.shape[2] == k.shape[2]
        self.calls.append(("eff_bwd", False))
        g = self._flash_attention_backward(do, q, k, v, out, lse[:, :, :q.shape[1]].contiguous(), None, None, 0, 0,
                                           0.0, mask_type == 1, None, None, scale=scale)
        return (*g, None)


@pytest.fixture
def fake_cuda_ops(monkeypatch):
    def install(old_varlen_lse=False):
        fake = _FakeAten(old_varlen_lse)
        for name in ("_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
                     "_efficient_attention_backward"):
            monkeypatch.setattr(torch.ops.aten, name, getattr(fake, name))
        return fake
    return install


@pytest.mark.parametrize("old_lse", [False, True], ids=["lse-h-T", "lse-S-h-maxq"])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_flash_binding_on_packed_documents(fake_cuda_ops, causal, old_lse):
    """BF16 packed shard through CudaFlashKernel's FlashAttention binding: one varlen call per kind
    forward and backward, results in FP32, within BF16 rounding of the FP64 reference."""
    fake = fake_cuda_ops(old_lse)
    q, k, v, do, pos, doc = _packed_case(seed=2)
    kern = CudaFlashKernel()
    kern._FLASH = TorchCudaFlashOps()                                          # fresh LSE-layout memory
    got = _run(kern, q, k, v, do, pos, pos, causal, torch.bfloat16, q_doc=doc, k_doc=doc)
    ref = _reference(*(x.to(torch.bfloat16).double() for x in (q, k, v, do)), pos, pos, causal, q_doc=doc, k_doc=doc)
    for name in QUANT:
        assert got[name].dtype == torch.float32
        assert _max_err(got[name], ref[name]) < 0.05, name
    kinds = [c for c in fake.calls]
    assert ("flash_fwd", True) in kinds and ("flash_bwd", True) in kinds
    assert sum(1 for c in kinds if c[0] == "flash_fwd") <= 2                    # one call per kind


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_flash_binding_on_zigzag_chunks(fake_cuda_ops, dtype):
    """A zigzag shard (two runs) against an earlier chunk and against its own: dense calls, GQA
    (BF16 -> flash, FP32 -> the memory-efficient op with repeated K/V heads)."""
    fake = fake_cuda_ops()
    g = torch.Generator().manual_seed(4)
    q, do = (torch.randn(16, 2, 4, 8, generator=g, dtype=F64) for _ in range(2))
    k, v = (torch.randn(8, 2, 2, 8, generator=g, dtype=F64) for _ in range(2))
    q_pos = torch.cat([torch.arange(8, 16), torch.arange(40, 48)])
    for k_pos in (torch.arange(0, 8), torch.arange(8, 16)):
        got = _run(CudaFlashKernel(), q, k, v, do, q_pos, k_pos, True, dtype)
        ref = _reference(*(x.to(dtype).double() for x in (q, k, v, do)), q_pos, k_pos, True)
        for name in QUANT:
            assert _max_err(got[name], ref[name]) < (0.05 if dtype == torch.bfloat16 else 1e-5), name
    want = "flash_fwd" if dtype == torch.bfloat16 else "eff_fwd"
    assert {c[0] for c in fake.calls} >= {want} and not any(c[1] for c in fake.calls)


def test_op_bindings_follow_the_aten_schemas():
    """The positional arguments and result counts the bindings use, against torch's schemas."""
    def names(op):
        sch = getattr(torch.ops.aten, op).default._schema
        return [a.name for a in sch.arguments if not a.kwarg_only], [a.name for a in sch.arguments if a.kwarg_only], \
            len(sch.returns)
    pos, kw, nret = names("_flash_attention_forward")
    assert pos == ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                   "return_debug_mask"] and "scale" in kw and nret == 5
    pos, kw, nret = names("_flash_attention_backward")
    assert pos[:14] == ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q",
                        "max_k", "dropout_p", "is_causal", "rng_state", "unused"] and "scale" in kw and nret == 3
    pos, kw, nret = names("_efficient_attention_forward")
    assert pos[:11] == ["query", "key", "value", "bias", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                        "max_seqlen_k", "dropout_p", "custom_mask_type", "compute_log_sumexp"] and nret == 6
    pos, kw, nret = names("_efficient_attention_backward")
    assert pos[:16] == ["grad_out_", "query", "key", "value", "bias", "out", "cu_seqlens_q", "cu_seqlens_k",
                        "max_seqlen_q", "max_seqlen_k", "logsumexp", "dropout_p", "philox_seed", "philox_offset",
                        "custom_mask_type", "bias_requires_grad"] and "scale" in kw and nret == 4
    pos, kw, _ = names("_scaled_dot_product_flash_attention_for_cpu")
    assert pos[:5] == ["query", "key", "value", "dropout_p", "is_causal"] and "scale" in kw


# ---------------------------------------------------------------------------------------------
# auto and gating
# ---------------------------------------------------------------------------------------------
def test_auto_on_cpu_is_math_and_logs_once(caplog):
    dispatch._logged.clear()
    with caplog.at_level("INFO", logger="megatron_fcp.attention.dispatch"):
        for dtype in (torch.float32, torch.bfloat16, F64, torch.float32):
            assert resolve_kernel("auto", dtype, "cpu") is BLOCK_KERNELS["math"]
    assert sum("auto -> 'math'" in r.message for r in caplog.records) == 3    # once per dtype


def test_auto_on_cuda_prefers_flash_attn_then_cuda_flash_then_math(monkeypatch):
    """With CUDA present (emulated): flash-attn absent -> cuda-flash for BF16/FP16/FP32, math for
    FP64; with flash-attn present -> flash-attn for half types; a head dim the fused ops cannot
    take -> math."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(FlashAttnOps, "unavailable", lambda self: "the flash_attn package is not installed")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert choose_kernel(dtype, cuda, 128).name == "cuda-flash"
    assert choose_kernel(F64, cuda, 128).name == "math"
    assert choose_kernel(torch.bfloat16, cuda, 12).name == "math"             # not a multiple of 8
    with pytest.raises(ValueError, match="flash_attn package is not installed.*use kernel='auto' or 'math'"):
        resolve_kernel("flash-attn", torch.bfloat16, cuda)
    monkeypatch.setattr(FlashAttnOps, "unavailable", lambda self: None)
    assert choose_kernel(torch.bfloat16, cuda, 128).name == "flash-attn"
    assert choose_kernel(torch.float32, cuda, 128).name == "cuda-flash"       # flash-attn: half types only


def test_fused_kernels_name_what_is_missing(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="cuda-flash' cannot run: CUDA is not available"):
        resolve_kernel("cuda-flash", torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="cuda-flash' runs CUDA tensors only, got device cpu"):
        resolve_kernel("cuda-flash", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="cuda-flash' runs float32 / bfloat16 / float16 only, got torch.float64"):
        resolve_kernel("cuda-flash", F64, cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_hasattr = hasattr
    monkeypatch.setattr("megatron_fcp.attention.fused_ops.hasattr",
                        lambda obj, n: False if n == "_flash_attention_backward" else real_hasattr(obj, n),
                        raising=False)
    with pytest.raises(ValueError, match=re.escape(f"torch {torch.__version__} lacks torch.ops.aten._flash_attention_backward")):
        resolve_kernel("cuda-flash", torch.bfloat16, cuda)
    monkeypatch.setattr("megatron_fcp.attention.fused_ops.hasattr", real_hasattr, raising=False)
    assert resolve_kernel("cuda-flash", torch.float32, cuda, head_dim=64).name == "cuda-flash"
    with pytest.raises(ValueError, match="head dim 12"):
        resolve_kernel("cuda-flash", torch.bfloat16, cuda, head_dim=12)


def test_cpu_flash_kernel_is_the_shared_implementation():
    assert isinstance(BLOCK_KERNELS["cpu-flash"], CpuFlashKernel) and isinstance(CpuFlashKernel(), FusedPiecesKernel)
    assert isinstance(BLOCK_KERNELS["cuda-flash"].ops_for(torch.float32), TorchCudaEfficientOps)


class _CountingCpuOps(CpuFlashOps):
    """cpu-flash's op, counting its forward and backward calls."""

    def __init__(self):
        super().__init__()
        self.calls = {"forward": 0, "backward": 0}

    def forward(self, *a, **kw):
        self.calls["forward"] += 1
        return super().forward(*a, **kw)

    def backward(self, *a, **kw):
        self.calls["backward"] += 1
        return super().backward(*a, **kw)


class _CountingCpuKernel(FusedPiecesKernel):
    name = "cpu-flash-counting"

    def __init__(self):
        self.ops = _CountingCpuOps()

    def ops_for(self, dtype):
        return self.ops if self.ops.op_dtype(dtype) else None


@pytest.mark.parametrize("cp", [2, 4])
def test_a_call_out_of_position_order_runs_sorted_in_one_op_call(cp):
    """A head-parallel member at a = cp holds the whole sequence as 2 cp zigzag chunks rank by rank
    (item 6 of the module note): the kernel sorts rows and keys, makes one causal op call each
    way, and returns every tensor in the caller's order, equal to the reference."""
    S = 16 * 2 * cp
    L = S // (2 * cp)
    order = torch.cat([torch.cat([torch.arange(j * L, (j + 1) * L), torch.arange((2 * cp - 1 - j) * L, (2 * cp - j) * L)])
                       for j in range(cp)])                                # zigzag, rank by rank
    g = torch.Generator().manual_seed(cp)
    q, do = (torch.randn(S, 1, 4, 16, generator=g, dtype=F64) for _ in range(2))
    k, v = (torch.randn(S, 1, 2, 16, generator=g, dtype=F64) for _ in range(2))
    ref = _reference(q, k, v, do, order, order, True)
    kern = _CountingCpuKernel()
    got = _run(kern, q, k, v, do, order, order, True, torch.float32)
    for name in QUANT:
        assert _max_err(got[name], ref[name]) < 2e-5, name
    assert kern.ops.calls == {"forward": 1, "backward": 1}
    kern.ops.calls = {"forward": 0, "backward": 0}                         # in order: no gather, same calls
    _run(kern, q, k, v, do, torch.arange(S), torch.arange(S), True, torch.float32)
    assert kern.ops.calls == {"forward": 1, "backward": 1}
