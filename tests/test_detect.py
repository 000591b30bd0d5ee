"""Topology detection: nvidia-smi / NCCL XML parsers on real-looking fixtures, hostname grouping,
malformed input, detect_topology's resolution order and the ``megatron-fcp topo`` command."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from megatron_fcp.topology import detect as D
from megatron_fcp.topology import serialize

FIX = Path(__file__).parent / "fixtures"


def _read(name: str) -> str:
    return (FIX / name).read_text()


@pytest.fixture(scope="module")
def a100():
    return D.parse_nvidia_smi_topo(_read("nvidia_smi_topo_dgx_a100.txt"))


@pytest.fixture(scope="module")
def h100():
    return D.parse_nvidia_smi_topo(_read("nvidia_smi_topo_dgx_h100.txt"))


@pytest.fixture(scope="module")
def pcie():
    return D.parse_nvidia_smi_topo(_read("nvidia_smi_topo_pcie_server.txt"))


@pytest.fixture(scope="module")
def h100_xml():
    return D.parse_nccl_topo_xml(_read("nccl_topo_dgx_h100.xml"))


# --- nvidia-smi topo -m ----------------------------------------------------------------------


def test_dgx_a100_nvswitch_and_rail_nics(a100):
    assert a100.num_gpus == 8
    assert len(a100.pairs) == 28
    assert {(p.kind, p.nvlinks) for p in a100.pairs.values()} == {("nvswitch", 12)}
    # mlx5 columns (old driver, no NIC legend): 10 ports, two of them storage (no GPU)
    assert [n.name for n in a100.nics] == [f"mlx5_{i}" for i in range(10)]
    # two GPUs behind one PCIe switch tree with two NICs each get their own NIC (PXB)
    assert a100.gpu_nic == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9")
    assert a100.nic("mlx5_4").gpus == () and a100.nic("mlx5_5").gpus == ()
    assert all(n.paths == ("PXB",) for n in a100.nics if n.gpus)
    assert not a100.uplinks_shared()
    # generation unknown from nvidia-smi: default 25 GB/s per link -> 300 GB/s (NVLink3)
    assert a100.nvlink_gbytes_per_s_per_link is None
    assert a100.pair_bandwidth_gbytes_per_s(0, 7) == pytest.approx(12 * D.DEFAULT_NVLINK_GBYTES_PER_S_PER_LINK)


def test_dgx_h100_nic_legend_and_pix(h100):
    assert h100.num_gpus == 8
    assert {(p.kind, p.nvlinks, p.path) for p in h100.pairs.values()} == {("nvswitch", 18, "NV18")}
    # NIC# columns renamed via the NIC legend; compute NICs are not numbered like the GPUs
    assert h100.gpu_nic == ("mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11")
    storage = [n.name for n in h100.nics if not n.gpus]
    assert storage == ["mlx5_1", "mlx5_2", "mlx5_7", "mlx5_8"]
    for g, name in enumerate(h100.gpu_nic):
        nic = h100.nic(name)
        assert nic.gpus == (g,) and nic.paths == ("PIX",) and nic.direct_gpus == (g,)
    assert h100.pair_bandwidth_gbytes_per_s(3, 4) == pytest.approx(450.0)


def test_pcie_server_kinds_and_shared_nic(pcie):
    assert pcie.num_gpus == 8
    assert pcie.link(0, 1) == D.PairLink("pcie-switch", 0, "PIX")
    assert pcie.link(2, 0).kind == "pcie-bridges"  # order does not matter
    assert pcie.link(5, 4).path == "PIX" and pcie.link(4, 6).path == "PXB"
    assert pcie.link(3, 4).kind == "cross-socket"
    counts = {}
    for p in pcie.pairs.values():
        counts[p.path] = counts.get(p.path, 0) + 1
    assert counts == {"PIX": 4, "PXB": 8, "SYS": 16}
    (nic,) = pcie.nics
    assert nic.name == "mlx5_0" and nic.gpus == tuple(range(8)) and nic.shared
    assert nic.direct_gpus == (0, 1, 2, 3)  # socket-1 GPUs reach it across the SMP link
    assert nic.paths[4:] == ("SYS",) * 4
    assert pcie.uplinks_shared()
    assert pcie.pair_bandwidth_gbytes_per_s(0, 1) == D.DEFAULT_PCIE_GBYTES_PER_S["PIX"]
    assert pcie.pair_bandwidth_gbytes_per_s(0, 7) == D.DEFAULT_PCIE_GBYTES_PER_S["SYS"]
    assert pcie.kind_matrix()[6] == ["SYS", "SYS", "SYS", "SYS", "PXB", "PXB", "X", "PIX"]


def test_direct_nvlink_mesh_is_not_nvswitch():
    # 4 GPUs, a DGX-1-like partial mesh: NV2/NV1 directly, one pair only over PCIe
    text = (
        "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV2\tNV1\tSYS\t0-19\t0\n"
        "GPU1\tNV2\t X \tNV1\tNV2\t0-19\t0\n"
        "GPU2\tNV1\tNV1\t X \tNV2\t0-19\t0\n"
        "GPU3\tSYS\tNV2\tNV2\t X \t0-19\t0\n"
    )
    lay = D.parse_nvidia_smi_topo(text, nvlink_gbytes_per_s_per_link=25.0)
    assert lay.link(0, 1) == D.PairLink("nvlink", 2, "NV2")
    assert lay.link(0, 2).nvlinks == 1 and lay.link(0, 2).kind == "nvlink"
    assert lay.link(0, 3).kind == "cross-socket"
    assert lay.nics == () and lay.gpu_nic == (None,) * 4
    assert lay.pair_bandwidth_gbytes_per_s(1, 3) == 50.0


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (lambda t: t.replace("\tGPU3\t", "\tGPU9\t", 1), r"line 1: GPU columns must come first as GPU0"),
        (lambda t: t.replace("\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPIX", "\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPIQ", 1),
         r"line 2 \(GPU0\) column NIC0: unknown connection 'PIQ'"),
        (lambda t: t.replace("GPU3\tNV18\tNV18\tNV18\t X \tNV18", "GPU3\tNV18\tNV18\tNV17\t X \tNV18", 1),
         r"GPU2/GPU3 disagree: line 4 says 'NV18', line 5 says 'NV17'"),
        (lambda t: t.replace("GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\t X ", "GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18", 1),
         r"line 7 \(GPU5\): diagonal cell is 'NV18', expected X"),
        (lambda t: "\n".join("\t".join(ln.split("\t")[:17]) if ln.startswith("GPU6") else ln for ln in t.splitlines()),
         r"line 8 \(GPU6\): 16 cells, expected 20"),
        (lambda t: t.replace("\nGPU7\t", "\nGPU9\t", 1), r"line 9 \(GPU9\): row label 'GPU9' is not a column"),
        (lambda t: t.replace("GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNODE", "GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV4", 1),
         r"line 4 \(GPU2\) column NIC0: GPU-NIC path 'NV4' must be a PCIe path"),
        (lambda t: "hello\nworld\n", r"no header line naming GPU0"),
        (lambda t: t.replace("\nNIC0\tPIX\t", "\nNIC0\tNODE\t", 1), r"GPU0/NIC0 disagree: line 2 says 'PIX', line 10 says 'NODE'"),
        (lambda t: t.replace("  NIC3: mlx5_3", "  NIC3: mlx5_0"), r"NIC legend gives duplicate names"),
    ],
)
def test_nvidia_smi_malformed_names_line_and_field(mutate, pattern):
    text = mutate(_read("nvidia_smi_topo_dgx_h100.txt"))
    with pytest.raises(D.TopologyParseError, match=pattern):
        D.parse_nvidia_smi_topo(text, source="h100.txt")


def test_nvidia_smi_old_soc_token_is_sys():
    text = "        GPU0    GPU1    CPU Affinity\nGPU0     X      SOC     0-9\nGPU1    SOC      X      10-19\n"
    assert D.parse_nvidia_smi_topo(text).link(0, 1).kind == "cross-socket"


# --- NCCL XML --------------------------------------------------------------------------------


def test_nccl_xml_dgx_h100(h100_xml, h100):
    lay = h100_xml
    assert lay.num_gpus == 8
    # NVSwitch targets (tclass 0x068000) summed: 5+4+4+5 = 18 links into the fabric per GPU
    assert {(p.kind, p.nvlinks) for p in lay.pairs.values()} == {("nvswitch", 18)}
    assert lay.nvlink_gbytes_per_s_per_link == D.NVLINK_GBYTES_PER_S_PER_LINK_BY_SM[90]
    assert lay.pair_bandwidth_gbytes_per_s(0, 7) == pytest.approx(450.0)
    # same NIC per GPU as nvidia-smi says for the same machine, now with speeds (400 Gb/s = 50 GB/s)
    assert lay.gpu_nic == h100.gpu_nic
    assert all(n.speed_gbytes_per_s == pytest.approx(50.0) and n.paths == ("PIX",) for n in lay.nics)
    assert lay.kind_matrix() == h100.kind_matrix()


_MINI_XML = """<system version="1">
  <cpu numaid="0" affinity="0000ffff" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="85">
    <pci busid="0000:1a:00.0" class="0x060400" vendor="0x10b5" device="0x9797" link_speed="16.0 GT/s PCIe" link_width="16">
      <pci busid="0000:1b:00.0" class="0x060400" vendor="0x10b5" device="0x9797" link_speed="16.0 GT/s PCIe" link_width="16">
        <pci busid="0000:1c:00.0" class="0x030200" vendor="0x10de" device="0x1db5" link_speed="8.0 GT/s PCIe" link_width="16">
          <gpu dev="0" sm="70" rank="0" gdr="1">
            <nvlink target="0000:1d:00.0" count="2" tclass="0x030200"/>
          </gpu>
        </pci>
        <pci busid="0000:1d:00.0" class="0x030200" vendor="0x10de" device="0x1db5" link_speed="8.0 GT/s PCIe" link_width="16">
          <gpu dev="1" sm="70" rank="1" gdr="1">
            <nvlink target="0000:1c:00.0" count="2" tclass="0x030200"/>
          </gpu>
        </pci>
      </pci>
      <pci busid="0000:1e:00.0" class="0x060400" vendor="0x10b5" device="0x9797" link_speed="16.0 GT/s PCIe" link_width="16">
        <pci busid="0000:1f:00.0" class="0x030200" vendor="0x10de" device="0x1db5" link_speed="8.0 GT/s PCIe" link_width="16">
          <gpu dev="2" sm="70" rank="2" gdr="1"/>
        </pci>
        <pci busid="0000:20:00.0" class="0x020700" vendor="0x15b3" device="0x1017" link_speed="8.0 GT/s PCIe" link_width="16">
          <nic>
            <net name="mlx5_0" dev="0" speed="100000" port="1" latency="0.000000" guid="0x1" maxconn="131072" gdr="1"/>
          </nic>
        </pci>
      </pci>
    </pci>
  </cpu>
  <cpu numaid="1" affinity="ffff0000" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="85">
    <pci busid="0000:86:00.0" class="0x030200" vendor="0x10de" device="0x1db5" link_speed="8.0 GT/s PCIe" link_width="16">
      <gpu dev="3" sm="70" rank="3" gdr="1"/>
    </pci>
  </cpu>
