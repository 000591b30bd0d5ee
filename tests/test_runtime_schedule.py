"""The Megatron runtime runs the planner's whole choice (Note [The runtime runs the planner's choice]
in megatron_fcp.patches.schedule): degree, graph, parts per chunk and stagger, priced with the
backward the executor runs (waves, keep or resend); explicit flags constrain the search; the choice
is a pure function of its inputs. Planning only, no processes (setup_fcp on hand-made layouts)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from megatron_fcp.config import FCPConfig
from megatron_fcp.patches.runtime import reset_fcp, setup_fcp
from megatron_fcp.cost.model import AttentionShape
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.megatron_layout import MegatronLayout
from megatron_fcp.planner.choose import choose_head_parallel, choose_schedule
from megatron_fcp.planner.head_parallel import compile_head_parallel
from megatron_fcp.contract.head_parallel import stage_plan
from megatron_fcp.cost.head_parallel import simulate_head_parallel
from megatron_fcp.schedule.program import RING_BUDGET, WaveBackward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GQA = dict(heads=32, kv_heads=8, head_dim=128)
ODD_CHUNK = 2731  # tokens per zigzag chunk: 2, 4 and 8 parts are all uneven


@pytest.fixture(autouse=True)
def _no_runtime():
    reset_fcp()
    yield
    reset_fcp()


def _setup(topology: str, cp: int, seq_len: int, tp: int = 1, heads: dict = GQA, **cfg):
    layout = MegatronLayout(world=cp * tp, tp=tp, cp=cp)
    return setup_fcp(FCPConfig(enabled=True, topology=topology, **cfg), layout=layout, groups={}, seq_len=seq_len,
                     **heads)


def _same_plan(a, b) -> bool:
    return (a.name, a.ranks, a.causal, a.parts_per_chunk, a.rounds) == (b.name, b.ranks, b.causal, b.parts_per_chunk,
                                                                          b.rounds)


# ---- the cost model prices the backward the executor runs --------------------------------------------
def test_wave_backward_prices_what_the_executor_runs():
    """a = 1, whole chunks, 128K on dgx-h100:2: the one-pass backward (the benchmarks' default,
    unchanged) vs the executor's waves (keep or resend, as auto decides at cp = 16: resend); two
    parts per chunk balance the waves (what FCPRuntime.parts_per_chunk relies on). Relations, not the
    ratios themselves (1.33x and 1.07x when this test was written)."""
    shape = AttentionShape(131072, 32, 8, 128, 2)
    ranks = range(16)
    whole = compile_head_parallel("dgx-h100:2", ranks, shape, 1, "hierarchical")
    halves = compile_head_parallel("dgx-h100:2", ranks, shape, 1, "hierarchical", parts_per_chunk=2)
    one = simulate_head_parallel(whole, "dgx-h100:2", shape)
    waves = simulate_head_parallel(whole, "dgx-h100:2", shape, backward=WaveBackward())
    halved = simulate_head_parallel(halves, "dgx-h100:2", shape, backward=WaveBackward())
    one_halves = simulate_head_parallel(halves, "dgx-h100:2", shape)
    assert waves.meta["backward_kv"] == halved.meta["backward_kv"] == "resend"
    assert one.meta["fwd_total_s"] == waves.meta["fwd_total_s"]  # the forward is the same
    assert waves.meta["one_pass_bwd_s"] == one.meta["bwd_total_s"]  # the one-pass backward it is compared with
    keep = simulate_head_parallel(whole, "dgx-h100:2", shape, backward=WaveBackward("keep"))
    assert keep.meta["backward_kv"] == "keep"
    # the one-pass backward bounds the waves from below; re-sending costs at most its own transfers
    assert one.total_s < keep.total_s <= waves.total_s
    assert waves.meta["bwd_total_s"] <= keep.meta["bwd_total_s"] + waves.meta["resend_s"] * (1 + 1e-9)
    assert one_halves.total_s <= halved.total_s
    # two parts per chunk balance the waves (whole chunks: some ranks have twice the work of others in
    # a wave): the gap to the one-pass backward shrinks, and the executor's backward gets faster
    assert halved.total_s / one_halves.total_s < waves.total_s / one.total_s
    assert halved.total_s < waves.total_s


def test_auto_decides_keep_or_resend_as_the_executor_does():
    """cp = 2 causal keeps within the ring's budget; larger groups re-send; an explicit budget in
    bytes is compared with micro_batch sequences' blocks (the executor's K/V bytes per token)."""
    shape = AttentionShape(8192, 8, 2, 64, 2)
    two = compile_head_parallel("dgx-h100:1", range(2), shape, 1, "ring")
    four = compile_head_parallel("dgx-h100:1", range(4), shape, 1, "ring")
    assert simulate_head_parallel(two, "dgx-h100:1", shape, backward=WaveBackward()).meta["backward_kv"] == "keep"
    assert simulate_head_parallel(four, "dgx-h100:1", shape, backward=WaveBackward()).meta["backward_kv"] == "resend"
    # rank 0 of cp = 4 keeps 6 of the 8 chunks: 6 * 1024 tokens * 2 * 2 heads * 64 * 2 bytes = 3 MiB per sequence
    kept = 6 * 1024 * 2 * 2 * 64 * 2
    for budget, mb, want in ((kept, 1, "keep"), (kept - 1, 1, "resend"), (kept, 2, "resend"), (2 * kept, 2, "keep")):
        got = simulate_head_parallel(four, "dgx-h100:1", shape, backward=WaveBackward("auto", budget, mb))
        assert got.meta["backward_kv"] == want, (budget, mb)
    with pytest.raises(ValueError, match="--fcp-kv-memory-budget"):
        WaveBackward("auto", -2)
    with pytest.raises(ValueError, match="--fcp-backward-kv"):
        WaveBackward("sometimes")


@pytest.mark.slow  # a long single-process sweep (docs/megatron.md, "Test tiers")
def test_the_benchmarks_default_is_unchanged():
    """choose_head_parallel without ``backward`` prices the one-pass backward, as before (a = 2 at
    32K on dgx-h100:2, a hierarchical KV stage); the backward the runtime runs picks differently
    there: a = 2 with a ring KV stage, whose backward streams (Note [Streaming chain backward];
    a hierarchical stage's would re-send in waves), 0.2% ahead of a = 8's ring (TE's a2a+p2p)."""
    shape = AttentionShape(32768, 32, 8, 128, 2)
    hp = choose_head_parallel("dgx-h100:2", range(16), shape)
    assert hp.degree == 2 and hp.kv_plan.name == "hierarchical"
    runtime = choose_schedule("dgx-h100:2", range(16), shape, backward=WaveBackward())
    assert (runtime.degree, runtime.plan.kv_plan.name, runtime.backward_kv) == (2, "ring", "resend")
    assert runtime.runner_up[0].startswith("a=8 graph=ring")


# ---- the runtime runs the choice ---------------------------------------------------------------------------
def test_runtime_runs_the_choice_with_uneven_parts():
    """Chunks of 2731 tokens. dgx-h100:1, cp = 8: unconstrained the planner picks the ring, whose
    backward streams whole chunks. pcie-box:2, cp = 16, ``--fcp-graph full``: it picks a = 1 with
    uneven parts per chunk (resend in waves) at ``--fcp-head-parallel 1``; the runtime's settled plan of every CP group is the
    planner's. (On dgx-h100:1 ``full`` ties whole chunks with two parts since waves hold a shard,
    2026-12-03, and takes whole chunks.)"""
    shape = AttentionShape(2 * 8 * ODD_CHUNK, 32, 8, 128, 2)
    ring = choose_schedule("dgx-h100:1", range(8), shape, backward=WaveBackward())
    assert ring.label == "a=1 graph=ring parts=1" and ring.backward_form == "chain"
    assert "backward resend streamed hop by hop" in ring.describe()
    seq = 2 * 16 * ODD_CHUNK
    shape = AttentionShape(seq, 32, 8, 128, 2)
    want = choose_schedule("pcie-box:2", range(16), shape, graph="full", degree=1, backward=WaveBackward())
    assert (want.degree, want.backward_kv) == (1, "resend") and want.parts > 1 and ODD_CHUNK % want.parts
    assert want.backward_form == "waves"
    rt = _setup("pcie-box:2", 16, seq, graph="full", head_parallel=1)
    assert rt.schedule == want and rt.head_parallel_degree() == 1
    assert rt.parts_per_chunk(seq // 16) == want.parts
    plan = rt.plans[(tuple(range(16)), True, want.parts)]
    assert _same_plan(plan, stage_plan(want.plan, seq)) and plan.name == want.graph
    assert rt.parts_per_chunk(seq // 16 - 2) == 2  # another length: FCPRuntime's rule (resend at cp > 2)


MHA = dict(heads=32, kv_heads=32, head_dim=128)


@pytest.mark.parametrize("topology, cp, seq, tp, heads, label", [
    ("dgx-h100:2", 16, 32768, 1, GQA, "a=2 graph=ring parts=1"),
    ("pcie-box:2", 16, 2 * 16 * ODD_CHUNK, 1, MHA, "a=8 graph=ring parts=1 stagger=8"),
    ("single-uplink:2", 8, 16384, 2, GQA, None),   # at 32K a = 1 wins since waves hold a shard
])
@pytest.mark.slow  # a long single-process sweep (docs/megatron.md, "Test tiers")
def test_runtime_runs_the_choice_with_a_head_parallel_stage(topology, cp, seq, tp, heads, label):
    """Degree, KV-stage graph and stagger: the runtime's stage plan of CP group 0 (built at setup)
    is the planner's, every other CP group's the same schedule on its own ranks; tp = 2 chooses
    for the heads each tensor-parallel rank holds."""
    rt = _setup(topology, cp, seq, tp=tp, heads=heads)
    ranks = MegatronLayout(world=cp * tp, tp=tp, cp=cp).cp_groups()
    h, hk = heads["heads"] // tp, heads["kv_heads"] // tp
    want = choose_schedule(topology, ranks[0], AttentionShape(seq, h, hk, 128, 2), backward=WaveBackward())
    assert rt.schedule == want and (label is None or want.label == label)
    assert rt.head_parallel_degree() == want.degree > 1 and rt.parts_per_chunk(seq // cp) == 1
    for group in ranks:
        hp = rt.hp_plans[(group, True, seq // cp, h, hk)]
        assert hp.degree == want.degree and hp.ranks == group
        if group == ranks[0]:
            assert hp == want.plan  # head groups, KV-stage plan (graph, stagger) and replication
        else:
            assert hp.kv_plan == want.plan.kv_plan
    assert (rt.config.head_parallel, rt.config.graph, rt.config.block_tokens) == ("auto", "auto", 0)


@pytest.mark.slow  # a long single-process sweep (docs/megatron.md, "Test tiers")
def test_explicit_flags_win_and_the_rest_is_chosen_under_them():
    shape = AttentionShape(32768, 32, 8, 128, 2)
    bw = WaveBackward()
    one = _setup("dgx-h100:2", 16, 32768, head_parallel=1)
    assert one.schedule == choose_schedule("dgx-h100:2", range(16), shape, degree=1, backward=bw)
    assert one.head_parallel_degree() == 1 and one.schedule.degree == 1
    reset_fcp()
    full = _setup("dgx-h100:2", 16, 32768, graph="full")
    assert full.schedule.graph == "full" and full.schedule == choose_schedule("dgx-h100:2", range(16), shape,
                                                                              graph="full", backward=bw)
    reset_fcp()
    blocks = _setup("dgx-h100:2", 16, 32768, block_tokens=256)  # 1024-token chunks in 4: only a = 1 cuts chunks
    assert (blocks.schedule.degree, blocks.schedule.parts) == (1, 4) and blocks.parts_per_chunk(2048) == 4
    reset_fcp()
    keep = _setup("dgx-h100:2", 16, 32768, backward_kv="keep", head_parallel=1)
    assert keep.schedule.backward_kv == "keep"
    assert keep.schedule == choose_schedule("dgx-h100:2", range(16), shape, degree=1,
                                            backward=WaveBackward("keep", RING_BUDGET))
    reset_fcp()
    # a degree no head group inside a node can take (16 spans both nodes): no choice, the flags as given
    spans = _setup("dgx-h100:2", 16, 32768, head_parallel=16)
    assert spans.schedule is None and spans.head_parallel_degree() == 16
    assert spans.parts_per_chunk(2048) == 2  # FCPRuntime's rule where no choice exists


def test_no_shapes_no_choice():
    rt = setup_fcp(FCPConfig(enabled=True, topology="dgx-h100:1"), layout=MegatronLayout(world=4, cp=4), groups={},
                   seq_len=64)
    assert rt.schedule is None and rt.schedule_report() is None and rt.head_parallel_degree() == 1
    assert "schedule:" not in rt.summary(0)


def test_the_choice_is_logged_reported_and_agreed(caplog):
    with caplog.at_level(logging.INFO, logger="megatron_fcp"):
        rt = _setup("pcie-box:2", 16, 2 * 16 * ODD_CHUNK, graph="full", head_parallel=1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("FCP schedule")]
    assert len(lines) == 1 and rt.schedule.label in lines[0] and "runner-up" in lines[0], lines
    assert "predicted fwd+bwd" in lines[0] and "backward resend in waves" in lines[0]
    assert rt.schedule_report()["backward_form"] == "waves"
    summary = rt.summary(0)
    assert f"schedule: {rt.schedule.label}" in summary and "runner-up" in summary
    report = rt.schedule_report()
    assert (report["head_parallel"], report["parts"], report["graph"]) == (1, rt.schedule.parts, rt.schedule.graph)
    assert rt.schedule.parts > 1
    assert report["predicted_ms"] == pytest.approx(rt.schedule.total_s * 1e3, rel=1e-4)
    assert report["runner_up"]["label"] != report["label"]
    assert report["runner_up"]["predicted_ms"] >= report["predicted_ms"] * (1 - 1e-3)
    entry = rt.report_layer(1)
    assert entry["schedule"] == rt.schedule.label and entry["plan"] == rt.schedule.graph
    from megatron_fcp.patches.runtime import setup_fingerprint

    assert setup_fingerprint(rt, tuple(range(16)), rt.schedule.parts)["schedule"] == rt.schedule.label


# ---- a pure function: the same answer on every rank -------------------------------------------------------
_PROBE = """
import hashlib
from megatron_fcp.planning import AttentionShape
from megatron_fcp.planner.choose import choose_schedule
from megatron_fcp.schedule.program import WaveBackward
c = choose_schedule("dgx-h100:1", range(8), AttentionShape(2 * 8 * 2731, 32, 8, 128, 2), backward=WaveBackward())
print(c.describe(), hashlib.sha256(repr((c.plan.head_groups, c.plan.kv_plan.rounds, c.plan.auto)).encode()).hexdigest())
"""


@pytest.mark.slow  # starts Python processes
def test_the_choice_is_deterministic_across_processes():
    """Every rank computes the choice on its own; it reads no rank, clock or hash order: two
    interpreters with different hash seeds and this one give the same choice, plan and times."""
    from megatron_fcp.planner.choose import choose_schedule as exported
    import hashlib

    c = exported("dgx-h100:1", range(8), AttentionShape(2 * 8 * ODD_CHUNK, 32, 8, 128, 2), backward=WaveBackward())
    here = c.describe() + " " + hashlib.sha256(repr((c.plan.head_groups, c.plan.kv_plan.rounds,
                                                         c.plan.auto)).encode()).hexdigest()
    env = dict(os.environ, PYTHONPATH=ROOT)
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", _PROBE], env=dict(env, PYTHONHASHSEED=seed), cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == here


def test_build_plan_of_the_chosen_graph_is_the_plan_the_planner_timed():
    """a = 1: the runtime builds build_plan(graph, parts) on each CP group's ranks; the planner
    timed compile_head_parallel's relabelled copy of the same plan."""
    seq = 2 * 8 * ODD_CHUNK
    want = choose_schedule("dgx-h100:1", range(8), AttentionShape(seq, 32, 8, 128, 2), backward=WaveBackward())
    mine = build_plan("dgx-h100:1", range(8), want.graph, parts_per_chunk=want.parts)
    assert _same_plan(mine, stage_plan(want.plan, seq))
