"""Backward KV modes: ``resend`` and ``keep`` give bitwise identical results, and ``resend``
holds no received KV between forward and backward.

Per case the same inputs run through ``keep``, ``resend`` and ``auto``; out, lse, dq, dk, dv must
match bit for bit. Plans: the ring (multi-hop chains), the hierarchical graph on 2 x 2 ranks
(relays across nodes) with sub-blocks, the direct ``full`` schedule, and a packed batch (THD
placement); FP64, FP32, BF16. Every case runs in the in-process harness (held KV: what the
executor's forward keeps for backward); two also run on a 4-process gloo group through autograd,
where the held KV is measured on the autograd graph itself.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _backward_kv_cases import _DTYPES, CASES, GLOO_CASES, MODES, case_setup  # noqa: E402

_DIST = [pytest.mark.dist, pytest.mark.slow]


def _harness(name: str, dt: str) -> list[dict]:
    """Per rank, per mode: the same report as the gloo worker's, from the in-process harness."""
    from megatron_fcp.testing.harness import harness_attention

    full, placement, plan = case_setup(name, dt)
    per_rank = [{} for _ in range(4)]
    for mode in MODES:
        res = harness_attention(*(x.to(_DTYPES[dt]) for x in full), cp=4, plan=plan, causal=True,
                                placement=placement, backward_kv=mode, stats=True)
        for r in res.ranks:
            per_rank[r.index][mode] = {**r.tensors(), "held": r.kept_bytes, "stats": r.stats.as_dict(),
                                       "local_kv": 2 * r.dk.numel() * r.dk.element_size()}
    return per_rank


@pytest.fixture(scope="module")
def gloo(gloo_attention_world):
    """The gloo cases' per-rank reports, from the shared gloo world (tests/_gloo_world.py)."""
    return [r["backward_kv"] for r in gloo_attention_world]


@pytest.fixture(scope="module")
def harness():
    return {f"{n}-{d}": _harness(n, d) for n, d in CASES}


def _per_rank(request, source: str, case: str) -> list[dict]:
    if source == "harness":
        return request.getfixturevalue("harness")[case]
    return [r[case] for r in request.getfixturevalue("gloo")]


_MATRIX = [pytest.param("harness", f"{n}-{d}", id=f"harness-{n}-{d}") for n, d in CASES] + \
    [pytest.param("gloo", f"{n}-{d}", id=f"gloo-{n}-{d}", marks=_DIST) for n, d in GLOO_CASES]


@pytest.mark.parametrize("source, case", _MATRIX)
def test_resend_is_bitwise_keep(request, source, case):
    for rank, r in enumerate(_per_rank(request, source, case)):
        keep, resend = r["keep"], r["resend"]
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert keep[name].dtype == resend[name].dtype
            assert torch.equal(keep[name], resend[name]), f"rank {rank} {case} {name}"


@pytest.mark.parametrize("source, case", _MATRIX)
def test_resend_holds_no_received_kv_between_passes(request, source, case):
    results = _per_rank(request, source, case)
    for r in results:
        keep, resend = r["keep"], r["resend"]
        assert resend["held"] == 0 and resend["stats"]["saved_kv_bytes"] == 0
        assert resend["stats"]["backward_kv"] == "resend"
        assert keep["held"] == keep["stats"]["saved_kv_bytes"]  # the stats report what the graph holds
        assert keep["stats"]["resend_bytes_sent"] == 0
    # what it costs: about the forward's KV traffic once more in backward (waves skip transfers nobody
    # computes on and send a block again along a path when its readers are split over waves)
    fwd = sum(r["resend"]["stats"]["forward_bytes_sent"] for r in results)
    assert 0.5 * fwd <= sum(r["resend"]["stats"]["resend_bytes_sent"] for r in results) <= 1.5 * fwd
    # at cp = 4 the need sets exceed one shard on some rank: auto (ring budget) re-sends
    assert any(r["keep"]["held"] > r["keep"]["local_kv"] for r in results)
    assert all(r["auto"]["stats"]["backward_kv"] == "resend" for r in results)


