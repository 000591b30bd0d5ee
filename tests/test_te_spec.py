"""Transformer Engine's layer spec under apply_fcp, on CPU with stubbed modules (TE is never imported).

Each supported megatron-core release's ``TEDotProductAttention`` signature is stubbed (Note
[TEDotProductAttention across megatron-core 0.14-0.19] in megatron_fcp/patches/te_spec.py); the
stub records every construction and call, so a test sees whether TE's own class ran. The last
tests import the *installed* megatron-core's real TE spec builder against a fake
``transformer_engine`` package.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_patches import _AttnMaskType, _pgs, _stub_megatron, _tcfg  # noqa: E402

from megatron_fcp.config import FCPConfig  # noqa: E402
from megatron_fcp.patches import REGISTRY, PatchTargetError  # noqa: E402
from megatron_fcp.patches.runtime import current_runtime, setup_fcp  # noqa: E402
from megatron_fcp.patches.te_spec import CPCommTypeError, check_te_signature, refuse_cp_comm_type_args  # noqa: E402
from megatron_fcp.planner.megatron_layout import MegatronLayout  # noqa: E402

PROVIDER = "megatron.core.extensions.transformer_engine_spec_provider"
EXT = "megatron.core.extensions.transformer_engine"


# ---- TEDotProductAttention stubs, one signature per release ------------------------------------------------
class _Recording(torch.nn.Module):
    """Records its constructions and calls; Megatron's TE class must run only where FCP hands over."""

    built: list
    called: list

    def _record(self, frame_locals: dict) -> None:
        super().__init__()
        kwargs = {k: v for k, v in frame_locals.items() if k not in ("self", "__class__")}
        self.config, self.layer_number = kwargs["config"], kwargs["layer_number"]
        type(self).built.append(kwargs)

    def _call(self, frame_locals: dict) -> str:
        type(self).called.append({k: v for k, v in frame_locals.items() if k not in ("self", "__class__")})
        return "te"


class TE_0_14(_Recording):  # noqa: N801 - named after the release
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type="p2p", model_comm_pgs=None):
        self._record(locals())

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None):
        return self._call(locals())


class TE_0_15(_Recording):  # noqa: N801
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type="p2p", pg_collection=None):
        self._record(locals())

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None):
        return self._call(locals())


class TE_0_16(_Recording):  # noqa: N801 - 0.16 to 0.19 share this signature
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, num_splits=None, cp_comm_type="p2p",
                 pg_collection=None):
        self._record(locals())

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None, num_splits=None):
        return self._call(locals())


#: release -> (its stub, the keyword Attention.__init__ passes the process groups under)
RELEASES = {
    "0.14.0": (TE_0_14, "model_comm_pgs"),
    "0.15.3": (TE_0_15, "pg_collection"),
    "0.16.1": (TE_0_16, "pg_collection"),
    "0.17.1": (TE_0_16, "pg_collection"),
    "0.18.2": (TE_0_16, "pg_collection"),
    "0.19.2": (TE_0_16, "pg_collection"),
}


def _stub_te(monkeypatch, version="0.16.1", te_class=None):
    """The stubbed megatron-core of test_patches with ``version``'s TEDotProductAttention bound
    where megatron-core defines it and where ``TESpecProvider.core_attention()`` reads it."""
    cls = te_class or RELEASES[version][0]
    cls = type(cls.__name__, (cls,), {"built": [], "called": []})  # fresh records per test
    stub = _stub_megatron(monkeypatch, version)
    for name in (EXT, PROVIDER):
        monkeypatch.setattr(stub.mods[name], "TEDotProductAttention", cls)
    stub.TEDotProductAttention = cls
    return stub


@pytest.fixture
def applied(monkeypatch):
    """``apply(version, **fcp)`` settles a 2-rank CP plan, stubs the release and applies FCP."""
    from megatron_fcp.patches import megatron as pm

    def apply(version="0.16.1", te_class=None, **fcp):
        stub = _stub_te(monkeypatch, version, te_class)
        cfg = FCPConfig(enabled=True, graph="ring", topology="dgx-h100:1", **fcp)
        setup_fcp(cfg, layout=MegatronLayout(world=2, cp=2), groups={}, seq_len=64)
        stub.targets = pm.apply_fcp(cfg)
        return stub

    yield apply
    pm.revert_fcp()
    assert not REGISTRY.targets("megatron")


