"""The streaming chain backward (Note [Streaming chain backward] in schedule/chains.py): a ring's
blocks travel chains, and its backward streams KV and the accumulated dK/dV partials one hop per
step as Transformer Engine's ring does, instead of re-sending and reducing wave by wave.

Checked: which plans are chains; the steps keep every hop's order (a partial is sent only after
its sender computed it and received the one before; a chain's sum goes home after its last
reader); the executor matches the FP64 reference for out, lse, dq, dk, dv (zigzag and packed,
causal or not, uneven parts), keep and resend agree bit for bit, the bytes are the schedule's and
the held KV is two steps' blocks; the cost model prices the ring as TE's ring.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from megatron_fcp.testing.harness import QUANTITIES, harness_attention
from megatron_fcp.attention.kernels import reference_attention
from megatron_fcp.contract.plan import full_plan, ring_plan
from megatron_fcp.cost.model import AttentionShape
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.compile import compile_plan
from megatron_fcp.schedule.chains import chain_budget, chain_routes, chain_steps, first_received


def _placement_ring(cp: int = 4, causal: bool = True):
    from megatron_fcp.contract.placement import place_packed
    from megatron_fcp.planner.builders import build_graph
    from megatron_fcp.topology import load_topology

    pl = place_packed([5, 40, 3, 17, 1, 30], cp, block_tokens=8, causal=causal)
    graph = build_graph(load_topology("pcie-box:1"), list(range(cp)), "ring")
    return compile_plan(graph, causal=causal, placement=pl), pl


def test_ring_blocks_travel_chains_and_trees_do_not():
    assert chain_routes(ring_plan(range(8), causal=True)) is not None
    assert chain_routes(ring_plan(range(5), causal=False, parts_per_chunk=3)) is not None
    assert chain_routes(_placement_ring()[0]) is not None
    assert chain_routes(full_plan(range(4), causal=True)) is None                  # the owner sends to several
    assert chain_routes(build_plan("dgx-h100:2", range(16), "hierarchical")) is None  # relays fan out
    assert chain_steps(ring_plan((0,), causal=True), lambda b: 1) is None          # nothing travels


def test_only_balanced_chains_stream():
    """A zigzag ring keeps every rank in step (pace 1.0: each step one owner's two chunks); a packed
    batch's ring does not (big blocks reach ranks at different steps: pace 4.1), so it runs in
    waves -- the cost model priced its streaming backward at 2.2x the waves' (cp = 16, lognormal
    8.0/1.2)."""
    from megatron_fcp.contract.placement import lognormal_lengths, place_packed
    from megatron_fcp.schedule.chains import CHAIN_PACE, _basis, _build
    from megatron_fcp.cost.backward import simulate_backward_waves

    for cp, parts in ((4, 1), (8, 2), (16, 1)):
        assert chain_steps(ring_plan(range(cp), True, parts), lambda b: 100) is not None
    shape = AttentionShape(1, 64, 8, 128, 2)
    pl = place_packed(lognormal_lengths(8.0, 1.2, 32768 * 16, 0), 16)
    plan = build_plan("dgx-h100:2", range(16), "ring", placement=pl)
    assert chain_routes(plan) is not None and chain_steps(plan, _size(plan)) is None
    assert _build(plan, _basis(plan, _size(plan), None), math.inf) is not None      # a chain, but unbalanced
    assert 1.25 < CHAIN_PACE < 4  # staggered stage rings stream, packed rings (4-14) do not
    waves = simulate_backward_waves(plan, "dgx-h100:2", shape, backward_kv="resend")
    assert waves.get("backward", "waves") == "waves"


def _plans():
    yield "ring8", ring_plan(range(8), causal=True)
    yield "ring5-noncausal-3parts", ring_plan(range(5), causal=False, parts_per_chunk=3)
    yield "ring4-2parts", ring_plan(range(4), causal=True, parts_per_chunk=2)
    yield "packed-ring", _placement_ring()[0]
    yield "stage-ring-staggered", compile_plan(build_graph_2x4(), causal=True, stagger_blocks=2,
                                               placement=_placement_ring(8)[1])


def _size(plan):
    """Bytes of a block: its tokens (a placement's blocks differ), 100 per zigzag part."""
    if plan.placement is None:
        return lambda b: 100
    tokens = {(plan.ranks[i], b): sp.tokens for i, b, sp in plan.placement.block_list()}
    return lambda blk: 7 * tokens[(blk.owner, blk.chunk)]


def build_graph_2x4():
    from megatron_fcp.planner.builders import build_graph

    from megatron_fcp.topology import load_topology

    return build_graph(load_topology("dgx-h100:2"), [0, 1, 2, 3, 8, 9, 10, 11], "ring")


@pytest.mark.parametrize("first_kept", [False, True], ids=["resend-all", "first-kept"])
@pytest.mark.parametrize("name, plan", list(_plans()), ids=lambda x: x if isinstance(x, str) else "")
def test_steps_keep_every_hop_in_order(name, plan, first_kept):
    size = _size(plan)
    steps = chain_steps(plan, size, pace=math.inf, first_kept=first_kept)   # the order of hops, balanced or not
    assert steps is not None, name
    first = {(b, x) for x, blocks in first_received(plan, size).items() for b in blocks}
    at: dict = {}                                   # (kind, block, rank or hop) -> step
    for s, st in enumerate(steps):
        for t in st.kv:
            at[("kv", t.block, t.dst)] = s
        for b, x in st.computes:
            assert ("c", b, x) not in at, (name, b, x)
            at[("c", b, x)] = s
        for t in st.grad:
            at[("g", t.block, t.dst)] = s
        for t in st.home:
            at[("h", t.block)] = s
    # every need computed once, after its KV arrived; every own block once, by its owner
    want = {(b, x) for x in plan.ranks for b in plan.needs(x)} | {(b, b.owner) for b in plan.blocks()}
    assert {(b, x) for (k, b, x) in (key for key in at if key[0] == "c")} == want, name
    for b, hops in chain_routes(plan).items():
        chain = [b.owner] + [t.dst for _, t in hops]
        last = max((i for i, x in enumerate(chain) if i and b in plan.needs(x)), default=0)
        assert not any(("kv", b, x) in at for x in chain[last + 1:]), (name, b)  # nothing past the last reader
        kv = [at.get(("kv", b, x), -1) for x in chain[1:last + 1]]          # -1: kept from the forward
        assert kv == sorted(set(kv)), (name, b)                             # one hop per step, in order
        assert all((k < 0) == (first_kept and (b, x) in first) for k, x in zip(kv, chain[1:])), (name, b)
        read = [x for x in chain[1:] if b in plan.needs(x)]     # (a plan may carry a block nobody reads)
        for i, x in enumerate(chain[1:], start=1):
            if b in plan.needs(x):
                assert at[("c", b, x)] == at.get(("kv", b, x), -1) + 1
            if i + 1 < len(chain) and any(b in plan.needs(y) for y in chain[1:i + 1]):
                sent = at[("g", b, chain[i + 1])]                           # acc_i: v_i -> v_(i+1)
                assert sent > at.get(("c", b, x), -1) and sent > at.get(("g", b, x), -1), (name, b, i)
        last = chain[-1]
        assert (("h", b) in at) == bool(read), (name, b)
        if read:
            assert at[("h", b)] > max(at.get(("c", b, last), -1), at.get(("g", b, last), -1)), (name, b)
    # a step brings a rank at most the chain budget (a larger block alone)
    budget = chain_budget(plan, size)
    for st in steps:
        got: dict = {}
        for t in st.kv:
            got.setdefault(t.dst, []).append(size(t.block))
        assert all(sum(v) <= budget or len(v) == 1 for v in got.values()), name


def test_own_blocks_fill_the_steps_alike_in_every_mode():
    """Note [Streaming chain backward], "Own blocks": a zigzag ring computes its own chunks at the last
    step (every step's work is alike); a head-parallel stage ring staggered over 8 rounds (2 x 4
    ranks, a = 4) spreads them over the steps after the first sub-round's compute, so no step holds
    more work than the busiest remote step plus one own block. Both backward KV modes place every
    job alike (a re-sending chain has one KV-only step more in front): the same jobs in the same
    order, which is what makes them agree bit for bit."""
    from megatron_fcp.planner.head_parallel import compile_head_parallel
    from megatron_fcp.contract.head_parallel import stage_plan
    from megatron_fcp.schedule.waves import block_work

    ring = ring_plan(range(8), causal=True)
    steps = chain_steps(ring, lambda b: 100, first_kept=True)
    for x in ring.ranks:
        own = [s for s, st in enumerate(steps) for b, y in st.computes if y == x and b.owner == x]
        assert own == [len(steps) - 1] * 2, (x, own)

    shape = AttentionShape(4096, 4, 4, 64, 2)
    hp = compile_head_parallel("dgx-h100:2", [0, 1, 2, 3, 8, 9, 10, 11], shape, 4, "ring", causal=True, stagger=8)
    plan = stage_plan(hp, shape.seq_len, True)
    kept = chain_steps(plan, lambda b: 100, first_kept=True)
    resend = chain_steps(plan, lambda b: 100, first_kept=False)
    assert kept is not None and resend is not None
    assert not resend[0].computes and [st.computes for st in resend[1:]] == [st.computes for st in kept]
    work = block_work(plan)
    for x in plan.ranks:
        per_step = [[(b, work(x, b)) for b, y in st.computes if y == x] for st in kept]
        own = [s for s, jobs in enumerate(per_step) for b, _ in jobs if b.owner == x]
        assert len(own) == len(plan.local_blocks(x)) and min(own) >= 1 and len(set(own)) > 1, (x, own)
        remote = max(sum(w for b, w in jobs if b.owner != x) for jobs in per_step)
        biggest = max(work(x, b) for b in plan.local_blocks(x))
        assert max(sum(w for _, w in jobs) for jobs in per_step) <= remote + biggest, (x, per_step)


def _inputs(name: str, s: int, heads: int, kv_heads: int, b: int = 2, d: int = 8, packed: bool = False):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if packed:
        return tuple(torch.randn(s, h, d, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads, heads))
    return tuple(torch.randn(s, b, h, d, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads, heads))


CASES = [  # name, cp, parts, causal, heads
    ("ring8-gqa", 8, 1, True, (4, 2)),
    ("ring8-2parts", 8, 2, True, (2, 1)),
    ("ring5-noncausal-uneven", 5, 3, False, (4, 4)),      # 7-token chunks: parts of 2, 2 and 3 tokens
]


@pytest.mark.parametrize("name, cp, parts, causal, heads", CASES)
def test_streaming_ring_matches_fp64_reference_and_every_mode_agrees(name, cp, parts, causal, heads):
    """keep (the need set saved), resend (nothing saved: every step re-sent) and auto (resend with
    the first sub-round kept, one shard: what TE's ring saves, Note [Streaming chain backward])
    walk the same jobs in the same order: each matches the FP64 reference and all three agree bit
    for bit. Bytes and memory as the schedule says."""
    q, k, v, do = _inputs(name, 2 * cp * 7, *heads)
    scale = 1.0 / math.sqrt(q.shape[-1])
    ref = reference_attention(q, k, v, causal=causal, scale=scale, dout=do)
    plan = ring_plan(range(cp), causal, parts)
    runs = {}
    for mode in ("keep", "resend", "auto"):
        res = harness_attention(q, k, v, do, cp=cp, plan=plan, causal=causal, softmax_scale=scale,
                                backward_kv=mode, stats=True)
        for n in QUANTITIES:
            err = (res.gathered(n) - ref[n]).abs().max().item()
            assert err <= 1e-12 * max(1.0, ref[n].abs().max().item()), f"{mode} {n}: error {err:.3g}"
        runs[mode] = res
    for other in ("resend", "auto"):
        for a, b in zip(runs["keep"].ranks, runs[other].ranks):
            for n in QUANTITIES:
                assert torch.equal(getattr(a, n), getattr(b, n)), (other, a.index, n)
    first = first_received(plan, lambda blk: 1)
    for r in runs["resend"].ranks:
        st = r.stats
        # re-sent KV: the forward's transfers once more, but none past a block's last reader (the
        # ring plan carries a few on); held: at most two steps' blocks
        assert r.kept_bytes == 0 and 0 < st.resend_bytes_sent <= st.forward_bytes_sent
        assert 0 < st.backward_peak_kv_bytes <= 2 * st.ring_kv_bytes
        assert st.backward_waves == len(chain_steps(plan, lambda blk: 1))
    for r, a in zip(runs["resend"].ranks, runs["auto"].ranks):
        st = a.stats
        kept = first.get(plan.ranks[a.index], ())
        assert a.backward_kv == "resend" and a.kept_bytes == st.saved_kv_bytes <= st.ring_kv_bytes  # one shard
        assert (a.kept_bytes > 0) == bool(kept)
        assert st.backward_peak_kv_bytes <= 3 * st.ring_kv_bytes             # saved + two steps, as TE's
        assert st.backward_waves == len(chain_steps(plan, lambda blk: 1, first_kept=True)) == \
            r.stats.backward_waves - 1
    # what auto keeps is exactly what it does not re-send: the first sub-round's transfers
    assert sum(a.stats.resend_bytes_sent for a in runs["auto"].ranks) == \
        sum(r.stats.resend_bytes_sent for r in runs["resend"].ranks) - sum(a.kept_bytes for a in runs["auto"].ranks)
    for r in runs["keep"].ranks:
        assert r.stats.resend_bytes_sent == 0


@pytest.mark.parametrize("docs, block_tokens, causal", [([64, 64], 8, True), ([60, 4], 4, False)])
def test_streaming_ring_over_a_packed_batch_matches_the_reference(docs, block_tokens, causal):
    """THD placements whose ring streams (balanced: documents split evenly, or no causal mask):
    per-document FP64 reference for out, lse, dq, dk, dv; keep and resend bit for bit."""
    from megatron_fcp.contract.placement import place_packed
    from megatron_fcp.planner.builders import build_graph
    from megatron_fcp.topology import load_topology

    pl = place_packed(docs, 4, block_tokens=block_tokens, causal=causal)
    plan = compile_plan(build_graph(load_topology("pcie-box:1"), [0, 1, 2, 3], "ring"), causal=causal, placement=pl)
    assert chain_steps(plan, _size(plan)) is not None
    q, k, v, do = _inputs(f"packed{docs}", pl.total_tokens, 4, 2, packed=True)
    scale = 1.0 / math.sqrt(q.shape[-1])
    outs = []
    for mode in ("keep", "resend"):
        res = harness_attention(q, k, v, do, cp=4, plan=plan, placement=pl, causal=causal, softmax_scale=scale,
                                backward_kv=mode, stats=True)
        steps = chain_steps(plan, _size(plan), first_kept=mode == "keep")
        assert all(r.stats.backward_waves == len(steps) for r in res.ranks)
        outs.append(res)
        start = 0
        for n_tok in pl.doc_lengths:
            sl = slice(start, start + n_tok)
            ref = reference_attention(*(x[sl].unsqueeze(1) for x in (q, k, v)), causal=causal, scale=scale,
                                      dout=do[sl].unsqueeze(1))
            for n in QUANTITIES:
                got = res.gathered(n)
                got = got[..., sl] if n == "lse" else got[sl]
                want = ref[n].squeeze(1) if n != "lse" else ref[n].squeeze(0)
                err = (got.double() - want.reshape(got.shape)).abs().max().item()
                assert err <= 1e-12 * max(1.0, want.abs().max().item()), (mode, n, err)
            start += n_tok
    for a, b in zip(*(o.ranks for o in outs)):
        for n in QUANTITIES:
            assert torch.equal(getattr(a, n), getattr(b, n)), n


@pytest.mark.parametrize("seq", [32 * 1024, 128 * 1024])
def test_streaming_ring_prices_as_transformer_engines_ring(seq):
    """The same ring, the same model: FCP's ring (a = 1) under ``auto`` prices as TE's p2p backward
    (first sub-round kept as TE keeps its last shard, own blocks last, one kernel launch per owner
    and step), where the wave backward priced the ring 2.6x TE's at 128K (0.289 s vs 0.110 s); with
    a = 8 per node on two nodes the KV stage's ring prices as TE's a2a+p2p. Explicit ``resend``
    (nothing saved) pays one step more, within 3% (2.4% at 128K)."""
    from megatron_fcp.planner.choose import build_head_parallel_plan
    from megatron_fcp.cost.head_parallel import simulate_head_parallel, simulate_te
    from megatron_fcp.schedule.program import WaveBackward

    shape = AttentionShape(seq, 32, 8, 128, 2)
    for topo, ranks, degree, te in (("pcie-box:1", list(range(8)), 1, "te-p2p"),
                                    ("dgx-h100:2", list(range(16)), 8, "te-a2a-p2p")):
        hp = build_head_parallel_plan(topo, ranks, shape, degree=degree, graph="ring", parts_per_chunk=1)
        base = simulate_te(te, topo, ranks, shape, pass_="bwd")
        fcp = simulate_head_parallel(hp, topo, shape, pass_="bwd", backward=WaveBackward())
        assert fcp.meta["backward_form"] == "chain"
        assert fcp.meta["backward_kv"] == ("resend" if degree == 1 else "keep")  # a two-group stage keeps
        # the same schedule, or faster where the ring prunes relays past a block's last reader
        assert fcp.total_s <= 1.001 * base.total_s, (topo, seq, fcp.total_s, base.total_s)
        assert fcp.total_s >= 0.999 * base.compute_s
        if degree == 1:
            bare = simulate_head_parallel(hp, topo, shape, pass_="bwd", backward=WaveBackward("resend"))
            assert fcp.total_s < bare.total_s <= 1.03 * base.total_s