@pytest.mark.parametrize("source", ["harness", pytest.param("gloo", marks=_DIST)])
def test_auto_keeps_part_of_the_first_wave_through_autograd(request, source):
    """packed-partial: under auto the ranks whose part of the first wave fits their own shard keep
    it (through autograd on the gloo group: what the graph holds), the others keep nothing and get
    theirs again; auto is bitwise keep and resend, and re-sends less than resend."""
    results = _per_rank(request, source, "packed-partial-fp64")
    held = [r["auto"]["held"] for r in results]
    local = [r["auto"]["local_kv"] for r in results]
    assert all(h == 0 or 0 < h <= k for h, k in zip(held, local)), (held, local)
    assert held[0] == 0 and held[3] > 0, held      # some keep their part, the others get it again
    for rank, r in enumerate(results):
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert torch.equal(r["auto"][name], r["keep"][name]), (rank, name)
    sent = {m: sum(r[m]["stats"]["resend_bytes_sent"] for r in results) for m in ("auto", "resend")}
    assert 0 < sent["auto"] < sent["resend"], sent
    if source == "gloo":  # real processes give bitwise the harness's results (the harness runs this plan
        # against the FP64 reference in test_auto_keeps_the_first_wave_rank_by_rank)
        for r, h in zip(results, _per_rank(request, "harness", "packed-partial-fp64")):
            assert all(torch.equal(r["auto"][n], h["auto"][n]) for n in ("out", "lse", "dq", "dk", "dv"))


@pytest.mark.parametrize("name", ("ring", "hier", "packed"))
def test_backward_partials_travel_in_the_input_dtype(harness, name):
    """dK/dV partials are summed in FP32 but sent in the input dtype (Note [Backward pipeline]), as
    TE's ring sends dKV: for the same plan and shapes BF16's backward sends exactly half FP32's
    bytes, FP64's twice, rank by rank and mode by mode (the forward's KV scales the same way)."""
    by_dt = {dt: harness[f"{name}-{dt}"] for dt in ("fp64", "fp32", "bf16") if f"{name}-{dt}" in harness}
    assert "bf16" in by_dt and "fp32" in by_dt
    for mode in MODES:
        sent = {dt: [r[mode]["stats"]["backward_bytes_sent"] for r in rs] for dt, rs in by_dt.items()}
        fwd = {dt: [r[mode]["stats"]["forward_bytes_sent"] for r in rs] for dt, rs in by_dt.items()}
        assert sum(sent["fp32"]) > 0
        assert [2 * x for x in sent["bf16"]] == sent["fp32"], (mode, sent)
        assert [2 * x for x in fwd["bf16"]] == fwd["fp32"], (mode, fwd)
        if "fp64" in sent:
            assert sent["fp64"] == [2 * x for x in sent["fp32"]], (mode, sent)


def test_choose_backward_kv_is_uniform_and_budgeted():
    from megatron_fcp.schedule.waves import choose_backward_kv, kept_bytes_per_rank
    from megatron_fcp.contract.plan import ring_plan

    plan = ring_plan((0, 1), causal=True)
    size = lambda b: 100  # noqa: E731
    assert kept_bytes_per_rank(plan, size) == {0: 200, 1: 100}  # causal: rank 0 needs both chunks of rank 1
    assert choose_backward_kv("auto", plan, size) == "keep"      # 200 <= its own 2 x 100: the ring's
    assert choose_backward_kv("auto", plan, size, budget=150) == "resend"  # rank 0 does not fit
    assert choose_backward_kv("auto", ring_plan((0, 1, 2, 3)), size) == "resend"
    assert choose_backward_kv("keep", ring_plan((0, 1, 2, 3)), size) == "keep"
    with pytest.raises(ValueError, match="--fcp-backward-kv"):
        choose_backward_kv("lazy", plan, size)
    with pytest.raises(ValueError, match="--fcp-kv-memory-budget"):
        choose_backward_kv("auto", plan, size, budget=-5)


