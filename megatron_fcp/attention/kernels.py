"""Attention of a query shard against one KV block, returning ``(out, lse)``, and its backward.

Pure torch math, any dtype and device (the exact reference; fused kernels: :mod:`megatron_fcp.attention.fused`).

Shapes (Megatron's ``[s, b, h, d]`` convention):
    q:    [n, b, h, d]        n query tokens, h query heads
    k, v: [m, b, h_kv, d]     m key tokens of one block, h_kv KV heads, h % h_kv == 0 (GQA / MQA);
                              v may have its own head size d_v (MLA: k [m, b, h_kv, d], v [m, b,
                              h_kv, d_v]; scores use d, out and dv have d_v)
    q_pos: int64 [n], k_pos: int64 [m]   global token positions (CPU tensors; used to classify tiles)
    q_doc: int64 [n], k_doc: int64 [m]   optional document ids (packed batches; positions are then
                                         positions inside the document)
    out:  [n, b, h, d_v]      softmax(q k^T * scale + mask) v over this block only
    lse:  [b, h, n]           log-sum-exp of the masked, scaled scores over this block

Precision: the *compute dtype* is float64 for float64 inputs and float32 otherwise (bf16/fp16/fp32
inputs are upcast once per call). ``out`` and ``lse`` (and the backward's ``dq, dk, dv``) are
returned in the compute dtype, never cast back, so partial results can be merged across blocks in
FP32 (see :mod:`megatron_fcp.attention.merge`); the caller casts the final result.

Mask: a :class:`~megatron_fcp.contract.mask.Mask` (``mask``; a bool is ``causal`` through
:func:`~megatron_fcp.contract.mask.as_mask`): causal means key position <= query position,
non-causal sees everything, a sliding window ``(left, right)`` bounds both (Megatron's
convention: query ``q`` sees keys ``q - left .. q + right``); with document ids a query sees only
keys of its own document (positions are then positions inside the document). A query row that
sees no key of the block gets ``out = 0`` and ``lse = -inf`` (never NaN), which the merge treats as
an empty contribution.

Algorithm (flash-attention's, with tiles over query rows so the score tile stays bounded):
    forward:  S = scale * Q K^T (+ mask);  m = rowmax S;  P = softmax(S) (torch's fused op)
              out = P V;  lse = m + log(rowsum exp(S - m)) = m - log(rowmax P)
              (the largest softmax entry is exp(0) / rowsum, so no second pass over S is needed)
    backward (from saved q, k, v, out, lse and the incoming dout, like flash-attn):
              D = rowsum(dout * out);  P = exp(S - lse)
              dV = P^T dO;  dP = dO V^T;  dS = P * (dP - D)
              dQ = scale * dS K;  dK = scale * dS^T Q
GQA without copying K/V: query head ``h`` uses KV head ``h // g`` (g = h / h_kv, the convention
of ``repeat_interleave`` and flash-attn), so the g query heads of a KV head are stacked as extra
rows: Q becomes [b, h_kv, g*T, d] and one matmul against [b, h_kv, d, m] serves the whole group;
dK/dV come out summed over the group by the same matmul.

Tiles (:mod:`megatron_fcp.attention.tiles`): query rows are cut into tiles that never cross a jump
in positions or a document (the two zigzag chunks of a shard are separate runs), and a block's
keys into chunks of at most ``_KEY_CHUNK`` that never cross a document; pairs of two documents are
skipped; inside
a query tile the chunks are folded with the same online log-sum-exp merge as blocks are. Each
(tile, chunk) pair is classed by :meth:`Mask.classify`: *fully masked* pairs (the chunk after
every query, or before every window) are skipped (rows that see no chunk stay 0 / -inf), *fully
visible* pairs run without a mask, and only *partial* pairs (the diagonal, a window's edges)
build the mask from positions (:meth:`Mask.visible`), their chunk first clipped to
:meth:`Mask.key_range` of the tile.

Block kernels as strategies: the functions above are the ``"math"`` kernel (:class:`MathKernel`),
the exact reference. Kernels on fused ops (``cpu-flash``, ``cuda-flash``, ``flash-attn``) live in
:mod:`megatron_fcp.attention.fused`; :mod:`megatron_fcp.attention.dispatch` holds the registry
(``BLOCK_KERNELS``) and ``auto``'s choice per device and dtype. All honour the same contract
(shapes, FP32 ``out``/``lse``, masks from positions and document ids, fully masked rows 0 / -inf,
GQA).
"""

