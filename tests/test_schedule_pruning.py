"""The runtime's schedule search prunes by floors and still finds the full search's answer
(Note [Pruning the search]; Note [Backward floors])."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_fcp.cost.model import AttentionShape
from megatron_fcp.cost.model import pick_best
from megatron_fcp.planner.choose import choose_schedule, head_parallel_candidates
from megatron_fcp.planner.head_parallel import compile_head_parallel
from megatron_fcp.contract.head_parallel import head_parallel_degrees
from megatron_fcp.cost.head_parallel import HeadParallelPricing, degree_floor, simulate_head_parallel
from megatron_fcp.schedule.program import WaveBackward
from megatron_fcp.topology import load_topology

# (preset, CP ranks, heads, KV heads, sequence): every preset, even and uneven groups, MHA and GQA,
# compute-bound and communication-bound lengths
CELLS = [("dgx-h100:2", 16, 32, 8, 32768), ("dgx-a100:2", 12, 32, 32, 131072), ("pcie-box:2", 16, 32, 2, 32768),
         ("single-uplink:2", 16, 32, 8, 131072), ("dgx-h100:1", 8, 32, 8, 1048576)]


@pytest.mark.parametrize("preset,cp,heads,kv,seq", CELLS)
@pytest.mark.parametrize("backward", [None, WaveBackward()], ids=["one-pass", "executor"])
def test_floors_never_exceed_the_priced_total(preset, cp, heads, kv, seq, backward):
    """Every candidate's floor, its tighter floor (a chain's steps' compute), its packed floor (the
    wave loop's posts and completions), its degree's floor
    and (a = 1) its graph's floor are at most its predicted total."""
    from megatron_fcp.cost.floors import graph_kv_floor
    from megatron_fcp.cost.model import pad_for_zigzag
    from megatron_fcp.planner.builders import build_graph

    topo = load_topology(preset)
    shape = AttentionShape(seq, heads, kv, 128, 2)
    padded, _ = pad_for_zigzag(shape, cp)
    for a in head_parallel_degrees(topo, range(cp), heads, kv):
        lo = degree_floor(topo, range(cp), shape, a, backward=backward)
        for graph in ("ring", "hierarchical", "full", "leader"):
            kv_s = graph_kv_floor(build_graph(topo, range(cp), graph), topo, padded.seq_len, True, padded.kv_bytes(1))
            by_graph = degree_floor(topo, range(cp), shape, a, backward=backward, kv_s=kv_s) if a == 1 else lo
            for opts in ({}, {"parts_per_chunk": 2} if a == 1 else {"stagger": 2}):
                if a == cp and opts:
                    continue
                hp = compile_head_parallel(topo, range(cp), shape, a, graph, **opts)
                pr = HeadParallelPricing(hp, topo, shape, backward=backward)
                res = pr.result()
                total = res.total_s
                assert pr.floor() <= pr.tight_floor() <= pr.packed_floor() <= total, (a, graph, opts)
                assert lo <= by_graph <= total, (a, graph, opts)


def test_a_search_pricing_skips_the_one_pass_backward_only():
    """``one_pass=False`` (the runtime's search) prices the same times and communication."""
    shape = AttentionShape(65536, 32, 8, 128, 2)
    for preset, cp, a, graph, opts in (("dgx-h100:2", 16, 1, "hierarchical", {}), ("dgx-h100:2", 16, 4, "ring", {}),
                                       ("dgx-h100:2", 16, 4, "ring", {"stagger": 2}),
                                       ("pcie-box:2", 16, 1, "ring", {"parts_per_chunk": 2})):
        topo = load_topology(preset)
        hp = compile_head_parallel(topo, range(cp), shape, a, graph, **opts)
        full = HeadParallelPricing(hp, topo, shape, backward=WaveBackward()).result()
        lean = HeadParallelPricing(hp, topo, shape, backward=WaveBackward(), one_pass=False).result()
        assert (lean.total_s, lean.comm_s, lean.compute_s) == (full.total_s, full.comm_s, full.compute_s)
        assert all(full.meta[k] == v for k, v in lean.meta.items())   # less reported, nothing different
        assert {"backward_kv", "backward_form", "fwd_total_s", "bwd_total_s"} <= \
            set(lean.meta)


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


