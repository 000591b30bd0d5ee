#!/usr/bin/env python
"""Pretrain a megatron-core GPTModel with FCP context parallelism (CPU/gloo or GPU/NCCL).

    torchrun --nproc-per-node 4 examples/pretrain_gpt_fcp.py \\
        --config examples/configs/tiny_cpu_cp4.yaml --metrics-json /tmp/fcp.json

The YAML run config sets Megatron's arguments (tp/cp sizes, sequence length, model sizes,
iterations) and an ``fcp:`` section; flags with Megatron's names (``--context-parallel-size 2``)
and the ``--fcp-*`` flags override it. Without CUDA the script runs on gloo with megatron-core's
local spec and :mod:`megatron_fcp.patches.cpu`; with CUDA on NCCL with the Transformer Engine
spec when TE is installed (``--transformer-impl`` chooses).

What one step does (``global_batch = micro_batch x dp x microbatches``, as in Megatron):

1. every rank draws the same synthetic global batch for the step (seeded by step), keeps its
   data-parallel slice and cuts each sequence with Megatron's own ``get_batch_on_this_cp_rank``
   (zigzag: CP rank r keeps chunks r and 2cp-1-r), called through
   :func:`megatron_fcp.patches.compat.cp_batch_splitter` since its signature differs between
   megatron-core releases;
2. forward + backward per micro batch; the loss is ``sum(token losses) / global tokens`` so that
   summing gradients over the data-parallel x context-parallel group gives the global mean;
3. gradients are all-reduced over that group, the global grad norm is taken over unique
   parameters (TP shards summed over the TP group), clipped, and the optimizer steps.

The synthetic sequences are arithmetic progressions ``(start + stride*t) mod vocab`` with a random
stride per sequence: the next token is predictable only by attending to earlier tokens, so the
loss falls only if context-parallel attention is right.

``main()`` is the torchrun entry; :func:`run_worker` is the same run for an already initialised
process group (``megatron_fcp.testing.launch.run_gloo(run_worker, 4, argv)``), used by the tests.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import os
import sys
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

try:
    import megatron_fcp  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_fcp.config import FCPConfig  # noqa: E402
from megatron_fcp.patches.args import add_fcp_args, apply_yaml_defaults, fcp_config_from_args  # noqa: E402

logger = logging.getLogger("pretrain_gpt_fcp")

__all__ = ["build_parser", "parse_args", "validate_run", "train", "run_worker", "main"]


# ---- arguments -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """Megatron's flag names for what this example uses, plus ``--fcp-*`` and ``--config``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", metavar="FILE.yaml", help="YAML run config (flags override it)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=32)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=None, help="GQA groups (default: MHA)")
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=128)
    g.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"), default="rope")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated SiLU)")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in linear layers")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--softmax-type", choices=("vanilla", "off-by-one", "learnable"), default="vanilla",
                   help="attention sinks (megatron-core 0.15+): off-by-one adds 1 to every softmax denominator, "
                        "learnable a trained logit per head")
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--window-size", type=_window_arg, default=None, metavar="LEFT,RIGHT",
                   help="sliding-window attention (Megatron's window_size; causal: W,0)")
    g.add_argument("--window-attn-skip-freq", type=int, default=None,
                   help="every N-th layer full attention, the others windowed (Megatron's rule)")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--transformer-impl", choices=("auto", "local", "transformer_engine"), default="auto",
                   help="auto: transformer_engine on CUDA when installed, else local")
    g.add_argument("--bf16", action="store_true", help="BF16 parameters and compute (GPU)")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-style MLA (MLATransformerConfig): K and V of different head sizes")
    g.add_argument("--q-lora-rank", type=int, default=None, help="MLA: query compression rank (default none)")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="MLA: KV compression rank")
    g.add_argument("--qk-head-dim", type=int, default=32, help="MLA: query/key head size without RoPE")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=16, help="MLA: query/key RoPE head size")
    g.add_argument("--v-head-dim", type=int, default=24, help="MLA: value head size")
    g.add_argument("--recompute-granularity", choices=("selective", "full"), default=None,
                   help="activation recomputation: selective (the core attention is recomputed in "
                        "backward) or full (whole layers; with --recompute-method/--recompute-num-layers)")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="full recomputation: uniform or block (default uniform)")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="full recomputation: layers per unit (default 1)")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro x data-parallel size")
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--dist-backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="process-group backend (auto: nccl with CUDA, else gloo); gloo with --device cuda runs "
                        "several ranks on one GPU (KV staged through host memory: a check, not a fast path)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs (auto: CUDA with the nccl backend, else CPU)")
    g = p.add_argument_group("packed documents")
    g.add_argument("--packed", action="store_true",
                   help="train on packed batches (THD): each sequence is several documents of lognormal "
                        "lengths; FCP places them (short documents whole on one rank)")
    g.add_argument("--packed-log-mean", type=float, default=3.0, help="log-mean of document lengths (median exp(m))")
    g.add_argument("--packed-log-sigma", type=float, default=1.0, help="log-sigma of document lengths")
    g = p.add_argument_group("output")
    g.add_argument("--metrics-json", metavar="PATH", help="rank 0 writes losses, grad norms, FCP info")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bar (log lines only)")
    add_fcp_args(p)
    return p


