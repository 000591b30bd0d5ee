"""Columnar plans (Note [Columnar plans]): the table compiler writes exactly the object compiler's
rounds, and the table verifier rejects exactly what ``verify_plan`` rejects, with its messages."""

from __future__ import annotations

import dataclasses
import pickle
import random
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fcp.contract.blocks import PlanError
from megatron_fcp.contract.placement import place_packed
from megatron_fcp.contract.plan import Plan, full_plan, ring_plan
from megatron_fcp.cost.model import AttentionShape, simulate_plan
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.builders import BalancedGraph, build_graph
from megatron_fcp.planner.compile import compile_plan
from megatron_fcp.contract import table_verify
from megatron_fcp.planner.builders import EntryGraph, _node_groups, entry_position
from megatron_fcp.planner.compile import _sources, _waves
from megatron_fcp.planner.graph import CommGraph
from megatron_fcp.contract.table import TransferTable, block_layout, table_from_rounds, table_rounds
from megatron_fcp.contract.verify import verify_plan
from megatron_fcp.topology import load_topology


def _table_of(plan: Plan) -> TransferTable:
    return table_from_rounds(plan.rounds, plan.ranks, plan.chunks_per_rank(), plan.parts_per_chunk)


def _columnar(plan: Plan, table: TransferTable | None = None) -> Plan:
    """``plan`` stored as a table (unverified)."""
    return dataclasses.replace(plan, rounds=None, table=_table_of(plan) if table is None else table)


# ---- the table compiler writes the object compiler's rounds ---------------------------------------


def _group(kind: str, world: int, cp: int) -> list[int]:
    if kind == "range":
        return list(range(cp))
    if kind == "stride2":
        return list(range(0, 2 * cp, 2))
    ranks = list(range(world))
    random.Random(cp).shuffle(ranks)  # any CP order, nodes partly filled
    return ranks[:cp]


@pytest.mark.parametrize("case", [
    ("dgx-h100:40", "range", 300, "hierarchical", True, 1),      # 37 full nodes + one of 4
    ("dgx-h100:40", "range", 264, "hierarchical", False, 2),
    ("dgx-h100:80", "stride2", 300, "hierarchical", True, 3),    # 4 CP ranks per node
    ("dgx-h100:40", "shuffled", 272, "hierarchical", True, 2),   # CP order != rail order, uneven nodes
    ("dgx-h100:40", "shuffled", 260, "balanced", False, 1),      # equal KV sizes: hierarchical's trees
    ("dgx-h100:40", "range", 270, "ring", True, 1),
    ("dgx-h100:40", "shuffled", 260, "ring", False, 2),
    ("dgx-h100:40", "range", 264, "full", True, 2),
    ("dgx-h100:64", "range", 512, "hierarchical", True, 2),
], ids=repr)
def test_large_groups_compile_to_a_table_with_the_object_plans_rounds(case):
    preset, kind, cp, graph, causal, parts = case
    topo = load_topology(preset)
    ranks = _group(kind, topo.world, cp)
    columnar = compile_plan(build_graph(topo, ranks, graph), causal, parts)
    objects = compile_plan(build_graph(topo, ranks, graph), causal, parts, columnar=False)
    assert objects.table is None
    if columnar.table is not None:
        assert columnar.__dict__["_rounds"] is None  # compiled and verified without objects
        assert columnar.num_transfers() == objects.num_transfers()
        assert columnar.num_rounds == len(objects.rounds)
    else:  # at most BALANCE_MAX_TRANSFERS: the table's rounds were reordered fast links first
        assert objects.num_transfers() <= 200_000
    assert columnar.rounds == objects.rounds
    assert columnar.verified and columnar == objects


def _object_waves(cg: CommGraph, causal: bool, parts: int):
    runs = [(o, c, cg.tree_runs(o, d, c)) for o, c, d in _sources(cg.ranks, causal, None)]
    return _waves(runs, parts, cg.pipeline_parts)


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(1, 5), data=st.data(), graph=st.sampled_from(["hierarchical", "ring", "full"]),
       causal=st.booleans(), parts=st.integers(1, 3))
