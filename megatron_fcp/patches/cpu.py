"""Shims that let megatron-core's GPTModel train on CPU with gloo (only when CUDA is absent).

megatron-core assumes a GPU in a handful of places that a CPU run of a GPTModel reaches. Each
shim below replaces exactly one binding, in the namespace where megatron-core looks it up, with
a CPU equivalent of the same semantics; nothing else changes. They are installed through
:data:`megatron_fcp.patches.REGISTRY` (group ``"cpu"``), so they are idempotent, logged once
each, and reverted exactly by :func:`revert_cpu_shims`. Checked against megatron-core 0.14-0.19.

==============================================================  ==================================
binding (megatron-core 0.16.1)                                   CPU meaning
==============================================================  ==================================
``tensor_parallel.random:_get_cuda_rng_state``                  the CPU generator's state
``tensor_parallel.random:_set_cuda_rng_state``                  ``torch.set_rng_state``
``tensor_parallel.random:CudaRNGStatesTracker.add``             seed a named state on the CPU
                                                                 generator (the tracker then forks
                                                                 the CPU generator, which is what
                                                                 CPU dropout draws from)
``utils:GlobalMemoryBuffer.get_tensor``                         buffer on the CPU
``...rotary_pos_embedding:RotaryEmbedding.get_emb``             keep ``inv_freq`` on the CPU
``...rotary_pos_embedding:get_pos_emb_on_this_cp_rank``         zigzag slice without pinned/CUDA
                                                                 index tensors
``fusions.fused_softmax:get_default_causal_mask``               mask built on the CPU
==============================================================  ==================================

``model_parallel_cuda_manual_seed`` itself works on CPU (``torch.cuda.manual_seed`` is lazy) but
seeds no CPU generator: call ``torch.manual_seed(seed)`` too. Megatron's own DDP wrapper and ``get_megatron_optimizer`` allocate CUDA buffers: on CPU use
``torch.nn.parallel.DistributedDataParallel`` (or a manual all-reduce) and ``torch.optim``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import torch

from megatron_fcp.patches import REGISTRY, check_megatron_version

__all__ = ["CPU_SHIMS", "apply_cpu_shims", "revert_cpu_shims", "cpu_shims_needed"]

GROUP = "cpu"
_RANDOM = "megatron.core.tensor_parallel.random"
_ROPE = "megatron.core.models.common.embeddings.rotary_pos_embedding"


# ---- RNG ---------------------------------------------------------------------------------------
def _make_get_rng_state(original: Callable) -> Callable:
    def _get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        """CPU stand-in: the default CPU generator's state (a fresh ByteTensor, clone or not)."""
        del device, clone, graph_safe
        return torch.get_rng_state()

    return _get_cuda_rng_state


def _make_set_rng_state(original: Callable) -> Callable:
    def _set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
        """CPU stand-in: restore the default CPU generator's state."""
        del device, graph_safe
        torch.set_rng_state(new_state)

    return _set_cuda_rng_state


def _make_tracker_add(original: Callable) -> Callable:
    def add(self, name: str, seed: int) -> None:
        """Register RNG state ``name`` seeded with ``seed`` on the CPU generator.

        Same bookkeeping as Megatron's tracker (a seed and a name may be used once); the
        generator's state is restored afterwards, so adding a state draws nothing.
        """
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")  # noqa: TRY002 - Megatron's type
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")  # noqa: TRY002
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    return add


# ---- memory buffer -----------------------------------------------------------------------------
def _make_get_tensor(original: Callable) -> Callable:
    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        """Megatron's reuse-by-(name, dtype) buffer, allocated on the CPU."""
        del mem_alloc_context
        required = 1
        for n in tensor_shape:
            required *= int(n)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required:
            buf = torch.empty(required, dtype=dtype, device="cpu", requires_grad=False)
            self.buffer[(name, dtype)] = buf
        return buf[:required].view(*tensor_shape)

    return get_tensor


# ---- RoPE --------------------------------------------------------------------------------------
def _make_get_emb(original: Callable) -> Callable:
    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """RoPE table ``[max_seq_len, 1, 1, dim]`` computed where ``inv_freq`` lives (the CPU)."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, dim/2]
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)  # [s, dim]
        else:  # interleave: f0 f0 f1 f1 ...
            emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)
        return emb[:, None, None, :]

    return get_emb


def _make_pos_emb_on_cp_rank(original: Callable) -> Callable:
    def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
        """Keep the two zigzag chunks of this CP rank: ``r`` and ``2*cp-1-r`` of ``2*cp``."""
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp, r = cp_group.size(), cp_group.rank()
        idx = torch.tensor([r, 2 * cp - 1 - r], device=pos_emb.device)
        shape = pos_emb.shape
        pos_emb = pos_emb.view(*shape[:seq_dim], 2 * cp, -1, *shape[seq_dim + 1 :])
        pos_emb = pos_emb.index_select(seq_dim, idx)
        return pos_emb.reshape(*shape[:seq_dim], -1, *shape[seq_dim + 1 :])

    return get_pos_emb_on_this_cp_rank


# ---- masks -------------------------------------------------------------------------------------
def _make_default_causal_mask(original: Callable) -> Callable:
    @lru_cache(maxsize=8)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        """Upper-triangular True = masked, ``[sq, sq]`` on the CPU."""
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    return get_default_causal_mask


#: (target, replacement factory) in install order.
CPU_SHIMS: tuple[tuple[str, Callable[[Callable], Callable]], ...] = (
    (f"{_RANDOM}:_get_cuda_rng_state", _make_get_rng_state),
    (f"{_RANDOM}:_set_cuda_rng_state", _make_set_rng_state),
    (f"{_RANDOM}:CudaRNGStatesTracker.add", _make_tracker_add),
    ("megatron.core.utils:GlobalMemoryBuffer.get_tensor", _make_get_tensor),
    (f"{_ROPE}:RotaryEmbedding.get_emb", _make_get_emb),
    (f"{_ROPE}:get_pos_emb_on_this_cp_rank", _make_pos_emb_on_cp_rank),
    ("megatron.core.fusions.fused_softmax:get_default_causal_mask", _make_default_causal_mask),
)


def cpu_shims_needed() -> bool:
    """True when this process has no usable CUDA device."""
    return not torch.cuda.is_available()


def apply_cpu_shims(force: bool = False) -> list[str]:
    """Install the CPU shims when CUDA is absent (or ``force``); return the patched targets.

    Version-gated: raises ``ImportError`` naming the symbol and megatron-core version when a
    binding is missing. With CUDA present (and not forced) this does nothing.
    """
    if not (force or cpu_shims_needed()):
        return []
    check_megatron_version()
    for target, make in CPU_SHIMS:
        REGISTRY.install(target, make, group=GROUP)
    return REGISTRY.targets(GROUP)


def revert_cpu_shims() -> list[str]:
    """Restore every CPU shim exactly; return the restored targets."""
    return REGISTRY.revert(GROUP)