# ---- build_plan's auto and the columnar rounds (Note [Pruning auto], Note [Columnar rounds]) ----------

GRAPH_CASES = [("dgx-h100:4", 32), ("dgx-a100:3", 20), ("pcie-box:2", 12), ("single-uplink:4", 32), ("dgx-h100:2", 16)]


@pytest.mark.parametrize("preset,cp", GRAPH_CASES)
def test_graph_floors_never_exceed_the_priced_plans(preset, cp):
    from megatron_fcp.cost.model import simulate_plan
    from megatron_fcp.planner.builders import build_graph
    from megatron_fcp.planner.compile import compile_plan
    from megatron_fcp.planner.build import NOMINAL_SHAPE, _floor
    from megatron_fcp.planner.builders import AUTO_CANDIDATES

    topo = load_topology(preset)
    for causal in (True, False):
        for name in AUTO_CANDIDATES:
            cg = build_graph(topo, range(cp), name)
            plan = compile_plan(cg, causal)
            res = simulate_plan(plan, topo, NOMINAL_SHAPE)
            assert _floor(cg, topo, NOMINAL_SHAPE, causal) <= min(res.comm_s, res.total_s), (name, causal)


@pytest.mark.parametrize("preset,cp", GRAPH_CASES)
@pytest.mark.parametrize("shaped", [False, True])
def test_auto_picks_the_best_of_every_candidate(preset, cp, shaped, monkeypatch):
    """Pruned auto is pick_best over every builder's plan, each compiled and timed."""
    from megatron_fcp.cost.model import simulate_plan
    from megatron_fcp.planner import build
    from megatron_fcp.planner.build import build_plan
    from megatron_fcp.planner.build import NOMINAL_SHAPE
    from megatron_fcp.planner.builders import AUTO_CANDIDATES

    topo = load_topology(preset)
    shape = dict(seq_len=65536, heads=32, kv_heads=8, head_dim=128) if shaped else {}
    objective = "total" if shaped else "comm"
    sim_shape = AttentionShape(65536, 32, 8, 128, 2) if shaped else NOMINAL_SHAPE
    every = [(simulate_plan(p, topo, sim_shape, compute=shaped), p)
             for p in (build_plan(topo, range(cp), n) for n in AUTO_CANDIDATES)]
    want = pick_best(every, objective)[1]
    monkeypatch.setattr(build, "PRUNE_AUTO_MIN_CP", 0)   # prune at these small sizes too
    got = build_plan(topo, range(cp), "auto", **shape)
    assert got.name == want.name and got.rounds == want.rounds
    times = {p.name: getattr(r, "total_s" if shaped else "comm_s") for r, p in every}
    assert all(times[k] == t for k, t in got.auto.times)


PACKED_CASES = [("dgx-h100:4", 32, 2048), ("single-uplink:4", 32, 8192), ("dgx-a100:3", 24, 4096),
                ("pcie-box:2", 16, 2048)]


def _packed_placement(cp: int, median: int, causal: bool = True):
    import math

    from megatron_fcp.contract.placement import lognormal_lengths, place_packed

    return place_packed(lognormal_lengths(math.log(median), 1.0, 128 * 1024, 0), cp, block_tokens=2048,
                        causal=causal)


@pytest.mark.parametrize("preset,cp,median", PACKED_CASES)
def test_packed_graph_floors_never_exceed_the_priced_plans(preset, cp, median):
    """A packed batch's graph floor (graph_kv_floor over the placement) is below every builder's
    plan over it, in communication and in total."""
    from megatron_fcp.cost.model import simulate_plan
    from megatron_fcp.planner.build import NOMINAL_SHAPE, _floor
    from megatron_fcp.planner.builders import PACKED_AUTO_CANDIDATES, build_graph
    from megatron_fcp.planner.compile import compile_plan

    topo = load_topology(preset)
    for causal in (True, False):
        pl = _packed_placement(cp, median, causal)
        for name in PACKED_AUTO_CANDIDATES:
            cg = build_graph(topo, range(cp), name)
            res = simulate_plan(compile_plan(cg, causal, placement=pl), topo, NOMINAL_SHAPE)
            assert 0 < _floor(cg, topo, NOMINAL_SHAPE, causal, pl) <= min(res.comm_s, res.total_s), (name, causal)


