"""The head-parallel stage's configuration: FCPConfig.head_parallel, --fcp-head-parallel, setup
errors before any communication, the runtime's plan builder, and the packed-batch refusal.
(Numerics: tests/test_head_parallel_dist.py; Megatron end to end: tests/test_gpt_e2e.py.)"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from megatron_fcp.config import FCPConfig
from megatron_fcp.patches.args import add_fcp_args, fcp_config_from_args
from megatron_fcp.patches.runtime import group_head_parallel_plan, reset_fcp, setup_fcp
from megatron_fcp.planner.megatron_layout import MegatronLayout
from megatron_fcp.contract.head_parallel import group_placement
from megatron_fcp.topology import load_topology


@pytest.fixture(autouse=True)
def _no_runtime():
    reset_fcp()
    yield
    reset_fcp()


def test_config_values_flag_and_yaml(tmp_path):
    assert FCPConfig().head_parallel == "auto" and FCPConfig().head_parallel_degree(8) == 1  # as configured; setup_fcp settles auto
    assert FCPConfig(head_parallel=2).head_parallel_degree(8) == 2
    parser = add_fcp_args(argparse.ArgumentParser())
    assert fcp_config_from_args(parser.parse_args(["--fcp-head-parallel", "4"])).head_parallel == 4
    assert fcp_config_from_args(parser.parse_args(["--fcp-head-parallel", "auto"])).head_parallel == "auto"
    path = tmp_path / "fcp.yaml"
    path.write_text("fcp:\n  enabled: true\n  head_parallel: 2\n")
    assert FCPConfig.from_yaml(str(path)).head_parallel == 2
    assert "head_parallel: 2" in FCPConfig(head_parallel=2).to_yaml()
    for bad in (0, -2, "two", True, 1.5):
        with pytest.raises(ValueError, match=r"--fcp-head-parallel \(fcp.head_parallel\) must be an integer >= 1 or auto"):
            FCPConfig(head_parallel=bad)
    with pytest.raises(ValueError, match=r"--fcp-head-parallel 3 \(fcp.head_parallel\) must divide the context-parallel size 4"):
        FCPConfig(head_parallel=3).head_parallel_degree(4)


def test_setup_refuses_a_bad_degree_before_anything():
    cfg = FCPConfig(enabled=True, topology="dgx-h100:1", head_parallel=3)
    with pytest.raises(ValueError, match="--fcp-head-parallel 3 .*must divide the context-parallel size 4"):
        setup_fcp(cfg, layout=MegatronLayout(world=4, cp=4), groups={}, seq_len=64)
    cfg = cfg.replace(head_parallel=4)
    with pytest.raises(ValueError, match="--fcp-head-parallel 4 with 6 query / 6 KV heads per tensor-parallel rank"):
        setup_fcp(cfg, layout=MegatronLayout(world=4, cp=4), groups={}, seq_len=64, heads=6, kv_heads=6)
    # tp = 2 halves the heads each rank sees: 8 heads / tp 2 = 4, fine for a = 2; 4 / 2 = 2 is not for a = 4
    ok = setup_fcp(cfg.replace(head_parallel=2), layout=MegatronLayout(world=8, tp=2, cp=4), groups={},
                   seq_len=64, heads=8, kv_heads=2)
    assert ok.head_parallel_degree() == 2
    with pytest.raises(ValueError, match="with 2 query / 1 KV heads per tensor-parallel rank"):
        setup_fcp(cfg.replace(head_parallel=4), layout=MegatronLayout(world=8, tp=2, cp=4), groups={},
                  seq_len=64, heads=4, kv_heads=2)


def test_runtime_plan_builder():
    topo = load_topology("dgx-h100:2")  # 2 nodes x 8: CP ranks 4..11 straddle the nodes
    ranks = tuple(range(4, 12))
    cfg = FCPConfig(enabled=True, graph="hierarchical")
    hp = group_head_parallel_plan(cfg, topo, ranks, 4, 64, causal=True, heads=8, kv_heads=2)
    assert hp.head_groups == ((4, 5, 6, 7), (8, 9, 10, 11)) and hp.kv_replication == 2
    assert hp.kv_plan.ranks == (0, 1) and hp.kv_plan.placement == group_placement(ranks, hp.head_groups, 64, True)
    assert hp.kv_plan_for(3).ranks == (7, 11)
    hp.kv_plan_for(3).verify()
    whole = group_head_parallel_plan(cfg, topo, ranks, 8, 64, causal=False, heads=8, kv_heads=8)
    assert whole.kv_plan is None and whole.num_groups == 1
    none = group_head_parallel_plan(cfg, topo, ranks, 1, 64, causal=True, heads=8, kv_heads=8)
    assert none.kv_plan.ranks == tuple(range(8)) and len(none.kv_plan.placement.blocks[0]) == 2


def test_stage_plan_is_one_object_so_the_executor_plans_backward_once():
    """Every call of the head-parallel engine asks kv_plan_for(j); the executor caches its backward
    waves and KV decision per plan object, so a fresh relabelled plan per call re-planned the waves
    every layer (25 ms of CPU a call on the emulated 2x4 GQA stage)."""
    import pickle

    from megatron_fcp.schedule.waves import choose_backward_kv, plan_waves

    topo = load_topology("dgx-h100:2")
    hp = group_head_parallel_plan(FCPConfig(enabled=True, graph="hierarchical"), topo, tuple(range(4, 12)), 4, 64,
                                  causal=True, heads=8, kv_heads=2)
    stage = hp.kv_plan_for(1)
    assert hp.kv_plan_for(1) is stage and hp.kv_plan_for(2) is not stage and stage.ranks == (5, 9)
    size = lambda b: 1000  # noqa: E731
    waves = plan_waves(stage, size, cache_key="k")
    assert plan_waves(hp.kv_plan_for(1), size, cache_key="k") is waves  # the cache hit
    assert choose_backward_kv("auto", hp.kv_plan_for(1), size, cache_key="k") in ("keep", "resend")
    copy = pickle.loads(pickle.dumps(hp))                               # the emulator ships plans pickled
    assert copy == hp and hash(copy) == hash(hp) and copy.kv_plan_for(1) == stage


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_packed_batches_run_the_stage_and_bad_heads_are_refused_naming_the_fix():
    """Packed batches with --fcp-head-parallel > 1 are served by FCP (the stage on THD shards:
    tests/test_head_parallel_thd.py), and head counts the degree cannot split are refused before
    any communication."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_fcp.patches.megatron import FCPCoreAttention

    rt = setup_fcp(FCPConfig(enabled=True, topology="dgx-h100:1", head_parallel=2),
                   layout=MegatronLayout(world=2, cp=2), groups={}, seq_len=64)
    cfg = SimpleNamespace(num_attention_heads=4, num_query_groups=None, kv_channels=8, hidden_size=32,
                          attention_dropout=0.0, window_size=None, softmax_type="vanilla", context_parallel_size=2,
                          params_dtype=torch.float32)
    att = FCPCoreAttention(config=cfg, layer_number=1, attn_mask_type=None,
                           pg_collection=SimpleNamespace(cp=_Group(2), tp=_Group(1)))
    from megatron.core.transformer.enums import AttnMaskType

    assert att._forward_reason(AttnMaskType.causal, None, PackedSeqParams(qkv_format="thd")) is None
    hp = rt.packed_head_parallel((0, 1), (5, 7), causal=True, heads=4, kv_heads=4)
    assert hp.degree == 2 and hp.num_groups == 1 and hp.placement == rt.packed_placement((5, 7), cp_ranks=(0, 1))
    with pytest.raises(ValueError, match="must divide the query heads 3"):
        rt.packed_head_parallel((0, 1), (5, 7), causal=True, heads=3, kv_heads=3)


