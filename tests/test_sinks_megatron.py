"""FCP's core attention holds the sink as megatron-core 0.15+ does, on the real installed megatron-core.

One 2-process gloo world at tp = 2 (cp = 1): from the same seed, Megatron's ``DotProductAttention``
(its softmax offset made on the CPU by the sink shim of megatron_fcp.patches.cpu) and
``FCPCoreAttention`` (the spec route) have equal ``softmax_offset`` parameters (name, shape
``[heads / tp]``, dtype, value, attributes), equal sharded state dicts (TP-sharded along dim 0),
and the same output and gradients (q, k, v and the sink) -- Megatron through its ``SoftmaxOne``,
FCP through its single-rank sink attention. Off-by-one: a zero tensor that is no parameter.
"""

from __future__ import annotations

import pytest
import torch

from megatron_fcp.testing.launch import run_gloo

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _megatron_has_sinks() -> bool:
    """megatron-core 0.15+ has ``TransformerConfig.softmax_type``; 0.14 has no sinks to serve."""
    import inspect

    try:
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        return False
    return "softmax_type" in inspect.signature(TransformerConfig).parameters


if not _megatron_has_sinks():
    pytest.skip("this megatron-core has no softmax_type (0.15+)", allow_module_level=True)


def _worker(rank: int, world: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fcp.patches.cpu import apply_cpu_shims, revert_cpu_shims
    from megatron_fcp.patches.megatron import FCPCoreAttention

    apply_cpu_shims()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    out: dict = {}
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        for kind in ("learnable", "off-by-one"):
            cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                    tensor_model_parallel_size=2, use_cpu_initialization=True,
                                    attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
                                    softmax_type=kind, perform_initialization=True)
            mods = {}
            for name, cls in (("megatron", DotProductAttention), ("fcp", FCPCoreAttention)):
                torch.manual_seed(7)
                mods[name] = cls(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                 attention_type="self")
            meg, fcp = mods["megatron"], mods["fcp"]
            res = {"param": [isinstance(m.softmax_offset, torch.nn.Parameter) for m in (meg, fcp)],
                   "state_keys": [sorted(m.state_dict()) for m in (meg, fcp)],
                   "shape": [tuple(m.softmax_offset.shape) for m in (meg, fcp)],
                   "dtype": [str(m.softmax_offset.dtype) for m in (meg, fcp)],
                   "equal": bool(torch.equal(meg.softmax_offset, fcp.softmax_offset)),
                   "attrs": [sorted(vars(m.softmax_offset)) for m in (meg, fcp)]}
            if kind == "learnable":
                meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
                sds = [m.sharded_state_dict(prefix="layer.core_attention.", metadata=meta) for m in (meg, fcp)]
                res["sharded"] = [{k: (v.key, v.global_shape, v.global_offset, v.axis_fragmentations)
                                   for k, v in sd.items()} for sd in sds]
                g = torch.Generator().manual_seed(rank)
                q = torch.randn(16, 2, 2, 8, generator=g)                 # [s, b, heads / tp, d]
                k, v, do = torch.randn(16, 2, 1, 8, generator=g), torch.randn(16, 2, 1, 8, generator=g), \
                    torch.randn(16, 2, 16, generator=g)
                with torch.no_grad():
                    meg.softmax_offset.copy_(torch.tensor([1.5, -0.5]))  # sinks that matter
                    fcp.softmax_offset.copy_(meg.softmax_offset)
                grads = []
                for m in (meg, fcp):
                    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                    o = m(qq, kk, vv, None, attn_mask_type=AttnMaskType.causal)
                    o.backward(do)
                    grads.append([o.detach(), qq.grad, kk.grad, vv.grad, m.softmax_offset.grad.clone()])
                res["max_diff"] = [float((a - b).abs().max()) for a, b in zip(*grads)]
            out[kind] = res
    finally:
        ps.destroy_model_parallel()
        revert_cpu_shims()
    return out


@pytest.fixture(scope="module")
def results():
    return run_gloo(_worker, 2, timeout_s=240)


def test_learnable_offset_is_megatrons(results):
    for r in results:
        res = r["learnable"]
        assert res["param"] == [True, True]
        assert res["state_keys"] == [["softmax_offset"], ["softmax_offset"]]
        assert res["shape"] == [(2,), (2,)] and res["dtype"][0] == res["dtype"][1]
        assert res["equal"] and res["attrs"][0] == res["attrs"][1]
        assert res["sharded"][0] == res["sharded"][1]
        (key, (shape, _offset, frag)), = [(v[0], v[1:]) for v in res["sharded"][0].values()]
        assert key == "layer.core_attention.softmax_offset" and shape == (4,) and frag[0] == 2


def test_learnable_forward_and_gradients_match_megatron(results):
    for r in results:
        assert all(d <= 1e-6 for d in r["learnable"]["max_diff"]), r["learnable"]["max_diff"]


def test_off_by_one_is_a_zero_tensor(results):
    for r in results:
        res = r["off-by-one"]
        assert res["param"] == [False, False] and res["state_keys"] == [[], []]
        assert res["shape"] == [(2,), (2,)] and res["equal"]