def _window_arg(text: str) -> tuple[int, int]:
    from megatron_fcp.contract.mask import parse_window  # noqa: PLC0415

    try:
        return parse_window(text, "--window-size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, FCPConfig]:
    """Parse ``argv``: YAML (``--config``) first as defaults, then the flags given."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    yaml_fcp: dict[str, Any] = {}
    if pre.config:
        yaml_fcp = apply_yaml_defaults(parser, pre.config)
    args = parser.parse_args(argv)
    fcp = fcp_config_from_args(args, base=FCPConfig.from_dict(yaml_fcp))
    return args, fcp


def validate_run(args: argparse.Namespace, fcp: FCPConfig, world: int):
    """Check the run before anything starts; return the :class:`MegatronLayout`.

    Errors (``ValueError``) name the flag to change: cp (or tp/pp) not dividing the world, a
    sequence not splittable into ``2*cp`` chunks, pipeline parallelism (not in this example),
    FCP's topology missing or smaller than the world.
    """
    from megatron_fcp.patches.runtime import resolve_topology  # noqa: PLC0415
    from megatron_fcp.planner.megatron_layout import MegatronLayout  # noqa: PLC0415

    layout = MegatronLayout(world=world, tp=args.tensor_model_parallel_size,
                            pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size)
    if layout.pp != 1:
        raise ValueError("--pipeline-model-parallel-size must be 1 in this example")
    if args.packed:
        if args.micro_batch_size != 1:
            raise ValueError("--packed needs --micro-batch-size 1 (one packed sequence per micro-batch, "
                             "as Megatron's THD format)")
        if layout.cp > 1 and not fcp.enabled:
            raise ValueError("--packed with --context-parallel-size > 1 needs --fcp (this example has no "
                             "Transformer Engine THD path)")
        if args.position_embedding_type != "rope":
            raise ValueError("--packed needs --position-embedding-type rope (positions restart per document)")
    elif args.seq_length % (2 * layout.cp):
        raise ValueError(f"--seq-length {args.seq_length} must be divisible by 2 x "
                         f"--context-parallel-size = {2 * layout.cp}")
    if args.num_attention_heads % layout.tp:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} must be divisible by "
                         f"--tensor-model-parallel-size {layout.tp}")
    global_batch = args.global_batch_size or args.micro_batch_size * layout.dp
    if global_batch % (args.micro_batch_size * layout.dp):
        raise ValueError(f"--global-batch-size {global_batch} must be a multiple of --micro-batch-size x "
                         f"data-parallel size = {args.micro_batch_size * layout.dp}")
    if fcp.enabled:
        resolve_topology(fcp.topology, world)
        if args.attention_dropout > 0:
            raise ValueError("FCP needs --attention-dropout 0")
    return layout


# ---- pieces of a run ---------------------------------------------------------------------------------
def _synthetic_batch(step: int, batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """``[batch, seq+1]`` arithmetic progressions mod ``vocab`` (identical on every rank)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 8, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq + 1)[None, :]) % vocab


