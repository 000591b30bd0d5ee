"""Patch layer: stub megatron-core modules (originals fail loudly), the real installed one, and
the order-of-setup errors on a real 2-process gloo group."""

from __future__ import annotations

import dataclasses
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from megatron_fcp.config import FCPConfig
from megatron_fcp.patches import REGISTRY, PatchTargetError
from megatron_fcp.patches.runtime import FCPStateError, setup_fcp
from megatron_fcp.planner.megatron_layout import MegatronLayout

ORIGINAL_CALLED = "original called - patch failed"


# ---- stub megatron-core ----------------------------------------------------------------------------
class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class _AttnMaskType:
    causal, no_mask, padding, arbitrary = "causal", "no_mask", "padding", "arbitrary"


def _stub_megatron(monkeypatch, version="0.16.1", *, local_binding=True, te_binding=True):
    """Install a fake ``megatron.core`` whose attention classes raise if instantiated/called."""

    class DotProductAttention(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            raise AssertionError(ORIGINAL_CALLED)

    class TEDotProductAttention(torch.nn.Module):
        def __init__(self, config, **kwargs):
            super().__init__()
            self.config = config
            self.layer_number = kwargs.get("layer_number", 1)

        def forward(self, *args, **kwargs):
            return "te-ring"

    mods = {}

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        mods[name] = m
        return m

    mod("megatron")
    mod("megatron.core")
    mod("megatron.core.package_info", __version__=version)
    mod("megatron.core.transformer")
    mod("megatron.core.transformer.dot_product_attention", DotProductAttention=DotProductAttention)
    mod("megatron.core.transformer.attention", apply_rotary_pos_emb=lambda t, freqs, config=None, cu_seqlens=None: t)
    mod("megatron.core.transformer.enums", AttnMaskType=_AttnMaskType)
    mod("megatron.core.extensions")
    mod("megatron.core.extensions.transformer_engine", TEDotProductAttention=TEDotProductAttention)
    mod("megatron.core.extensions.transformer_engine_spec_provider",
        **({"TEDotProductAttention": TEDotProductAttention} if te_binding else {}))
    mod("megatron.core.models")
    mod("megatron.core.models.backends", **({"DotProductAttention": DotProductAttention} if local_binding else {}))
    mod("megatron.core.models.gpt")
    # This release's spec module binds something else under the TE name: must be left alone.
    mod("megatron.core.models.gpt.gpt_layer_specs", TEDotProductAttention=None)
    mod("megatron.core.parallel_state",
        get_context_parallel_group=lambda check_initialized=True: None,
        get_tensor_model_parallel_world_size=lambda: 1)
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    return SimpleNamespace(mods=mods, DotProductAttention=DotProductAttention, TEDotProductAttention=TEDotProductAttention)


def _tcfg(cp=2, **over):
    base = dict(num_attention_heads=4, num_query_groups=None, kv_channels=8, hidden_size=32,
                attention_dropout=0.0, window_size=None, softmax_type="vanilla",
                context_parallel_size=cp, params_dtype=torch.float32)
    base.update(over)
    return SimpleNamespace(**base)


def _pgs(cp):
    return SimpleNamespace(cp=_Group(cp), tp=_Group(1))


@pytest.fixture
def stub(monkeypatch):
    from megatron_fcp.patches import megatron as pm

    stubbed = _stub_megatron(monkeypatch)
    yield stubbed
    pm.revert_fcp()
    assert not REGISTRY.targets("megatron")


def _settle(cfg):
    # Pure settling for a 2-rank CP group (no processes): the patched constructor finds the runtime.
    setup_fcp(cfg, layout=MegatronLayout(world=2, cp=2), groups={}, seq_len=64)


def test_apply_patches_spec_bindings_and_constructs_fcp(stub):
    from megatron_fcp.patches import megatron as pm

    cfg = FCPConfig(enabled=True, graph="ring", topology="dgx-h100:1")
    _settle(cfg)
    targets = pm.apply_fcp(cfg)
    backends = stub.mods["megatron.core.models.backends"]
    provider = stub.mods["megatron.core.extensions.transformer_engine_spec_provider"]
    assert "megatron.core.models.backends:DotProductAttention" in targets
    assert "megatron.core.extensions.transformer_engine_spec_provider:TEDotProductAttention" in targets
    assert stub.mods["megatron.core.models.gpt.gpt_layer_specs"].TEDotProductAttention is None
    for replacement, original in ((backends.DotProductAttention, stub.DotProductAttention),
                                  (provider.TEDotProductAttention, stub.TEDotProductAttention)):
        assert issubclass(replacement, pm.FCPCoreAttention)
        assert replacement.__fcp_patched__ is True and replacement.__wrapped__ is original
    # CP > 1: the FCP module is built and the loud original never runs.
    module = backends.DotProductAttention(config=_tcfg(), layer_number=3, attn_mask_type=None,
                                          attention_type="self", pg_collection=_pgs(2))
    assert isinstance(module, pm.FCPCoreAttention) and module.cp_size == 2
    assert module.layer_number == 3 and module.softmax_scale == pytest.approx(8 ** -0.5)
    # CP = 1: the replacement hands back Megatron's own class (here: the loud stub).
    with pytest.raises(AssertionError, match=ORIGINAL_CALLED):
        backends.DotProductAttention(config=_tcfg(cp=1), layer_number=1, attn_mask_type=None,
                                     attention_type="self", pg_collection=_pgs(1))


def test_idempotent_by_identity_and_exact_revert(stub):
    from megatron_fcp.patches import megatron as pm

    backends = stub.mods["megatron.core.models.backends"]
    te_cls = stub.TEDotProductAttention
    forward_before = vars(te_cls)["forward"]
    cfg = FCPConfig(enabled=True)
    first = pm.apply_fcp(cfg)
    patched = backends.DotProductAttention
    guard = vars(te_cls)["forward"]
    assert pm.apply_fcp(cfg) == first  # second call: same targets ...
    assert backends.DotProductAttention is patched and vars(te_cls)["forward"] is guard  # ... same objects
    restored = pm.revert_fcp()
    assert sorted(restored) == sorted(first)
    assert backends.DotProductAttention is stub.DotProductAttention
    assert vars(te_cls)["forward"] is forward_before
    # An attribute the class only inherited is deleted again, not left as a copy.
    assert "forward" not in vars(stub.DotProductAttention)
    assert not pm.is_fcp_applied()


def test_fcp_patched_context_manager_restores_on_error(stub):
    from megatron_fcp.patches import megatron as pm

    backends = stub.mods["megatron.core.models.backends"]
    with pytest.raises(RuntimeError, match="boom"):
        with pm.fcp_patched(FCPConfig(enabled=True)):
            assert backends.DotProductAttention is not stub.DotProductAttention
            raise RuntimeError("boom")
    assert backends.DotProductAttention is stub.DotProductAttention
    assert not REGISTRY.targets("megatron")


def test_disabled_config_patches_nothing(stub):
    from megatron_fcp.patches import megatron as pm

    assert pm.apply_fcp(FCPConfig(enabled=False)) == []
    assert stub.mods["megatron.core.models.backends"].DotProductAttention is stub.DotProductAttention


def test_model_built_before_apply_fails_loudly(stub):
    """A TE attention with CP > 1 built before apply_fcp would run TE's ring: refuse it."""
    from megatron_fcp.patches import megatron as pm

    old = stub.TEDotProductAttention(_tcfg(cp=2), layer_number=5)
    cp1 = stub.TEDotProductAttention(_tcfg(cp=1))
    assert old() == "te-ring"
    pm.apply_fcp(FCPConfig(enabled=True))
    with pytest.raises(FCPStateError, match="layer 5.*built before apply_fcp"):
        old()
    assert cp1() == "te-ring"  # cp = 1 modules are Megatron's own on purpose
    model = torch.nn.Module()
    model.core_attention = old
    with pytest.raises(FCPStateError, match="core_attention is TEDotProductAttention"):
        pm.assert_model_uses_fcp(model)
    pm.revert_fcp()
    assert old() == "te-ring"


def test_missing_symbol_names_target_and_version(monkeypatch):
    from megatron_fcp.patches import megatron as pm

    _stub_megatron(monkeypatch, version="0.15.2", local_binding=False)
    with pytest.raises(ImportError) as err:
        pm.apply_fcp(FCPConfig(enabled=True))
    assert isinstance(err.value, PatchTargetError)
    assert "megatron.core.models.backends:DotProductAttention" in str(err.value)
    assert "0.15.2" in str(err.value)
    assert not REGISTRY.targets("megatron")


def test_failed_apply_leaves_nothing_patched(stub, monkeypatch):
    from megatron_fcp.patches import megatron as pm

    def broken(original):
        raise RuntimeError("cannot build the guard")

    monkeypatch.setattr(pm, "_make_forward_guard", broken)  # fails after the spec bindings
    with pytest.raises(RuntimeError, match="cannot build the guard"):
        pm.apply_fcp(FCPConfig(enabled=True))
    assert stub.mods["megatron.core.models.backends"].DotProductAttention is stub.DotProductAttention
    assert not REGISTRY.targets("megatron") and not pm.is_fcp_applied()


def test_version_outside_supported_range(monkeypatch):
    from megatron_fcp.patches import megatron as pm

    _stub_megatron(monkeypatch, version="0.12.0")
    with pytest.raises(ImportError, match="megatron-core 0.12.0 is outside"):
        pm.apply_fcp(FCPConfig(enabled=True))


def test_fcp_core_attention_rejects_unsupported(stub):
    from megatron_fcp.patches import megatron as pm

    with pytest.raises(NotImplementedError, match="qk_clip"):
        pm.FCPCoreAttention(config=_tcfg(cp=1, qk_clip=True), layer_number=1,
                            attn_mask_type=None, pg_collection=_pgs(1))
    with pytest.raises(NotImplementedError, match="softmax_type='quiet'"):
        pm.FCPCoreAttention(config=_tcfg(cp=1, softmax_type="quiet"), layer_number=1,
                            attn_mask_type=None, pg_collection=_pgs(1))
    sinks = pm.FCPCoreAttention(config=_tcfg(cp=1, softmax_type="learnable"), layer_number=1,  # served
                                attn_mask_type=None, pg_collection=_pgs(1))
    assert isinstance(sinks.softmax_offset, torch.nn.Parameter) and sinks.softmax_offset.shape == (4,)
    att = pm.FCPCoreAttention(config=_tcfg(cp=1, attention_dropout=0.1), layer_number=1,
                              attn_mask_type=None, pg_collection=_pgs(1))
    q = torch.zeros(4, 1, 4, 8)
    with pytest.raises(NotImplementedError, match="attention_bias"):
        att(q, q, q, None, attention_bias=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="FCP packs documents as 'thd'"):
        att(q, q, q, None, packed_seq_params=object())  # packed, but not THD
    with pytest.raises(NotImplementedError, match="attention dropout 0.1"):
        att.train()(q, q, q, None)


# ---- the real installed megatron-core ---------------------------------------------------------------
def test_real_megatron_apply_and_revert():
    pytest.importorskip("megatron.core")
    from megatron.core.models import backends
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_fcp.patches import megatron as pm

    assert backends.DotProductAttention is DotProductAttention
    try:
        targets = pm.apply_fcp(FCPConfig(enabled=True))
        assert "megatron.core.models.backends:DotProductAttention" in targets
        patched = backends.DotProductAttention
        assert issubclass(patched, pm.FCPCoreAttention) and patched.__wrapped__ is DotProductAttention
        spec = get_gpt_layer_local_spec()
        assert spec.submodules.self_attention.submodules.core_attention is patched
        assert pm.apply_fcp(FCPConfig(enabled=True)) == targets and backends.DotProductAttention is patched
    finally:
        pm.revert_fcp()
    assert backends.DotProductAttention is DotProductAttention
    spec = get_gpt_layer_local_spec()
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention


def test_real_cpu_shims_apply_and_revert_exactly():
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope
    from megatron.core.tensor_parallel import random as rnd
    from megatron.core.utils import GlobalMemoryBuffer

    from megatron_fcp.patches.cpu import apply_cpu_shims, plan_cpu_shims, revert_cpu_shims

    before = (vars(rnd)["_get_cuda_rng_state"], vars(rnd.CudaRNGStatesTracker)["add"],
              vars(GlobalMemoryBuffer)["get_tensor"], vars(rope)["get_pos_emb_on_this_cp_rank"])
    targets = apply_cpu_shims(force=True)
    try:
        assert targets == [shim.target for shim in plan_cpu_shims()[0]]
        assert rnd._get_cuda_rng_state.__wrapped__ is before[0]
        assert apply_cpu_shims(force=True) == targets  # idempotent
        tracker = rnd.CudaRNGStatesTracker()
        tracker.add("a", 7)
        state = torch.get_rng_state()
        with tracker.fork("a"):
            first = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), state)  # fork restored the CPU generator
        torch.manual_seed(7)
        assert torch.equal(first, torch.rand(3))  # the forked stream is seed 7's
        buf = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")
        assert buf.shape == (2, 3) and buf.device.type == "cpu"
        emb = torch.arange(8.0).view(8, 1, 1, 1)
        got = rope.get_pos_emb_on_this_cp_rank(emb, 0, SimpleNamespace(size=lambda: 2, rank=lambda: 1))
        assert got.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]  # chunks 1 and 2 of 4
    finally:
        revert_cpu_shims()
    after = (vars(rnd)["_get_cuda_rng_state"], vars(rnd.CudaRNGStatesTracker)["add"],
             vars(GlobalMemoryBuffer)["get_tensor"], vars(rope)["get_pos_emb_on_this_cp_rank"])
    assert all(a is b for a, b in zip(before, after))


