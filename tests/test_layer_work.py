"""Note [Layer work]: ``place_packed(token_weight=...)`` balances attention pairs plus the tokens the
layer's projections and MLP run on; ``layer_pairs_per_token`` prices a token in pairs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_fcp.contract.placement import lognormal_lengths, place_packed
from megatron_fcp.cost.model import AttentionShape, layer_pairs_per_token
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.placing import place_batch
from megatron_fcp.testing.harness import harness_attention, per_document_reference


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
    for pl in (default, weighted):
        assert sum(pl.tokens(i) for i in range(8)) == sum(lengths)
    t0, t1 = _tokens(default), _tokens(weighted)
    layer0, layer1 = default.work() + lam * t0, weighted.work() + lam * t1
    assert default.work().max() / default.work().mean() <= 1.05
    assert t0.max() / t0.mean() > 1.5 and layer0.max() / layer0.mean() > 1.3
    assert layer1.max() / layer1.mean() <= 1.05
    assert t1.max() / t1.mean() < t0.max() / t0.mean()


def test_a_token_weighted_placement_matches_fp64():
    """cp = 4 over two nodes, token weight 40 pairs a token: out, LSE, dQ, dK, dV against the
    per-document FP64 reference."""
    ranks = (0, 1, 8, 9)
    lengths = [120, 9, 33, 2, 61, 5]
    pl = place_batch("dgx-h100:2", ranks, lengths, block_tokens=16, token_weight=40.0)
    assert pl != place_batch("dgx-h100:2", ranks, lengths, block_tokens=16)  # the weight moved something
    plan = build_plan("dgx-h100:2", ranks, "entry", placement=pl)
    g = torch.Generator().manual_seed(11)
    T, h, hk, d = sum(lengths), 4, 2, 8
    q, do = (torch.randn(T, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(T, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
    ref = per_document_reference(q, k, v, do, lengths, True, 1.0 / math.sqrt(d))
    res = harness_attention(q, k, v, do, ranks=ranks, placement=pl, plan=plan, causal=True)
    for name in ("out", "lse", "dq", "dk", "dv"):
        torch.testing.assert_close(res.gathered(name), ref[name], rtol=0, atol=1e-10, msg=name)
