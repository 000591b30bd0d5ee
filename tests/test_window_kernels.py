"""Block kernels under sliding windows: math, cpu-flash and the band path against a dense FP64 reference.

The reference is the full score matrix masked by :meth:`Mask.visible` (and document ids), through
torch autograd; the kernels run one (query shard, KV block) pair with tiny tiles and key chunks so
that windows smaller than a tile, not a multiple of it and larger than the sequence all meet
tile edges. The ``band`` path (flash-attn's window arguments) runs here on an exact CPU binding
that implements flash-attn's own window rule (bottom-right alignment, ``w >= m`` read as
unbounded, ``lse = +inf`` on rows that see nothing), so the piece cutting and the argument
translation are checked without a GPU.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from megatron_fcp.attention.fused import CpuFlashKernel, FusedPiecesKernel
from megatron_fcp.attention.fused_ops import FlashAttnOps, FusedOps, LoopVarlenOps, TorchCudaFlashOps
from megatron_fcp.attention.kernels import MathKernel, block_attention_backward, block_attention_forward
from megatron_fcp.attention.tiles import BAND, FULL, MATH, flash_pieces, flash_window, math_tiles, sees_any
from megatron_fcp.contract.mask import Mask

F64 = torch.float64
QUANT = ("out", "lse", "dq", "dk", "dv")
SCALE = 0.3

# (name, mask): windows against tiles of 4 rows and key chunks of 5 keys, blocks of 12-24 keys
MASKS = [
    ("causal-w2-below-tile", Mask(True, 2, 0)),
    ("causal-w7-not-multiple", Mask(True, 7, 0)),
    ("causal-w0-diagonal", Mask(True, 0, 0)),
    ("causal-w1000-beyond-seq", Mask(True, 1000, 0)),
    ("left3-right2", Mask(False, 3, 2)),
    ("left-unbounded-right4", Mask(False, -1, 4)),
    ("left6-right-unbounded", Mask(False, 6, -1)),
    ("left0-right5", Mask(False, 0, 5)),
]


def _visible(q_pos, k_pos, mask, q_doc=None, k_doc=None) -> torch.Tensor:
    vis = mask.visible(q_pos.numpy()[:, None], k_pos.numpy()[None, :])
    if q_doc is not None:
        vis &= q_doc.numpy()[:, None] == k_doc.numpy()[None, :]
    return torch.from_numpy(vis)                                           # [n, m]


def dense_reference(q, k, v, do, q_pos, k_pos, mask, q_doc=None, k_doc=None) -> dict:
    """Dense FP64 attention of one block: out 0 / lse -inf on rows that see nothing, autograd grads."""
    n, b, h, d = q.shape
    g = h // k.shape[2]
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    vis = _visible(q_pos, k_pos, mask, q_doc, k_doc)                        # [n, m]
    kr, vr = (x.repeat_interleave(g, dim=2).permute(1, 2, 0, 3) for x in (k, v))  # [b, h, m, d]
    s = torch.matmul(q.permute(1, 2, 0, 3), kr.transpose(-1, -2)) * SCALE  # [b, h, n, m]
    s = s.masked_fill(~vis, -math.inf)
    empty = ~vis.any(-1)                                                   # [n]
    lse = torch.logsumexp(s, dim=-1).detach()
    p = torch.softmax(s.masked_fill(empty[:, None], 0.0), dim=-1).masked_fill(~vis, 0.0)
    out = torch.matmul(p, vr).permute(2, 0, 1, 3)                          # [n, b, h, d]
    out.backward(do)
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _run(kernel, q, k, v, do, q_pos, k_pos, mask, dtype, **kw):
    args = [x.to(dtype) for x in (q, k, v)]
    out, lse = kernel.forward(*args, q_pos, k_pos, mask, SCALE, **kw)
    grads = kernel.backward(do.to(dtype), *args, out, lse, q_pos, k_pos, mask, SCALE, **kw)
    return dict(zip(QUANT, (out, lse, *grads)))


def _check(got: dict, ref: dict, tol: float) -> None:
    for n in QUANT:
        fin = torch.isfinite(ref[n])
        assert not torch.isnan(got[n]).any(), f"{n}: NaN"
        assert torch.equal(torch.isfinite(got[n]), fin), f"{n}: finite pattern differs (fully masked rows)"
        err = (got[n].double()[fin] - ref[n][fin]).abs().max().item() if fin.any() else 0.0
        assert err <= tol * max(1.0, ref[n][fin].abs().max().item() if fin.any() else 0.0), f"{n}: error {err:.3g}"


def _case(layout: str, seed: int = 0, b: int = 2, h: int = 4, hk: int = 2, d: int = 8):
    """(q, k, v, do, q_pos, k_pos, docs): a query shard and one KV block.

    zigzag-own: a zigzag shard (chunks 0 and 7 of 8 x 6 tokens) against its own late chunk;
    zigzag-remote: the same shard against chunk 3 (a block between its two chunks);
    split-keys: keys that are not one increasing run (two chunks concatenated);
    packed: a packed shard of several documents against its own tokens."""
    g = torch.Generator().manual_seed(seed)
    if layout == "packed":
        docs = (5, 13, 3, 17, 1, 9)
        q_pos = torch.cat([torch.arange(L) for L in docs])
        q_doc = torch.cat([torch.full((L,), i) for i, L in enumerate(docs)])
        k_pos, k_doc = q_pos, q_doc
    else:
        c = 6
        q_pos = torch.cat([torch.arange(0, c), torch.arange(7 * c, 8 * c)])
        k_pos = {"zigzag-own": torch.arange(7 * c, 8 * c), "zigzag-remote": torch.arange(3 * c, 4 * c),
                 "split-keys": torch.cat([torch.arange(2 * c, 3 * c), torch.arange(6 * c, 7 * c)])}[layout]
        q_doc = k_doc = None
        q_pos = torch.cat([q_pos, torch.arange(3 * c + 2, 5 * c)]) if layout == "zigzag-remote" else q_pos
    n, m = q_pos.numel(), k_pos.numel()
    q, do = (torch.randn(n, b, h, d, generator=g, dtype=F64) for _ in range(2))
    k, v = (torch.randn(m, b, hk, d, generator=g, dtype=F64) for _ in range(2))
    docs = {} if q_doc is None else {"q_doc": q_doc, "k_doc": k_doc}
    return q, k, v, do, q_pos, k_pos, docs


LAYOUTS = ["zigzag-own", "zigzag-remote", "split-keys", "packed"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name, mask", MASKS, ids=[m[0] for m in MASKS])
def test_math_kernel_matches_the_dense_reference(name, mask, layout):
    q, k, v, do, qp, kp, docs = _case(layout)
    ref = dense_reference(q, k, v, do, qp, kp, mask, **docs)
    out, lse = block_attention_forward(q, k, v, qp, kp, mask, SCALE, rows_per_tile=4, key_chunk=5, **docs)
    grads = block_attention_backward(do, q, k, v, out, lse, qp, kp, mask, SCALE, rows_per_tile=4, key_chunk=5,
                                     **docs)
    _check(dict(zip(QUANT, (out, lse, *grads))), ref, 1e-12)
    default = _run(MathKernel(), q, k, v, do, qp, kp, mask, F64, **docs)   # default tiles too
    _check(default, ref, 1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name, mask", MASKS, ids=[m[0] for m in MASKS])
def test_cpu_flash_matches_the_dense_reference(name, mask, layout):
    if not CpuFlashKernel.available():
        pytest.skip("torch lacks the fused CPU flash op")
    q, k, v, do, qp, kp, docs = _case(layout)
    ref = dense_reference(q, k, v, do, qp, kp, mask, **docs)
    _check(_run(CpuFlashKernel(), q, k, v, do, qp, kp, mask, torch.float32, **docs), ref, 1e-5)


def test_a_bool_still_means_causal():
    q, k, v, do, qp, kp, _ = _case("zigzag-own")
    for causal in (True, False):
        a = _run(MathKernel(), q, k, v, do, qp, kp, causal, F64)
        b = _run(MathKernel(), q, k, v, do, qp, kp, Mask(causal), F64)
        assert all(torch.equal(a[n], b[n]) for n in QUANT)


def test_a_window_beyond_the_sequence_is_bitwise_causal():
    q, k, v, do, qp, kp, docs = _case("packed")
    a = _run(MathKernel(), q, k, v, do, qp, kp, Mask(True), F64, **docs)
    b = _run(MathKernel(), q, k, v, do, qp, kp, Mask(True, 1000, 0), F64, **docs)
    assert all(torch.equal(a[n], b[n]) for n in QUANT)


def test_tiles_skip_and_clip_what_the_window_masks():
    """Tiles never carry a chunk outside the window, and every visible pair is in some chunk."""
    qp = torch.arange(40, 80)
    kp = torch.arange(0, 80)
    mask = Mask(True, 6, 0)
    covered = np.zeros((40, 80), dtype=bool)
    for a, z, chunks in math_tiles(qp, kp, mask, 8, 16):
        for c0, c1, kind in chunks:
            vis = mask.visible(qp[a:z].numpy()[:, None], kp[c0:c1].numpy()[None, :])
            assert vis.any() and (kind != FULL or vis.all())
            covered[a:z, c0:c1] = True
    assert not (mask.visible(qp.numpy()[:, None], kp.numpy()[None, :]) & ~covered).any()
    assert covered.sum() < 40 * 20                                         # a band, not the causal half


def test_sees_any_is_exact_on_runs():
    rng = random.Random(0)
    for _ in range(300):
        causal = rng.random() < 0.5
        mask = Mask(causal, rng.choice([-1, 0, 1, 3, 9]), 0 if causal else rng.choice([-1, 0, 2, 7]))
        q0, k0, n, m = rng.randrange(40), rng.randrange(40), rng.randrange(1, 12), rng.randrange(1, 12)
        qp, kp = torch.arange(q0, q0 + n), torch.arange(k0, k0 + m)
        assert sees_any(qp, kp, mask) == bool(mask.visible(qp.numpy()[:, None], kp.numpy()[None, :]).any())


# ---------------------------------------------------------------------------------------------
# flash-attn's window arguments
# ---------------------------------------------------------------------------------------------
def flash_attn_visible(t: int, m: int, wl: int, wr: int) -> np.ndarray:
    """flash-attn's own rule (FlashAttention-2's mha_fwd): values >= seqlen_k are unbounded, the
    window is aligned bottom-right: row i sees j iff i + m - t - wl <= j <= i + m - t + wr."""
    wl = -1 if wl >= m else wl
    wr = -1 if wr >= m else wr
    i, j = np.arange(t)[:, None], np.arange(m)[None, :]
    ok = np.ones((t, m), dtype=bool)
    if wl >= 0:
        ok &= j >= i + m - t - wl
    if wr >= 0:
        ok &= j <= i + m - t + wr
    return ok


def test_flash_window_translates_positions_exactly():
    """Where flash_window gives arguments, flash-attn's rule is the mask's, pair for pair."""
    rng = random.Random(1)
    given = 0
    for _ in range(4000):
        causal = rng.random() < 0.5
        mask = Mask(causal, rng.choice([-1, 0, 1, 2, 5, 11]), 0 if causal else rng.choice([-1, 0, 1, 3, 8]))
        if not mask.windowed:
            continue
        q0, k0, t, m = rng.randrange(30), rng.randrange(30), rng.randrange(1, 14), rng.randrange(1, 14)
        w = flash_window(q0, t, k0, m, mask)
        if w is None:
            continue
        given += 1
        want = mask.visible(np.arange(q0, q0 + t)[:, None], np.arange(k0, k0 + m)[None, :])
        assert np.array_equal(flash_attn_visible(t, m, *w), want), (mask, q0, t, k0, m, w)
    assert given > 500


@pytest.mark.parametrize("name, mask", MASKS, ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_band_pieces_cover_every_visible_pair_once(name, mask, layout):
    """Pieces with bands: every row in at most one piece, every band row sees a key of its piece
    (flash-attn gives lse = +inf otherwise), fused pieces hold exactly the visible pairs."""
    _, _, _, _, qp, kp, docs = _case(layout)
    qd, kd = docs.get("q_doc"), docs.get("k_doc")
    vis = _visible(qp, kp, mask, qd, kd).numpy()
    rows = np.zeros(qp.numel(), dtype=int)
    for a, z, kind, k0, k1 in flash_pieces(qp, kp, mask, qd, kd, bands=True):
        rows[a:z] += 1
        if kind == MATH:
            continue
        sub = vis[a:z, k0:k1]
        assert sub.sum() == vis[a:z].sum(), "a fused piece misses visible keys of its rows"
        if kind == FULL:
            assert sub.all()
        if kind == BAND:
            assert sub.any(axis=1).all()
            w = flash_window(int(qp[a]), z - a, int(kp[k0]), k1 - k0, mask)
            assert w is not None and np.array_equal(flash_attn_visible(z - a, k1 - k0, *w), sub)
    assert rows.max() <= 1
    assert (rows[vis.any(axis=1)] == 1).all()


class ExactWindowOps(FusedOps):
    """An exact CPU stand-in for flash-attn's dense op with windows: flash-attn's window rule
    (:func:`flash_attn_visible`), lse = +inf on rows that see nothing (as FlashAttention-2), GQA by
    repeated heads, backward from the given (final) out and lse. FP64 throughout."""

    name, device_type, windows = "exact-window", "cpu", True

    def unavailable(self):
        return None

    def op_dtype(self, dtype):
        return F64 if dtype == F64 else None

    def _vis(self, t, m, causal, window):
        if window is None:
            window = (-1, 0) if causal else (-1, -1)
        return torch.from_numpy(flash_attn_visible(t, m, *window))           # [t, m]

    def _scores(self, q, k, causal, scale, window):
        g = q.shape[2] // k.shape[2]
        kr = k.repeat_interleave(g, dim=2).transpose(1, 2)                     # [b, h, m, d]
        s = torch.matmul(q.transpose(1, 2), kr.transpose(-1, -2)) * scale     # [b, h, t, m]
        vis = self._vis(q.shape[1], k.shape[1], causal, window)
        return s.masked_fill(~vis, -math.inf), vis, g

    def forward(self, q, k, v, causal, scale, window=None):
        s, vis, g = self._scores(q, k, causal, scale, window)
        lse = torch.logsumexp(s, dim=-1)                                       # [b, h, t]
        lse = torch.where(torch.isneginf(lse), math.inf, lse)                  # flash-attn's empty rows
        p = torch.exp(s - lse[..., None])
        o = torch.matmul(p, v.repeat_interleave(g, dim=2).transpose(1, 2)).transpose(1, 2)  # [b, t, h, d]
        return o, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, window=None):
        s, vis, g = self._scores(q, k, causal, scale, window)
        p = torch.exp(s - lse[..., None])                                      # [b, h, t, m]
        do, qh = dout.transpose(1, 2), q.transpose(1, 2)                      # [b, h, t, d]
        vr = v.repeat_interleave(g, dim=2).transpose(1, 2)
        kr = k.repeat_interleave(g, dim=2).transpose(1, 2)
        delta = (dout * out).sum(-1).transpose(1, 2)[..., None]                # [b, h, t, 1]
        ds = p * (torch.matmul(do, vr.transpose(-1, -2)) - delta)
        dq = (torch.matmul(ds, kr) * scale).transpose(1, 2)
        dk = (torch.matmul(ds.transpose(-1, -2), qh) * scale).transpose(1, 2)  # [b, m, h, d]
        dv = torch.matmul(p.transpose(-1, -2), do).transpose(1, 2)
        b, m, h, d = dk.shape
        return dq, dk.unflatten(2, (h // g, g)).sum(3), dv.unflatten(2, (h // g, g)).sum(3)


class ExactWindowKernel(FusedPiecesKernel):
    name = "exact-window"
    _OPS = LoopVarlenOps(ExactWindowOps())

    def ops_for(self, dtype):
        return self._OPS if dtype == F64 else None


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name, mask", MASKS, ids=[m[0] for m in MASKS])
def test_band_path_matches_the_dense_reference(name, mask, layout):
    """The fused kernel with a windowed binding: band pieces through flash-attn's rule, exact up
    to the FP32 LSE every fused op's backward takes (FusedPiecesKernel casts it)."""
    q, k, v, do, qp, kp, docs = _case(layout)
    ref = dense_reference(q, k, v, do, qp, kp, mask, **docs)
    _check(_run(ExactWindowKernel(), q, k, v, do, qp, kp, mask, F64, **docs), ref, 1e-6)
    if mask.windowed and layout != "split-keys":
        kinds = {p[2] for p in flash_pieces(qp, kp, mask, docs.get("q_doc"), docs.get("k_doc"), bands=True)}
        assert MATH not in kinds or layout == "zigzag-remote"


