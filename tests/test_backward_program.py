"""One backward program (Note [Backward program] in megatron_fcp.schedule.program): what the
executor posts in backward is the program's list, and the cost model prices that same object.

Every plan of the matrix -- each graph builder x causal x sub-blocks x backward KV mode on a
2 x 2 cluster, packed placements, and the KV stages of head-parallel plans -- runs forward and
backward on the in-process harness with a counting transport. For every rank the rounds posted
in backward (phase, round, sends, receives, in post order, empty rounds included) must equal
``program.posts(rank)``; the cost model's backward (``simulate_backward_waves``) must compile to
the very program object the executor ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_fcp.testing.harness import harness_attention
from megatron_fcp.attention.comm import CountingTransport
from megatron_fcp.contract.placement import place_packed
from megatron_fcp.contract.plan import full_plan, ring_plan
from megatron_fcp.cost.model import AttentionShape
from megatron_fcp.planner.build import build_plan
from megatron_fcp.cost import backward as packed_cost
from megatron_fcp.schedule.program import BackwardPolicy, ProgramPost, compile_backward

TOPO = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "topology_2x2.yaml")
CP, S, H, HK, D = 4, 48, 2, 1, 8          # zigzag: 6 tokens per chunk
MODES = ("keep", "resend", "auto")


def _run(plan, mode, *, placement=None, ranks=None, tokens=None):
    g = torch.Generator().manual_seed(7)
    if placement is None:
        shape_q, shape_kv = (S, 1, H, D), (S, 1, HK, D)
    else:
        shape_q, shape_kv = (tokens, H, D), (tokens, HK, D)
    q, do = (torch.randn(shape_q, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(shape_kv, generator=g, dtype=torch.float64) for _ in range(2))
    return harness_attention(q, k, v, do, ranks=ranks or tuple(range(CP)), plan=plan, causal=plan.causal,
                             placement=placement, backward_kv=mode, kernel="math",
                             transport=lambda rank, inner: CountingTransport(inner))


def _check(res, mode):
    programs = {r.program for r in res.ranks}
    assert len(programs) == 1, "every rank runs the same program object"
    program = programs.pop()
    assert program.policy == BackwardPolicy(mode)
    for r in res.ranks:
        posted = [ProgramPost(ph, i, s, rv) for ph, i, s, rv in r.transport.rounds if ph != "forward"]
        want = list(program.posts(r.rank))
        assert posted == want, f"rank {r.rank} ({program.plan.name}, {mode}, {program.form})"
        assert r.backward_kv == program.mode
        assert r.kept_bytes == program.kept_bytes(r.rank)
    return program


def _zigzag_plans():
    for graph in ("ring", "full", "hierarchical", "leader", "spanning"):
        for causal in (True, False):
            for parts in (1, 2):
                yield f"{graph}-{'causal' if causal else 'full-mask'}-p{parts}", (graph, causal, parts)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,spec", list(_zigzag_plans()), ids=[n for n, _ in _zigzag_plans()])
def test_zigzag_posts_are_the_programs_and_priced_from_it(name, spec, mode, monkeypatch):
    graph, causal, parts = spec
    plan = build_plan(TOPO, range(CP), graph, causal=causal, parts_per_chunk=parts)
    res = _run(plan, mode)
    program = _check(res, mode)
    assert program is compile_backward(plan, 2 * HK * D * 8, BackwardPolicy(mode), seq_len=S)

    compiled = []
    real = packed_cost.compile_backward
    monkeypatch.setattr(packed_cost, "compile_backward", lambda *a, **kw: compiled.append(real(*a, **kw)) or compiled[-1])
    priced = packed_cost.simulate_backward_waves(plan, TOPO, AttentionShape(S, H, HK, D, 8), backward_kv=mode)
    assert compiled == [program] and compiled[0] is program       # the cost model's object is the executor's
    assert priced["backward_kv"] == program.mode and priced["backward"] == program.form
    assert priced["waves"] == len(program.steps if program.steps is not None else program.waves)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("graph", ["full", "ring", "hierarchical"])
def test_packed_posts_are_the_programs(graph, mode):
    docs = [30, 5, 17, 40, 8]
    pl = place_packed(docs, CP, block_tokens=12, causal=True)
    plan = full_plan(range(CP), True, placement=pl) if graph == "full" else \
        build_plan(TOPO, range(CP), graph, causal=True, placement=pl)
    program = _check(_run(plan, mode, placement=pl, tokens=sum(docs)), mode)
    assert program.seq_len is None


@pytest.mark.parametrize("mode", MODES)
def test_head_parallel_stage_posts_are_the_programs(mode):
    """The KV stage of a head-parallel plan (degree 2 over 4 ranks: two stages of 2 ranks over a
    group placement) runs its own program; every member's stage alike."""
    from megatron_fcp.planner.head_parallel import compile_head_parallel

    hp = compile_head_parallel(TOPO, range(CP), AttentionShape(S, 2 * H, 2 * HK, D, 8), 2, "ring", causal=True)
    for member in range(hp.degree):
        stage = hp.kv_plan_for(member)
        pl = stage.placement
        _check(_run(stage, mode, placement=pl, ranks=stage.ranks, tokens=pl.total_tokens), mode)


def test_the_program_is_decided_once_per_plan_and_key():
    plan = ring_plan(range(CP), True)
    a = compile_backward(plan, 64, BackwardPolicy("auto"), seq_len=S)
    assert compile_backward(plan, 64, BackwardPolicy("auto"), seq_len=S) is a
    assert compile_backward(plan, 64, BackwardPolicy("keep"), seq_len=S) is not a
    assert compile_backward(ring_plan(range(CP), True), 64, BackwardPolicy("auto"), seq_len=S) is not a  # per object
    # auto on a ring at cp = 4: re-send, every rank keeping its first sub-round (one shard, TE's)
    assert (a.mode, a.form, a.first_kept) == ("resend", "chain", True)
    assert all(a.kept_bytes(r) <= sum(a.block_bytes(b) for b in plan.local_blocks(r)) for r in plan.ranks)
    keep = compile_backward(plan, 64, BackwardPolicy("keep"), seq_len=S)
    assert keep.kept(0) == plan.needs(0) and keep.keep_first(0) is None
    with pytest.raises(ValueError, match="seq_len"):
        compile_backward(plan, 64)
    with pytest.raises(ValueError, match="--fcp-backward-kv"):
        BackwardPolicy("lazy")
    with pytest.raises(ValueError, match="--fcp-kv-memory-budget"):
        BackwardPolicy("auto", -7)


@pytest.mark.parametrize("plan_name", ["ring", "full"])
def test_the_default_holds_no_more_than_the_rings_kv(plan_name):
    """With no ``backward_kv`` argument a rank at cp = 4 holds at most 1.1x a ring's KV (its own
    shard's K and V, what TE's ring keeps) between forward and backward."""
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(S, 1, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(S, 1, HK, D, generator=g, dtype=torch.float64) for _ in range(2))
    res = harness_attention(q, k, v, do, cp=CP, plan=plan_name, stats=True)       # the API's default
    for r in res.ranks:
        ring_kv = 2 * (S // CP) * HK * D * 8
        assert r.stats.ring_kv_bytes == ring_kv
        assert r.kept_bytes == r.stats.saved_kv_bytes <= 1.1 * ring_kv, (plan_name, r.rank, r.kept_bytes / ring_kv)
