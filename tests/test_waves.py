"""Backward waves (Note [Backward waves] in megatron_fcp/attention/backward_waves.py): the pure
split of a plan's blocks (planning/waves.py) and its cost model (packed_cost.simulate_backward_waves)."""

from __future__ import annotations

import pytest

from megatron_fcp.planning import build_plan, place_packed
from megatron_fcp.planning.waves import plan_waves, restrict, wave_budget

BUILDERS = ("ring", "full", "hierarchical", "leader", "spanning", "entry")


@pytest.mark.parametrize("cp", (4, 8))
@pytest.mark.parametrize("builder", BUILDERS)
def test_waves_cover_every_block_once_within_the_budget(cp, builder):
    plan = build_plan("dgx-h100:1", range(cp), builder, parts_per_chunk=2)
    size = lambda b: 100  # noqa: E731
    budget = wave_budget(plan, size)
    assert budget == 2 * 100  # half a shard of 2 chunks x 2 parts
    waves = plan_waves(plan, size)
    blocks = [b for w in waves for b in w.blocks]
    assert sorted(blocks) == sorted(plan.blocks())          # every block, once
    for w in waves:
        sub = restrict(plan, w)
        assert len(sub.rounds) == len(w.rounds) and all(sub.rounds)
        load: dict[int, int] = {}
        for rnd in sub.rounds:
            for t in rnd:
                assert t.block in w
                load[t.dst] = load.get(t.dst, 0) + size(t.block)
        assert max(load.values(), default=0) <= budget      # two waves fit the ring's one shard
    # the cut rounds are the plan's rounds, nothing lost
    assert sum(len(r) for w in waves for r in restrict(plan, w).rounds) == plan.num_transfers()
    assert plan_waves(plan, size, cache_key="k") == plan_waves(plan, size, cache_key="k") == waves


def test_a_block_larger_than_the_budget_forms_its_own_wave():
    pl = place_packed([5, 40, 3, 17, 1, 30], 4, block_tokens=8)
    plan = build_plan("dgx-h100:1", range(4), "full", placement=pl)
    waves = plan_waves(plan, lambda b: 1000, budget=10)
    sent = {t.block for _, t in plan.transfers()}
    assert all(len([b for b in w.blocks if b in sent]) == 1 for w in waves)  # unsent blocks cost nobody
    assert len(waves) == len(sent)


def test_wave_cost_model_bounds_held_kv_by_the_ring():
    """cp = 16 on two DGX H100, 128K tokens, GQA 32:8: resend holds at most the ring's one shard
    (32 MiB) within backward; keep holds its need set (480 MiB on CP rank 0)."""
    from megatron_fcp.planning.cost import AttentionShape, simulate_plan
    from megatron_fcp.planning.packed_cost import simulate_backward_waves, simulate_plan_backward

    shape = AttentionShape(131072, 32, 8, 128)
    plan = build_plan("dgx-h100:2", range(16), "hierarchical")
    shard = shape.kv_bytes(131072 / 16)
    resend = simulate_backward_waves(plan, "dgx-h100:2", shape, backward_kv="resend")
    keep = simulate_backward_waves(plan, "dgx-h100:2", shape, backward_kv="keep")
    assert resend["held_kv_bytes_max"] <= shard and keep["held_kv_bytes_max"] == 15 * shard
    assert resend["waves"] == keep["waves"] > 16 and resend["resend_s"] > 0 and keep["resend_s"] == 0
    assert keep["bwd_s"] <= resend["bwd_s"] <= keep["bwd_s"] + resend["resend_s"]
    # one wave = the whole plan: the one-pass backward
    one = simulate_backward_waves(plan, "dgx-h100:2", shape, backward_kv="keep", budget=10 ** 12)
    assert one["waves"] == 1
    assert one["bwd_s"] == pytest.approx(simulate_plan_backward(plan, "dgx-h100:2", shape).total_s)
    assert simulate_plan(plan, "dgx-h100:2", shape).total_s > 0
