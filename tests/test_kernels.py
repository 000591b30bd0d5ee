"""Block kernels against an independent FP64 reference (torch autograd over the full sequence)."""

from __future__ import annotations

import pytest
import torch

from megatron_fcp.attention.dispatch import BLOCK_KERNELS, resolve_kernel
from megatron_fcp.attention.fused import CpuFlashKernel
from megatron_fcp.attention.kernels import (
    block_attention_backward,
    block_attention_forward,
    compute_dtype_for,
    reference_attention,
)
from megatron_fcp.attention.layout import (
    block_local_slice,
    block_positions,
    zigzag_positions,
    zigzag_split,
    zigzag_unsplit,
)
from megatron_fcp.attention.merge import LseAccumulator
from megatron_fcp.attention.tiles import flash_pieces as _flash_pieces
from megatron_fcp.contract.blocks import blocks_of

F64 = torch.float64


def _qkvd(s, b, h, hk, d, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, h, d, generator=g, dtype=F64).to(dtype)
    k = torch.randn(s, b, hk, d, generator=g, dtype=F64).to(dtype)
    v = torch.randn(s, b, hk, d, generator=g, dtype=F64).to(dtype)
    do = torch.randn(s, b, h, d, generator=g, dtype=F64).to(dtype)
    return q, k, v, do


