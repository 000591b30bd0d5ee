"""CUDA stand-ins that let megatron.training's real ``pretrain()`` run on CPU with gloo (tests only).

Testing support, never on the product's path: :mod:`tests.megatron_driver.run_cpu` installs these
before it runs a pretrain script. Megatron-LM's training loop (0.17-0.19) assumes a GPU in the
places below; each stand-in replaces exactly that, and is *named* (the harness records which were
installed) and *gated* (a megatron-core release range and the existence of its target; an absent
target is skipped, not an error). The model's own CPU needs are megatron_fcp's CPU shims
(:mod:`megatron_fcp.patches.cpu`), installed here too.

=========================================  =====================================================
stand-in                                    why
=========================================  =====================================================
``torch.cuda.<fn>`` (device count 1, a      ``_initialize_distributed`` skips model-parallel init
no-op ``set_device``/``synchronize``/...,   when ``device_count()`` is 0; timers, memory reports
zero memory figures, fake streams/events)   and the rerun state machine call these every step
``torch.cuda.get_rng_state``/``manual_seed`` the rerun state machine saves the CUDA RNG; seeds go to
                                            a separate generator (:data:`CUDA_GENERATOR`)
``initialize_megatron(allow_no_cuda=True)`` it asserts ``torch.cuda.is_available()`` otherwise
``arguments.get_device_arch_version`` -> 0  ``validate_args`` (cp > 1) asks it only to choose
                                            which CUDA_DEVICE_MAX_CONNECTIONS advice to print
``datasets.utils.compile_helpers`` no-op     the wheel ships the built helpers but no Makefile
``training.set_jit_fusion_options`` no-op   it warms up (``torch.compile``, several seconds a rank
                                            on CPU) fused bias-GeLU/dropout-add kernels for CUDA;
                                            the runs turn those fusions off
``CudaToCpu`` (a ``TorchFunctionMode``)     ``device="cuda"``/``.cuda()``/``pin_memory`` ->
                                            CPU; ``t.type()`` reads ``torch.cuda.*`` (``clip_grads``
                                            asserts it); random tensors made "on cuda" (the JIT
                                            warm-up's, whose sizes depend on cp) draw from
                                            :data:`CUDA_GENERATOR`, not the CPU generator the
                                            weights are initialised from
=========================================  =====================================================
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

__all__ = ["CUDA_GENERATOR", "CudaToCpu", "STANDINS", "install_cpu_standins"]

#: stands for the CUDA default generator: "cuda" random draws must not advance the CPU generator
CUDA_GENERATOR = torch.Generator()
_RANDOM = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal, torch.bernoulli}


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # Megatron passes torch.cuda.current_device() == 0
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpu(torch.overrides.TorchFunctionMode):
    """Every torch call: CUDA devices -> CPU, ``.cuda()``/``.pin_memory()`` -> self, and
    ``Tensor.type()`` reported as ``torch.cuda.*``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
            if func in _RANDOM and kwargs.get("generator") is None:
                kwargs["generator"] = CUDA_GENERATOR
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _Event()

    def query(self):
        return True


class _Event:
    def __init__(self, *a, **k):
        self._t = 0.0

    def record(self, *a, **k):
        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, *a, **k):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 1000.0 * (other._t - self._t)


def _const(value):
    return lambda *a, **k: value


#: torch.cuda attribute -> stand-in (all releases of megatron.training, 0.17-0.19)
_TORCH_CUDA = {
    "current_device": _const(0), "device_count": _const(1), "set_device": _const(None),
    "synchronize": _const(None), "empty_cache": _const(None), "reset_peak_memory_stats": _const(None),
    "reset_max_memory_allocated": _const(None), "memory_allocated": _const(0),
    "max_memory_allocated": _const(0), "memory_reserved": _const(0), "max_memory_reserved": _const(0),
    "get_device_capability": _const((9, 0)), "get_device_name": _const("cpu"),
    "get_rng_state": lambda *a, **k: CUDA_GENERATOR.get_state(),
    "set_rng_state": lambda state, *a, **k: CUDA_GENERATOR.set_state(state),
    "manual_seed": lambda seed: CUDA_GENERATOR.manual_seed(int(seed)),
    "manual_seed_all": lambda seed: CUDA_GENERATOR.manual_seed(int(seed)),
    "current_stream": lambda *a, **k: _Stream(), "default_stream": lambda *a, **k: _Stream(),
    "set_stream": _const(None), "stream": lambda *a, **k: contextlib.nullcontext(),
    "Stream": _Stream, "Event": _Event,
}


@dataclass(frozen=True)
class Standin:
    name: str
    since: tuple[int, int]  # megatron-core releases [since, until) that need it
    until: tuple[int, int]
    install: Callable[[], bool]  # False: its target is absent in this release (skipped)


def _torch_cuda() -> bool:
    for name, value in _TORCH_CUDA.items():
        setattr(torch.cuda, name, value)
    return True


def _allow_no_cuda() -> bool:
    import megatron.training.training as training

    training.initialize_megatron = partial(training.initialize_megatron, allow_no_cuda=True)
    return True


def _device_arch() -> bool:
    import megatron.training.arguments as arguments

    if not hasattr(arguments, "get_device_arch_version"):
        return False
    arguments.get_device_arch_version = lambda: 0
    return True


def _compile_helpers() -> bool:
    import megatron.core.datasets.utils as utils

    if not hasattr(utils, "compile_helpers"):
        return False
    utils.compile_helpers = lambda: None
    return True


def _no_jit_warmup() -> bool:
    import megatron.training.training as training

    if not hasattr(training, "set_jit_fusion_options"):
        return False
    training.set_jit_fusion_options = lambda *a, **k: None
    return True


def _fcp_cpu_shims() -> bool:
    from megatron_fcp.patches.cpu import apply_cpu_shims

    apply_cpu_shims()
    return True


def _cuda_to_cpu() -> bool:
    CudaToCpu().__enter__()  # for the rest of the process
    return True


STANDINS: tuple[Standin, ...] = (
    Standin("torch.cuda functions (count 1, no-op sync, zero memory, fake streams/events, RNG)",
            (0, 17), (0, 20), _torch_cuda),
    Standin("megatron.training.training:initialize_megatron(allow_no_cuda=True)", (0, 17), (0, 20), _allow_no_cuda),
    Standin("megatron.training.arguments:get_device_arch_version -> 0", (0, 17), (0, 20), _device_arch),
    Standin("megatron.core.datasets.utils:compile_helpers (no-op)", (0, 17), (0, 20), _compile_helpers),
    Standin("megatron.training.training:set_jit_fusion_options (no-op)", (0, 17), (0, 20), _no_jit_warmup),
    Standin("megatron_fcp.patches.cpu shims (RNG tracker, buffers, RoPE, causal mask)", (0, 14), (0, 20),
            _fcp_cpu_shims),
    Standin("TorchFunctionMode CudaToCpu (cuda devices, .cuda(), pin_memory, Tensor.type, cuda RNG draws)",
            (0, 17), (0, 20), _cuda_to_cpu),
)


def install_cpu_standins() -> list[str]:
    """Install every stand-in whose release range holds the installed megatron-core; their names."""
    from megatron_fcp.patches import _version_tuple, megatron_core_version

    version = _version_tuple(megatron_core_version())
    return [s.name for s in STANDINS if s.since <= version < s.until and s.install()]
