"""FCPConfig validation, YAML round trip, and the --fcp-* flags generated from it (no processes)."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest
import yaml

from megatron_fcp.config import KERNELS, FCPConfig, field_docs, flag_of
from megatron_fcp.planner.builders import BUILDERS, GRAPH_CHOICES
from megatron_fcp.patches.args import (
    add_fcp_args,
    apply_yaml_defaults,
    dest_of,
    fcp_config_from_args,
)


def _parser() -> argparse.ArgumentParser:
    return add_fcp_args(argparse.ArgumentParser(prog="t"))


# ---- validation ------------------------------------------------------------------------------------
def test_defaults_are_valid_and_disabled():
    cfg = FCPConfig()
    assert cfg.enabled is False and cfg.graph == "auto" and cfg.topology == "auto"
    assert cfg.block_tokens == 0 and cfg.overlap is True and cfg.kernel == "auto"


def test_kernel_names_are_the_attention_registry():
    from megatron_fcp.attention.dispatch import BLOCK_KERNELS, KERNEL_CHOICES

    assert KERNELS == KERNEL_CHOICES and set(KERNELS) == {"auto", *BLOCK_KERNELS}
    assert all(FCPConfig(kernel=name).kernel == name for name in KERNELS)


@pytest.mark.parametrize("graph", GRAPH_CHOICES)
def test_every_graph_name_is_accepted(graph):
    assert FCPConfig(graph=graph).graph == graph


def test_graph_choices_come_from_the_builder_registry():
    """One registry: the config, its flag and the CLI offer auto plus every builder that needs no KV
    sizes; balanced (which needs sizes no runtime path supplies yet) is not offered by name."""
    assert GRAPH_CHOICES == ("auto", *(n for n in BUILDERS if n != "balanced"))
    with pytest.raises(ValueError, match="unknown FCP graph 'balanced'"):
        FCPConfig(graph="balanced")


@pytest.mark.parametrize(
    "kwargs, flag, words",
    [
        ({"graph": "tree"}, "--fcp-graph", "unknown FCP graph 'tree'"),
        ({"topology": "missing/topo.yaml"}, "--fcp-topology", "topology file not found"),
        ({"topology": "dgx h100"}, "--fcp-topology", "PRESET[:NODES]"),
        ({"block_tokens": -1}, "--fcp-block-tokens", ">= 0"),
        ({"block_tokens": True}, "--fcp-block-tokens", ">= 0"),
        ({"overlap": "yes"}, "--fcp-overlap", "true or false"),
        ({"enabled": 1}, "--fcp", "true or false"),
        ({"kernel": "flash"}, "--fcp-kernel", "unknown block kernel 'flash'"),
    ],
)
def test_bad_values_name_the_flag(kwargs, flag, words):
    with pytest.raises(ValueError) as err:
        FCPConfig(**kwargs)
    assert flag in str(err.value) and words in str(err.value)


def test_topology_preset_and_existing_file_are_accepted(tmp_path):
    assert FCPConfig(topology="dgx-h100:2").topology == "dgx-h100:2"
    path = tmp_path / "t.yaml"
    path.write_text("name: x\n")
    assert FCPConfig(topology=str(path)).topology == str(path)


def test_parts_per_chunk_from_block_tokens():
    assert FCPConfig().parts_per_chunk(4096) == 1
    assert FCPConfig(block_tokens=1024).parts_per_chunk(4096) == 4
    assert FCPConfig(block_tokens=8192).parts_per_chunk(4096) == 1  # one block per chunk
    with pytest.raises(ValueError, match="--fcp-block-tokens 1000 must divide"):
        FCPConfig(block_tokens=1000).parts_per_chunk(4096)


# ---- YAML --------------------------------------------------------------------------------------------
def test_yaml_round_trip(tmp_path):
    cfg = FCPConfig(enabled=True, graph="hierarchical", topology="dgx-h100:2", block_tokens=4096, overlap=False)
    path = tmp_path / "fcp.yaml"
    path.write_text(cfg.to_yaml())
    assert yaml.safe_load(path.read_text())["fcp"]["graph"] == "hierarchical"
    assert FCPConfig.from_yaml(str(path)) == cfg


def test_yaml_unknown_key_and_missing_file(tmp_path):
    path = tmp_path / "fcp.yaml"
    path.write_text("fcp:\n  enabled: true\n  grpah: ring\n")
    with pytest.raises(ValueError, match="unknown key.*grpah"):
        FCPConfig.from_yaml(str(path))
    with pytest.raises(ValueError, match="config file not found"):
        FCPConfig.from_yaml(str(tmp_path / "nope.yaml"))


# ---- flags -------------------------------------------------------------------------------------------
def test_flags_are_generated_from_every_field_with_docstring_help():
    parser = _parser()
    docs = field_docs(FCPConfig)
    assert set(docs) == {f.name for f in fields(FCPConfig)}
    options = {opt: action for action in parser._actions for opt in action.option_strings}
    for f in fields(FCPConfig):
        action = options[flag_of(f.name)]
        assert action.dest == dest_of(f.name)
        assert docs[f.name].split()[0] in action.help  # help text is the field docstring
    assert flag_of("enabled") == "--fcp" and flag_of("block_tokens") == "--fcp-block-tokens"
    assert "--no-fcp-overlap" in options and "--fcp-config" in options
    assert list(options["--fcp-graph"].choices) == list(GRAPH_CHOICES)
    assert list(options["--fcp-kernel"].choices) == list(KERNELS)


def test_add_fcp_args_twice_is_a_noop():
    parser = _parser()
    before = len(parser._actions)
    assert add_fcp_args(parser) is parser and len(parser._actions) == before


def test_flags_parse_into_config():
    args = _parser().parse_args(
        ["--fcp", "--fcp-graph", "spanning", "--fcp-topology", "pcie-box:2", "--fcp-block-tokens", "512",
         "--no-fcp-overlap", "--fcp-kernel", "cpu-flash"]
    )
    assert fcp_config_from_args(args) == FCPConfig(
        enabled=True, graph="spanning", topology="pcie-box:2", block_tokens=512, overlap=False, kernel="cpu-flash"
    )
    assert fcp_config_from_args(_parser().parse_args([])) == FCPConfig()


def test_unknown_graph_flag_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--fcp-graph", "tree"])
    assert "invalid choice: 'tree'" in capsys.readouterr().err


def test_cli_overrides_fcp_config_yaml(tmp_path):
    path = tmp_path / "fcp.yaml"
    path.write_text("fcp:\n  enabled: true\n  graph: ring\n  block_tokens: 256\n")
    args = _parser().parse_args(["--fcp-config", str(path), "--fcp-graph", "full"])
    cfg = fcp_config_from_args(args)
    assert (cfg.enabled, cfg.graph, cfg.block_tokens) == (True, "full", 256)  # YAML kept, flag wins


def test_extra_args_provider_contract_with_megatron_style_parser():
    """Megatron's parse_args calls ``parser = extra_args_provider(parser)`` on its own parser."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser = add_fcp_args(parser)
    args = parser.parse_args(["--context-parallel-size", "4", "--fcp"])
    assert args.context_parallel_size == 4 and fcp_config_from_args(args).enabled