from __future__ import annotations

import math

import torch

from megatron_fcp.attention.merge import merge_coefficients
from megatron_fcp.attention.tiles import PARTIAL, math_tiles
from megatron_fcp.contract.mask import Mask, as_mask

__all__ = [
    "compute_dtype_for",
    "block_attention_forward",
    "block_attention_backward",
    "attention_delta",
    "prepare_query",
    "reference_attention",
    "BlockKernel",
    "MathKernel",
]

# Target elements of one score tile [b, h, T, m] (2^21 FP32 elements = 8 MiB), and a floor on its
# rows: measured on CPU (one thread, d=64, 8 heads), tiles of 64-256 query rows against 1-2K keys
# run the matmuls fastest; much larger tiles fall out of cache, much thinner ones starve the GEMM.
_TILE_ELEMS = 1 << 21
_MIN_TILE_ROWS = 64
# Keys per chunk inside one block: longer blocks are processed chunk by chunk with an online
# softmax inside each query tile (flash-attention's KV loop), so a 4K-token block runs as fast
# per key as a 1K one and causal skipping works at chunk granularity.
_KEY_CHUNK = 1024

def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                  k_pos: torch.Tensor, q_doc: torch.Tensor | None = None,
                  k_doc: torch.Tensor | None = None) -> tuple[int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"expected q [n,b,h,d], k [m,b,h_kv,d] and v [m,b,h_kv,d_v] (d_v may differ: MLA); "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    n, b, h, d = q.shape
    _, bk, hk, dk = k.shape
    if bk != b or dk != d or h % hk != 0:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} disagree on batch or head dim, "
                         f"or h={h} is not a multiple of h_kv={hk}")
    if q_pos.shape != (n,) or k_pos.shape != (k.shape[0],):
        raise ValueError(f"positions must be 1-D with one entry per token: q_pos {tuple(q_pos.shape)} for {n} "
                         f"queries, k_pos {tuple(k_pos.shape)} for {k.shape[0]} keys")
    if (q_doc is None) != (k_doc is None):
        raise ValueError("document ids: pass both q_doc and k_doc, or neither")
    if q_doc is not None and (q_doc.shape != (n,) or k_doc.shape != (k.shape[0],)):
        raise ValueError(f"document ids must be 1-D with one entry per token: q_doc {tuple(q_doc.shape)} for "
                         f"{n} queries, k_doc {tuple(k_doc.shape)} for {k.shape[0]} keys")
    return n, b, h, hk, d