def test_small_groups_table_waves_equal_object_waves(nodes, data, graph, causal, parts):
    """Below the size where the compiler uses tables, the table writer still gives the object
    compiler's waves (uneven nodes, any CP order, single nodes, cp = 1)."""
    topo = load_topology(f"dgx-h100:{nodes}")
    ranks = data.draw(st.permutations(range(topo.world)))[:data.draw(st.integers(1, topo.world))]
    cg = build_graph(topo, ranks, graph)
    table = cg.builder.wave_table(cg, causal, parts)
    assert table is not None
    assert table_rounds(table, cg.ranks, np.full(len(ranks), 2), parts) == _object_waves(cg, causal, parts)


@pytest.mark.parametrize("cp", [16, 64, 128, 256])
@pytest.mark.parametrize("graph,causal,parts", [("hierarchical", True, 1), ("hierarchical", False, 2),
                                                ("ring", True, 2), ("full", False, 1)])
def test_table_waves_equal_object_waves_up_to_256_ranks(cp, graph, causal, parts):
    cg = build_graph(load_topology(f"dgx-h100:{max(cp // 8, 1)}"), range(cp), graph)
    table = cg.builder.wave_table(cg, causal, parts)
    assert table_rounds(table, cg.ranks, np.full(cp, 2), parts) == _object_waves(cg, causal, parts)


def test_builders_without_table_trees_give_none():
    topo = load_topology("dgx-h100:2")
    ranks = list(range(16))
    uneven = BalancedGraph({r: 1.0 + (r % 3) for r in ranks}).build(topo, ranks)
    assert uneven.builder.wave_table(uneven, True, 1) is None  # chunks leave on other rails
    even = BalancedGraph().build(topo, ranks)
    assert even.builder.wave_table(even, True, 1) is not None
    entry = EntryGraph().build(topo, ranks)
    assert entry.builder.wave_table(entry, True, 1) is None
    for name in ("leader", "spanning"):
        cg = build_graph(topo, ranks, name)
        assert cg.builder.wave_table(cg, True, 1) is None


def test_port_limits_and_small_plans_keep_objects():
    topo = load_topology("dgx-h100:40")
    cg = build_graph(topo, range(300), "hierarchical")
    assert compile_plan(cg, True, 1, max_sends=64).table is None
    assert build_plan("dgx-h100:16", range(128), "hierarchical").table is None


# ---- the rail graph's edges as an array --------------------------------------------------------


def _reference_edges(topo, ranks):
    """The rail-striped edge list as HierarchicalGraph built it in Python (the specification)."""
    groups = _node_groups(topo, ranks)
    edges = [(a, b) for members in groups.values() for a in members for b in members if a != b]
    pos = {r: k for members in groups.values() for k, r in enumerate(members)}
    node_of = {r: topo.node_of(r) for r in ranks}
    for a in ranks:
        home_size = len(groups[node_of[a]])
        for node, members in groups.items():
            if node != node_of[a]:
                for chunk in (0, 1):
                    edges.append((a, members[entry_position(pos[a], home_size, len(members), chunk)]))
    return list(dict.fromkeys(edges))


@settings(max_examples=40, deadline=None)
@given(nodes=st.integers(1, 5), data=st.data())
def test_rail_edges_as_array_equal_the_python_list(nodes, data):
    topo = load_topology(f"dgx-h100:{nodes}")
    ranks = data.draw(st.permutations(range(topo.world)))[:data.draw(st.integers(1, topo.world))]
    for builder in ("hierarchical", BalancedGraph()):
        cg = build_graph(topo, ranks, builder)
        assert cg.edges == _reference_edges(topo, ranks)
        assert cg.num_edges() == len(cg.edges)
    assert build_graph(topo, ranks, "full").edges == [(a, b) for a in ranks for b in ranks if a != b]


