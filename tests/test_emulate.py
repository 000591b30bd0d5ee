"""The emulated cluster benchmark: the pieces that need no root (rates, address plan, the commands that
build a cluster, its Topology, sleep calibration, workloads and predictions, JSON shape, the CLI's
refusal), and one smoke run that brings a 2 x 2 cluster up, measures and tears it down (root only)."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import replace

import pytest
import torch

from megatron_fcp.emulate import netns, probe
from megatron_fcp.emulate.report import assemble, link_probe_line, progress_printer, table
from megatron_fcp.emulate.sleep_kernel import Sleeper, SleepKernel, VirtualStream, count_pairs
from megatron_fcp.emulate.spec import GOODPUT, ClusterSpec, address_plan, emulated_topology, format_rate, parse_rate
from megatron_fcp.emulate.workloads import (FcpWorkload, HeadParallelWorkload, WorkloadShape, executor_program,
                                             lower_bounds, make_workloads)
from megatron_fcp.planner.choose import choose_schedule
from megatron_fcp.cost.model import ComputeModel
from megatron_fcp.schedule.program import WaveBackward
from megatron_fcp.cost.backward import simulate_backward_waves, simulate_plan_backward

RUN_KEYS = {"workload", "median_s", "min_s", "max_s", "comm_s", "compute_s", "predicted_s", "lower_bound_s",
            "nodes", "ranks_per_node", "nic", "intra", "inter", "seq", "heads", "kv_heads", "head_dim", "causal",
            "doc_lengths"}


# ---- rates, addresses, commands, topology --------------------------------------------------------
@pytest.mark.parametrize("text, bits", [("400mbit", 400e6), ("1gbit", 1e9), ("64kbit", 64e3), ("2.5Mbit", 2.5e6),
                                        (" 40mbit ", 40e6), (8e6, 8e6)])
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits
    assert parse_rate(format_rate(bits)) == bits


@pytest.mark.parametrize("bad", ["400", "400mb", "fast", "1kbit", "-5mbit", ""])
def test_parse_rate_refuses_with_the_fix(bad):
    with pytest.raises(ValueError, match="like 400mbit"):
        parse_rate(bad, "--intra")


def test_cluster_spec_refuses_bad_fields():
    with pytest.raises(ValueError, match="--nic"):
        ClusterSpec(2, 4, "star")
    with pytest.raises(ValueError, match="--nodes"):
        ClusterSpec(0, 4)
    with pytest.raises(ValueError, match="prefix"):
        ClusterSpec(2, 4, prefix="Bad-Prefix")


def test_address_plan_is_node_major_and_private():
    spec = ClusterSpec(3, 2, prefix="fcpe1x")
    plan = address_plan(spec)
    assert [(a.rank, a.node, a.local) for a in plan] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1), (4, 2, 0),
                                                         (5, 2, 1)]
    assert [a.ip for a in plan[:3]] == ["10.213.0.1", "10.213.0.2", "10.213.1.1"]
    assert len({a.netns for a in plan}) == 6 and all(a.netns.startswith("fcpe1x") for a in plan)


@pytest.mark.parametrize("nic", ["rail", "shared"])
def test_setup_commands_shape_every_link_both_ways(nic):
    spec = ClusterSpec(2, 2, nic, prefix="fcpe1x")
    cmds = netns.setup_commands(spec)
    roots = [c for c in cmds if c[0] == "tc" and "root" in c]
    # rail: per rank eth0 + ib0, both ends -> 4 per rank; shared: eth0 both ends per rank + uplink both ends
    assert len(roots) == (4 * 4 if nic == "rail" else 2 * 4 + 2 * 2)
    assert all(c[1] == "-n" and c[2].startswith("fcpe1x") for c in cmds if c[0] == "tc")
    namespaces = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    assert sorted(namespaces) == sorted(["fcpe1xsw", "fcpe1xn0", "fcpe1xn1"] + [a.netns for a in address_plan(spec)])
    rates = {c[c.index("rate") + 1] for c in cmds if c[0] == "tc" and "classid" in c and c[c.index("classid") + 1] == "1:1"}
    assert rates == {"360mbit", "40mbit"}
    assert all(not any(x.startswith("10.") and not x.startswith("10.213.") for x in c) for c in cmds)
    # Note [Quick ACKs]: every route of every rank acknowledges at once (no 40 ms delayed ACKs)
    routes = [c for c in cmds if c[3:5] == ["route", "replace"]]
    assert len(routes) == (2 if nic == "rail" else 1) * 4 and all(c[-2:] == ["quickack", "1"] for c in routes)
    devs = sorted(c[c.index("dev") + 1] for c in routes)
    assert devs == (["eth0"] * 4 + ["ib0"] * 4 if nic == "rail" else ["eth0"] * 4)


def test_links_have_no_burst_credit():
    """Note [Link bursts]: every htb class has a 4 KB bucket and every veth end, both sides of every
    cable, sends packets of at most 16 KB, so an idle link is no faster than its rate."""
    spec = ClusterSpec(2, 2, "rail", prefix="fcpe1x")
    cmds = netns.setup_commands(spec)
    classes = [c for c in cmds if c[0] == "tc" and c[3:5] == ["class", "add"]]
    assert classes and all(c[c.index("burst") + 1] == "4kb" and c[c.index("cburst") + 1] == "4kb" for c in classes)
    added = [c for c in cmds if c[3:5] == ["link", "add"] and "veth" in c]
    veths = {(c[2], c[5]) for c in added} | {(c[c.index("netns") + 1], c[c.index("name") + 1]) for c in added}
    gso = {(c[2], c[5]) for c in cmds if c[3:5] == ["link", "set"] and "gso_max_size" in c}
    assert len(veths) == 2 * 8 and gso == veths  # 4 ranks x (eth0 + ib0), both ends
    assert all(c[-1] == str(netns.GSO_MAX_SIZE) == "16384" for c in cmds if "gso_max_size" in c)


@pytest.mark.parametrize("nodes, rpn, pairs", [(2, 4, [("intra", 0, 1), ("inter", 0, 4)]), (1, 4, [("intra", 0, 1)]),
                                               (4, 1, [("inter", 0, 1)])])
def test_link_probe_pairs_and_summary(nodes, rpn, pairs):
    spec = ClusterSpec(nodes, rpn, "rail", 360e6, 40e6)
    assert probe.probe_pairs(spec) == pairs
    topo = emulated_topology(spec)
    rate = {"intra": 360e6 / 8 * GOODPUT, "inter": 40e6 / 8 * GOODPUT}
    fake = [{"link": link, "src": s, "dst": d, "bytes": 65536, "times_s": [2 * 65536 / rate[link], 65536 / rate[link],
                                                                             0.5]}
            for link, s, d in pairs]
    out = probe.summarize(fake, topo)
    for e, (link, _, _) in zip(out, pairs):
        assert e["modelled_s"] == pytest.approx(65536 / rate[link])  # the route's narrowest link, no latency
        assert e["median_s"] == sorted(e["times_s"])[1] and e["ratio"] == pytest.approx(e["median_s"] / e["modelled_s"])
    line = link_probe_line(out)
    assert line.startswith("links, one message alone, measured / modelled: ") and all(p[0] in line for p in pairs)
    assert link_probe_line([]) == ""
    fitted = link_probe_line(out, {"intra_latency_s": 4e-4, "inter_latency_s": 0.0})
    assert fitted.startswith(line) and fitted.endswith("; fitted latency (in predicted) intra 0.40 ms, inter 0.00 ms")


@pytest.mark.parametrize("nic", ["rail", "shared"])
def test_probe_fitted_latency(nic):
    spec = ClusterSpec(2, 4, nic, 360e6, 40e6)
    nominal = emulated_topology(spec)
    alpha = {"intra": 4e-4, "inter": 1e-3}
    pairs = probe.probe_pairs(spec)
    # one message alone costs its bytes at the modelled goodput plus alpha (plus the intra alpha on a
    # shared uplink's route, which crosses the node's switch too); one outlier per size
    fake = []
    for link, s, d in pairs:
        extra = alpha[link] + (alpha["intra"] if link == "inter" and nic == "shared" else 0.0)
        for n in probe.PROBE_BYTES:
            t = probe.modelled_s(nominal, s, d, n) + extra
            fake.append({"link": link, "src": s, "dst": d, "bytes": n, "times_s": [t, t, 5 * t]})
    topo, fit = probe.calibrated_topology(spec, fake)
    assert fit == pytest.approx({"intra_latency_s": 4e-4, "inter_latency_s": 1e-3})
    assert topo.route(0, 1).latency == pytest.approx(4e-4)  # a route, not each of its two links, pays alpha
    assert topo.route(0, 4).latency == pytest.approx(1e-3 + (4e-4 if nic == "shared" else 0.0))
    assert topo.route(0, 1).bandwidth == nominal.route(0, 1).bandwidth
    for e in fake:  # the calibrated model prices every probed message as measured
        assert probe.modelled_s(topo, e["src"], e["dst"], e["bytes"]) == pytest.approx(e["times_s"][0])
    # links running faster than the model (inter goodput) and a run without a probe fit no latency
    fast = [{**e, "times_s": [0.9 * probe.modelled_s(nominal, e["src"], e["dst"], e["bytes"])]} for e in fake]
    assert probe.calibrated_topology(spec, fast)[1] == {"intra_latency_s": 0.0, "inter_latency_s": 0.0}
    assert probe.calibrated_topology(spec, [])[1] == {"intra_latency_s": 0.0, "inter_latency_s": 0.0}


def test_emulated_topology_matches_the_layout():
    rail = emulated_topology(ClusterSpec(2, 4, "rail", 360e6, 40e6))
    assert [r.name for r in rail.route(0, 1).resources] == ["n0:gpu0>nvswitch", "n0:nvswitch>gpu1"]
    cross = rail.route(1, 5).resources
    assert min(r.bandwidth for r in cross) == pytest.approx(40e6 / 8 * 1448 / 1514)
    assert cross[1].name == "n0:nic1>net"
    shared = emulated_topology(ClusterSpec(2, 4, "shared", 360e6, 40e6))
    assert {r.name for r in shared.route(1, 5).resources} >= {"n0:gpu1>nvswitch", "n0:nic0>net", "n1:nvswitch>gpu1"}
    assert ClusterSpec(2, 4, intra_bps=360e6).time_scale == pytest.approx(1e4)


def test_missing_prerequisites_name_the_fix(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    missing = netns.missing_prerequisites()
    assert any("root" in m and "sudo" in m for m in missing)
    assert any("`tc`" in m and "iproute2" in m for m in missing)
    with pytest.raises(netns.EmulatorUnavailable, match="needs: .*root"):
        netns.check_prerequisites()


def test_cli_refuses_without_root_before_creating_anything(monkeypatch, capsys):
    from megatron_fcp.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    created = []
    monkeypatch.setattr(netns, "_run_all", created.append)
    rc = main(["bench", "--emulate", "--nodes", "2", "--ranks-per-node", "2", "--seq", "1k"])
    assert rc == 2 and not created
    assert "root" in capsys.readouterr().err


# ---- sleep kernel ------------------------------------------------------------------------------------
def test_count_pairs_causal_and_documents():
    q = torch.tensor([0, 1, 2, 3])
    assert count_pairs(q, torch.tensor([0, 1, 2, 3]), True).tolist() == [1, 2, 3, 4]
    assert count_pairs(q, torch.tensor([2, 3]), True).tolist() == [0, 0, 1, 2]
    assert count_pairs(q, torch.tensor([2, 3]), False).tolist() == [2, 2, 2, 2]
    qd, kd = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 1, 1])
    qp, kp = torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 1, 2])
    assert count_pairs(qp, kp, True, qd, kd).tolist() == [1, 1, 1, 2]
    assert count_pairs(qp, kp, False, qd, kd).tolist() == [1, 1, 3, 3]


def test_sleep_kernel_sleeps_the_cost_models_time():
    """The modelled seconds of a block are the cost model's (4 * pairs * h * d / flops, backward x2.5)."""
    flops = 4e9
    kern = SleepKernel(flops)
    q = torch.zeros(8, 1, 4, 16, dtype=torch.bfloat16)
    kv = torch.zeros(8, 1, 2, 16, dtype=torch.bfloat16)
    pos = torch.arange(8)
    out, lse = kern.forward(q, kv, kv, pos, pos, True, 0.25)
    pairs = 8 * 9 // 2
    expected = float(ComputeModel(flops=flops, kernel_overhead_s=0.0).time(pairs, _shape(4, 16)))
    assert kern.modelled_s == pytest.approx(expected)
    assert out.shape == (8, 1, 4, 16) and out.dtype == torch.float32 and lse.shape == (1, 4, 8)
    dq, dk, dv = kern.backward(q, q, kv, kv, out, lse, pos, pos, True, 0.25)
    assert kern.modelled_s == pytest.approx(3.5 * expected)
    assert dq.shape == q.shape and dk.shape == kv.shape and dv.dtype == torch.float32
    _, lse = kern.forward(q, kv, kv, pos, pos + 100, True, 0.25)  # nothing visible: lse -inf, no sleep
    assert bool(torch.isneginf(lse).all()) and kern.modelled_s == pytest.approx(3.5 * expected)
    assert SleepKernel(0.0).seconds(10**9, 1, 8, 64) == 0.0


