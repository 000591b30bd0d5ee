"""Version compatibility: what the installed megatron-core has, the gated CPU shims, the three
``get_batch_on_this_cp_rank`` signatures, and the refusal of Megatron's hybrid/dynamic CP.

These run on whichever megatron-core is installed; ``tests/compat/run_matrix.sh`` runs them on
every declared release (0.14-0.19). Hybrid CP exists from 0.16: where a release lacks it, the
tests that build Megatron's own hybrid objects are skipped with that reason, and the refusal is
checked on the plain attributes FCP reads.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from megatron_fcp.config import FCPConfig
from megatron_fcp.patches import REGISTRY, PatchTargetError
from megatron_fcp.patches.args import add_fcp_args, fcp_config_from_args
from megatron_fcp.patches.compat import (
    HybridCPUnsupportedError,
    cp_batch_splitter,
    has_target,
    refuse_hybrid_cp,
    source_mentions,
)

ROPE = "megatron.core.models.common.embeddings.rotary_pos_embedding"


# ---- get_batch_on_this_cp_rank signatures ----------------------------------------------------------
def _recording(signature: str):
    """A function with ``signature`` that returns what it was called with."""
    namespace: dict = {}
    exec(f"def get_batch_on_this_cp_rank{signature}:\n    return dict(locals())", namespace)  # noqa: S102
    return namespace["get_batch_on_this_cp_rank"]


GROUP = object()


@pytest.mark.parametrize("signature, called_with", [
    ("(batch, cp_group=None)", {"cp_group": GROUP}),                                       # 0.16-0.17
    ("(batch, is_hybrid_cp, cp_group=None, hybrid_cp_group_func=None, "
     "use_per_sequence_balancing=False)", {"is_hybrid_cp": False, "cp_group": GROUP}),    # 0.18+
])
def test_splitter_calls_each_signature_as_it_wants(signature, called_with):
    got = cp_batch_splitter(_recording(signature))({"tokens": 1}, cp_group=GROUP)
    assert got["batch"] == {"tokens": 1}
    assert {k: got[k] for k in called_with} == called_with


def test_splitter_batch_only_signature_refuses_a_foreign_group():
    """0.14-0.15 take ``(batch)`` and read parallel_state's CP group: another group cannot be honoured."""
    split = cp_batch_splitter(_recording("(batch)"))
    assert split({"tokens": 1}) == {"batch": {"tokens": 1}}
    with pytest.raises(ValueError, match="takes no cp_group"):
        split({"tokens": 1}, cp_group=GROUP)


def test_splitter_unknown_required_parameter_names_the_signature():
    with pytest.raises(PatchTargetError, match=r"get_batch_on_this_cp_rank\(batch, packing_mode\)"):
        cp_batch_splitter(_recording("(batch, packing_mode)"))


def test_installed_signature_is_one_the_splitter_knows():
    from megatron.core.utils import get_batch_on_this_cp_rank

    params = list(inspect.signature(get_batch_on_this_cp_rank).parameters)
    assert params[:1] == ["batch"]
    cp_batch_splitter()  # does not raise: the installed release's signature is supported


# ---- CPU shims, gated on what the release has ---------------------------------------------------------
def test_rope_shim_is_exactly_one_of_get_emb_and_forward(caplog):
    """0.14-0.15 move ``inv_freq`` to CUDA in ``forward`` (no ``get_emb``); 0.16+ in ``get_emb``."""
    from megatron_fcp.patches.cpu import apply_cpu_shims, plan_cpu_shims, revert_cpu_shims

    install, skipped = plan_cpu_shims()
    rope = {s.target for s in install} & {f"{ROPE}:RotaryEmbedding.get_emb", f"{ROPE}:RotaryEmbedding.forward"}
    assert len(rope) == 1, rope
    if has_target(f"{ROPE}:RotaryEmbedding.get_emb"):
        assert rope == {f"{ROPE}:RotaryEmbedding.get_emb"}
        assert "does not use CUDA" in skipped[f"{ROPE}:RotaryEmbedding.forward"]
    else:
        assert rope == {f"{ROPE}:RotaryEmbedding.forward"}
        assert "absent in megatron-core" in skipped[f"{ROPE}:RotaryEmbedding.get_emb"]
    with caplog.at_level(logging.INFO, logger="megatron_fcp.patches"):
        try:
            apply_cpu_shims(force=True)
        finally:
            revert_cpu_shims()
    assert any("skipped" in r.getMessage() and "RotaryEmbedding" in r.getMessage() for r in caplog.records)