def _build(stub, version="0.16.1", cp=2, layer=1, mask=_AttnMaskType.causal, cp_comm_type=None,
           softmax_scale=None, extra=None, **config):
    """Build the core attention as megatron-core ``version``'s Attention.__init__ does (keywords):
    ``cp_comm_type`` is this layer's value, ``config`` fields go to the TransformerConfig stand-in
    (its ``cp_comm_type`` is the whole per-layer setting)."""
    provider = sys.modules[PROVIDER]
    config.setdefault("cp_comm_type", cp_comm_type)
    if isinstance(cp_comm_type, list):  # Megatron hands each layer its own entry
        cp_comm_type = cp_comm_type[layer - 1]
    kwargs = dict(config=_tcfg(cp=cp, **config), layer_number=layer, attn_mask_type=mask, attention_type="self",
                  cp_comm_type=cp_comm_type, softmax_scale=softmax_scale)
    kwargs[RELEASES[version][1]] = _pgs(cp)
    kwargs.update(extra or {})
    return provider.TEDotProductAttention(**kwargs)


# ---- apply_fcp picks the TE spec up, for every release's signature -----------------------------------------
@pytest.mark.parametrize("version", sorted(RELEASES))
def test_apply_fcp_replaces_te_core_attention_for_each_release(applied, version):
    from megatron_fcp.patches import megatron as pm

    stub = applied(version)
    te = stub.TEDotProductAttention
    replacement = stub.mods[PROVIDER].TEDotProductAttention
    assert f"{PROVIDER}:TEDotProductAttention" in stub.targets
    assert issubclass(replacement, pm.FCPCoreAttention) and replacement.__wrapped__ is te
    assert replacement.fcp_original is te
    # What Attention.__init__ passes in this release builds FCP, with the arguments it was given.
    module = _build(stub, version, layer=3, softmax_scale=0.25, cp_comm_type="p2p",
                    num_attention_heads=8, num_query_groups=2, kv_channels=16, hidden_size=128)
    assert isinstance(module, pm.FCPCoreAttention) and te.built == []  # TE's class never built
    assert (module.cp_size, module.layer_number, module.softmax_scale) == (2, 3, 0.25)
    assert module.attn_mask_type == _AttnMaskType.causal and module.cp_comm_type == "p2p"
    assert (module.num_attention_heads_per_partition, module.num_query_groups_per_partition) == (8, 2)  # GQA
    assert module.hidden_size_per_attention_head == 16
    assert current_runtime().layer_report[3]["attention"] == "fcp"
    # The arguments FCP keeps for a fallback bind to this release's constructor exactly.
    inspect.signature(te).bind(**module._megatron_kwargs)
    # cp = 1: Megatron's own TE class, built with exactly what Megatron passed.
    own = _build(stub, version, cp=1, layer=4)
    assert type(own) is te and te.built[-1]["layer_number"] == 4
    assert RELEASES[version][1] in te.built[-1]