@pytest.mark.slow  # a long single-process sweep (docs/megatron.md, "Test tiers")
def test_auto_settles_the_planners_degree_at_setup():
    """--fcp-head-parallel auto: setup_fcp takes choose_schedule's degree for the run's shape
    (heads per tensor-parallel rank), topology and backward (waves; tests/test_runtime_schedule.py
    checks the rest of the choice); 1 without shapes or CP."""
    from megatron_fcp.cost.model import AttentionShape
    from megatron_fcp.planner.choose import choose_schedule
    from megatron_fcp.schedule.program import WaveBackward

    cfg = FCPConfig(enabled=True, topology="dgx-h100:2")
    layout = MegatronLayout(world=16, cp=16)
    rt = setup_fcp(cfg, layout=layout, groups={}, seq_len=32768, heads=32, kv_heads=8, head_dim=128)
    want = choose_schedule("dgx-h100:2", tuple(range(16)), AttentionShape(32768, 32, 8, 128, 2),
                           backward=WaveBackward()).degree
    assert rt.head_parallel_degree() == want and want > 1
    assert rt.config.head_parallel == "auto"
    reset_fcp()
    assert setup_fcp(cfg, layout=layout, groups={}, seq_len=32768).head_parallel_degree() == 1  # no head counts
    reset_fcp()
    assert setup_fcp(cfg.replace(head_parallel=1), layout=layout, groups={}, seq_len=32768, heads=32, kv_heads=8,
                     head_dim=128).head_parallel_degree() == 1


