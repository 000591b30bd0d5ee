"""FCPConfig: the one configuration object of megatron_fcp.

Every field carries a docstring (the string literal right below it); :func:`field_docs` reads them
so that ``--help`` of the generated ``--fcp-*`` flags (see :mod:`megatron_fcp.patches.args`) and
``docs/megatron.md`` say the same thing as this file. ``__post_init__`` validates each value and
its errors name the flag (and YAML key) to change. YAML maps 1:1 onto the fields::

    fcp:
      enabled: true
      graph: hierarchical
      topology: dgx-h100:2
      block_tokens: 4096
      overlap: true
      head_parallel: 2
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import textwrap
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from typing import Any, Mapping

from megatron_fcp.contract.layer_placement import BALANCES
from megatron_fcp.planner.builders import GRAPH_CHOICES
from megatron_fcp.planner.placing import LAYOUT_CHOICES, PACKED_BALANCE
from megatron_fcp.schedule.program import BACKWARD_KV_MODES, RING_BUDGET

__all__ = ["FCPConfig", "KERNELS", "FALLBACKS", "field_docs", "flag_of", "load_yaml"]

#: Block kernels (``megatron_fcp.attention.dispatch.KERNEL_CHOICES``: ``auto`` and the kernel names,
#: kept here so that config stays torch-free; a test checks the two agree).
KERNELS: tuple[str, ...] = ("auto", "math", "cpu-flash", "cuda-flash", "flash-attn")

#: What FCPCoreAttention may do with a layer it cannot serve (``--fcp-fallback``).
FALLBACKS: tuple[str, ...] = ("none", "megatron")

_PRESET_SPEC = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*(:[0-9]+)?$")


def _is_file_spec(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or os.sep in spec


@dataclass(frozen=True, kw_only=True)
class FCPConfig:
    """Flexible Context Parallelism settings (CLI flags, YAML ``fcp:`` section, Python)."""

    enabled: bool = field(default=False, metadata={"flag": "--fcp"})
    """Replace Megatron's context-parallel attention with FCP's graph-scheduled attention."""

    graph: str = field(default="auto", metadata={"choices": GRAPH_CHOICES})
    """Communication graph the KV blocks travel on: auto (chosen from the topology), ring, full,
    hierarchical (rail-striped across nodes, fan-out inside), leader (one uplink per node),
    spanning (max-bandwidth tree)."""

    topology: str = field(default="auto", metadata={"metavar": "SPEC"})
    """Machine topology: auto (ranks per node from LOCAL_WORLD_SIZE), PRESET[:NODES] (dgx-a100,
    dgx-h100, pcie-box, single-uplink; e.g. dgx-h100:2) or a topology FILE.yaml."""

    block_tokens: int = 0
    """Tokens per KV block; a zigzag chunk is cut into chunk_len/block_tokens blocks so transfers
    overlap with compute (4K-8K is a good start on GPUs). 0: the planner chooses the blocks per
    chunk at setup with the head-parallel degree and graph; without the shapes at setup one block
    per chunk, or two where the backward may re-send KV (backward_kv auto/resend at cp > 2)."""

    overlap: bool = True
    """Overlap block transfers with attention compute (off: communicate, then compute)."""

    kernel: str = field(default="auto", metadata={"choices": KERNELS})
    """Block attention kernel: auto (the default: on CUDA flash-attn if installed, else cuda-flash,
    math for FP64; on CPU math; the choice is logged once), math (pure torch, any dtype and device,
    the exact reference), cpu-flash (torch's fused CPU flash ops; FP32/BF16 CPU), cuda-flash
    (torch's CUDA FlashAttention-2 for FP16/BF16, memory-efficient kernel for FP32) or flash-attn
    (the flash-attn package, FP16/BF16 CUDA)."""

    backward_kv: str = field(default="auto", metadata={"choices": BACKWARD_KV_MODES})
    """Received KV between forward and backward: keep (saved: fastest backward, most memory),
    resend (re-sent in backward: holds no more than Transformer Engine's ring) or auto (keep only
    while every rank's kept bytes fit --fcp-kv-memory-budget; the default)."""

    kv_memory_budget: int = field(default=RING_BUDGET, metadata={"metavar": "BYTES"})
    """Bytes of received KV a rank may keep per attention call under --fcp-backward-kv auto; -1
    (the default) means what the ring holds: one KV pair the size of the rank's own shard."""
    timeout_s: float = field(default=300.0, metadata={"metavar": "SECONDS"})
    """Bound on every FCP wait: each round of block transfers and each agreement across the CP
    group. On expiry FCP raises CommTimeout (naming phase, round, peer, block and plan) or
    FCPAgreementError (naming the CP group) instead of hanging."""

    check_numerics: bool = False
    """Debugging: after every FCP attention forward, check that out is finite and lse has no NaN
    or +inf (-inf is a fully masked row); raise FCPNumericsError naming the layer otherwise."""

    fallback: str = field(default="none", metadata={"choices": FALLBACKS})
    """What to do with a layer FCP cannot serve (attention bias, dropout in training, a mask,
    window or softmax FCP does not support): none raises with the reason; megatron runs
    Megatron's own attention class for that layer (Transformer Engine's CP on GPU) and logs it
    once per reason."""

    head_parallel: int | str = field(default="auto", metadata={"metavar": "N|auto"})
    """Head-parallel (Ulysses all-to-all) degree a: groups of a consecutive CP ranks (one node's
    when CP ranks fill nodes) exchange heads with an all-to-all, and FCP's KV stage runs across
    the cp/a groups; 1 turns the stage off, a = cp is pure all-to-all. Must divide the CP size
    and the query heads; KV heads not divisible by a are replicated. auto (the default): the
    planner chooses a at setup, with the graph and block size, by predicted forward + backward time
    (the backward as it runs: waves, KV kept or re-sent) for the run's sequence length, heads and
    topology (logged; 1 when the shapes are not known at setup)."""

    packed_balance: str = field(default=PACKED_BALANCE, metadata={"choices": BALANCES})
    """What a packed (THD) batch's placement balances across CP ranks: layer (the default) the
    attention work and the tokens each, since Megatron's projections and MLP run on the tokens a rank
    holds; attention the attention work alone (fewer KV transfers, but up to several times the mean
    tokens on a rank on batches of many short documents: docs/planner.md, "Layer balance")."""

    packed_layout: str = field(default="auto", metadata={"choices": LAYOUT_CHOICES})
    """Where a packed (THD) batch's tokens go: auto (the default) FCP's placement, or Transformer
    Engine's per-document zigzag run on TE's ring where TE's schedule is predicted faster than
    FCP's plans (compute-bound batches of long documents; docs/planner.md, "TE's layout as a
    candidate"); fcp FCP's placement always; thd TE's layout always."""

    def __post_init__(self) -> None:
        if isinstance(self.head_parallel, str) and self.head_parallel.strip().isdigit():
            object.__setattr__(self, "head_parallel", int(self.head_parallel))  # from the command line
        if self.head_parallel != "auto" and (isinstance(self.head_parallel, bool) or not isinstance(
                self.head_parallel, int) or self.head_parallel < 1):
            raise ValueError(f"--fcp-head-parallel (fcp.head_parallel) must be an integer >= 1 or auto, "
                             f"got {self.head_parallel!r}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"--fcp (fcp.enabled) must be true or false, got {self.enabled!r}")
        if self.graph not in GRAPH_CHOICES:
            raise ValueError(
                f"unknown FCP graph {self.graph!r}: set --fcp-graph (fcp.graph) to one of "
                + ", ".join(GRAPH_CHOICES)
            )
        if not isinstance(self.topology, str) or not self.topology:
            raise ValueError("--fcp-topology (fcp.topology) must be auto, PRESET[:NODES] or FILE.yaml")
        if self.topology != "auto":
            if _is_file_spec(self.topology):
                if not os.path.isfile(self.topology):
                    raise ValueError(
                        f"topology file not found: {self.topology!r}; fix --fcp-topology "
                        "(fcp.topology) or use a preset such as dgx-h100:2"
                    )
            elif not _PRESET_SPEC.match(self.topology):
                raise ValueError(
                    f"--fcp-topology (fcp.topology) {self.topology!r} is not auto, PRESET[:NODES] "
                    "(e.g. dgx-h100:2) or a .yaml file"
                )
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int) or self.block_tokens < 0:
            raise ValueError(
                f"--fcp-block-tokens (fcp.block_tokens) must be an integer >= 0, got {self.block_tokens!r}"
            )
        if not isinstance(self.overlap, bool):
            raise ValueError(f"--fcp-overlap (fcp.overlap) must be true or false, got {self.overlap!r}")
        if self.backward_kv not in BACKWARD_KV_MODES:
            raise ValueError(f"--fcp-backward-kv (fcp.backward_kv) must be one of {', '.join(BACKWARD_KV_MODES)}, "
                             f"got {self.backward_kv!r}")
        if isinstance(self.kv_memory_budget, bool) or not isinstance(self.kv_memory_budget, int) \
                or self.kv_memory_budget < RING_BUDGET:
            raise ValueError(f"--fcp-kv-memory-budget (fcp.kv_memory_budget) must be bytes >= 0 or -1 (the "
                             f"ring's), got {self.kv_memory_budget!r}")
        if self.packed_balance not in BALANCES:
            raise ValueError(f"--fcp-packed-balance (fcp.packed_balance) must be one of {', '.join(BALANCES)}, "
                             f"got {self.packed_balance!r}")
        if self.packed_layout not in LAYOUT_CHOICES:
            raise ValueError(f"--fcp-packed-layout (fcp.packed_layout) must be one of {', '.join(LAYOUT_CHOICES)}, "
                             f"got {self.packed_layout!r}")
        if self.kernel not in KERNELS:
            raise ValueError(
                f"unknown block kernel {self.kernel!r}: set --fcp-kernel (fcp.kernel) to one of " + ", ".join(KERNELS)
            )
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
                or not self.timeout_s > 0 or self.timeout_s == float("inf")):
            raise ValueError(
                f"--fcp-timeout-s (fcp.timeout_s) must be a positive finite number of seconds, got {self.timeout_s!r}"
            )
        if not isinstance(self.check_numerics, bool):
            raise ValueError(f"--fcp-check-numerics (fcp.check_numerics) must be true or false, got {self.check_numerics!r}")
        if self.fallback not in FALLBACKS:
            raise ValueError(
                f"unknown fallback {self.fallback!r}: set --fcp-fallback (fcp.fallback) to one of " + ", ".join(FALLBACKS)
            )

    # ---- derived -----------------------------------------------------------------------------
    def head_parallel_degree(self, cp: int) -> int:
        """The head-parallel degree for a CP group of ``cp`` ranks as configured (``auto``: 1 here;
        ``setup_fcp`` settles ``auto`` with the planner). Raises ValueError naming the flag when the
        degree does not divide ``cp``."""
        degree = 1 if self.head_parallel == "auto" else int(self.head_parallel)
        if cp % degree:
            raise ValueError(f"--fcp-head-parallel {degree} (fcp.head_parallel) must divide the context-parallel "
                             f"size {cp}; use one of {[a for a in range(1, cp + 1) if cp % a == 0]} or auto")
        return degree

    def parts_per_chunk(self, chunk_tokens: int) -> int:
        """Blocks per zigzag chunk of ``chunk_tokens`` tokens (``seq_len / (2*cp)``)."""
        if self.block_tokens == 0 or self.block_tokens >= chunk_tokens:
            return 1
        if chunk_tokens % self.block_tokens:
            raise ValueError(
                f"--fcp-block-tokens {self.block_tokens} must divide the zigzag chunk length "
                f"{chunk_tokens} (= seq_length / (2 * context_parallel_size))"
            )
        return chunk_tokens // self.block_tokens

    # ---- dict / YAML -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "FCPConfig":
        """Build from a mapping of field names (the YAML ``fcp:`` section); unknown keys fail."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown key(s) in the fcp config: {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str) -> "FCPConfig":
        """Load the ``fcp:`` section of a YAML file (or the whole file if it has none)."""
        data = load_yaml(path)
        return cls.from_dict(data.get("fcp", data) if isinstance(data, dict) else data)

    def to_yaml(self) -> str:
        import yaml  # noqa: PLC0415

        return yaml.safe_dump({"fcp": self.to_dict()}, sort_keys=False)

    def replace(self, **changes: Any) -> "FCPConfig":
        """A copy with ``changes`` applied (and validated)."""
        return type(self).from_dict({**self.to_dict(), **changes})


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping; errors name the file."""
    import yaml  # noqa: PLC0415

    if not os.path.isfile(path):
        raise ValueError(f"config file not found: {path!r}")
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping at the top level, got {type(data).__name__}")
    return data


def flag_of(name: str) -> str:
    """The command-line flag of field ``name`` (``block_tokens`` -> ``--fcp-block-tokens``)."""
    for f in fields(FCPConfig):
        if f.name == name:
            return f.metadata.get("flag", "--fcp-" + name.replace("_", "-"))
    raise KeyError(name)


@lru_cache(maxsize=None)
def field_docs(cls: type = FCPConfig) -> dict[str, str]:
    """``{field: docstring}`` from the string literal that follows each field in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs
