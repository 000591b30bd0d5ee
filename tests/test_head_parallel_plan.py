"""The planner's head-parallel stage (issue 9): groups from the topology, the KV stage over group
placements, its cost forward and backward against Transformer Engine's schedules, the lower bound
over families, auto's choice, and rounds against Delta."""

from __future__ import annotations

import json
import random

import pytest

from megatron_fcp.cli import main
from megatron_fcp.cost.model import AttentionShape
from megatron_fcp.planner.builders import build_graph
from megatron_fcp.planner.compile import compile_plan
from megatron_fcp.cost.te import simulate_te_a2a_p2p
from megatron_fcp.contract.blocks import PlanError
from megatron_fcp.planner.choose import (
    build_head_parallel_plan,
    choose_head_parallel,
    head_parallel_candidates,
)
from megatron_fcp.planner.head_parallel import compile_head_parallel
from megatron_fcp.contract.head_parallel import head_parallel_degrees, topology_head_groups
from megatron_fcp.contract.head_parallel import stage_plan
from megatron_fcp.planner.choose import lower_bound_all
from megatron_fcp.cost.head_parallel import simulate_head_parallel, simulate_te
from megatron_fcp.planner.rounds import bipartite_edge_colouring, plan_delta
from megatron_fcp.topology import load_topology

GQA = AttentionShape(131072, 32, 8, 128, 2)


def test_head_groups_sit_inside_nodes_even_and_uneven():
    assert topology_head_groups("dgx-h100:2", range(16), 8) == (tuple(range(8)), tuple(range(8, 16)))
    # 8 + 4 ranks: degrees dividing both; groups of 4 inside each node
    assert head_parallel_degrees("dgx-h100:2", range(12)) == [1, 2, 4]
    assert topology_head_groups("dgx-h100:2", range(12), 4) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
    with pytest.raises(ValueError, match="must divide every node's CP rank count"):
        topology_head_groups("dgx-h100:2", range(12), 8)
    # head counts: 32:2 at degree 8 repeats each KV head 4 times (allowed), 6 query heads at 4 are not
    assert 8 in head_parallel_degrees("dgx-h100:2", range(16), 32, 2)
    assert head_parallel_degrees("dgx-h100:1", range(8), 6, 6) == [1, 2]


@pytest.mark.parametrize("degree", [1, 2, 4, 8])
@pytest.mark.parametrize("graph", ["ring", "hierarchical", "full"])
def test_every_degree_and_graph_compiles_and_verifies(degree, graph):
    hp = compile_head_parallel("dgx-a100:3", range(24), AttentionShape(48 * 1024, 32, 8), degree, graph)
    assert hp.verify() is hp and hp.degree == degree and hp.num_groups == 24 // degree
    sp = stage_plan(hp, 48 * 1024)
    assert sp.verified and sp.ranks == hp.ranks
    if degree > 1:  # the merged stages: every rank receives only from its own stage (member index)
        for _, t in sp.transfers():
            assert hp.position(t.src)[1] == hp.position(t.dst)[1] == hp.position(t.block.owner)[1]
        assert hp.kv_plan.placement is not None and all(len(b) == 2 * degree for b in hp.kv_plan.placement.blocks)
    with pytest.raises(PlanError):
        compile_head_parallel("dgx-a100:3", range(24), AttentionShape(48 * 1024), 2, graph, parts_per_chunk=2)