def test_auto_lets_each_packed_batch_choose_its_degree():
    """--fcp-head-parallel auto without a settled schedule (packed runs): every batch runs the
    degree choose_packed_head_parallel picks for its documents, and its layout follows (Note
    [Head-parallel degree of a packed batch]); an explicit degree runs on every batch."""
    from megatron_fcp.contract.head_parallel import head_groups_for
    from megatron_fcp.contract.head_parallel_packed import place_packed_groups
    from megatron_fcp.contract.layer_placement import place_packed_layer
    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.cost.model import AttentionShape
    from megatron_fcp.planner.head_parallel import choose_packed_head_parallel

    ranks = tuple(range(8))
    rt = setup_fcp(FCPConfig(enabled=True, topology="dgx-h100:1", graph="hierarchical", block_tokens=64),
                   layout=MegatronLayout(world=8, cp=8), groups={}, heads=8, kv_heads=2, head_dim=16)
    assert rt.packed_degrees == (1, 2, 4, 8)
    for seed in range(4):
        docs = tuple(lognormal_lengths(5.0, 1.0, 2048, seed=seed))
        want, _ = choose_packed_head_parallel("dgx-h100:1", ranks, docs, AttentionShape(2048, 8, 2, 16, 2),
                                              graph="hierarchical", block_tokens=64)
        got = rt.packed_degree(ranks, docs)
        assert got == want
        pl = rt.packed_placement(docs, cp_ranks=ranks)
        if got == 1:
            assert pl == place_packed_layer(docs, 8, block_tokens=64)   # --fcp-packed-balance's default
        else:
            assert pl == place_packed_groups(docs, ranks, head_groups_for("dgx-h100:1", ranks, got), block_tokens=64,
                                             balance="layer")[1]
            assert rt.packed_head_parallel(ranks, docs, causal=True, heads=8, kv_heads=2).degree == got
    reset_fcp()
    rt = setup_fcp(FCPConfig(enabled=True, topology="dgx-h100:1", head_parallel=2), layout=MegatronLayout(world=8, cp=8),
                   groups={}, heads=8, kv_heads=2, head_dim=16)
    assert rt.packed_degrees == () and rt.packed_degree(ranks, (100, 20)) == 2
    reset_fcp()


def test_a_packed_batch_runs_the_stage_its_degree_choice_compiled(monkeypatch):
    """Under --fcp-head-parallel auto the degree choice compiles every degree's stage; the batch
    runs the chosen one as compiled (no second compile), and it equals a fresh compile."""
    from megatron_fcp.contract.head_parallel import head_groups_for
    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.patches import runtime as runtime_mod
    from megatron_fcp.planner.head_parallel import compile_packed_head_parallel

    calls = []

    def counting(*args, **kwargs):
        calls.append(args[5])
        return compile_packed_head_parallel(*args, **kwargs)

    ranks = tuple(range(8))
    rt = setup_fcp(FCPConfig(enabled=True, topology="dgx-h100:1", graph="hierarchical", block_tokens=64),
                   layout=MegatronLayout(world=8, cp=8), groups={}, heads=8, kv_heads=2, head_dim=16)
    monkeypatch.setattr(runtime_mod, "compile_packed_head_parallel", counting)
    seen = 0
    for seed in range(6):
        docs = tuple(lognormal_lengths(5.0, 1.0, 2048, seed=seed))
        a = rt.packed_degree(ranks, docs)
        if a == 1:
            continue
        seen += 1
        hp = rt.packed_head_parallel(ranks, docs, causal=True, heads=8, kv_heads=2)
        assert calls == [] and hp.degree == a
        assert hp == compile_packed_head_parallel("dgx-h100:1", ranks, docs, 8, 2, a, "hierarchical",
                                                  head_groups=head_groups_for("dgx-h100:1", ranks, a),
                                                  block_tokens=64, head_dim=16, dtype_bytes=2)
        assert rt.packed_placement(docs, cp_ranks=ranks) == hp.placement
    assert seen, "no batch chose a degree above 1: the test checks nothing"
    reset_fcp()
