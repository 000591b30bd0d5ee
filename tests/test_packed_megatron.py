"""Packed batches in the Megatron layer, in one process: metadata checks, the cp = 1 data path,
per-document local attention and the RoPE replacement's pass-through."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_fcp.patches.packed import doc_lengths_of, local_packed_attention, make_rope, shard_packed_batch


def _psp(cu, **kw):
    from megatron.core.packed_seq_params import PackedSeqParams

    t = torch.tensor(cu, dtype=torch.int32)
    return PackedSeqParams(qkv_format=kw.pop("qkv_format", "thd"), cu_seqlens_q=t, cu_seqlens_kv=kw.pop("kv", t), **kw)


def test_doc_lengths_of_reads_cu_seqlens():
    assert doc_lengths_of(_psp([0, 3, 10, 11])) == (3, 7, 1)


@pytest.mark.parametrize("cu, kw, msg", [
    ([1, 3, 10], {}, "must start at 0"),
    ([0, 3, 3, 10], {}, r"must increase strictly \(document 1 has 0 tokens\)"),
    ([0, 5, 4], {}, r"document 1 has -1 tokens"),
    ([0], {}, r"needs at least \[0, n\]"),
    ([0, 4, 8], {"kv": torch.tensor([0, 2, 8], dtype=torch.int32)}, "cu_seqlens_kv must equal cu_seqlens_q"),
    ([0, 4, 8], {"cu_seqlens_q_padded": torch.tensor([0, 6, 12], dtype=torch.int32)}, "leave the padded variants unset"),
    ([0, 4, 8], {"qkv_format": "sbhd"}, "qkv_format must be 'thd'"),
])
def test_bad_packed_metadata_names_the_fix(cu, kw, msg):
    with pytest.raises(ValueError, match=msg):
        doc_lengths_of(_psp(cu, **kw))


def test_shard_checks_the_batch_against_cu_seqlens():
    batch = {"tokens": torch.zeros(1, 10, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"batch\['tokens'\]: expected \[1, 11\]"):
        shard_packed_batch(batch, [0, 4, 11], cp_group=SimpleNamespace(size=lambda: 1, rank=lambda: 0))
    with pytest.raises(ValueError, match="must start at 0"):
        shard_packed_batch(batch, [2, 10])


def test_shard_at_cp1_gives_positions_inside_documents():
    group = SimpleNamespace(size=lambda: 1, rank=lambda: 0)  # a CP group of one rank: nothing to split
    batch = {"tokens": torch.arange(7)[None], "position_ids": torch.arange(7)[None]}
    local, params = shard_packed_batch(batch, [0, 3, 4, 7], cp_group=group)
    assert local["tokens"].tolist() == [list(range(7))]
    assert local["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2]]
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 3, 4, 7]
    assert params.max_seqlen_q == 3


@pytest.mark.parametrize("causal", [True, False])
def test_local_packed_attention_keeps_documents_apart(causal):
    from megatron_fcp.attention.kernels import reference_attention

    g = torch.Generator().manual_seed(0)
    lengths = (3, 1, 6)
    q = torch.randn(10, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(10, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(10, 2, 8, generator=g, dtype=torch.float64)
    out = local_packed_attention(q, k, v, lengths, causal=causal, scale=0.3)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        ref = reference_attention(q[sl, None], k[sl, None], v[sl, None], causal=causal, scale=0.3)["out"][:, 0]
        torch.testing.assert_close(out[sl], ref, rtol=1e-12, atol=1e-12)
        start += n


def test_rope_replacement_passes_other_calls_through():
    """Without a packed batch under FCP (no runtime, or no cu_seqlens) Megatron's function runs as is."""
    seen = []

    def original(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        seen.append((t.shape, cu_seqlens))
        return t * 2

    rope = make_rope(original)
    t = torch.ones(5, 2, 4)
    assert torch.equal(rope(t, torch.zeros(8, 1, 1, 4), None), t * 2)
    assert torch.equal(rope(t, torch.zeros(8, 1, 1, 4), None, cu_seqlens=torch.tensor([0, 5])), t * 2)
    assert seen == [(t.shape, None), (t.shape, seen[1][1])]
