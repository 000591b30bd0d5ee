"""A ``pretrain_gpt.py``-shaped driver for megatron.training's own ``pretrain()`` (tests only).

It imports nothing from megatron_fcp: FCP reaches it only through ``python -m megatron_fcp.run``
or ``--spec megatron_fcp.spec fcp_layer_spec``, exactly as it would reach Megatron-LM's own
script. The flow follows Megatron-LM's ``pretrain_gpt.py`` of the installed release line, chosen
by ``pretrain``'s signature (the wheels' ``megatron/training/training.py``):

* 0.19 (``pretrain(cfg_container, datasets, model_type, forward_step, model_provider=None)``):
  ``parse_and_validate_args`` -> ``gpt_config_from_args`` (resolves ``--spec``) ->
  ``pretrain_cfg_container_from_args`` -> ``pretrain`` builds the model with ``GPTModelBuilder``;
* 0.18 (``pretrain(cfg_container, datasets, model_provider, model_type, forward_step)``):
  ``parse_and_validate_args`` -> ``pretrain_cfg_container_from_args`` -> ``pretrain`` with
  :func:`model_provider`;
* 0.17 (``pretrain(datasets, model_provider, model_type, forward_step, ..., args_defaults)``):
  ``pretrain`` parses the arguments itself.

Data: ``--mock-data`` through ``BlendedMegatronDatasetBuilder``, built on every rank (each TP rank
reads the same deterministic batches instead of receiving tensor rank 0's broadcast), then this
CP rank's zigzag chunks by ``get_batch_on_this_cp_rank``. The loss function is pretrain_gpt's
(sum of masked token losses, token count, ``{"lm loss": [sum, count]}``).
"""

import inspect
from functools import partial

import torch


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """The 0.17/0.18 route (``get_model``): a GPTModel, ``--spec`` resolved as Megatron-LM does."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import import_module
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    if args.spec is not None:
        spec = import_module(args.spec)
        if callable(spec):  # a spec function, called with the config (as 0.19's builder does)
            spec = spec(config, vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization)
    kwargs = {"pg_collection": pg_collection} if pg_collection is not None else {}
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                    vp_stage=vp_stage, **kwargs)


def is_dataset_built_on_rank(vp_stage=None):
    return True


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None,
        split=args.split, path_to_cache=None, tokenizer=get_tokenizer(),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False)
    assert args.mock_data, "this driver trains on --mock-data only"
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples, is_dataset_built_on_rank,
                                         config).build()


train_valid_test_datasets_provider.is_distributed = True


def _this_cp_rank(batch):
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_cp_rank

    params = inspect.signature(get_batch_on_this_cp_rank).parameters
    kwargs = {"cp_group": mpu.get_context_parallel_group()} if "cp_group" in params else {}
    if "is_hybrid_cp" in params:
        kwargs["is_hybrid_cp"] = False
    return get_batch_on_this_cp_rank(batch, **kwargs)


def get_batch(data_iterator, vp_stage=None):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = next(data_iterator)
    batch = {k: v.to(device) for k, v in batch.items() if k in ("tokens", "labels", "loss_mask", "position_ids")}
    batch = _this_cp_rank(batch)
    return batch["tokens"], batch["labels"], batch["loss_mask"], None, batch["position_ids"]


def loss_func(loss_mask, output_tensor, model=None):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan=False):
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, model=model)


def main():
    from megatron.core.enums import ModelType
    from megatron.training import training

    params = list(inspect.signature(training.pretrain).parameters)
    defaults = {"tokenizer_type": "NullTokenizer"}
    if params[0] != "cfg_container":  # 0.17: pretrain parses the arguments itself
        training.pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                          forward_step, args_defaults=defaults)
        return
    from megatron.training import argument_utils
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(args_defaults=defaults)
    if params[2] == "model_provider":  # 0.18: positional model_provider, GPT built by get_model
        cfg = argument_utils.pretrain_cfg_container_from_args(args)
        training.pretrain(cfg, train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                          forward_step)
        return
    # 0.19 and Megatron-LM main: the model config (with --spec) goes into the container
    cfg = argument_utils.pretrain_cfg_container_from_args(args, argument_utils.gpt_config_from_args(args))
    training.pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