def _rows_per_tile(b: int, h: int, m: int) -> int:
    return max(_MIN_TILE_ROWS, _TILE_ELEMS // max(1, b * h * min(m, _KEY_CHUNK)))


def _q_tile(qh: torch.Tensor, a: int, z: int) -> torch.Tensor:
    """qh: [b, hk, g, n, d] -> rows a:z as [b, hk, g*T, d] (row = gi*T + t)."""
    b, hk, g, _, d = qh.shape
    return qh[:, :, :, a:z].reshape(b, hk, g * (z - a), d)


def prepare_query(q: torch.Tensor, h_kv: int, scale: float = 1.0) -> torch.Tensor:
    """q [n, b, h, d] -> ``scale * q`` as [b, h_kv, g, n, d] in the compute dtype (a new tensor).

    The kernels' internal query layout; pass it as ``q_layout=`` (forward: with the softmax
    scale; backward: unscaled, and ``dout`` likewise as ``dout_layout=``) to reuse it across the
    blocks of one shard instead of re-laying out the query for every block.
    """
    n, b, h, d = q.shape
    x = q.to(compute_dtype_for(q.dtype))
    if scale != 1.0:
        x = x * scale
    return x.permute(1, 2, 0, 3).reshape(b, h_kv, h // h_kv, n, d)


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, g: int, device, mask: Mask) -> torch.Tensor:
    """Visibility [g*T, m] (True = key visible) for a tile, repeated over the g stacked heads
    (positions are CPU tensors: :meth:`Mask.visible` on them, then one copy to ``device``)."""
    vis = torch.from_numpy(mask.visible(q_pos.numpy()[:, None], k_pos.numpy()[None, :]))  # [T, m]
    return vis.to(device).repeat(g, 1)


def block_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_pos: torch.Tensor, k_pos: torch.Tensor, mask: "Mask | bool", scale: float,
    rows_per_tile: int | None = None, q_layout: torch.Tensor | None = None,
    key_chunk: int | None = None, q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` against one KV block; returns ``(out [n,b,h,d_v], lse [b,h,n])`` in the
    compute dtype (see module docstring for shapes, mask and precision). ``rows_per_tile`` and
    ``key_chunk`` override the automatic tile height and key chunk length (tests use tiny ones);
    ``q_layout`` is an optional ``prepare_query(q, h_kv, scale)`` reused across blocks.
    ``q_doc`` / ``k_doc`` (int64 [n] / [m], CPU): document ids; a query sees only keys of its own
    document (then positions are positions inside the document). ``mask``: a
    :class:`~megatron_fcp.contract.mask.Mask` or a bool (``causal``)."""
    n, b, h, hk, d = _check_shapes(q, k, v, q_pos, k_pos, q_doc, k_doc)
    m, g = k.shape[0], h // hk
    mask = as_mask(mask)
    cd = compute_dtype_for(q.dtype)
    qh = q_layout if q_layout is not None else prepare_query(q, hk, scale)  # [b, hk, g, n, d]
    kh = k.to(cd).permute(1, 2, 0, 3).contiguous()                        # [b, hk, m, d]
    vh = v.to(cd).permute(1, 2, 0, 3).contiguous()                        # [b, hk, m, dv]
    dv_ = v.shape[3]
    out = torch.zeros(b, hk, g, n, dv_, dtype=cd, device=q.device)
    lse = torch.full((b, hk, g, n), -math.inf, dtype=cd, device=q.device)
    tiles = math_tiles(q_pos, k_pos, mask, rows_per_tile or _rows_per_tile(b, h, m), key_chunk or _KEY_CHUNK,
                   q_doc, k_doc)
    for a, z, chunks in tiles:
        t = z - a
        qt = _q_tile(qh, a, z)                                             # [b, hk, g*t, d]
        o_t = l_t = None
        for c0, c1, kind in chunks:
            s = torch.matmul(qt, kh[:, :, c0:c1].transpose(-1, -2))       # [b, hk, g*t, c]
            if kind == PARTIAL:
                s.masked_fill_(~_mask(q_pos[a:z], k_pos[c0:c1], g, q.device, mask), -math.inf)
            mx = s.amax(dim=-1, keepdim=True)                              # [b, hk, g*t, 1]
            p = torch.softmax(s, dim=-1)                                   # fused max/exp/sum/scale
            del s
            if kind == PARTIAL:
                empty = torch.isneginf(mx)                                 # rows seeing no key
                p.masked_fill_(empty, 0.0)                                 # softmax gave NaN there
            # softmax's largest entry is exp(0) / l, so lse = max + log l = max - log(max P)
            l_c = mx - torch.log(p.amax(dim=-1, keepdim=True))
            if kind == PARTIAL:
                l_c.masked_fill_(empty, -math.inf)
            o_c = torch.matmul(p, vh[:, :, c0:c1])                         # [b, hk, g*t, dv]
            if o_t is None:
                o_t, l_t = o_c, l_c
            else:                                                          # online softmax
                l_t, ca, cb = merge_coefficients(l_t, l_c)
                o_t.mul_(ca).addcmul_(o_c, cb)
        out[:, :, :, a:z] = o_t.view(b, hk, g, t, dv_)
        lse[:, :, :, a:z] = l_t.view(b, hk, g, t)
    return out.view(b, h, n, dv_).permute(2, 0, 1, 3), lse.view(b, h, n)


def attention_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dout * out): [n,b,h,d_v] x2 -> [b,h,n] in the compute dtype."""
    cd = torch.promote_types(compute_dtype_for(dout.dtype), compute_dtype_for(out.dtype))
    return (dout.to(cd) * out.to(cd)).sum(dim=-1).permute(1, 2, 0)


def block_attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor,
    q_pos: torch.Tensor, k_pos: torch.Tensor, mask: "Mask | bool", scale: float,
    delta: torch.Tensor | None = None, rows_per_tile: int | None = None,
    q_layout: torch.Tensor | None = None, dout_layout: torch.Tensor | None = None,
    key_chunk: int | None = None, q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of the gradients, given the *final* (all-block) ``out`` and ``lse``.

    dout, out: [n,b,h,d_v]; lse: [b,h,n]; delta (optional, precomputed :func:`attention_delta`): [b,h,n].
    Returns ``dq [n,b,h,d]`` (this block's contribution; sum over blocks gives dQ) and
    ``dk [m,b,h_kv,d]``, ``dv [m,b,h_kv,d_v]`` for this block, all in the compute dtype. ``q_layout`` /
    ``dout_layout``: optional unscaled ``prepare_query(q, h_kv)`` / ``prepare_query(dout, h_kv)``.
    ``q_doc`` / ``k_doc`` and ``mask``: as in :func:`block_attention_forward`.
    """
    n, b, h, hk, d = _check_shapes(q, k, v, q_pos, k_pos, q_doc, k_doc)
    m, g = k.shape[0], h // hk
    mask = as_mask(mask)
    cd = compute_dtype_for(q.dtype)
    if delta is None:
        delta = attention_delta(dout, out)
    qh = q_layout if q_layout is not None else prepare_query(q, hk)            # [b, hk, g, n, d]
    doh = dout_layout if dout_layout is not None else prepare_query(dout, hk)  # [b, hk, g, n, dv]
    lse_h = lse.to(cd).reshape(b, hk, g, n)
    lse_h = torch.where(torch.isinf(lse_h), torch.zeros_like(lse_h), lse_h)  # empty rows -> P = 0
    dl_h = delta.to(cd).reshape(b, hk, g, n)
    kh = k.to(cd).permute(1, 2, 0, 3).contiguous()                        # [b, hk, m, d]
    vh = v.to(cd).permute(1, 2, 0, 3).contiguous()                        # [b, hk, m, dv]
    dq = torch.zeros(b, hk, g, n, d, dtype=cd, device=q.device)
    dk = torch.zeros(b, hk, m, d, dtype=cd, device=q.device)
    dv = torch.zeros(b, hk, m, v.shape[3], dtype=cd, device=q.device)
    tiles = math_tiles(q_pos, k_pos, mask, rows_per_tile or _rows_per_tile(b, h, m), key_chunk or _KEY_CHUNK,
                   q_doc, k_doc)
    for a, z, chunks in tiles:
        t = z - a
        qt = _q_tile(qh, a, z)                                             # [b, hk, g*t, d]
        dot = _q_tile(doh, a, z)                                           # [b, hk, g*t, dv]
        lse_t = lse_h[:, :, :, a:z].reshape(b, hk, g * t, 1)
        dl_t = dl_h[:, :, :, a:z].reshape(b, hk, g * t, 1)
        dq_t = torch.zeros_like(qt)                                        # [b, hk, g*t, d]
        for c0, c1, kind in chunks:
            kc, vc = kh[:, :, c0:c1], vh[:, :, c0:c1]                      # [b, hk, c, d | dv]
            s = torch.matmul(qt, kc.transpose(-1, -2)).mul_(scale)         # [b, hk, g*t, c]
            if kind == PARTIAL:
                s.masked_fill_(~_mask(q_pos[a:z], k_pos[c0:c1], g, q.device, mask), -math.inf)
            p = s.sub_(lse_t).exp_()                                       # P = exp(S - lse)
            dv[:, :, c0:c1].add_(torch.matmul(p.transpose(-1, -2), dot))   # [b, hk, c, dv]
            dp = torch.matmul(dot, vc.transpose(-1, -2))                   # [b, hk, g*t, c]
            ds = dp.sub_(dl_t).mul_(p)                                     # dS = P * (dP - D)
            dq_t.add_(torch.matmul(ds, kc))
            dk[:, :, c0:c1].add_(torch.matmul(ds.transpose(-1, -2), qt), alpha=scale)
        dq[:, :, :, a:z] = dq_t.mul_(scale).view(b, hk, g, t, d)
    return (dq.view(b, h, n, d).permute(2, 0, 1, 3),
            dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3))


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
    dout: torch.Tensor | None = None, rows_per_tile: int = 1024, window: "tuple[int, int] | None" = None,
) -> dict[str, torch.Tensor]:
    """Plain single-device attention with torch autograd, in the inputs' own dtype (no upcast).

    Used as the FP64 reference (pass float64 tensors) and as "plain PyTorch attention in BF16"
    (pass bf16 tensors) for the flash-attn tolerance rule. q: [s,b,h,d], k: [s,b,h_kv,d], v:
    [s,b,h_kv,d_v] over the *global* sequence (positions 0..s-1). Independent of the kernels above: GQA by
    ``repeat_interleave``, ``torch.softmax`` / ``torch.logsumexp``, the dense visibility matrix of
    :meth:`Mask.visible` (``causal`` and ``window``, Megatron's ``(left, right)``). Query rows are
    processed in tiles (each row's output depends only on its own query, so per-tile autograd is
    exact and memory stays bounded); with ``causal`` a tile only looks at keys up to its last
    query. Returns ``out [s,b,h,d_v]``, ``lse [b,h,s]`` and, if ``dout`` is given, ``dq, dk, dv``.
    """
    s, b, h, d = q.shape
    g = h // k.shape[2]
    mask = Mask.of(causal, window)
    kf = k.detach().requires_grad_(dout is not None)
    vf = v.detach().requires_grad_(dout is not None)
    outs, lses, dqs = [], [], []
    for a in range(0, s, rows_per_tile):
        z = min(a + rows_per_tile, s)
        qt = q[a:z].detach().requires_grad_(dout is not None)
        sk = min(z, kf.shape[0]) if causal else kf.shape[0]                # later keys are masked
        kr = kf[:sk].repeat_interleave(g, dim=2).permute(1, 2, 0, 3)       # [b, h, sk, d]
        vr = vf[:sk].repeat_interleave(g, dim=2).permute(1, 2, 0, 3)       # [b, h, sk, d_v]
        sc = torch.matmul(qt.permute(1, 2, 0, 3), kr.transpose(-1, -2)) * scale  # [b, h, t, sk]
        if causal or mask.windowed:
            vis = torch.from_numpy(mask.visible(torch.arange(a, z).numpy()[:, None],
                                                torch.arange(sk).numpy()[None, :])).to(q.device)  # [t, sk]
            sc = sc.masked_fill(~vis, -math.inf)
        o = torch.matmul(torch.softmax(sc, dim=-1), vr).permute(2, 0, 1, 3)  # [t, b, h, d_v]
        lses.append(torch.logsumexp(sc, dim=-1).detach())
        if dout is not None:
            o.backward(dout[a:z])
            dqs.append(qt.grad)
        outs.append(o.detach())
    res = {"out": torch.cat(outs), "lse": torch.cat(lses, dim=-1)}
    if dout is not None:
        res.update(dq=torch.cat(dqs), dk=kf.grad, dv=vf.grad)
    return res


# ---------------------------------------------------------------------------------------------
# block kernels as strategy objects
# ---------------------------------------------------------------------------------------------
class BlockKernel:
    """One way to compute attention of a query shard against one KV block, and its backward.

    Contract (every kernel): ``forward(q, k, v, q_pos, k_pos, mask, scale, **prep)`` returns
    ``(out [n,b,h,d_v], lse [b,h,n])`` in the compute dtype (:func:`compute_dtype_for`); ``mask`` is
    a :class:`~megatron_fcp.contract.mask.Mask` (causal, full or a sliding window; the executor
    always passes one, a bool still means ``causal`` through ``as_mask``); rows that see
    no key of the block give out 0 and lse -inf (v's head size ``d_v`` may differ from q's and k's
    ``d``: MLA). ``backward(dout, q, k, v, out, lse, q_pos, k_pos,
    mask, scale, **prep)`` returns this block's ``dq [n,b,h,d]``, ``dk [m,b,h_kv,d]``, ``dv [m,b,h_kv,d_v]`` in the
    compute dtype, given the *final* (all-block) FP32 ``out`` and ``lse``. ``prepare_forward`` /
    ``prepare_backward`` build per-shard keyword arguments reused across the blocks of one shard.
    ``check(dtype, device)`` raises ValueError naming the fix when the kernel cannot run them.
    Document masks (packed batches): a kernel with ``documents = True`` also takes ``q_doc=``,
    ``k_doc=`` (int64 ``[n]`` / ``[m]`` CPU tensors) and lets a query see only keys of its own
    document; without them (the zigzag path) it is never passed them.
    A kernel whose device is not the tensors' (the emulator's) names its clock as ``clock``
    (:func:`~megatron_fcp.attention.device_clock.clock_for`).
    """

    name = ""
    documents = False

    def check(self, dtype: torch.dtype, device: torch.device) -> None:
        raise NotImplementedError

    def prepare_forward(self, q: torch.Tensor, h_kv: int, scale: float) -> dict:
        return {}

    def prepare_backward(self, q: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, h_kv: int) -> dict:
        return {}

    def forward(self, q, k, v, q_pos, k_pos, mask: "Mask | bool", scale: float, **prep):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, q_pos, k_pos, mask: "Mask | bool", scale: float, **prep):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class MathKernel(BlockKernel):
    """The default: :func:`block_attention_forward` / :func:`block_attention_backward` (pure torch
    math, any float dtype and device, FP64 computed in FP64). The query (and in backward the
    incoming gradient and ``D = rowsum(dout*out)``) is laid out once per shard."""

    name = "math"
    documents = True

    def check(self, dtype: torch.dtype, device: torch.device) -> None:
        return None

    def prepare_forward(self, q, h_kv, scale):
        return {"q_layout": prepare_query(q, h_kv, scale)}                # [b, h_kv, g, n, d]

    def prepare_backward(self, q, dout, out, h_kv):
        return {"delta": attention_delta(dout, out),                       # [b, h, n]
                "q_layout": prepare_query(q, h_kv), "dout_layout": prepare_query(dout, h_kv)}

    def forward(self, q, k, v, q_pos, k_pos, mask, scale, **prep):
        return block_attention_forward(q, k, v, q_pos, k_pos, mask, scale, **prep)

    def backward(self, dout, q, k, v, out, lse, q_pos, k_pos, mask, scale, **prep):
        return block_attention_backward(dout, q, k, v, out, lse, q_pos, k_pos, mask, scale, **prep)