def test_windowed_bindings_pass_flash_attn_keywords():
    """The CUDA bindings' keyword translation, checked on CPU with a recording stand-in module."""
    calls = []

    class FakeFA:
        def _flash_attn_forward(self, q, k, v, **kw):
            calls.append(kw)
            return q, torch.zeros(1), None, None

        def _flash_attn_backward(self, *args, **kw):
            calls.append(kw)

    ops = FlashAttnOps()
    ops._fa = FakeFA()
    x = torch.zeros(1, 2, 1, 8)
    ops.forward(x, x, x, False, 0.5, window=(3, 0))
    ops.backward(x, x, x, x, x, torch.zeros(1, 1, 2), False, 0.5, window=(3, 0))
    ops.forward(x, x, x, True, 0.5)
    assert [(c["window_size_left"], c["window_size_right"], c["causal"]) for c in calls] == [
        (3, 0, False), (3, 0, False), (-1, -1, True)]
    assert FlashAttnOps.windows and not CpuFlashKernel._OPS.windows
    assert TorchCudaFlashOps().windows == ("window_size_left" in str(
        torch.ops.aten._flash_attention_forward.default._schema))


@pytest.mark.parametrize("name, mask", MASKS, ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_emulator_counts_windowed_pairs(name, mask, layout):
    """The emulator's sleep kernel prices a block by the pairs the mask leaves (Mask.visible)."""
    from megatron_fcp.emulate.sleep_kernel import count_pairs

    _, _, _, _, qp, kp, docs = _case(layout)
    want = _visible(qp, kp, mask, docs.get("q_doc"), docs.get("k_doc")).sum(1)
    assert torch.equal(count_pairs(qp, kp, mask, docs.get("q_doc"), docs.get("k_doc")), want)
