"""megatron_fcp: Flexible Context Parallelism for Megatron-LM.

Public API (stable):

* :func:`fcp_attention` — exact CP attention for one CP group driven by a :class:`~megatron_fcp.planning.Plan`.
* :func:`apply_fcp` / :func:`revert_fcp` — patch Megatron's core attention (and undo it exactly).
* :class:`FCPConfig` — the one configuration object (also the source of the ``--fcp-*`` flags).
* :func:`setup_fcp` — settle the CP plans from Megatron's process groups (before building the model).
* :func:`place_packed_layer` — place a packed batch (documents of any lengths) on the CP ranks with
  attention work and tokens each balanced (what the plugin runs); :func:`place_packed` balances the
  attention work alone.
* :mod:`megatron_fcp.planning` — the pure planner: ``build_plan``, ``Plan`` (+ ``verify``), the cost model.

Attributes are imported lazily so that ``import megatron_fcp`` never imports megatron-core or
``torch.distributed`` machinery the caller does not use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "fcp_attention": ("megatron_fcp.attention.function", "fcp_attention"),
    "apply_fcp": ("megatron_fcp.patches.megatron", "apply_fcp"),
    "revert_fcp": ("megatron_fcp.patches.megatron", "revert_fcp"),
    "fcp_patched": ("megatron_fcp.patches.megatron", "fcp_patched"),
    "FCPConfig": ("megatron_fcp.config", "FCPConfig"),
    "setup_fcp": ("megatron_fcp.patches.runtime", "setup_fcp"),
    "planning": ("megatron_fcp.planning", None),
    "place_packed": ("megatron_fcp.contract.placement", "place_packed"),
    "place_packed_layer": ("megatron_fcp.contract.layer_placement", "place_packed_layer"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'megatron_fcp' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
