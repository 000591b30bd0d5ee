"""Graph builders: vertices are exactly the CP group, structure per strategy, Megatron CP groups."""

from __future__ import annotations

import math
import random

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.builders import BUILDERS, BalancedGraph, build_graph, get_builder
from megatron_fcp.planner.graph import CommGraph, runs_of, steiner_tree
from megatron_fcp.contract.plan import check_cp_ranks
from megatron_fcp.planner.megatron_layout import MegatronLayout
from megatron_fcp.topology import PRESETS, TopologyError, load_topology

CPS = (2, 3, 4, 8, 16, 64)


def topo_for(preset: str, cp: int):
    per_node = load_topology(f"{preset}:1").gpus_per_node  # 8 on HGX, 4 on an NVL72 tray
    return load_topology(f"{preset}:{max(2, math.ceil(cp / per_node))}")


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_builder_on_every_preset_is_a_connected_graph_over_the_group(preset, name):
    for cp in CPS:
        topo = topo_for(preset, cp)
        # a strided group (like TP=2) when it fits, else contiguous
        ranks = list(range(0, 2 * cp, 2)) if 2 * cp <= topo.world else list(range(cp))
        cg = build_graph(topo, ranks, name)
        assert set(cg.graph.nodes) == set(ranks), (preset, name, cp)
        assert nx.is_strongly_connected(cg.graph)
        for u, v, data in cg.graph.edges(data=True):
            assert u != v and data["bandwidth"] > 0 and data["cost"] > 0 and data["kind"]


def test_hierarchical_is_rail_striped_on_dgx():
    topo = load_topology("dgx-h100:4")
    cg = build_graph(topo, range(32), "hierarchical")
    for u, v, kind in cg.graph.edges(data="kind"):
        if topo.node_of(u) != topo.node_of(v):
            assert topo.local_rank_of(u) == topo.local_rank_of(v), (u, v)  # same rail
            assert kind == "ib"
        else:
            assert kind == "nvswitch"
    # a block needed everywhere crosses to each other node exactly once, on its owner's rail
    tree = cg.tree(3, [r for r in range(32) if r != 3])
    crossings = [(u, v) for u, v in tree if topo.node_of(u) != topo.node_of(v)]
    assert sorted(crossings) == [(3, 11), (3, 19), (3, 27)]
    assert len(tree) == 31 and {v for _, v in tree} == set(range(32)) - {3}


def test_leader_funnels_through_one_rank_per_node():
    topo = load_topology("single-uplink:3")
    cg = build_graph(topo, range(24), "leader")
    cross = {(u, v) for u, v in cg.graph.edges if topo.node_of(u) != topo.node_of(v)}
    assert cross == {(a, b) for a in (0, 8, 16) for b in (0, 8, 16) if a != b}


def test_spanning_is_a_tree_that_keeps_pcie_pairs_together():
    topo = load_topology("pcie-box:2")
    cg = build_graph(topo, range(16), "spanning")
    und = cg.graph.to_undirected()
    assert nx.is_tree(und)
    for pair in range(8):  # GPUs 2i, 2i+1 share a PCIe switch
        a = 2 * pair
        assert und.has_edge(a, a + 1)
    cross = [(u, v) for u, v in und.edges if topo.node_of(u) != topo.node_of(v)]
    assert len(cross) == 1


def test_ring_follows_cp_order_not_rank_order():
    topo = load_topology("dgx-h100:2")
    ranks = [5, 1, 12, 3]
    cg = build_graph(topo, ranks, "ring")
    assert sorted(cg.graph.edges) == sorted([(5, 1), (1, 12), (12, 3), (3, 5)])


def _rail_loads(plan, topo, sizes):
    """Bytes (in KV-size units) each NIC egress carries under a plan."""
    loads = {}
    for _, t in plan.transfers():
        if topo.node_of(t.src) != topo.node_of(t.dst):
            loads[t.src] = loads.get(t.src, 0.0) + sizes.get(t.block.owner, 1.0)
    return loads


def test_balanced_spreads_uneven_kv_over_rails():
    topo = load_topology("dgx-h100:2")
    sizes = {r: (8.0 if r in (0, 8) else 1.0) for r in range(16)}  # two long sequences
    hier = build_plan(topo, range(16), "hierarchical", causal=False)
    bal = build_plan(topo, range(16), BalancedGraph(sizes), causal=False)
    assert bal.name == "balanced" and bal.kv_sizes == tuple(sizes[r] for r in range(16))
    assert max(_rail_loads(bal, topo, sizes).values()) < max(_rail_loads(hier, topo, sizes).values())
    # equal sizes: identical to hierarchical
    same = build_plan(topo, range(16), BalancedGraph(), causal=False)
    assert {t for _, t in same.transfers()} == {t for _, t in hier.transfers()}


def test_builders_and_errors():
    topo = load_topology("dgx-h100:2")
    with pytest.raises(ValueError, match="unknown builder"):
        get_builder("torus")
    with pytest.raises(TopologyError, match="cp_ranks: rank 16 is missing"):
        build_graph(topo, [0, 16], "ring")
    with pytest.raises(ValueError, match="cp_ranks: rank 3 appears twice"):
        check_cp_ranks(topo, [3, 1, 3])
    with pytest.raises(ValueError, match="cp_ranks: the CP group is empty"):
        check_cp_ranks(topo, [])
    with pytest.raises(ValueError, match="kv_sizes"):
        BalancedGraph({0: -1.0})
    g = nx.DiGraph()
    g.add_edges_from([(0, 1), (1, 0), (2, 3), (3, 2)])
    with pytest.raises(ValueError, match="disconnected"):
        CommGraph("islands", (0, 1, 2, 3), g).check_connected()


