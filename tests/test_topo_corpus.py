"""Topology detection on real inputs (tests/fixtures/topo_corpus/, sources in its README) and on
each failure class of issue 29: glued cells, ANSI escapes, rows of the wrong length (a mutation
test over every corpus row), static NCCL topology files, ``gdr="0"``, repeated socket NICs, the
per-SM NVLink table, NIC kinds from attributes, and guesses that are reported (NIC ties, NUMA,
defaulted speeds)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from megatron_fcp.topology import detect as D
from megatron_fcp.topology.detect.node import place_nics

CORPUS = Path(__file__).parent / "fixtures" / "topo_corpus"
FIX = Path(__file__).parent / "fixtures"

# file -> (GPUs, pair kinds, NIC of each GPU (None: no NIC), path token of each GPU to its NIC)
EXPECTED = {
    "a100_pcie_x8_dask1381.txt": (8, {"nvlink": 4, "pcie-node": 24}, ("NIC0",) * 8, "NODE NODE NODE NODE NODE NODE PHB NODE"),
    "a40x8_nv4_nccl1343.txt": (8, {"cross-socket": 16, "nvlink": 4, "pcie-node": 8}, ("NIC0",) * 4 + ("NIC1",) * 4,
                               "NODE NODE PIX PIX NODE NODE PIX PIX"),
    "b200_explorer_page.txt": (8, {"nvswitch": 28}, ("NIC0", "NIC1", "NIC2", "NIC3") * 2, "PIX PIX PIX PIX SYS SYS SYS SYS"),
    "dgx_h100_glued_vllm13855.txt": (8, {"nvswitch": 28}, ("NIC0", "NIC3", "NIC4", "NIC5", "NIC6", "NIC9", "NIC10", "NIC11"),
                                     "PXB " * 8),
    "dgx_h100_k8s_recipes_page.txt": (8, {"nvswitch": 28}, (None,) * 8, ""),
    "gb200_tray_sglang11208.txt": (4, {"nvswitch": 6}, ("NIC0", "NIC1", "NIC2", "NIC3"), "SYS SYS SYS SYS"),
    "h100x4_nv6_nccl1617.txt": (4, {"nvlink": 6}, ("NIC0", "NIC1", "NIC2", "NIC3"), "PIX PIX PIX PIX"),
    "h100x8_no_nic_thunderkittens167.txt": (8, {"nvswitch": 28}, (None,) * 8, ""),
    "hgx_h100_nccl1264.txt": (8, {"nvswitch": 28}, ("NIC0", "NIC1", "NIC2", "NIC5", "NIC6", "NIC7", "NIC8", "NIC9"),
                              "PIX " * 8),
    "l40sx4_missalignment106.txt": (4, {"cross-socket": 4, "pcie-node": 2}, ("mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1"),
                                    "SYS SYS NODE NODE"),
    "rtx3090x2_club3090_104.txt": (2, {"pcie-host": 1}, (None, None), ""),
    "rtx4090x5_club3090_46.txt": (5, {"cross-socket": 4, "pcie-host": 2, "pcie-node": 4}, (None,) * 5, ""),
    "rtx4090x8_gpuallocator17.txt": (8, {"cross-socket": 28}, ("NIC0", "NIC1") * 4, "SYS SYS SYS SYS SYS SYS PHB SYS"),
    "rtx5090x2_club3090_1229.txt": (2, {"pcie-host": 1}, (None, None), ""),
    "two_gpu_indented_club3090_1125.txt": (2, {"pcie-node": 1}, (None, None), ""),
}
SMI_FILES = sorted(p.name for p in CORPUS.glob("*.txt"))


def _parse(name: str, text: str | None = None):
    return D.parse_nvidia_smi_topo((CORPUS / name).read_text() if text is None else text, source=name)


def _nic_paths(node) -> str:
    out = []
    for g, nic in enumerate(node.gpu_nic):
        if nic is not None:
            info = node.nic(nic)
            out.append(info.paths[info.gpus.index(g)])
    return " ".join(out)


def test_corpus_is_complete():
    assert sorted(EXPECTED) == SMI_FILES
    readme = (CORPUS / "README.md").read_text()
    for name in [*SMI_FILES, *(p.name for p in CORPUS.glob("*.xml"))]:
        assert re.search(rf"`{re.escape(name)}`.*https?://", readme), f"{name} has no source URL in the README"


@pytest.mark.parametrize("name", SMI_FILES)
def test_corpus_parses_to_the_expected_node(name):
    gpus, kinds, gpu_nic, paths = EXPECTED[name]
    node = _parse(name)
    assert node.num_gpus == gpus
    assert dict(Counter(p.kind for p in node.pairs.values())) == kinds
    assert node.gpu_nic == gpu_nic
    assert _nic_paths(node) == paths.strip()
    topo = D.layout_to_topology(node, nodes=2 if gpu_nic[0] else 1)  # the model accepts every one
    assert topo.world == gpus * (2 if gpu_nic[0] else 1)


# --- rows of the wrong length: a mutation test over every row of every corpus matrix ---------


def _matrix_lines(text: str) -> list[int]:
    """Indices of the header and the matrix rows (up to the blank line / Legend)."""
    lines = text.splitlines()
    head = next(k for k, ln in enumerate(lines) if re.search(r"(?<![A-Za-z])GPU0(?!\d)", ln) and " X " not in f" {ln} "
                and "\tX" not in ln)
    out = [head]
    k = head + 1
    while k < len(lines) and lines[k].strip() and not lines[k].strip().startswith("Legend"):
        out.append(k)
        k += 1
    return out


def _mutants(line: str):
    """Every way of removing or duplicating one whitespace-separated cell of ``line``."""
    parts = re.split(r"(\s+)", line)
    cells = [i for i, p in enumerate(parts) if p and not p.isspace()]
    for i in cells:
        sep = next((parts[j] for j in (i + 1, i - 1) if 0 <= j < len(parts) and parts[j].isspace()), " ")
        yield "removed", "".join(parts[:i] + parts[i + 2:] if i + 1 < len(parts) else parts[:max(i - 1, 0)])
        yield "duplicated", "".join(parts[:i + 1] + [sep] + parts[i:])


@pytest.mark.parametrize("name", SMI_FILES)
def test_one_cell_removed_or_duplicated_is_refused_or_harmless(name):
    text = (CORPUS / name).read_text()
    lines = text.splitlines()
    base = _parse(name)
    refused = kept = 0
    for k in _matrix_lines(text):
        for how, mutant in _mutants(lines[k]):
            mutated = "\n".join(lines[:k] + [mutant] + lines[k + 1:]) + "\n"
            try:
                node = _parse(name, mutated)
            except D.TopologyParseError as exc:
                assert f"line {k + 1}" in str(exc) or "GPU0" in str(exc) or "no row" in str(exc), (how, k, str(exc))
                refused += 1
                continue
            # accepted: only an affinity value can have moved; every path is what the original says
            kept += 1
            assert node.pairs == base.pairs and node.pcie_paths == base.pcie_paths, (how, k, mutant)
            if node.gpu_nic != base.gpu_nic:
                assert any(f"line {k + 1}" in g for g in node.guesses), (how, k, mutant)
    assert refused > 0


def test_a_shifted_cell_is_refused_with_the_line_cause_and_fix():
    text = (CORPUS / "hgx_h100_nccl1264.txt").read_text()
    row = text.splitlines()[4]  # GPU3: its NIC3 cell duplicated -> one cell too many
    bad = text.replace(row, row.replace("\tSYS\tSYS\tPIX", "\tSYS\tSYS\tSYS\tPIX", 1))
    with pytest.raises(D.TopologyParseError,
                       match=r"line 5 \(GPU3\): 19 cells, expected 18 .*an extra cell cannot be placed.*nvidia-smi topo -m > topo.txt"):
        _parse("hgx_h100_nccl1264.txt", bad)


# --- glued cells and ANSI escapes --------------------------------------------------------------


def test_glued_header_and_cells_are_split_on_their_tokens():
    node = _parse("dgx_h100_glued_vllm13855.txt")  # header "NIC8NIC9", cells "NODENODE", "NODEPXB"
    assert [n.name for n in node.nics][8:10] == ["NIC8", "NIC9"]
    assert node.gpu_nic[5] == "NIC9" and node.nic("NIC9").paths == ("PXB",)
    assert node.pcie_paths[frozenset(("gpu4", "NIC8"))] == "NODE"


def test_ansi_escapes_are_stripped():
    text = (CORPUS / "hgx_h100_nccl1264.txt").read_text()
    lines = text.splitlines()
    lines[0] = "\x1b[4m" + lines[0] + "\x1b[0m"  # a terminal's underlined header
    lines[1] = lines[1].replace("PIX", "\x1b[1;32mPIX\x1b[0m")
    node = _parse("hgx_h100_nccl1264.txt", "\n".join(lines))
    assert node.pairs == _parse("hgx_h100_nccl1264.txt").pairs and node.gpu_nic[0] == "NIC0"


def test_affinity_columns_are_read_by_their_header():
    node = _parse("gb200_tray_sglang11208.txt")  # NUMA Affinity "0,3-9,11-17": the CPU node first
    assert node.numa == (0, 0, 1, 1)
    assert _parse("dgx_h100_k8s_recipes_page.txt").numa == (0,) * 4 + (1,) * 4  # header "NUMA" alone
    node = _parse("a100_pcie_x8_dask1381.txt")  # Slurm printed no CPU Affinity for GPU4-7
    assert node.numa[:4] == (0,) * 4 and node.numa[4:] == (None,) * 4
    assert any(g.startswith("line 7 (GPU4): 2 affinity value(s) ['1', 'N/A']") for g in node.guesses)


# --- guesses: ties in NIC placement, NUMA, NIC kinds, speeds ----------------------------------


def test_gb200_tray_ties_are_reported_with_their_fix():
    node = _parse("gb200_tray_sglang11208.txt")
    ties = [g for g in node.guesses if "a tie" in g]
    assert len(ties) == 4 and all("--gpu-nic" in g and "node.gpu_nic" in g for g in ties)
    assert any("NIC kind of NIC0" in g for g in node.guesses)


def _tray(nic_rows: bool) -> str:
    """A GB200-like tray: 4 GPUs (NUMA 0,0,1,1), NIC0/NIC2 on one socket and NIC1/NIC3 on the
    other (numbered alternately), every GPU-NIC path SYS."""
    hdr = "\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tNIC2\tNIC3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    rows = ""
    for i in range(4):
        cells = ["NV18" if j != i else " X " for j in range(4)] + ["SYS"] * 4
        rows += f"GPU{i}\t" + "\t".join(cells) + f"\t{'0-71' if i < 2 else '72-143'}\t{0 if i < 2 else 1}\t\t{2 + 8 * i}\n"
    if nic_rows:
        for k in range(4):
            cells = ["SYS"] * 4 + [" X " if m == k else ("NODE" if m % 2 == k % 2 else "SYS") for m in range(4)]
            rows += f"NIC{k}\t" + "\t".join(cells) + "\n"
    return hdr + rows


def test_numa_breaks_ties_when_every_path_is_sys():
    node = D.parse_nvidia_smi_topo(_tray(nic_rows=True))
    assert node.gpu_nic == ("NIC0", "NIC2", "NIC1", "NIC3")  # each GPU on a NIC of its socket
    assert any(g.startswith("NIC NUMA nodes: no GPU reaches a NIC") for g in node.guesses)
    blind = D.parse_nvidia_smi_topo(_tray(nic_rows=False))  # nothing tells the NICs' sockets
    assert blind.gpu_nic == ("NIC0", "NIC1", "NIC2", "NIC3") and sum("a tie" in g for g in blind.guesses) == 4


def test_two_ports_of_one_card_with_a_nic_unused_is_reported():
    names = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    paths = [dict.fromkeys(names, "SYS")] * 3
    # mlx5_0/mlx5_1: two ports of one card (PIX); mlx5_2/mlx5_3 on the other socket (NODE)
    pairs = {frozenset((a, b)): ("PIX" if {a, b} == {"mlx5_0", "mlx5_1"} else
                                 "NODE" if {a, b} == {"mlx5_2", "mlx5_3"} else "SYS")
             for k, a in enumerate(names) for b in names[k + 1:]}
    nics, gpu_nic, guesses = place_nics(paths, names, {}, gpu_numa=[0, 0, 1], nic_pairs=pairs)
    assert gpu_nic == ("mlx5_0", "mlx5_1", "mlx5_2")  # NUMA first: both socket-0 GPUs on the one card
    assert any(g.startswith("mlx5_0 and mlx5_1 share one card (PIX) and carry GPUs [0, 1] while mlx5_3 carry none")
               for g in guesses)
    # without NUMA information the card is spread first: no warning
    nics, gpu_nic, guesses = place_nics(paths, names, {}, nic_pairs=pairs)
    assert gpu_nic == ("mlx5_0", "mlx5_2", "mlx5_3") and not any("share one card" in g for g in guesses)


def test_topo_command_prints_every_guess(capsys):
    from megatron_fcp.cli import main

    assert main(["topo", "--from-nvidia-smi", str(CORPUS / "gb200_tray_sglang11208.txt")]) == 0
    out = capsys.readouterr().out
    section = out.split("guesses (not read from the machine; each names its fix):\n", 1)[1].split("\n\n", 1)[0]
    lines = section.splitlines()
    assert sum("a tie" in ln for ln in lines) == 4
    assert any("NVLink 25 GB/s per link" in ln and "--nvlink-gbytes-per-s" in ln for ln in lines)
    assert any("NIC 25 GB/s" in ln and "--nic-gbytes-per-s" in ln for ln in lines)
    assert re.search(r"NIC0 +ib ", out)  # an unnamed NIC column is an RDMA device, not ethernet
    # --gpu-nic replaces the placement and its tie lines
    assert main(["topo", "--from-nvidia-smi", str(CORPUS / "gb200_tray_sglang11208.txt"),
                 "--gpu-nic", "NIC0,NIC2,NIC3,NIC5"]) == 0
    out = capsys.readouterr().out
    assert "a tie" not in out and re.search(r"NIC5 +ib .*gpus \[3\]", out)


def test_guesses_are_logged_once_by_detect_topology(caplog):
    D._log_once.cache_clear()
    with caplog.at_level("WARNING"):
        D.detect_topology(nvidia_smi=CORPUS / "gb200_tray_sglang11208.txt")
        D.detect_topology(nvidia_smi=CORPUS / "gb200_tray_sglang11208.txt")
    ties = [r.message for r in caplog.records if "a tie" in r.message]
    assert len(ties) == 4


# --- NCCL XML ----------------------------------------------------------------------------------


def test_static_topology_file_says_to_dump_instead():
    with pytest.raises(D.TopologyParseError, match=r"static topology file \(NCCL_TOPO_FILE.*NCCL_TOPO_DUMP_FILE="):
        D.parse_nccl_topo_xml((CORPUS / "azure_ndv2_static_topo_azhpc393.xml").read_text())


def _h100_xml() -> str:
    return (FIX / "nccl_topo_dgx_h100.xml").read_text()


def test_gdr_off_is_marked_and_priced():
    xml = _h100_xml().replace('name="mlx5_0" dev="0" speed="400000" port="1" latency="0.000000" guid="0xf2a74de452e6b438" maxconn="131072" gdr="1"',
                              'name="mlx5_0" dev="0" speed="400000" port="1" latency="0.000000" guid="0xf2a74de452e6b438" maxconn="131072" gdr="0"')
    node = D.parse_nccl_topo_xml(xml)
    assert node.nic("mlx5_0").gdr is False and node.nic("mlx5_3").gdr is True
    topo, guesses = D.detect_topology_report(nccl_xml=xml, nodes=2)
    assert topo.layout.nics[0].bandwidth == pytest.approx(D.NO_GDR_GBYTES_PER_S * 1e9)
    assert topo.layout.nics[1].bandwidth == pytest.approx(50e9)
    assert any("no GPUDirect RDMA (gdr=0) on mlx5_0" in g for g in guesses)


def test_repeated_socket_nic_under_every_cpu_is_one_nic():
    sock = '<nic><net name="eth0" dev="8" speed="100000" port="0" latency="0.000000" guid="0x0" maxconn="65536" gdr="0"/></nic>'
    xml = re.sub(r'(<cpu [^>]*>)', lambda m: m.group(1) + sock, _h100_xml())
    assert xml.count('name="eth0"') == 2
    node = D.parse_nccl_topo_xml(xml)
    assert [n.name for n in node.nics].count("eth0") == 1 and node.nic("eth0").kind == "ethernet"
    other = xml.replace('name="eth0" dev="8" speed="100000"', 'name="eth0" dev="9" speed="100000"', 1)
    with pytest.raises(D.TopologyParseError, match=r"<net name> \['eth0'\] listed twice with different"):
        D.parse_nccl_topo_xml(other)


@pytest.mark.parametrize("sm, per_link", [(70, 25.0), (80, 25.0), (86, 14.0625), (90, 25.0), (100, 50.0), (103, 50.0)])
def test_nvlink_speed_per_generation_from_sm(sm, per_link):
    node = D.parse_nccl_topo_xml(_h100_xml().replace('sm="90"', f'sm="{sm}"'))
    assert node.nvlink_gbytes_per_s_per_link == per_link
    assert D.NVLINK_GBYTES_PER_S_PER_LINK_BY_SM[sm] == per_link


def test_unknown_sm_is_a_reported_guess():
    node = D.parse_nccl_topo_xml(_h100_xml().replace('sm="90"', 'sm="89"'))
    assert node.nvlink_gbytes_per_s_per_link is None and any("sm [89]" in g for g in node.guesses)


def test_nic_kind_and_speed_from_the_dump_attributes():
    xml = _h100_xml()
    efa = xml.replace('name="mlx5_0"', 'name="rdmap16s27"', 1)
    node = D.parse_nccl_topo_xml(efa)
    assert node.nic("rdmap16s27").kind == "ib" and node.nic("rdmap16s27").speed_gbytes_per_s == 50.0
    # an RDMA port named like an ethernet interface is still RDMA: the guid says so, not the name
    roce = xml.replace('name="mlx5_0"', 'name="eth2"', 1)
    assert D.parse_nccl_topo_xml(roce).nic("eth2").kind == "ib"
    topo = D.detect_topology(nccl_xml=efa, nodes=2)
    assert topo.layout.nics[0].name == "rdmap16s27" and topo.layout.nics[0].kind == "ib"
