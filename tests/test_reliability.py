"""Reliability without processes: fully masked rows at kernel level, --fcp-check-numerics,
--fcp-fallback and the start-up layer report (stub megatron-core whose originals fail loudly)."""

from __future__ import annotations

import logging
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_patches import _pgs, _stub_megatron, _tcfg  # noqa: E402

from megatron_fcp.attention.function import FCPNumericsError, check_finite  # noqa: E402
from megatron_fcp.attention.dispatch import BLOCK_KERNELS  # noqa: E402
from megatron_fcp.attention.merge import LseAccumulator  # noqa: E402
from megatron_fcp.config import FCPConfig  # noqa: E402
from megatron_fcp.patches import REGISTRY  # noqa: E402
from megatron_fcp.patches.runtime import current_runtime, setup_fcp  # noqa: E402
from megatron_fcp.planner.megatron_layout import MegatronLayout  # noqa: E402

TOPOLOGY_2X2 = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "topology_2x2.yaml")


# ---- fully masked rows at kernel level ----------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["math", "cpu-flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_fully_masked_rows_give_zero_output_and_gradients_at_kernel_level(kernel, dtype, packed):
    """Rows 0-3 see no key of the block (causal: they precede every key; packed: another
    document), rows 4-7 see some: out 0 / lse -inf / dq 0 on the empty rows, nothing NaN, and the
    empty rows add nothing to dk/dv (same dk/dv as with their dout zeroed)."""
    k_obj = BLOCK_KERNELS[kernel]
    g = torch.Generator().manual_seed(5)
    q, do = (torch.randn(8, 2, 4, 16, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(6, 2, 2, 16, generator=g).to(dtype) for _ in range(2))
    if packed:  # positions inside documents; rows 0-3 in document 0, the keys in document 1
        q_pos, k_pos = torch.arange(8) % 4, torch.arange(6)
        kw = dict(q_doc=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), k_doc=torch.ones(6, dtype=torch.int64))
    else:  # queries 0..3 precede the keys at 10..15; queries 12..15 see some
        q_pos, k_pos = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15]), torch.arange(10, 16)
        kw = {}
    scale = 1 / math.sqrt(16)
    out, lse = k_obj.forward(q, k, v, q_pos, k_pos, True, scale, **k_obj.prepare_forward(q, 2, scale), **kw)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert (out[:4] == 0).all() and torch.isneginf(lse[..., :4]).all() and torch.isfinite(lse[..., 4:]).all()
    dq, dk, dv = k_obj.backward(do, q, k, v, out, lse, q_pos, k_pos, True, scale,
                                **k_obj.prepare_backward(q, do, out, 2), **kw)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert (dq[:4] == 0).all()
    do0 = do.clone()
    do0[:4] = 0
    _, dk0, dv0 = k_obj.backward(do0, q, k, v, out, lse, q_pos, k_pos, True, scale,
                                 **k_obj.prepare_backward(q, do0, out, 2), **kw)
    assert torch.allclose(dk, dk0, atol=1e-6) and torch.allclose(dv, dv0, atol=1e-6)


def test_merging_nothing_with_nothing_stays_zero():
    acc = LseAccumulator.empty(3, 1, 2, 4, torch.float32)
    acc.add(torch.zeros(3, 1, 2, 4), torch.full((1, 2, 3), -math.inf))
    out, lse = acc.result()
    assert (out == 0).all() and torch.isneginf(lse).all()


# ---- --fcp-check-numerics ---------------------------------------------------------------------------------------
def test_check_finite_accepts_masked_rows_and_names_what_is_wrong():
    out, lse = torch.zeros(4, 1, 2, 8), torch.full((1, 2, 4), -math.inf)
    check_finite(out, lse, "layer 3")  # fully masked rows are fine
    out[1, 0, 0, 0] = math.nan
    with pytest.raises(FCPNumericsError, match=r"layer 3: out has 1 non-finite values of 64, lse has 0"):
        check_finite(out, lse, "layer 3")
    with pytest.raises(FCPNumericsError, match="lse has 2 NaN/\\+inf"):
        check_finite(torch.zeros(4, 1, 2, 8), lse.index_fill(2, torch.tensor([0]), math.inf), "x")


# ---- fallbacks and the layer report ---------------------------------------------------------------------------
@pytest.fixture
def stub(monkeypatch):
    from megatron_fcp.patches import megatron as pm

    stubbed = _stub_megatron(monkeypatch)
    yield stubbed
    pm.revert_fcp()
    assert not REGISTRY.targets("megatron")


def _te_module(stub, cp=2, layer=1, **config):
    provider = stub.mods["megatron.core.extensions.transformer_engine_spec_provider"]
    return provider.TEDotProductAttention(config=_tcfg(cp=cp, **config), layer_number=layer, attn_mask_type=None,
                                          attention_type="self", pg_collection=_pgs(cp))


def _apply(cfg, world=2, cp=2):
    from megatron_fcp.patches import megatron as pm

    setup_fcp(cfg, layout=MegatronLayout(world=world, cp=cp), groups={}, seq_len=64)
    pm.apply_fcp(cfg)


