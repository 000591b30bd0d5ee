"""Block kernels on fused attention ops: one implementation, a binding per library.

:class:`FusedPiecesKernel` honours the :class:`~megatron_fcp.attention.kernels.BlockKernel`
contract (``(out, lse)`` in FP32, masks from positions and document ids, rows that see nothing
0 / -inf, GQA, backward from the *final* out and lse) on top of any
:class:`~megatron_fcp.attention.fused_ops.FusedOps` binding:

1. :func:`~megatron_fcp.attention.tiles.flash_pieces` cuts the (query shard, KV block) pair into
   pieces a fused op can express under the call's :class:`~megatron_fcp.contract.mask.Mask`:
   ``full`` (no mask), ``causal`` (square: a query run against its own positions), ``band`` (a
   sliding window's edge rows, on bindings with ``windows = True``: flash-attn's
   ``window_size_left/right`` from :func:`~megatron_fcp.attention.tiles.flash_window`, one dense
   call per piece) and ``math`` (anything else, e.g. a query run starting inside the block, or a
   window's edge rows on a binding without window arguments: run by the math kernel on those
   rows, bounded tiles, never an ``s x s`` matrix; logged once per kernel on CUDA because it is
   slow there); fully masked rows are skipped.
2. Pieces of one kind run in **one varlen call** when the binding has a varlen form and the batch
   is 1 (THD: one piece per document of a packed shard), each piece a segment (``cu_seqlens``),
   otherwise one dense call each.
3. Inputs are cast once per shard to the op's dtype (:meth:`FusedOps.op_dtype`: FP32 on CPU, the
   input's half type for FlashAttention, FP32 for the memory-efficient kernel); results are
   written into FP32 buffers, so blocks merge in FP32 whatever the op ran in.
4. Different head sizes for K and V (MLA, ``d_v != d_qk``): torch's fused CPU op, torch's
   FlashAttention-2 and the flash-attn package all require one head size for Q, K and V, so the
   kernel pads with zero channels to ``D = max(d_qk, d_v)`` around the op, as megatron-core pads V
   for THD: V (and in backward ``dout`` and ``out``) when ``d_v < d_qk``, Q and K when ``d_v >
   d_qk``. Exact: a zero channel adds nothing to ``q.k``, the padded output channels are
   ``P @ 0 = 0`` and sliced off, as are the gradients of the padding; ``D = rowsum(dout * out)``
   is unchanged (zeros times zeros). The scale is passed explicitly (``1/sqrt(d_qk)``), never
   derived from ``D``. Only the op's inputs are padded (per block, in the op's dtype); KV blocks
   travel unpadded (Note [KV block tensors] in :mod:`megatron_fcp.attention.kv_block`), and
   pieces delegated to the math kernel run at the true sizes.

5. One call on several blocks (the executor joins the blocks of one owner and stage: Note [One
   launch per owner and stage] in :mod:`megatron_fcp.schedule.launches`): keys that are one
   increasing run per document (sub-blocks of one chunk, a packed rank's adjacent spans) run as
   one block. The fused ops mask by index (top-left causal, flash-attn's window), so keys whose
   positions jump inside a document (a zigzag owner's two chunks) are cut at the jumps
   (:meth:`FusedPiecesKernel._key_runs`) and each run goes through 1.-3., merged in FP32 inside
   the call (backward: dq summed, dK/dV joined), exact as the blocks were one by one; under a
   mask that ignores positions (no causal, no window) nothing is cut. The op calls of one such
   kernel call are one per run and piece, as before per block; flash-attn's varlen form could
   take the runs as segments of one launch (the query repeated per run): not done.
6. A call's rows and keys are taken in (document, position) order (:func:`position_order`):
   when either is out of that order (a head-parallel member's tokens after the all-to-all are its
   group's zigzag chunks rank by rank: at ``a = cp`` 2 cp chunks of one sequence), the kernel
   gathers them sorted, runs, and scatters the outputs and gradients back. Rows are independent
   and the keys' runs are only fewer, so nothing but the op calls changes: at ``a = cp`` one causal
   call over the whole sequence instead of 2 cp x 2 cp pieces, as Transformer Engine's Ulysses
   runs it. The cost model prices calls so (:func:`~megatron_fcp.cost.model.key_runs`).

Kernels: :class:`CpuFlashKernel` (``cpu-flash``), :class:`CudaFlashKernel` (``cuda-flash``:
torch's FlashAttention-2 for FP16/BF16, its memory-efficient kernel for FP32) and
:class:`FlashAttnKernel` (``flash-attn``, the package).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from megatron_fcp.attention.fused_ops import (
    CpuFlashOps,
    FlashAttnOps,
    FusedOps,
    TorchCudaEfficientOps,
    TorchCudaFlashOps,
)
from megatron_fcp.attention.kernels import (
    BlockKernel,
    _check_shapes,
    block_attention_backward,
    block_attention_forward,
    compute_dtype_for,
)
from megatron_fcp.attention.merge import LseAccumulator
from megatron_fcp.attention.tiles import BAND, CAUSAL, MATH, flash_pieces, flash_window
from megatron_fcp.contract.mask import as_mask

__all__ = ["FusedPiecesKernel", "CpuFlashKernel", "CudaFlashKernel", "FlashAttnKernel"]

log = logging.getLogger(__name__)


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] -> [b, s, h, d] view (the ops take strided inputs with a contiguous last dim)."""
    return x.permute(1, 0, 2, 3)