def _maxdiff(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("tiling", [(None, None), (3, 7), (5, 4)], ids=["auto", "t3k7", "t5k4"])
def test_single_block_matches_reference(causal, heads, tiling):
    rows_per_tile, key_chunk = tiling
    h, hk = heads
    s, scale = 20, 0.37
    q, k, v, do = _qkvd(s, 2, h, hk, 8)
    ref = reference_attention(q, k, v, causal=causal, scale=scale, dout=do, rows_per_tile=7)
    pos = torch.arange(s)
    out, lse = block_attention_forward(q, k, v, pos, pos, causal, scale, rows_per_tile=rows_per_tile,
                                       key_chunk=key_chunk)
    assert out.shape == q.shape and lse.shape == (2, h, s)
    assert _maxdiff(out, ref["out"]) < 1e-12 and _maxdiff(lse, ref["lse"]) < 1e-12
    dq, dk, dv = block_attention_backward(do, q, k, v, out, lse, pos, pos, causal, scale,
                                          rows_per_tile=rows_per_tile, key_chunk=key_chunk)
    assert dk.shape == k.shape and dv.shape == v.shape
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert _maxdiff(got, ref[name]) < 1e-12, name


def _blockwise(q, k, v, do, causal, scale, cp, parts, order_seed, kernel=None):
    """Emulate every CP rank in one process: each rank folds all KV blocks in a random order.
    kernel: a BlockKernel (its own tiling), or None for the math functions with tiny tiles."""
    if kernel is None:
        fwd = lambda *a: block_attention_forward(*a, rows_per_tile=5, key_chunk=2)  # noqa: E731
        bwd = lambda *a: block_attention_backward(*a, rows_per_tile=5, key_chunk=2)  # noqa: E731
    else:
        fwd, bwd = kernel.forward, kernel.backward
    ranks = tuple(range(cp))
    s_local = q.shape[0] // cp
    outs, lses, dqs = [], [], []
    cd = compute_dtype_for(q.dtype)                  # partial gradients are summed in this dtype
    dk, dv = torch.zeros(k.shape, dtype=cd), torch.zeros(v.shape, dtype=cd)
    gen = torch.Generator().manual_seed(order_seed)
    all_blocks = [b for r in ranks for b in blocks_of(r, parts)]
    kv_of = {}
    for blk in all_blocks:
        sl = block_local_slice(blk, s_local, parts)
        kv_of[blk] = (zigzag_split(k, cp, blk.owner)[sl], zigzag_split(v, cp, blk.owner)[sl],
                      block_positions(blk, ranks, s_local, parts))
    for r in ranks:
        ql, dol = zigzag_split(q, cp, r), zigzag_split(do, cp, r)
        qpos = zigzag_positions(s_local, cp, r)
        order = [all_blocks[i] for i in torch.randperm(len(all_blocks), generator=gen).tolist()]
        acc = LseAccumulator()
        for blk in order:
            kb, vb, kp = kv_of[blk]
            acc.add(*fwd(ql, kb, vb, qpos, kp, causal, scale))
        out, lse = acc.result()
        dq = torch.zeros(ql.shape, dtype=cd)
        for blk in order:
            kb, vb, kp = kv_of[blk]
            dq_b, dk_b, dv_b = bwd(dol.to(cd), ql, kb, vb, out, lse, qpos, kp, causal, scale)
            dq += dq_b
            glob = kp  # global positions of this block's keys
            dk[glob] += dk_b
            dv[glob] += dv_b
        outs.append(out), lses.append(lse), dqs.append(dq)
    return {"out": zigzag_unsplit(outs), "lse": zigzag_unsplit(lses, seq_dim=2), "dq": zigzag_unsplit(dqs),
            "dk": dk, "dv": dv}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_blocks_in_random_permutations_agree_with_reference_fp64(causal, heads):
    cp, parts, scale = 4, 2, 0.3
    q, k, v, do = _qkvd(2 * cp * parts * 3, 2, *heads, 8, seed=1)
    ref = reference_attention(q, k, v, causal=causal, scale=scale, dout=do)
    results = [_blockwise(q, k, v, do, causal, scale, cp, parts, order_seed=i) for i in range(3)]
    for res in results:
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert _maxdiff(res[name], ref[name]) < 1e-12, name
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert _maxdiff(results[0][name], results[1][name]) < 1e-12
        assert _maxdiff(results[0][name], results[2][name]) < 1e-12


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse():
    q, k, v, do = _qkvd(6, 1, 2, 2, 4)
    q_pos = torch.tensor([0, 1, 2, 3, 10, 11])  # first four rows precede every key
    k_pos = torch.arange(5, 11)
    out, lse = block_attention_forward(q, k, v, q_pos, k_pos, True, 0.5, rows_per_tile=4)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.all(out[:4] == 0) and torch.all(torch.isneginf(lse[..., :4]))
    assert torch.all(torch.isfinite(lse[..., 4:]))
    # a tile mixing empty and non-empty rows (rows 2..5 with tile 4 starting at 2 is 'partial')
    out2, lse2 = block_attention_forward(q, k, v, q_pos, k_pos, True, 0.5, rows_per_tile=6)
    assert torch.equal(out2[:4], torch.zeros_like(out2[:4])) and torch.all(torch.isneginf(lse2[..., :4]))
    assert _maxdiff(out2, out) < 1e-14
    dq, dk, dv = block_attention_backward(do, q, k, v, out, lse, q_pos, k_pos, True, 0.5, rows_per_tile=6)
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.all(dq[:4] == 0)


def test_position_lengths_must_match():
    q, k, v, _ = _qkvd(4, 1, 2, 2, 4)
    with pytest.raises(ValueError, match="positions"):
        block_attention_forward(q, k, v, torch.arange(4), torch.arange(3), True, 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_accumulate_in_fp32(dtype):
    q, k, v, do = _qkvd(16, 1, 4, 2, 8, dtype=dtype)
    pos = torch.arange(16)
    out, lse = block_attention_forward(q, k, v, pos, pos, True, 0.35)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    dq, dk, dv = block_attention_backward(do, q, k, v, out, lse, pos, pos, True, 0.35)
    assert dq.dtype == dk.dtype == dv.dtype == torch.float32
    ref = reference_attention(q.double(), k.double(), v.double(), causal=True, scale=0.35, dout=do.double())
    assert _maxdiff(out, ref["out"]) < 1e-5 and _maxdiff(dk, ref["dk"]) < 1e-4


def test_extreme_logits_between_blocks_stay_finite_and_exact():
    """Blocks whose scores differ by ~1e4: the per-block maxima jump far above the running one."""
    s, cp = 16, 4
    q, k, v, do = _qkvd(s, 1, 2, 2, 4, seed=3)
    q[..., 0] = 1.0
    for c in range(2 * cp):                        # chunk c of the sequence: logits offset ~ c * 1400
        k[c * 2:(c + 1) * 2, :, :, 0] = 1e4 * c / (2 * cp - 1)
    ref = reference_attention(q, k, v, causal=False, scale=1.0, dout=do)
    pos = torch.arange(s)
    acc = LseAccumulator()
    for a in (0, 6, 2, 14, 4, 8, 12, 10):          # blocks of 2 keys, in a scrambled order
        acc.add(*block_attention_forward(q, k[a:a + 2], v[a:a + 2], pos, pos[a:a + 2], False, 1.0))
    out, lse = acc.result()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # scores near 1e4 carry FP64 rounding of 1e4 * 2.2e-16 ~ 2e-12 in either computation, and
    # exp() passes that on to the weights: compare at that conditioning, not at 1e-12
    assert _maxdiff(out, ref["out"]) < 1e-10
    assert _maxdiff(lse, ref["lse"]) / ref["lse"].abs().max().item() < 1e-14


def test_default_tiles_split_at_zigzag_runs_and_skip_masked_tiles():
    """Rank 0 of cp=2 against rank 1's late chunk: early queries fully masked, late ones see all."""
    cp, s_local = 2, 8
    q, k, v, do = _qkvd(s_local, 1, 2, 2, 4)
    k, v = k[:4], v[:4]
    q_pos = zigzag_positions(s_local, cp, 0)     # [0..3, 12..15]
    k_pos = torch.arange(8, 12)                  # rank 1's late chunk (global chunk 2)
    out, lse = block_attention_forward(q, k, v, q_pos, k_pos, True, 0.5)
    assert torch.all(out[:4] == 0) and torch.all(torch.isneginf(lse[..., :4]))
    dense = torch.softmax(torch.einsum("nbhd,mbhd->bhnm", q[4:], k) * 0.5, dim=-1)
    assert _maxdiff(out[4:], torch.einsum("bhnm,mbhd->nbhd", dense, v)) < 1e-12


# ---------------------------------------------------------------------------------------------
# the "cpu-flash" block kernel (torch's fused CPU flash ops) against the same FP64 reference
# ---------------------------------------------------------------------------------------------
FLASH = BLOCK_KERNELS["cpu-flash"]
QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def test_kernel_registry_and_bad_kernels_name_the_fix():
    assert set(BLOCK_KERNELS) == {"math", "cpu-flash", "cuda-flash", "flash-attn"} and CpuFlashKernel.available()
    assert resolve_kernel("math", F64, "cpu") is BLOCK_KERNELS["math"]
    assert resolve_kernel(FLASH, torch.bfloat16, "cpu") is FLASH
    with pytest.raises(ValueError, match=r"unknown block kernel 'flash'.*\['auto', 'math', 'cpu-flash'"):
        resolve_kernel("flash", torch.float32, "cpu")
    for dtype in (F64, torch.float16):
        with pytest.raises(ValueError, match="runs float32 / bfloat16 only.*use kernel='math'"):
            resolve_kernel("cpu-flash", dtype, "cpu")
    with pytest.raises(ValueError, match="CPU tensors only, got device cuda.*use kernel='auto' or 'math'"):
        resolve_kernel("cpu-flash", torch.float32, torch.device("cuda", 0))
    BLOCK_KERNELS["math"].check(F64, torch.device("cuda", 0))  # math runs anywhere


def test_flash_pieces_classify_rows():
    ar = torch.arange
    # a query chunk against its own block: one top-left causal piece over all keys
    assert _flash_pieces(ar(8), ar(8), True) == [(0, 8, "causal", 0, 8)]
    assert _flash_pieces(ar(8), ar(8), False) == [(0, 8, "full", 0, 8)]
    # sub-block diagonal (parts_per_chunk = 2): rows 0-3 masked, 4-5 causal on 2 keys, 6-7 full
    assert _flash_pieces(ar(8), ar(4, 6), True) == [(4, 6, "causal", 0, 2), (6, 8, "full", 0, 2)]
    # zigzag shard [0..3, 12..15] of cp=2 against key chunks: masked / full rows; adjacent full merged
    zz = zigzag_positions(8, 2, 0)
    assert _flash_pieces(zz, ar(8, 12), True) == [(4, 8, "full", 0, 4)]
    assert _flash_pieces(zz, ar(0, 4), True) == [(0, 4, "causal", 0, 4), (4, 8, "full", 0, 4)]
    assert _flash_pieces(ar(4, 8), ar(0, 4), True) == [(0, 4, "full", 0, 4)]
    # a query run starting inside the block (no bottom-right causal in the op): delegated to math
    assert _flash_pieces(ar(3, 8), ar(0, 6), True) == [(0, 3, "math", 0, 6), (3, 5, "full", 0, 6)]
    # keys that are not one increasing run: the whole pair goes to math
    assert _flash_pieces(ar(6), torch.tensor([0, 2, 4]), True) == [(0, 6, "math", 0, 3)]
    # fully masked pair: nothing to compute
    assert _flash_pieces(ar(4), ar(10, 14), True) == []


def _diff(a, b) -> float:
    """Max-abs difference; -inf entries (rows that see no key) must sit in the same places."""
    inf_a, inf_b = torch.isneginf(a), torch.isneginf(b)
    assert torch.equal(inf_a, inf_b), "fully masked rows differ"
    return _maxdiff(a[~inf_a], b[~inf_b]) if (~inf_a).any() else 0.0


def _errs(got: dict, ref: dict) -> dict:
    return {n: _diff(got[n], ref[n]) for n in QUANTITIES}


def _assert_fp32(got: dict, ref: dict) -> None:
    for n in QUANTITIES:
        assert got[n].dtype == torch.float32, n
        finite = ref[n][torch.isfinite(ref[n])]
        tol = 1e-5 * max(1.0, finite.abs().max().item() if finite.numel() else 0.0)
        assert _diff(got[n], ref[n]) <= tol, (n, _diff(got[n], ref[n]))


def _single(kernel, q, k, v, do, q_pos, k_pos, causal, scale):
    out, lse = kernel.forward(q, k, v, q_pos, k_pos, causal, scale)
    dq, dk, dv = kernel.backward(do.to(out.dtype), q, k, v, out, lse, q_pos, k_pos, causal, scale)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("pair", ["diagonal", "full", "sub-block-diagonal", "delegated", "non-causal"])
def test_cpu_flash_single_pair_matches_fp64_math(heads, pair):
    """One (query shard, KV block) pair: FP32 cpu-flash vs the FP64 math kernel (which matches the
    reference above within 1e-12), including pieces the op cannot run (delegated to math)."""
    q_pos, k_pos, causal = {
        "diagonal": (torch.arange(12), torch.arange(12), True),
        "full": (torch.arange(12, 24), torch.arange(12), True),
        "sub-block-diagonal": (torch.arange(12), torch.arange(4, 8), True),
        "delegated": (torch.arange(3, 15), torch.arange(0, 6), True),
        "non-causal": (torch.arange(12), torch.arange(5, 10), False),
    }[pair]
    q, _, _, do = _qkvd(q_pos.numel(), 2, *heads, 8, seed=5)
    _, k, v, _ = _qkvd(k_pos.numel(), 2, *heads, 8, seed=6)
    ref = _single(BLOCK_KERNELS["math"], q, k, v, do, q_pos, k_pos, causal, 0.4)
    got = _single(FLASH, *(x.float() for x in (q, k, v, do)), q_pos, k_pos, causal, 0.4)
    assert got["out"].shape == q.shape and got["lse"].shape == (2, heads[0], q.shape[0])
    assert got["dk"].shape == k.shape and got["dv"].shape == v.shape
    _assert_fp32(got, ref)


def test_cpu_flash_fully_masked_rows_and_pairs_give_zero_and_minus_inf():
    q, k, v, do = _qkvd(8, 1, 4, 2, 8, dtype=torch.float32)
    q_pos, k_pos = torch.arange(8), torch.arange(4, 8)          # rows 0-3 precede every key
    out, lse = FLASH.forward(q, k[:4], v[:4], q_pos, k_pos, True, 0.5)
    assert torch.all(out[:4] == 0) and torch.all(torch.isneginf(lse[..., :4]))
    assert torch.isfinite(out).all() and torch.isfinite(lse[..., 4:]).all()
    # a pair masked for every row: nothing computed, nothing NaN, zero gradients
    out, lse = FLASH.forward(q, k[:4], v[:4], torch.arange(8), torch.arange(10, 14), True, 0.5)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    final_out, final_lse = torch.randn_like(out), torch.randn_like(lse)  # any finite final values
    grads = FLASH.backward(do, q, k[:4], v[:4], final_out, final_lse, torch.arange(8), torch.arange(10, 14),
                           True, 0.5)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_cpu_flash_blockwise_fp32_matches_fp64_reference(causal, heads, parts):
    """Every zigzag rank of cp=4 folds all blocks (parts_per_chunk 1: diagonal pairs; 2: sub-block
    diagonals) through cpu-flash in FP32: out, lse, dq, dk, dv within 1e-5 x max(1, max|ref|)."""
    cp, scale = 4, 0.3
    q, k, v, do = _qkvd(2 * cp * parts * 4, 2, *heads, 16, seed=7)
    ref = reference_attention(q, k, v, causal=causal, scale=scale, dout=do)
    got = _blockwise(*(x.float() for x in (q, k, v, do)), causal, scale, cp, parts, order_seed=0, kernel=FLASH)
    _assert_fp32(got, ref)


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_flash_blockwise_bf16_within_twice_plain_bf16_error(causal):
    """BF16 inputs: error vs FP64 <= 2 x that of plain PyTorch attention in BF16 (+ flash-attn's
    rounding slack), blocks with parts_per_chunk = 2 and GQA."""
    cp, parts, scale = 4, 2, 0.25
    q, k, v, do = _qkvd(2 * cp * parts * 8, 2, 8, 2, 32, seed=8)
    ref = reference_attention(q, k, v, causal=causal, scale=scale, dout=do)
    bf = [x.to(torch.bfloat16) for x in (q, k, v, do)]
    plain = reference_attention(*bf[:3], causal=causal, scale=scale, dout=bf[3])
    got = _blockwise(*bf, causal, scale, cp, parts, order_seed=1, kernel=FLASH)
    math_got = _blockwise(*bf, causal, scale, cp, parts, order_seed=1, kernel=BLOCK_KERNELS["math"])
    err, base, math_err = _errs(got, ref), _errs(plain, ref), _errs(math_got, ref)
    for n in QUANTITIES:
        r16 = ref[n].to(torch.bfloat16)
        slack = 2 * _maxdiff((r16 + 0.3 - 0.3), r16)
        assert got[n].dtype == torch.float32
        assert err[n] <= 2 * base[n] + slack, (n, err[n], base[n], math_err[n])