@pytest.mark.parametrize("version", ["0.14.0", "0.16.1"])
def test_forward_takes_each_releases_keywords(applied, version):
    """Megatron calls core_attention with keywords; 0.16+ callers may add num_splits."""
    from megatron_fcp.patches import megatron as pm

    stub = applied(version)
    module = pm.FCPCoreAttention(config=_tcfg(cp=1), layer_number=1, attn_mask_type=_AttnMaskType.causal,
                                 pg_collection=_pgs(1))
    q, k, v = (torch.randn(8, 2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    kwargs = dict(attn_mask_type=_AttnMaskType.causal, attention_bias=None, packed_seq_params=None)
    if "num_splits" in inspect.signature(stub.TEDotProductAttention.forward).parameters:
        kwargs["num_splits"] = 1
    out = module(q, k, v, None, **kwargs)  # [s, b, h*d]
    ref = torch.softmax((q.permute(1, 2, 0, 3) @ k.permute(1, 2, 3, 0)) / 8 ** 0.5
                        + torch.full((8, 8), float("-inf"), dtype=torch.float64).triu(1), dim=-1)
    ref = (ref @ v.permute(1, 2, 0, 3)).permute(2, 0, 1, 3).reshape(8, 2, 32)  # FP64 reference
    assert out.shape == (8, 2, 32) and torch.allclose(out, ref, atol=1e-12)


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_te_spec_with_learnable_sinks_builds_fcp_with_tes_parameter(applied, version):
    """softmax_type="learnable" on the TE spec: FCP serves the layer and holds the sink under TE's
    name and shape (``softmax_offset``, ``[heads / tp]``), so checkpoints keep their keys; at cp = 1
    the module computes the sink's softmax (FP64 reference with the sink as one more column)."""
    from megatron_fcp.patches import megatron as pm

    stub = applied(version)
    module = _build(stub, layer=2, softmax_type="learnable")
    assert isinstance(module, pm.FCPCoreAttention) and stub.TEDotProductAttention.built == []
    assert current_runtime().layer_report[2]["attention"] == "fcp"
    assert isinstance(module.softmax_offset, torch.nn.Parameter) and module.softmax_offset.shape == (4,)
    assert list(module.state_dict()) == ["softmax_offset"]
    local = pm.FCPCoreAttention(config=_tcfg(cp=1, softmax_type="learnable"), layer_number=1,
                                attn_mask_type=_AttnMaskType.causal, pg_collection=_pgs(1)).double()
    with torch.no_grad():
        local.softmax_offset.copy_(torch.tensor([2.0, -1.0, 0.0, 0.5]))
    q, k, v = (torch.randn(8, 1, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    out = local(q, k, v, None, attn_mask_type=_AttnMaskType.causal)
    scores = (q.permute(1, 2, 0, 3) @ k.permute(1, 2, 3, 0)) / 8 ** 0.5 \
        + torch.full((8, 8), float("-inf"), dtype=torch.float64).triu(1)              # [1, 4, 8, 8]
    column = local.softmax_offset.detach().view(1, 4, 1, 1).expand(1, 4, 8, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    ref = (probs @ v.permute(1, 2, 0, 3)).permute(2, 0, 1, 3).reshape(8, 1, 32)
    assert torch.allclose(out, ref, atol=1e-12)


def test_mla_head_sizes_are_served_through_the_te_spec_slot(applied):
    """MLA (k_channels 24 != v_channels 16) through the TE spec's slot: FCP serves it (TE's class is
    never built); at cp = 1 its out has v_channels per head and matches an FP64 reference."""
    from megatron_fcp.patches import megatron as pm

    stub = applied("0.16.1")
    served = _build(stub, cp=2, extra={"k_channels": 24, "v_channels": 16})  # cp = 2: FCP's, not TE's
    assert stub.TEDotProductAttention.built == [] and served._fallback_reason is None and served.v_head_dim == 16
    module = pm.FCPCoreAttention(config=_tcfg(cp=1), layer_number=1, attn_mask_type=_AttnMaskType.causal,
                                 pg_collection=_pgs(1), k_channels=24, v_channels=16)
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(8, 2, 4, 24, dtype=torch.float64, generator=g) for _ in range(2))
    v = torch.randn(8, 2, 4, 16, dtype=torch.float64, generator=g)
    out = module(q, k, v, None, attn_mask_type=_AttnMaskType.causal, attention_bias=None, packed_seq_params=None)
    ref = torch.softmax((q.permute(1, 2, 0, 3) @ k.permute(1, 2, 3, 0)) / 24 ** 0.5
                        + torch.full((8, 8), float("-inf"), dtype=torch.float64).triu(1), dim=-1)
    ref = (ref @ v.permute(1, 2, 0, 3)).permute(2, 0, 1, 3).reshape(8, 2, 64)  # [s, b, h*d_v]
    assert out.shape == (8, 2, 64) and torch.allclose(out, ref, atol=1e-12)


def test_revert_restores_the_te_bindings_exactly(applied):
    from megatron_fcp.patches import megatron as pm

    stub = applied()
    te = stub.TEDotProductAttention
    guard = vars(te)["forward"]
    assert stub.mods[PROVIDER].TEDotProductAttention is not te
    assert guard.__fcp_patched__ and guard.__wrapped__ is TE_0_16.forward  # the built-before guard
    restored = pm.revert_fcp()
    assert f"{PROVIDER}:TEDotProductAttention" in restored and f"{EXT}:TEDotProductAttention.forward" in restored
    assert stub.mods[PROVIDER].TEDotProductAttention is te and stub.mods[EXT].TEDotProductAttention is te
    assert "forward" not in vars(te) and te.forward is TE_0_16.forward  # inherited: the guard is deleted


def test_a_release_with_unknown_te_parameters_is_refused_before_patching(monkeypatch):
    from megatron_fcp.patches import megatron as pm

    class TEFuture(TE_0_16):
        def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                    packed_seq_params=None, num_splits=None, sink_tokens=None):
            return self._call(locals())

    stub = _stub_te(monkeypatch, "0.19.2", TEFuture)
    with pytest.raises(PatchTargetError, match=r"megatron-core 0\.19\.2 it takes forward\(sink_tokens=\.\.\.\)"):
        pm.apply_fcp(FCPConfig(enabled=True))
    assert not REGISTRY.targets("megatron") and not pm.is_fcp_applied()  # all or nothing
    assert stub.mods["megatron.core.models.backends"].DotProductAttention is stub.DotProductAttention

    class TERequired(TE_0_16):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, recipe):
            self._record(locals())

    with pytest.raises(PatchTargetError, match=r"__init__\(recipe\)"):
        check_te_signature(TERequired)

    class TEOptional(TE_0_16):  # an optional constructor argument Megatron does not pass: accepted
        def __init__(self, config, layer_number, attn_mask_type, attention_type, pg_collection=None, tag="x"):
            self._record(locals())

    check_te_signature(TEOptional)


def test_te_not_installed_leaves_the_te_bindings_alone(monkeypatch):
    """megatron-core binds a MagicMock for TE's classes when TE is absent: nothing of TE is patched."""
    from unittest.mock import MagicMock

    from megatron_fcp.patches import megatron as pm

    stub = _stub_megatron(monkeypatch)
    mock = MagicMock()
    for name in (EXT, PROVIDER):
        monkeypatch.setattr(stub.mods[name], "TEDotProductAttention", mock)
    try:
        targets = pm.apply_fcp(FCPConfig(enabled=True))
        assert targets and not any("TEDotProductAttention" in t for t in targets)
        assert stub.mods[PROVIDER].TEDotProductAttention is mock
    finally:
        pm.revert_fcp()
    assert "transformer_engine" not in sys.modules  # the CPU path never imports TE


# ---- refusals, each before any plan or message --------------------------------------------------------------
REFUSED = [
    ("fp8-dpa", dict(fp8_dot_product_attention=True), r"FP8 attention \(fp8_dot_product_attention\).*"
                                                        r"--fp8-dot-product-attention"),
    ("fp8-mha", dict(fp8_multi_head_attention=True), r"FP8 attention \(fp8_multi_head_attention\)"),
    ("softmax", dict(softmax_type="quiet"), r"softmax_type='quiet' is not supported"),
    ("qk-clip", dict(qk_clip=True), r"qk_clip needs the max attention logit.*--qk-clip"),
    ("batch-invariant", dict(batch_invariant_mode=True), r"batch_invariant_mode.*--batch-invariant-mode"),
    ("cross", dict(extra={"attention_type": "cross"}), r"attention_type='cross'"),
]


@pytest.mark.parametrize("case, options, words", REFUSED, ids=[c[0] for c in REFUSED])
def test_each_unsupported_te_option_is_refused_before_any_communication(applied, monkeypatch, case, options, words):
    from megatron_fcp.patches import megatron as pm

    stub = applied()

    def no_communication(*args, **kwargs):
        raise AssertionError("settled a plan / communicated before refusing")

    monkeypatch.setattr(pm, "_ensure_runtime", no_communication)
    with pytest.raises(NotImplementedError, match=words) as err:
        _build(stub, layer=5, **options)
    assert "[layer 5]; or pass --fcp-fallback megatron" in str(err.value)
    assert stub.TEDotProductAttention.built == []


def test_fp8_linear_layers_alone_are_kept(applied):
    """config.fp8 (FP8 GEMMs) without FP8 attention: TE's attention itself runs BF16, so FCP serves it."""
    from megatron_fcp.patches import megatron as pm

    stub = applied()
    assert isinstance(_build(stub, fp8="hybrid"), pm.FCPCoreAttention)


def test_window_only_on_the_layers_megatron_windows(applied, monkeypatch):
    """window_attn_skip_freq=2: layers 2, 4, ... are full attention (megatron-core's own rule); FCP
    serves both kinds, each layer with its own window (Note [Per-layer plans])."""
    from megatron_fcp.patches import megatron as pm
    from megatron_fcp.patches.te_spec import model_windows

    stub = applied()
    utils = types.ModuleType("megatron.core.transformer.utils")
    utils.is_layer_window_attention = lambda window, freq, layer: bool(window) and layer % freq != 0
    monkeypatch.setitem(sys.modules, "megatron.core.transformer.utils", utils)
    windowed = _build(stub, layer=1, window_size=(64, 0), window_attn_skip_freq=2)
    full = _build(stub, layer=2, window_size=(64, 0), window_attn_skip_freq=2)
    assert isinstance(windowed, pm.FCPCoreAttention) and isinstance(full, pm.FCPCoreAttention)
    assert windowed.window == (64, 0) and full.window is None
    cfg = types.SimpleNamespace(window_size=(64, 0), window_attn_skip_freq=2, num_layers=4)
    assert model_windows(cfg) == ((64, 0),)
    assert model_windows(types.SimpleNamespace(window_size=None, num_layers=4)) == ()


def test_causal_window_with_a_right_side_is_refused(applied):
    """A causal layer sees no later key: window (W, R > 0) is refused as TE refuses it."""
    stub = applied()
    with pytest.raises(NotImplementedError, match=r"right side must be 0"):
        _build(stub, layer=1, window_size=(64, 8))


def test_fallback_runs_te_with_the_layers_own_arguments(applied):
    """--fcp-fallback megatron: a refused layer runs TE's class, built with what Megatron passed
    (its cp_comm_type included) and called with the caller's keywords (num_splits included)."""
    stub = applied(fallback="megatron")
    te = stub.TEDotProductAttention
    clipped = _build(stub, layer=2, cp_comm_type="a2a", qk_clip=True, softmax_scale=0.5)
    q = torch.zeros(4, 1, 4, 8)
    assert clipped(q, q, q, None, attn_mask_type=_AttnMaskType.causal, num_splits=2) == "te"
    assert len(te.built) == 1 and te.built[0]["cp_comm_type"] == "a2a" and te.built[0]["softmax_scale"] == 0.5
    assert te.called[0]["num_splits"] == 2 and te.called[0]["attn_mask_type"] == _AttnMaskType.causal
    assert current_runtime().layer_report[2]["attention"] == "megatron"


def test_fallback_shares_the_layers_sink_parameter(applied):
    """A layer that falls back keeps one sink parameter: TE's module uses FCP's (the one the
    optimizer was built with, since the fallback module is built at the first forward)."""
    stub = applied(fallback="megatron")
    clipped = _build(stub, layer=2, qk_clip=True, softmax_type="learnable")
    q = torch.zeros(4, 1, 4, 8)
    assert clipped(q, q, q, None, attn_mask_type=_AttnMaskType.causal) == "te"
    assert clipped._fallback_module.softmax_offset is clipped.softmax_offset
    assert [n for n, _ in clipped.named_parameters()] == ["softmax_offset"]


def test_fallback_on_a_release_without_num_splits_does_not_pass_it(applied):
    stub = applied("0.15.3", fallback="megatron")
    module = _build(stub, "0.15.3", layer=1)
    q = torch.zeros(4, 1, 4, 8)
    assert module(q, q, q, None, attn_mask_type=_AttnMaskType.causal, attention_bias=torch.zeros(1)) == "te"
    assert "num_splits" not in stub.TEDotProductAttention.called[0]


def test_masks_kept_and_refused(applied, monkeypatch):
    """causal and no_mask always; padding_causal / padding only with a THD batch; arbitrary never."""
    stub = applied()
    module = _build(stub)
    assert module._causal(_AttnMaskType.causal) is True and module._causal(_AttnMaskType.no_mask) is False
    thd = SimpleNamespace(qkv_format="thd")
    monkeypatch.setattr(_AttnMaskType, "padding_causal", "padding_causal", raising=False)
    assert module._causal("padding_causal", thd) is True and module._causal(_AttnMaskType.padding, thd) is False
    q = torch.zeros(4, 1, 4, 8)
    for mask in (_AttnMaskType.padding, "padding_causal", _AttnMaskType.arbitrary):
        with pytest.raises(NotImplementedError, match="express padding as documents in a THD batch"):
            module(q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool), attn_mask_type=mask)


# ---- cp_comm_type -------------------------------------------------------------------------------------------
def test_cp_comm_type_replaced_and_logged_once(applied, caplog):
    from megatron_fcp.patches import megatron as pm

    stub = applied()
    with caplog.at_level(logging.INFO, logger="megatron_fcp"):
        for layer in (1, 2, 3):
            assert isinstance(_build(stub, layer=layer, cp_comm_type="a2a"), pm.FCPCoreAttention)
        _build(stub, layer=4, cp_comm_type="p2p")  # TE's ring, Megatron-LM's default: nothing to say
        _build(stub, layer=5, cp_comm_type=None)
    lines = [r.getMessage() for r in caplog.records if "cp_comm_type=" in r.getMessage()]
    assert lines == ["megatron_fcp: cp_comm_type='a2a' is replaced by FCP's plan on every layer FCP serves "
                     "(layers that fall back to Transformer Engine keep it)"]


def test_uniform_list_is_one_value_and_a_mixed_list_is_refused(applied, monkeypatch):
    from megatron_fcp.patches import megatron as pm

    stub = applied()
    uniform = _build(stub, layer=1, cp_comm_type=["all_gather"] * 4)
    assert isinstance(uniform, pm.FCPCoreAttention)
    monkeypatch.setattr(pm, "_ensure_runtime", lambda *a, **k: (_ for _ in ()).throw(AssertionError("settled")))
    with pytest.raises(CPCommTypeError, match=r"\[layer 2\]: cp_comm_type is a per-layer list with different "
                                              r"values \['a2a', 'a2a', 'p2p', 'p2p'\].*--cp-comm-type p2p"):
        _build(stub, layer=2, cp_comm_type=["a2a", "a2a", "p2p", "p2p"])
    assert isinstance(CPCommTypeError("x"), ValueError)


def test_apply_fcp_refuses_a_mixed_cp_comm_type_from_megatron_lm_args(monkeypatch):
    from megatron_fcp.patches import megatron as pm

    stub = _stub_te(monkeypatch)
    training = types.ModuleType("megatron.training")
    training.global_vars = SimpleNamespace(_GLOBAL_ARGS=SimpleNamespace(cp_comm_type=["p2p", "a2a"]))
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", training.global_vars)
    with pytest.raises(CPCommTypeError, match=r"apply_fcp\(\): cp_comm_type is a per-layer list"):
        pm.apply_fcp(FCPConfig(enabled=True))
    assert not REGISTRY.targets("megatron") and stub.mods[PROVIDER].TEDotProductAttention is stub.TEDotProductAttention
    refuse_cp_comm_type_args(SimpleNamespace(cp_comm_type=["p2p"]))  # Megatron-LM's default passes
    refuse_cp_comm_type_args(SimpleNamespace(cp_comm_type=["a2a", "a2a"]))


# ---- the installed megatron-core's own TE spec builder, against a fake transformer_engine -------------------
SPECS = "megatron.core.models.gpt.gpt_layer_specs"


@pytest.fixture
def real_te_spec(monkeypatch):
    """Re-import the installed ``gpt_layer_specs`` and ``TESpecProvider`` as if TE were installed:
    a fake ``transformer_engine`` package and a fake ``megatron.core.extensions.transformer_engine``
    whose TE classes are empty stand-ins and whose ``TEDotProductAttention`` is this release's stub.
    monkeypatch puts every real module and attribute back afterwards."""
    pytest.importorskip("megatron.core")
    import megatron.core.extensions as ext_pkg
    import megatron.core.models.gpt as gpt_pkg
    import megatron.core.utils as mutils

    from megatron_fcp.patches import megatron_core_version

    importlib.import_module(SPECS)  # the real module first, so its parents exist and are restored
    major_minor = ".".join(megatron_core_version().split(".")[:2])
    base = next(cls for v, (cls, _) in RELEASES.items() if v.startswith(major_minor + "."))
    te_cls = type(base.__name__, (base,), {"built": [], "called": []})
    standins: dict = {}

    def standin(name):  # TELayerNormColumnParallelLinear, TENorm, ...: classes the spec only names
        if name.startswith("__"):
            raise AttributeError(name)
        return standins.setdefault(name, type(name, (), {}))

    te = types.ModuleType("transformer_engine")
    te.__version__, te.__path__ = "2.8.0", []
    fake = types.ModuleType(EXT)
    fake.__getattr__, fake.HAVE_TE, fake.TEDotProductAttention = standin, True, te_cls
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, EXT, fake)
    for name in (PROVIDER, SPECS):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(ext_pkg, "transformer_engine", fake, raising=False)
    monkeypatch.setattr(ext_pkg, "transformer_engine_spec_provider", None, raising=False)
    monkeypatch.setattr(gpt_pkg, "gpt_layer_specs", sys.modules.get(SPECS), raising=False)
    monkeypatch.setattr(mutils, "_te_version", None, raising=False)  # TE's version is read once and cached
    specs = importlib.import_module(SPECS)
    assert specs.HAVE_TE, "the installed spec builder did not take the fake TE"
    yield SimpleNamespace(specs=specs, te=te_cls, standins=standins)
    from megatron_fcp.patches import megatron as pm

    pm.revert_fcp()


