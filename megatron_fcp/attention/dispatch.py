"""Which block kernel runs: the registry of kernels by name and ``auto``'s choice per device and dtype.

``auto`` (the default) tries, in order, the kernels of :data:`AUTO_ORDER` for the tensors' device
type and takes the first that can run their dtype and head dim here:

* CUDA: ``flash-attn`` (the FlashAttention-2 package, when installed; FP16/BF16), then
  ``cuda-flash`` (torch's own FlashAttention-2 for FP16/BF16, memory-efficient kernel for FP32),
  then ``math`` (FP64, or a torch without the fused ops);
* CPU: ``math``, the exact reference and the kernel the CPU suite's numbers come from
  (``cpu-flash`` stays opt-in: it rounds differently, to FP32 like ``math`` but not bitwise).

The choice is logged once per (device type, dtype, choice), with the reason each kernel before it
was passed over. A kernel named explicitly that cannot run raises ValueError naming the fix.
"""

from __future__ import annotations

import logging

import torch

from megatron_fcp.attention.fused import CpuFlashKernel, CudaFlashKernel, FlashAttnKernel, FusedPiecesKernel
from megatron_fcp.attention.kernels import BlockKernel, MathKernel

__all__ = ["BLOCK_KERNELS", "KERNEL_CHOICES", "AUTO_ORDER", "resolve_kernel", "choose_kernel"]

log = logging.getLogger(__name__)

#: Block kernels by name.
BLOCK_KERNELS: dict[str, BlockKernel] = {
    k.name: k for k in (MathKernel(), CpuFlashKernel(), CudaFlashKernel(), FlashAttnKernel())}

#: What ``--fcp-kernel`` / ``kernel=`` accept: ``auto`` and every kernel name.
KERNEL_CHOICES: tuple[str, ...] = ("auto", *BLOCK_KERNELS)

#: ``auto``'s preference per device type (first that can run wins).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash-attn", "cuda-flash", "math"),
    "cpu": ("math",),
}

_logged: set = set()


def _check(kernel: BlockKernel, dtype: torch.dtype, device: torch.device, head_dim: int | None,
           v_head_dim: int | None = None) -> None:
    kernel.check(dtype, device)
    if head_dim is not None and isinstance(kernel, FusedPiecesKernel):
        # fused ops run K and V at one head size: V (or Q and K) padded to the larger (MLA)
        kernel.check_head_dim(dtype, max(head_dim, v_head_dim or head_dim))


def choose_kernel(dtype: torch.dtype, device, head_dim: int | None = None,
                  v_head_dim: int | None = None) -> BlockKernel:
    """``auto``: the first kernel of :data:`AUTO_ORDER` that can run ``dtype`` on ``device``
    (at q/k head size ``head_dim`` and v head size ``v_head_dim``, default the same)."""
    device = torch.device(device)
    skipped = []
    for name in AUTO_ORDER.get(device.type, ("math",)):
        kernel = BLOCK_KERNELS[name]
        try:
            _check(kernel, dtype, device, head_dim, v_head_dim)
        except ValueError as exc:
            skipped.append(f"{name}: {exc}")
            continue
        key = (device.type, dtype, name)
        if key not in _logged:
            _logged.add(key)
            log.info("FCP block kernel auto -> %r for %s %s%s", name, device.type, dtype,
                     "" if not skipped else " (passed over: " + "; ".join(skipped) + ")")
        return kernel
    raise ValueError(f"no block kernel can run {dtype} on {device}: " + "; ".join(skipped))


def resolve_kernel(kernel: "str | BlockKernel", dtype: torch.dtype, device, head_dim: int | None = None,
                   v_head_dim: int | None = None) -> BlockKernel:
    """The :class:`BlockKernel` for ``kernel`` (``"auto"``, a name in :data:`BLOCK_KERNELS` or an
    instance), checked against ``dtype`` / ``device`` (and ``head_dim``, ``v_head_dim`` for fused
    kernels); ValueError naming the fix otherwise."""
    if isinstance(kernel, BlockKernel):
        obj = kernel
    elif kernel == "auto":
        return choose_kernel(dtype, device, head_dim, v_head_dim)
    elif isinstance(kernel, str) and kernel in BLOCK_KERNELS:
        obj = BLOCK_KERNELS[kernel]
    else:
        raise ValueError(f"unknown block kernel {kernel!r}; use one of {list(KERNEL_CHOICES)} "
                         f"(default 'auto') or a BlockKernel instance")
    _check(obj, dtype, torch.device(device), head_dim, v_head_dim)
    return obj