def _megatron_argv(*extra: str) -> list[str]:
    """A tiny model's Megatron-LM command line (what validate_args needs to accept it)."""
    return ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", *extra]


def test_megatron_training_parse_args_when_installed(monkeypatch, tmp_path):
    """Megatron-LM's own parser and validation with our provider (wheels ship megatron.training
    from megatron-core 0.17): flags, ``--fcp-config`` YAML under them, Megatron's args untouched."""
    arguments = pytest.importorskip("megatron.training.arguments")  # absent from the 0.14-0.16 wheels
    yaml_file = tmp_path / "fcp.yaml"
    yaml_file.write_text("fcp:\n  enabled: true\n  graph: hierarchical\n  block_tokens: 8\n  overlap: false\n")
    monkeypatch.setattr("sys.argv", _megatron_argv("--context-parallel-size", "1", "--fcp-config", str(yaml_file),
                                                   "--fcp-graph", "ring", "--fcp-kernel", "cpu-flash"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = arguments.parse_args(extra_args_provider=add_fcp_args)
    args = arguments.validate_args(args, {}) or args  # Megatron's own checks of the whole command line
    config = fcp_config_from_args(args)
    assert config == FCPConfig(enabled=True, graph="ring", block_tokens=8, overlap=False, kernel="cpu-flash")
    assert args.num_layers == 2 and args.seq_length == 64 and args.context_parallel_size == 1
    # a typo in an FCP flag is Megatron's parser's error, like any other flag
    monkeypatch.setattr("sys.argv", _megatron_argv("--fcp-graph", "mesh"))
    with pytest.raises(SystemExit):
        arguments.parse_args(extra_args_provider=add_fcp_args)


def test_megatron_training_hybrid_cp_with_fcp_is_refused(monkeypatch):
    """``--hybrid-context-parallel`` is Megatron-LM's own flag (0.17+ wheels): with ``--fcp`` it fails
    at argument time, naming both and what to use instead."""
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron_fcp.patches.compat import HybridCPUnsupportedError

    monkeypatch.setattr("sys.argv", _megatron_argv("--hybrid-context-parallel", "--fcp"))
    args = arguments.parse_args(extra_args_provider=add_fcp_args)
    assert args.hybrid_context_parallel
    with pytest.raises(HybridCPUnsupportedError, match="--fcp: --hybrid-context-parallel.*drop --fcp"):
        fcp_config_from_args(args)


# ---- YAML run configs ---------------------------------------------------------------------------
def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--seq-length", type=int, default=64)
    return add_fcp_args(parser)


def test_run_yaml_sets_defaults_and_flags_override(tmp_path):
    topo = tmp_path / "topo.yaml"
    topo.write_text("name: t\n")
    path = tmp_path / "run.yaml"
    path.write_text("context_parallel_size: 4\nseq-length: 128\nfcp:\n  enabled: true\n  topology: topo.yaml\n")
    parser = _run_parser()
    fcp = apply_yaml_defaults(parser, str(path))
    args = parser.parse_args(["--seq-length", "256"])
    assert args.context_parallel_size == 4 and args.seq_length == 256
    assert fcp["topology"] == str(topo)  # relative file resolved beside the run config
    assert fcp_config_from_args(args, base=FCPConfig.from_dict(fcp)).enabled


def test_run_yaml_unknown_key_fails(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("context_paralel_size: 4\n")
    with pytest.raises(ValueError, match="unknown key.*context_paralel_size"):
        apply_yaml_defaults(_run_parser(), str(path))


def test_run_yaml_bad_fcp_section_fails_before_parsing(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("fcp:\n  graph: mesh\n")
    with pytest.raises(ValueError, match="unknown FCP graph 'mesh'"):
        apply_yaml_defaults(_run_parser(), str(path))
