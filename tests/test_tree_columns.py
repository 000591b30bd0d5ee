"""Trees as columns (Note [Trees as columns] in megatron_fcp.planner.tree_columns): the vectorised
``full``, ``entry`` and ``hierarchical`` trees are, edge for edge and in order, what each builder's
``tree_with_depths`` gives tree by tree -- on uneven CP groups, shuffled rank maps, NVLink domains
that span hosts, every chunk parity, readers of one rank up to all of them -- and builders that
change the per-tree rule (``stripe``, ``balanced``) are asked tree by tree."""

import numpy as np
import pytest

from megatron_fcp.planner import compile as C
from megatron_fcp.planner.builders import BalancedGraph, build_graph
from megatron_fcp.planner.placing import place_batch
from megatron_fcp.planner.tree_columns import Readers, columns_of, from_trees
from megatron_fcp.topology import load_topology

GROUPS = {
    "even": ("dgx-h100:4", list(range(32))),
    "uneven": ("dgx-h100:4", list(range(8)) + list(range(8, 12)) + list(range(16, 24)) + list(range(24, 27))),
    "shuffled": ("dgx-h100:4", np.random.default_rng(7).permutation(32).tolist()),
    "nvl72": ("gb200-nvl72:4", list(range(16))),
    "pcie": ("pcie-box:3", list(range(0, 24, 2))),
}


def _per_tree(cg, owner, chunk, readers):
    return columns_of(owner.tolist(), chunk.tolist(), readers, cg.tree_with_depths)


def _random_trees(ranks, n, seed):
    rng = np.random.default_rng(seed)
    owner = rng.choice(ranks, n)
    chunk = rng.integers(0, 6, n)
    lists = []
    for t in range(n):
        k = int(rng.integers(1, len(ranks) + 1))
        pool = [r for r in ranks if r != owner[t]]            # a block's owner never reads it from others
        lists.append(sorted(rng.choice(pool, min(k, len(pool)), replace=False).tolist(), key=ranks.index))
    for t in range(0, n, 7):                                              # everyone but the owner
        lists[t] = [r for r in ranks if r != owner[t]]
    return owner.astype(np.int64), chunk.astype(np.int64), Readers.from_lists(lists)


def _assert_same(got, want):
    for name, a, b in zip(got._fields, got, want):
        assert np.array_equal(a, b), name


@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("graph", ["full", "entry", "hierarchical", "stripe"])
def test_vectorised_trees_are_the_per_tree_trees(group, graph):
    preset, ranks = GROUPS[group]
    cg = build_graph(load_topology(preset), ranks, graph)
    for seed in range(3):
        owner, chunk, readers = _random_trees(ranks, 60, seed)
        _assert_same(cg.tree_columns(owner, chunk, readers), _per_tree(cg, owner, chunk, readers))


def test_a_subclass_with_its_own_exit_is_asked_tree_by_tree():
    topo = load_topology("dgx-h100:4")
    ranks = GROUPS["uneven"][1]
    cg = BalancedGraph({r: 1.0 + (r % 5) for r in ranks}).build(topo, ranks)
    owner, chunk, readers = _random_trees(ranks, 80, 3)
    got = cg.tree_columns(owner, chunk, readers)
    _assert_same(got, _per_tree(cg, owner, chunk, readers))
    plain = build_graph(topo, ranks, "hierarchical").tree_columns(owner, chunk, readers)
    assert not all(np.array_equal(a, b) for a, b in zip(got, plain))    # its exits do move blocks


@pytest.mark.parametrize("graph", ["full", "entry", "hierarchical"])
def test_packed_readers_come_from_the_need_matrix(graph):
    """The compiler's readers of a placement are _sources' blocks and readers, in order, and the
    trees over them the per-tree trees."""
    topo = load_topology("dgx-h100:4")
    ranks = GROUPS["uneven"][1]
    rng = np.random.default_rng(5)
    lengths = np.maximum(1, rng.lognormal(7.5, 1.2, 90).astype(int)).tolist()
    pl = place_batch(topo, ranks, lengths)
    owner, chunk, readers = C._readers(ranks, True, pl)
    src = list(C._sources(ranks, True, pl))
    assert list(zip(owner.tolist(), chunk.tolist())) == [(o, c) for o, c, _ in src]
    assert [readers.of(t) for t in range(len(src))] == [list(d) for _, _, d in src]
    cg = build_graph(topo, ranks, graph)
    _assert_same(cg.tree_columns(owner, chunk, readers), _per_tree(cg, owner, chunk, readers))


def test_columns_round_trip_and_stagger():
    cg = build_graph(load_topology("dgx-h100:2"), range(16), "hierarchical")
    owner, chunk, readers = _random_trees(list(range(16)), 20, 1)
    cols = cg.tree_columns(owner, chunk, readers)
    _assert_same(from_trees(cols.as_trees()), cols)
    deeper = cols.staggered(3)
    assert np.array_equal(deeper.depth - cols.depth, cols.chunk[cols.tree_of] % 3)
    assert cols.staggered(1) is cols


def test_entry_position_is_one_rule_for_ints_and_arrays():
    """``entry_position`` on ints (the per-tree builders) and on arrays (the rail layout, the
    columns): the same positions, an int for ints; odd chunks shift only into larger nodes."""
    import itertools

    from megatron_fcp.planner.tree_columns import entry_position

    cases = list(itertools.product(range(9), range(1, 9), range(1, 9), range(4)))
    ints = [entry_position(*c) for c in cases]
    assert all(type(x) is int for x in ints)
    assert ints == [(r + h) % s if s > h and c % 2 else r % s for r, h, s, c in cases]
    arrays = entry_position(*(np.array(col) for col in zip(*cases)))
    assert arrays.tolist() == ints