def _docs(q_doc, k_doc, a: int, z: int) -> dict:
    """Document-id keyword arguments for query rows a:z (none without document ids)."""
    return {} if q_doc is None else {"q_doc": q_doc[a:z], "k_doc": k_doc}


def _cat_ranges(x: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Rows of ``x`` ([s, ...]) over ``ranges`` in order: a view when they are consecutive."""
    if all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)):
        return x[ranges[0][0]:ranges[-1][1]]
    return torch.cat([x[a:z] for a, z in ranges])


def _gaps(ranges: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The parts of ``[0, n)`` no range covers (ranges are disjoint)."""
    out, pos = [], 0
    for a, z in sorted(ranges):
        if a > pos:
            out.append((pos, a))
        pos = max(pos, z)
    if pos < n:
        out.append((pos, n))
    return out


def _window(kind: str, q_pos, k_pos, piece, mask) -> dict:
    """The op's ``window=`` keyword for a ``band`` piece (flash-attn's convention:
    :func:`~megatron_fcp.attention.tiles.flash_window`), none for other kinds."""
    if kind != BAND:
        return {}
    a, z, _, k0, k1 = piece
    return {"window": flash_window(int(q_pos[a]), z - a, int(k_pos[k0]), k1 - k0, mask)}
def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., d] -> [..., width] with zero channels after the d real ones (x itself if d == width)."""
    if x.shape[-1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _cu(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


class FusedPiecesKernel(BlockKernel):
    """A block kernel on a fused op binding (module docstring for the algorithm)."""

    documents = True

    def ops_for(self, dtype: torch.dtype) -> FusedOps | None:
        """The binding that runs inputs of ``dtype`` (None: this kernel cannot)."""
        raise NotImplementedError

    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64) if self.ops_for(d))

    def check(self, dtype: torch.dtype, device: torch.device) -> None:
        ops = self.ops_for(dtype)
        if ops is None:
            raise ValueError(f"kernel {self.name!r} runs {' / '.join(str(d)[6:] for d in self.dtypes())} only, got {dtype}; "
                             f"use kernel='math' (FP64 is computed in FP64 there) or 'auto'")
        device = torch.device(device)
        if device.type != ops.device_type:
            raise ValueError(f"kernel {self.name!r} runs {ops.device_type.upper()} tensors only, got device {device}; "
                             f"use kernel='auto' or 'math'")
        reason = ops.unavailable()
        if reason is not None:
            raise ValueError(f"kernel {self.name!r} cannot run: {reason}; use kernel='auto' or 'math'")

    def check_head_dim(self, dtype: torch.dtype, d: int) -> None:
        ops = self.ops_for(dtype)
        reason = ops.check_head_dim(d) if ops is not None else None
        if reason is not None:
            raise ValueError(f"kernel {self.name!r} cannot run {reason}; use kernel='math'")

    # -- per shard --------------------------------------------------------------------------
    def _od(self, dtype: torch.dtype) -> torch.dtype:
        return self.ops_for(dtype).op_dtype(dtype)

    def prepare_forward(self, q, h_kv, scale):
        return {"q_c": q.to(self._od(q.dtype))}                                 # [n, b, h, d] op dtype

    def prepare_backward(self, q, dout, out, h_kv):
        od = self._od(q.dtype)
        w = max(q.shape[-1], dout.shape[-1])                                     # one head size (item 4)
        return {"q_c": _pad_to(q.to(od), w), "dout_c": _pad_to(dout.to(od), w),  # [n, b, h, w] x3
                "out_c": _pad_to(out.to(od), w)}

    # -- one call on several blocks (item 5) -------------------------------------------------
    @staticmethod
    def _key_runs(k_pos, k_doc, mask) -> list[tuple[int, int]] | None:
        """Key ranges of a call that :func:`~megatron_fcp.attention.tiles.flash_pieces` can each
        express: cut wherever a document's positions do not step by one (blocks of one owner
        joined in one call: a zigzag owner's two chunks). None: one range does (no cut, or a mask
        that does not look at positions)."""
        if not (mask.causal or mask.windowed) or k_pos.numel() < 2:
            return None
        p = k_pos.numpy()
        cut = p[1:] != p[:-1] + 1
        if k_doc is not None:
            kd = k_doc.numpy()
            cut &= kd[1:] == kd[:-1]                      # a new document starts a new segment anyway
        at = (cut.nonzero()[0] + 1).tolist()
        if not at:
            return None
        bounds = [0, *at, int(p.size)]
        return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]

    def forward(self, q, k, v, q_pos, k_pos, mask, scale, q_c=None, q_doc=None, k_doc=None):
        qo, ko = position_order(q_pos, q_doc), position_order(k_pos, k_doc)
        if qo is not None or ko is not None:  # item 6: sorted in, outputs back in the caller's row order
            q, q_pos, q_c, q_doc = _take(qo, q, q_pos, q_c, q_doc)
            k, v, k_pos, k_doc = _take(ko, k, v, k_pos, k_doc)
            out, lse = self.forward(q, k, v, q_pos, k_pos, mask, scale, q_c, q_doc, k_doc)
            return _untake(qo, out, 0), _untake(qo, lse, 2)
        runs = self._key_runs(k_pos, k_doc, as_mask(mask))
        if runs is None:
            return self._forward_run(q, k, v, q_pos, k_pos, mask, scale, q_c, q_doc, k_doc)
        acc = LseAccumulator()                                                   # FP32 merge of the runs
        for c0, c1 in runs:
            acc.add(*self._forward_run(q, k[c0:c1], v[c0:c1], q_pos, k_pos[c0:c1], mask, scale, q_c, q_doc,
                                       None if k_doc is None else k_doc[c0:c1]))
        return acc.result()

    def backward(self, dout, q, k, v, out, lse, q_pos, k_pos, mask, scale, q_c=None, dout_c=None, out_c=None,
                 q_doc=None, k_doc=None):
        qo, ko = position_order(q_pos, q_doc), position_order(k_pos, k_doc)
        if qo is not None or ko is not None:  # item 6
            dout, q, q_pos, q_c, dout_c, out_c, q_doc = _take(qo, dout, q, q_pos, q_c, dout_c, out_c, q_doc)
            out = _take(qo, out)[0]
            lse = lse if qo is None else lse[:, :, qo.to(lse.device)]
            k, v, k_pos, k_doc = _take(ko, k, v, k_pos, k_doc)
            dq, dk, dv = self.backward(dout, q, k, v, out, lse, q_pos, k_pos, mask, scale, q_c, dout_c, out_c,
                                       q_doc, k_doc)
            return _untake(qo, dq, 0), _untake(ko, dk, 0), _untake(ko, dv, 0)
        runs = self._key_runs(k_pos, k_doc, as_mask(mask))
        if runs is None:
            return self._backward_run(dout, q, k, v, out, lse, q_pos, k_pos, mask, scale, q_c, dout_c, out_c,
                                      q_doc, k_doc)
        dq, dks, dvs = None, [], []
        for c0, c1 in runs:                                                      # from the final out, lse: exact
            g = self._backward_run(dout, q, k[c0:c1], v[c0:c1], out, lse, q_pos, k_pos[c0:c1], mask, scale, q_c,
                                   dout_c, out_c, q_doc, None if k_doc is None else k_doc[c0:c1])
            dq = g[0] if dq is None else dq.add_(g[0])
            dks.append(g[1])
            dvs.append(g[2])
        return dq, torch.cat(dks), torch.cat(dvs)

    # -- forward ----------------------------------------------------------------------------
    def _forward_run(self, q, k, v, q_pos, k_pos, mask, scale, q_c=None, q_doc=None, k_doc=None):
        n, b, h, hk, d = _check_shapes(q, k, v, q_pos, k_pos, q_doc, k_doc)
        mask = as_mask(mask)
        cd = compute_dtype_for(q.dtype)
        ops = self.ops_for(q.dtype)
        od = ops.op_dtype(q.dtype)
        d_v = v.shape[3]
        w = max(d, d_v)                                                          # the op's head size (item 4)
        qc = _pad_to(q.to(od) if q_c is None else q_c, w)                        # [n, b, h, w]
        kc, vc = _pad_to(k.to(od), w), _pad_to(v.to(od), w)                      # [m, b, hk, w]
        pieces = flash_pieces(q_pos, k_pos, mask, q_doc, k_doc, bands=ops.windows)
        out = torch.empty(n, b, h, d_v, dtype=cd, device=q.device)               # every row written once:
        lse = torch.empty((b, h, n), dtype=cd, device=q.device)                  # by a piece, or as empty
        for a, z in _gaps([(p[0], p[1]) for p in pieces], n):                     # rows that see no key
            out[a:z] = 0.0
            lse[:, :, a:z] = -math.inf
        groups = self._groups(pieces, ops, b)
        for kind, pieces in groups:
            if kind == MATH:
                for a, z, _, _, _ in pieces:
                    self._note_math(q.device)
                    o_p, l_p = block_attention_forward(q[a:z], k, v, q_pos[a:z], k_pos, mask, scale,
                                                       **_docs(q_doc, k_doc, a, z))
                    out[a:z], lse[:, :, a:z] = o_p, l_p
            elif len(pieces) == 1:
                a, z, _, k0, k1 = pieces[0]
                o_p, l_p = ops.forward(_bshd(qc[a:z]), _bshd(kc[k0:k1]), _bshd(vc[k0:k1]), kind == CAUSAL, scale,
                                       **_window(kind, q_pos, k_pos, pieces[0], mask))
                out[a:z] = _bshd(o_p)[..., :d_v]                                 # [t, b, h, d_v]
                lse[:, :, a:z] = l_p                                             # [b, h, t]
            else:                                                                # varlen, b == 1
                q_r = [(a, z) for a, z, _, _, _ in pieces]
                k_r = [(k0, k1) for _, _, _, k0, k1 in pieces]
                cu_q, cu_k = _cu([z - a for a, z in q_r], q.device), _cu([k1 - k0 for k0, k1 in k_r], q.device)
                o_v, l_v = ops.forward_varlen(_cat_ranges(qc[:, 0], q_r), _cat_ranges(kc[:, 0], k_r),
                                              _cat_ranges(vc[:, 0], k_r), cu_q, cu_k,
                                              max(z - a for a, z in q_r), max(k1 - k0 for k0, k1 in k_r),
                                              kind == CAUSAL, scale)             # [T, h, w], [h, T]
                pos = 0
                for a, z in q_r:
                    out[a:z, 0] = o_v[pos:pos + z - a, :, :d_v]
                    lse[0, :, a:z] = l_v[:, pos:pos + z - a]
                    pos += z - a
        return out, lse

    # -- backward ---------------------------------------------------------------------------
    def _backward_run(self, dout, q, k, v, out, lse, q_pos, k_pos, mask, scale, q_c=None, dout_c=None, out_c=None,
                      q_doc=None, k_doc=None):
        n, b, h, hk, d = _check_shapes(q, k, v, q_pos, k_pos, q_doc, k_doc)
        mask = as_mask(mask)
        m, d_v = k.shape[0], v.shape[3]
        w = max(d, d_v)                                                          # the op's head size (item 4)
        cd = compute_dtype_for(q.dtype)
        ops = self.ops_for(q.dtype)
        od = ops.op_dtype(q.dtype)
        qc = _pad_to(q.to(od) if q_c is None else q_c, w)                        # [n, b, h, w]
        doc = _pad_to(dout.to(od) if dout_c is None else dout_c, w)              # [n, b, h, w]
        ouc = _pad_to(out.to(od) if out_c is None else out_c, w)                 # [n, b, h, w]
        kc, vc = _pad_to(k.to(od), w), _pad_to(v.to(od), w)                      # [m, b, hk, w]
        lse = lse.to(torch.float32)                                              # [b, h, n]; ops take FP32
        pieces = flash_pieces(q_pos, k_pos, mask, q_doc, k_doc, bands=ops.windows)
        dq = torch.empty(n, b, h, d, dtype=cd, device=q.device)                  # every row written once
        for a, z in _gaps([(p[0], p[1]) for p in pieces], n):
            dq[a:z] = 0.0
        dk = torch.zeros(m, b, hk, d, dtype=cd, device=q.device)                 # pieces add into key ranges
        dv = torch.zeros(m, b, hk, d_v, dtype=cd, device=q.device)
        for kind, pieces in self._groups(pieces, ops, b):
            if kind == MATH:
                for a, z, _, _, _ in pieces:
                    g = block_attention_backward(dout[a:z], q[a:z], k, v, out[a:z], lse[:, :, a:z].to(cd), q_pos[a:z],
                                                 k_pos, mask, scale, **_docs(q_doc, k_doc, a, z))
                    dq[a:z] = g[0]
                    dk.add_(g[1])
                    dv.add_(g[2])
            elif len(pieces) == 1:
                a, z, _, k0, k1 = pieces[0]
                dq_p, dk_p, dv_p = ops.backward(_bshd(doc[a:z]), _bshd(qc[a:z]), _bshd(kc[k0:k1]), _bshd(vc[k0:k1]),
                                                _bshd(ouc[a:z]), lse[:, :, a:z], kind == CAUSAL, scale,
                                                **_window(kind, q_pos, k_pos, pieces[0], mask))
                dq[a:z] = _bshd(dq_p)[..., :d]                                   # [t, b, h, d]
                dk[k0:k1].add_(_bshd(dk_p)[..., :d])                             # [k1-k0, b, hk, d]
                dv[k0:k1].add_(_bshd(dv_p)[..., :d_v])                           # padding's gradient dropped
            else:                                                                # varlen, b == 1
                q_r = [(a, z) for a, z, _, _, _ in pieces]
                k_r = [(k0, k1) for _, _, _, k0, k1 in pieces]
                cu_q, cu_k = _cu([z - a for a, z in q_r], q.device), _cu([k1 - k0 for k0, k1 in k_r], q.device)
                lse_rows = torch.cat([lse[0, :, a:z] for a, z in q_r], dim=1)    # [h, T]
                dq_v, dk_v, dv_v = ops.backward_varlen(
                    _cat_ranges(doc[:, 0], q_r), _cat_ranges(qc[:, 0], q_r), _cat_ranges(kc[:, 0], k_r),
                    _cat_ranges(vc[:, 0], k_r), _cat_ranges(ouc[:, 0], q_r), lse_rows, cu_q, cu_k,
                    max(z - a for a, z in q_r), max(k1 - k0 for k0, k1 in k_r), kind == CAUSAL, scale)
                pos = 0
                for a, z in q_r:
                    dq[a:z, 0] = dq_v[pos:pos + z - a, :, :d]
                    pos += z - a
                pos = 0
                for k0, k1 in k_r:
                    dk[k0:k1, 0] += dk_v[pos:pos + k1 - k0, :, :d]
                    dv[k0:k1, 0] += dv_v[pos:pos + k1 - k0, :, :d_v]
                    pos += k1 - k0
        return dq, dk, dv

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _groups(pieces, ops: FusedOps, b: int) -> list[tuple[str, list]]:
        """Pieces as ``(kind, pieces)`` calls: math and band pieces one by one (each band piece has
        its own window arguments); fused pieces of one kind in one varlen call when the binding has
        one and ``b == 1``, else one dense call each."""
        out: list[tuple[str, list]] = []
        batched = ops.varlen and b == 1
        by_kind: dict[str, list] = {}
        for p in pieces:
            if p[2] in (MATH, BAND) or not batched:
                out.append((p[2], [p]))
            else:
                by_kind.setdefault(p[2], []).append(p)
        out.extend((kind, ps) for kind, ps in by_kind.items())
        return out

    _math_noted: set = set()

    def _note_math(self, device) -> None:
        if device.type == "cuda" and self.name not in FusedPiecesKernel._math_noted:
            FusedPiecesKernel._math_noted.add(self.name)
            log.warning("kernel %r: some query rows meet a KV block in a shape the fused op cannot mask "
                        "(a query run starting inside the block, or a window's edge the op has no "
                        "window argument for); they run on the math kernel (exact, slower)",
                        self.name)


class CpuFlashKernel(FusedPiecesKernel):
    """``cpu-flash``: torch's fused CPU flash-attention ops (FP32 / BF16 CPU tensors).

    Numerics: the op runs in FP32, also for BF16 inputs (upcast once per shard for q, per block for
    k, v), so ``out``, ``lse``, ``dq, dk, dv`` are FP32 like the math kernel's and FP32 matches FP64
    within 1e-5 (tested). Running the op in BF16 instead would round each block's out and
    gradients, and the final out from which the op's backward forms ``D = rowsum(dout * out)``, to
    BF16; that breaks the cancellation in ``dQ = dS K`` when keys share a large component (logits
    spread over 1e4: dq errors of ~100 vs max|dq| 8, measured), and on this CPU (AVX-512 BF16, one
    thread) the BF16 op is no faster than the FP32 one. The CPU op has no varlen form and only
    top-left causal, so pieces run one call each, and a sliding window's edge rows (``band``
    pieces) run on the math kernel; rows a window sees whole run on the op."""

    name = "cpu-flash"
    _OPS = CpuFlashOps()

    @staticmethod
    def available() -> bool:
        return CpuFlashKernel._OPS.unavailable() is None

    def ops_for(self, dtype):
        return self._OPS if self._OPS.op_dtype(dtype) is not None else None


class CudaFlashKernel(FusedPiecesKernel):
    """``cuda-flash``: torch's own CUDA attention ops, no extra dependency. FP16/BF16 run torch's
    FlashAttention-2 (varlen form for packed documents); FP32 runs the memory-efficient kernel.
    The ops run in the input's dtype (BF16 stays BF16: that is the point of a fused kernel on a
    GPU); results are FP32 and blocks merge in FP32. FP64: use ``math``."""

    name = "cuda-flash"
    _FLASH = TorchCudaFlashOps()
    _EFFICIENT = TorchCudaEfficientOps()

    def ops_for(self, dtype):
        if dtype in (torch.float16, torch.bfloat16):
            return self._FLASH
        return self._EFFICIENT if dtype == torch.float32 else None


class FlashAttnKernel(FusedPiecesKernel):
    """``flash-attn``: the FlashAttention-2 package (>= 2.6) for FP16/BF16 CUDA tensors, varlen
    form for packed documents."""

    name = "flash-attn"
    _OPS = FlashAttnOps()

    def ops_for(self, dtype):
        return self._OPS if dtype in (torch.float16, torch.bfloat16) else None


def position_order(pos: torch.Tensor, doc: torch.Tensor | None) -> torch.Tensor | None:
    """The permutation that sorts a call's rows (or keys) by (document, position), int64 on the
    host; None when they are in that order already (item 6 of the module note; the emulator's
    sleep kernel takes runs in the same order). Positions and document ids are host tensors (both
    layouts build them there)."""
    if pos.numel() < 2:
        return None
    p = pos.numpy().astype(np.int64)
    key = p if doc is None else doc.numpy().astype(np.int64) * (int(p.max()) + 1) + p
    if (key[1:] >= key[:-1]).all():
        return None
    return torch.from_numpy(np.argsort(key, kind="stable"))


def _take(order: torch.Tensor | None, *xs):
    """Each of ``xs`` (None passes) with its first axis gathered by ``order`` (None: unchanged)."""
    if order is None:
        return xs
    return tuple(None if x is None else x[order.to(x.device)] for x in xs)


def _untake(order: torch.Tensor | None, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` computed in sorted order, back in the caller's order along ``dim``."""
    if order is None:
        return x
    out = torch.empty_like(x)
    idx = order.to(x.device)
    if dim == 0:
        out[idx] = x
    else:
        out[:, :, idx] = x
    return out
