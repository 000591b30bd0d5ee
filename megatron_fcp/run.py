"""Run an unmodified Megatron-LM pretrain script with FCP: ``python -m megatron_fcp.run``.

    torchrun --nproc-per-node 8 -m megatron_fcp.run pretrain_gpt.py <Megatron flags> \\
        --context-parallel-size 8 --fcp --fcp-topology dgx-h100:1 [--fcp-graph ...]
    torchrun ... -m megatron_fcp.run -m my_pkg.pretrain <flags>        # a module instead of a file

What it does, in order:

1. reads the ``--fcp-*`` flags (and ``--fcp-config FILE.yaml``) out of the script's arguments with
   the parser of :func:`~megatron_fcp.patches.args.add_fcp_args`;
2. FCP not enabled (no ``--fcp``, nor ``enabled: true`` in the YAML): removes the ``--fcp-*``
   flags, says so on stderr when there were any, and runs the script with nothing patched --
   exactly Megatron's own path;
3. FCP enabled: checks that ``megatron.training`` imports (megatron-core >= 0.17 wheels or a
   Megatron-LM checkout; 0.14-0.16 wheels raise
   :class:`~megatron_fcp.patches.megatron_lm.MegatronTrainingMissingError` naming the fix) and
   installs the two hooks of :mod:`megatron_fcp.patches.megatron_lm`: the flags are registered
   with Megatron-LM's own parser (whichever entry point the release parses through) and FCP is
   applied after the process groups exist, before the model is built;
4. runs the script as ``__main__`` (``runpy``), with ``sys.argv`` = the script and its flags and
   the script's folder first on ``sys.path``, as ``python pretrain_gpt.py`` would.

Nothing here knows a release: the release-specific facts live in the hook module's table.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from megatron_fcp.config import FCPConfig

__all__ = ["split_fcp_argv", "main"]

_USAGE = "python -m megatron_fcp.run (SCRIPT.py | -m MODULE) [script and --fcp-* flags ...]"


def _fcp_parser() -> argparse.ArgumentParser:
    from megatron_fcp.patches.args import add_fcp_args  # noqa: PLC0415

    return add_fcp_args(argparse.ArgumentParser(prog="megatron_fcp.run", add_help=False, allow_abbrev=False))


def split_fcp_argv(argv: list[str]) -> tuple[FCPConfig, list[str], list[str]]:
    """``(config, argv without --fcp-* flags, the removed flags)`` of a script's arguments.

    The config merges defaults < ``--fcp-config`` YAML < flags (as Megatron's parse would).
    Unknown ``--fcp-*`` spellings are not guessed: argparse's ``allow_abbrev=False`` leaves them
    to Megatron's parser, which reports them.
    """
    from megatron_fcp.patches.args import fcp_config_from_args  # noqa: PLC0415

    parser = _fcp_parser()
    ns, rest = parser.parse_known_args(argv)
    removed, j = [], 0
    for a in argv:  # rest is argv in order minus what the FCP parser consumed
        if j < len(rest) and rest[j] == a:
            j += 1
        else:
            removed.append(a)
    return fcp_config_from_args(ns), rest, removed


def _target(argv: list[str]) -> tuple[str, str, list[str]]:
    """``("path"|"module", name, script args)`` from the launcher's own arguments."""
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(f"usage: {_USAGE}\n\n{__doc__.split(chr(10) + chr(10))[0]}")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(f"usage: {_USAGE} (-m needs a module name)")
        return "module", argv[1], argv[2:]
    if not os.path.isfile(argv[0]):
        raise SystemExit(f"megatron_fcp.run: script {argv[0]!r} not found (usage: {_USAGE})")
    return "path", argv[0], argv[1:]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    kind, name, script_argv = _target(argv)
    config, plain_argv, removed = split_fcp_argv(script_argv)
    if config.enabled:
        from megatron_fcp.patches.megatron_lm import install_launch_hooks  # noqa: PLC0415

        install_launch_hooks()
        forwarded = script_argv  # Megatron's parser now knows the --fcp-* flags: get_args() carries them
    else:
        if removed and os.environ.get("RANK", "0") == "0":
            print(f"megatron_fcp.run: FCP not enabled (no --fcp); ignoring {' '.join(removed)} and running "
                  f"{name} unchanged", file=sys.stderr)
        forwarded = plain_argv
    if kind == "module":
        sys.argv = [name, *forwarded]
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        path = os.path.abspath(name)
        sys.argv = [name, *forwarded]
        sys.path.insert(0, os.path.dirname(path))
        runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main()
