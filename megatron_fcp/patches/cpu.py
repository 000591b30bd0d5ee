"""Shims that let megatron-core's GPTModel train on CPU with gloo (only when CUDA is absent).

megatron-core assumes a GPU in a handful of places that a CPU run of a GPTModel reaches. Each
shim below replaces exactly one binding, in the namespace where megatron-core looks it up, with
a CPU equivalent of the same semantics; nothing else changes. They are installed through
:data:`megatron_fcp.patches.REGISTRY` (group ``"cpu"``), so they are idempotent, logged once
each, and reverted exactly by :func:`revert_cpu_shims`. Run on every release of the version matrix
(``tests/compat/run_matrix.sh``).

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
``...rotary_pos_embedding:RotaryEmbedding.get_emb`` (0.16+)     keep ``inv_freq`` on the CPU
``...rotary_pos_embedding:RotaryEmbedding.forward`` (0.14-0.15)  the same, where ``forward`` itself
                                                                 moves ``inv_freq`` to CUDA
``...rotary_pos_embedding:get_pos_emb_on_this_cp_rank``         zigzag slice without pinned/CUDA
                                                                 index tensors
``fusions.fused_softmax:get_default_causal_mask``               mask built on the CPU
``transformer.dot_product_attention:DotProductAttention          the sink's ``softmax_offset``
.__init__`` (0.15+)                                              (``softmax_type`` off-by-one /
                                                                 learnable) created on the CPU
``fusions.fused_softmax:get_sliding_window_causal_mask``        the window's band on the CPU (0.15+)
``transformer.multi_latent_attention:RotaryEmbedding``          MLA's own RoPE built with
                                                                 ``use_cpu_initialization=True``
                                                                 (MLA passes no flag, so its
                                                                 ``__init__`` asks for a CUDA
                                                                 device); the same table
``tensor_parallel.mappings:_gather_along_last_dim``             the all-gather's buffer on the
                                                                 input's device (MLA gathers its
                                                                 compressed KV across TP ranks)
``transformer.multi_latent_attention:TELinear``                 only where TE is absent and the
                                                                 name is megatron-core's
                                                                 ``MagicMock`` stand-in: a class
                                                                 nothing is an instance of (MLA's
                                                                 ``isinstance(linear_proj,
                                                                 TELinear)`` needs a type)
==============================================================  ==================================

Each shim is gated on what the installed megatron-core really has: it is installed only where
its target exists *and* the target's source reaches for CUDA (``cuda`` or ``pin_memory``). A
shim that a release does not need (``get_emb`` before 0.16, ``forward`` from 0.16 on, or a
function a later release made device-agnostic) is skipped and logged at INFO. A required shim
with no target at all raises :class:`~megatron_fcp.patches.PatchTargetError` naming the symbol
and the version, and so does a target whose signature differs from what the shim replaces.

``model_parallel_cuda_manual_seed`` itself works on CPU (``torch.cuda.manual_seed`` is lazy) but
seeds no CPU generator: call ``torch.manual_seed(seed)`` too. Megatron's own DDP wrapper and
``get_megatron_optimizer`` allocate CUDA buffers: on CPU use
``torch.nn.parallel.DistributedDataParallel`` (or a manual all-reduce) and ``torch.optim``.
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch

from megatron_fcp.patches import (
    REGISTRY,
    PatchTargetError,
    check_megatron_version,
    megatron_core_version,
    resolve_target,
)
from megatron_fcp.patches.compat import source_mentions
from megatron_fcp.patches.sinks import make_softmax_offset, softmax_type_of

__all__ = ["CPU_SHIMS", "Shim", "apply_cpu_shims", "revert_cpu_shims", "cpu_shims_needed", "plan_cpu_shims"]

logger = logging.getLogger("megatron_fcp.patches")

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


# ---- tensor-parallel all-gather ----------------------------------------------------------------
_GATHER_PARAMS = ("input_", "group")


def _make_gather_along_last_dim(original: Callable) -> Callable:
    params = tuple(inspect.signature(inspect.unwrap(original)).parameters)
    if params != _GATHER_PARAMS:
        raise PatchTargetError(
            f"cannot shim megatron.core.tensor_parallel.mappings:_gather_along_last_dim{params} in megatron-core "
            f"{megatron_core_version()}: the CPU shim reimplements _gather_along_last_dim{_GATHER_PARAMS}")

    def _gather_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
        """Megatron's all-gather along the last dim, its buffer on ``input_``'s device: gather
        ``[a*n, ...]`` along dim 0 (rank order), then concatenate the pieces along the last dim."""
        world_size = group.size()
        if world_size == 1:
            return input_
        out = torch.empty((input_.shape[0] * world_size, *input_.shape[1:]), dtype=input_.dtype,
                          device=input_.device)
        torch.distributed.all_gather_into_tensor(out, input_.contiguous(), group=group)
        return torch.cat(out.chunk(world_size, dim=0), dim=-1).contiguous()

    return _gather_along_last_dim


# ---- RoPE --------------------------------------------------------------------------------------
def _rope_table(rope: Any, max_seq_len: int, offset: int) -> torch.Tensor:
    """RoPE table ``[max_seq_len, 1, 1, dim]`` computed where ``inv_freq`` lives (the CPU)."""
    freqs = rope.get_freqs_non_repeated(max_seq_len, offset)  # [s, dim/2]
    if not rope.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)  # [s, dim]
    else:  # interleave: f0 f0 f1 f1 ...
        emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _make_get_emb(original: Callable) -> Callable:
    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """RoPE table ``[max_seq_len, 1, 1, dim]`` on the CPU (0.16+: ``forward`` calls this)."""
        return _rope_table(self, max_seq_len, offset)

    return get_emb


#: The signature ``_make_rope_forward`` reimplements (megatron-core 0.14-0.15).
_ROPE_FORWARD_PARAMS = ("self", "max_seq_len", "offset", "packed_seq")


def _make_rope_forward(original: Callable) -> Callable:
    """0.14-0.15: ``RotaryEmbedding.forward`` moves ``inv_freq`` to CUDA itself (no ``get_emb``).

    The replacement computes the same table on the CPU and slices it per CP rank through the
    rotary module's own ``get_pos_emb_on_this_cp_rank`` binding (looked up at call time, so the
    CPU shim of that function is the one used).
    """
    params = tuple(inspect.signature(inspect.unwrap(original)).parameters)
    if params != _ROPE_FORWARD_PARAMS:
        raise PatchTargetError(
            f"cannot shim {_ROPE}:RotaryEmbedding.forward{params} in megatron-core "
            f"{megatron_core_version()}: the CPU shim reimplements forward{_ROPE_FORWARD_PARAMS}"
        )

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> torch.Tensor:
        """RoPE table ``[s, 1, 1, dim]`` on the CPU, this CP rank's zigzag slice when cp > 1."""
        emb = _rope_table(self, max_seq_len, offset)
        cp_group = getattr(self, "cp_group", None)
        if cp_group is not None and cp_group.size() > 1 and not packed_seq:
            emb = sys.modules[_ROPE].get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb

    return forward


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


