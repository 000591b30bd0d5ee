"""``megatron-fcp`` console script.

Each subcommand lives in its own module under :mod:`megatron_fcp.commands` and exposes
``NAME`` (the subcommand), ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
This dispatcher discovers them, so adding a command never touches this file.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from megatron_fcp import commands as _commands_pkg


def _command_modules(only: str | None = None):
    for info in sorted(pkgutil.iter_modules(_commands_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_") or (only is not None and info.name != only):
            continue
        module = importlib.import_module(f"{_commands_pkg.__name__}.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "run"):
            yield module


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The console script's parser; ``only``: just that command's module is imported (a command
    is named after its module), so ``megatron-fcp plan`` does not import the emulator's."""
    parser = argparse.ArgumentParser(
        prog="megatron-fcp",
        description="Flexible Context Parallelism for Megatron: topology, plans, simulation, demo.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _command_modules(only):
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = {m.name for m in pkgutil.iter_modules(_commands_pkg.__path__) if not m.name.startswith("_")}
    args = build_parser(argv[0] if argv and argv[0] in names else None).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