@pytest.mark.parametrize("preset,cp,median", PACKED_CASES)
@pytest.mark.parametrize("name", ["ring", "spanning"])
def test_fixed_path_edge_loads_are_the_compiled_plans(preset, cp, median, name):
    """A builder's fixed paths (GraphBuilder.edge_loads: the ring's chains, the spanning tree's
    paths) give each graph edge exactly the tokens the compiled plan sends over it, causal or not,
    and the packed floor built on them stays below the plan's time."""
    from megatron_fcp.cost.model import simulate_plan
    from megatron_fcp.planner.build import NOMINAL_SHAPE, _floor
    from megatron_fcp.planner.builders import build_graph
    from megatron_fcp.planner.compile import compile_plan

    topo = load_topology(preset)
    for causal in (True, False):
        pl = _packed_placement(cp, median, causal)
        cg = build_graph(topo, range(cp), name)
        src, dst, tokens = cg.builder.edge_loads(cg, pl.block_owners(), pl.need_matrix(),
                                                 pl.block_tokens().astype(np.float64))
        plan = compile_plan(cg, causal, placement=pl)
        _, s, d, owner, chunk, _ = plan.transfer_columns()
        sent = {}
        for key, t in zip(zip(s.tolist(), d.tolist()), pl.tokens_of(owner, chunk).tolist()):
            sent[key] = sent.get(key, 0) + t
        assert {(a, b): t for a, b, t in zip(src.tolist(), dst.tolist(), tokens.tolist())} == sent
        res = simulate_plan(plan, topo, NOMINAL_SHAPE)
        assert 0 < _floor(cg, topo, NOMINAL_SHAPE, causal, pl) <= min(res.comm_s, res.total_s)


@pytest.mark.parametrize("preset,cp,median", PACKED_CASES)
def test_trees_floor_is_below_every_packed_plan_and_the_trees_are_reused(preset, cp, median):
    """The trees floor (_trees_floor: each edge's load from the candidate's trees) never exceeds the
    plan compiled from the same graph, and the compile over the trees kept on the placement is the
    compile from scratch."""
    from megatron_fcp.cost.model import simulate_plan
    from megatron_fcp.planner.build import NOMINAL_SHAPE, _trees_floor
    from megatron_fcp.planner.builders import PACKED_AUTO_CANDIDATES, build_graph
    from megatron_fcp.planner.compile import compile_plan, placement_trees

    topo = load_topology(preset)
    for causal in (True, False):
        pl = _packed_placement(cp, median, causal)
        for name in PACKED_AUTO_CANDIDATES:
            cg = build_graph(topo, range(cp), name)
            fresh = compile_plan(cg, causal, placement=_packed_placement(cp, median, causal))
            floor = _trees_floor(cg, topo, NOMINAL_SHAPE, pl)              # keeps the trees on pl
            _, cols = placement_trees(cg, pl)
            assert not cols.u.flags.writeable
            again = compile_plan(cg, causal, placement=pl)
            assert again.rounds == fresh.rounds, name
            res = simulate_plan(again, topo, NOMINAL_SHAPE)
            assert 0 < floor <= min(res.comm_s, res.total_s), (name, causal)


@pytest.mark.parametrize("preset,cp,median", PACKED_CASES)
@pytest.mark.parametrize("shaped", [False, True])
def test_packed_auto_picks_what_every_candidate_would(preset, cp, median, shaped, monkeypatch):
    """Pruned auto on a packed batch is _least_crossing over every builder's plan, each compiled
    and timed; the candidates it leaves out are the ones a floor puts above the packed tie."""
    from megatron_fcp.cost.model import simulate_plan
    from megatron_fcp.planner import build
    from megatron_fcp.planner.build import NOMINAL_SHAPE, PACKED_TIE, _least_crossing, build_plan
    from megatron_fcp.planner.builders import PACKED_AUTO_CANDIDATES

    topo = load_topology(preset)
    pl = _packed_placement(cp, median)
    shape = dict(seq_len=65536, heads=32, kv_heads=8, head_dim=128) if shaped else {}
    objective = "total" if shaped else "comm"
    sim_shape = AttentionShape(65536, 32, 8, 128, 2) if shaped else NOMINAL_SHAPE
    every = [(simulate_plan(p, topo, sim_shape, compute=shaped), p)
             for p in (build_plan(topo, range(cp), n, placement=pl) for n in PACKED_AUTO_CANDIDATES)]
    want = _least_crossing(every, objective)[1]
    monkeypatch.setattr(build, "PRUNE_AUTO_MIN_CP", 0)   # prune at these small sizes too
    got = build_plan(topo, range(cp), "auto", placement=pl, **shape)
    assert got.name == want.name and got.rounds == want.rounds
    metric = "total_s" if shaped else "comm_s"
    times = {p.name: getattr(r, metric) for r, p in every}
    assert all(times[k] == t for k, t in got.auto.times)
    best = min(times.values())
    left_out = set(times) - {k for k, _ in got.auto.times}
    assert all(times[k] > best * (1 + PACKED_TIE) for k in left_out)