def test_edge_arrays_drop_loops_and_name_outside_vertices():
    cg = CommGraph("g", (0, 1, 2), edges=np.array([[0, 1], [1, 1], [1, 2], [2, 0]]))
    assert cg.edges == [(0, 1), (1, 2), (2, 0)] and cg._graph is None
    assert list(cg.graph.edges) == cg.edges and cg.check_connected() is cg
    with pytest.raises(ValueError, match=r"extra \[7\]"):
        CommGraph("g", (0, 1, 2), edges=np.array([[0, 1], [1, 2], [2, 7]])).check_connected()
    with pytest.raises(ValueError, match="rank 0 cannot reach rank 2"):
        CommGraph("g", (0, 1, 2), edges=np.array([[0, 1], [1, 0], [2, 0]])).check_connected()


# ---- a table is another spelling of the same plan ------------------------------------------------


def test_table_round_trip_and_lazy_rounds():
    topo = load_topology("dgx-h100:40")
    plan = build_plan(topo, range(300), "hierarchical", parts_per_chunk=2)  # a table-backed plan
    assert plan.table is not None and plan.verified and plan.__dict__["_rounds"] is None
    assert plan.num_rounds == 3 and plan.num_transfers() == plan.table.num_transfers
    rounds = plan.rounds
    assert plan.rounds is rounds  # materialised once, then cached
    again = _table_of(plan)
    for col in ("round_starts", "src", "dst", "block"):
        assert np.array_equal(getattr(again, col), getattr(plan.table, col))
    objects = dataclasses.replace(plan, rounds=rounds)  # explicit rounds win: no table
    assert objects.table is None and objects == plan
    for a, b in zip(plan.transfer_columns(), objects.transfer_columns()):
        assert np.array_equal(a, b)
    shape = AttentionShape(300 * 2 * 512, heads=8, kv_heads=8)
    assert simulate_plan(plan, topo, shape) == simulate_plan(objects, topo, shape)
    auto = plan.with_auto(None)
    assert auto.table is plan.table and auto.verified and auto.__dict__["_rounds"] is rounds
    assert pickle.loads(pickle.dumps(plan)) == plan
    with pytest.raises(PlanError, match="needs rounds"):
        Plan((0, 1), None)


def test_a_table_holds_only_what_a_plan_can_name():
    plan = build_plan("dgx-h100:1", range(4), "full")
    with pytest.raises(PlanError, match="rank 9 is outside the CP group"):
        table_from_rounds(((*plan.rounds[0], dataclasses.replace(plan.rounds[0][0], dst=9)),),
                          plan.ranks, plan.chunks_per_rank(), 1)
    t = plan.table if plan.table is not None else _table_of(plan)
    with pytest.raises(PlanError, match="differ in length"):
        TransferTable(t.round_starts, t.src, t.dst[:-1], t.block)
    with pytest.raises(PlanError, match="round_starts must rise"):
        TransferTable(t.round_starts[::-1].copy(), t.src, t.dst, t.block)


# ---- the table verifier agrees with verify_plan ----------------------------------------------------


def _rows(table: TransferTable) -> list[list[int]]:
    rnd = table.round_of_rows()
    return [[int(k), int(s), int(d), int(b)] for k, s, d, b in zip(rnd, table.src, table.dst, table.block)]


def _from_rows(rows: list[list[int]], n_rounds: int) -> TransferTable:
    rows = sorted(rows, key=lambda r: r[0])  # stable: plan order inside a round kept
    counts = np.bincount([r[0] for r in rows], minlength=n_rounds).astype(np.int64)
    cols = np.array([r[1:] for r in rows], dtype=np.int64).reshape(-1, 3).T
    return TransferTable(np.concatenate(([0], np.cumsum(counts))), cols[0].copy(), cols[1].copy(), cols[2].copy())


def _mutate(table: TransferTable, plan: Plan, rng: random.Random) -> TransferTable:
    """One of: drop a row, duplicate one (same or later round), move one a round earlier, send one
    elsewhere, to its own sender, or back to the block's owner."""
    cp, owner_of = plan.cp, block_layout(plan.chunks_per_rank(), plan.parts_per_chunk)[1]
    rows, R = _rows(table), table.num_rounds
    i = rng.randrange(len(rows))
    k, s, d, b = rows[i]
    kind = rng.choice(["drop", "dup", "earlier", "elsewhere", "self", "owner"])
    if kind == "drop":
        rows.pop(i)
    elif kind == "dup":
        rows.insert(rng.randrange(len(rows) + 1), [rng.randrange(k, R), s, d, b])
    elif kind == "earlier":
        later = [j for j, r in enumerate(rows) if r[0] > 0]
        if later:
            rows[rng.choice(later)][0] -= 1
        else:
            rows.pop(i)
    elif kind == "elsewhere":
        rows[i][2] = rng.choice([x for x in range(cp) if x != d] or [d])
    elif kind == "self":
        rows[i][2] = s
    else:
        rows[i][2] = int(owner_of[b])
    return _from_rows(rows, R)


