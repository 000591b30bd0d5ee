"""FP32/FP64 log-sum-exp merge: exactness, order independence, empty sides, extreme spreads."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_fcp.attention.kernels import block_attention_forward, reference_attention
from megatron_fcp.attention.merge import LseAccumulator, merge_two

F64 = torch.float64


def _partials(n_parts, n=5, b=2, h=3, d=4, seed=0, spread=3.0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, b, h, d, generator=g, dtype=dtype),
             spread * torch.randn(b, h, n, generator=g, dtype=dtype)) for _ in range(n_parts)]


def _fold(parts):
    acc = LseAccumulator()
    for o, l in parts:
        acc.add(o, l)
    return acc.result()


def test_merge_of_two_key_halves_equals_attention_over_all_keys():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(7, 2, 4, 8, generator=g, dtype=F64)
    k = torch.randn(10, 2, 2, 8, generator=g, dtype=F64)
    v = torch.randn(10, 2, 2, 8, generator=g, dtype=F64)
    ref = reference_attention(q, k, v, causal=False, scale=0.4)
    qp, kp = torch.arange(7), torch.arange(10)
    a = block_attention_forward(q, k[:4], v[:4], qp, kp[:4], False, 0.4)
    b = block_attention_forward(q, k[4:], v[4:], qp, kp[4:], False, 0.4)
    out, lse = merge_two(*a, *b)
    assert (out - ref["out"]).abs().max() < 1e-13 and (lse - ref["lse"]).abs().max() < 1e-13


def test_merge_is_bitwise_commutative():
    (oa, la), (ob, lb) = _partials(2, spread=30.0)
    o1, l1 = merge_two(oa, la, ob, lb)
    o2, l2 = merge_two(ob, lb, oa, la)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_accumulator_is_order_independent_to_1e12_and_matches_merge_two():
    parts = _partials(5, spread=20.0)
    ref_o, ref_l = _fold(parts)
    for perm in itertools.islice(itertools.permutations(range(5)), 0, 120, 7):
        o, l = _fold([parts[i] for i in perm])
        assert (o - ref_o).abs().max() < 1e-12 and (l - ref_l).abs().max() < 1e-12
    o, l = parts[0]
    for ob, lb in parts[1:]:
        o, l = merge_two(o, l, ob, lb)
    assert (o - ref_o).abs().max() < 1e-14 and (l - ref_l).abs().max() < 1e-14


def test_direct_formula():
    (oa, la), (ob, lb) = _partials(2)
    o, l = merge_two(oa, la, ob, lb)
    lse = torch.logaddexp(la, lb)
    wa, wb = torch.exp(la - lse).permute(2, 0, 1)[..., None], torch.exp(lb - lse).permute(2, 0, 1)[..., None]
    assert (l - lse).abs().max() < 1e-14 and (o - (wa * oa + wb * ob)).abs().max() < 1e-14


def test_empty_sides_give_no_nan():
    (oa, la), (ob, lb) = _partials(2)
    empty_o, empty_l = torch.zeros_like(oa), torch.full_like(la, -math.inf)
    o, l = merge_two(empty_o, empty_l, empty_o, empty_l)           # both empty
    assert torch.equal(o, empty_o) and torch.all(torch.isneginf(l))
    o, l = merge_two(empty_o, empty_l, ob, lb)                      # one side empty: the other exactly
    assert torch.equal(o, ob) and torch.equal(l, lb)
    o, l = merge_two(oa, la, empty_o, empty_l)
    assert torch.equal(o, oa) and torch.equal(l, la)
    lb2 = lb.clone()
    lb2[:, :, 0] = -math.inf                                        # mixed rows
    o, l = merge_two(oa, la, ob, lb2)
    assert torch.isfinite(o).all() and torch.isfinite(l).all()
    assert torch.equal(o[0], oa[0]) and torch.equal(l[..., 0], la[..., 0])


def test_extreme_spread_fp32_stays_finite_and_picks_the_dominant_side():
    (oa, la), (ob, lb) = _partials(2, dtype=torch.float32)
    la = la + 1e4                                                   # side a dominates by ~1e4
    for order in ((oa, la, ob, lb), (ob, lb, oa, la)):
        o, l = merge_two(*order)
        assert torch.isfinite(o).all() and torch.isfinite(l).all()
        assert torch.equal(o, oa) and torch.equal(l, la)            # exp(-1e4) underflows to 0
    acc = LseAccumulator()
    acc.add(ob, lb)
    acc.add(oa, la)                                                 # running max jumps by 1e4
    o, l = acc.result()
    assert torch.equal(o, oa) and torch.equal(l, la)


def test_shape_mismatch_raises():
    (oa, la), = _partials(1)
    with pytest.raises(ValueError, match="cannot merge"):
        merge_two(oa, la, oa[:2], la[..., :2])
    with pytest.raises(ValueError, match="no partial result"):
        LseAccumulator().result()


def test_row_range_merge_into_an_empty_accumulator_is_exact():
    """Placements merge a block into the rows of its document only: the same bits as merging the
    whole shard with the other rows empty (out 0, lse -inf), and untouched rows stay empty."""
    g = torch.Generator().manual_seed(5)
    n, b, h, d = 10, 1, 2, 4
    parts = [(slice(0, 6), torch.randn(6, b, h, d, generator=g), torch.randn(b, h, 6, generator=g)),
             (slice(3, 8), torch.randn(5, b, h, d, generator=g), torch.randn(b, h, 5, generator=g)),
             (slice(0, 6), torch.randn(6, b, h, d, generator=g), torch.randn(b, h, 6, generator=g))]
    rows = LseAccumulator.empty(n, b, h, d, torch.float32)
    whole = LseAccumulator()
    for sl, o, l in parts:
        rows.add(o, l, rows=sl)
        full_o, full_l = torch.zeros(n, b, h, d), torch.full((b, h, n), -math.inf)
        full_o[sl], full_l[..., sl] = o, l
        whole.add(full_o, full_l)
    assert torch.equal(rows.out, whole.out) and torch.equal(rows.lse, whole.lse)
    assert torch.all(rows.out[8:] == 0) and torch.all(torch.isneginf(rows.lse[..., 8:]))
    with pytest.raises(ValueError, match="LseAccumulator.empty"):
        LseAccumulator().add(parts[0][1], parts[0][2], rows=parts[0][0])