@pytest.mark.parametrize("preset,cp,graph", [("dgx-h100:4", 32, "hierarchical"), ("dgx-a100:3", 20, "full"),
                                             ("pcie-box:2", 12, "leader"), ("single-uplink:4", 32, "spanning"),
                                             ("dgx-h100:3", 20, "ring")])
def test_columnar_rounds_are_the_loop(preset, cp, graph, monkeypatch):
    """Above COLUMNAR_ROUNDS_MIN_CP ranks rounds are loaded as columns; the same times and loads."""
    from megatron_fcp.cost import model as cost
    from megatron_fcp.planner.build import build_plan
    from megatron_fcp.cost.model import simulate_plan

    topo = load_topology(preset)
    plan = build_plan(topo, range(cp), graph, parts_per_chunk=2)
    shape = AttentionShape(131072)
    loop = simulate_plan(plan, topo, shape, compute=False)
    monkeypatch.setattr(cost, "COLUMNAR_ROUNDS_MIN_CP", 0)
    cols = simulate_plan(plan, topo, shape, compute=False)
    assert cols.comm_s == pytest.approx(loop.comm_s, rel=1e-12) and cols.bytes == loop.bytes
    assert cols.resource_bytes.keys() == loop.resource_bytes.keys()
    assert all(cols.resource_bytes[k] == pytest.approx(v, rel=1e-12) for k, v in loop.resource_bytes.items())
    assert [e["bottleneck"] for e in cols.timeline] == [e["bottleneck"] for e in loop.timeline]


def test_packed_auto_breaks_an_exact_tie_by_the_fewest_bytes():
    """Two packed plans whose forwards tie exactly (time, communication, inter-node bytes): auto
    keeps the one that moves fewer bytes in all, whose backward returns fewer partials
    (dgx-h100:2, 512K tokens of an 8K-median mix: `entry` against `hierarchical`'s relays)."""
    from megatron_fcp.contract.placement import lognormal_lengths, place_packed
    from megatron_fcp.cost.backward import simulate_plan_backward
    from megatron_fcp.cost.model import simulate_plan
    from megatron_fcp.planner.build import build_plan

    topo = load_topology("dgx-h100:2")
    pl = place_packed(lognormal_lengths(9.0, 1.0, 1 << 19, seed=0), 16, block_tokens=4096)
    shape = AttentionShape(1, 32, 8, 128, 2)
    res = {g: (simulate_plan(p, topo, shape), p) for g in ("entry", "hierarchical")
           for p in [build_plan(topo, range(16), g, placement=pl)]}
    (e, pe), (h, ph) = res["entry"], res["hierarchical"]
    assert (e.total_s, e.comm_s, e.inter_node_bytes) == (h.total_s, h.comm_s, h.inter_node_bytes)
    assert e.bytes < h.bytes
    assert simulate_plan_backward(pe, topo, shape).total_s < simulate_plan_backward(ph, topo, shape).total_s
    got = build_plan(topo, range(16), "auto", placement=pl, heads=32, kv_heads=8, head_dim=128)
    assert got.name == "entry"


@pytest.mark.parametrize("preset,cp", [("dgx-h100:2", 16), ("single-uplink:2", 16), ("pcie-box:2", 16),
                                       ("dgx-a100:4", 32), ("gb200-nvl72:4", 16)])