def _outcome(fn):
    try:
        fn()
        return None
    except PlanError as e:
        return str(e)


def _both(plan: Plan, table: TransferTable, **limits) -> tuple:
    objects = dataclasses.replace(plan, rounds=table_rounds(table, plan.ranks, plan.chunks_per_rank(),
                                                             plan.parts_per_chunk), table=None)
    fast = _outcome(lambda: table_verify.verify_table(_columnar(plan, table), limits.get("max_sends"),
                                                      limits.get("max_recvs")))
    return fast, _outcome(lambda: verify_plan(objects, limits.get("max_sends"), limits.get("max_recvs")))


PLANS = {
    "hierarchical": lambda: build_plan("dgx-h100:2", range(16), "hierarchical", causal=True),
    "hierarchical-parts": lambda: build_plan("dgx-h100:3", [5, 17, 2, 9, 20, 11, 0, 23], "hierarchical",
                                             causal=False, parts_per_chunk=2),
    "ring": lambda: ring_plan([3, 7, 1, 12, 5], causal=True, parts_per_chunk=2),
    "full": lambda: full_plan(range(6), causal=True),
    "packed": lambda: build_plan("dgx-h100:2", [0, 1, 2, 8, 9], "entry",  # blocks per rank differ
                                 placement=place_packed([3000, 500, 9000, 1200, 700, 4000], 5, causal=True,
                                                        block_tokens=1024)),
}


def test_named_mutations_get_verify_plans_messages():
    plan = PLANS["hierarchical"]()
    table = _table_of(plan)
    rows = _rows(table)
    relay_fwd = next(i for i, r in enumerate(rows) if r[0] == 1)
    cases = {
        "duplicate delivery": (rows + [rows[0]], "more than once"),
        "duplicate in one round": (rows[:1] + rows, "more than once"),
        "missing delivery": (rows[:relay_fwd] + rows[relay_fwd + 1:], "never receives"),
        "relay sends before it received": ([[0, *r[1:]] if i == relay_fwd else r for i, r in enumerate(rows)],
                                           "forwards .* before it has arrived"),
        "sent back to its owner": (rows + [[1, 1, 0, 0]], "sent back to its owner"),
        "self-send": (rows + [[0, 3, 3, 6]], "sends to itself"),
    }
    for name, (mutated, message) in cases.items():
        fast, ref = _both(plan, _from_rows(mutated, table.num_rounds))
        assert ref is not None and fast == ref, name
        assert re.search(message, fast), (name, fast)
    # port overflow: one below the busiest rank's posts in its busiest round
    rnd = table.round_of_rows()
    most_sends = int(np.bincount(rnd * plan.cp + table.src).max())
    most_recvs = int(np.bincount(rnd * plan.cp + table.dst).max())
    fast, ref = _both(plan, table, max_sends=most_sends - 1)
    assert fast == ref and f"posts {most_sends} sends, over the port limit of {most_sends - 1} (max_sends)" in fast
    fast, ref = _both(plan, table, max_sends=most_sends, max_recvs=most_recvs - 1)
    assert fast == ref and f"receives, over the port limit of {most_recvs - 1} (max_recvs)" in fast
    assert _both(plan, table, max_sends=most_sends, max_recvs=most_recvs) == (None, None)


def test_rows_a_plan_cannot_name_are_rejected():
    plan = PLANS["hierarchical"]()
    rows = _rows(_table_of(plan))
    for bad, message in (([0, 0, 16, 0], "CP index 16 is outside the CP group"),
                         ([0, -1, 3, 0], "CP index -1 is outside the CP group"),
                         ([0, 0, 3, 32], "block id 32 is not a block of this group")):
        with pytest.raises(PlanError, match=message):
            _columnar(plan, _from_rows(rows + [bad], 2)).verify()


