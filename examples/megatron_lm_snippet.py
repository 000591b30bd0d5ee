"""Two additions to Megatron-LM's ``pretrain_gpt.py`` turn on FCP (route 3 of docs/megatron.md).

Needs no edit at all: ``torchrun ... -m megatron_fcp.run pretrain_gpt.py <flags> --fcp`` (route 1)
or ``--spec megatron_fcp.spec fcp_layer_spec`` (route 2). For a script you edit anyway:

1. Register the ``--fcp-*`` flags where the release parses the arguments.

   megatron-core 0.17 (``pretrain`` parses)::

       from megatron_fcp.patches.args import add_fcp_args

       pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                forward_step, args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
                extra_args_provider=add_fcp_args)          # or chain it with yours, see below

   megatron-core 0.18 (the script parses, ``pretrain`` takes the config container)::

       from megatron.training.argument_utils import pretrain_cfg_container_from_args
       from megatron.training.arguments import parse_and_validate_args

       args = parse_and_validate_args(extra_args_provider=add_fcp_args, args_defaults={...})
       pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
                model_provider, ModelType.encoder_or_decoder, forward_step)

   megatron-core 0.19 / Megatron-LM main (the model comes from ``GPTModelBuilder``, no
   ``model_provider``): parse as for 0.18, then either keep the builder and add
   ``--spec megatron_fcp.spec fcp_layer_spec`` (route 2), or pass your own provider::

       cfg = pretrain_cfg_container_from_args(args)          # no model config: get_model(model_provider)
       pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
                model_provider=model_provider)

2. Apply FCP at the top of ``model_provider`` -- it runs on every rank after
   ``initialize_model_parallel`` and *before* the layer spec and model are built, which is
   exactly when the plan must be settled::

       def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
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
tests/test_megatron_training.py, and Megatron-LM's own ``pretrain()`` loop by
tests/test_megatron_pretrain.py (megatron-core 0.17+ wheels ship ``megatron.training``).
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
    from megatron_fcp.patches.megatron_lm import enable_fcp_from_megatron_args as enable  # noqa: PLC0415

    return enable()


def chain_extra_args(*providers: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]):
    """Combine extra-args providers: ``extra_args_provider=chain_extra_args(mine, add_fcp_args)``."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in providers:
            parser = p(parser)
        return parser

    return provider