def test_without_fallback_every_unsupported_layer_raises_with_the_reason(stub):
    from megatron_fcp.patches import megatron as pm

    _apply(FCPConfig(enabled=True, graph="ring", topology="dgx-h100:1"))
    with pytest.raises(NotImplementedError, match=r"qk_clip .*\[layer 2\]; or pass --fcp-fallback megatron"):
        _te_module(stub, layer=2, qk_clip=True)
    module = _te_module(stub, layer=3)
    assert isinstance(module, pm.FCPCoreAttention)
    q = torch.zeros(4, 1, 4, 8)
    with pytest.raises(NotImplementedError, match="attention_bias .*--fcp-fallback megatron"):
        module(q, q, q, None, attention_bias=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="attention dropout 0.1"):
        _te_module(stub, layer=4, attention_dropout=0.1).train()(q, q, q, None)


def test_fallback_megatron_runs_megatrons_class_and_logs_once_per_reason(stub, caplog):
    from megatron_fcp.patches import megatron as pm

    _apply(FCPConfig(enabled=True, graph="ring", topology="dgx-h100:1", fallback="megatron"))
    q = torch.zeros(4, 1, 4, 8)
    with caplog.at_level(logging.WARNING, logger="megatron_fcp"):
        clipped = _te_module(stub, layer=1, qk_clip=True)
        assert isinstance(clipped, pm.FCPCoreAttention)
        assert clipped(q, q, q, None) == "te-ring" and clipped(q, q, q, None) == "te-ring"
        biased = _te_module(stub, layer=2)
        for _ in range(3):
            assert biased(q, q, q, None, attention_bias=torch.zeros(1)) == "te-ring"
    logged = [r.getMessage() for r in caplog.records if "runs Megatron's" in r.getMessage()]
    assert len(logged) == 2 and "qk_clip" in logged[0] and "attention_bias" in logged[1], logged
    report = current_runtime().layer_report
    assert report[1] == {"attention": "megatron", "reason": report[1]["reason"]}
    assert "qk_clip" in report[1]["reason"] and "attention_bias" in report[2]["reason"]


def test_fallback_megatron_says_when_megatrons_class_cannot_serve_either(stub):
    """The local DotProductAttention (here: a stub that refuses to be built) cannot run CP > 1."""
    _apply(FCPConfig(enabled=True, graph="ring", topology="dgx-h100:1", fallback="megatron"))
    backends = stub.mods["megatron.core.models.backends"]
    module = backends.DotProductAttention(config=_tcfg(cp=2), layer_number=7, attn_mask_type=None,
                                          attention_type="self", pg_collection=_pgs(2))
    q = torch.zeros(4, 1, 4, 8)
    with pytest.raises(NotImplementedError, match=r"attention_bias .*\[layer 7\], and --fcp-fallback megatron "
                                                  r"cannot serve it: Megatron's DotProductAttention failed"):
        module(q, q, q, None, attention_bias=torch.zeros(1))


def test_user_report_hierarchical_cp_never_silently_runs_without_cp(stub, caplog):
    """Megatron-Bridge 2667: a hierarchical CP setting ran with CP off for weeks. Here the start-up
    log and FCPRuntime.layer_report name, for every layer, that FCP serves it with the
    hierarchical plan over the 4 CP ranks; a layer FCP cannot serve raises instead of quietly
    running something else; a model built before apply_fcp is refused (test_patches)."""
    cfg = FCPConfig(enabled=True, graph="hierarchical", topology=TOPOLOGY_2X2)
    with caplog.at_level(logging.INFO, logger="megatron_fcp"):
        _apply(cfg, world=4, cp=4)
        for layer in (1, 2, 3):
            _te_module(stub, cp=4, layer=layer)
    report = current_runtime().layer_report
    assert sorted(report) == [1, 2, 3]
    for entry in report.values():
        assert entry["attention"] == "fcp" and entry["plan"] == "hierarchical" and entry["cp_ranks"] == [0, 1, 2, 3]
    lines = [r.getMessage() for r in caplog.records if "FCP attention, plan" in r.getMessage()]
    assert len(lines) == 3 and "layer 1: FCP attention, plan 'hierarchical'" in lines[0], lines
    with pytest.raises(NotImplementedError, match="qk_clip"):
        _te_module(stub, cp=4, layer=4, qk_clip=True)


# ---- the error catalogue ------------------------------------------------------------------------------------
def test_every_test_the_error_catalogue_names_exists():
    import re

    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, "docs", "errors.md"), encoding="utf-8") as fh:
        text = fh.read()
    refs = re.findall(r"(tests/\w+\.py)::(\w+)", text) + [
        (path, name) for path, names in re.findall(r"(tests/\w+\.py)::\w+(?:\[[^\]]*\])?((?:, `::\w+`)+)", text)
        for name in re.findall(r"::(\w+)", names)]
    assert len(refs) >= 40
    missing = []
    for path, name in refs:
        with open(os.path.join(root, path), encoding="utf-8") as fh:
            if not re.search(rf"^def {name}\(", fh.read(), re.M):
                missing.append(f"{path}::{name}")
    assert not missing, missing
    from test_bad_inputs import CASES

    for case in re.findall(r"bad-input suite `([\w-]+)`", text):
        assert case in CASES, case