@pytest.mark.parametrize("name", sorted(PLANS))
@pytest.mark.parametrize("piece", [3, 1 << 20])
def test_random_mutations_get_verify_plans_messages(name, piece, monkeypatch):
    """Pieces of 3 rows exercise faults and duplicates that straddle the verifier's passes."""
    monkeypatch.setattr(table_verify, "PIECE", piece)
    monkeypatch.setattr(table_verify, "NEED_ROWS", 7)
    plan = PLANS[name]()
    table = _table_of(plan)
    assert _both(plan, table) == (None, None)
    rng = random.Random(f"{name}/{piece}")
    outcomes = set()
    for _ in range(150):
        bad = _mutate(table, plan, rng)
        if rng.random() < 0.3:  # two faults: the first in plan order is reported
            bad = _mutate(bad, plan, rng)
        fast, ref = _both(plan, bad)
        assert fast == ref
        outcomes |= {kind for kind in FAULTS if fast is not None and kind in fast}
    assert len(outcomes) >= 3, outcomes  # the mutations reach several kinds of fault


FAULTS = ("more than once", "never receives", "before it has arrived", "sends to itself", "sent back to its owner")


def test_one_ranks_view_comes_from_the_table_alone():
    plan = build_plan("dgx-h100:40", range(300), "hierarchical", parts_per_chunk=2)
    assert plan.table is not None
    views = {r: plan.rank_rounds(r) for r in (0, 7, 133, 299)}
    assert plan.__dict__["_rounds"] is None  # no other rank's transfers were built
    assert plan.rank_rounds(7) is views[7]  # cached
    for r, view in views.items():
        assert view == tuple((tuple(t for t in rnd if t.src == r), tuple(t for t in rnd if t.dst == r))
                             for rnd in plan.rounds)
        assert all(plan.sends(r, k) == s and plan.recvs(r, k) == v for k, (s, v) in enumerate(view))
    assert pickle.loads(pickle.dumps(plan)).__dict__.get("_rank_rounds") is None  # a cache is not state
    small = build_plan("dgx-h100:1", range(4), "full")
    assert small.sends(9, 0) == () and small.recvs(0, 0) == tuple(t for t in small.rounds[0] if t.dst == 0)


def test_the_1024_rank_plan_is_verified_without_objects():
    plan = build_plan("dgx-h100:128", range(1024), "hierarchical")
    assert plan.table is not None and plan.verified and plan.__dict__["_rounds"] is None
    assert plan.num_transfers() == 1.5 * 1024 * 1023 and plan.num_rounds == 2


@pytest.mark.parametrize("graph", ["entry", "hierarchical", "full"])
@pytest.mark.parametrize("cp,ranks_kind", [(16, "range"), (32, "shuffled")])
def test_packed_plans_compile_to_a_table_with_the_object_plans_rounds(graph, cp, ranks_kind):
    """A packed batch's balanced plan is kept as its table (verified without objects); its rounds,
    its columns and what the executor's ranks read are the object plan's."""
    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.planner.placing import place_batch

    topo = load_topology("dgx-h100:4")
    ranks = _group(ranks_kind, topo.world, cp)
    pl = place_batch(topo, ranks, lognormal_lengths(8.0, 1.2, cp * 4096, 7))
    cg = build_graph(topo, ranks, graph)
    columnar = compile_plan(cg, True, 1, placement=pl)
    objects = compile_plan(build_graph(topo, ranks, graph), True, 1, placement=pl, columnar=False)
    assert objects.table is None and columnar.table is not None
    assert columnar.__dict__["_rounds"] is None and columnar.verified
    for a, b in zip(columnar.transfer_columns(), objects.transfer_columns()):
        assert np.array_equal(a, b)
    assert all(columnar.rank_rounds(r) == objects.rank_rounds(r) for r in ranks)   # before rounds are built
    assert columnar.rounds == objects.rounds and columnar == objects
