"""Drop-in for Megatron-LM's ``pretrain_gpt.py``: two additions turn on FCP.

1. Register the ``--fcp-*`` flags (pass the provider to ``pretrain``)::

       from megatron_fcp.patches.args import add_fcp_args

       pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                forward_step, args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
                extra_args_provider=add_fcp_args)          # or chain it with yours, see below

2. Apply FCP at the top of ``model_provider`` -- it runs on every rank after
   ``initialize_model_parallel`` and *before* the layer spec and model are built, which is
   exactly when the plan must be settled::

       def model_provider(pre_process=True, post_process=True, vp_stage=None):
           enable_fcp_from_megatron_args()                   # <- this file
           args = get_args()
           ...  # unchanged: get_gpt_layer_with_transformer_engine_spec(...), GPTModel(...)

Then run as usual with ``--context-parallel-size 8 --fcp --fcp-topology dgx-h100:2``
(``--fcp-graph``, ``--fcp-block-tokens``, ``--no-fcp-overlap``, ``--fcp-config FILE.yaml`` as
needed). Without ``--fcp`` nothing is patched and Megatron's own CP attention runs.
Transformer Engine's and the local spec's core attention are both replaced for CP > 1; CP = 1
modules stay Megatron's own. Unsupported with FCP (clear errors): packed/THD sequences,
attention bias, sliding windows, attention dropout > 0, and Megatron's hybrid context
parallelism (``--hybrid-context-parallel`` with ``--fcp`` fails when the args are read).
Exercised through Megatron-LM's parse_args/validate_args and model path on CPU by
tests/test_megatron_training.py (megatron-core 0.17+ wheels ship ``megatron.training``).
"""

from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["enable_fcp_from_megatron_args", "chain_extra_args"]


def enable_fcp_from_megatron_args():
    """Patch Megatron's attention and settle the plans from Megatron-LM's parsed args.

    Idempotent: ``model_provider`` may run several times (virtual pipeline stages). Returns the
    settled :class:`~megatron_fcp.patches.runtime.FCPRuntime`, or None when ``--fcp`` is not given.
    """
    from megatron.training import get_args, print_rank_0

    from megatron_fcp.patches.args import fcp_config_from_args
    from megatron_fcp.patches.megatron import apply_fcp
    from megatron_fcp.patches.runtime import current_runtime, setup_fcp

    args = get_args()
    config = fcp_config_from_args(args)
    if not config.enabled:
        return None
    apply_fcp(config)
    runtime = current_runtime()
    if runtime is None or runtime.config != config:
        heads = args.num_attention_heads
        runtime = setup_fcp(
            config,
            seq_len=args.seq_length,
            heads=heads,
            kv_heads=args.num_query_groups if getattr(args, "group_query_attention", False) else heads,
            head_dim=args.kv_channels or args.hidden_size // heads,
            dtype_bytes=2 if (args.bf16 or args.fp16) else 4,
            micro_batch=args.micro_batch_size,
        )
        if args.context_parallel_size > 1:
            print_rank_0(runtime.summary(0))
    return runtime


def chain_extra_args(*providers: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]):
    """Combine extra-args providers: ``extra_args_provider=chain_extra_args(mine, add_fcp_args)``."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in providers:
            parser = p(parser)
        return parser

    return provider
