"""Routes as integer columns (Note [Route ids] in megatron_fcp.topology.route_ids): every row is
the route Topology.route gives, first-use renumbering is the loop's numbering, and the vectorised
callers (the cost model's route columns, CommGraph.bandwidths, Placement.tokens_of) agree with
their pair-by-pair forms."""

import numpy as np
import pytest

from megatron_fcp.cost.model import _ResourceIndex
from megatron_fcp.planner.builders import build_graph
from megatron_fcp.planner.placing import place_batch
from megatron_fcp.topology import load_topology
from megatron_fcp.topology.errors import TopologyError
from megatron_fcp.topology.route_ids import first_use_ids


def _pairs(world, n, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, world, n), rng.integers(0, world, n)


@pytest.mark.parametrize("dense", (True, False), ids=("table", "search"))
@pytest.mark.parametrize("preset", ["dgx-h100:4", "gb200-nvl72:18", "pcie-box:2"])
def test_rows_are_the_topology_routes_whatever_order_they_are_asked_in(preset, dense):
    """Rows found by the world x world table and by the sorted keys' search (worlds over
    DENSE_ROWS_MAX_WORLD) alike."""
    from megatron_fcp.topology.route_ids import RouteIds

    topo = load_topology(preset)
    table = topo.route_ids() if dense else RouteIds(topo)
    if not dense:
        table._dense = None
    for seed in range(3):                        # later calls find earlier rows and add new ones
        src, dst = _pairs(topo.world, 200, seed)
        rows = table.rows(src, dst)
        lens, ids = table.gather(rows)
        at = np.concatenate([[0], np.cumsum(lens)])
        for k, (s, d) in enumerate(zip(src.tolist(), dst.tolist())):
            route = topo.route(s, d)
            assert [table.names[i] for i in ids[at[k]:at[k + 1]]] == [r.name for r in route.resources]
            assert [table.resource_bandwidth[i] for i in ids[at[k]:at[k + 1]]] == [r.bandwidth for r in route.resources]
            assert table.latency[rows[k]] == route.latency
            assert table.bandwidth[rows[k]] == route.bandwidth
    assert (topo.route_ids() is table) == dense                    # one per topology
    assert len(np.unique(table._index[0])) == len(table.latency)    # each pair one row


def test_rows_name_a_rank_outside_the_topology():
    topo = load_topology("dgx-h100:1")
    with pytest.raises(TopologyError, match="8"):
        topo.route_ids().rows([0, 8], [1, 2])


def test_first_use_ids_number_as_a_loop_would():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 40, 300)
    local, topo_of_local = first_use_ids(ids)
    seen: dict[int, int] = {}
    expect = [seen.setdefault(int(i), len(seen)) for i in ids]
    assert local.tolist() == expect
    assert topo_of_local.tolist() == list(seen)
    from megatron_fcp.topology.route_ids import _first_use
    slow = getattr(_first_use, "py_func", _first_use)(ids.astype(np.int64), 40)   # the loop as Python
    assert slow[0].tolist() == expect and slow[1].tolist() == list(seen)
    empty_local, empty_of = first_use_ids(np.zeros(0, dtype=np.int64))
    assert len(empty_local) == 0 and len(empty_of) == 0
    with pytest.raises(ValueError, match=">= 0"):
        first_use_ids(np.array([3, -1]))


def test_cost_model_route_columns_match_route_by_route():
    topo = load_topology("dgx-h100:4")
    src, dst = _pairs(topo.world, 150, 4)
    one, many = _ResourceIndex(topo), _ResourceIndex(topo)
    lens, ids, lat = many.route_columns(src, dst)
    at = np.concatenate([[0], np.cumsum(lens)])
    for k, (s, d) in enumerate(zip(src.tolist(), dst.tolist())):
        rid, latency = one.route(s, d)
        assert ids[at[k]:at[k + 1]].tolist() == list(rid)
        assert lat[k] == latency
    assert many.names == one.names and many.bw == one.bw        # the same numbering and bandwidths


@pytest.mark.parametrize("graph", ["ring", "full", "hierarchical", "leader", "spanning"])
def test_graph_bandwidths_match_edge_by_edge(graph):
    topo = load_topology("dgx-h100:2")
    cg = build_graph(topo, range(16), graph)
    src, dst = _pairs(16, 100, 5)
    got = cg.bandwidths(src, dst)          # the first question of a fresh topology, on purpose
    assert got.tolist() == [cg.bandwidth(a, b) for a, b in zip(src.tolist(), dst.tolist())]


def test_placement_tokens_of_is_each_blocks_tokens():
    topo = load_topology("dgx-h100:2")
    rng = np.random.default_rng(2)
    lengths = np.maximum(1, rng.lognormal(7.0, 1.2, 60).astype(int)).tolist()
    pl = place_batch(topo, range(16), lengths)
    blocks = pl.block_list()
    i = np.array([a for a, _, _ in blocks])
    b = np.array([c for _, c, _ in blocks])
    order = rng.permutation(len(blocks))
    assert pl.tokens_of(i[order], b[order]).tolist() == [blocks[k][2].tokens for k in order.tolist()]