def test_sleep_kernel_on_a_stream_returns_at_once_and_synchronize_waits(monkeypatch):
    """Note [The emulated GPU stream]: a launch queues the block's seconds and sleeps not at all; the
    host sleeps only in synchronize, exactly until the queued seconds (from the first launch) end."""
    from megatron_fcp.emulate import sleep_kernel

    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(sleep_kernel.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    flops = 4.0 * 1 * 4 * 16 / 2e-5  # 2e-5 s per visible pair: 36 pairs = 0.72 ms forward, 1.8 ms backward
    stream = VirtualStream()
    kern = SleepKernel(flops, stream=stream)
    q = torch.zeros(8, 1, 4, 16, dtype=torch.bfloat16)
    pos = torch.arange(8)
    t0 = time.perf_counter()
    for _ in range(10):
        out, lse = kern.forward(q, q, q, pos, pos, True, 0.25)
        kern.backward(q, q, q, q, out, lse, pos, pos, True, 0.25)
    t1 = time.perf_counter()
    assert kern.modelled_s == pytest.approx(10 * 3.5 * 36 * 2e-5) and slept == []  # nothing slept in the calls
    assert t0 + kern.modelled_s <= stream.busy_until <= t1 + kern.modelled_s     # queued back to back
    kern.synchronize()
    assert len(slept) <= 1 and time.perf_counter() >= stream.busy_until          # the device's queue is done
    n = len(slept)
    kern.synchronize()                                                           # idle: no sleep
    assert len(slept) == n
    kern.reset()
    assert kern.modelled_s == 0.0 and stream.busy_until == 0.0
    before = time.perf_counter()
    stream.launch(0.01)                                                          # after idle, work starts now
    assert before + 0.01 <= stream.busy_until <= time.perf_counter() + 0.01


def test_device_sync_transport_waits_only_before_sending_computed_data():
    from megatron_fcp.attention.comm import Handle, Transport
    from megatron_fcp.emulate.runners import DeviceSyncTransport

    class Kernel:
        syncs = 0

        def synchronize(self):
            self.syncs += 1

    class Inner(Transport):
        def post(self, round_sends, round_recvs, *, round_index, phase="forward"):
            return Handle(phase, round_index)

        def wait(self, handle):
            return None

    kern = Kernel()
    tr = DeviceSyncTransport(Inner(), kern)
    x = torch.zeros(2)
    for phase, sends, syncs in (("forward", [(None, x)], 0), ("resend", [(None, x)], 0), ("backward", [], 0),
                                ("backward", [(None, x)], 1), ("te-backward", [(None, x)], 2),
                                ("te-forward", [(None, x)], 2)):
        tr.wait(tr.post(sends, [], round_index=0, phase=phase))
        assert kern.syncs == syncs, phase


def _shape(h, d):
    from megatron_fcp.cost.model import AttentionShape

    return AttentionShape(64, h, h, d, 2)


def test_sleeper_pays_back_oversleep():
    """Each sleep is shortened by what earlier ones overslept: the total stays on target."""
    s = Sleeper()
    t0 = time.perf_counter()
    for _ in range(20):
        s.sleep(0.002)
    total = time.perf_counter() - t0
    assert s.requested_s == pytest.approx(0.04)
    assert s.slept_s <= s.requested_s + 0.02  # at most the last sleep's overshoot beyond the target
    assert total >= 0.04 - 1e-3


# ---- workloads, predictions, JSON --------------------------------------------------------------------
def _prepared(nic="rail", docs=None):
    spec = ClusterSpec(2, 2, nic, prefix="fcpe1x")
    topo = emulated_topology(spec)
    cm = ComputeModel(flops=400e12 / spec.time_scale, kernel_overhead_s=0.0)
    shape = WorkloadShape(1024, 4, 4, 32, True, docs, block_tokens=256)
    ws = make_workloads(["te-p2p", "te-a2a-p2p", "fcp-auto", "fcp-ring", "fcp-hp"], shape, topo, cm)
    return spec, topo, cm, shape, ws


def test_workloads_plans_predictions_and_the_hook():
    spec, topo, cm, shape, ws = _prepared()
    by = {w.name: w for w in ws}
    te = by["te-a2a-p2p"]
    assert te.unavailable is None and te.hp_plan.degree == 2 and te.hp_plan.head_groups == ((0, 1), (2, 3))
    assert te.hp_plan.kv_plan.name == "ring" and te.backward_kv == "keep"
    assert by["fcp-hp"].hp_plan.auto and by["fcp-hp"].info["choice"]["label"]  # every candidate recorded
    assert by["fcp-auto"].plan.name in ("hierarchical", "full", "ring", "leader", "spanning")
    assert by["fcp-ring"].plan.name == "ring"
    pred = {w.name: w.predict(topo, cm) for w in ws}
    from megatron_fcp.cost.head_parallel import simulate_head_parallel

    # the model of what runs (keep, wave by wave, partials in the KV dtype, one Q|K|V all-to-all as TE
    # posts it) and TE's own model: the same forward
    assert not te.overlap_q and by["fcp-hp"].overlap_q
    want = simulate_head_parallel(te.hp_plan, topo, shape.attention(), compute_model=cm, backward=WaveBackward("keep"),
                                  overlap_q=False)
    assert pred["te-a2a-p2p"]["predicted_s"] == pytest.approx(want.total_s, rel=1e-12)
    assert pred["te-a2a-p2p"]["predicted_fwd_s"] == pytest.approx(pred["te-a2a-p2p"]["predicted_te_model_fwd_s"],
                                                                 rel=1e-4)
    assert pred["fcp-auto"]["predicted_s"] < pred["te-p2p"]["predicted_s"]
    assert pred["fcp-hp"]["predicted_s"] <= pred["fcp-auto"]["predicted_s"] * 1.0001  # a = 1 is a candidate
    b = lower_bounds(shape, topo, cm, None)
    assert b["lower_bound_s"] <= min(p["predicted_s"] for p in pred.values())
    assert b["lower_bound_comm_s"] == pytest.approx(2 * b["lower_bound_comm_fwd_s"])  # dK/dV in the KV's bytes
    assert "lower_bound_fp32_grads_s" not in b
    with pytest.raises(ValueError, match="--workloads"):
        make_workloads(["fcp-nope"], shape, topo)
    with pytest.raises(ValueError, match="@keep"):
        make_workloads(["te-p2p@keep"], shape, topo)
    with pytest.raises(ValueError, match="fcp-hp takes no /PARTS"):
        make_workloads(["fcp-hp@keep/2"], shape, topo)
    gqa = make_workloads(["te-a2a-p2p"], WorkloadShape(1024, 4, 1, 32), topo)[0]
    assert "KV heads (1) divisible by the 2 ranks per node" in gqa.unavailable
    keep, resend, four = make_workloads(["fcp-auto@keep", "fcp-auto@resend", "fcp-hierarchical/4"], shape, topo)
    assert (keep.backward_kv, resend.backward_kv) == ("keep", "resend")
    assert four.plan.parts_per_chunk == 4 and four.plan.name == "hierarchical"
    assert keep.predict(topo, cm)["predicted_s"] < resend.predict(topo, cm)["predicted_s"]


def test_windowed_workloads_refuse_tes_p2p_and_price_what_runs():
    """Under a window: te-p2p / te-a2a-p2p refused with TE's reason (not run, not priced); te-a2a (degree
    cp, one head group, no KV stage) priced by TE's a2a model; FCP's plans built under the window and
    priced as the executor runs them; fcp-hp the runtime's windowed choice."""
    from megatron_fcp.cost.model import simulate_plan
    from megatron_fcp.cost.te import simulate_te_a2a

    topo = emulated_topology(ClusterSpec(2, 4))
    cm = ComputeModel(flops=4e10, kernel_overhead_s=0.0)
    shape = WorkloadShape(4096, 8, 8, 64, window=(128, -1))
    assert shape.window == (128, 0) and shape.describe()["window"] == [128, 0]  # causal: right side 0
    names = ["te-p2p", "te-a2a-p2p", "te-a2a", "fcp-auto", "fcp-full/2", "fcp-hp"]
    by = {w.name: w for w in make_workloads(names, shape, topo, cm)}
    for name, comm in (("te-p2p", "p2p"), ("te-a2a-p2p", "a2a+p2p")):
        assert by[name].unavailable == f"not available: TE refuses sliding windows with cp_comm_type={comm}"
        assert by[name].predict(topo, cm)["predicted_s"] is None
    te = by["te-a2a"]
    assert te.unavailable is None and te.hp_plan.degree == 8 and te.hp_plan.kv_plan is None
    assert te.hp_plan.head_groups == (tuple(range(8)),)
    kw = {"causal": True, "window": (128, 0), "compute_model": cm}
    want = sum(simulate_te_a2a(topo, range(8), shape.attention(), backward=b, **kw).total_s for b in (False, True))
    assert te.predict(topo, cm)["predicted_s"] == pytest.approx(want, rel=1e-12)
    for name in ("fcp-auto", "fcp-full/2", "fcp-hp"):
        w = by[name]
        assert isinstance(w, FcpWorkload) and w.plan.window == (128, 0), name
        fwd = simulate_plan(w.plan, topo, shape.attention(), compute_model=cm)
        bwd = simulate_backward_waves(w.plan, topo, shape.attention(), compute_model=cm, backward_kv=w.executor_kv,
                                      buffered_sends=True)
        assert w.predict(topo, cm)["predicted_s"] == pytest.approx(fwd.total_s + bwd["bwd_s"], rel=1e-12), name
    choice = choose_schedule(topo, range(8), shape.attention(), causal=True, grad_dtype_bytes=2, compute_model=cm,
                             backward=WaveBackward("auto", buffered_sends=True), window=(128, 0))
    assert by["fcp-hp"].info["choice"]["label"] == choice.label
    assert by["fcp-hp"].plan.rounds == choice.plan.kv_plan_for(0).rounds
    # the window's need sets: FCP's plans move less than the causal plan's; the bound is the window's
    causal = make_workloads(["fcp-full"], replace(shape, window=None), topo, cm)[0]
    sent = lambda w: simulate_plan(w.plan, topo, shape.attention(), compute_model=cm).bytes
    assert sent(by["fcp-full/2"]) < sent(causal) / 4
    assert lower_bounds(shape, topo, cm)["lower_bound_s"] < lower_bounds(replace(shape, window=None), topo,
                                                                          cm)["lower_bound_s"]
    # TE's a2a needs heads and KV heads divisible by cp; without a window te-p2p runs again
    gqa = make_workloads(["te-a2a"], replace(shape, kv_heads=2), topo, cm)[0]
    assert gqa.unavailable and "divisible by the CP size 8" in gqa.unavailable
    assert gqa.predict(topo, cm)["predicted_s"] is None
    plain = make_workloads(["te-p2p", "te-a2a"], replace(shape, window=None), topo, cm)
    assert all(w.unavailable is None for w in plain)


def test_cli_window_flag():
    import argparse

    from megatron_fcp.commands import bench as bench_cmd

    p = argparse.ArgumentParser()
    bench_cmd.add_arguments(p)
    cfg = bench_cmd.config_from_args(p.parse_args(["--emulate", "--heads", "8", "--window", "512,0"]))
    assert cfg.shape.window == (512, 0)
    assert bench_cmd.config_from_args(p.parse_args(["--emulate"])).shape.window is None
    with pytest.raises(ValueError, match="--window"):
        bench_cmd.config_from_args(p.parse_args(["--emulate", "--window", "512"]))
    with pytest.raises(ValueError, match="right side must be 0"):
        bench_cmd.config_from_args(p.parse_args(["--emulate", "--window", "512,4"]))


# (nodes, ranks per node, workload, shape): the choice is a = 2 with stagger 4 (keep), a = 1 with 2
# parts (auto re-sends) and a = 1 whole chunks (@resend)
HP_CASES = [(2, 2, "fcp-hp", WorkloadShape(1024, 4, 4, 32)), (2, 2, "fcp-hp", WorkloadShape(8192, 2, 1, 32)),
            (2, 2, "fcp-hp@resend", WorkloadShape(1024, 4, 1, 32))]


@pytest.mark.parametrize("nodes, rpn, name, shape", HP_CASES)
def test_fcp_hp_runs_what_the_runtime_chooses(nodes, rpn, name, shape):
    """fcp-hp is choose_schedule's choice with the executor's backward (what settle_schedule asks
    for), on the emulated compute model: the same plan (degree, graph, parts, stagger), the same
    backward KV mode, and a prediction equal to the choice's predicted time."""
    spec = ClusterSpec(nodes, rpn, "rail", prefix="fcpe1x")
    topo, cm = emulated_topology(spec), ComputeModel(flops=400e12 / spec.time_scale, kernel_overhead_s=0.0)
    w = make_workloads([name], shape, topo, cm)[0]
    mode = name.partition("@")[2] or "auto"
    ranks = tuple(range(topo.world))
    choice = choose_schedule(topo, ranks, shape.attention(), causal=True, grad_dtype_bytes=2,
                             backward=WaveBackward(mode, buffered_sends=True), compute_model=cm)
    assert w.info["choice"]["label"] == choice.label and w.info["head_parallel"] == choice.degree
    assert w.info["choice"]["runner_up"]["label"] == choice.runner_up[0]
    assert w.info["choice"]["predicted_ms"] == pytest.approx(choice.total_s * 1e3, abs=1e-4)
    assert w.backward_kv == choice.backward_kv and "note" not in w.info  # the executor's mode is the one priced
    if choice.degree == 1:
        assert isinstance(w, FcpWorkload) and w.placement is None
        want = choice.plan.kv_plan_for(0)
        assert (w.plan.rounds, w.plan.ranks, w.plan.parts_per_chunk) == (want.rounds, want.ranks, choice.parts)
    else:
        assert isinstance(w, HeadParallelWorkload) and w.hp_plan == choice.plan and w.info["stagger"] == choice.stagger
    pred = w.predict(topo, cm)
    assert pred["predicted_s"] == pytest.approx(choice.total_s, rel=1e-9)
    assert pred["predicted_bwd_s"] == pytest.approx(choice.bwd_s, rel=1e-9)
    assert pred["predicted_bwd_waves"] >= 1


def test_predictions_price_the_wave_backward():
    """FCP's predicted backward is simulate_backward_waves' total for the plan and mode that run (not
    the one-pass model); each workload's mode is the executor's (choose_backward_kv on the block
    bytes its layout has), which the cost model's own auto decision matches; the runner passes the
    mode as given (``executor_kv``), so auto's kept first step is priced as it runs."""
    spec, topo, cm, shape, ws = _prepared()
    att = shape.attention()
    for name in ("fcp-auto", "fcp-auto@keep", "fcp-auto@resend", "fcp-ring/3"):
        w = make_workloads([name], shape, topo, cm)[0]
        # the mode as given (auto may keep the backward's first step: Note [Streaming chain backward])
        waves = simulate_backward_waves(w.plan, topo, att, compute_model=cm, backward_kv=w.executor_kv,
                                        buffered_sends=True)  # the emulator's gloo over TCP
        assert waves["backward_kv"] == w.backward_kv
        pred = w.predict(topo, cm)
        assert pred["predicted_bwd_s"] == pytest.approx(waves["bwd_s"], rel=1e-12)
        assert pred["predicted_bwd_waves"] == waves["waves"] and pred["predicted_resend_s"] == waves["resend_s"]
        one = simulate_plan_backward(w.plan, topo, att, compute_model=cm, backward_kv=w.backward_kv)
        assert pred["predicted_bwd_s"] != pytest.approx(one.total_s, rel=1e-6)
        auto = simulate_backward_waves(w.plan, topo, att, compute_model=cm, backward_kv="auto")["backward_kv"]
        assert executor_program("auto", w.plan, 1024, 4, 32).mode == auto
    resend = make_workloads(["fcp-auto@resend"], shape, topo, cm)[0].predict(topo, cm)
    assert resend["predicted_resend_s"] > 0
    packed = make_workloads(["fcp-auto"], WorkloadShape(1024, 4, 4, 32, True, (300, 40, 679, 5), block_tokens=256),
                            topo, cm)[0]
    waves = simulate_backward_waves(packed.plan, topo, packed.shape.attention(), compute_model=cm, backward_kv="auto",
                                    buffered_sends=True)
    assert packed.backward_kv == waves["backward_kv"]
    assert packed.predict(topo, cm)["predicted_bwd_s"] == pytest.approx(waves["bwd_s"], rel=1e-12)


def test_plan_block_tokens_are_the_layouts():
    """The one rule for a block's size (``Plan.block_tokens``, what the backward program and the
    cost model count with) is the executor's receive buffer (the layout's block tokens): uneven
    zigzag parts, a packed placement and a head-parallel KV stage (group placement)."""
    from megatron_fcp.attention.layout import PlacementLayout, ZigzagLayout

    spec, topo, cm, shape, ws = _prepared()
    plan = make_workloads(["fcp-ring/3"], shape, topo, cm)[0].plan        # 128-token chunks: parts 43, 43, 42
    for r in plan.ranks:
        lay = ZigzagLayout(plan.ranks, r, 1024 // plan.cp, 3, True)
        assert {plan.block_tokens(b, 1024) for b in plan.local_blocks(r)} == {43, 42}
        assert all(plan.block_tokens(b, 1024) == lay.block_tokens(b) for b in plan.blocks())
    packed = WorkloadShape(1024, 4, 4, 32, True, (300, 40, 679, 5), block_tokens=256)
    plan = make_workloads(["fcp-auto"], packed, topo, cm)[0].plan
    for r in plan.ranks:
        lay = PlacementLayout(plan.placement, plan.ranks, r)
        assert all(plan.block_tokens(b) == lay.block_tokens(b) for b in plan.blocks())
    hp = next(w for w in ws if w.name == "fcp-hp").hp_plan
    assert hp.degree == 2
    stage = hp.kv_plan_for(0)
    for r in stage.ranks:
        lay = PlacementLayout(stage.placement, stage.ranks, r)
        assert all(stage.block_tokens(b) == lay.block_tokens(b) for b in stage.blocks())


def test_packed_workloads_use_the_placement_and_tes_padding():
    spec, topo, cm, shape, ws = _prepared(docs=(300, 40, 700, 5))
    assert "zigzag" in next(w for w in ws if w.name == "te-a2a-p2p").unavailable  # TE's model is its prediction
    fcp = next(w for w in ws if w.name == "fcp-auto")
    assert fcp.placement is not None and fcp.plan.placement is fcp.placement
    pred = {w.name: w.predict(topo, cm)["predicted_s"] for w in ws}
    assert all(v and v > 0 for v in pred.values())
    assert lower_bounds(shape, topo, cm, fcp.plan)["lower_bound_s"] > 0


@pytest.mark.parametrize("mode", ["auto", "resend"])
def test_packed_fcp_hp_runs_the_runtimes_degree(mode):
    """fcp-hp on a packed batch is the runtime's degree choice (choose_packed_plan: choose_packed_head_parallel over
    every degree, the runtime's graph and block tokens, the emulated compute model and gloo's
    timeline): degree 2 here, the packed head-parallel engine over the chosen plan, its backward KV
    mode the executor's (compile_backward on a stage's plan), and a prediction equal to the choice's
    time; the same choice without pruning. Under a window the stage is not run (degree 1, as the
    runtime's windowed layers), nor is a degree chosen."""
    from megatron_fcp.cost.head_parallel import stage_shape
    from megatron_fcp.cost.head_parallel_packed import PackedAsRun
    from megatron_fcp.emulate.workloads import GLOO_TCP, PackedHeadParallelWorkload
    from megatron_fcp.planner.head_parallel import choose_packed_head_parallel
    from megatron_fcp.schedule.program import BackwardPolicy, compile_backward

    spec, topo, cm, shape, _ = _prepared(docs=(300, 40, 700, 5))
    shape = replace(shape, backward_kv=mode)
    hp = make_workloads([f"fcp-hp@{mode}"], shape, topo, cm)[0]
    plans: dict = {}
    full = choose_packed_head_parallel(topo, range(4), shape.doc_lengths, shape.attention(), graph="auto",
                                       block_tokens=256, compute_model=cm, plans=plans, backward_kv=mode,
                                       prune=False, **GLOO_TCP)
    assert full[0] == hp.info["head_parallel"] == 2 and isinstance(hp, PackedHeadParallelWorkload)
    assert hp.hp_plan.placement == plans[2].placement and hp.hp_plan.head_groups == ((0, 1), (2, 3))
    assert hp.info["degree_times"][2] == pytest.approx(full[1][2], rel=1e-12)
    stage = hp.hp_plan.kv_plan_for(0)
    assert hp.backward_kv == compile_backward(stage, stage_shape(hp.hp_plan, shape.attention()).kv_bytes(1),
                                              BackwardPolicy(mode)).mode
    pred = hp.predict(topo, cm)
    assert pred["predicted_s"] == pytest.approx(full[1][2], rel=1e-12)
    priced = PackedAsRun(hp.hp_plan, topo, shape.attention(), compute_model=cm, backward_kv=mode, **GLOO_TCP)
    assert priced.result()["backward_kv"] == hp.backward_kv               # the mode priced is the one run
    assert pred["predicted_s"] == pytest.approx(pred["predicted_fwd_s"] + pred["predicted_bwd_s"], rel=1e-12)
    assert 0 < pred["predicted_comm_s"] and 0 < pred["predicted_compute_s"] and pred["predicted_bwd_waves"] >= 1
    assert (pred["predicted_resend_s"] > 0) == (hp.backward_kv == "resend")
    windowed = make_workloads(["fcp-hp"], replace(shape, window=(64, 0)), topo, cm)[0]
    assert isinstance(windowed, FcpWorkload) and windowed.info["head_parallel"] == 1
    assert windowed.info["degree_times"] == {} and windowed.plan.window == (64, 0)


def test_packed_fcp_hp_runs_te_layout_where_the_runtime_would(monkeypatch):
    """Where the runtime's choice is Transformer Engine's layout (Note [TE's layout as a candidate]),
    fcp-hp runs that: at degree 1 a plain FCP workload over TE's per-document zigzag, its backward on
    the ring, at degree 2 the packed head-parallel engine over the chosen stage. (The emulated batches are
    communication-bound, so the choice is forced here.)"""
    from megatron_fcp.contract.placement import thd_placement
    from megatron_fcp.emulate import workloads as wl
    from megatron_fcp.planner.head_parallel import packed_degree_plan
    from megatron_fcp.planner.packed_choice import PackedChoice

    spec, topo, cm, shape, _ = _prepared(docs=(300, 40, 700, 5))
    for degree in (1, 2):
        choice = PackedChoice(degree, "thd")
        plan = packed_degree_plan(topo, range(4), shape.doc_lengths, shape.attention(), degree, layout="thd")
        monkeypatch.setattr(wl, "packed_hp_choice", lambda *a, c=choice, p=plan: (c, {}, {c: p}))
        w = make_workloads(["fcp-hp"], shape, topo, cm)[0]
        assert w.info["layout"] == "thd" and w.info["head_parallel"] == degree
        if degree == 1:
            assert isinstance(w, FcpWorkload) and w.plan.backward_plan.name == "ring"   # the backward on the ring
            assert w.info["graph"] == w.plan.name
            assert w.info.get("backward_graph") == (None if w.plan.backward is None else "ring")
            assert w.plan.placement == thd_placement(shape.doc_lengths, 4)
        else:
            assert w.hp_plan is plan and w.hp_plan.kv_plan.backward_plan.name == "ring"


def test_packed_lower_bound_over_degrees():
    """Note [Packed lower bound over degrees]: degree 1 is twice the placement's need-set bound;
    degree a adds its four all-to-alls' busiest receivers over the intra-node ingress to the KV
    stage's need-set bound both ways; the configuration's all-families bound is the least, with the
    same compute; no degree's plan is priced below its own bound."""
    from megatron_fcp.cost.floors import intra_ingress
    from megatron_fcp.cost.head_parallel import stage_shape
    from megatron_fcp.cost.head_parallel_packed import packed_as_run, packed_stage_plan
    from megatron_fcp.planner.compare import packed_lower_bound_all, packed_need_stats
    from megatron_fcp.planner.head_parallel import packed_degree_plan

    spec, topo, cm, shape, ws = _prepared(docs=(300, 40, 700, 5))
    att = shape.attention()
    fcp = next(w for w in ws if w.name == "fcp-auto")
    plans = {a: fcp.plan if a == 1 else packed_degree_plan(topo, range(4), shape.doc_lengths, att, a, graph="full",
                                                          block_tokens=256) for a in (1, 2)}   # the degrees of 2 x 2
    got = packed_lower_bound_all(plans, topo, att)
    assert got["per_degree"][1] == pytest.approx(2 * packed_need_stats(fcp.plan, topo, att)["lower_bound_s"])
    hp = plans[2]
    tokens = [hp.placement.tokens(i) for i in range(4)]                     # member tokens, groups (0, 1), (2, 3)
    per_tok = {"qkv": (att.q_bytes(1) + att.kv_bytes(1)) / 2, "o": att.o_bytes(1) / 2}
    # each member receives its partner's rows of its shard: the busiest receiver's partner holds the most
    a2a = 2 * sum(max(tokens[1 - j % 2 + 2 * (j // 2)] * per for j in range(4)) for per in per_tok.values())
    stage = packed_need_stats(packed_stage_plan(hp), topo, stage_shape(hp, att))["lower_bound_s"]
    assert got["per_degree"][2] == pytest.approx(a2a / intra_ingress(topo, 0) + 2 * stage)
    whole = packed_degree_plan(topo, range(4), shape.doc_lengths, att, 4, graph="full", block_tokens=256)
    assert whole.kv_plan is None and packed_lower_bound_all({4: whole}, topo, att)["lower_bound_s"] > 0  # a2a alone
    assert got["lower_bound_s"] == min(got["per_degree"].values()) == got["per_degree"][got["degree"]]
    fwd, bwd = (packed_lower_bound_all(plans, topo, att, pass_=p)["per_degree"] for p in ("fwd", "bwd"))
    for a in plans:  # the passes add up; the forward is the half with Q|K|V in and O out
        assert fwd[a] + bwd[a] == pytest.approx(got["per_degree"][a])
    assert fwd[1] == pytest.approx(bwd[1]) and fwd[2] == pytest.approx(
        (max(tokens[1 - j % 2 + 2 * (j // 2)] for j in range(4)) * sum(per_tok.values())) / intra_ingress(topo, 0) + stage)
    with pytest.raises(ValueError):
        packed_lower_bound_all(plans, topo, att, pass_="forward")
    with pytest.raises(ValueError, match="no plans"):
        packed_lower_bound_all({}, topo, att)
    bounds = lower_bounds(shape, topo, cm, fcp.plan)
    assert bounds["lower_bound_all_families_s"] == pytest.approx(max(bounds["lower_bound_compute_s"], got["lower_bound_s"]))
    assert bounds["lower_bound_all_families_s"] <= bounds["lower_bound_s"]
    for a, plan in plans.items():
        assert packed_as_run(plan, topo, att, compute_model=cm)["total_s"] >= got["per_degree"][a] * (1 - 1e-9)


def test_result_json_shape_and_table():
    spec, topo, cm, shape, ws = _prepared(docs=(300, 40, 700, 5))
    ws = [w for w in ws if w.name != "fcp-hp"]
    preds = {w.name: w.predict(topo, cm) for w in ws}
    bounds = lower_bounds(shape, topo, cm, ws[2].plan)
    times = {w.name: {"overlap": [1.0, 1.2, 0.9], "comm": [0.8], "compute": [0.1]} for w in ws if not w.unavailable}
    res = assemble(spec, shape, ws, preds, bounds, {"times": times, "modelled_compute_s": {}}, {"setup_s": 0.1})
    json.loads(json.dumps(res))  # serialisable
    assert len(res["runs"]) == 4
    for r in res["runs"]:
        assert RUN_KEYS <= set(r), RUN_KEYS - set(r)
        assert r["intra"] == "360mbit" and r["inter"] == "40mbit" and r["nic"] == "rail"
    te = next(r for r in res["runs"] if r["workload"] == "te-p2p")
    assert (te["median_s"], te["min_s"], te["max_s"]) == (1.0, 0.9, 1.2)
    assert te["prediction_error"] == pytest.approx(1.0 / te["predicted_s"] - 1)
    hp = next(r for r in res["runs"] if r["workload"] == "te-a2a-p2p")
    assert hp["available"] is False and hp["median_s"] is None and "not emulated" in hp["reason"]
    text = table(res)
    assert "te-a2a-p2p" in text and "n/a" in text and "lower bound" in text


def test_calibrated_predictions_keep_the_plans_and_add_the_latency():
    from megatron_fcp.emulate.bench import BenchConfig, predict_calibrated, prepare

    cfg = BenchConfig(ClusterSpec(2, 2, "rail", 360e6, 40e6), WorkloadShape(1024, 4, 4, 32, True, None, block_tokens=256),
                      ("te-p2p", "te-a2a-p2p", "fcp-auto", "fcp-hp"))
    topo, cm, ws, _, nominal = prepare(cfg)
    plans = {w.name: (w.info.get("graph"), w.info.get("rounds"), w.info.get("backward_kv")) for w in ws}
    same, fit0 = predict_calibrated(cfg, ws, cm, nominal, [])
    assert fit0 == {"intra_latency_s": 0.0, "inter_latency_s": 0.0}
    for w in ws:
        assert same[w.name]["predicted_s"] == pytest.approx(nominal[w.name]["predicted_s"])
        assert same[w.name]["predicted_nominal_s"] == nominal[w.name]["predicted_s"]
    slow = [{"link": "intra", "src": 0, "dst": 1, "bytes": n,
             "times_s": [probe.modelled_s(topo, 0, 1, n) + 2e-3]} for n in probe.PROBE_BYTES]
    cal, fit = predict_calibrated(cfg, ws, cm, nominal, slow)
    assert fit["intra_latency_s"] == pytest.approx(2e-3) and fit["inter_latency_s"] == 0.0
    for w in ws:  # every schedule here sends inside a node: each pays the latency, none is re-planned
        assert cal[w.name]["predicted_s"] > nominal[w.name]["predicted_s"]
        assert cal[w.name]["predicted_nominal_s"] == nominal[w.name]["predicted_s"]
    assert {w.name: (w.info.get("graph"), w.info.get("rounds"), w.info.get("backward_kv")) for w in ws} == plans


def test_paced_rates_keep_the_ratio_the_plans_and_the_regime():
    from megatron_fcp.emulate.bench import MAX_SLOWDOWN, BenchConfig, paced, prepare

    shape = WorkloadShape(1024, 4, 4, 32, True, None, block_tokens=256)
    fast = BenchConfig(ClusterSpec(2, 2, "rail", 360e6, 40e6), shape, ("te-p2p", "fcp-auto", "fcp-hp"))
    _, _, ws, _, pred = prepare(fast)
    fastest = min(p["predicted_s"] for p in pred.values())
    assert fastest < 0.5 / MAX_SLOWDOWN  # a short step: divided by the most allowed
    slow = paced(fast)
    assert slow.cluster.intra_bps == 360e6 / MAX_SLOWDOWN and slow.cluster.inter_bps == 40e6 / MAX_SLOWDOWN
    assert slow.cluster.time_scale == pytest.approx(MAX_SLOWDOWN * fast.cluster.time_scale)
    assert slow.emulated_flops == pytest.approx(fast.emulated_flops / MAX_SLOWDOWN)
    _, _, ws2, _, pred2 = prepare(slow)
    for a, b in zip(ws, ws2):  # the same plans; every time stretched by the same factor
        assert (a.info.get("graph"), a.info.get("rounds"), (a.info.get("choice") or {}).get("label")) == \
            (b.info.get("graph"), b.info.get("rounds"), (b.info.get("choice") or {}).get("label"))
        assert pred2[a.name]["predicted_s"] == pytest.approx(MAX_SLOWDOWN * pred[a.name]["predicted_s"], rel=1e-9)
    # a step already long enough keeps its rates; the real CPU kernels are never paced
    assert paced(fast, min_step_s=fastest) == fast
    assert paced(fast, min_step_s=1.5 * fastest).cluster.intra_bps == 180e6
    assert paced(replace(fast, compute="cpu")) == replace(fast, compute="cpu")


def test_head_parallel_runs_in_the_json():
    spec, topo, cm, shape, ws = _prepared()
    preds = {w.name: w.predict(topo, cm) for w in ws}
    times = {w.name: {"overlap": [0.5, 0.4, 0.6], "comm": [0.3], "compute": [0.1]} for w in ws}
    res = assemble(spec, shape, ws, preds, lower_bounds(shape, topo, cm), {"times": times}, {})
    runs = {r["workload"]: r for r in json.loads(json.dumps(res))["runs"]}
    for name in ("te-a2a-p2p", "fcp-hp"):
        r = runs[name]
        assert r["available"] and r["median_s"] == 0.5 and RUN_KEYS <= set(r)
        assert r["info"]["head_parallel"] >= 1 and r["info"]["head_groups"] and r["info"]["backward_kv"]
    assert runs["te-a2a-p2p"]["predicted_te_model_s"] > 0 and runs["te-a2a-p2p"]["info"]["graph"] == "a2a x2 + ring"
    assert res["bounds"]["lower_bound_all_families_s"] <= res["bounds"]["lower_bound_s"]
    assert "te-a2a-p2p" in table(res)


def test_progress_printer_lines():
    import io

    buf = io.StringIO()
    show = progress_printer(buf, tty=False)
    show("@progress 3 12 fcp-auto overlap 0.4700")
    assert buf.getvalue() == "[#######-----------------------] 3/12 fcp-auto overlap 0.470s\n"


# ---- the smoke run (root) ------------------------------------------------------------------------------
def _root_skip_reason():
    missing = netns.missing_prerequisites()
    return "emulator smoke run needs " + "; ".join(missing) if missing else None


@pytest.mark.slow
@pytest.mark.skipif(_root_skip_reason() is not None, reason=str(_root_skip_reason()))
def test_smoke_run_brings_up_measures_and_tears_down():
    from megatron_fcp.emulate.bench import BenchConfig, run_bench

    cfg = BenchConfig(ClusterSpec(2, 2, "rail", 360e6, 40e6, prefix=netns.run_prefix()),
                      WorkloadShape(512, 2, 2, 32), ("te-p2p", "fcp-auto"), repeats=1, component_repeats=1,
                      warmup=0, timeout_s=120)
    before = set(netns.list_namespaces("fcpe"))
    res = run_bench(cfg)  # about 45 s on 2 busy cores, mostly process start-up
    assert set(netns.list_namespaces("fcpe")) <= before  # nothing left behind
    for r in res["runs"]:
        assert r["available"] and r["median_s"] > 0 and r["comm_s"] > 0 and r["compute_s"] >= 0
        assert math.isfinite(r["predicted_s"]) and r["lower_bound_s"] > 0
    assert res["setup_s"] > 0 and res["teardown_s"] >= 0
    probed = {(e["link"], e["bytes"]) for e in res["link_probe"] if e["median_s"] > 0 and e["modelled_s"] > 0}
    assert probed == {(link, n) for link in ("intra", "inter") for n in probe.PROBE_BYTES}
    assert set(res["latency_fit"]) == {"intra_latency_s", "inter_latency_s"} and min(res["latency_fit"].values()) >= 0
    assert all(r["predicted_nominal_s"] <= r["predicted_s"] + 1e-12 for r in res["runs"])  # latency only adds
    assert not _children("megatron_fcp.emulate.worker")  # every rank process reaped


def _children(needle: str) -> list[int]:
    """Live child processes of this one whose command line contains ``needle``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and needle in cmd:
            found.append(int(pid))
    return found


def test_a_failed_rank_log_is_in_the_message_even_without_a_traceback(tmp_path):
    """A rank that aborts natively (SIGABRT: no Python traceback) still has its log tail in the
    LaunchError, so the message says where it stopped."""
    from megatron_fcp.emulate.launcher import _failure

    logs = []
    for r, text in enumerate(("@progress 1 2 fcp overlap 0.1\n", "fine\n", "[c10d] last words\n")):
        logs.append(tmp_path / f"rank{r}.log")
        logs[-1].write_text(text)
    msg = _failure("rank 2 exited with code -6", logs, {2})
    assert "--- rank 0" in msg and "--- rank 2" in msg and "last words" in msg and "--- rank 1" not in msg
