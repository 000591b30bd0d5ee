"""Topology model: presets, routing over shared resources, YAML round trip, validation errors."""

from __future__ import annotations

import pytest

from megatron_fcp.topology import serialize
from megatron_fcp.topology import (
    GB,
    LINK_KINDS,
    PRESETS,
    Link,
    Nic,
    NodeLayout,
    Topology,
    TopologyError,
    load_topology,
    parse_bandwidth,
    parse_latency,
    preset,
)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_presets_build_and_route_every_pair(name, nodes):
    topo = load_topology(f"{name}:{nodes}")
    assert topo.nodes == nodes and topo.world == nodes * topo.gpus_per_node
    for r in range(topo.world):
        assert topo.node_of(r) == r // topo.gpus_per_node
        assert topo.local_rank_of(r) == r % topo.gpus_per_node
    for a in range(topo.world):
        for b in range(topo.world):
            route = topo.route(a, b)
            if a == b:
                assert route.resources == ()
                continue
            assert route.resources and route.bandwidth > 0 and route.latency > 0
            crosses = any(">net" in r.name or "net>" in r.name for r in route.resources)
            assert crosses == (topo.domain_of(a) != topo.domain_of(b))  # Note [NVLink domains]
            names = [r.name for r in route.resources]
            assert len(set(names)) == len(names), names  # no resource used twice on one path


def test_dgx_h100_is_rail_aligned_with_nvswitch_inside():
    topo = load_topology("dgx-h100:2")
    intra = topo.route(3, 5)
    assert [r.name for r in intra.resources] == ["n0:gpu3>nvswitch", "n0:nvswitch>gpu5"]
    assert intra.bandwidth == 450 * GB and intra.kind == "nvswitch"
    inter = topo.route(3, 8 + 3)
    assert [r.name for r in inter.resources] == ["n0:gpu3>nic3", "n0:nic3>net", "n1:net>nic3", "n1:nic3>gpu3"]
    assert inter.bandwidth == 50 * GB and inter.kind == "ib"
    # different GPUs use different NICs: no shared resource between two rails
    other = topo.route(4, 8 + 4)
    assert not set(inter.resources) & set(other.resources)
    assert topo.node_ingress_bandwidth() == 8 * 50 * GB
    assert topo.gpu_ingress_bandwidth(0) == 450 * GB + 50 * GB  # NVSwitch + own NIC wire


def test_dgx_a100_numbers():
    topo = load_topology("dgx-a100:2")
    assert topo.route(0, 1).bandwidth == 300 * GB
    assert topo.route(0, 8).bandwidth == 25 * GB
    assert topo.node_ingress_bandwidth() == 8 * 25 * GB


def test_single_uplink_shares_one_nic_per_node():
    topo = load_topology("single-uplink:2")
    a, b = topo.route(0, 8), topo.route(5, 13)
    shared = {r.name for r in a.resources} & {r.name for r in b.resources}
    assert {"n0:nic0>net", "n1:net>nic0"} <= shared
    assert topo.node_ingress_bandwidth() == 25 * GB


def test_pcie_box_pairs_share_switch_uplink():
    topo = load_topology("pcie-box")
    pair = [r.name for r in topo.route(0, 1).resources]
    assert pair == ["n0:gpu0>pcisw0", "n0:pcisw0>gpu1"]  # peer-to-peer under one switch
    cross = [r.name for r in topo.route(0, 2).resources]
    assert "n0:pcisw0>cpu" in cross and "n0:cpu>pcisw1" in cross
    # GPU 1 going to GPU 3 shares the switch uplink of pair 0 with GPU 0 going to GPU 2
    assert "n0:pcisw0>cpu" in [r.name for r in topo.route(1, 3).resources]
    assert topo.route(0, 2).bandwidth == 25 * GB


def test_yaml_round_trip(tmp_path):
    for name in PRESETS:
        topo = load_topology(f"{name}:2")
        path = tmp_path / f"{name}.yaml"
        serialize.to_yaml(topo, path)
        again = load_topology(str(path))
        assert again == topo
        last = topo.world - 1
        assert again.route(1, last).resources == topo.route(1, last).resources


