"""Packed batches on the cost model: TE's THD schedules by hand, FCP's backward, compare_packed, the
CLI's --doc-lengths and the lognormal generator."""

from __future__ import annotations

from dataclasses import replace

import json

import numpy as np
import pytest

from megatron_fcp.cli import main
from megatron_fcp.contract.placement import lognormal_lengths, place_packed
from megatron_fcp.planner.compare import compare_packed
from megatron_fcp.cost.model import AttentionShape, ComputeModel, simulate_plan
from megatron_fcp.cost.backward import simulate_plan_backward
from megatron_fcp.cost.te import simulate_te_p2p_thd, thd_padded_lengths, thd_rank_work
from megatron_fcp.planner.build import build_plan
from megatron_fcp.contract.placement import Placement, Span, span_pairs

SHAPE = AttentionShape(1, heads=8, kv_heads=2, head_dim=16, dtype_bytes=2)
KV_TOKEN = 2 * 2 * 16 * 2  # K and V, 2 KV heads, d=16, bf16


def test_thd_padding_and_work_by_hand():
    # cp=2: documents padded to multiples of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert thd_padded_lengths([5, 3, 8], 2).tolist() == [8, 4, 8]
    work = thd_rank_work([5, 3], 2)
    # doc 0 (l=2): rank 0 queries [0,2) and [6,8)->none real; rank 1 [2,4) and [4,5)
    # doc 1 (l=1): rank 0 [0,1) and [3,4)->none; rank 1 [1,2) and [2,3)
    d0, d1 = Span(0, 0, 5), Span(1, 0, 3)
    r0 = span_pairs(Span(0, 0, 2), d0, True) + span_pairs(Span(1, 0, 1), d1, True)
    r1 = span_pairs(Span(0, 2, 5), d0, True) + span_pairs(Span(1, 1, 3), d1, True)
    assert work.tolist() == [r0, r1] == [4, 17]
    assert thd_rank_work([5, 3], 2, causal=False).tolist() == [2 * 5 + 1 * 3, 3 * 5 + 2 * 3]


