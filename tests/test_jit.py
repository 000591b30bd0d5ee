"""The planner's compiled loops (Note [Compiled planning loops] in :mod:`megatron_fcp.jit`): the
compiled run and the Python run of each kernel give the same answer, bit for bit, on the same
plans; and the Python fallback is what runs when numba is switched off."""

import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_fcp import jit as J
from megatron_fcp.contract.placement import lognormal_lengths, place_packed
from megatron_fcp.planner.build import build_plan
from megatron_fcp.schedule import waves as W


def _plans():
    pl = place_packed(lognormal_lengths(8.0, 1.2, 16 * 8192, 3), 16, block_tokens=2048)
    yield "packed", build_plan("dgx-h100:2", range(16), "hierarchical", placement=pl), None
    yield "zigzag", build_plan("pcie-box:2", range(16), "entry", parts_per_chunk=4), 65536
    # CP ranks neither contiguous nor sorted: block numbers and rank ids are not the same order
    yield "scattered", build_plan("dgx-h100:4", [17, 3, 9, 30, 22, 5, 12, 27], "hierarchical", parts_per_chunk=2), 8192


@pytest.mark.skipif(not J.COMPILED, reason="numba not installed: only the Python run exists")
@pytest.mark.parametrize("case", list(_plans()), ids=lambda c: c[0])
def test_pack_kernel_compiled_equals_python(case):
    _, plan, seq = case
    size = lambda b: plan.block_tokens(b, seq) * 4096  # noqa: E731
    inp = W._PackInput(plan, size)
    a = inp.arrays
    budget = W.wave_budget(plan, size)
    for b in (budget // 2, budget):
        for scale in (0.3, 1.0, 4.0, float("inf")):
            args = W._kernel_args(inp, b, inp.top * scale)
            fast, slow = W._pack_kernel(*args), W._pack_kernel.py_func(*args)
            for x, y in zip(fast[:5], slow[:5]):
                assert x.dtype == y.dtype and np.array_equal(x, y)
            assert fast[5] == slow[5] and fast[6] == slow[6] and len(fast[0]) > 1
            # every delivery and own block packed exactly once
            n = int(a["n_needs"].sum() + (a["own_hi"] - a["own_lo"]).sum())
            assert len(fast[3]) == n and len(set(zip(fast[3].tolist(), fast[4].tolist()))) == n


@pytest.mark.parametrize("case", list(_plans()), ids=lambda c: c[0])
def test_row_totals_are_the_running_sums(case):
    """The packing's busiest-rank total (``_row_totals``): each rank's work on the blocks it computes,
    summed in block order, the bits of numpy's running sum both compiled and as Python."""
    _, plan, _ = case
    work = W.work_matrix(plan)
    does = plan.need_matrix().copy()
    does[np.arange(work.shape[1]) % work.shape[0], np.arange(work.shape[1])] = True  # some extra cells
    want = np.cumsum(np.where(does, work, 0.0), axis=1)[:, -1]
    for run in (W._row_totals, getattr(W._row_totals, "py_func", W._row_totals)):
        got = run(does, work)
        assert got.dtype == np.float64 and np.array_equal(got, want) and got.max() > 0


def test_no_jit_runs_the_same_waves_as_python():
    """MEGATRON_FCP_NO_JIT=1 runs the loops as Python (logged once) and gives the same waves."""
    code = ("import hashlib; from megatron_fcp import jit; from megatron_fcp.planner.build import build_plan; "
            "from megatron_fcp.schedule.waves import plan_waves; "
            "p = build_plan('pcie-box:2', range(16), 'hierarchical', parts_per_chunk=4); "
            "w = plan_waves(p, lambda b: p.block_tokens(b, 65536) * 4096); "
            "print(jit.COMPILED, hashlib.sha256(repr([(x.transfers, sorted(x.computes)) for x in w]).encode()).hexdigest())")
    out = {}
    for flag in ("1", "0"):
        env = dict(os.environ, MEGATRON_FCP_NO_JIT=flag)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        out[flag] = run.stdout.split()
        if flag == "1":
            assert "numba not available" in run.stderr and "MEGATRON_FCP_NO_JIT" in run.stderr
    assert out["1"][0] == "False" and out["0"][0] == str(J.COMPILED)
    assert out["1"][1] == out["0"][1]


@pytest.mark.skipif(not J.COMPILED, reason="numba not installed: only the Python run exists")
@pytest.mark.parametrize("nodes", (False, True), ids=("flat", "nodes"))
def test_layer_assign_compiled_equals_python(nodes):
    """The layer placement's greedy and search (``_assign_kernel``) give the same bins both ways."""
    from megatron_fcp.contract import layer_placement as LP
    from megatron_fcp.contract.placement import span_pairs

    lengths = lognormal_lengths(8.0, 1.2, 1 << 18, 5)
    items = LP._items(lengths, 16, 4096, LP.Mask(True, -1, -1))
    spans = {d: LP.Span(d, 0, n) for d, n in enumerate(lengths)}
    w = np.array([span_pairs(s, spans[s.doc], LP.Mask(True, -1, -1)) for s in items], dtype=np.float64)
    t = np.array([s.tokens for s in items], dtype=np.float64)
    n = 2 if nodes else 16
    W_, T_ = w.sum() / n, t.sum() / n
    order = np.array(sorted(range(len(items)), key=lambda k: (-max(w[k] / W_, t[k] / T_), items[k].doc,
                                                              items[k].start)), dtype=np.int64)
    doc = np.array([s.doc for s in items], dtype=np.int64)
    args = (order, w, t, doc, n, W_, T_, 1.0 + LP.LAYER_TOLERANCE, LP.LAYER_TARGET, 8, LP.HOLDER_SLACK)
    (fm, fs), (sm, ss) = LP._assign_kernel(*args), LP._assign_kernel.py_func(*args)
    assert np.array_equal(fs, ss) and all(np.array_equal(fm[r, :fs[r]], sm[r, :ss[r]]) for r in range(n))
    assert sorted(np.concatenate([fm[r, :fs[r]] for r in range(n)]).tolist()) == list(range(len(items)))
    loads = np.array([w[fm[r, :fs[r]]].sum() for r in range(n)])
    assert loads.max() / loads.mean() <= 1 + LP.LAYER_TOLERANCE     # balanced, as the placement promises


def test_tree_check_of_all_trees_names_the_first_fault():
    """The compiler's vectorised tree check (``_check_trees``) passes the trees it builds and, for a
    tree at fault, raises the message the per-tree check gives for the first such tree."""
    from megatron_fcp.contract.blocks import PlanError
    from megatron_fcp.planner import compile as C
    from megatron_fcp.planner.builders import get_builder
    from megatron_fcp.planner.tree_columns import Readers, from_trees
    from megatron_fcp.topology import load_topology

    topo = load_topology("dgx-h100:2")
    cg = get_builder("hierarchical").build(topo, list(range(16)))
    good = [(o, 0) + cg.tree_with_depths(o, [r for r in range(16) if r != o], 0) for o in range(16)]
    readers = [[r for r in range(16) if r != o] for o in range(16)]
    C._check_trees(cg, from_trees(good), Readers.from_lists(readers))                               # every builder tree is sound
    o, c, tree, depths = good[5]
    u, v = tree[-1]
    faults = {"twice": (tree + [(u, v)], "reaches"), "late parent": ([tree[-1]] + tree[:-1], "forwards from"),
              "missing": (tree[:-1], "misses reader"), "no edge": (tree[:-1] + [(o, v)] if not cg.has_edge(o, v)
                                                                    else None, "not an edge")}
    for name, (bad, words) in faults.items():
        if bad is None:
            continue
        trees = list(good)
        trees[5] = (o, c, bad, [1] * len(bad))     # the check reads edges, not depths
        with pytest.raises(PlanError, match=words) as got:
            C._check_trees(cg, from_trees(trees), Readers.from_lists(readers))
        with pytest.raises(PlanError) as alone:
            C._check_tree(cg, o, readers[5], bad)
        assert str(got.value) == str(alone.value), name


@pytest.mark.skipif(not J.COMPILED, reason="numba not installed: only the Python run exists")
@pytest.mark.parametrize("buffered", (False, True), ids=("nccl", "gloo"))
def test_wave_floor_compiled_equals_python(monkeypatch, buffered):
    """wave_timeline_floor with its chain loop (``_chain_floor``) compiled and as Python: the same
    floor, bit for bit, re-sending and keeping."""
    from megatron_fcp.cost import backward as BK
    from megatron_fcp.cost import timeline as TL
    from megatron_fcp.cost.model import AttentionShape

    shape = AttentionShape(1, 32, 8, 128, 2)
    for _, plan, _ in list(_plans())[:1]:
        for kv in ("resend", "keep"):
            fast = BK.wave_backward_floor(plan, "dgx-h100:2", shape, backward_kv=kv, buffered_sends=buffered)
            with monkeypatch.context() as m:
                m.setattr(TL, "_chain_floor", TL._chain_floor.py_func)
                slow = BK.wave_backward_floor(plan, "dgx-h100:2", shape, backward_kv=kv, buffered_sends=buffered)
            assert fast == slow and fast > 0


@pytest.mark.parametrize("mask", [(True, -1, -1), (False, -1, -1), (True, 7, 0), (False, 5, 3)],
                         ids=("causal", "full", "causal-window", "window"))
def test_pair_count_is_the_brute_force_count(mask):
    """The compiled closed form (``pair_count``, behind ``Mask.pairs`` and the placement's pair
    matrix) counts what ``Mask.visible`` sees, span pair by span pair; its Python run agrees."""
    from megatron_fcp.contract.mask import Mask, pair_count

    m = Mask(*mask)
    lo, hi = m.offsets
    rng = np.random.default_rng(0)
    for _ in range(200):
        q0, k0 = (int(x) for x in rng.integers(0, 40, 2))
        q1, k1 = q0 + int(rng.integers(0, 25)), k0 + int(rng.integers(0, 25))
        brute = int(m.visible(np.arange(q0, q1)[:, None], np.arange(k0, k1)[None, :]).sum())
        assert pair_count(q0, q1, k0, k1, lo, hi) == brute == int(m.pairs(q0, q1, k0, k1))
        if J.COMPILED:
            assert pair_count.py_func(q0, q1, k0, k1, lo, hi) == brute


def test_pair_matrix_sums_every_span_pair_of_a_document():
    """The placement's pair matrix (``_span_pair_matrix``) against a sum of ``Mask.pairs`` over
    every (rank, block) of a small layer placement, windowed and not."""
    from megatron_fcp.contract.layer_placement import place_packed_layer

    for window in (None, (300, 0)):
        pl = place_packed_layer(lognormal_lengths(7.0, 1.0, 8 * 2048, 4), 8, window=window)
        blocks = pl.block_list()
        want = np.zeros((pl.cp, len(blocks)), dtype=np.int64)
        for k, (_, _, ks) in enumerate(blocks):
            for j in range(pl.cp):
                want[j, k] = sum(int(pl.mask.pairs(s.start, s.end, ks.start, ks.end))
                                 for s in pl.blocks[j] if s.doc == ks.doc)
        assert np.array_equal(pl.pair_matrix(), want) and want.sum() > 0


@pytest.mark.skipif(not J.COMPILED, reason="numba not installed: only the Python run exists")
@pytest.mark.parametrize("case", list(_plans()), ids=lambda c: c[0])
def test_forward_compute_timeline_compiled_equals_python(case, monkeypatch):
    """simulate_plan's per-rank compute timeline (cost.model._compute_ends): the compiled and the
    Python run give the same ends, and the forward priced with either is the same to the bit."""
    from megatron_fcp.cost import model as M

    _, plan, seq = case
    shape = M.AttentionShape(seq or 1, 32, 8, 128)
    topo = "dgx-h100:4" if plan.cp == 8 else ("pcie-box:2" if seq == 65536 else "dgx-h100:2")
    res = M.simulate_plan(plan, topo, shape)
    with monkeypatch.context() as m:
        m.setattr(M, "_compute_ends", M._compute_ends.py_func)
        loop = M.simulate_plan(plan, topo, shape)
    assert (loop.total_s, loop.compute_s, loop.comm_s) == (res.total_s, res.compute_s, res.comm_s)
    rng = np.random.default_rng(0)
    for n_ranks, per in ((plan.cp, 40), (3, 1000)):
        counts = rng.integers(0, per, n_ranks)
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        arrival = rng.random(int(bounds[-1])) * 1e-3
        work = rng.random(int(bounds[-1])) * 1e-4
        start = rng.random(n_ranks) * 1e-3
        fast, slow = start.copy(), start.copy()
        M._compute_ends(fast, bounds, arrival, work)
        M._compute_ends.py_func(slow, bounds, arrival, work)
        assert np.array_equal(fast, slow) and (fast >= start).all()
    assert res.total_s >= res.compute_s > 0


def test_unique_ints_is_numpys_unique():
    """``unique_ints``: numpy's sorted keys, first indices and inverse, over its table (compiled and
    as Python) and over numpy's sort where the span is large; keys outside the span are refused."""
    rng = np.random.default_rng(4)
    for n, span in ((0, 10), (1, 1), (500, 64), (5000, 4096), (300, 1 << 20), (300, 1 << 24)):
        keys = rng.integers(0, span, n)
        want = np.unique(keys, return_index=True, return_inverse=True)
        runs = [J.unique_ints(keys, span)]
        if span <= 16 * n + (1 << 20):
            runs.append(getattr(J._unique_table, "py_func", J._unique_table)(keys.astype(np.int64), span))
        for got in runs:
            assert all(np.array_equal(g, w.reshape(-1)) and g.dtype == np.int64 for g, w in zip(got, want))
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        J.unique_ints(np.array([1, 8]), 8)


def test_isin_ints_is_numpys_isin():
    rng = np.random.default_rng(5)
    for n, m, span in ((0, 3, 10), (7, 0, 10), (400, 300, 500), (1000, 10, 1 << 30)):
        keys, values = rng.integers(0, span, n), rng.integers(0, span, m)
        assert np.array_equal(J.isin_ints(keys, values, span), np.isin(keys, values))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        J.isin_ints(np.array([0, 1]), np.array([5]), 5)


@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_need_table_is_the_dense_rule(causal):
    """A placement's need matrix (``_need_table``) is the rule written over dense tables: rank j
    needs block b when it does not own it and its last query of b's document is at or after b's
    start (any query, unmasked), compiled and as Python."""
    from megatron_fcp.contract import placement as P

    pl = place_packed(lognormal_lengths(7.0, 1.2, 16 * 4096, 2), 16, block_tokens=1024, causal=causal)
    docs, starts, ends = pl.block_spans()
    owners = pl.block_owners()
    last_q = np.full((pl.cp, len(pl.doc_lengths)), -1, dtype=np.int64)
    np.maximum.at(last_q, (owners, docs), ends - 1)
    held = last_q[:, docs]
    want = (held >= (starts[None, :] if causal else 0)) & (owners[None, :] != np.arange(pl.cp)[:, None])
    for run in (P._need_table, getattr(P._need_table, "py_func", P._need_table)):
        assert np.array_equal(run(last_q, docs, starts, owners, causal), want)
    assert np.array_equal(pl.need_matrix(), want) and want.any() and not want.all()


def test_farthest_ring_reader_is_the_dense_rule():
    """The ring builder's farthest reader per block (``_farthest_reader``): the largest ``(j - owner)
    mod cp`` over the block's readers, compiled and as Python, as the dense tables give it."""
    from megatron_fcp.planner import builders as B

    rng = np.random.default_rng(6)
    cp, n = 12, 200
    need, owner = rng.random((cp, n)) < 0.2, rng.integers(0, cp, n)
    want = np.where(need, (np.arange(cp)[:, None] - owner[None, :]) % cp, 0).max(axis=0, initial=0)
    for run in (B._farthest_reader, getattr(B._farthest_reader, "py_func", B._farthest_reader)):
        assert np.array_equal(run(need, owner, cp), want)
