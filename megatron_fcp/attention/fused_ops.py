"""Bindings of fused attention ops: one small class per library, one contract for all.

A :class:`FusedOps` binding runs attention of a query range against a key range with the op's
own kernel and returns ``(out, lse)``; its backward takes the *final* ``out`` and ``lse`` (the
flash-attn recipe, so a block's backward gives its exact share of the global gradient). Every
piece of logic above the op — which rows meet which keys, masks, documents, GQA, casting, FP32
results — lives once in :class:`megatron_fcp.attention.fused.FusedPiecesKernel`; a binding only
translates the call. That is what lets the CPU suite (the ``cpu-flash`` binding) cover the code the
CUDA bindings run.

Contract (all tensors on the op's device; ``b`` batch, ``t`` queries, ``m`` keys, ``d`` head dim):

* ``forward(q [b,t,h,d], k, v [b,m,h_kv,d], causal, scale) -> (o [b,t,h,d], lse [b,h,t] fp32)``,
  inputs in :meth:`op_dtype`, last dim contiguous; ``causal`` is the square (top-left = bottom-right)
  causal mask: the kernel only asks for it with ``t == m``.
* ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq [b,t,h,d], dk, dv [b,m,h_kv,d])``.
* Bindings with ``windows = True`` also take ``window=(wl, wr)`` on ``forward`` / ``backward``:
  flash-attn's ``window_size_left/right`` (bottom-right aligned; Note [flash-attn's window
  convention] in :mod:`megatron_fcp.attention.tiles`), passed with ``causal=False``; the kernel
  passes it only for ``band`` pieces whose rows all see a key.
* Bindings with ``varlen = True`` also take packed segments (no batch dim; ``b = 1`` callers):
  ``forward_varlen(q [T,h,d], k, v [M,h_kv,d], cu_q, cu_k (int32 [S+1]), max_q, max_k, causal,
  scale) -> (o [T,h,d], lse [h,T] fp32)`` and ``backward_varlen(..., out, lse [h,T], ...)``.
  Segment ``i`` is queries ``cu_q[i]:cu_q[i+1]`` against keys ``cu_k[i]:cu_k[i+1]``.

Bindings:

* :class:`CpuFlashOps` — ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``),
  FP32 compute for FP32/BF16 inputs (see :class:`~megatron_fcp.attention.fused.CpuFlashKernel`).
* :class:`TorchCudaFlashOps` — ``aten._flash_attention_forward`` / ``_flash_attention_backward``
  (torch's vendored FlashAttention-2; dense and ``cum_seq`` varlen forms; FP16/BF16; GQA native).
* :class:`TorchCudaEfficientOps` — ``aten._efficient_attention_forward`` / ``_backward`` (the
  memory-efficient CUTLASS kernel; FP32 too; K/V heads repeated for GQA, their gradients summed).
* :class:`FlashAttnOps` — the ``flash_attn`` package (FlashAttention-2 >= 2.6), its
  ``_flash_attn_(varlen_)forward/backward`` functions, when installed.
* :class:`LoopVarlenOps` — gives any binding a varlen form by looping over segments (exact, slow):
  the CPU tests use it to run the varlen grouping logic.

Signatures were checked against torch 2.11 and 2.13 (``torch.ops.aten.<op>.default._schema``) and
flash-attn 2.6-2.8; :meth:`FusedOps.unavailable` names what is missing instead of failing late.
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["FusedOps", "CpuFlashOps", "TorchCudaFlashOps", "TorchCudaEfficientOps", "FlashAttnOps",
           "LoopVarlenOps", "lse_rows_from_varlen", "lse_varlen_from_rows"]

_HALF = (torch.float16, torch.bfloat16)


class FusedOps:
    """One library's fused attention op pair (module docstring for the contract)."""

    name = ""
    device_type = "cuda"
    varlen = False
    windows = False  # forward/backward take window=(wl, wr), flash-attn's convention

    def unavailable(self) -> str | None:
        """None if the ops can run here, else why not (names the fix)."""
        raise NotImplementedError

    def op_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype the op runs for inputs of ``dtype`` (None: not supported)."""
        raise NotImplementedError

    def check_head_dim(self, d: int) -> str | None:
        return None

    def forward(self, q, k, v, causal: bool, scale: float):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        raise NotImplementedError

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
        raise NotImplementedError

    def backward_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool,
                        scale: float):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------
_CPU_OP = "_scaled_dot_product_flash_attention_for_cpu"


class CpuFlashOps(FusedOps):
    """torch's fused CPU flash-attention ops; they take ``[b, h, s, d]``, so the binding transposes
    (views only). Runs in FP32 for FP32 and BF16 inputs."""

    name, device_type = "cpu-flash", "cpu"

    def unavailable(self) -> str | None:
        ops = torch.ops.aten
        if hasattr(ops, _CPU_OP) and hasattr(ops, _CPU_OP + "_backward"):
            return None
        return f"torch.ops.aten.{_CPU_OP}(_backward) is absent from torch {torch.__version__}"

    def op_dtype(self, dtype):
        return torch.float32 if dtype in (torch.float32, torch.bfloat16) else None

    def forward(self, q, k, v, causal, scale):
        op = getattr(torch.ops.aten, _CPU_OP)
        o, lse = op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
        return o.transpose(1, 2), lse                                      # [b,t,h,d], [b,h,t]

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        op = getattr(torch.ops.aten, _CPU_OP + "_backward")
        dq, dk, dv = op(dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        out.transpose(1, 2), lse, 0.0, causal, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# varlen helpers
# ---------------------------------------------------------------------------------------------
def _segments(cu: torch.Tensor) -> list[tuple[int, int]]:
    c = cu.tolist()
    return [(c[i], c[i + 1]) for i in range(len(c) - 1)]


def lse_rows_from_varlen(lse: torch.Tensor, cu_q: torch.Tensor, total: int) -> torch.Tensor:
    """A varlen op's LSE as ``[h, T]``: FlashAttention-2 >= 2.4 returns that already, older builds
    ``[S, h, max_q]`` (padded per segment)."""
    if lse.dim() == 2:
        return lse[:, :total]
    seg, off = _row_index(cu_q, total, lse.device)
    return lse[seg, :, off].t()                                           # [h, T]


def lse_varlen_from_rows(rows: torch.Tensor, like_dim: int, cu_q: torch.Tensor, max_q: int) -> torch.Tensor:
    """Inverse of :func:`lse_rows_from_varlen` for the layout (``like_dim`` 2 or 3) the op uses."""
    rows = rows.contiguous()
    if like_dim == 2:
        return rows
    total = rows.shape[1]
    seg, off = _row_index(cu_q, total, rows.device)
    out = rows.new_zeros(cu_q.numel() - 1, rows.shape[0], max_q)           # [S, h, max_q]
    out[seg, :, off] = rows.t()
    return out


def _row_index(cu_q: torch.Tensor, total: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment id and offset inside the segment of each of the ``total`` packed rows."""
    cu = cu_q.to(device=device, dtype=torch.int64)
    lens = cu[1:] - cu[:-1]
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens)
    off = torch.arange(total, device=device) - cu[:-1][seg]
    return seg, off