def _packed_sample(step: int, sample: int, args: argparse.Namespace) -> tuple[list[int], dict[str, torch.Tensor]]:
    """One packed sequence (identical on every rank): document lengths (seeded lognormal, summing to
    ``--seq-length``) and ``[1, seq]`` tokens, labels, loss mask. Each document is an arithmetic
    progression mod vocab; its last token has no next token in the document (loss mask 0)."""
    from megatron_fcp.contract.placement import lognormal_lengths  # noqa: PLC0415

    seed = (args.seed * 1_000_003 + step) * 4099 + sample
    lengths = lognormal_lengths(args.packed_log_mean, args.packed_log_sigma, args.seq_length, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tokens, labels, mask = [], [], []
    for n in lengths:
        start = torch.randint(0, args.vocab_size, (1,), generator=gen)
        stride = torch.randint(1, 8, (1,), generator=gen)
        doc = (start + stride * torch.arange(n + 1)) % args.vocab_size  # [n+1]
        tokens.append(doc[:-1])
        labels.append(doc[1:])
        mask.append(torch.cat([torch.ones(n - 1), torch.zeros(1)]))
    batch = {"tokens": torch.cat(tokens)[None], "labels": torch.cat(labels)[None],
             "loss_mask": torch.cat(mask)[None], "position_ids": torch.arange(args.seq_length)[None]}
    return lengths, batch


def _kv_memory_report(runtime, args: argparse.Namespace, layout, dtype: torch.dtype) -> dict[str, Any]:
    """Layer 1's KV bytes of its latest call (measured by FCPStats) beside the ring's in-flight KV:
    one KV pair the size of this rank's shard (local tokens x 2 x KV heads of the TP partition x d)."""
    stats = runtime.stats[min(runtime.stats)]
    kv_heads = (args.num_attention_heads if args.multi_latent_attention
                else args.num_query_groups or args.num_attention_heads) // layout.tp
    tokens = args.seq_length // layout.cp  # the packed placement gives about as many per rank
    d_k, d_v = _head_dims(args)
    per_token = kv_heads * (d_k + d_v) * torch.tensor([], dtype=dtype).element_size()
    return {"backward_kv": stats.backward_kv, "saved_kv_bytes": stats.saved_kv_bytes,
            "peak_kv_bytes": stats.peak_kv_bytes, "backward_peak_kv_bytes": stats.backward_peak_kv_bytes,
            "resend_bytes_sent": stats.resend_bytes_sent,
            "ring_in_flight_kv_bytes": tokens * per_token,
            "head_parallel_bytes_sent": stats.head_parallel_bytes_sent}


def _head_dims(args: argparse.Namespace) -> tuple[int, int]:
    """(query/key head size, value head size): MLA's are qk_head_dim + qk_pos_emb_head_dim and v_head_dim."""
    if args.multi_latent_attention:
        return args.qk_head_dim + args.qk_pos_emb_head_dim, args.v_head_dim
    return (args.hidden_size // args.num_attention_heads,) * 2


def _transformer_config(args: argparse.Namespace, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig  # noqa: PLC0415

    mla: dict[str, Any] = {}
    if args.multi_latent_attention:  # rope_type "rope": Megatron's RotaryEmbedding (yarn needs its fused kernels)
        mla = dict(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                   qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim, rope_type="rope",
                   rotary_base=args.rotary_base)
    return (MLATransformerConfig if mla else TransformerConfig)(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        normalization=args.normalization, gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        perform_initialization=True, masked_softmax_fusion=False,  # Megatron's fused softmax needs apex-era CUDA extensions
        **_window_kwargs(args), **_recompute_kwargs(args), **_softmax_kwargs(args), **mla,
    )


def _window_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``window_size`` (and ``window_attn_skip_freq``) where given (megatron-core 0.14 has no
    ``window_attn_skip_freq``: refused there; its window applies to every layer)."""
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    if args.window_size is None:
        if args.window_attn_skip_freq is not None:
            raise ValueError("--window-attn-skip-freq needs --window-size")
        return {}
    out: dict[str, Any] = {"window_size": args.window_size}
    if args.window_attn_skip_freq is not None:
        if "window_attn_skip_freq" not in inspect.signature(TransformerConfig).parameters:
            raise ValueError("--window-attn-skip-freq needs megatron-core 0.15 or later (TransformerConfig has no "
                             "window_attn_skip_freq here: the window applies to every layer); drop it")
        out["window_attn_skip_freq"] = args.window_attn_skip_freq
    return out


def _softmax_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``softmax_type`` where it is not vanilla (megatron-core 0.14 has no such field: refused there)."""
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    if args.softmax_type == "vanilla":
        return {}
    if "softmax_type" not in inspect.signature(TransformerConfig).parameters:
        raise ValueError(f"--softmax-type {args.softmax_type} needs megatron-core 0.15 or later (TransformerConfig "
                         "has no softmax_type here); drop --softmax-type")
    return {"softmax_type": args.softmax_type}


def _recompute_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """TransformerConfig fields for Megatron's activation recomputation (selective: core attention)."""
    if args.recompute_granularity is None:
        return {}
    if args.recompute_granularity == "selective":
        kw: dict[str, Any] = {"recompute_granularity": "selective"}
        from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

        if "recompute_modules" in inspect.signature(TransformerConfig).parameters:
            kw["recompute_modules"] = ["core_attn"]  # megatron-core >= 0.13 names what to recompute
        return kw
    return {"recompute_granularity": "full", "recompute_method": args.recompute_method or "uniform",
            "recompute_num_layers": args.recompute_num_layers or 1}


def _layer_spec(impl: str, normalization: str = "LayerNorm", mla: bool = False):
    from megatron.core.models.gpt import gpt_layer_specs as specs  # noqa: PLC0415

    if impl == "auto":
        impl = "local"
        if torch.cuda.is_available():
            try:
                import transformer_engine  # noqa: F401, PLC0415

                impl = "transformer_engine"
            except ImportError:
                pass
    if impl == "transformer_engine":
        return impl, specs.get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=mla)
    return impl, specs.get_gpt_layer_local_spec(normalization=normalization, multi_latent_attention=mla)


def _float16_module(model: torch.nn.Module) -> torch.nn.Module:
    """Megatron's ``Float16Module``: casts the whole model to the config's half type and the loss to FP32.

    ``params_dtype`` alone leaves the torch ``LayerNorm``/``RMSNorm`` of the local spec in FP32; CPU
    kernels accept the mix, CUDA's ``layer_norm`` does not ("expected scalar type BFloat16 but found
    Float"), so the example wraps the model as ``megatron.training`` does for ``--bf16``.
    """
    from megatron.core.transformer.module import Float16Module  # noqa: PLC0415

    return Float16Module(model.config, model)


def _grad_norm(model: torch.nn.Module, tp_group, device: torch.device) -> float:
    """Global L2 norm of gradients over unique parameters (TP shards summed over ``tp_group``)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate  # noqa: PLC0415

    sq = torch.zeros(1, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    for p in model.parameters():
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
            sq += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(sq, group=tp_group)
    return math.sqrt(float(sq))


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:
        return None
    return tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)


# ---- the run ---------------------------------------------------------------------------------------
def _process_groups() -> set:
    """The process groups this process holds now (torch's registry)."""
    return set(dist.distributed_c10d._world.pg_map)


def _destroy_groups_since(before: set) -> None:
    """Destroy the process groups created since ``before`` (Megatron's and FCP's of one training).

    ``destroy_model_parallel`` only forgets megatron-core's groups; each gloo group keeps its
    connection threads (two per peer) until destroyed, so trainings run one after another in a
    process would pile them up. Destroying a group is local: no rank waits for another.
    """
    for group in sorted(_process_groups() - before, key=lambda g: dist.distributed_c10d._world.pg_names[g],
                        reverse=True):
        dist.destroy_process_group(group)


def train(
    args: argparse.Namespace,
    fcp: FCPConfig,
    *,
    transport_factory: Callable[[Any], Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train on the initialised default process group; return the metrics (every rank).

    ``transport_factory(group) -> Transport`` replaces FCP's transport (tests count transfers).
    Leaves megatron-core as it found it: model-parallel state destroyed, FCP patches reverted.
    """
    from megatron.core import parallel_state as ps  # noqa: PLC0415
    from megatron.core import tensor_parallel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: PLC0415

    from megatron_fcp.patches.compat import cp_batch_splitter  # noqa: PLC0415
    from megatron_fcp.patches.cpu import apply_cpu_shims  # noqa: PLC0415
    from megatron_fcp.patches.megatron import apply_fcp, assert_model_uses_fcp, revert_fcp  # noqa: PLC0415
    from megatron_fcp.patches.packed import prefetch_packed_batch, shard_packed_batch  # noqa: PLC0415
    from megatron_fcp.patches.runtime import setup_fcp  # noqa: PLC0415
    from megatron_fcp.patches.te_spec import model_windows  # noqa: PLC0415

    rank, world = dist.get_rank(), dist.get_world_size()
    say = log or (lambda msg: print(msg, flush=True) if rank == 0 else None)
    layout = validate_run(args, fcp, world)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()
                                         and dist.get_backend() == "nccl")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if not use_cuda:
        apply_cpu_shims()

    groups_before = _process_groups()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=1,
        context_parallel_size=layout.cp, create_gloo_process_groups=False,
    )
    try:
        torch.manual_seed(args.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        info: dict[str, Any] = {"enabled": fcp.enabled, "cp": layout.cp, "tp": layout.tp, "dp": layout.dp,
                                "graph": None, "topology": fcp.topology, "plan_ranks": None}
        tconfig = _transformer_config(args, dtype)
        if fcp.enabled:
            apply_fcp(fcp)
            heads = args.num_attention_heads
            kv_heads = heads if args.multi_latent_attention else args.num_query_groups or heads  # MLA: no groups
            runtime = setup_fcp(
                fcp, seq_len=None if args.packed else args.seq_length, heads=heads, kv_heads=kv_heads,
                head_dim=_head_dims(args)[0], v_head_dim=_head_dims(args)[1] if args.multi_latent_attention else None,
                dtype_bytes=torch.tensor([], dtype=dtype).element_size(),
                micro_batch=args.micro_batch_size, windows=model_windows(tconfig),
            )
            runtime.transport_factory = transport_factory
            runtime.record_stats = True  # each layer's latest FCPStats: KV held, peak, re-sent
            if layout.cp > 1 and args.packed:  # plans follow each micro-batch's documents: show the first
                lengths, _ = _packed_sample(0, 0, args)
                cp_ranks = tuple(ps.get_context_parallel_global_ranks())
                degree, packed_layout = runtime.packed_choice(cp_ranks, tuple(lengths))
                if degree == 1:
                    plan, placed, over = runtime.packed_plan(cp_ranks, tuple(lengths)), None, "CP ranks"
                else:  # the KV stage runs over the head groups: their placement and plan are what to show
                    hp = runtime.packed_head_parallel(cp_ranks, tuple(lengths), causal=True,  # heads per TP rank
                                                      heads=heads // layout.tp, kv_heads=max(1, kv_heads // layout.tp))
                    plan, placed, over = hp.kv_plan, hp.group_placement, f"{len(hp.head_groups)} head groups"
                placed = placed or plan.placement
                info.update(graph=plan.name, backward_graph=plan.backward_plan.name, topology=runtime.topology.name,
                            plan_ranks=list(cp_ranks), rounds=len(plan.rounds), transfers=plan.num_transfers(),
                            packed=True, head_parallel=degree, packed_layout=packed_layout)
                say(f"FCP packed: first micro-batch {lengths}, head-parallel degree {degree}, {packed_layout} layout; "
                    f"placement over the "
                    f"{over}:\n{placed.summary()}\n{plan.round_table()}")
            elif layout.cp > 1:
                plan = runtime.plan(tuple(ps.get_context_parallel_global_ranks()), causal=True,
                                    parts_per_chunk=runtime.parts_per_chunk(args.seq_length // layout.cp))
                info.update(graph=plan.name, topology=runtime.topology.name,
                            plan_ranks=list(plan.ranks), rounds=len(plan.rounds),
                            transfers=plan.num_transfers(), head_parallel=runtime.head_parallel_degree(),
                            schedule=runtime.schedule_report())
                say(runtime.summary(0))
        impl, spec = _layer_spec(args.transformer_impl, args.normalization, args.multi_latent_attention)
        if (args.packed or args.multi_latent_attention) and impl == "local":
            # Megatron's local attention refuses THD and MLA's k_channels/v_channels: FCP's spec route
            # (at cp = 1 FCPCoreAttention is torch's SDPA, the reference)
            from megatron_fcp.patches.megatron import FCPCoreAttention  # noqa: PLC0415

            spec.submodules.self_attention.submodules.core_attention = FCPCoreAttention
        model = GPTModel(
            config=tconfig, transformer_layer_spec=spec,
            vocab_size=args.vocab_size, max_sequence_length=args.max_position_embeddings or args.seq_length,
            position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        ).to(device)
        if dtype != torch.float32:  # as Megatron's training does: every parameter in BF16, norms included
            model = _float16_module(model)
        if fcp.enabled:
            info["fcp_modules"] = assert_model_uses_fcp(model)
            from megatron_fcp.patches.runtime import current_runtime  # noqa: PLC0415

            runtime = current_runtime()
            if runtime is not None:  # which layers FCP serves, with which plan (or why not)
                info["layers"] = {str(n): e for n, e in sorted(runtime.layer_report.items())}
                served = sorted(n for n, e in runtime.layer_report.items() if e["attention"] == "fcp")
                say(f"FCP serves layers {served}; Megatron's attention: "
                    f"{sorted(set(runtime.layer_report) - set(served)) or 'none'}")
        say(f"model: GPTModel {args.num_layers} layers, hidden {args.hidden_size}, "
            f"{sum(p.numel() for p in model.parameters())} params/rank, spec {impl}, "
            f"world {world} = tp {layout.tp} x cp {layout.cp} x dp {layout.dp}, device {device}")
        info["param_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

        split_for_cp = cp_batch_splitter()  # get_batch_on_this_cp_rank, whatever its signature
        dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        tp_group = ps.get_tensor_model_parallel_group()
        dp_rank, dp = ps.get_data_parallel_rank(), layout.dp
        mbs = args.micro_batch_size
        global_batch = args.global_batch_size or mbs * dp
        microbatches = global_batch // (mbs * dp)
        tokens_per_step = global_batch * args.seq_length
        if args.packed:  # loss over the tokens that have a next token inside their document
            samples = [_packed_sample(step, n, args) for step in range(args.train_iters) for n in range(global_batch)]
            loss_tokens = [sum(float(b["loss_mask"].sum()) for _, b in samples[i * global_batch:(i + 1) * global_batch])
                           for i in range(args.train_iters)]

        losses: list[float] = []
        grad_norms: list[float] = []
        planned_ahead = 0
        bar = _progress(args.train_iters, rank == 0 and not args.no_progress)
        t0 = time.perf_counter()
        model.train()
        for step in range(args.train_iters):
            data = _synthetic_batch(step, global_batch, args.seq_length, args.vocab_size, args.seed)
            mine = data.view(dp, microbatches, mbs, -1)[dp_rank]  # [microbatches, mbs, seq+1]
            optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
            for m in range(microbatches):
                if args.packed:  # THD: this rank's tokens in FCP's placement of the documents
                    here = step * global_batch + dp_rank * microbatches + m
                    lengths, whole = samples[here]
                    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
                    # the next micro-batch's plans are made in the background while this one runs
                    # (Note [Planning a packed batch ahead]); the data loader knows its lengths now
                    after = here + 1 if m + 1 < microbatches else (step + 1) * global_batch + dp_rank * microbatches
                    if fcp.enabled and step * microbatches + m + 1 < args.train_iters * microbatches:
                        nxt = samples[after][0]
                        planned_ahead += prefetch_packed_batch([0, *torch.tensor(nxt).cumsum(0).tolist()]) is not None
                    batch, packed = shard_packed_batch(whole, cu)
                    batch = {k: v.to(device) for k, v in batch.items()}
                    token_loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                                       packed_seq_params=packed)
                    loss = (token_loss.float() * batch["loss_mask"]).sum() / loss_tokens[step]
                    loss.backward()
                    loss_sum += loss.detach().double()
                    continue
                seq = mine[m]
                batch = {
                    "tokens": seq[:, :-1].contiguous(),
                    "labels": seq[:, 1:].contiguous(),
                    "position_ids": torch.arange(args.seq_length)[None, :].expand(mbs, -1).contiguous(),
                }
                batch = split_for_cp(batch)  # zigzag: [mbs, seq/cp]
                batch = {k: v.to(device) for k, v in batch.items()}
                token_loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                loss = token_loss.float().sum() / tokens_per_step  # [mbs, seq/cp] -> scalar
                loss.backward()
                loss_sum += loss.detach().double()
            for p in model.parameters():
                if p.grad is not None:
                    g = p.grad.float()  # FP32 sum (and gloo has no BF16 reduction on CUDA tensors)
                    dist.all_reduce(g, group=dp_cp_group)
                    p.grad.copy_(g)
            dist.all_reduce(loss_sum, group=dp_cp_group)
            norm = _grad_norm(model, tp_group, device)
            if args.clip_grad > 0 and norm > args.clip_grad:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(args.clip_grad / (norm + 1e-6))
            optimizer.step()
            losses.append(float(loss_sum))
            grad_norms.append(norm)
            if bar is not None:
                bar.set_postfix(loss=f"{losses[-1]:.4f}", gnorm=f"{norm:.3f}")
                bar.update(1)
            elif rank == 0 and log is None and args.no_progress:
                say(f"step {step + 1:4d}/{args.train_iters}  loss {losses[-1]:.6f}  grad norm {norm:.4f}")
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - t0
        say(f"done: {args.train_iters} steps in {elapsed:.1f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        if fcp.enabled and layout.cp > 1 and runtime.stats:
            info["kv_memory"] = _kv_memory_report(runtime, args, layout, dtype)
            m = info["kv_memory"]
            say(f"KV per layer (rank 0, last micro-batch): backward_kv={m['backward_kv']}, held between forward "
                f"and backward {m['saved_kv_bytes']} B, peak received {m['peak_kv_bytes']} B (within backward "
                f"{m['backward_peak_kv_bytes']} B), re-sent "
                f"{m['resend_bytes_sent']} B; Transformer Engine's ring saves its last received shard "
                f"({m['ring_in_flight_kv_bytes']} B) between the passes and holds that much in flight")
        if args.packed and fcp.enabled:
            info["planned_ahead"] = planned_ahead  # micro-batches whose plans were made while the previous ran
            info["microbatches"] = microbatches
            if layout.cp > 1:
                say(f"packed: {planned_ahead} of {args.train_iters * microbatches} micro-batches planned in the "
                    "background while the one before ran (prefetch_packed_batch)")
        metrics = {"losses": losses, "grad_norms": grad_norms, "fcp": info, "seconds": elapsed}
        if args.softmax_type != "vanilla":  # this rank's sink logits after training (its TP heads)
            metrics["softmax_offset"] = {n: p.detach().double().tolist() for n, p in model.named_parameters()
                                         if n.endswith("softmax_offset")}
        if args.metrics_json and rank == 0:
            with open(args.metrics_json, "w", encoding="utf-8") as fh:
                json.dump(metrics, fh, indent=1)
        return metrics
    finally:
        revert_fcp()
        ps.destroy_model_parallel()
        _destroy_groups_since(groups_before)


def run_worker(rank: int, world: int, argv: Sequence[str]) -> dict[str, Any]:
    """``run_gloo`` entry: parse ``argv`` and train on the already initialised group."""
    del rank, world
    warnings.filterwarnings("ignore", module="megatron")
    args, fcp = parse_args(list(argv))
    return train(args, fcp)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """torchrun entry: validate, initialise the default group (nccl on CUDA, gloo otherwise), train."""
    warnings.filterwarnings("ignore", module="megatron")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if os.environ.get("RANK", "0") == "0":  # rank 0 logs each patched binding and settled plan
        logging.getLogger("megatron_fcp").setLevel(logging.INFO)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args, fcp = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate_run(args, fcp, world)  # clear errors before any process group exists
    if not dist.is_initialized():
        backend = args.dist_backend if args.dist_backend != "auto" else "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl" or args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        if "MASTER_ADDR" not in os.environ:  # plain `python pretrain_gpt_fcp.py`: one process
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", RANK="0", WORLD_SIZE="1")
        dist.init_process_group(backend)
    try:
        return train(args, fcp)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