# ---- order of setup on a real gloo group --------------------------------------------------------------
def _order_worker(rank: int, world: int) -> dict:
    """2 ranks, cp = 2: Megatron's local attention refuses CP; FCP works; re-created groups fail."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fcp.patches.compat import cp_batch_splitter
    from megatron_fcp.patches.cpu import apply_cpu_shims
    from megatron_fcp.patches.megatron import FCPCoreAttention, apply_fcp, revert_fcp

    apply_cpu_shims()
    out: dict = {}

    def init(cp):
        ps.initialize_model_parallel(context_parallel_size=cp, create_gloo_process_groups=False)
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, context_parallel_size=cp,
                                 use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)

    def gpt(cfg):
        torch.manual_seed(0)  # same weights every time
        return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                        max_sequence_length=32, position_embedding_type="rope")

    tokens = torch.arange(32).remainder(64)[None, :]
    # 1) spec route at cp = 1 equals Megatron's DotProductAttention (dp = 2 here).
    cfg = init(1)
    q, k, v = (torch.randn(16, 2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mine = FCPCoreAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal)
    ref = DotProductAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    out["spec_cp1_maxdiff"] = float((mine(q, k, v, None) - ref(q, k, v, None)).abs().max())
    ps.destroy_model_parallel()

    # 2) without FCP, the local spec refuses cp > 1 (Megatron's own assertion).
    cfg = init(2)
    try:
        gpt(cfg)
        out["local_cp2_without_fcp"] = "built"
    except AssertionError as e:
        out["local_cp2_without_fcp"] = str(e)

    # 3) FCP: settle, build, run.
    fcp = FCPConfig(enabled=True, graph="ring", topology="dgx-h100:1")
    try:
        apply_fcp(fcp)
        setup_fcp(fcp, seq_len=32)
        model = gpt(cfg)
        batch = cp_batch_splitter()({"tokens": tokens, "labels": tokens, "position_ids": tokens.clone()})
        out["loss_before"] = float(model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum())
        # 4) the CP groups are re-created (destroy + initialize): the old model must not run.
        ps.destroy_model_parallel()
        cfg = init(2)
        try:
            model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            out["stale_group"] = "ran"
        except FCPStateError as e:
            out["stale_group"] = str(e)
        # 5) documented fix: settle again and rebuild the model.
        setup_fcp(fcp, seq_len=32)
        model = gpt(cfg)
        out["loss_after"] = float(model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum())
        # 6) the configured block kernel reaches the attention: cpu-flash trains the same model to
        #    FP32 rounding, and refuses FP64 inputs (which only the kernel itself checks).
        revert_fcp()
        flash = dataclasses.replace(fcp, kernel="cpu-flash")
        apply_fcp(flash)
        setup_fcp(flash, seq_len=32)
        model = gpt(cfg)
        out["loss_flash"] = float(model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum())
        attn = FCPCoreAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal)
        q64 = torch.randn(16, 1, 4, 8, dtype=torch.float64)
        try:
            attn(q64, q64, q64, None)
            out["flash_fp64"] = "ran"
        except ValueError as e:
            out["flash_fp64"] = str(e)
    finally:
        revert_fcp()
        ps.destroy_model_parallel()
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_order_of_setup_on_gloo():
    from megatron_fcp.testing.launch import run_gloo

    results = run_gloo(_order_worker, 2, timeout_s=240)
    for r in results:
        assert r["spec_cp1_maxdiff"] < 1e-6
        assert "Context parallelism is only supported by TEDotProductAttention" in r["local_cp2_without_fcp"]
        assert "re-created after" in r["stale_group"] and "rebuild the model" in r["stale_group"]
        assert r["loss_after"] == pytest.approx(r["loss_before"], rel=1e-6)  # same seed, same model
        assert r["loss_flash"] == pytest.approx(r["loss_before"], rel=1e-5)  # another kernel, FP32 rounding
        assert "kernel='math'" in r["flash_fp64"], r["flash_fp64"]


# ---- plan setup from Megatron's layout (pure) ---------------------------------------------------------
def test_layout_groups_follow_tp_cp_ep_dp_pp():
    layout = MegatronLayout(world=8, tp=2, cp=2)
    assert layout.dp == 2
    assert layout.cp_groups() == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.tp_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert MegatronLayout.parse("world=16,tp=2,pp=1,cp=8").cp_groups()[1] == (1, 3, 5, 7, 9, 11, 13, 15)
    with_pp = MegatronLayout(world=8, tp=2, pp=2, cp=2)
    assert with_pp.cp_groups() == [(0, 2), (1, 3), (4, 6), (5, 7)] and with_pp.dp == 1
    for group in layout.cp_groups():  # a CP group meets every TP group in at most one rank
        assert all(len(set(group) & set(tp)) <= 1 for tp in layout.tp_groups())


@pytest.mark.parametrize("text, words", [
    ("world=4,cp=3", "--context-parallel-size"),
    ("world=8,tp=2,cp=3", "not divisible"),
    ("tp=2,cp=2", "world=N is required"),
    ("world=8,tp=2", "cp=N is required"),
    ("world=8,ep=2", "expected world=N"),
])
def test_layout_errors_name_the_flag(text, words):
    with pytest.raises(ValueError, match=words):
        MegatronLayout.parse(text)


def test_setup_fcp_settles_every_group_and_prints_the_rank_map():
    from megatron_fcp.patches.runtime import rank_map_table, resolve_topology

    layout = MegatronLayout(world=16, tp=2, cp=8)
    cfg = FCPConfig(enabled=True, graph="hierarchical", topology="dgx-h100:2", block_tokens=1024)
    rt = setup_fcp(cfg, seq_len=32768, heads=32, kv_heads=8, head_dim=128, layout=layout, groups={})
    try:
        assert sorted(k[0] for k in rt.plans) == sorted(layout.cp_groups())
        assert all(k[1] is True and k[2] == 2 for k in rt.plans)  # 32768/8/2 = 2048 tokens = 2 blocks
        assert all(p.ranks == k[0] for k, p in rt.plans.items())
        assert "graph=hierarchical" in rt.summary(3) and "ranks=[1, 3, 5" in rt.summary(3)
        with pytest.raises(FCPStateError, match="no FCP plan was settled for CP group"):
            rt.plan((0, 1), causal=True)
        table = rank_map_table(layout, resolve_topology("dgx-h100:2", 16))
        assert "CP group 1: cp0=r1(n0.1)" in table and "cp4=r9(n1.1)" in table
    finally:
        from megatron_fcp.patches.runtime import reset_fcp

        reset_fcp()


def _tp_peer_transfers(plan, layout: MegatronLayout) -> list:
    """Transfers of ``plan`` that leave its CP group or join two tensor-parallel peers."""
    group = set(plan.ranks)
    return [t for _, t in plan.transfers()
            if t.src not in group or t.dst not in group or (layout.tp > 1 and t.dst in layout.tp_group_of(t.src))]


def test_the_tp_peer_check_catches_a_plan_over_a_tp_group():
    from megatron_fcp.contract.plan import ring_plan

    layout = MegatronLayout(world=4, tp=2, cp=2)
    assert _tp_peer_transfers(ring_plan((0, 2)), layout) == []  # a real CP group
    assert len(_tp_peer_transfers(ring_plan((0, 1)), layout)) == 4  # ranks 0 and 1 form a TP group


@pytest.mark.parametrize("graph", ["auto", "ring", "full", "hierarchical", "leader", "spanning"])
def test_settled_plans_never_join_tp_peers(graph):
    """Every plan setup_fcp settles for tp 2 x cp 8 on two DGX-H100 nodes stays inside its CP group."""
    from megatron_fcp.patches.runtime import reset_fcp

    layout = MegatronLayout(world=16, tp=2, cp=8)
    try:
        runtime = setup_fcp(FCPConfig(enabled=True, graph=graph, topology="dgx-h100:2"), layout=layout, groups={})
        assert len(runtime.plans) == 2
        for plan in runtime.plans.values():
            assert plan.verified and _tp_peer_transfers(plan, layout) == []
    finally:
        reset_fcp()


@pytest.mark.parametrize("spec, world, words", [
    ("examples/configs/topology_2x2.yaml", 8, "describes 4 ranks but the job has 8"),
    ("dgx-x100:2", 8, "neither a preset"),
    ("missing.yaml", 4, "not found"),
])
def test_resolve_topology_errors(spec, world, words):
    import os

    from megatron_fcp.patches.runtime import resolve_topology

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, spec) if spec.startswith("examples/") else spec
    with pytest.raises(ValueError, match=words):
        resolve_topology(path, world)