@pytest.mark.parametrize("case", [f"{n}-{d}" for n, d in CASES])
def test_resend_backward_holds_at_most_the_ring(harness, case):
    """Within backward, resend holds at most two waves of received KV, a shard each: no more than
    the two shard-sized KV buffers Transformer Engine's ring backward allocates (a packed batch's
    shards differ: the largest shard's, Note [Backward waves]). A ring streams instead (Note
    [Streaming chain backward]): two steps' blocks, computing and arriving, counted from the
    receive buffers' allocation -- the same two buffers."""
    results = harness[case]
    ring = [r["resend"]["stats"]["ring_kv_bytes"] for r in results]
    bound = ring if not case.startswith("packed") else [max(ring)] * len(ring)
    forms = {r[m]["stats"]["backward_form"] for r in results for m in ("keep", "resend")}
    assert len(forms) == 1, forms                     # every rank and mode walks the same form
    chain = forms == {"chain"}
    # the packed batch's hierarchical plan travels in chains, balanced once its own blocks fill the
    # steps (Note [Streaming chain backward], "Own blocks"); packed-partial's plan does not stream
    assert chain == (case.startswith("ring") or case in ("packed-fp32", "packed-bf16")), forms
    bound = [2 * x for x in bound]
    for rank, r in enumerate(results):
        resend, keep = r["resend"]["stats"], r["keep"]["stats"]
        assert 0 < resend["backward_peak_kv_bytes"] <= bound[rank], (rank, resend)
        assert keep["backward_peak_kv_bytes"] == keep["saved_kv_bytes"]  # keep holds its need set
        # a chain's keep starts from the first sub-round the forward saved: one step fewer
        assert resend["backward_waves"] == keep["backward_waves"] + chain > 1


BUILDER_NAMES = ("ring", "full", "hierarchical", "leader", "spanning", "entry")