class LoopVarlenOps(FusedOps):
    """Varlen form of any binding by a loop over segments (exact; for bindings and tests without a
    native varlen op)."""

    varlen = True

    def __init__(self, inner: FusedOps) -> None:
        self.inner = inner
        self.name, self.device_type, self.windows = inner.name, inner.device_type, inner.windows

    def unavailable(self):
        return self.inner.unavailable()

    def op_dtype(self, dtype):
        return self.inner.op_dtype(dtype)

    def forward(self, q, k, v, causal, scale, **window):
        return self.inner.forward(q, k, v, causal, scale, **window)

    def backward(self, dout, q, k, v, out, lse, causal, scale, **window):
        return self.inner.backward(dout, q, k, v, out, lse, causal, scale, **window)

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        o = torch.empty_like(q)                                           # [T, h, d]
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)  # [h, T]
        for (a, z), (k0, k1) in zip(_segments(cu_q), _segments(cu_k)):
            o_s, l_s = self.inner.forward(q[None, a:z], k[None, k0:k1], v[None, k0:k1], causal, scale)
            o[a:z], lse[:, a:z] = o_s[0], l_s[0]
        return o, lse

    def backward_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (a, z), (k0, k1) in zip(_segments(cu_q), _segments(cu_k)):
            g = self.inner.backward(dout[None, a:z], q[None, a:z], k[None, k0:k1], v[None, k0:k1],
                                    out[None, a:z], lse[None, :, a:z].contiguous(), causal, scale)
            dq[a:z] = g[0][0]
            dk[k0:k1] += g[1][0]
            dv[k0:k1] += g[2][0]
        return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# CUDA: torch's own ops
# ---------------------------------------------------------------------------------------------
def _cuda_missing(op_names: tuple[str, ...]) -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available"
    missing = [n for n in op_names if not hasattr(torch.ops.aten, n)]
    if missing:
        return f"torch {torch.__version__} lacks torch.ops.aten.{', '.join(missing)}"
    return None


