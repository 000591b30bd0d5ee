"""Node-aware placement (Note [Node-aware placement]) and the ``stripe`` graph: contracts, relations,
and FP64 numerics of a stripe plan over a node-aware placement."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from megatron_fcp.contract.placement import (BALANCE_TARGET, Span, _split_even, lognormal_lengths, place_packed,
                                             span_pairs)
from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.verify import verify_reference
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.builders import GRAPH_CHOICES, PACKED_AUTO_CANDIDATES, get_builder
from megatron_fcp.planner.placing import cp_nodes, place_batch
from megatron_fcp.testing.harness import assert_packed_matches_fp64
from megatron_fcp.topology import load_topology


def _node_ingress(pl, nodes) -> np.ndarray:
    """Tokens entering each node: every block some rank of the node needs, once per node."""
    need, blocks = pl.need_matrix(), pl.block_list()
    tok = np.array([b[2].tokens for b in blocks])
    own = np.array([nodes[b[0]] for b in blocks])
    ids = sorted(set(nodes))
    out = []
    for n in ids:
        rows = [j for j in range(pl.cp) if nodes[j] == n]
        wanted = need[rows].any(0) & (own != n)
        out.append(int((wanted * tok).sum()))
    return np.array(out)


@pytest.mark.parametrize("median,cp", [(8192, 64), (32768, 64), (2048, 128)])
def test_node_aware_placement_keeps_work_and_cuts_node_ingress(median, cp):
    """Same tokens, work within the balance target, and less entering the busiest node than flat."""
    lengths = lognormal_lengths(math.log(median), 1.0, 524288, 0)
    nodes = cp_nodes(f"dgx-h100:{cp // 8}", range(cp))
    flat = place_packed(lengths, cp)
    aware = place_packed(lengths, cp, nodes=nodes)
    assert aware.total_tokens == flat.total_tokens == sum(lengths)
    work = aware.work()
    assert work.max() <= BALANCE_TARGET * work.mean()
    assert _node_ingress(aware, nodes).max() < _node_ingress(flat, nodes).max()
    assert _node_ingress(aware, nodes).sum() < _node_ingress(flat, nodes).sum()


def test_node_aware_equals_flat_where_nodes_say_nothing(caplog):
    lengths = lognormal_lengths(math.log(3000), 1.0, 65536, 1)
    flat = place_packed(lengths, 8)
    assert place_packed(lengths, 8, nodes=[0] * 8) == flat                  # one node
    assert place_packed(lengths, 8, nodes=range(8)) == flat                 # one rank per node
    with caplog.at_level(logging.INFO, logger="megatron_fcp.contract.placement"):
        uneven = place_packed(lengths, 8, nodes=[0, 0, 0, 0, 0, 1, 1, 1])   # 5 + 3: cannot share work evenly
    assert uneven == flat
    with pytest.raises(ValueError, match="one node id per CP index"):
        place_packed(lengths, 8, nodes=[0, 1])


def test_split_even_balances_a_node_to_the_token():
    """The coarse case of the note: one document's tail in a few pieces, 8 ranks; runs are
    contiguous, cover the pieces exactly, and differ in work by at most one token's work."""
    doc = {0: Span(0, 0, 120000), 1: Span(1, 0, 3000)}
    pieces = [Span(0, a, a + 573) for a in range(110140, 119892, 573)] + [Span(1, 0, 3000)]
    runs = _split_even(pieces, doc, Mask(True), 8)
    assert len(runs) == 8 and all(runs)
    flat = sorted(pieces)
    got = [s for r in runs for s in r]
    assert sum(s.tokens for s in got) == sum(s.tokens for s in flat)
    covered = sorted((s.doc, t) for s in got for t in range(s.start, s.end))
    assert covered == sorted((s.doc, t) for s in flat for t in range(s.start, s.end))
    works = [sum(span_pairs(s, doc[s.doc], True) for s in r) for r in runs]
    assert max(works) - min(works) <= 2 * 120000                          # two tokens at most


