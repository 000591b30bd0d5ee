"""``--fcp-*`` flags generated from :class:`~megatron_fcp.config.FCPConfig`, and YAML run configs.

Flags (one per field, help text = the field's docstring)::

    --fcp/--no-fcp                enabled
    --fcp-graph {auto,ring,...}   graph
    --fcp-topology SPEC           topology
    --fcp-block-tokens N          block_tokens
    --fcp-overlap/--no-fcp-overlap overlap
    --fcp-config FILE.yaml        the ``fcp:`` section of a YAML file

Precedence: dataclass defaults < ``--fcp-config`` YAML < flags given on the command line. To know
which flags were *given*, every generated flag defaults to ``None`` and only non-``None`` values
override (the help text still shows the dataclass default).

With Megatron-LM::

    from megatron.training import pretrain
    from megatron_fcp.patches.args import add_fcp_args
    pretrain(..., extra_args_provider=add_fcp_args)   # parse_args(extra_args_provider=...)

Standalone: ``add_fcp_args(argparse.ArgumentParser())``. :func:`apply_yaml_defaults` lets a YAML
*run* config (tp/pp/cp, seq length, model sizes, plus ``fcp:``) become parser defaults, so flags
with Megatron's names override the YAML.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, fields
from typing import Any, Mapping

from megatron_fcp.config import FCPConfig, field_docs, flag_of, load_yaml
from megatron_fcp.patches.compat import refuse_hybrid_cp

__all__ = [
    "add_fcp_args",
    "fcp_config_from_args",
    "dest_of",
    "apply_yaml_defaults",
    "split_run_yaml",
]

_GROUP_TITLE = "FCP (flexible context parallelism)"


def dest_of(name: str) -> str:
    """argparse ``dest`` of field ``name``: ``enabled`` -> ``fcp``, others ``fcp_<name>``."""
    return flag_of(name).lstrip("-").replace("-", "_")


def add_fcp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``--fcp-*`` flags; a Megatron ``extra_args_provider`` (returns the parser).

    Calling it twice on one parser is a no-op.
    """
    if any(getattr(g, "title", None) == _GROUP_TITLE for g in parser._action_groups):
        return parser
    docs = field_docs(FCPConfig)
    group = parser.add_argument_group(title=_GROUP_TITLE)
    for f in fields(FCPConfig):
        default = f.default if f.default is not MISSING else None
        helptext = f"{docs.get(f.name, '')} (default: {default})"
        kwargs: dict[str, Any] = {"dest": dest_of(f.name), "default": None, "help": helptext}
        if f.type in ("bool", bool):
            kwargs["action"] = argparse.BooleanOptionalAction  # --fcp/--no-fcp, --fcp-overlap/...
        else:
            kwargs["type"] = {"int": int, int: int, "float": float, float: float}.get(f.type, str)
            if "choices" in f.metadata:
                kwargs["choices"] = list(f.metadata["choices"])
            if kwargs["type"] in (int, float) or "metavar" in f.metadata:
                kwargs["metavar"] = f.metadata.get("metavar", "N")
        group.add_argument(flag_of(f.name), **kwargs)
    group.add_argument(
        "--fcp-config",
        dest="fcp_config",
        default=None,
        metavar="FILE.yaml",
        help="YAML file whose fcp: section sets the FCP options; flags given here override it.",
    )
    return parser


def fcp_config_from_args(args: argparse.Namespace, base: FCPConfig | None = None) -> FCPConfig:
    """Merge ``base`` (or defaults), then ``--fcp-config`` YAML, then flags that were given.

    FCP enabled together with Megatron-LM's ``--hybrid-context-parallel`` raises
    :class:`~megatron_fcp.patches.compat.HybridCPUnsupportedError` (why, and what to use instead).
    """
    config = base or FCPConfig()
    yaml_path = getattr(args, "fcp_config", None)
    if yaml_path:
        config = config.replace(**FCPConfig.from_yaml(yaml_path).to_dict())
    given = {}
    for f in fields(FCPConfig):
        value = getattr(args, dest_of(f.name), None)
        if value is not None:
            given[f.name] = value
    config = config.replace(**given) if given else config
    if config.enabled:
        refuse_hybrid_cp("--fcp", args=args)
    return config


def split_run_yaml(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a run YAML into ``(run settings, fcp section)``."""
    data = dict(data)
    fcp = data.pop("fcp", None) or {}
    if not isinstance(fcp, dict):
        raise ValueError("the fcp: section of a run config must be a mapping")
    return data, fcp


def apply_yaml_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """Make the YAML run config at ``path`` the parser's defaults; return its ``fcp:`` section.

    A relative ``fcp.topology`` file is looked up beside the YAML file when it is not found
    relative to the working directory. Keys are the parser's ``dest`` names or flag spellings (``context_parallel_size`` or
    ``context-parallel-size``). Unknown keys raise ``ValueError`` naming them, so a typo in the
    YAML cannot silently fall back to a default.
    """
    run, fcp = split_run_yaml(load_yaml(path))
    dests = {a.dest for a in parser._actions}
    defaults = {}
    unknown = []
    for key, value in run.items():
        dest = str(key).replace("-", "_")
        if dest in dests:
            defaults[dest] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(map(str, unknown))}")
    parser.set_defaults(**defaults)
    topo = fcp.get("topology")
    if isinstance(topo, str) and topo.endswith((".yaml", ".yml")) and not os.path.isabs(topo):
        beside = os.path.join(os.path.dirname(os.path.abspath(path)), topo)
        if not os.path.exists(topo) and os.path.exists(beside):
            fcp = {**fcp, "topology": beside}  # relative to the run config, like an include
    FCPConfig.from_dict(fcp)  # validate now: errors name the key before anything starts
    return fcp
