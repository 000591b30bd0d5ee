"""Block kernels against an independent FP64 reference (torch autograd over the full sequence)."""

from __future__ import annotations

import pytest
import torch

from megatron_fcp.attention.kernels import (
    attention_delta,
    block_attention_backward,
    block_attention_forward,
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
from megatron_fcp.plan import blocks_of

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


def _blockwise(q, k, v, do, causal, scale, cp, parts, order_seed):
    """Emulate every CP rank in one process: each rank folds all KV blocks in a random order."""
    ranks = tuple(range(cp))
    s_local = q.shape[0] // cp
    outs, lses, dqs = [], [], []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
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
            acc.add(*block_attention_forward(ql, kb, vb, qpos, kp, causal, scale, rows_per_tile=5, key_chunk=2))
        out, lse = acc.result()
        delta = attention_delta(dol, out)
        dq = torch.zeros_like(ql)
        for blk in order:
            kb, vb, kp = kv_of[blk]
            dq_b, dk_b, dv_b = block_attention_backward(dol, ql, kb, vb, out, lse, qpos, kp, causal, scale,
                                                        delta, rows_per_tile=5, key_chunk=2)
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
