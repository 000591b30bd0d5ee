"""The position mask (contract/mask.py): pairs and classes against the token-level rule."""

import itertools

import numpy as np
import pytest

from megatron_fcp.contract.mask import CAUSAL, FULL, FULL_PAIRS, NO_PAIRS, PARTIAL_PAIRS, Mask, as_mask
from megatron_fcp.contract.needs import causal_pairs

MASKS = [CAUSAL, FULL, Mask(True, 0), Mask(True, 3), Mask(True, 7), Mask(False, 2, 1), Mask(False, -1, 2),
         Mask(False, 4, -1), Mask(False, 0, 0)]


def brute(mask: Mask, q0, q1, k0, k1) -> int:
    q = np.arange(q0, q1)[:, None]
    k = np.arange(k0, k1)[None, :]
    return int(mask.visible(q, k).sum()) if q1 > q0 and k1 > k0 else 0


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.describe())
def test_pairs_match_the_token_rule(mask):
    ranges = [(a, b) for a in range(0, 12, 3) for b in range(a, 14, 4)]
    for (q0, q1), (k0, k1) in itertools.product(ranges, ranges):
        assert mask.pairs(q0, q1, k0, k1) == brute(mask, q0, q1, k0, k1), (q0, q1, k0, k1)
    q0, q1, k0, k1 = (np.array([r[i % 2] for r in ranges]) for i in range(4))
    got = mask.pairs(q0, q1, k0, k1)                                    # vectorised form agrees
    assert got.tolist() == [brute(mask, *x) for x in zip(q0, q1, k0, k1)]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.describe())
def test_classify_matches_the_token_rule(mask):
    for q_lo, q_hi, k_lo, k_hi in itertools.product(range(0, 10, 2), range(0, 10, 3), range(0, 10, 2), range(0, 10, 3)):
        if q_hi < q_lo or k_hi < k_lo:
            continue
        vis = mask.visible(np.arange(q_lo, q_hi + 1)[:, None], np.arange(k_lo, k_hi + 1)[None, :])
        want = FULL_PAIRS if vis.all() else NO_PAIRS if not vis.any() else PARTIAL_PAIRS
        assert mask.classify(q_lo, q_hi, k_lo, k_hi) == want
        a, b = mask.key_range(q_lo, q_hi)
        cols = np.flatnonzero(vis.any(axis=0)) + k_lo
        assert all(a <= c <= b for c in cols)


def test_plain_masks_are_the_causal_rule():
    ranges = [(0, 5), (3, 9), (8, 12)]
    for (q0, q1), (k0, k1) in itertools.product(ranges, ranges):
        assert CAUSAL.pairs(q0, q1, k0, k1) == causal_pairs(q0, q1, k0, k1, True)
        assert FULL.pairs(q0, q1, k0, k1) == causal_pairs(q0, q1, k0, k1, False)
    assert not CAUSAL.windowed and not FULL.windowed and Mask(True, 4).windowed


def test_megatron_convention_and_normalisation():
    m = Mask.of(True, (4, 0))
    assert m.window == (4, 0) and m.pairs(10, 11, 0, 20) == 5       # itself and the 4 before it
    assert Mask.of(True, (4, -1)) == m                                # causal: right -1 means 0
    assert Mask.of(True, None) == CAUSAL == Mask.of(True, (-1, 0))
    with pytest.raises(ValueError, match="right side must be 0"):
        Mask.of(True, (4, 3))
    assert as_mask(True, (4, 0)) == m and as_mask(m) is m
    with pytest.raises(ValueError, match="window=\\(left, right\\)"):
        Mask.of(True, (4,))
    with pytest.raises(ValueError, match=">= 0, or -1"):
        Mask.of(True, (-3, 0))
    with pytest.raises(ValueError, match="disagree"):
        as_mask(m, (8, 0))