def _make_mla_rope(original: type) -> type:
    """MLA builds its ``RotaryEmbedding`` without ``use_cpu_initialization`` (so on the current CUDA
    device); the subclass builds the same ``inv_freq`` on the CPU. Nothing else differs: the RoPE
    table is computed by the (shimmed) ``get_emb`` exactly as the GPT model's own RoPE."""

    class RotaryEmbedding(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["use_cpu_initialization"] = True
            super().__init__(*args, **kwargs)

    RotaryEmbedding.__qualname__ = original.__qualname__
    RotaryEmbedding.__module__ = original.__module__
    return RotaryEmbedding


def _is_te_standin(current: Any) -> bool:
    """Whether a TE class name is megatron-core's no-TE stand-in (not a class) and TE is absent."""
    import importlib.util  # noqa: PLC0415

    return not isinstance(current, type) and importlib.util.find_spec("transformer_engine") is None


def _make_no_te_linear(original: Any) -> type:
    class TELinear:
        """Stand-in for Transformer Engine's ``TELinear`` where TE is not installed: nothing is an
        instance of it, so MLA's ``isinstance(self.linear_proj, TELinear)`` is False, as it is
        for every local-spec layer."""

    return TELinear


# ---- masks -------------------------------------------------------------------------------------
def _make_default_causal_mask(original: Callable) -> Callable:
    @lru_cache(maxsize=8)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        """Upper-triangular True = masked, ``[sq, sq]`` on the CPU."""
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    return get_default_causal_mask


# ---- attention sinks ---------------------------------------------------------------------------
def _make_dpa_init(original: Callable) -> Callable:
    def __init__(self, config, *args: Any, **kwargs: Any) -> None:
        """Megatron's constructor, its ``softmax_offset`` made on the CPU: the original runs with
        ``softmax_type`` "vanilla" (the offset is where it reaches for CUDA), then the offset is
        created as megatron-core creates it (:func:`~megatron_fcp.patches.sinks.make_softmax_offset`),
        at the same point, the end of construction, so the same seed draws the same value."""
        kind = softmax_type_of(config)
        if kind == "vanilla":
            original(self, config, *args, **kwargs)
            return
        config.softmax_type = "vanilla"
        try:
            original(self, config, *args, **kwargs)
        finally:
            config.softmax_type = kind
        del self.softmax_offset                                  # the vanilla constructor's None
        make_softmax_offset(self, config, self.num_attention_heads_per_partition, device=torch.device("cpu"))

    return __init__
def _make_sliding_window_mask(original: Callable) -> Callable:
    def get_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
        """True = masked, ``[sq, skv]`` on the CPU: key ``j`` is visible to query ``i`` iff
        ``i + skv - sq - left <= j <= i + skv - sq + right`` (megatron-core's band, bottom-right aligned)."""
        ones = torch.ones(sq, skv, dtype=torch.bool)
        band = torch.tril(torch.triu(ones, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])
        return ~band

    return get_sliding_window_causal_mask


@dataclass(frozen=True)
class Shim:
    """One CPU shim: ``target`` is replaced by ``make(original)`` where the gate says it is needed.

    ``required``: a missing target is a version error (not skipped). Gate: the target exists and
    its source mentions one of ``cuda_words`` (unreadable source counts as needing the shim).
    """

    target: str
    make: Callable[[Callable], Callable]
    required: bool = True
    cuda_words: tuple[str, ...] = ("cuda", "pin_memory")
    needed: Callable[[Any], bool] | None = None   # replaces the source gate when given

    def skip_reason(self) -> str | None:
        """Why this shim is not needed by the installed megatron-core, or None when it is."""
        try:
            owner, attr = resolve_target(self.target)
        except PatchTargetError:
            if self.required:
                raise
            return f"absent in megatron-core {megatron_core_version()}"
        current = getattr(owner, attr)
        if getattr(current, "__fcp_patched__", False):
            return None  # ours already: installing again is the idempotent no-op
        if self.needed is not None:
            return None if self.needed(current) else f"not needed in megatron-core {megatron_core_version()} here"
        if source_mentions(current, self.cuda_words) is False:
            return f"its megatron-core {megatron_core_version()} source does not use CUDA"
        return None


#: In install order. RoPE has two gated alternatives: ``get_emb`` (0.16+) or ``forward`` (0.14-0.15).
CPU_SHIMS: tuple[Shim, ...] = (
    Shim(f"{_RANDOM}:_get_cuda_rng_state", _make_get_rng_state),
    Shim(f"{_RANDOM}:_set_cuda_rng_state", _make_set_rng_state),
    Shim(f"{_RANDOM}:CudaRNGStatesTracker.add", _make_tracker_add),
    Shim("megatron.core.utils:GlobalMemoryBuffer.get_tensor", _make_get_tensor),
    Shim("megatron.core.tensor_parallel.mappings:_gather_along_last_dim", _make_gather_along_last_dim,
         required=False),
    Shim(f"{_ROPE}:RotaryEmbedding.get_emb", _make_get_emb, required=False),
    Shim(f"{_ROPE}:RotaryEmbedding.forward", _make_rope_forward, required=False),
    Shim(f"{_ROPE}:get_pos_emb_on_this_cp_rank", _make_pos_emb_on_cp_rank),
    Shim("megatron.core.fusions.fused_softmax:get_default_causal_mask", _make_default_causal_mask),
    Shim("megatron.core.transformer.dot_product_attention:DotProductAttention.__init__", _make_dpa_init,
         required=False),
    Shim("megatron.core.fusions.fused_softmax:get_sliding_window_causal_mask", _make_sliding_window_mask,
         required=False),  # 0.15+: the local attention's sliding window (the cp = 1 reference of windowed layers)
    Shim("megatron.core.transformer.multi_latent_attention:RotaryEmbedding", _make_mla_rope, required=False),
    Shim("megatron.core.transformer.multi_latent_attention:TELinear", _make_no_te_linear, required=False,
         needed=_is_te_standin),
)


def cpu_shims_needed() -> bool:
    """True when this process has no usable CUDA device."""
    return not torch.cuda.is_available()


def plan_cpu_shims() -> tuple[list[Shim], dict[str, str]]:
    """``(shims to install, {skipped target: reason})`` for the installed megatron-core."""
    install, skipped = [], {}
    for shim in CPU_SHIMS:
        reason = shim.skip_reason()
        if reason is None:
            install.append(shim)
        else:
            skipped[shim.target] = reason
    return install, skipped


def apply_cpu_shims(force: bool = False) -> list[str]:
    """Install the CPU shims the installed megatron-core needs when CUDA is absent (or ``force``).

    Returns the patched targets. Shims a release does not need are skipped and logged (INFO);
    a required target that is missing raises ``ImportError`` naming the symbol and the version.
    All or nothing: a failure reverts the shims installed by this call. With CUDA present (and
    not forced) this does nothing.
    """
    if not (force or cpu_shims_needed()):
        return []
    check_megatron_version()
    install, skipped = plan_cpu_shims()
    for target, reason in skipped.items():
        logger.info("megatron_fcp: CPU shim %s skipped: %s", target, reason)
    before = set(REGISTRY.targets(GROUP))
    try:
        for shim in install:
            REGISTRY.install(shim.target, shim.make, group=GROUP)
    except BaseException:
        if not before:
            REGISTRY.revert(GROUP)
        raise
    return REGISTRY.targets(GROUP)


def revert_cpu_shims() -> list[str]:
    """Restore every CPU shim exactly; return the restored targets."""
    return REGISTRY.revert(GROUP)
