"""Document masks in the block kernels (packed batches): pure kernel calls against a dense FP64
reference that masks by document (and causal position inside the document)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from megatron_fcp.attention.dispatch import BLOCK_KERNELS
from megatron_fcp.attention.kernels import block_attention_backward, block_attention_forward
from megatron_fcp.attention.tiles import flash_pieces, math_tiles

F64 = torch.float64
QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def _spans(spans):
    """[(doc, start, end), ...] -> (positions, doc ids) int64 tensors in span order."""
    pos = torch.cat([torch.arange(a, z) for _, a, z in spans])
    doc = torch.cat([torch.full((z - a,), d) for d, a, z in spans])
    return pos, doc


def _masked_reference(q, k, v, do, q_pos, k_pos, q_doc, k_doc, causal, scale):
    """Dense FP64 attention with the document (+ causal) mask, torch autograd; rows that see no
    key give out 0, lse -inf and no gradient."""
    q, k, v = (x.detach().to(F64).requires_grad_() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    vis = q_doc[:, None] == k_doc[None, :]
    if causal:
        vis &= k_pos[None, :] <= q_pos[:, None]                              # [n, m]
    rows = vis.any(dim=1)
    kr, vr = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)    # [m, b, h, d]
    s = torch.einsum("nbhd,mbhd->bhnm", q[rows], kr) * scale
    s = s.masked_fill(~vis[rows], -math.inf)
    p = torch.softmax(s, dim=-1)
    out = torch.zeros(q.shape, dtype=F64)
    out[rows] = torch.einsum("bhnm,mbhd->nbhd", p, vr)
    lse = torch.full((q.shape[1], q.shape[2], q.shape[0]), -math.inf, dtype=F64)
    lse[:, :, rows] = torch.logsumexp(s, dim=-1).detach()
    out.backward(do.to(F64))
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _diff(a, b) -> float:
    inf_a, inf_b = torch.isneginf(a), torch.isneginf(b)
    assert torch.equal(inf_a, inf_b), "fully masked rows differ"
    return (a[~inf_a].double() - b[~inf_b].double()).abs().max().item() if (~inf_a).any() else 0.0


def _run(kernel, q, k, v, do, q_pos, k_pos, q_doc, k_doc, causal, scale, **kw):
    """Forward, then backward fed the final out/lse (a single block: they are this block's)."""
    if kernel == "math-tiny":   # tiny tiles and key chunks: many tiles, chunk cuts inside documents
        out, lse = block_attention_forward(q, k, v, q_pos, k_pos, causal, scale, rows_per_tile=2, key_chunk=2,
                                           q_doc=q_doc, k_doc=k_doc)
        dq, dk, dv = block_attention_backward(do, q, k, v, out, lse, q_pos, k_pos, causal, scale,
                                              rows_per_tile=2, key_chunk=2, q_doc=q_doc, k_doc=k_doc)
    else:
        kern = BLOCK_KERNELS[kernel]
        assert kern.documents
        out, lse = kern.forward(q, k, v, q_pos, k_pos, causal, scale, q_doc=q_doc, k_doc=k_doc)
        dq, dk, dv = kern.backward(do, q, k, v, out, lse, q_pos, k_pos, causal, scale, q_doc=q_doc, k_doc=k_doc)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


# a rank's queries (spans of several documents, one split mid-document) against key blocks
Q_SPANS = [(0, 0, 5), (1, 3, 9), (2, 0, 1), (3, 2, 7), (3, 9, 12)]
K_BLOCKS = {
    "own-doc-block": [(1, 0, 6)],                       # one document, the usual placement block
    "diagonal": [(3, 2, 7)],                            # a query span's own block
    "multi-doc": [(1, 0, 4), (3, 0, 3), (5, 0, 2)],     # several documents, one absent from the queries
    "split-doc": [(3, 0, 2), (0, 1, 3), (3, 4, 8)],     # document 3 in two places: math delegation
    "absent": [(7, 0, 4)],                              # no query of this document: all rows masked
}


@pytest.mark.parametrize("kernel,dtype", [("math", F64), ("math-tiny", F64), ("cpu-flash", torch.float32)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block", sorted(K_BLOCKS))
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_document_mask_matches_dense_reference(kernel, dtype, causal, block, heads):
    q_pos, q_doc = _spans(Q_SPANS)
    k_pos, k_doc = _spans(K_BLOCKS[block])
    n, m, (h, hk), d = q_pos.numel(), k_pos.numel(), heads, 8
    g = torch.Generator().manual_seed(zlib.crc32(f"{block}{causal}{heads}".encode()))
    q, do = (torch.randn(n, 1, h, d, generator=g, dtype=F64) for _ in range(2))
    k, v = (torch.randn(m, 1, hk, d, generator=g, dtype=F64) for _ in range(2))
    ref = _masked_reference(q, k, v, do, q_pos, k_pos, q_doc, k_doc, causal, 0.3)
    got = _run(kernel, *(x.to(dtype) for x in (q, k, v, do)), q_pos, k_pos, q_doc, k_doc, causal, 0.3)
    tol = 1e-12 if dtype == F64 else 1e-5
    for name in QUANTITIES:
        assert not torch.isnan(got[name]).any(), name
        err = _diff(got[name], ref[name])
        finite = ref[name][torch.isfinite(ref[name])]
        assert err <= tol * max(1.0, finite.abs().max().item() if finite.numel() else 0.0), (name, err)
    # rows whose document the block lacks: out 0, lse -inf, zero dq
    seen = torch.isin(q_doc, k_doc)
    assert torch.all(got["out"][~seen] == 0) and torch.all(torch.isneginf(got["lse"][..., ~seen]))
    assert torch.all(got["dq"][~seen] == 0)


def test_one_document_is_bitwise_the_plain_positions_path():
    """All tokens in one document: the document-aware path takes the very same tiles and pieces."""
    n, m = 40, 24
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(n, 2, 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(m, 2, 2, 8, generator=g) for _ in range(2))
    q_pos = torch.cat([torch.arange(0, 20), torch.arange(60, 80)])
    k_pos = torch.arange(16, 40)
    zq, zk = torch.zeros(n, dtype=torch.int64), torch.zeros(m, dtype=torch.int64)
    for name in ("math", "cpu-flash"):
        kern = BLOCK_KERNELS[name]
        for causal in (True, False):
            a = kern.forward(q, k, v, q_pos, k_pos, causal, 0.5)
            b = kern.forward(q, k, v, q_pos, k_pos, causal, 0.5, q_doc=zq, k_doc=zk)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (name, causal)
            ga = kern.backward(do, q, k, v, *a, q_pos, k_pos, causal, 0.5)
            gb = kern.backward(do, q, k, v, *a, q_pos, k_pos, causal, 0.5, q_doc=zq, k_doc=zk)
            assert all(torch.equal(x, y) for x, y in zip(ga, gb)), (name, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_tiles_never_cross_a_document_and_skip_other_documents(causal):
    q_pos, q_doc = _spans(Q_SPANS)
    k_pos, k_doc = _spans(K_BLOCKS["multi-doc"] + [(3, 3, 6)])
    seen_rows = set()
    for a, z, chunks in math_tiles(q_pos, k_pos, causal, 3, 2, q_doc, k_doc):
        assert len(set(q_doc[a:z].tolist())) == 1                            # tile inside one document
        for c0, c1, _ in chunks:
            assert set(k_doc[c0:c1].tolist()) == {q_doc[a].item()}             # same document only
        seen_rows.update(range(a, z))
    assert all(q_doc[r].item() in (1, 3) for r in seen_rows)                  # rows of docs 0, 2: skipped


def test_flash_pieces_with_documents():
    q_pos, q_doc = _spans([(0, 0, 4), (1, 0, 3), (1, 5, 8), (2, 0, 2)])      # rows 0-3, 4-6, 7-9, 10-11
    k_pos, k_doc = _spans([(1, 0, 6), (2, 0, 2)])                              # keys 0-5 doc 1, 6-7 doc 2
    assert flash_pieces(q_pos, k_pos, True, q_doc, k_doc) == [
        (4, 7, "causal", 0, 3),    # doc 1 positions 0-2 against its keys 0-2
        (7, 8, "math", 0, 8),      # doc 1 position 5 starts inside the keys (no bottom-right causal)
        (8, 10, "full", 0, 6),     # doc 1 positions 6-7 see all of doc 1's keys
        (10, 12, "causal", 6, 8),  # doc 2 against its own block
    ]
    assert flash_pieces(q_pos, k_pos, False, q_doc, k_doc) == [(4, 10, "full", 0, 6), (10, 12, "full", 6, 8)]
    # a document in two separate key segments: its rows go to math, other rows stay fused
    k_pos2, k_doc2 = _spans([(1, 0, 2), (2, 0, 2), (1, 2, 4)])
    assert flash_pieces(q_pos, k_pos2, False, q_doc, k_doc2) == [
        (4, 7, "math", 0, 6), (7, 10, "math", 0, 6), (10, 12, "full", 2, 4)]
