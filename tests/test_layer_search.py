"""The layer placement's search (Note [Swaps by weight] in
:mod:`megatron_fcp.contract.layer_placement`): trying each swap only over the other bin's items
whose pairs can still matter gives the bins the full double loop over every swap gives, on random
items and on real packed batches placed over nodes."""

import numpy as np
import pytest

from megatron_fcp import jit as J
from megatron_fcp.contract import layer_placement as LP

numba = pytest.importorskip("numba")
pytestmark = pytest.mark.skipif(not J.COMPILED, reason="numba not installed: the reference is compiled")


@numba.njit(nogil=True)
def _full_loop_assign(order, w, t, doc, n, W, T, cap, target, candidates, holder_slack):
    """The search before Note [Swaps by weight]: every swap with every candidate bin."""
    m = order.shape[0]
    n_docs = doc.max() + 1 if m else 1
    held = np.zeros((n_docs, n), dtype=np.int64)     # [documents, bins]: items of the document in the bin
    members = np.empty((n, max(m, 1)), dtype=np.int64)
    sizes = np.zeros(n, dtype=np.int64)
    lw = np.zeros(n)
    lt = np.zeros(n)
    room = np.empty(n)
    fits = np.empty(n, dtype=np.bool_)
    for k in order:                                 # step 2
        d = doc[k]
        vw = w[k] / W
        vt = t[k] / T
        for r in range(n):
            fits[r] = ((lw[r] + w[k]) / W <= cap) and ((lt[r] + t[k]) / T <= cap)
            room[r] = vw * (1.0 - lw[r] / W) + vt * (1.0 - lt[r] / T)   # the item against each bin's deficit
            if not fits[r]:
                room[r] = room[r] - 1e9
        best = int(np.argmax(room))
        slack = holder_slack * (vw * vw + vt * vt)
        pick = -1
        for h in range(n):                          # a bin holding the document, if near enough
            if held[d, h] > 0 and fits[h] and room[h] >= room[best] - slack:
                if pick < 0 or room[h] > room[pick]:
                    pick = h
        r = best if pick < 0 else pick
        lw[r] += w[k]
        lt[r] += t[k]
        members[r, sizes[r]] = k
        sizes[r] += 1
        held[d, r] += 1
    for _ in range(8 * n + 64):                     # step 3
        score = np.maximum(lw / W, lt / T)
        a = int(np.argmax(score))
        if score[a] <= 1.0 + target or sizes[a] == 0 or n == 1:
            break
        rank = np.argsort(score, kind="mergesort")
        na = sizes[a]
        best_v = np.inf
        best_away = True
        best_kind = -1                              # 0: move, 1: swap
        best_i = best_b = best_j = -1
        seen = 0
        for q in range(n):
            b = rank[q]
            if b == a:
                continue
            if seen == candidates:
                break
            seen += 1
            # move item i of a to b
            mi = -1
            mv = np.inf
            m_away = True
            for i in range(na):
                k = members[a, i]
                v = max(max((lw[a] - w[k]) / W, (lt[a] - t[k]) / T), max((lw[b] + w[k]) / W, (lt[b] + t[k]) / T))
                away = held[doc[k], b] == 0
                if mi < 0 or v < mv or (v == mv and (not away) and m_away):
                    mi, mv, m_away = i, v, away
            if best_kind < 0 or mv < best_v or (mv == best_v and (not m_away) and best_away):
                best_v, best_away, best_kind, best_i, best_b, best_j = mv, m_away, 0, mi, b, -1
            if sizes[b] == 0:
                continue
            si = sj = 0                             # swap item i of a with item j of b
            sv = np.inf
            for i in range(na):
                ka = members[a, i]
                for j in range(sizes[b]):
                    kb = members[b, j]
                    dw = w[ka] - w[kb]
                    dt = t[ka] - t[kb]
                    if dw <= 0 and dt <= 0:
                        continue
                    v = max(max((lw[a] - dw) / W, (lt[a] - dt) / T), max((lw[b] + dw) / W, (lt[b] + dt) / T))
                    if v < sv:
                        si, sj, sv = i, j, v
            s_away = held[doc[members[a, si]], b] == 0
            if sv < best_v or (sv == best_v and (not s_away) and best_away):
                best_v, best_away, best_kind, best_i, best_b, best_j = sv, s_away, 1, si, b, sj
        if best_v >= score[a] - 1e-12:
            break
        b = best_b
        k = members[a, best_i]
        kb = members[b, best_j] if best_kind == 1 else -1
        LP._take(members, sizes, held, doc, lw, lt, w, t, a, best_i)      # a's item to the end of b
        LP._put(members, sizes, held, doc, lw, lt, w, t, b, k)
        if best_kind == 1:                                              # b's item to the end of a
            LP._take(members, sizes, held, doc, lw, lt, w, t, b, best_j)
            LP._put(members, sizes, held, doc, lw, lt, w, t, a, kb)
    return members, sizes




def _same(args, kernel=None) -> bool:
    (m1, s1), (m2, s2) = (kernel or LP._assign_kernel)(*args), _full_loop_assign(*args)
    return np.array_equal(s1, s2) and all(np.array_equal(m1[r, :s1[r]], m2[r, :s2[r]]) for r in range(len(s1)))


def test_search_by_weight_is_the_full_loop_on_random_items():
    rng = np.random.default_rng(0)
    for k in range(200):
        m, n = int(rng.integers(1, 300)), int(rng.integers(1, 40))
        # heavy-tailed pairs, or small integers full of ties
        w = np.round(rng.lognormal(10, 2, m)) if k % 3 else rng.integers(1, 50, m).astype(np.float64)
        t = np.round(rng.lognormal(7, 1, m)) if k % 2 else rng.integers(1, 50, m).astype(np.float64)
        doc = rng.integers(0, max(1, m // 3), m).astype(np.int64)
        W, T = w.sum() / n, t.sum() / n
        order = np.lexsort((np.arange(m), doc, -np.maximum(w / W, t / T))).astype(np.int64)
        target = float(rng.choice([0.0005, 0.0, 0.01]))     # 0: the search runs to its step cap
        assert _same((order, w, t, doc, n, float(W), float(T), 1.03, target, 8, LP.HOLDER_SLACK)), k


@pytest.mark.parametrize("cp,docs", [(64, 512), (256, 512)])
def test_search_by_weight_places_real_batches_as_the_full_loop(cp, docs, monkeypatch):
    """Every call of a packed batch's node-then-rank placement (33 searches at cp = 256) agrees."""
    from megatron_fcp.planner.placing import place_batch
    from megatron_fcp.topology import load_topology

    lengths = np.maximum(1, np.random.default_rng(1).lognormal(8.0, 1.2, docs).astype(int)).tolist()
    topo = load_topology(f"dgx-h100:{cp // 8}")
    calls = []
    real = LP._assign_kernel

    def both(*args):
        calls.append(_same(args, real))
        return real(*args)

    monkeypatch.setattr(LP, "_assign_kernel", both)
    place_batch(topo, range(cp), lengths)
    assert calls and all(calls) and len(calls) == (1 + cp // 8 if cp > 8 else 1)