def _has_window_args(op_names: tuple[str, ...]) -> bool:
    """Whether this torch's ops take ``window_size_left/right`` (their schema names them)."""
    try:
        return all("window_size_left" in str(getattr(torch.ops.aten, n).default._schema) for n in op_names)
    except (AttributeError, RuntimeError):
        return False


def _torch_window(window) -> dict:
    """``window=(wl, wr)`` as torch's flash-op keywords (none without a window)."""
    return {} if window is None else {"window_size_left": window[0], "window_size_right": window[1]}


class TorchCudaFlashOps(FusedOps):
    """torch's vendored FlashAttention-2: ``aten._flash_attention_forward(q, k, v, cum_seq_q,
    cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale)`` returns
    ``(out, lse, rng_state, unused, debug_mask)``, dense (``cum_seq`` None, ``[b, s, h, d]``) or
    varlen (``[total, h, d]``); ``aten._flash_attention_backward(dout, q, k, v, out, lse, cum_seq_q,
    cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale)`` -> ``(dq, dk,
    dv)``. FP16/BF16, head dim a multiple of 8 up to 256, GQA native. With ``t == m`` its
    bottom-right causal mask is the square one the kernel asks for. Torch builds whose schema has
    ``window_size_left/right`` (2.5+; checked: 2.13) take sliding-window bands (``windows``), in
    flash-attn's convention (the vendored kernel's)."""

    name, varlen = "torch-flash", True
    _OPS = ("_flash_attention_forward", "_flash_attention_backward")

    def __init__(self) -> None:
        self._rng: dict = {}                                               # device -> (rng_state, unused)
        self._varlen_lse_dim: int | None = None                            # 2: [h, T]; 3: [S, h, max_q]
        self.windows = _has_window_args(self._OPS)

    def unavailable(self):
        return _cuda_missing(self._OPS)

    def op_dtype(self, dtype):
        return dtype if dtype in _HALF else None

    def check_head_dim(self, d):
        return None if d % 8 == 0 and d <= 256 else f"head dim {d} (FlashAttention needs a multiple of 8, <= 256)"

    def _rng_state(self, device):
        if device not in self._rng:                                        # dropout 0: never read
            z = torch.zeros(2, dtype=torch.int64, device=device)
            self._rng[device] = (z, torch.zeros((), dtype=torch.int64, device=device))
        return self._rng[device]

    def forward(self, q, k, v, causal, scale, window=None):
        o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=scale, **_torch_window(window))
        self._rng.setdefault(q.device, (rng, unused))
        return o, lse                                                      # [b,t,h,d], [b,h,t]

    def backward(self, dout, q, k, v, out, lse, causal, scale, window=None):
        rng, unused = self._rng_state(q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[1], k.shape[1], 0.0, causal, rng, unused,
            scale=scale, **_torch_window(window))
        return dq, dk, dv

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
        self._rng.setdefault(q.device, (rng, unused))
        self._varlen_lse_dim = lse.dim()
        return o, lse_rows_from_varlen(lse, cu_q, q.shape[0])

    def backward_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        if self._varlen_lse_dim is None:                                   # learn the op's LSE layout once
            self.forward_varlen(q[:1], k[:1], v[:1], cu_q.new_tensor([0, 1]), cu_k.new_tensor([0, 1]), 1, 1,
                                False, scale)
        rng, unused = self._rng_state(q.device)
        lse_op = lse_varlen_from_rows(lse, self._varlen_lse_dim, cu_q, max_q)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse_op, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale)
        return dq, dk, dv


