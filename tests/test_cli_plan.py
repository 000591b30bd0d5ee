"""`megatron-fcp plan` and `megatron-fcp simulate`: output, --json contract, --plot, errors."""

from __future__ import annotations

import json
import re

import pytest

from megatron_fcp.cli import main


def run_cli(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse rejects bad choices itself (exit status 2)
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_prints_topology_graph_and_rounds(capsys):
    rc, out, err = run_cli(capsys, "plan", "dgx-h100:2", "--graph", "hierarchical", "--cp", "16", "--parts", "2")
    assert rc == 0, err
    assert "topology 'dgx-h100:2': 2 node(s) x 8 GPU(s) = 16 ranks" in out
    assert "graph 'hierarchical': 16 ranks" in out
    assert re.search(r"plan: graph 'hierarchical', cp=16, causal=True, parts/chunk=2, rounds=3, .* verified", out)
    assert len(re.findall(r"^  round \d+ \(\d+\): ", out, flags=re.M)) == 3


def test_plan_megatron_layout_prints_each_cp_group(capsys):
    rc, out, err = run_cli(capsys, "plan", "--topology", "dgx-h100:2", "--megatron-layout", "world=16,tp=2,pp=1,cp=8")
    assert rc == 0, err
    assert "CP group 0/2: global ranks [0, 2, 4, 6, 8, 10, 12, 14]" in out
    assert "CP group 1/2: global ranks [1, 3, 5, 7, 9, 11, 13, 15]" in out
    assert "0:0(n0.0), 1:2(n0.2)" in out and "4:9(n1.1)" in out
    # every printed transfer stays inside its group (odd ranks never meet even ones)
    for block in out.split("CP group")[1:]:
        parity = int(re.search(r"global ranks \[(\d+)", block).group(1)) % 2
        for src, dst in re.findall(r"(\d+)->(\d+):", block):
            assert int(src) % 2 == parity and int(dst) % 2 == parity


def test_plan_backward_and_yaml(capsys, tmp_path):
    from megatron_fcp.topology import load_topology, serialize

    path = tmp_path / "c.yaml"
    serialize.to_yaml(load_topology("pcie-box:2"), path)
    rc, out, err = run_cli(capsys, "plan", str(path), "--ranks", "0,1,8,9", "--graph", "spanning", "--backward")
    assert rc == 0, err
    assert "backward (reversed rounds" in out


def test_simulate_json_contract(capsys):
    rc, out, err = run_cli(capsys, "simulate", "dgx-h100:2", "--seq", "128k", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert isinstance(d["lower_bound_s"], float) and d["lower_bound_s"] > 0
    assert list(d["schedules"]) == ["te-p2p", "te-a2a-p2p", "fcp"]
    for name, s in d["schedules"].items():
        for key in ("comm_s", "compute_s", "total_s", "bytes"):
            assert isinstance(s[key], float) and s[key] > 0, (name, key)
        assert s["total_s"] >= max(s["comm_s"], s["compute_s"]) * (1 - 1e-12)
    assert d["schedules"]["fcp"]["graph"] == "hierarchical"
    assert d["schedules"]["te-p2p"]["comm_s"] >= 2 * d["schedules"]["fcp"]["comm_s"]


def test_simulate_table_and_inapplicable_baseline(capsys):
    rc, out, err = run_cli(capsys, "simulate", "dgx-a100:2", "--seq", "64k", "--heads", "12", "--kv-heads", "4",
                           "--graph", "hierarchical", "--parts", "2", "--dtype", "fp32")
    assert rc == 0, err
    assert re.search(r"^te-a2a-p2p\s+n/a\s+\(te-a2a-p2p: heads \(12\)", out, flags=re.M)
    assert re.search(r"^fcp\s+[\d.]+\s+[\d.]+\s+[\d.]+.*graph=hierarchical parts=2", out, flags=re.M)
    rc, out, err = run_cli(capsys, "simulate", "dgx-a100:2", "--heads", "12", "--kv-heads", "4", "--json")
    d = json.loads(out)
    assert d["schedules"]["te-a2a-p2p"]["comm_s"] is None and "error" in d["schedules"]["te-a2a-p2p"]


def test_simulate_plot_writes_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "fcp.png"
    rc, out, err = run_cli(capsys, "simulate", "dgx-h100:2", "--cp", "8", "--plot", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "dgx-z100:2"], "neither a preset"),
        (["plan"], "topology: give PRESET:NODES"),
        (["plan", "dgx-h100:2", "--cp", "40"], "--cp: must be between 1 and"),
        (["plan", "dgx-h100:2", "--ranks", "0,1,99"], "cp_ranks: rank 99 is missing"),
        (["plan", "dgx-h100:2", "--ranks", "0,x"], "--ranks: expected comma-separated integers"),
        (["plan", "dgx-h100:2", "--graph", "torus"], "invalid choice: 'torus'"),
        (["plan", "dgx-h100:2", "--graph", "balanced"], "invalid choice: 'balanced'"),
        (["plan", "dgx-h100:2", "--megatron-layout", "world=32,tp=2,cp=8"], "world=32 but topology"),
        (["plan", "dgx-h100:2", "--megatron-layout", "world=16,tp=two,cp=8"], "item 'tp=two': expected world=N"),
        (["plan", "dgx-h100:2", "--megatron-layout", "world=16,tp=2"], "cp=N is required"),
        (["plan", "/nonexistent/c.yaml"], "not found"),
        (["simulate", "dgx-h100:2", "--seq", "lots"], "seq: cannot parse"),
        (["simulate", "dgx-h100:2", "--parts", "0"], "--parts: must be >= 1"),
        (["simulate", "dgx-h100:2", "--kv-heads", "5"], "kv_heads: 5 must divide heads"),
        (["simulate", "dgx-h100:2", "--tflops", "0"], "--tflops"),
    ],
)
def test_bad_inputs_name_the_field(capsys, argv, message):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    assert message in err, err


def test_bad_yaml_file(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("node: {gpus: 2, links: [{a: gpu0, b: sw, kind: warp, bandwidth: 1e9}]}\n")
    rc, out, err = run_cli(capsys, "simulate", str(bad))
    assert rc == 2 and "links[0]" in err and "unknown link kind 'warp'" in err
    bad.write_text("node: [unclosed\n")
    rc, out, err = run_cli(capsys, "plan", str(bad))
    assert rc == 2 and "malformed YAML" in err