class _CPGroup:
    """Rank ``r`` of a CP group of ``n`` (hashable, as RoPE's lru_cache needs)."""

    def __init__(self, n: int, r: int) -> None:
        self.n, self.r = n, r

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


def test_rope_on_cpu_matches_the_formula_whole_and_per_cp_rank():
    """A real RotaryEmbedding on the CPU: the table is ``cat(p*f, p*f)``; cp = 2 keeps chunks r, 3-r."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_fcp.patches.cpu import apply_cpu_shims, revert_cpu_shims

    apply_cpu_shims(force=True)
    try:
        dim, seq = 8, 16
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        want = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, dim]
        rope = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, use_cpu_initialization=True)
        got = rope(seq)
        assert got.device.type == "cpu" and torch.allclose(got, want)
        for r in range(2):
            fake = _CPGroup(2, r)
            if "cp_group" in inspect.signature(inspect.unwrap(RotaryEmbedding.forward)).parameters:
                part = rope(seq, cp_group=fake)
            else:  # 0.14-0.15: the group is the module's own
                rope_r = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, use_cpu_initialization=True,
                                         cp_group=fake)
                part = rope_r(seq)
            chunks = want.view(4, seq // 4, 1, 1, dim)
            assert torch.equal(part, torch.cat((chunks[r], chunks[3 - r])))
    finally:
        revert_cpu_shims()


def test_shim_gate_skips_cuda_free_targets_and_requires_missing_ones(tmp_path, monkeypatch):
    from megatron_fcp.patches.cpu import Shim

    (tmp_path / "fcp_shim_probe.py").write_text(textwrap.dedent('''
        import torch

        def on_cuda(n):
            return torch.ones(n, device="cuda")

        def anywhere(n):
            return torch.ones(n)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fcp_shim_probe", raising=False)
    make = lambda original: (lambda n: torch.zeros(n))  # noqa: E731
    assert Shim("fcp_shim_probe:on_cuda", make).skip_reason() is None
    assert "does not use CUDA" in Shim("fcp_shim_probe:anywhere", make).skip_reason()
    assert "absent" in Shim("fcp_shim_probe:gone", make, required=False).skip_reason()
    with pytest.raises(PatchTargetError, match="fcp_shim_probe:gone"):
        Shim("fcp_shim_probe:gone", make).skip_reason()
    import fcp_shim_probe

    assert source_mentions(fcp_shim_probe.on_cuda, ("cuda",)) is True
    assert source_mentions(len, ("cuda",)) is None  # a builtin has no source: assume it needs a shim


def test_rope_forward_shim_refuses_an_unknown_signature():
    from megatron_fcp.patches.cpu import _make_rope_forward

    def forward(self, max_seq_len, offset=0, packed_seq=False, cp_group=None):
        raise AssertionError("original called")

    with pytest.raises(PatchTargetError, match="RotaryEmbedding.forward"):
        _make_rope_forward(forward)


# ---- hybrid / dynamic context parallelism: refused, never mixed --------------------------------------
def _has_hybrid_cp() -> bool:
    from megatron.core.model_parallel_config import ModelParallelConfig

    return "hybrid_context_parallel" in ModelParallelConfig.__dataclass_fields__


def test_refusal_says_why_and_what_to_use_instead():
    with pytest.raises(HybridCPUnsupportedError) as err:
        refuse_hybrid_cp("somewhere", args=argparse.Namespace(hybrid_context_parallel=True))
    msg = str(err.value)
    assert msg.startswith("somewhere: --hybrid-context-parallel")
    assert "per micro batch" in msg and "fixed --context-parallel-size" in msg and "drop --fcp" in msg
    refuse_hybrid_cp("somewhere", args=argparse.Namespace(hybrid_context_parallel=False),
                     config=SimpleNamespace(), packed_seq_params=SimpleNamespace(cp_group=None))


def test_fcp_core_attention_refuses_hybrid_config_before_any_setup():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fcp.patches.megatron import FCPCoreAttention, current_runtime

    if not _has_hybrid_cp():
        pytest.skip("this megatron-core has no hybrid_context_parallel (added in 0.16)")
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, context_parallel_size=1,
                            hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=64)
    pgs = SimpleNamespace(cp=SimpleNamespace(size=lambda: 4), tp=SimpleNamespace(size=lambda: 1))
    with pytest.raises(HybridCPUnsupportedError, match="FCPCoreAttention: TransformerConfig.hybrid_context_parallel"):
        FCPCoreAttention(config=cfg, layer_number=1, attn_mask_type=None, pg_collection=pgs)
    assert current_runtime() is None  # refused before any plan was settled


def test_forward_refuses_per_micro_batch_cp_group():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fcp.patches.megatron import FCPCoreAttention

    if "local_cp_size" not in PackedSeqParams.__dataclass_fields__:
        pytest.skip("this megatron-core's PackedSeqParams has no per-micro-batch CP group (added in 0.16)")
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0)
    pgs = SimpleNamespace(cp=None, tp=SimpleNamespace(size=lambda: 1))
    att = FCPCoreAttention(config=cfg, layer_number=1, attn_mask_type=None, pg_collection=pgs)
    q = torch.zeros(4, 1, 4, 8)
    with pytest.raises(HybridCPUnsupportedError, match="per-micro-batch cp_group"):
        att(q, q, q, None, packed_seq_params=PackedSeqParams(qkv_format="thd", local_cp_size=2))


def test_patched_binding_refuses_hybrid_config_even_at_cp1():
    """At cp = 1 the replacement hands back Megatron's class: not when hybrid CP is configured."""
    from megatron.core.models import backends
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fcp.patches.megatron import apply_fcp, revert_fcp

    if not _has_hybrid_cp():
        pytest.skip("this megatron-core has no hybrid_context_parallel (added in 0.16)")
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=64)
    try:
        apply_fcp(FCPConfig(enabled=True))
        with pytest.raises(HybridCPUnsupportedError, match="in place of DotProductAttention"):
            backends.DotProductAttention(config=cfg, layer_number=1, attn_mask_type=None,
                                         pg_collection=SimpleNamespace(cp=None, tp=None))
    finally:
        revert_fcp()
    assert not REGISTRY.targets("megatron")