def _builders(cp: int) -> dict:
    """cp ranks on one 8-GPU node, every builder, in the in-process harness: the default mode
    (auto), keep and resend; per rank the held received KV between the passes, the stats and the
    results (FP64)."""
    from megatron_fcp.testing.harness import harness_attention
    from megatron_fcp.planner.build import build_plan

    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(8 * cp, 1, h, 8, generator=g, dtype=torch.float64) for h in (2, 1, 1, 2))
    out = {"local_kv": 2 * (k.numel() // cp) * k.element_size()}
    for name in BUILDER_NAMES:
        plan = build_plan("dgx-h100:1", range(cp), name)
        for mode in ("auto", "keep", "resend"):
            res = harness_attention(q, k, v, do, cp=cp, plan=plan, backward_kv=mode, stats=True)
            out[(name, mode)] = res.ranks
    return out


@pytest.fixture(scope="module")
def builders():
    return {cp: _builders(cp) for cp in (4, 8)}


@pytest.mark.parametrize("cp", (4, 8))
def test_default_mode_holds_no_more_than_the_ring(builders, cp):
    """FCP's default (auto, the ring's budget) re-sends at cp = 4 and 8 for every builder and holds
    no more than Transformer Engine's ring: between the passes, as TE's ring saves its last received
    shard, the backward's first step (a ring's first sub-round, another graph's first wave: at most
    one shard); within backward TE's three shards (the saved one and two in flight: Note
    [Streaming chain backward]; the waves: the kept first wave and two waves of a shard in flight). An explicit resend saves nothing. keep, resend and auto agree bit for bit."""
    res = builders[cp]
    one = res["local_kv"]
    for name in BUILDER_NAMES:
        auto, keep, resend = res[(name, "auto")], res[(name, "keep")], res[(name, "resend")]
        assert all(0 < r.kept_bytes <= one for r in auto), name      # the first step's KV: at most one shard
        assert [r.kept_bytes for r in resend] == [0] * cp, name
        for a, kp, rs in zip(auto, keep, resend):
            assert a.backward_kv == "resend"
            assert a.stats.ring_kv_bytes == one
            assert 0 < a.stats.backward_peak_kv_bytes <= 3 * one, (name, a.stats)
            assert 0 < rs.stats.backward_peak_kv_bytes <= 2 * one, (name, rs.stats)
            assert kp.stats.backward_peak_kv_bytes == kp.kept_bytes
            for q in ("out", "lse", "dq", "dk", "dv"):
                assert torch.equal(getattr(kp, q), getattr(rs, q)), (name, q)
                assert torch.equal(getattr(kp, q), getattr(a, q)), (name, q)
    # keep's figure: causal zigzag CP rank 0 holds 2*(cp-1) chunks = cp-1 times its own KV
    assert res[("full", "keep")][0].kept_bytes == (cp - 1) * res["local_kv"]


def test_auto_decides_once_per_plan_and_shape():
    """Every layer calls with the same settled plan: the decision is computed once per plan object
    and cache key, recomputed for another key or another plan object."""
    from megatron_fcp.schedule.waves import choose_backward_kv
    from megatron_fcp.contract.plan import ring_plan

    plan = ring_plan((0, 1), causal=True)
    calls = []

    def size(b):
        calls.append(b)
        return 100

    assert choose_backward_kv("auto", plan, size, cache_key="s64") == "keep"
    n = len(calls)
    assert choose_backward_kv("auto", plan, lambda b: 1 / 0, cache_key="s64") == "keep"  # cached: not called
    assert choose_backward_kv("auto", plan, size, budget=150, cache_key="s64") == "resend"  # budget is in the key
    assert len(calls) > n
    assert choose_backward_kv("auto", ring_plan((0, 1), causal=True), size, cache_key="s64") == "keep"


def test_timing_never_changes_the_bits():
    """The wave backward advances its reductions and re-sends on ``transport.test`` between jobs
    (Note [Backward waves]); how far they get depends on timing, the arithmetic must not. Random
    message delays, a transport whose ``test`` never knows (the base answer: rounds move only
    at the blocking finish), and a kernel whose device is behind the host, so that the pump keeps
    polling between jobs (Note [Polling on the device's clock]) give bitwise the plain run's out,
    lse, dq, dk, dv (hierarchical 2 x 2 with sub-blocks: relays and several waves; resend)."""
    from megatron_fcp.testing.harness import harness_attention
    from megatron_fcp.attention.comm import DelayTransport, Transport, TransportWrapper

    from megatron_fcp.attention.kernels import MathKernel

    class Unknowing(TransportWrapper):
        test = Transport.test                                    # always False: "unknown"

    import threading

    from megatron_fcp.attention.device_clock import DeviceClock

    class Behind(DeviceClock):
        """A device behind the host (Note [Polling on the device's clock]): each mark is reached
        only at its second query, so the pump keeps polling between jobs (CPU: nothing to wait for)."""
        queries = 0

        def __init__(self):
            super().__init__()
            self.asked: set = set()
            self.n = 0

        def mark(self):
            self.n += 1
            return self.n

        def reached(self, mark):
            Behind.queries += 1
            done = mark is None or mark in self.asked
            self.asked.add(mark)
            return done

    class Clocked(MathKernel):
        def __init__(self):
            self._local = threading.local()

        @property
        def clock(self):                                  # one per virtual rank (thread)
            if not hasattr(self._local, "clock"):
                self._local.clock = Behind()
            return self._local.clock

    full, placement, plan = case_setup("hier", "fp32")
    runs = {}
    for name, wrap, kernel in (("plain", None, "math"),
                               ("delayed", lambda r, t: DelayTransport(t, _delay(r)), "math"),
                               ("unknowing", lambda r, t: Unknowing(t), "math"),
                               ("device-clock", None, Clocked())):
        res = harness_attention(*full, cp=4, plan=plan, causal=True, placement=placement, backward_kv="resend",
                                transport=wrap, kernel=kernel)
        runs[name] = [r.tensors() for r in res.ranks]
    # the pump polled the device's clock between jobs (rounds queued), without a host wait
    assert Behind.queries > 0
    for name in ("delayed", "unknowing", "device-clock"):
        for a, b in zip(runs["plain"], runs[name]):
            for q in ("out", "lse", "dq", "dk", "dv"):
                assert torch.equal(a[q], b[q]), (name, q)


def _delay(rank: int):
    import random

    rng = random.Random(rank)
    return lambda: rng.uniform(0.0, 3e-4)


@pytest.mark.parametrize("docs", ([33, 5, 5], [3, 2, 33, 7]), ids=("relay-sends-what-it-kept", "relay-fetched-again"))
def test_auto_keeps_the_first_wave_rank_by_rank(docs):
    """A packed plan whose first wave fits some ranks' own shard and not others' (hierarchical on
    2 x 2, 4-token blocks): under auto those ranks keep their part from the forward and the rest of
    the first wave is re-sent (Note [Backward waves], "The first wave"). A relay that kept a block
    sends it on from what it kept; one that did not gets it again. FP64 per-document reference for
    out, lse, dq, dk, dv; keep, resend and auto bit for bit; auto re-sends exactly the later waves
    and the first wave's cut, and the cost model prices the same cut."""
    from megatron_fcp.testing.harness import harness_attention, per_document_reference
    from megatron_fcp.contract.placement import place_packed
    from megatron_fcp.planner.build import build_plan
    from megatron_fcp.cost.backward import simulate_backward_waves
    from megatron_fcp.schedule.chains import first_kept_blocks, first_keepers, first_wave_fetch
    from megatron_fcp.cost.model import AttentionShape
    from megatron_fcp.schedule.waves import plan_waves
    from megatron_fcp.topology import load_topology

    topo = load_topology(os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples/configs/topology_2x2.yaml"))
    pl = place_packed(docs, 4, block_tokens=4)
    plan = build_plan(topo, range(4), "hierarchical", placement=pl)
    h, hk, d = 4, 2, 8
    per_token = 2 * hk * d * 8                                          # K and V, FP64
    tokens = {(plan.ranks[i], b): sp.tokens for i, b, sp in pl.block_list()}
    size = lambda b: tokens[(b.owner, b.chunk)] * per_token  # noqa: E731
    keepers = first_keepers("auto", "resend", plan, size)
    assert 0 < len(keepers) < 4
    cut = first_wave_fetch(plan, size, keepers)
    waves = plan_waves(plan, size)
    kept = first_kept_blocks(plan, size)
    assert 0 < len(cut.transfers) < len(waves[0].transfers)
    relays = [t for _, t in cut.transfers if t.src != t.block.owner]
    assert relays and all(any(u.dst == t.src and u.block == t.block for _, u in cut.transfers)
                          or t.block in kept.get(t.src, ()) for t in relays)

    g = torch.Generator().manual_seed(len(docs))
    q, k, v, do = (torch.randn(pl.total_tokens, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk, h))
    scale = d ** -0.5
    runs = {mode: harness_attention(q, k, v, do, cp=4, plan=plan, placement=pl, softmax_scale=scale,
                                    backward_kv=mode, stats=True) for mode in MODES}
    ref = per_document_reference(q, k, v, do, docs, True, scale)
    for name in ("out", "lse", "dq", "dk", "dv"):
        got = runs["auto"].gathered(name)
        assert (got - ref[name]).abs().max().item() <= 1e-12 * max(1.0, ref[name].abs().max().item()), name
        for mode in ("keep", "resend"):
            assert all(torch.equal(getattr(a, name), getattr(b, name))
                       for a, b in zip(runs["auto"].ranks, runs[mode].ranks)), (mode, name)
    for r in runs["auto"].ranks:
        own = sum(size(b) for b in plan.local_blocks(r.rank))
        want = sum(size(b) for b in kept.get(r.rank, ())) if r.rank in keepers else 0
        assert r.backward_kv == "resend" and r.kept_bytes == want <= own, (r.rank, r.kept_bytes, want, own)
    again = sum(size(t.block) for w in (cut, *waves[1:]) for _, t in w.transfers)
    assert sum(r.stats.resend_bytes_sent for r in runs["auto"].ranks) == again
    assert again < sum(r.stats.resend_bytes_sent for r in runs["resend"].ranks)
    priced = simulate_backward_waves(plan, topo, AttentionShape(pl.total_tokens, h, hk, d, 8), backward_kv="auto")
    assert (priced["first_kept"], priced["first_kept_ranks"]) == (False, len(keepers))
    assert priced["wave_resend_s"][0] > 0 and priced["held_between_passes_bytes_max"] == max(
        sum(size(b) for b in kept.get(x, ())) for x in keepers)


def test_a_single_wave_runs_half_its_own_jobs_after_the_wave():
    """One wave (a packed batch on 2 x 2, the direct plan): each rank computes the first half of its own
    blocks while the wave's KV arrives and the rest after the wave's received blocks, while the
    wave's dK/dV partials return (leading_own_jobs); those partials join the result after the
    wave's sum, in a fixed place. FP64 per-document reference for out, lse, dq, dk, dv; keep,
    resend and auto bit for bit; random message delays change no bit."""
    from megatron_fcp.testing.harness import harness_attention, per_document_reference
    from megatron_fcp.attention.comm import DelayTransport
    from megatron_fcp.contract.placement import place_packed
    from megatron_fcp.planner.build import build_plan
    from megatron_fcp.schedule.chains import chain_steps
    from megatron_fcp.schedule.waves import leading_own_jobs, plan_waves
    from megatron_fcp.topology import load_topology

    docs = [17, 17, 13, 5, 2, 17, 1, 13, 13]
    topo = load_topology(os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples/configs/topology_2x2.yaml"))
    pl = place_packed(docs, 4, block_tokens=4)
    plan = build_plan(topo, range(4), "full", placement=pl)
    h, hk, d = 4, 2, 8
    tokens = {(plan.ranks[i], b): sp.tokens for i, b, sp in pl.block_list()}
    size = lambda b: tokens[(b.owner, b.chunk)] * 2 * hk * d * 8  # noqa: E731
    waves = plan_waves(plan, size)
    assert chain_steps(plan, size) is None and len(waves) == 1 and waves[0].transfers
    own = {r: sum((b, r) in waves[0].computes for b in plan.local_blocks(r)) for r in plan.ranks}
    assert all(own[r] >= 2 and leading_own_jobs(own[r], 1) < own[r] for r in plan.ranks), own

    g = torch.Generator().manual_seed(9)
    q, k, v, do = (torch.randn(pl.total_tokens, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk, h))
    scale = d ** -0.5
    runs = {mode: harness_attention(q, k, v, do, cp=4, plan=plan, placement=pl, softmax_scale=scale,
                                    backward_kv=mode, stats=True) for mode in MODES}
    runs["delayed"] = harness_attention(q, k, v, do, cp=4, plan=plan, placement=pl, softmax_scale=scale,
                                        backward_kv="resend", transport=lambda r, t: DelayTransport(t, _delay(r)))
    ref = per_document_reference(q, k, v, do, docs, True, scale)
    for name in ("out", "lse", "dq", "dk", "dv"):
        got = runs["auto"].gathered(name)
        assert (got - ref[name]).abs().max().item() <= 1e-12 * max(1.0, ref[name].abs().max().item()), name
        for mode in ("keep", "resend", "delayed"):
            assert all(torch.equal(getattr(a, name), getattr(b, name))
                       for a, b in zip(runs["auto"].ranks, runs[mode].ranks)), (mode, name)
    assert [r.stats.backward_waves for r in runs["resend"].ranks] == [1] * 4, [r.stats.backward_waves for r in runs["resend"].ranks]