def _same(a, b) -> bool:
    """Spec entries compare by value; 0.19 builds the MLP entry as a fresh functools.partial."""
    if isinstance(a, functools.partial):
        return isinstance(b, functools.partial) and (a.func, a.args, a.keywords) == (b.func, b.args, b.keywords)
    return a == b


def test_real_te_spec_gets_fcp_and_keeps_every_other_submodule(real_te_spec):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fcp.patches import megatron as pm

    specs, te = real_te_spec.specs, real_te_spec.te
    before = specs.get_gpt_layer_with_transformer_engine_spec()
    assert before.submodules.self_attention.submodules.core_attention is te
    cfg = FCPConfig(enabled=True, graph="ring", topology="dgx-h100:1")
    setup_fcp(cfg, layout=MegatronLayout(world=2, cp=2), groups={}, seq_len=64)
    pm.apply_fcp(cfg)
    spec = specs.get_gpt_layer_with_transformer_engine_spec()
    attn = spec.submodules.self_attention
    fcp_cls = attn.submodules.core_attention
    assert issubclass(fcp_cls, pm.FCPCoreAttention) and fcp_cls.__wrapped__ is te
    # Everything else is the TE spec as before: linears, norms, MLP, the mask type.
    for name in ("linear_qkv", "linear_proj", "q_layernorm", "k_layernorm"):
        assert getattr(attn.submodules, name) is getattr(before.submodules.self_attention.submodules, name)
    assert attn.submodules.linear_qkv is real_te_spec.standins["TELayerNormColumnParallelLinear"]
    assert attn.params == before.submodules.self_attention.params == {"attn_mask_type": AttnMaskType.causal}
    assert _same(spec.submodules.mlp, before.submodules.mlp) and spec.module is before.module
    # MLA's TE spec takes the same slot.
    mla = specs.get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)
    assert mla.submodules.self_attention.submodules.core_attention is fcp_cls
    # Built as Attention.__init__ builds it, with a real TransformerConfig (GQA 4:2, cp = 2).
    tcfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             context_parallel_size=2, use_cpu_initialization=True, attention_dropout=0.0)
    module = fcp_cls(config=tcfg, layer_number=1, attn_mask_type=attn.params["attn_mask_type"],
                     attention_type="self", cp_comm_type=None, softmax_scale=None, pg_collection=_pgs(2))
    assert isinstance(module, pm.FCPCoreAttention) and te.built == []
    assert module._causal(None) is True and module.num_query_groups_per_partition == 2
    # MLA's head sizes (k_channels != v_channels) are served: FCP, not TE, with both sizes kept
    mla_module = fcp_cls(config=tcfg, layer_number=2, attn_mask_type=AttnMaskType.causal, attention_type="self",
                         k_channels=24, v_channels=16, cp_comm_type=None, softmax_scale=None, pg_collection=_pgs(2))
    assert mla_module._fallback_reason is None and te.built == []
    assert (mla_module.hidden_size_per_attention_head, mla_module.v_head_dim) == (24, 16)
    assert mla_module.softmax_scale == pytest.approx(24 ** -0.5)
    pm.revert_fcp()
    assert specs.get_gpt_layer_with_transformer_engine_spec().submodules.self_attention.submodules.core_attention is te


def test_the_fake_te_is_gone_after_the_real_spec_test():
    """Runs after the test above: the real modules are back and TE was never really imported."""
    pytest.importorskip("megatron.core")
    specs = importlib.import_module(SPECS)
    assert "transformer_engine" not in sys.modules and not specs.HAVE_TE
    assert sys.modules[EXT].HAVE_TE is False