def test_explicit_rank_map_overrides_torchrun_order(tmp_path):
    base = load_topology("dgx-h100:2")
    # interleave: even ranks on node 0, odd ranks on node 1
    rm = [(r % 2, r // 2) for r in range(16)]
    topo = base.with_rank_map(rm)
    assert topo.node_of(1) == 1 and topo.local_rank_of(1) == 0
    assert topo.route(0, 2).bandwidth == 450 * GB
    assert topo.route(0, 1).bandwidth == 50 * GB
    path = tmp_path / "interleaved.yaml"
    serialize.to_yaml(topo, path)
    assert load_topology(str(path)).rank_map == topo.rank_map


def test_units_are_parsed():
    assert parse_bandwidth("450GB/s") == 450e9
    assert parse_bandwidth("200Gb/s") == 25e9  # bits
    assert parse_bandwidth("25e9") == 25e9
    assert parse_latency("2us") == pytest.approx(2e-6)
    assert parse_latency(0) == 0.0


@pytest.mark.parametrize(
    "text, bytes_per_s",
    [
        # capital B: bytes; a plain number is bytes/s
        ("25GB/s", 25e9), ("25GBps", 25e9), ("25 GB/s", 25e9), ("12.5MB/s", 12.5e6), ("1TB/s", 1e12), ("8B/s", 8.0),
        (25e9, 25e9), ("25e9", 25e9),
        # lowercase b or "bit": bits, the networking convention ("gbps" is gigabits)
        ("200gbps", 25e9), ("200Gbps", 25e9), ("200Gb/s", 25e9), ("200Gbit/s", 25e9), ("100Mbps", 12.5e6), ("8b/s", 1.0),
    ],
)
def test_bandwidth_units_bytes_vs_bits(text, bytes_per_s):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s, rel=1e-12)


@pytest.mark.parametrize("text", ["25GBPS", "25 parsecs", "GB/s", "25GB/h"])
def test_bandwidth_units_refused(text):
    with pytest.raises(TopologyError, match=r"link\.bandwidth: cannot parse .*200Gbps \(bits\)"):
        parse_bandwidth(text, "link.bandwidth")


def _yaml(tmp_path, text):
    p = tmp_path / "t.yaml"
    p.write_text(text)
    return str(p)


GOOD_NODE = """
node:
  gpus: 2
  links:
    - {a: gpu0, b: sw, kind: pcie, bandwidth: 25e9}
    - {a: gpu1, b: sw, kind: pcie, bandwidth: 25e9}
    - {a: sw, b: nic0, kind: pcie, bandwidth: 25e9}
  nics:
    - {name: nic0, kind: ethernet, bandwidth: 12.5e9}
"""


@pytest.mark.parametrize(
    "text, field",
    [
        ("nodes: [1, 2\nnode: {", "malformed YAML"),
        ("nodes: 2\n", "node: missing"),
        (GOOD_NODE.replace("kind: ethernet", "kind: infiniband"), "nics[0]"),
        (GOOD_NODE.replace("kind: pcie, bandwidth: 25e9}\n    - {a: gpu1", "kind: warp, bandwidth: 25e9}\n    - {a: gpu1"), "links[0]"),
        (GOOD_NODE.replace("bandwidth: 12.5e9", "bandwidth: 0"), "bandwidth"),
        (GOOD_NODE.replace("bandwidth: 12.5e9", "bandwidth: -3"), "bandwidth"),
        (GOOD_NODE.replace("gpus: 2", "gpus: 3"), "gpu2 is not connected"),
        (GOOD_NODE.replace("a: gpu1", "a: gpu7"), "gpu7"),
        (GOOD_NODE + "rank_map: [[0, 0], [0, 5]]\n", "rank_map[1]"),
        (GOOD_NODE + "rank_map: [[0, 0], [0, 0]]\n", "rank_map"),
        (GOOD_NODE + "nodes: 1\nrank_map: [[1, 0]]\n", "rank_map[0]"),
        (GOOD_NODE + "colour: red\n", "unknown field"),
        (GOOD_NODE.replace("    - {a: sw, b: nic0, kind: pcie, bandwidth: 25e9}\n", ""), "NIC 'nic0' is not attached"),
    ],
)
def test_bad_yaml_names_the_field(tmp_path, text, field):
    with pytest.raises(TopologyError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_topology(_yaml(tmp_path, text))


def test_good_yaml_and_kinds(tmp_path):
    topo = load_topology(_yaml(tmp_path, GOOD_NODE + "nodes: 3\n"))
    assert topo.world == 6 and topo.route(0, 5).bandwidth == 12.5e9
    assert set(LINK_KINDS) == {"nvlink", "nvswitch", "pcie", "ib", "ethernet", "loopback"}


def test_bad_spec_strings():
    with pytest.raises(TopologyError, match="neither a preset"):
        load_topology("dgx-z100:2")
    with pytest.raises(TopologyError, match="node count"):
        load_topology("dgx-h100:two")
    with pytest.raises(TopologyError, match="nodes"):
        preset("dgx-h100", 0)
    with pytest.raises(TopologyError, match="not found"):
        load_topology("/nonexistent/cluster.yaml")
    with pytest.raises(TopologyError, match="not in the topology"):
        load_topology("dgx-h100").route(0, 8)


def test_direct_nvlink_mesh_prefers_nvlink_over_pcie():
    links = [Link("gpu0", "gpu1", "nvlink", 100 * GB), Link("gpu0", "cpu", "pcie", 25 * GB),
             Link("gpu1", "cpu", "pcie", 25 * GB), Link("gpu2", "cpu", "pcie", 25 * GB)]
    lay = NodeLayout(3, tuple(links), (), (), "mesh")
    topo = Topology("mesh", lay, 1)
    assert [r.name for r in topo.route(0, 1).resources] == ["n0:gpu0>gpu1"]
    # no transit through a GPU: 2 -> 0 goes over the CPU, not via gpu1
    assert [r.name for r in topo.route(2, 0).resources] == ["n0:gpu2>cpu", "n0:cpu>gpu0"]


def test_multi_node_without_nic_is_rejected():
    lay = NodeLayout(1, (Link("gpu0", "sw", "pcie", 1 * GB),), (), (), "lonely")
    with pytest.raises(TopologyError, match="no NIC"):
        Topology("x", lay, 2)
    with pytest.raises(TopologyError, match="kind"):
        Nic("n", "carrier-pigeon", 1.0)
