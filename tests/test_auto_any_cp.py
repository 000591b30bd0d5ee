"""Regression: graph "auto" (the default everywhere) works for every CP size, not only those whose
2*cp divides 131,072, through build_plan, setup_fcp and both CLI commands."""

from __future__ import annotations

import math
import re

import pytest

from megatron_fcp.cli import main
from megatron_fcp.config import FCPConfig
from megatron_fcp.patches.runtime import reset_fcp, setup_fcp
from megatron_fcp.cost.model import zigzag_padded_len
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.builders import AUTO_CANDIDATES
from megatron_fcp.planner.megatron_layout import MegatronLayout
from megatron_fcp.topology import PRESETS, load_topology

CPS = (3, 5, 6, 12, 24)  # 2*cp does not divide 131072 for any of them

def _preset(name: str, cp: int) -> str:
    return f"{name}:{max(1, math.ceil(cp / load_topology(name).gpus_per_node))}"

@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("cp", CPS)
def test_auto_builds_a_verified_plan_for_any_cp(preset, cp):
    assert 131072 % (2 * cp)
    plan = build_plan(_preset(preset, cp), range(cp))
    assert plan.verified and plan.cp == cp and plan.name in AUTO_CANDIDATES
    assert plan.name == min(dict(plan.auto.times), key=dict(plan.auto.times).get)
    # with a real shape whose length 2*cp does not divide either (Megatron would pad it)
    shaped = build_plan(_preset(preset, cp), range(cp), seq_len=100_001, heads=32, kv_heads=8, head_dim=128)
    assert shaped.verified and shaped.auto.metric == "total_s"

# cp = 24's runtime choice is a sweep of 10 s or more (docs/megatron.md, "Test tiers")
@pytest.mark.parametrize("cp", [pytest.param(cp, marks=pytest.mark.slow) if cp == 24 else cp for cp in CPS])
def test_setup_fcp_with_the_default_config_settles_any_cp(cp):
    layout = MegatronLayout(world=2 * cp, tp=2, cp=cp)
    try:
        runtime = setup_fcp(FCPConfig(enabled=True, topology=_preset("dgx-a100", 2 * cp)), layout=layout,
                            groups={}, seq_len=2 * cp * 64, heads=8, kv_heads=2, head_dim=64)
        assert runtime.config.graph == "auto"
        assert {key[0] for key in runtime.plans} == set(layout.cp_groups())
        assert all(plan.verified for plan in runtime.plans.values())
    finally:
        reset_fcp()

@pytest.mark.parametrize("cp", CPS)
def test_cli_plan_and_simulate_with_auto_for_any_cp(capsys, cp):
    topo = _preset("dgx-a100", cp)
    assert main(["plan", "--topology", topo, "--cp", str(cp)]) == 0
    out = capsys.readouterr().out
    assert f"cp={cp}" in out and "verified" in out and "auto: predicted comm_s" in out
    assert main(["simulate", "--topology", topo, "--cp", str(cp), "--seq", "128k"]) == 0
    out = capsys.readouterr().out
    padded = zigzag_padded_len(131072, cp)
    assert f"padded to {padded} tokens, as Megatron pads" in out
    assert re.search(r"^fcp\s+\d", out, re.M)


def test_named_graphs_are_built_once_per_topology_and_group():
    """A graph named by its builder is shared by every plan over the same topology object and CP
    group (it reads nothing else); another topology object, group or a builder instance builds anew;
    plans from the shared graph equal plans from a fresh one."""
    from megatron_fcp.contract.placement import place_packed
    from megatron_fcp.planner import build as B
    from megatron_fcp.planner.builders import get_builder
    from megatron_fcp.planner.compile import compile_plan
    from megatron_fcp.topology import load_topology

    topo, other = load_topology("dgx-h100:2"), load_topology("dgx-h100:2")
    ranks = tuple(range(16))
    cg = B._graph(topo, ranks, "entry")
    assert B._graph(topo, ranks, "entry") is cg
    assert B._graph(other, ranks, "entry") is not cg
    assert B._graph(topo, tuple(range(8)), "entry") is not cg
    assert B._graph(topo, ranks, get_builder("entry")) is not cg
    for lengths in ([900, 40, 3000, 77, 512], [5] * 40):
        pl = place_packed(lengths, 16, block_tokens=64)
        plan = B.build_plan(topo, ranks, "auto", placement=pl)
        fresh = compile_plan(get_builder(plan.name).build(topo, ranks), True, 1, placement=pl)
        assert plan.rounds == fresh.rounds
