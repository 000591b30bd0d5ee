"""``examples/megatron_lm_snippet.py`` inside Megatron-LM's own argument and model path, on gloo.

Runs where the megatron-core wheel ships ``megatron.training`` (0.17+; the whole module is skipped
on 0.14-0.16). Megatron-LM's ``pretrain()`` itself needs CUDA, so this test drives what it does
on the way to the model, on 2 CPU processes with cp = 2:

``parse_args(extra_args_provider=add_fcp_args)`` -> ``validate_args`` (its one GPU query, the
device architecture, answered with 0) -> ``set_args`` ->
``initialize_model_parallel`` -> ``model_provider`` = ``enable_fcp_from_megatron_args()`` + the
GPT spec and model built from ``core_transformer_config_from_args(args)`` -> one forward/backward.

The model must hold FCP attention in every layer, the snippet must be idempotent (virtual
pipeline stages call ``model_provider`` again), and the loss must equal the same model's loss
at cp = 1 (one rank holding the whole sequence), computed on each rank from the same weights.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("megatron.training.arguments")  # megatron-core >= 0.17 wheels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

ARGV = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--use-cpu-initialization",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--context-parallel-size", "2",
        "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",  # CPU: no fused kernels
        "--fcp", "--fcp-graph", "ring", "--fcp-topology", "dgx-h100:1"]


def _core_config_from_args(args):
    """Megatron-LM's TransformerConfig from args (``arguments`` up to 0.17, ``argument_utils`` from 0.18)."""
    from megatron.training import arguments

    fn = getattr(arguments, "core_transformer_config_from_args", None)
    if fn is None:
        from megatron.training import argument_utils

        fn = argument_utils.core_transformer_config_from_args
    return fn(args)


def _snippet_worker(rank: int, world: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training import arguments, global_vars

    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from megatron_lm_snippet import chain_extra_args, enable_fcp_from_megatron_args

    from megatron_fcp.patches.args import add_fcp_args
    from megatron_fcp.patches.compat import cp_batch_splitter
    from megatron_fcp.patches.cpu import apply_cpu_shims, revert_cpu_shims
    from megatron_fcp.patches.megatron import assert_model_uses_fcp, revert_fcp

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), CUDA_DEVICE_MAX_CONNECTIONS="1")  # as Megatron-LM asks
    sys.argv = list(ARGV)
    args = arguments.parse_args(extra_args_provider=chain_extra_args(add_fcp_args))
    # With cp > 1, validate_args asks the GPU's architecture (torch.cuda.get_device_properties), only
    # to choose which CUDA_DEVICE_MAX_CONNECTIONS advice to print. A CPU has none: report 0.
    if hasattr(arguments, "get_device_arch_version"):
        arguments.get_device_arch_version = lambda: 0
    args = arguments.validate_args(args, {}) or args
    global_vars.set_args(args)
    apply_cpu_shims()
    ps.initialize_model_parallel(context_parallel_size=args.context_parallel_size,
                                 create_gloo_process_groups=False)
    out: dict = {}
    try:
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        runtime = enable_fcp_from_megatron_args()  # what model_provider calls first
        out["same_runtime"] = enable_fcp_from_megatron_args() is runtime  # a second model_provider call
        out["graph"] = runtime.config.graph
        config = _core_config_from_args(args)

        def build():
            torch.manual_seed(0)
            return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                            vocab_size=args.vocab_size, max_sequence_length=args.max_position_embeddings,
                            position_embedding_type="rope")

        model = build()
        out["fcp_modules"] = assert_model_uses_fcp(model)
        tokens = (3 + 5 * torch.arange(args.seq_length + 1)[None, :]) % args.vocab_size  # [1, s+1]
        whole = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                 "position_ids": torch.arange(args.seq_length)[None, :]}
        mine = cp_batch_splitter()(dict(whole))
        token_loss = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"])  # [1, s/cp]
        loss = token_loss.sum()
        loss.backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=ps.get_context_parallel_group())
        out["loss_cp2"] = float(total)
        out["grads"] = sum(p.grad is not None for p in model.parameters())
    finally:
        revert_fcp()
        ps.destroy_model_parallel()
    # the same weights at cp = 1 (Megatron's own attention), the whole sequence on this rank
    args.context_parallel_size = 1
    config = _core_config_from_args(args)
    ps.initialize_model_parallel(create_gloo_process_groups=False)
    try:
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        torch.manual_seed(0)
        ref = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab_size,
                       max_sequence_length=args.max_position_embeddings, position_embedding_type="rope")
        out["loss_cp1"] = float(ref(whole["tokens"], whole["position_ids"], None, labels=whole["labels"]).sum())
    finally:
        ps.destroy_model_parallel()
        revert_cpu_shims()
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_snippet_through_megatron_training_on_gloo():
    from megatron_fcp.testing.launch import run_gloo

    results = run_gloo(_snippet_worker, 2, timeout_s=300)
    for r in results:
        assert r["same_runtime"] and r["graph"] == "ring"
        assert r["fcp_modules"] == 2  # both layers run FCP at cp = 2
        assert r["grads"] > 0
        assert r["loss_cp2"] == pytest.approx(r["loss_cp1"], rel=1e-5)
