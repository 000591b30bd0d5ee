"""``python -m megatron_fcp.run``'s own logic, without Megatron's training loop (any release).

Reading the ``--fcp-*`` flags out of a script's arguments, running the script unchanged without
``--fcp``, and the clear error where the installed megatron-core ships no ``megatron.training``
(0.14-0.16 wheels). Megatron-LM's real ``pretrain()`` through the launcher:
tests/test_megatron_pretrain.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from megatron_fcp.patches.megatron_lm import MegatronTrainingMissingError
from megatron_fcp.run import main, split_fcp_argv

HAS_TRAINING = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.training") is not None


def test_fcp_flags_are_read_and_removed_in_order():
    argv = ["--num-layers", "2", "--fcp", "--fcp-graph", "ring", "--seq-length", "2", "--fcp-topology", "dgx-h100:1"]
    config, rest, removed = split_fcp_argv(argv)
    assert config.enabled and config.graph == "ring" and config.topology == "dgx-h100:1"
    assert rest == ["--num-layers", "2", "--seq-length", "2"]
    assert removed == ["--fcp", "--fcp-graph", "ring", "--fcp-topology", "dgx-h100:1"]


def test_without_fcp_the_config_is_disabled_and_megatron_flags_untouched():
    config, rest, removed = split_fcp_argv(["--spec", "m", "f", "--fcp-graph", "ring"])
    assert not config.enabled and rest == ["--spec", "m", "f"] and removed == ["--fcp-graph", "ring"]


def test_yaml_enables_fcp_like_the_flag(tmp_path):
    path = tmp_path / "fcp.yaml"
    path.write_text("fcp:\n  enabled: true\n  graph: ring\n")
    config, rest, _ = split_fcp_argv(["--fcp-config", str(path), "--lr", "1"])
    assert config.enabled and config.graph == "ring" and rest == ["--lr", "1"]


def _run(tmp_path, monkeypatch, capsys, *argv):
    """``python -m megatron_fcp.run SCRIPT argv`` in this process (sys.argv and sys.path restored)."""
    script = tmp_path / "script.py"
    script.write_text("import json, sys\nprint(json.dumps({'argv': sys.argv, 'name': __name__}))\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    main([str(script), *argv])
    return capsys.readouterr()


def test_without_fcp_the_script_runs_as_main_with_the_fcp_flags_stripped(tmp_path, monkeypatch, capsys):
    captured = _run(tmp_path, monkeypatch, capsys, "--lr", "1", "--fcp-graph", "ring")
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["name"] == "__main__" and out["argv"][1:] == ["--lr", "1"]
    assert "FCP not enabled (no --fcp); ignoring --fcp-graph ring" in captured.err


@pytest.mark.skipif(HAS_TRAINING, reason="megatron.training is installed (megatron-core >= 0.17)")
def test_fcp_without_megatron_training_names_the_fix(tmp_path, monkeypatch, capsys):
    with pytest.raises(MegatronTrainingMissingError, match=r"megatron-core>=0\.17"):
        _run(tmp_path, monkeypatch, capsys, "--fcp")


def test_a_missing_script_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit, match="not found"):
        main([str(tmp_path / "nope.py")])