</system>
"""


def test_nccl_xml_direct_nvlink_and_pcie_paths():
    lay = D.parse_nccl_topo_xml(_MINI_XML)
    assert lay.link(0, 1) == D.PairLink("nvlink", 2, "NV2")
    assert lay.link(0, 2).path == "PXB"  # common bridge 1a, one more bridge each side
    assert lay.link(2, 3).path == "SYS"
    assert lay.nvlink_gbytes_per_s_per_link == 25.0  # sm 70 -> NVLink2
    # GPU2 sits next to the NIC (PIX), GPU0/1 one bridge further (PXB): all take the only NIC,
    # GPU3 on the other socket through the SMP link
    (nic,) = lay.nics
    assert nic.gpus == (0, 1, 2, 3) and nic.paths == ("PXB", "PXB", "PIX", "SYS")
    assert nic.speed_gbytes_per_s == pytest.approx(12.5)
    topo = D.layout_to_topology(lay, nodes=2)
    assert topo.route(0, 1).kind == "nvlink" and topo.route(0, 1).bandwidth == pytest.approx(50e9)
    assert "n0:cpu0>cpu1" in _res(topo.route(0, 3))  # no NVLink: PCIe up to the CPU, across sockets
    assert topo.route(3, 7).bandwidth == pytest.approx(D.DEFAULT_PCIE_GBYTES_PER_S["SYS"] * 1e9)  # NIC across the SMP link


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (lambda t: t.replace("</system>", ""), r"not well-formed XML"),
        (lambda t: t.replace('count="2" tclass="0x030200"/>', 'count="two" tclass="0x030200"/>', 1),
         r"nvlink 0000:1d:00\.0: <nvlink count='two'> is not an integer"),
        (lambda t: t.replace('<gpu dev="2"', '<gpu dev="1"', 1), r"duplicate gpu dev=1"),
        (lambda t: t.replace('<gpu dev="3" sm="70"', '<gpu sm="70"', 1), r"<gpu> lacks attribute 'dev'"),
        (lambda t: t.replace('speed="100000"', 'speed="-5"'), r"<net name='mlx5_0'> speed=-5 must be >= 0"),
        (lambda t: t.replace('target="0000:1d:00.0" count="2" tclass="0x030200"', 'target="0000:99:00.0" count="2" tclass="0x0abcde"', 1),
         r"gpu dev=0: nvlink target 0000:99:00\.0 has unknown tclass '0x0abcde'"),
        (lambda t: t.replace("<system", "<sistem").replace("</system>", "</sistem>"), r"root element is <sistem>"),
        (lambda t: t.replace('<gpu dev="3"', '<gpu dev="7"'), r"gpu dev ids must be 0..3"),
    ],
)
def test_nccl_xml_malformed_names_field(mutate, pattern):
    with pytest.raises(D.TopologyParseError, match=pattern):
        D.parse_nccl_topo_xml(mutate(_MINI_XML))


# --- hostnames -------------------------------------------------------------------------------


def test_group_uniform_contiguous():
    hg = D.group_ranks_by_host(["n0"] * 8 + ["n1"] * 8, local_world_sizes=[8] * 16)
    assert hg.hosts == ("n0", "n1") and hg.num_nodes == 2 and hg.ranks_per_node == 8
    assert hg.ranks[1] == tuple(range(8, 16)) and hg.contiguous
    assert hg.node_of(9) == 1 and hg.local_rank_of(9) == 1


def test_group_round_robin_orders_by_local_rank():
    hosts = ["b", "a", "b", "a"]
    hg = D.group_ranks_by_host(hosts, local_ranks=[1, 0, 0, 1])
    assert hg.hosts == ("b", "a")  # nodes in order of their lowest rank (rank 0 is on b)
    assert hg.ranks == ((2, 0), (1, 3))  # ordered by LOCAL_RANK, not by rank
    assert not hg.contiguous
    assert hg.local_rank_of(0) == 1 and hg.local_rank_of(2) == 0


def test_group_subgroup_global_ranks():
    hg = D.group_ranks_by_host(["x", "x", "y", "y"], ranks=[1, 3, 5, 7])
    assert hg.ranks == ((1, 3), (5, 7))


def test_group_uneven_is_an_error():
    with pytest.raises(ValueError, match=r"uneven nodes \(ranks per host: n0: 8, n1: 4\).*--nproc-per-node"):
        D.group_ranks_by_host(["n0"] * 8 + ["n1"] * 4)


def test_group_local_world_size_mismatch_is_an_error():
    # two containers named "worker" on two machines: 16 ranks share one hostname, LOCAL_WORLD_SIZE 8
    with pytest.raises(ValueError, match=r"rank 0 on host 'worker' has LOCAL_WORLD_SIZE=8 but 16 ranks"):
        D.group_ranks_by_host(["worker"] * 16, local_world_sizes=[8] * 16)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(hostnames=[]), r"no hostnames"),
        (dict(hostnames=["a", ""]), r"rank 1 has an empty/invalid hostname"),
        (dict(hostnames=["a", "a"], local_ranks=[0, 0]), r"ranks 0 and 1 on host 'a' both have LOCAL_RANK=0"),
        (dict(hostnames=["a", "a"], local_ranks=[0, 2]), r"host 'a': LOCAL_RANK values \[0, 2\] are not 0..1"),
        (dict(hostnames=["a", "a"], local_ranks=[0, None]), r"LOCAL_RANK is set on some ranks but not on ranks \[1\]"),
        (dict(hostnames=["a", "a"], ranks=[0]), r"ranks has 1 entries, hostnames has 2"),
    ],
)
def test_group_bad_input(kwargs, pattern):
    hostnames = kwargs.pop("hostnames")
    with pytest.raises(ValueError, match=pattern):
        D.group_ranks_by_host(hostnames, **kwargs)


# --- DetectedNode -> Topology ----------------------------------------------------------------


def _res(route):
    return [r.name for r in route.resources]


def test_a100_topology_routes(a100):
    topo = D.layout_to_topology(a100, nodes=2)
    assert (topo.nodes, topo.gpus_per_node, topo.world) == (2, 8, 16)
    r = topo.route(0, 5)
    assert r.kind == "nvswitch" and r.bandwidth == pytest.approx(300e9)
    assert _res(r) == ["n0:gpu0>nvswitch", "n0:nvswitch>gpu5"]
    # rail-aligned: GPU1 leaves through mlx5_1 and enters node 1's GPU1 through mlx5_1
    r = topo.route(1, 9)
    assert "n0:mlx5_1>net" in _res(r) and "n1:net>mlx5_1" in _res(r)
    assert r.bandwidth == pytest.approx(D.DEFAULT_NIC_GBYTES_PER_S * 1e9)
    assert [n.name for n in topo.layout.nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]
    # explicit speeds override the defaults
    fast = D.layout_to_topology(a100, nodes=2, nvlink_gbytes_per_s_per_link=50.0, nic_gbytes_per_s=50.0)
    assert fast.route(0, 5).bandwidth == pytest.approx(600e9)
    r = fast.route(1, 9)  # a 50 GB/s NIC behind a PCIe 4.0 x16 link: PCIe is the bottleneck
    assert r.kind == "pcie" and r.bandwidth == pytest.approx(D.DEFAULT_PCIE_GBYTES_PER_S["PIX"] * 1e9)
    assert {x.name: x.bandwidth for x in r.resources}["n0:mlx5_1>net"] == pytest.approx(50e9)
    gen5 = D.layout_to_topology(a100, nodes=2, pcie_gbytes_per_s=64.0, nic_gbytes_per_s=50.0)
    assert gen5.route(1, 9).kind == "ib" and gen5.route(1, 9).bandwidth == pytest.approx(50e9)


def test_h100_xml_topology_matches_preset_shape(h100_xml):
    from megatron_fcp.topology import load_topology

    topo = D.layout_to_topology(h100_xml, nodes=2)
    ref = load_topology("dgx-h100:2")
    for a, b in [(0, 7), (2, 3), (3, 11), (8, 15)]:
        got, want = topo.route(a, b), ref.route(a, b)
        assert got.kind == want.kind and got.bandwidth == pytest.approx(want.bandwidth), (a, b)
    assert topo.node_ingress_bandwidth() == pytest.approx(ref.node_ingress_bandwidth())  # 8 x 50 GB/s
    # every GPU has its own NIC: no two ranks of a node share an egress wire
    egress = {next(x for x in _res(topo.route(r, r + 8)) if x.endswith(">net")) for r in range(8)}
    assert len(egress) == 8
    # PCIe Gen5 x16 read from link_speed/link_width
    assert h100_xml.pcie_gbytes_per_s == pytest.approx(32 * 16 / 8 * 128 / 130)


def test_pcie_server_topology_shared_uplink_and_tree(pcie):
    topo = D.layout_to_topology(pcie, nodes=2)
    bw = {p: topo.route(*p).bandwidth / 1e9 for p in [(0, 1), (0, 2), (0, 4), (6, 7)]}
    assert bw == {(0, 1): D.DEFAULT_PCIE_GBYTES_PER_S["PIX"], (0, 2): D.DEFAULT_PCIE_GBYTES_PER_S["PXB"],
                  (0, 4): D.DEFAULT_PCIE_GBYTES_PER_S["SYS"], (6, 7): D.DEFAULT_PCIE_GBYTES_PER_S["PIX"]}
    # all eight GPUs leave the node through the one NIC: one shared egress resource
    egress = {x for r in range(8) for x in _res(topo.route(r, 8 + (r + 1) % 8)) if x.endswith(">net")}
    assert egress == {"n0:mlx5_0>net"}
    # the two PIX pairs under one PXB switch share its uplink when they talk across (contention)
    up02, up13 = set(_res(topo.route(0, 2))), set(_res(topo.route(1, 3)))
    assert any(name.startswith("n0:pcisw") and ">pcisw" in name for name in up02 & up13)
    # socket-1 GPUs reach the NIC across the SMP link
    assert "n0:cpu1>cpu0" in _res(topo.route(5, 8))


def test_layout_subset_of_gpus_and_errors(a100, pcie):
    topo = D.layout_to_topology(a100, gpus=2)
    assert topo.gpus_per_node == 2 and [n.name for n in topo.layout.nics] == ["mlx5_0", "mlx5_1"]
    with pytest.raises(ValueError, match=r"9 ranks per node but the node has 8 GPU"):
        D.layout_to_topology(a100, gpus=9)
    lone = D.parse_nvidia_smi_topo("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \n", source="nonic.txt")
    assert D.layout_to_topology(lone).route(0, 1).kind == "nvlink"
    from megatron_fcp.topology import TopologyError

    with pytest.raises(TopologyError, match=r"nonic.txt: .*no NIC"):
        D.layout_to_topology(lone, nodes=2)


def test_hostnames_set_rank_map(h100):
    # round-robin launch: even ranks on host a, odd ranks on host b
    hosts = D.group_ranks_by_host(["a", "b"] * 8, local_ranks=[r // 2 for r in range(16)])
    topo = D.layout_to_topology(h100, hosts=hosts)
    assert topo.nodes == 2 and topo.rank_map[:4] == ((0, 0), (1, 0), (0, 1), (1, 1))
    assert topo.route(0, 2).kind == "nvswitch"  # same host
    assert any(x.endswith(">net") for x in _res(topo.route(0, 1)))  # different hosts


# --- detect_topology resolution order ---------------------------------------------------------


def test_detect_resolution_order(tmp_path, caplog):
    smi, xml = FIX / "nvidia_smi_topo_pcie_server.txt", FIX / "nccl_topo_dgx_h100.xml"
    # 1. preset / YAML wins over every detected source
    t = D.detect_topology("dgx-a100:2", nccl_xml=xml, nvidia_smi=smi)
    assert t.name == "dgx-a100:2" and t.world == 16
    yaml_path = tmp_path / "c.yaml"
    serialize.to_yaml(D.detect_topology(nvidia_smi=smi, nodes=3), yaml_path)
    t = D.detect_topology(str(yaml_path), nccl_xml=xml)
    assert t.nodes == 3 and t.layout.nics[0].name == "mlx5_0"
    # 2. NCCL XML over nvidia-smi
    t = D.detect_topology(nccl_xml=xml, nvidia_smi=smi)
    assert t.route(0, 1).kind == "nvswitch" and t.name == "nccl-xml:nccl_topo_dgx_h100.xml"
    # 3. nvidia-smi (file path or the text itself)
    t = D.detect_topology(nvidia_smi=smi.read_text())
    assert t.route(0, 1).kind == "pcie" and len(t.layout.nics) == 1
    # 4. nothing: uniform nodes from hostnames, logged once with the default speeds named
    caplog.set_level("WARNING", logger=D.__name__)
    D._log_once.cache_clear()
    hosts = ["h0"] * 4 + ["h1"] * 4
    t1 = D.detect_topology(hosts=hosts)
    t2 = D.detect_topology(hosts=hosts)
    assert (t1.nodes, t1.gpus_per_node) == (2, 4) and t2.world == 8
    msgs = [r.getMessage() for r in caplog.records if "no topology source" in r.getMessage()]
    assert len(msgs) == 1
    assert f"NVSwitch {D.DEFAULT_UNIFORM_INTRA_GBYTES_PER_S:g} GB/s" in msgs[0] and f"{D.DEFAULT_NIC_GBYTES_PER_S:g} GB/s NIC per GPU" in msgs[0]
    assert t1.route(0, 4).bandwidth == pytest.approx(D.DEFAULT_NIC_GBYTES_PER_S * 1e9)


def test_detect_with_hosts_and_conflicts():
    hosts = D.group_ranks_by_host(["b", "a"] * 8, local_ranks=[r // 2 for r in range(16)])
    t = D.detect_topology("dgx-h100", hosts=hosts)  # bare preset: node count from the hostnames
    assert t.nodes == 2 and t.rank_map[1] == (1, 0)
    with pytest.raises(ValueError, match=r"has 1 node\(s\) x 8 GPU\(s\) but the process group has 2 host\(s\) x 8"):
        D.detect_topology("dgx-h100:1", hosts=hosts)
    with pytest.raises(ValueError, match=r"'dgx-h100:2' has 2 node\(s\) but nodes=4"):
        D.detect_topology("dgx-h100:2", nodes=4)
    with pytest.raises(ValueError, match=r"nodes=3 but the hostnames name 2 node"):
        D.detect_topology(hosts=hosts, nodes=3)
    with pytest.raises(FileNotFoundError, match=r"missing\.xml: not found"):
        D.detect_topology(nccl_xml="missing.xml")
    with pytest.raises(ValueError, match=r"nic_gbytes_per_s=0: a bandwidth must be > 0"):
        D.detect_topology(nvidia_smi=FIX / "nvidia_smi_topo_pcie_server.txt", nic_gbytes_per_s=0)
    with pytest.raises(ValueError, match=r"nvlink_gbytes_per_s_per_link=-25.0: a bandwidth must be > 0"):
        D.detect_topology(nvidia_smi=FIX / "nvidia_smi_topo_dgx_a100.txt", nvlink_gbytes_per_s_per_link=-25.0)
    sub = D.group_ranks_by_host(["x", "x", "y", "y"], ranks=[1, 3, 5, 7])
    with pytest.raises(ValueError, match=r"hostnames cover ranks \[1, 3, 5, 7\], not 0..3.*default process group"):
        D.detect_topology(hosts=sub)


def test_speed_arguments_are_gigabytes_per_second():
    # *_gbytes_per_s is GB/s: 25 is an HDR "200 Gbps" NIC, 25e9 bytes/s in the model
    from megatron_fcp.topology import parse_bandwidth

    smi = FIX / "nvidia_smi_topo_pcie_server.txt"
    t = D.detect_topology(nvidia_smi=smi, nodes=2, nic_gbytes_per_s=25, pcie_gbytes_per_s=64)
    (nic,) = t.layout.nics
    assert nic.bandwidth == 25e9 == parse_bandwidth("25GB/s") == parse_bandwidth("200Gbps")
    assert t.route(0, 8).bandwidth == pytest.approx(25e9)  # the NIC wire is the bottleneck
    u = D.uniform_topology(2, 4, intra_gbytes_per_s=300, nic_gbytes_per_s=50)
    assert u.route(0, 1).bandwidth == 300e9 and u.route(0, 4).bandwidth == pytest.approx(D.DEFAULT_PCIE_GBYTES_PER_S["PIX"] * 1e9)
    assert {n.bandwidth for n in u.layout.nics} == {50e9}
    # NCCL XML gives NIC speed in Mb/s: 400000 Mb/s = 50 GB/s
    assert {n.speed_gbytes_per_s for n in D.parse_nccl_topo_xml(_read("nccl_topo_dgx_h100.xml")).nics} == {50.0}


# --- megatron-fcp topo -----------------------------------------------------------------------


def _topo_cli(capsys, *argv):
    from megatron_fcp.cli import main

    rc = main(["topo", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--topology", "dgx-h100:2"], [r"2 node\(s\) x 8 GPU\(s\) = 16 ranks", r"node 1: ranks 8-15",
                                        r"  gpu3 NVS 450 +NVS 450 +NVS 450 +X ", r"nic7 +ib +50 GB/s  gpus \[7\]  \(one GPU\)"]),
        (["--topology", "single-uplink:2"], [r"nic0 .* gpus \[0, 1, 2, 3, 4, 5, 6, 7\]  \(shared uplink\)"]),
        (["--from-nvidia-smi", str(FIX / "nvidia_smi_topo_pcie_server.txt"), "--nodes", "2"],
         [r"  gpu0 X +PCIe 25 +PCIe 25 +PCIe 25 +PCIe 12", r"mlx5_0 .*25 GB/s  gpus \[0, 1, 2, 3, 4, 5, 6, 7\]  \(shared uplink\)",
          r"  gpu2 PXB +PXB +X +PIX +SYS +SYS", r"pair kinds: cross-socket x16, pcie-bridges x8, pcie-switch x4",
          r"mlx5_0: gpu0 PXB, gpu1 PXB, gpu2 PXB, gpu3 PXB, gpu4 SYS, gpu5 SYS, gpu6 SYS, gpu7 SYS"]),
        (["--from-nvidia-smi", str(FIX / "nvidia_smi_topo_dgx_h100.txt")],
         [r"pair kinds: nvswitch x28", r"mlx5_9: gpu5 PIX", r"not used by any GPU \(left out\): mlx5_1, mlx5_2, mlx5_7, mlx5_8"]),
        (["--from-nvidia-smi", str(FIX / "nvidia_smi_topo_dgx_a100.txt")], [r"  gpu7 (NVS 300 +){7}X", r"mlx5_9 "]),
        (["--from-nccl-xml", str(FIX / "nccl_topo_dgx_h100.xml"), "--nodes", "4"],
         [r"4 node\(s\) x 8 GPU\(s\) = 32 ranks", r"mlx5_11 +ib +50 GB/s  gpus \[7\]"]),
    ],
)
def test_topo_command_prints(capsys, argv, expect):
    rc, out, _ = _topo_cli(capsys, *argv)
    assert rc == 0
    for pattern in expect:
        assert re.search(pattern, out), (pattern, out)


def test_topo_command_yaml_roundtrip(capsys, tmp_path):
    from megatron_fcp.topology import load_topology

    out_yaml = tmp_path / "pcie.yaml"
    rc, out, _ = _topo_cli(capsys, "--from-nvidia-smi", str(FIX / "nvidia_smi_topo_pcie_server.txt"),
                           "--nodes", "2", "--yaml-out", str(out_yaml))
    assert rc == 0 and f"wrote {out_yaml}" in out
    back = load_topology(str(out_yaml))
    direct = D.detect_topology(nvidia_smi=FIX / "nvidia_smi_topo_pcie_server.txt", nodes=2)
    for a in range(16):
        for b in range(16):
            ra, rb = back.route(a, b), direct.route(a, b)
            assert _res(ra) == _res(rb) and ra.bandwidth == pytest.approx(rb.bandwidth)
    rc, out2, _ = _topo_cli(capsys, "--topology", str(out_yaml))
    # the same printout (after the source line) up to the detected-source section
    head = out.split("\n", 1)[1].split("\n\nguesses (", 1)[0].split("\n\nas reported by", 1)[0]
    assert rc == 0 and out2.split("\n", 1)[1] == head + "\n"


def test_topo_command_errors(capsys, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text(_read("nvidia_smi_topo_dgx_h100.txt").replace("GPU3\tNV18\tNV18\tNV18\t X ", "GPU3\tNV18\tNV18\tNV8\t X ", 1))
    rc, _, err = _topo_cli(capsys, "--from-nvidia-smi", str(bad))
    assert rc == 2 and re.search(r"error: .*bad\.txt: GPU2/GPU3 disagree: line 4 says 'NV18', line 5 says 'NV8'", err)
    rc, _, err = _topo_cli(capsys, "--topology", "dgx-z100:2")
    assert rc == 2 and "'dgx-z100:2' is neither a preset" in err
    rc, _, err = _topo_cli(capsys, "--topology", "dgx-h100:2", "--nodes", "3")
    assert rc == 2 and "nodes=3" in err


# --- gather_host_info over a real process group -------------------------------------------------


def _gather_worker(rank: int, world: int) -> dict:
    out = {}
    for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(var, None)
    hg = D.gather_host_info()
    out["plain"] = (hg.num_nodes, hg.ranks)
    # an emulated cluster names its nodes; LOCAL_RANK reversed on purpose
    os.environ["LOCAL_RANK"] = "0"
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    hg = D.gather_host_info(hostname=f"node{rank}")
    out["named"] = (hg.hosts, hg.ranks)
    # every rank claims LOCAL_WORLD_SIZE=1 while both share one hostname: same error everywhere
    try:
        D.gather_host_info(hostname="same")
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_gather_host_info_gloo():
    from megatron_fcp.testing.launch import run_gloo

    res = run_gloo(_gather_worker, 2, timeout_s=120)
    for r in res:
        assert r["plain"] == (1, ((0, 1),))
        assert r["named"] == (("node0", "node1"), ((0,), (1,)))
        assert re.search(r"rank 0 on host 'same' has LOCAL_WORLD_SIZE=1 but 2 ranks", r["mismatch"])


def test_single_gpu_node_nic_across_sockets():
    text = ("\tGPU0\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \tSYS\t0-63\t0\t\tN/A\n"
            "NIC0\tSYS\t X \t\t\t\n\nLegend:\n\n  X    = Self\n\nNIC Legend:\n\n  NIC0: mlx5_0\n")
    lay = D.parse_nvidia_smi_topo(text)
    assert lay.num_gpus == 1 and lay.pairs == {} and lay.gpu_nic == ("mlx5_0",)
    assert lay.nic("mlx5_0").paths == ("SYS",) and lay.nic("mlx5_0").direct_gpus == ()
    topo = D.layout_to_topology(lay, nodes=2)
    r = topo.route(0, 1)  # GPU -> CPU -> other socket -> NIC -> fabric -> ...
    assert "n0:cpu0>cpu1" in _res(r) and r.bandwidth == pytest.approx(D.DEFAULT_PCIE_GBYTES_PER_S["SYS"] * 1e9)


def test_topo_command_every_preset(capsys):
    from megatron_fcp.topology import PRESETS

    for name in PRESETS:
        rc, out, err = _topo_cli(capsys, "--topology", f"{name}:2")
        g = D.detect_topology(f"{name}:2").gpus_per_node
        assert rc == 0, err
        assert f"node 1: ranks {g}-{2 * g - 1}" in out and re.search(rf"  gpu{g - 1} .*X$", out, re.M), name


def test_topo_command_speed_flags_and_deprecated_aliases(capsys):
    smi = str(FIX / "nvidia_smi_topo_pcie_server.txt")
    rc, out, err = _topo_cli(capsys, "--from-nvidia-smi", smi, "--nic-gbytes-per-s", "12.5")
    assert rc == 0 and re.search(r"mlx5_0 +ib +12\.5 GB/s", out) and "deprecated" not in err
    # the old flags still work, print one warning line each, and mean the same GB/s
    rc, old_out, err = _topo_cli(capsys, "--from-nvidia-smi", smi, "--nic-gbps", "12.5")
    assert rc == 0 and old_out == out
    warnings = [ln for ln in err.splitlines() if "deprecated" in ln]
    assert warnings == ["megatron-fcp topo: warning: --nic-gbps is deprecated, use --nic-gbytes-per-s (same value, gigabytes/s)"]
    rc, out, err = _topo_cli(capsys, "--from-nvidia-smi", smi, "--nvlink-gbps", "50", "--pcie-gbps", "32")
    assert rc == 0 and re.search(r"  gpu0 X +PCIe 32 ", out)
    assert sorted(ln.split()[3] for ln in err.splitlines() if "deprecated" in ln) == ["--nvlink-gbps", "--pcie-gbps"]
    with pytest.raises(SystemExit):
        _topo_cli(capsys, "--help")
    help_text = capsys.readouterr().out
    assert "--nic-gbytes-per-s" in help_text and "--nic-gbps" not in help_text