def _ceil(x: int, m: int) -> int:
    return -(-x // m) * m


class TorchCudaEfficientOps(FusedOps):
    """torch's memory-efficient (CUTLASS) attention: ``aten._efficient_attention_forward(q, k, v,
    bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, custom_mask_type,
    compute_log_sumexp, *, scale)`` on ``[b, s, h, d]`` returns ``(out, lse [b, h, ceil32(t)],
    seed, offset, ...)``; ``aten._efficient_attention_backward(dout, q, k, v, bias, out, cu_q, cu_k,
    max_q, max_k, lse, dropout_p, seed, offset, custom_mask_type, bias_requires_grad, *, scale)``.
    Mask type 1 is top-left causal. No GQA in the kernel: K/V heads are repeated (``repeat_interleave``,
    query head i -> KV head i // g) and dK/dV summed over each group. The FP32 path on CUDA."""

    name = "torch-mem-efficient"
    _OPS = ("_efficient_attention_forward", "_efficient_attention_backward")
    _ALIGN_LSE = 32

    def __init__(self) -> None:
        self._rng: dict = {}

    def unavailable(self):
        return _cuda_missing(self._OPS)

    def op_dtype(self, dtype):
        return dtype if dtype in (torch.float32, *_HALF) else None

    @staticmethod
    def _expand(q, k, v):
        g = q.shape[2] // k.shape[2]
        if g == 1:
            return k, v, 1
        return k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2), g  # [b, m, h, d]

    def forward(self, q, k, v, causal, scale):
        k_r, v_r, _ = self._expand(q, k, v)
        o, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
            q, k_r, v_r, None, None, None, None, None, 0.0, 1 if causal else 0, True, scale=scale)
        self._rng.setdefault(q.device, (seed, offset))
        return o, lse[:, :, :q.shape[1]]                                   # [b,t,h,d], [b,h,t]

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        b, t, h, _ = q.shape
        k_r, v_r, g = self._expand(q, k, v)
        seed, offset = self._rng.get(q.device) or (torch.zeros((), dtype=torch.int64, device=q.device),) * 2
        lse_p = lse.new_zeros(b, h, _ceil(t, self._ALIGN_LSE))
        lse_p[:, :, :t] = lse
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            dout.contiguous(), q, k_r, v_r, None, out, None, None, t, k.shape[1], lse_p, 0.0, seed, offset,
            1 if causal else 0, False, scale=scale)
        if g > 1:                                                          # [b, m, h, d] -> [b, m, h_kv, d]
            dk = dk.unflatten(2, (k.shape[2], g)).sum(3)
            dv = dv.unflatten(2, (k.shape[2], g)).sum(3)
        return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# flash-attn (FlashAttention-2 package)
# ---------------------------------------------------------------------------------------------
_FA_MIN = (2, 6)


class FlashAttnOps(FusedOps):
    """The ``flash_attn`` package's low-level functions (FlashAttention-2 >= 2.6):
    ``_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
    window_size_right, softcap, alibi_slopes, return_softmax) -> (out, lse, S_dmask, rng_state)``,
    ``_flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, softmax_scale, causal,
    window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state)`` (fills
    dq, dk, dv) and their ``_varlen_`` forms (LSE ``[h, T]``). Arguments are passed by keyword."""

    name, varlen, windows = "flash-attn", True, True

    def __init__(self) -> None:
        self._fa = None

    def _module(self):
        if self._fa is None:
            from flash_attn import flash_attn_interface
            self._fa = flash_attn_interface
        return self._fa

    def unavailable(self):
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if importlib.util.find_spec("flash_attn") is None:
            return "the flash_attn package is not installed (pip install flash-attn>=2.6)"
        try:
            import flash_attn
        except Exception as exc:  # a broken build: say so instead of failing at the first call
            return f"flash_attn fails to import: {exc}"
        version = tuple(int(x) for x in flash_attn.__version__.split(".")[:2] if x.isdigit())
        if version < _FA_MIN:
            return f"flash_attn {flash_attn.__version__} is older than 2.6 (the window/softcap signature)"
        return None

    def op_dtype(self, dtype):
        return dtype if dtype in _HALF else None

    def check_head_dim(self, d):
        return None if d % 8 == 0 and d <= 256 else f"head dim {d} (flash-attn needs a multiple of 8, <= 256)"

    _NO_WINDOW = dict(window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None)

    def _window(self, window) -> dict:
        """flash-attn's window keywords: ``window=(wl, wr)`` (its own convention) or none."""
        return self._NO_WINDOW if window is None else {
            **self._NO_WINDOW, "window_size_left": window[0], "window_size_right": window[1]}

    def forward(self, q, k, v, causal, scale, window=None):
        o, lse, _, _ = self._module()._flash_attn_forward(
            q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, return_softmax=False, **self._window(window))
        return o, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, window=None):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._module()._flash_attn_backward(
            dout, q, k, v, out, lse.contiguous(), dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
            deterministic=False, rng_state=None, **self._window(window))
        return dq, dk, dv

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        o, lse, _, _ = self._module()._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
            return_softmax=False, **self._NO_WINDOW)
        return o, lse_rows_from_varlen(lse, cu_q, q.shape[0])

    def backward_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._module()._flash_attn_varlen_backward(
            dout, q, k, v, out, lse.contiguous(), dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
            softmax_scale=scale, causal=causal, deterministic=False, rng_state=None, **self._NO_WINDOW)
        return dq, dk, dv