def test_flag_path_refuses_fcp_with_hybrid_cp():
    parser = add_fcp_args(argparse.ArgumentParser())
    parser.add_argument("--hybrid-context-parallel", action="store_true")  # Megatron-LM's flag
    args = parser.parse_args(["--fcp", "--hybrid-context-parallel"])
    with pytest.raises(HybridCPUnsupportedError, match="--fcp: --hybrid-context-parallel"):
        fcp_config_from_args(args)
    assert not fcp_config_from_args(parser.parse_args(["--hybrid-context-parallel"])).enabled  # FCP off: fine


def test_apply_fcp_refuses_hybrid_process_groups(monkeypatch):
    """``initialize_model_parallel(hybrid_context_parallel=True)`` on 4+ DPxCP ranks leaves its
    per-size groups in ``parallel_state._HYBRID_DP_CP_GROUPS`` (2 ranks build none, so this is set
    here as that call leaves it rather than spawning 4 processes)."""
    from megatron.core import parallel_state as ps

    from megatron_fcp.patches.megatron import apply_fcp, is_fcp_applied

    if not hasattr(ps, "_HYBRID_DP_CP_GROUPS"):
        pytest.skip("this megatron-core has no hybrid DPxCP groups (added in 0.16)")
    monkeypatch.setattr(ps, "_HYBRID_DP_CP_GROUPS", {2: object()})
    with pytest.raises(HybridCPUnsupportedError, match="apply_fcp\\(\\): parallel_state was initialised"):
        apply_fcp(FCPConfig(enabled=True))
    assert not is_fcp_applied() and not REGISTRY.targets("megatron")  # refused before patching