def test_the_star_floor_is_below_the_full_plans_communication(preset, cp):
    """``star_kv_floor`` (the ``full`` builder's messages, owner straight to each reader, on their
    routes' most loaded resource) is at most the full plan's forward communication, packed (causal
    and windowed) and zigzag (sub-blocks too), on rail-aligned and shared-link presets; and within
    a few percent of it (the rounds add latencies and imbalance, not bytes)."""
    import dataclasses

    from megatron_fcp.cost.floors import star_kv_floor
    from megatron_fcp.cost.model import pad_for_zigzag, simulate_plan
    from megatron_fcp.planner.build import build_plan

    topo = load_topology(preset)
    shape = AttentionShape(1, 32, 8, 128, 2)
    cases = []
    for window in (None, (1024, 0)):
        pl = _packed_placement(cp, 4096)
        pl = pl if window is None else dataclasses.replace(pl, window=window)
        cases.append((build_plan(topo, range(cp), "full", placement=pl), shape,
                      star_kv_floor(topo, range(cp), pl, 0, pl.mask, shape.kv_bytes(1))))
    for parts in (1, 2):
        padded = pad_for_zigzag(AttentionShape(cp * 2048, 32, 8, 128, 2), cp)[0]
        cases.append((build_plan(topo, range(cp), "full", parts_per_chunk=parts), padded,
                      star_kv_floor(topo, range(cp), None, padded.seq_len, True, padded.kv_bytes(1))))
    for plan, sim_shape, floor in cases:
        comm = simulate_plan(plan, topo, sim_shape).comm_s
        assert 0.9 * comm <= floor <= comm
    from megatron_fcp.planner.builders import BUILDERS, get_builder

    assert [n for n in BUILDERS if get_builder(n).sends_direct()] == ["full"]   # the only stars (entry relays)


@pytest.mark.parametrize("causal", [True, False])
def test_graphs_with_the_same_trees_compile_alike_and_auto_times_one(causal):
    """One rank per node (a = 8's KV stage): full, hierarchical, leader and entry all send each
    block straight to its readers. compiles_alike says so, and their compiled plans are the same
    transfers; auto compiles the first and records the others at its time, which is what compiling
    each gives, and picks what every candidate compiled would. Where trees differ (relays inside a
    node) it says no."""
    from megatron_fcp.cost.model import simulate_plan
    from megatron_fcp.planner.build import NOMINAL_SHAPE, _least_crossing, build_plan
    from megatron_fcp.planner.builders import PACKED_AUTO_CANDIDATES, build_graph
    from megatron_fcp.planner.compile import compile_plan, compiles_alike

    topo = load_topology("dgx-h100:6")
    ranks = tuple(range(0, 48, 8))                                   # member 0 of each node's group
    pl = _packed_placement(len(ranks), 8192, causal)
    graphs = {n: build_graph(topo, ranks, n) for n in PACKED_AUTO_CANDIDATES}
    plans = {n: compile_plan(cg, causal, placement=pl) for n, cg in graphs.items()}
    alike = [n for n in PACKED_AUTO_CANDIDATES if compiles_alike(graphs["full"], graphs[n], pl)]
    assert {"full", "hierarchical", "leader", "entry"} <= set(alike)
    for n in alike:
        assert [c.tolist() for c in plans[n].transfer_columns()] == [c.tolist() for c in plans["full"].transfer_columns()]
    every = [(simulate_plan(p, topo, NOMINAL_SHAPE, compute=False), p) for p in plans.values()]
    want = _least_crossing(every, "comm")[1]
    got = build_plan(topo, ranks, "auto", placement=pl, causal=causal)
    assert got.name == want.name and got.rounds == want.rounds
    times = {p.name: r.comm_s for r, p in every}
    assert all(times[k] == t for k, t in got.auto.times)
    assert {k for k, _ in got.auto.times} >= set(alike) - {"full"}      # recorded, not left out
    # inside a node, hierarchical relays where full sends straight: not alike
    inner = tuple(range(16))
    pl16 = _packed_placement(16, 8192, causal)
    assert not compiles_alike(build_graph(topo, inner, "full"), build_graph(topo, inner, "hierarchical"), pl16)
    assert not compiles_alike(graphs["full"], build_graph(topo, inner, "full"), pl16)    # other ranks