def test_connectivity_errors_name_both_directions():
    g = nx.DiGraph([(0, 1), (0, 2), (1, 2), (2, 1)])  # 0 reaches everyone, nobody reaches 0
    with pytest.raises(ValueError, match="rank 1 cannot reach rank 0"):
        CommGraph("one-way", (0, 1, 2), g).check_connected()
    with pytest.raises(ValueError, match="rank 0 cannot reach rank 3"):
        CommGraph("lost", (0, 1, 2, 3), None, edges=[(0, 1), (1, 0), (1, 2), (2, 1), (3, 0)]).check_connected()
    with pytest.raises(ValueError, match="extra \\[7\\]"):
        CommGraph("outside", (0, 1), None, edges=[(0, 1), (1, 0), (1, 7)]).check_connected()
    with pytest.raises(ValueError, match="exactly one of"):
        CommGraph("neither", (0, 1))


def test_edge_list_graph_is_built_lazily_without_loops_or_repeats():
    topo = load_topology("dgx-h100:1")
    cg = CommGraph("list", (0, 1, 2), None, topo, edges=[(0, 1), (1, 1), (0, 1), (1, 2), (2, 0)])
    assert cg.edges == [(0, 1), (1, 2), (2, 0)] and cg._graph is None
    cg.check_connected()
    assert cg._graph is None  # connectivity is checked on the edge list
    assert list(cg.graph.edges) == cg.edges and set(cg.graph.nodes) == {0, 1, 2}
    assert cg.graph[0][1]["kind"] == topo.route(0, 1).kind


@settings(max_examples=40, deadline=None)
@given(nodes=st.integers(1, 5), per_node=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_rail_tree_runs_match_tree_with_depths(nodes, per_node, seed):
    """The vectorised runs of hierarchical/balanced trees equal the specification's runs."""
    rng = random.Random(seed)
    topo = load_topology(f"dgx-h100:{nodes}")
    ranks = rng.sample(range(topo.world), max(2, min(topo.world, nodes * per_node)))
    sizes = {r: rng.choice((1.0, 1.0, 3.0)) for r in ranks}
    for builder in (get_builder("hierarchical"), BalancedGraph(sizes)):
        cg = builder.build(topo, ranks)
        for owner in ranks:
            others = [r for r in ranks if r != owner]
            for dests in (others, others[: rng.randint(1, len(others))], rng.sample(others, rng.randint(1, len(others)))):
                for chunk in (0, 1):
                    want = [(d, list(us), list(vs)) for d, us, vs in runs_of(*cg.tree_with_depths(owner, dests, chunk))]
                    got = [(d, list(us), list(vs)) for d, us, vs in cg.tree_runs(owner, dests, chunk)]
                    assert got == want, (builder, owner, dests, chunk)


def test_steiner_tree_uses_graph_edges_and_reaches_every_dest():
    g = nx.gnp_random_graph(30, 0.15, seed=3, directed=True)
    g.add_edges_from((i, (i + 1) % 30) for i in range(30))  # strongly connected
    for u, v in g.edges:
        g[u][v]["cost"] = 1.0 + (u * 7 + v * 3) % 5
    dests = [2, 9, 17, 25, 29]
    tree = steiner_tree(g, 0, dests)
    reached = {0}
    for u, v in tree:
        assert g.has_edge(u, v) and u in reached and v not in reached
        reached.add(v)
    assert set(dests) <= reached


@pytest.mark.parametrize("world,tp,pp,cp", [(16, 2, 1, 8), (32, 2, 2, 4), (24, 3, 2, 2), (8, 1, 1, 8), (64, 4, 2, 2)])
def test_megatron_layout_matches_rank_generator(world, tp, pp, cp):
    """The one rank-layout source (MegatronLayout) against megatron-core's own RankGenerator."""
    ps = pytest.importorskip("megatron.core.parallel_state")
    dp = world // (tp * pp * cp)
    gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    layout = MegatronLayout(world, tp, pp, cp)
    assert [list(g) for g in layout.cp_groups()] == gen.get_ranks("cp")
    assert sorted(map(list, layout.tp_groups())) == sorted(gen.get_ranks("tp"))


def test_megatron_layout_by_hand_and_errors():
    assert MegatronLayout(16, tp=2, pp=1, cp=8).cp_groups() == [tuple(range(0, 16, 2)), tuple(range(1, 16, 2))]
    with pytest.raises(ValueError, match="world size 16 is not divisible"):
        MegatronLayout(16, tp=3, cp=2)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size must be a positive integer"):
        MegatronLayout(16, tp=0)


@pytest.mark.parametrize("name", [*sorted(BUILDERS), "auto"])
def test_tp_safety_world16_tp2_cp8_two_nodes(name):
    """Megatron layout tp=2, cp=8 on two 8-GPU nodes: CP peers are strided by TP; no transfer may
    touch a rank of the other CP group (the TP partner)."""
    topo = load_topology("dgx-h100:2")
    groups = MegatronLayout(16, tp=2, pp=1, cp=8).cp_groups()
    for group in groups:
        plan = build_plan(topo, group, name)
        endpoints = {t.src for _, t in plan.transfers()} | {t.dst for _, t in plan.transfers()}
        assert endpoints <= set(group), (name, sorted(endpoints - set(group)))
        assert {t.block.owner for _, t in plan.transfers()} <= set(group)
        if name != "auto":
            assert set(build_graph(topo, group, name).graph.nodes) == set(group)