def test_stripe_trees_leave_the_owners_node_through_different_ranks():
    topo = load_topology("dgx-h100:4")
    cg = get_builder("stripe").build(topo, range(32))
    owner = 3
    dests = [9, 12, 17, 20, 25, 30, 1]                                      # readers on all four nodes
    edges, depths = cg.builder.tree_with_depths(cg, owner, dests)
    assert depths == sorted(depths)                                         # BFS order
    reached = {owner} | {v for _, v in edges}
    assert set(dests) <= reached and len(edges) == len(reached) - 1         # a tree covering the readers
    exits = [u for u, v in edges if topo.node_of(u) != topo.node_of(v)]
    assert len(exits) == 3 and len(set(exits)) == 3                         # one copy a node, three NICs
    assert all(topo.node_of(u) == topo.node_of(owner) for u in exits)
    assert "stripe" not in PACKED_AUTO_CANDIDATES and "stripe" in GRAPH_CHOICES   # named only (its docstring)


def test_stripe_sends_no_more_inter_node_bytes_than_entry():
    lengths = lognormal_lengths(math.log(8192), 1.0, 262144, 0)
    topo = load_topology("dgx-h100:4")
    pl = place_batch(topo, range(32), lengths)
    plans = {g: build_plan(topo, range(32), g, placement=pl) for g in ("entry", "stripe")}
    crossing = {g: sum(1 for _, t in p.transfers() if topo.node_of(t.src) != topo.node_of(t.dst))
                for g, p in plans.items()}
    assert crossing["stripe"] == crossing["entry"] > 0
    for p in plans.values():
        verify_reference(p)


def test_stripe_over_a_node_aware_placement_matches_fp64():
    """cp = 8 over four nodes of two (global ranks 6, 7, 14, 15, ... of dgx-h100:4), one document
    over most of them so its first blocks are read on three other nodes: out, LSE, dQ, dK, dV."""
    ranks = (6, 7, 14, 15, 22, 23, 30, 31)
    topo = load_topology("dgx-h100:4")
    lengths = [300, 7, 40, 3, 22, 1, 15]
    pl = place_batch(topo, ranks, lengths, block_tokens=16)
    assert len(set(cp_nodes(topo, ranks))) == 4
    plan = build_plan(topo, ranks, "stripe", placement=pl)
    assert any(topo.node_of(t.block.owner) == topo.node_of(t.src) != topo.node_of(t.dst) and t.src != t.block.owner
               for _, t in plan.transfers())                                # some copy leaves through a relay
    assert_packed_matches_fp64(plan, pl, seed=5)


def test_packed_as_run_prices_the_waves_between_the_stage_all_to_alls():
    """``packed_as_run``: the forward as priced one-pass, the backward as the executor runs it
    (waves) — for a head-parallel stage the waves of the merged stage plan plus the two
    all-to-alls; it is what ``choose_packed_head_parallel`` ranks the degrees by."""
    from megatron_fcp.cost.backward import simulate_backward_waves
    from megatron_fcp.cost.head_parallel import stage_shape
    from megatron_fcp.cost.head_parallel_packed import (packed_as_run, packed_stage_plan,
                                                        simulate_packed_head_parallel)
    from megatron_fcp.cost.model import AttentionShape, simulate_plan
    from megatron_fcp.planner.head_parallel import choose_packed_head_parallel

    topo = load_topology("dgx-h100:2")
    lengths = lognormal_lengths(math.log(6000), 1.0, 131072, 3)
    shape = AttentionShape(1, heads=16, kv_heads=8, head_dim=128, dtype_bytes=2)
    plans: dict = {}
    _, priced = choose_packed_head_parallel(topo, range(16), lengths, shape, degrees=(1, 2), graph="auto",
                                            plans=plans, prune=False)
    one = packed_as_run(plans[1], topo, shape)
    assert priced == {1: one["total_s"], 2: packed_as_run(plans[2], topo, shape)["total_s"]}
    assert one["fwd_s"] == simulate_plan(plans[1], topo, shape).total_s
    assert one["bwd_s"] == simulate_backward_waves(plans[1], topo, shape)["bwd_s"]
    hp = plans[2]
    two = packed_as_run(hp, topo, shape)
    one_pass = simulate_packed_head_parallel(hp, topo, shape)
    assert two["fwd_s"] == one_pass.meta["fwd_total_s"]
    stage = simulate_backward_waves(packed_stage_plan(hp), topo, stage_shape(hp, shape))
    assert two["bwd_s"] > stage["bwd_s"] and two["waves"] == stage["waves"]   # plus the two all-to-alls
    assert two["total_s"] == two["fwd_s"] + two["bwd_s"]
