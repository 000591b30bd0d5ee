"""The runtime's schedule search prunes by floors and still finds the full search's answer
(Note [Pruning the search]; Note [Backward floors])."""

from __future__ import annotations

import pytest

from megatron_fcp.planning import AttentionShape
from megatron_fcp.planning.cost import pick_best
from megatron_fcp.planning.head_parallel_choose import choose_schedule, head_parallel_candidates
from megatron_fcp.planning.head_parallel_compile import compile_head_parallel, head_parallel_degrees
from megatron_fcp.planning.head_parallel_cost import HeadParallelPricing, degree_floor, simulate_head_parallel
from megatron_fcp.planning.waves import WaveBackward
from megatron_fcp.topology import load_topology

# (preset, CP ranks, heads, KV heads, sequence): every preset, even and uneven groups, MHA and GQA,
# compute-bound and communication-bound lengths
CELLS = [("dgx-h100:2", 16, 32, 8, 32768), ("dgx-a100:2", 12, 32, 32, 131072), ("pcie-box:2", 16, 32, 2, 32768),
         ("single-uplink:2", 16, 32, 8, 131072), ("dgx-h100:1", 8, 32, 8, 1048576)]


@pytest.mark.parametrize("preset,cp,heads,kv,seq", CELLS)
@pytest.mark.parametrize("backward", [None, WaveBackward()], ids=["one-pass", "executor"])
def test_floors_never_exceed_the_priced_total(preset, cp, heads, kv, seq, backward):
    """Every candidate's floor, and its degree's floor, is at most its predicted total."""
    topo = load_topology(preset)
    shape = AttentionShape(seq, heads, kv, 128, 2)
    for a in head_parallel_degrees(topo, range(cp), heads, kv):
        lo = degree_floor(topo, range(cp), shape, a, backward=backward)
        for graph in ("ring", "hierarchical", "full"):
            for opts in ({}, {"parts_per_chunk": 2} if a == 1 else {"stagger": 2}):
                if a == cp and opts:
                    continue
                hp = compile_head_parallel(topo, range(cp), shape, a, graph, **opts)
                pr = HeadParallelPricing(hp, topo, shape, backward=backward)
                total = pr.result().total_s
                assert pr.floor() <= total and lo <= total, (a, graph, opts)


def test_pricing_in_two_steps_is_simulate_head_parallel():
    shape = AttentionShape(65536, 32, 8, 128, 2)
    for preset, cp, a, graph in (("dgx-h100:2", 16, 1, "hierarchical"), ("dgx-h100:2", 16, 4, "ring"),
                                 ("dgx-h100:2", 16, 8, "full"), ("dgx-h100:1", 8, 8, "ring")):
        topo = load_topology(preset)
        hp = compile_head_parallel(topo, range(cp), shape, a, graph)
        for bw in (None, WaveBackward()):
            one = simulate_head_parallel(hp, topo, shape, backward=bw)
            two = HeadParallelPricing(hp, topo, shape, backward=bw).result()
            assert (one.total_s, one.comm_s, one.bytes, one.meta) == (two.total_s, two.comm_s, two.bytes, two.meta)


@pytest.mark.parametrize("preset,cp,heads,kv,seq", CELLS)
def test_the_pruned_search_finds_the_full_search_answer(preset, cp, heads, kv, seq):
    """The same choice and runner-up as pricing every candidate; the candidates priced are a
    subset of the full list, with the same predictions."""
    shape = AttentionShape(seq, heads, kv, 128, 2)
    full = head_parallel_candidates(preset, range(cp), shape, backward=WaveBackward())
    best, _ = pick_best(full, "total")
    runner_up, _ = pick_best([c for c in full if c[0] is not best], "total")
    choice = choose_schedule(preset, range(cp), shape, backward=WaveBackward())
    assert choice.label == best.meta["label"] and choice.total_s == best.total_s
    assert choice.runner_up == (runner_up.meta["label"], runner_up.total_s)
    everything = {r.meta["label"]: r.total_s for r, _ in full}
    assert set(dict(choice.plan.auto)) <= set(everything)
    assert all(everything[k] == t for k, t in choice.plan.auto)
    assert [k for k, _ in choice.plan.auto] == [k for k in everything if k in dict(choice.plan.auto)]