@pytest.mark.parametrize("preset", ["dgx-h100:2", "pcie-box:2", "dgx-a100:3", "single-uplink:2"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_over_node_groups_is_te_a2a_p2p(preset, causal):
    """FCP with degree = ranks per node and the ring graph over the head groups is TE's a2a+p2p: the
    same forward prediction (causal: the same times, fewer bytes: the ring stops at the last reader)."""
    n = int(preset.split(":")[1])
    ranks = range(8 * n)
    hp = compile_head_parallel(preset, ranks, GQA, 8, "ring", causal=causal)
    ours = simulate_head_parallel(hp, preset, GQA, pass_="fwd", causal=causal, overlap_q=False)  # TE's order
    te = simulate_te_a2a_p2p(preset, ranks, GQA, causal=causal)
    assert ours.comm_s == pytest.approx(te.comm_s, rel=1e-12)
    if causal:  # the pruned ring lands some blocks earlier: never later, within 0.1%
        assert te.total_s * 0.999 <= ours.total_s <= te.total_s * (1 + 1e-12) and ours.bytes < te.bytes
    else:
        assert ours.total_s == pytest.approx(te.total_s, rel=1e-9) and ours.bytes == te.bytes
    engine = simulate_head_parallel(hp, preset, GQA, pass_="fwd", causal=causal)  # Q's a2a behind the stage
    # never slower but for the second all-to-all's latency (microseconds) where compute is the bound
    assert engine.total_s <= ours.total_s * 1.001 and engine.bytes == pytest.approx(ours.bytes)


def test_degree_cp_is_te_a2a_on_one_node():
    hp = compile_head_parallel("dgx-h100:1", range(8), GQA, 8, "ring")
    assert hp.kv_plan is None
    ours = simulate_head_parallel(hp, "dgx-h100:1", GQA, pass_="fwd")
    te = simulate_te_a2a_p2p("dgx-h100:1", range(8), GQA)
    assert ours.comm_s == pytest.approx(te.comm_s) and ours.total_s == pytest.approx(te.total_s)


def test_all_to_all_bytes_forward_and_backward_with_kv_replication():
    """GQA 32:2 at degree 8: each KV head repeated 4 times; forward in Q+K+V, out O; backward in dO,
    out dQ+dK+dV (Note [Head-parallel cost])."""
    shape = AttentionShape(16 * 1024, 32, 2, 128, 2)
    hp = compile_head_parallel("dgx-h100:1", range(8), shape, 8, "ring")
    assert hp.kv_replication == 4
    L2 = shape.seq_len / 8
    q, kv = shape.q_bytes(L2), shape.kv_bytes(L2) * 4
    fwd = simulate_head_parallel(hp, "dgx-h100:1", shape, pass_="fwd")
    both = simulate_head_parallel(hp, "dgx-h100:1", shape, pass_="fwd+bwd")
    assert fwd.bytes == pytest.approx(8 * 7 * (q + kv + q) / 8)
    assert both.bytes == pytest.approx(2 * fwd.bytes)


def test_q_all_to_all_behind_the_kv_stage_is_priced():
    """Note [Q's all-to-all behind the KV stage]: K|V's all-to-all first, the stage's transfers then,
    its compute only once Q's all-to-all is in too; the bytes are the one Q|K|V all-to-all's."""
    from megatron_fcp.cost.model import ComputeModel, simulate_plan
    from megatron_fcp.cost.head_parallel import a2a_messages

    shape = AttentionShape(8 * 1024, 16, 16, 128, 2)
    hp = compile_head_parallel("dgx-h100:2", range(16), shape, 8, "ring")
    msgs = {w: a2a_messages(hp, shape, w) for w in ("qkv", "q", "kv")}
    assert [m[:2] for m in msgs["kv"]] == [m[:2] for m in msgs["qkv"]]
    assert all(a[2] + b[2] == pytest.approx(c[2]) for a, b, c in zip(msgs["q"], msgs["kv"], msgs["qkv"]))
    with pytest.raises(ValueError, match="'qkv', 'q' or 'kv'"):
        a2a_messages(hp, shape, "dq")
    q_in = (8 - 1) * msgs["q"][0][2] / 450e9                  # Q's all-to-all alone over NVLink4
    for flops, bound in ((1e17, "comm"), (1e12, "compute")):
        cm = ComputeModel(flops=flops)
        over = simulate_head_parallel(hp, "dgx-h100:2", shape, pass_="fwd", compute_model=cm)
        serial = simulate_head_parallel(hp, "dgx-h100:2", shape, pass_="fwd", compute_model=cm, overlap_q=False)
        assert over.bytes == pytest.approx(serial.bytes)
        if bound == "comm":  # Q's all-to-all hidden behind the stage's transfers, no more
            assert serial.total_s - q_in * 1.01 <= over.total_s < serial.total_s - q_in * 0.5
        else:                # compute from Q's arrival either way: the second all-to-all's latency only
            assert over.total_s == pytest.approx(serial.total_s, rel=1e-3)
    sp = stage_plan(hp, shape.seq_len, True)
    base = simulate_plan(sp, "dgx-h100:2", shape, compute_model=ComputeModel(flops=1e12))
    late = simulate_plan(sp, "dgx-h100:2", shape, compute_model=ComputeModel(flops=1e12), compute_from_s=0.5)
    assert late.comm_s == base.comm_s and late.total_s == pytest.approx(base.total_s + 0.5)  # compute-bound
    with pytest.raises(ValueError, match="compute_from_s"):
        simulate_plan(sp, "dgx-h100:2", shape, compute_from_s=-1.0)


def test_dq_all_to_all_ahead_of_dk_dv_is_priced():
    """Note [dQ's all-to-all ahead of dK|dV's]: timed with the executor's backward, dQ's all-to-all
    starts at the stage's last job and only what outlasts the stage's tail adds to dK|dV's. On the
    emulated 2 x 4 rail cluster (MHA, a = 4, a ring staggered over 8 rounds: the stage's last step
    waits 27 ms for the last sums, dQ's all-to-all takes 9 ms) it is hidden whole; the bytes are
    the one dQ|dK|dV all-to-all's. The one-pass backward prices it from its own last job (unstaggered,
    its jobs end 0.15 s before its sums: hidden whole too)."""
    from megatron_fcp.emulate.spec import ClusterSpec, emulated_topology
    from megatron_fcp.cost.model import ComputeModel
    from megatron_fcp.cost.model import simulate_rounds
    from megatron_fcp.cost.head_parallel import a2a_messages
    from megatron_fcp.schedule.program import WaveBackward

    spec = ClusterSpec(2, 4, "rail", 180e6, 20e6)
    topo, cm = emulated_topology(spec), ComputeModel(flops=400e12 / spec.time_scale, kernel_overhead_s=0.0)
    shape = AttentionShape(4096, 4, 4, 64, 2)
    hp = compile_head_parallel(topo, range(8), shape, 4, "ring", stagger=8)
    dq_s = simulate_rounds(topo, [a2a_messages(hp, shape, "q")]).comm_s
    kw = dict(pass_="bwd", compute_model=cm, backward=WaveBackward("keep", buffered_sends=True))
    ahead = simulate_head_parallel(hp, topo, shape, **kw)
    serial = simulate_head_parallel(hp, topo, shape, overlap_q=False, **kw)
    assert ahead.bytes == pytest.approx(serial.bytes)
    assert serial.total_s - ahead.total_s == pytest.approx(dq_s, rel=1e-6)      # hidden whole
    one = dict(pass_="bwd", compute_model=cm)
    hp1 = compile_head_parallel(topo, range(8), shape, 4, "ring")
    saved = simulate_head_parallel(hp1, topo, shape, overlap_q=False, **one).total_s - \
        simulate_head_parallel(hp1, topo, shape, **one).total_s
    assert saved == pytest.approx(dq_s, rel=1e-6)


@pytest.mark.parametrize("preset,ranks", [("dgx-h100:2", 16), ("dgx-h100:2", 12), ("pcie-box:2", 16),
                                          ("single-uplink:3", 24), ("dgx-a100:1", 8)])
@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
def test_lower_bound_over_families_is_below_every_schedule(preset, ranks, pass_):
    lb = lower_bound_all(preset, range(ranks), GQA, pass_=pass_)
    comms = [r.comm_s for r, _ in head_parallel_candidates(preset, range(ranks), GQA, pass_=pass_,
                                                           parts_per_chunk=1)]
    for name in ("te-p2p", "te-a2a-p2p"):
        try:
            comms.append(simulate_te(name, preset, range(ranks), GQA, pass_=pass_).comm_s)
        except ValueError:
            pass
    assert 0 < lb["lower_bound_s"] <= min(comms) * (1 + 1e-9)
    assert lb["lower_bound_s"] == min(lb["per_degree"].values())


def test_choose_head_parallel_records_candidates_and_returns_a_verified_plan():
    hp = choose_head_parallel("dgx-h100:2", range(16), GQA)
    assert hp.verify() is hp and hp.auto
    labels = dict(hp.auto)
    assert any(k.startswith("a=8 graph=ring") for k in labels) and any(k.startswith("a=1 graph=ring") for k in labels)
    fixed = build_head_parallel_plan("dgx-h100:2", range(16), GQA, degree=4, graph="hierarchical", parts_per_chunk=1)
    assert fixed.degree == 4 and fixed.auto is None
    with pytest.raises(ValueError, match="does not fit"):
        build_head_parallel_plan("dgx-h100:2", range(12), GQA, degree=8)


# A representative subset of the grid of benchmarks/bench_head_parallel.py (fast): every preset,
# 1-3 nodes, even and uneven groups, MHA and both GQA shapes.
SUBSET = [("dgx-h100:2", 16, 32, 8), ("dgx-a100:2", 12, 32, 32), ("pcie-box:1", 8, 32, 2),
          ("single-uplink:2", 16, 32, 8), ("dgx-a100:3", 24, 32, 2), ("dgx-h100:3", 20, 32, 8)]


def _best_te(preset, ranks, shape, pass_):
    out = []
    for name in ("te-p2p", "te-a2a-p2p"):
        try:
            out.append(simulate_te(name, preset, range(ranks), shape, pass_=pass_).total_s)
        except ValueError:
            pass
    return min(out)


@pytest.mark.parametrize("preset,ranks,heads,kv", SUBSET)
def test_auto_forward_is_never_slower_than_te(preset, ranks, heads, kv):
    """Forward: the search holds TE's p2p (a = 1, ring) and a2a+p2p (a = ranks per node, ring) with
    the same predictions, so auto is never predicted slower (1% tolerance: the ring plan's own
    kernel accounting)."""
    shape = AttentionShape(131072, heads, kv, 128, 2)
    cands = head_parallel_candidates(preset, range(ranks), shape, pass_="fwd")
    best = min(r.total_s for r, _ in cands)
    assert best <= _best_te(preset, ranks, shape, "fwd") * 1.01


@pytest.mark.parametrize("preset,ranks,heads,kv", SUBSET)
@pytest.mark.parametrize("seq", [32768, 131072])
def test_auto_fwd_bwd_is_never_slower_than_te(preset, ranks, heads, kv, seq):
    """Forward+backward with the executor's dK/dV partials (the input dtype, bf16 here, as TE's ring
    returns dKV; the planner's default): auto is never predicted slower than the faster of te-p2p
    and te-a2a-p2p (1%)."""
    shape = AttentionShape(seq, heads, kv, 128, 2)
    hp = choose_head_parallel(preset, range(ranks), shape)
    assert min(t for _, t in hp.auto) <= _best_te(preset, ranks, shape, "fwd+bwd") * 1.01


# Cells of benchmarks/bench_head_parallel.py's grid that missed the claim while the executor sent
# FP32 partials (twice TE's bf16 dKV hop: 17 of 324 cells, up to 1.043x); these three are the
# small-cp ones (25 GB/s NICs at 32K MHA; PCIe boxes at 32K GQA).
FORMER_FP32_GAP = [("dgx-a100:2", 16, 32, 32, 32768), ("pcie-box:1", 8, 32, 8, 32768),
                   ("pcie-box:2", 16, 32, 2, 32768)]


@pytest.mark.parametrize("preset,ranks,heads,kv,seq", FORMER_FP32_GAP)
def test_auto_fwd_bwd_is_never_slower_than_te_where_fp32_partials_were(preset, ranks, heads, kv, seq):
    """With partials in the input dtype (default: ``shape.dtype_bytes``) auto is never predicted
    slower than the faster TE schedule (1%) on the cells FP32 partials lost; the explicit
    ``grad_dtype_bytes=4`` override still prices FP32 partials, and loses there."""
    shape = AttentionShape(seq, heads, kv, 128, 2)
    best_te = _best_te(preset, ranks, shape, "fwd+bwd")
    hp = choose_head_parallel(preset, range(ranks), shape)
    assert hp.auto == choose_head_parallel(preset, range(ranks), shape, grad_dtype_bytes=2).auto
    assert min(t for _, t in hp.auto) <= best_te * 1.01
    fp32 = choose_head_parallel(preset, range(ranks), shape, grad_dtype_bytes=4)
    assert min(t for _, t in fp32.auto) > best_te * 1.01


def test_bipartite_edge_colouring_uses_delta_colours():
    rng = random.Random(0)
    for _ in range(20):
        edges = [(rng.randrange(6), rng.randrange(6)) for _ in range(rng.randrange(1, 60))]
        colours = bipartite_edge_colouring(edges)
        delta = max(max(sum(1 for u, _ in edges if u == x), sum(1 for _, v in edges if v == x)) for x in range(6))
        assert max(colours) + 1 == delta
        for side in (0, 1):
            seen = {(e[side], c) for e, c in zip(edges, colours)}
            assert len(seen) == len(edges)  # proper: no two edges of one vertex share a colour


@pytest.mark.parametrize("spec", ["dgx-h100:1", "pcie-box:1", "dgx-h100:2"])
@pytest.mark.parametrize("graph", ["full", "hierarchical"])
def test_one_hop_plans_reach_delta_rounds(spec, graph):
    cg = build_graph(load_topology(spec), range(8 if spec.endswith(":1") else 16), graph)
    plan = compile_plan(cg, max_sends=1, max_recvs=1, packing="colour")
    one_hop = spec.endswith(":1") or graph == "full"
    assert plan.verified and (len(plan.rounds) == plan_delta(plan) if one_hop else len(plan.rounds) >= plan_delta(plan))
    with pytest.raises(PlanError, match="packing"):
        compile_plan(cg, packing="colour")


def test_cli_simulate_pass_and_head_parallel_json(capsys):
    assert main(["simulate", "--topology", "dgx-h100:2", "--seq", "64k", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pass"] == "fwd+bwd" and out["lower_bound"]["pass"] == "fwd+bwd"
    fcp = out["schedules"]["fcp"]
    assert {"comm_s", "compute_s", "total_s", "bytes", "rounds", "delta", "head_parallel", "pass"} <= set(fcp)
    assert main(["simulate", "--topology", "dgx-h100:2", "--seq", "64k", "--pass", "fwd", "--head-parallel", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pass"] == "fwd" and out["schedules"]["fcp"]["head_parallel"] == 8
    assert main(["simulate", "--topology", "dgx-h100:2", "--head-parallel", "3"]) == 2


def test_uneven_group_bound_counts_only_the_members_nics():
    """8 + 4 ranks on two DGX nodes: the half-filled node receives through its 4 members' NICs."""
    from megatron_fcp.cost.te import lower_bound
    from megatron_fcp.cost.floors import member_nic_ingress
    from megatron_fcp.topology import load_topology

    topo = load_topology("dgx-h100:2")
    assert member_nic_ingress(topo, range(8, 12)) == pytest.approx(topo.node_ingress_bandwidth() / 2)
    assert member_nic_ingress(topo, range(8)) == pytest.approx(topo.node_ingress_bandwidth())
    shape = AttentionShape(12 * 2048, 32, 8)
    lb = lower_bound(topo, range(12), shape, causal=False)
    # node 1 needs the 8 ranks' KV (2/3 of S) through 4 NICs
    assert lb["lower_bound_s"] == pytest.approx(max(shape.kv_bytes(shape.seq_len) * 8 / 12 / (4 * 50e9),
                                                    shape.kv_bytes(shape.seq_len) * 11 / 12 / lb["B_gpu"]))


@pytest.mark.parametrize("stagger", [2, 4])
def test_staggered_kv_stage_verifies_and_pipelines(stagger):
    """``stagger``: a group's b-th chunk starts b mod stagger rounds late; the plan still verifies,
    moves the same transfers, and on two DGX-H100 nodes (a = 2) the stage's forward comm drops."""
    plain = compile_head_parallel("dgx-h100:2", range(16), GQA, 2, "hierarchical")
    st = compile_head_parallel("dgx-h100:2", range(16), GQA, 2, "hierarchical", stagger=stagger)
    assert st.verify() is st and stage_plan(st, GQA.seq_len).verified
    assert st.kv_plan.num_transfers() == plain.kv_plan.num_transfers()
    assert len(st.kv_plan.rounds) > len(plain.kv_plan.rounds)
    comm = lambda hp: simulate_head_parallel(hp, "dgx-h100:2", GQA, pass_="fwd").comm_s  # noqa: E731
    assert comm(st) < comm(plain)
    with pytest.raises(PlanError, match="stagger_blocks"):
        compile_plan(build_graph(load_topology("dgx-h100:1"), range(8), "full"), stagger_blocks=2)


def test_uneven_group_spreads_the_small_nodes_fan_out():
    """8 + 4 ranks: odd chunks of the 4-rank node enter the 8-rank node at positions 4..7, so no
    NVLink egress carries twice the fan-out; forward comm within 1.15x the bound (was 1.28x)."""
    from megatron_fcp.cost.model import simulate_plan
    from megatron_fcp.planner.build import build_plan
    from megatron_fcp.planner.builders import entry_position

    assert [entry_position(k, 4, 8, c) for c in (0, 1) for k in range(4)] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert entry_position(5, 8, 4, 1) == 1 and entry_position(5, 8, 8, 1) == 5  # only into a larger node
    plan = build_plan("dgx-h100:2", range(12), "hierarchical", parts_per_chunk=2)
    comm = simulate_plan(plan, "dgx-h100:2", GQA, compute=False).comm_s
    assert comm <= 1.15 * lower_bound_all("dgx-h100:2", range(12), GQA, pass_="fwd")["lower_bound_s"]