def test_thd_rank_work_is_each_ranks_two_chunks_of_every_document():
    """thd_rank_work (all chunks at once) against each rank's two chunks summed one document at a time."""
    import numpy as np

    rng = np.random.default_rng(0)
    for cp in (1, 2, 3, 8, 64):
        lengths = np.maximum(1, rng.lognormal(7.0, 1.5, 40).astype(int)).tolist()
        l = (thd_padded_lengths(lengths, cp) // (2 * cp)).tolist()
        for causal in (True, False):
            want = [sum(span_pairs(Span(d, min(c * l[d], n), min((c + 1) * l[d], n)), Span(d, 0, n), causal)
                        for d, n in enumerate(lengths) for c in (i, 2 * cp - 1 - i)
                        if min(c * l[d], n) < min((c + 1) * l[d], n))
                    for i in range(cp)]
            assert thd_rank_work(lengths, cp, causal).tolist() == want


def test_te_p2p_thd_bytes_fwd_and_bwd():
    lengths, cp = [5, 3, 100], 4
    padded = int(thd_padded_lengths(lengths, cp).sum())  # 8 + 8 + 104
    assert padded == 120
    per_rank = padded / cp * KV_TOKEN
    cm = ComputeModel(kernel_overhead_s=0.0)
    fwd = simulate_te_p2p_thd("dgx-h100:1", range(cp), lengths, SHAPE, compute_model=cm)
    assert fwd.rounds == cp - 1 and fwd.bytes == pytest.approx(cp * (cp - 1) * per_rank)
    assert fwd.meta["padding_overhead"] == pytest.approx(120 / 108 - 1)
    bwd = simulate_te_p2p_thd("dgx-h100:1", range(cp), lengths, SHAPE, backward=True, compute_model=cm)
    # cp rounds: KV, KV+dKV (x2) ..., dKV home: twice the forward bytes
    assert bwd.rounds == cp and bwd.bytes == pytest.approx(2 * fwd.bytes)
    assert bwd.compute_s == pytest.approx(2.5 * fwd.compute_s)
    # a step lasts the busiest rank's work / cp at the model's FLOP/s
    assert fwd.compute_s == pytest.approx(thd_rank_work(lengths, cp).max() * 4 * 8 * 16 / cm.flops)
    assert bwd.total_s >= max(bwd.comm_s, bwd.compute_s) * (1 - 1e-12)


def test_fcp_backward_reverses_the_plan_with_partials_in_the_input_dtype():
    pl = place_packed([300, 40, 700, 90, 1200], 4, block_tokens=128)
    plan = build_plan("dgx-h100:1", range(4), "full", placement=pl)
    fwd = simulate_plan(plan, "dgx-h100:1", SHAPE)
    bwd = simulate_plan_backward(plan, "dgx-h100:1", SHAPE)
    assert plan.num_transfers() > 0 and bwd.rounds == len(plan.rounds)
    assert bwd.bytes == pytest.approx(fwd.bytes)  # bf16 dK/dV, as the bf16 KV (the executor's wire dtype)
    assert bwd.meta["grad_dtype_bytes"] == SHAPE.dtype_bytes == 2
    fp32 = simulate_plan_backward(plan, "dgx-h100:1", SHAPE, grad_dtype_bytes=4)  # the override: FP32 partials
    assert fp32.bytes == pytest.approx(2 * fwd.bytes) and fp32.comm_s > bwd.comm_s
    assert bwd.compute_s > fwd.compute_s and bwd.total_s >= bwd.compute_s
    # the same kernel launches as the forward (one per owner and round): FLOPs alone scale by 2.5
    cm0 = ComputeModel(kernel_overhead_s=0.0)
    assert simulate_plan_backward(plan, "dgx-h100:1", SHAPE, compute_model=cm0).compute_s == \
        pytest.approx(2.5 * simulate_plan(plan, "dgx-h100:1", SHAPE, compute_model=cm0).compute_s)
    # Megatron's zigzag split too (a 4096-token sequence), and the resend mode: the forward's KV
    # once more before the reduction, nothing held between the passes
    zig = build_plan("dgx-h100:1", range(4), "full")
    shape = replace(SHAPE, seq_len=4096)
    keep = simulate_plan_backward(zig, "dgx-h100:1", shape)
    resend = simulate_plan_backward(zig, "dgx-h100:1", shape, backward_kv="resend")
    assert keep.meta["held_kv_bytes"][0] == 6 * 4096 / 8 * 2 * SHAPE.kv_heads * SHAPE.head_dim * 2  # 6 chunks
    assert resend.meta["held_kv_bytes"] == [0.0] * 4
    assert resend.meta["resend_s"] == pytest.approx(simulate_plan(zig, "dgx-h100:1", shape, compute=False).comm_s)
    assert keep.total_s <= resend.total_s <= keep.total_s + resend.meta["resend_s"] * (1 + 1e-9)
    with pytest.raises(ValueError, match="backward_kv: must be"):
        simulate_plan_backward(zig, "dgx-h100:1", shape, backward_kv="both")


def test_fcp_backward_follows_the_executor_order_by_hand():
    """cp=2, one document in two blocks: the reader of block 0 computes it, posts its dKV, then
    computes its own block; the owner computes its own block and waits for the dKV (Note [FCP
    backward timeline]). The message starts when both ends have posted (reader: after its compute)."""
    from megatron_fcp.topology import load_topology

    pl = Placement((16,), ((Span(0, 0, 8),), (Span(0, 8, 16),)))
    plan = build_plan("dgx-h100:1", range(2), "full", placement=pl)
    (t,), = plan.rounds
    cm = ComputeModel(kernel_overhead_s=0.0)
    flop = 4.0 * SHAPE.heads * SHAPE.head_dim / cm.flops * 2.5
    reader, owner = t.dst, t.src
    c_recv = pl.pairs(reader, owner, t.block.chunk) * flop
    own = [sum(pl.pairs(j, j, b) for b in range(len(pl.blocks[j]))) * flop for j in range(2)]
    route = load_topology("dgx-h100:1").route(reader, owner)
    msg = pl.blocks[owner][t.block.chunk].tokens * 2 * SHAPE.kv_heads * SHAPE.head_dim * SHAPE.dtype_bytes  # dK/dV
    fin = c_recv + msg / min(x.bandwidth for x in route.resources) + route.latency
    bwd = simulate_plan_backward(plan, "dgx-h100:1", SHAPE, compute_model=cm)
    assert bwd.total_s == pytest.approx(max(own[owner], fin, c_recv + own[reader]))
    assert bwd.compute_s == pytest.approx(max(own[owner], c_recv + own[reader]))
    assert bwd.timeline[0]["start_s"] == pytest.approx(c_recv) and bwd.timeline[0]["end_s"] == pytest.approx(fin)
    # resend: the same, after the forward's transfer runs again
    again = simulate_plan_backward(plan, "dgx-h100:1", SHAPE, compute_model=cm, backward_kv="resend")
    assert again.total_s == pytest.approx(bwd.total_s + again.meta["resend_s"])
    with pytest.raises(ValueError, match="order: must be"):
        simulate_plan_backward(plan, "dgx-h100:1", SHAPE, order="barrier")


def test_fcp_backward_executor_order_waits_where_eager_sends_would_not():
    """On a lognormal mix the executor's order (a rank posts reverse round r-1 only after round r is
    done) is never faster than sending each partial as soon as it is complete, and neither beats the
    busiest rank's compute."""
    lengths = lognormal_lengths(8.0, 1.2, 16 * 8192, seed=2)
    pl = place_packed(lengths, 16, block_tokens=2048)
    for graph in ("entry", "hierarchical"):
        plan = build_plan("dgx-h100:2", range(16), graph, placement=pl)
        ex = simulate_plan_backward(plan, "dgx-h100:2", SHAPE)
        eager = simulate_plan_backward(plan, "dgx-h100:2", SHAPE, order="eager")
        assert ex.bytes == eager.bytes and ex.compute_s == eager.compute_s
        assert ex.compute_s <= eager.total_s * (1 + 1e-12) and eager.total_s <= ex.total_s * (1 + 1e-12)


def test_compare_packed_structure_and_exact_bytes():
    lengths = lognormal_lengths(8.0, 1.2, 16 * 8192, seed=3)
    out = compare_packed("dgx-h100:2", None, lengths, AttentionShape(1, 16, 8, 16), graph="entry", block_tokens=2048,
                         compute_model=ComputeModel())
    assert list(out["schedules"]) == ["te-p2p", "te-a2a-p2p", "fcp"]
    assert out["seq_len"] == sum(lengths) and out["padded_seq_len"] >= sum(lengths)
    for name, d in out["schedules"].items():
        for part in ("fwd", "bwd", "fwd_bwd"):
            for key in ("comm_s", "compute_s", "total_s", "bytes", "inter_node_bytes"):
                assert d[part][key] >= 0, (name, part, key)
        assert d["fwd_bwd"]["total_s"] == pytest.approx(d["fwd"]["total_s"] + d["bwd"]["total_s"])
        assert d["comm_s"] == d["fwd"]["comm_s"] and d["work_max_over_mean"] >= 1.0
    f = out["schedules"]["fcp"]
    assert f["graph"] == "entry" and f["bytes_over_exact"] == pytest.approx(1.0)
    assert f["inter_node_over_need"] == pytest.approx(1.0) and f["delta"] >= 1
    assert f["bytes"] < out["schedules"]["te-p2p"]["bytes"]  # 0.67x at 8K tokens/rank; <= 0.5x at 32K (bench)
    assert out["schedules"]["te-p2p"]["padding_overhead"] >= 0
    assert set(out["results"]["fcp"]) == {"fwd", "bwd"} and out["plan"].placement is out["placement"]


def test_lognormal_lengths_deterministic_and_exact_total():
    a = lognormal_lengths(7.0, 1.0, 100_000, seed=5)
    assert a == lognormal_lengths(7.0, 1.0, 100_000, seed=5)
    assert a != lognormal_lengths(7.0, 1.0, 100_000, seed=6)
    assert sum(a) == 100_000 and min(a) >= 1
    assert 500 < float(np.median(a)) < 2500  # exp(7) = 1097
    with pytest.raises(ValueError, match="TOTAL must be a positive integer"):
        lognormal_lengths(7.0, 1.0, 0)


def _cli(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    o = capsys.readouterr()
    return rc, o.out, o.err


def test_cli_plan_doc_lengths_list_and_file(capsys, tmp_path):
    rc, out, err = _cli(capsys, "plan", "dgx-h100:1", "--cp", "4", "--doc-lengths", "300,40,700,90,1200",
                        "--block-tokens", "128")
    assert rc == 0, err
    assert "placement: 5 documents, 2330 tokens, cp=4" in out and "rounds" in out and "delta" in out
    assert "exact need sets" in out and "verified" in out
    f = tmp_path / "lens.json"
    f.write_text("[300, 40, 700, 90, 1200]")
    rc, out2, err = _cli(capsys, "plan", "dgx-h100:1", "--cp", "4", "--doc-lengths", str(f), "--block-tokens", "128")
    assert rc == 0, err and out2 == out
    t = tmp_path / "lens.txt"
    t.write_text("300 40\n700, 90 1200\n")
    rc, out3, err = _cli(capsys, "plan", "dgx-h100:1", "--cp", "4", "--doc-lengths", str(t), "--block-tokens", "128")
    assert rc == 0 and out3 == out


def test_cli_simulate_lognormal_json(capsys):
    rc, out, err = _cli(capsys, "simulate", "dgx-h100:2", "--doc-lengths", "lognormal:8,1.2,128k,1", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert list(d["schedules"]) == ["te-p2p", "te-a2a-p2p", "fcp"] and d["seq_len"] == 131072
    for s in d["schedules"].values():
        assert s["fwd_bwd"]["total_s"] > 0 and s["bwd"]["bytes"] > 0
    rc, out, err = _cli(capsys, "simulate", "dgx-h100:2", "--doc-lengths", "lognormal:8,1.2,128k,1")
    assert rc == 0 and "fcp vs te-p2p: fwd+bwd" in out and "TE THD pads" in out


@pytest.mark.parametrize("spec, message", [
    ("3,0,5", "at least 1 token"), ("4,-2", "at least 1 token"), ("4,x", "'x' is not an integer"),
    ("", "empty"), ("lognormal:8,1.2", "expected lognormal:MEAN,SIGMA,TOTAL"),
    ("lognormal:a,1,10k", "MEAN and SIGMA must be numbers"), ("lognormal:8,1,lots", "TOTAL must be"),
    ("/nonexistent/lens.txt", "no such file"),
])
def test_cli_bad_doc_lengths_exit_2(capsys, spec, message):
    rc, out, err = _cli(capsys, "plan", "dgx-h100:1", "--doc-lengths", spec)
    assert rc == 2 and message in err, err
    rc, out, err = _cli(capsys, "simulate", "dgx-h100:1", "--doc-lengths", spec)
    assert rc == 2 and message in err, err


def test_packed_need_stats_hold_the_busiest_receiver_against_its_bounds():
    """The busiest rank's and node's received bytes are at least their lower bounds (Note [Busiest
    receiver lower bound]): any placement with work <= 1.05 x the mean, ours included."""
    from megatron_fcp.contract.placement import recv_lower_bound
    from megatron_fcp.planner.compare import packed_need_stats

    lengths = lognormal_lengths(9.0, 1.0, 1 << 19, seed=0)
    shape = AttentionShape(1, 32, 8, 128)
    pl = place_packed(lengths, 16)
    st = packed_need_stats(build_plan("dgx-h100:2", range(16), "entry", placement=pl), "dgx-h100:2", shape)
    assert st["recv_bound_bytes"] == recv_lower_bound(lengths, 16) * shape.kv_bytes(1) > 0
    assert st["recv_max_bytes"] >= st["recv_bound_bytes"]
    assert st["recv_max_over_bound"] == pytest.approx(st["recv_max_bytes"] / st["recv_bound_bytes"])
    assert 0 <= st["node_recv_bound_bytes"] <= st["recv_bound_bytes"]  # a node holds more of a document
    assert st["node_recv_max_bytes"] >= st["node_recv_bound_bytes"]
