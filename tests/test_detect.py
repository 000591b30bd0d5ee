"""Topology detection: nvidia-smi / NCCL XML parsers on real-looking fixtures, hostname grouping,
malformed input, detect_topology's resolution order and the ``megatron-fcp topo`` command."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from megatron_fcp.topology import detect as D

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
    assert a100.nvlink_gbps_per_link is None
    assert a100.pair_bandwidth_gbps(0, 7) == pytest.approx(12 * D.DEFAULT_NVLINK_GBPS_PER_LINK)


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
    assert h100.pair_bandwidth_gbps(3, 4) == pytest.approx(450.0)


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
    assert pcie.pair_bandwidth_gbps(0, 1) == D.DEFAULT_PCIE_GBPS["PIX"]
    assert pcie.pair_bandwidth_gbps(0, 7) == D.DEFAULT_PCIE_GBPS["SYS"]
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
    lay = D.parse_nvidia_smi_topo(text, nvlink_gbps_per_link=25.0)
    assert lay.link(0, 1) == D.PairLink("nvlink", 2, "NV2")
    assert lay.link(0, 2).nvlinks == 1 and lay.link(0, 2).kind == "nvlink"
    assert lay.link(0, 3).kind == "cross-socket"
    assert lay.nics == () and lay.gpu_nic == (None,) * 4
    assert lay.pair_bandwidth_gbps(1, 3) == 50.0


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
    assert lay.nvlink_gbps_per_link == D.NVLINK_GBPS_PER_LINK_BY_SM[90]
    assert lay.pair_bandwidth_gbps(0, 7) == pytest.approx(450.0)
    # same NIC per GPU as nvidia-smi says for the same machine, now with speeds (400 Gb/s = 50 GB/s)
    assert lay.gpu_nic == h100.gpu_nic
    assert all(n.speed_gbps == pytest.approx(50.0) and n.paths == ("PIX",) for n in lay.nics)
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
    assert lay.nvlink_gbps_per_link == 25.0  # sm 70 -> NVLink2
    # GPU2 sits next to the NIC (PIX), GPU0/1 one bridge further (PXB): all take the only NIC,
    # GPU3 on the other socket through the SMP link
    (nic,) = lay.nics
    assert nic.gpus == (0, 1, 2, 3) and nic.paths == ("PXB", "PXB", "PIX", "SYS")
    assert nic.speed_gbps == pytest.approx(12.5)


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
