"""Note [Layer work] and Note [Layer-balanced placement]: ``place_packed_layer`` keeps
attention pairs and tokens each within a few percent of their means; ``token_weight`` balances
their weighted sum; ``layer_pairs_per_token`` prices a token's linear layers in pairs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_fcp.contract.layer_placement import place_balanced, place_packed_layer
from megatron_fcp.contract.placement import lognormal_lengths, place_packed
from megatron_fcp.cost.model import AttentionShape, layer_pairs_per_token
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.placing import place_batch
from megatron_fcp.testing.harness import assert_packed_matches_fp64


def _tokens(pl) -> np.ndarray:
    return np.array([pl.tokens(i) for i in range(pl.cp)], dtype=np.float64)


def test_layer_pairs_per_token_counts_projections_and_mlp():
    shape = AttentionShape(1, heads=64, kv_heads=8, head_dim=128)
    # QKV 2*8192*(64*128 + 8*256), O 2*64*128*8192, SwiGLU MLP 2*8192*28672*3, over 2*64*256 FLOPs a pair
    want = (2 * 8192 * (64 * 128 + 8 * 256) + 2 * 64 * 128 * 8192 + 2 * 8192 * 28672 * 3) / (2 * 64 * 256)
    assert layer_pairs_per_token(shape, 8192, 28672, gated=True) == want == 52224.0
    plain = layer_pairs_per_token(shape, 8192, 28672)
    assert plain == want - 2 * 8192 * 28672 / (2 * 64 * 256)                  # one up-projection fewer
    assert layer_pairs_per_token(shape, 8192, 28672, gated=True, experts_per_token=2) > want
    with pytest.raises(ValueError, match="ffn_hidden"):
        layer_pairs_per_token(shape, 8192, 0)


@pytest.mark.parametrize("bad", [-1.0, True, "52K", float("nan")])
def test_token_weight_refuses_bad_values_naming_the_fix(bad):
    with pytest.raises(ValueError, match="layer_pairs_per_token"):
        place_packed([100, 50, 7], 2, token_weight=bad)


def test_token_weight_zero_is_the_attention_balance():
    lengths = lognormal_lengths(math.log(2048), 1.0, 1 << 17, 3)
    assert place_packed(lengths, 8, token_weight=0) == place_packed(lengths, 8)
    nodes = (0, 0, 1, 1, 2, 2, 3, 3)
    assert place_packed(lengths, 8, nodes=nodes, token_weight=0.0) == place_packed(lengths, 8, nodes=nodes)


@pytest.mark.parametrize("nodes", [None, (0, 0, 0, 0, 1, 1, 1, 1)])
def test_token_weight_balances_the_layer_sum_and_the_default_does_not(nodes):
    """Lognormal 8K-median mix at cp = 8 and a 70B-like token weight: attention alone leaves the
    tokens (the linear layers' work) far from even; the layer's work is balanced with the weight."""
    lengths = lognormal_lengths(math.log(8192), 1.0, 1 << 19, 0)
    lam = layer_pairs_per_token(AttentionShape(1, 64, 8, 128), 8192, 28672, gated=True)
    default = place_packed(lengths, 8, nodes=nodes)
    weighted = place_packed(lengths, 8, nodes=nodes, token_weight=lam)
    layer = place_packed_layer(lengths, 8, nodes=nodes)
    for pl in (default, weighted):
        assert sum(pl.tokens(i) for i in range(8)) == sum(lengths)
    t0, t1 = _tokens(default), _tokens(weighted)
    layer0, layer1 = default.work() + lam * t0, weighted.work() + lam * t1
    assert default.work().max() / default.work().mean() <= 1.05
    assert t0.max() / t0.mean() > 1.5 and layer0.max() / layer0.mean() > 1.3
    assert layer1.max() / layer1.mean() <= 1.05
    assert t1.max() / t1.mean() < t0.max() / t0.mean()
    # the layer balance: both maxima near their means, so the layer's phases are even too
    t2 = _tokens(layer)
    assert sum(t2) == sum(lengths)
    assert layer.work().max() / layer.work().mean() <= 1.03 and t2.max() / t2.mean() <= 1.03
    phases = (layer.work().max() + lam * t2.max()) / (layer.work().mean() + lam * t2.mean())
    assert phases <= 1.03 < (weighted.work().max() + lam * t1.max()) / (weighted.work().mean() + lam * t1.mean())


@pytest.mark.parametrize("median,cp,topology", [(2048, 16, "dgx-h100:2"), (8192, 64, "dgx-h100:8"),
                                                (32768, 64, "dgx-h100:8"), (600, 8, None)])
def test_layer_balance_keeps_pairs_and_tokens_even(median, cp, topology):
    """1M-token lognormal mixes (a 64K one at cp = 8, no nodes): pairs and tokens each within 3% of
    their means, every token placed once, where the attention balance leaves the tokens uneven
    (1.2x at cp = 8, 2x or more on the 1M-token mixes)."""
    total = (1 << 16) if topology is None else (1 << 20)
    lengths = lognormal_lengths(math.log(median), 1.0, total, 0)
    nodes = None if topology is None else tuple(j // 8 for j in range(cp))   # eight ranks a node
    layer = place_packed_layer(lengths, cp, nodes=nodes)
    work, tokens = layer.work(), _tokens(layer)
    assert tokens.sum() == sum(lengths)
    assert work.max() / work.mean() <= 1.03 and tokens.max() / tokens.mean() <= 1.03
    attention = _tokens(place_packed(lengths, cp, nodes=nodes))
    assert attention.max() / attention.mean() >= (1.15 if topology is None else 2.0)


def test_layer_balance_refuses_bad_values_naming_the_fix():
    with pytest.raises(ValueError, match="balance: one of 'attention', 'layer'.*--fcp-packed-balance"):
        place_balanced([100, 50, 7], 2, balance="tokens")
    with pytest.raises(ValueError, match="token_weight: knobs of the attention balance"):
        place_balanced([100, 50, 7], 2, balance="layer", token_weight=5.0)
    for bad in (0, True):
        with pytest.raises(ValueError, match="cp: must be a positive integer"):
            place_packed_layer([100, 50, 7], bad)
    with pytest.raises(ValueError, match="block_tokens"):
        place_packed_layer([100, 50, 7], 2, block_tokens=0)
    assert place_balanced([100, 50, 7], 2, balance="attention") == place_packed([100, 50, 7], 2)


def test_layer_balance_handles_tiny_batches():
    """More ranks than tokens, a single token, one document: every token placed once."""
    for lengths, cp in (([1], 4), ([3, 1, 2], 8), ([17], 3), ([5, 5, 5, 5], 4)):
        pl = place_packed_layer(lengths, cp)
        assert sum(pl.tokens(i) for i in range(cp)) == sum(lengths) and pl.cp == cp


def test_a_layer_balanced_placement_matches_fp64():
    """cp = 4 over two nodes: out, LSE, dQ, dK, dV of a plan over the layer-balanced placement (a
    document cut over ranks of both nodes) against the per-document FP64 reference."""
    ranks = (0, 1, 8, 9)
    lengths = [120, 9, 33, 2, 61, 5]
    pl = place_batch("dgx-h100:2", ranks, lengths, block_tokens=16, balance="layer")
    assert len({i for i, blocks in enumerate(pl.blocks) for s in blocks if s.doc == 0}) > 1
    _check_fp64(ranks, lengths, pl)


def test_a_token_weighted_placement_matches_fp64():
    """cp = 4 over two nodes, token weight 40 pairs a token: out, LSE, dQ, dK, dV against the
    per-document FP64 reference."""
    ranks = (0, 1, 8, 9)
    lengths = [120, 9, 33, 2, 61, 5]
    pl = place_batch("dgx-h100:2", ranks, lengths, block_tokens=16, token_weight=40.0, balance="attention")
    assert pl != place_batch("dgx-h100:2", ranks, lengths, block_tokens=16, balance="attention")  # it moved something
    _check_fp64(ranks, lengths, pl)


def _check_fp64(ranks, lengths, pl) -> None:
    assert list(pl.doc_lengths) == list(lengths)
    assert_packed_matches_fp64(build_plan("dgx-h100:2", ranks, "entry", placement=pl), pl, seed=11)


def test_layer_balance_under_a_window_counts_the_window_pairs():
    """A sliding window (512, 0): pairs counted under it, both resources within 3%, and chunks sized by
    the window's reach, not the document's (the blocks stay no more than without the window; sized by
    the document they were 3-token slivers, 182 blocks for 555 tokens at cp = 4)."""
    lengths = lognormal_lengths(math.log(2000), 1.0, 1 << 16, 0)
    full = place_packed_layer(lengths, 8)
    win = place_packed_layer(lengths, 8, window=(512, 0))
    assert win.window == (512, 0)
    work, tokens = win.work(), _tokens(win)
    assert work.max() / work.mean() <= 1.03 and tokens.max() / tokens.mean() <= 1.03
    assert sum(map(len, win.blocks)) <= sum(map(len, full.blocks))
    small = place_packed_layer([300, 20, 90, 5, 140], 4, window=(32, 0))
    assert sum(map(len, small.blocks)) <= 30
