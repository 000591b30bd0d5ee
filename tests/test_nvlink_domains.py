"""NVLink domains larger than a host (GB200/GB300 NVL72): routing, graph builders, the cost model
and ``megatron-fcp plan`` treat the domain as the fast tier and the NICs as the slow one; the
domain size comes from NVML fabric ids or a flag (Note [NVLink domains], Note [Detecting NVLink
domains])."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from megatron_fcp.cost.model import AttentionShape, simulate_plan
from megatron_fcp.planner.build import build_plan
from megatron_fcp.topology import Topology, load_topology, serialize
from megatron_fcp.topology import detect as D
from megatron_fcp.topology.detect.fabric import domain_size

SHAPE = AttentionShape(128 * 1024, 32, 8, 128)


def _over_nic(topo, src, dst) -> bool:
    return any(r.name.endswith(">net") for r in topo.route(src, dst).resources)


def test_routes_inside_a_domain_cross_trays_over_nvlink():
    topo = load_topology("gb200-nvl72:36")
    assert (topo.nvlink_domain, topo.domains, topo.gpus_per_node) == (18, 2, 4)
    r = topo.route(1, 70)  # tray 0 -> tray 17, same rack
    assert [x.name for x in r.resources] == ["n0:gpu1>nvswitch", "n17:nvswitch>gpu2"]
    assert r.kind == "nvswitch" and r.bandwidth == pytest.approx(900e9)
    r = topo.route(1, 73)  # rack 0 -> rack 1: over the NICs
    assert _over_nic(topo, 1, 73) and r.kind == "ib"
    # the same trays without the domain: every tray is an island behind its NICs
    islands = Topology("trays", topo.layout, 36)
    assert _over_nic(islands, 1, 70)


@pytest.mark.parametrize("graph", ["hierarchical", "full"])
def test_nvl72_cp64_inside_one_domain_crosses_no_nic(graph):
    topo = load_topology("gb200-nvl72:18")
    plan = build_plan(topo, list(range(64)), graph)
    assert not any(_over_nic(topo, t.src, t.dst) for rnd in plan.rounds for t in rnd)
    res = simulate_plan(plan, topo, SHAPE, compute=False)
    assert res.inter_node_bytes == 0 and res.bytes > 0
    # the cost model prices the trays' NVLink: without the domain the same plan is NIC-bound
    islands = Topology("trays", topo.layout, 18)
    assert simulate_plan(plan, islands, SHAPE, compute=False).comm_s > 3 * res.comm_s


def test_nvl72_cp144_over_two_domains_crosses_nics_only_between_domains():
    topo = load_topology("gb200-nvl72:36")
    plan = build_plan(topo, list(range(144)), "hierarchical")
    moves = [t for rnd in plan.rounds for t in rnd]
    crossing = [t for t in moves if _over_nic(topo, t.src, t.dst)]
    assert crossing and all(topo.domain_of(t.src) != topo.domain_of(t.dst) for t in crossing)
    assert all(_over_nic(topo, t.src, t.dst) for t in moves if topo.domain_of(t.src) != topo.domain_of(t.dst))
    src, dst = np.array([t.src for t in moves]), np.array([t.dst for t in moves])  # the CLI's vectorised rule
    assert ((topo.domains_of(src) != topo.domains_of(dst)) == [_over_nic(topo, t.src, t.dst) for t in moves]).all()
    res = simulate_plan(plan, topo, SHAPE, compute=False)
    assert res.inter_node_bytes > 0
    assert all(k.split(":")[1] in {f"nic{i}>net" for i in range(4)} for k in res.resource_bytes if k.endswith(">net"))


def test_plan_command_shows_nic_crossings(capsys):
    from megatron_fcp.cli import main

    assert main(["plan", "gb200-nvl72:18", "--cp", "64", "--graph", "hierarchical"]) == 0
    out = capsys.readouterr().out
    assert "NVLink domains: 1 of 18 node(s) (72 GPUs)" in out
    assert re.search(r"transfers over NICs: 0 of \d+ ", out) and "(4032 nvswitch)" in out
    assert main(["plan", "gb200-nvl72:36", "--cp", "144", "--graph", "hierarchical"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"transfers over NICs: (\d+) of \d+ \(all between NVLink domains; 2 domain", out)
    assert m and int(m.group(1)) > 0 and "144 ib" in out


def test_domain_yaml_round_trip_and_errors(tmp_path):
    topo = load_topology("gb300-nvl72:36")
    path = tmp_path / "nvl72.yaml"
    serialize.to_yaml(topo, path)
    text = path.read_text()
    assert "nvlink_domain: 18" in text and "domain_switch: nvswitch" in text
    assert load_topology(str(path)) == topo
    with pytest.raises(Exception, match="node.domain_switch is not set"):
        Topology("x", load_topology("dgx-h100:1").layout, 2, nvlink_domain=2)
    with pytest.raises(Exception, match="nvlink_domain: hosts per NVLink domain must be an integer >= 1"):
        Topology("x", topo.layout, 2, nvlink_domain=0)


def test_domain_size_from_fabric_ids():
    assert domain_size([None, None]) is None
    assert domain_size(["a/0"] * 18 + ["b/0"] * 18) == 18
    assert domain_size(["a/0"] * 4 + ["b/0"] * 2) == 4  # a partial last rack
    with pytest.raises(ValueError, match="not consecutive"):
        domain_size(["a/0", "b/0", "a/0"])
    with pytest.raises(ValueError, match="domains of \\[2, 4\\] hosts"):
        domain_size(["a/0"] * 2 + ["b/0"] * 4)
    with pytest.raises(ValueError, match=r"hosts \['h1'\] report no NVLink fabric"):
        domain_size(["a/0", None], ["h0", "h1"])


def test_detect_domain_from_hosts_fabric_or_flag():
    smi = Path(__file__).parent / "fixtures" / "nvidia_smi_topo_dgx_h100.txt"
    names = [f"tray{r // 8}" for r in range(32)]
    plain = D.group_ranks_by_host(names)
    hosts = D.HostGroups(plain.hosts, plain.ranks, ("rack0/1", "rack0/1", "rack1/1", "rack1/1"))
    topo, _ = D.detect_topology_report(nvidia_smi=smi, hosts=hosts)
    assert topo.nvlink_domain == 2 and topo.domains == 2 and not _over_nic(topo, 0, 8) and _over_nic(topo, 0, 16)
    topo, _ = D.detect_topology_report(nvidia_smi=smi, nodes=4, nvlink_domain=4)
    assert topo.domains == 1 and not _over_nic(topo, 0, 31)
    with pytest.raises(ValueError, match="nvlink_domain=4 but NVML's fabric ids put 2"):
        D.detect_topology_report(nvidia_smi=smi, hosts=hosts, nvlink_domain=4)
    pcie = Path(__file__).parent / "fixtures" / "nvidia_smi_topo_pcie_server.txt"
    with pytest.raises(ValueError, match="not on an NVSwitch"):
        D.detect_topology_report(nvidia_smi=pcie, nodes=2, nvlink_domain=2)


def test_topo_command_nvlink_domain_flag(capsys):
    from megatron_fcp.cli import main

    tray = Path(__file__).parent / "fixtures" / "topo_corpus" / "gb200_tray_sglang11208.txt"
    assert main(["topo", "--from-nvidia-smi", str(tray), "--nodes", "36", "--nvlink-domain", "18"]) == 0
    assert "NVLink domains: 2 of 18 node(s) (72 GPUs) over 'nvswitch'" in capsys.readouterr().out
