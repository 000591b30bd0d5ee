"""Patch machinery shared by the Megatron patch layer and the CPU shims.

A *target* is written ``"package.module:Attr"`` or ``"package.module:Class.attr"``: the module
whose namespace (or the class whose ``__dict__``) holds the binding that megatron-core looks up
at call time. Patching the binding that is actually looked up matters: a module that did
``from x import f`` keeps its own reference, so patching ``x.f`` would not reach it.

:class:`PatchRegistry` installs replacements idempotently and reverts them exactly:

* every replacement is marked ``__fcp_patched__ = True`` and ``__wrapped__ = original``;
* installing a target twice returns the installed replacement itself (idempotency by identity);
* the registry keeps the raw original (``staticmethod`` objects included) and whether the owner
  held it itself or inherited it, so :meth:`PatchRegistry.revert` restores the exact state;
* a missing module or attribute raises :class:`PatchTargetError` (an ``ImportError``) that names
  the target and the installed megatron-core version.

One registry (``REGISTRY``) exists per process because the state it guards -- module globals of
megatron-core -- is itself process-global.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

__all__ = [
    "SUPPORTED_MEGATRON",
    "PatchTargetError",
    "PatchRegistry",
    "REGISTRY",
    "megatron_core_version",
    "check_megatron_version",
    "resolve_target",
]

logger = logging.getLogger("megatron_fcp.patches")

#: megatron-core releases whose bindings were checked: ``lower <= version < upper``.
SUPPORTED_MEGATRON = ((0, 14), (0, 20))


class PatchTargetError(ImportError):
    """A patch target is missing from the installed megatron-core (message names both)."""


def megatron_core_version() -> str:
    """The installed megatron-core version string, or ``"not installed"``."""
    try:
        from megatron.core import package_info  # noqa: PLC0415 - optional dependency
    except ImportError:
        return "not installed"
    return str(getattr(package_info, "__version__", "unknown"))


def _version_tuple(version: str) -> tuple[int, int]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 2:
        parts.append(0)
    return parts[0], parts[1]


def check_megatron_version() -> tuple[int, int]:
    """Return ``(major, minor)`` of megatron-core; raise ``ImportError`` outside 0.14-0.19."""
    version = megatron_core_version()
    if version == "not installed":
        raise PatchTargetError("megatron_fcp's patches need megatron-core (pip install megatron-core)")
    major_minor = _version_tuple(version)
    lower, upper = SUPPORTED_MEGATRON
    if not lower <= major_minor < upper:
        raise PatchTargetError(
            f"megatron-core {version} is outside the range megatron_fcp supports "
            f"({lower[0]}.{lower[1]} <= version < {upper[0]}.{upper[1]}); its patch targets were "
            "checked against those releases only"
        )
    return major_minor


def resolve_target(target: str) -> tuple[Any, str]:
    """``"pkg.mod:Class.attr"`` -> ``(owner, "attr")`` where ``owner`` is the module or class.

    Raises :class:`PatchTargetError` naming the target and megatron-core version when the module
    cannot be imported or an attribute on the way is missing.
    """
    module_name, sep, qualname = target.partition(":")
    if not sep or not qualname:
        raise ValueError(f"patch target {target!r} must look like 'package.module:Attr'")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PatchTargetError(
            f"cannot patch {target}: module {module_name} does not import with megatron-core "
            f"{megatron_core_version()} ({exc})"
        ) from exc
    *parents, attr = qualname.split(".")
    for name in parents:
        if not hasattr(owner, name):
            raise PatchTargetError(
                f"cannot patch {target}: {module_name} has no {name!r} in megatron-core "
                f"{megatron_core_version()}"
            )
        owner = getattr(owner, name)
    if not hasattr(owner, attr):
        raise PatchTargetError(
            f"cannot patch {target}: symbol {qualname!r} not found in megatron-core "
            f"{megatron_core_version()}"
        )
    return owner, attr


@dataclass
class _Installed:
    target: str
    group: str
    owner: Any
    attr: str
    original_raw: Any  # as stored in the owner's __dict__ (may be a staticmethod), or None
    had_own: bool  # False: the owner inherited the attribute; revert deletes ours
    replacement: Any


class PatchRegistry:
    """Installed patches, keyed by target, with the originals needed for an exact revert."""

    def __init__(self) -> None:
        self._installed: dict[str, _Installed] = {}

    def install(self, target: str, make: Callable[[Any], Any], *, group: str) -> Any:
        """Replace ``target`` with ``make(original)``; return the installed replacement.

        ``original`` is the value as attribute access sees it (a plain function for a method).
        A target already installed is left alone and its replacement returned unchanged.
        """
        if target in self._installed:
            return self._installed[target].replacement
        owner, attr = resolve_target(target)
        current = getattr(owner, attr)
        if getattr(current, "__fcp_patched__", False):
            # Patched by a registry that no longer knows it (e.g. a re-imported module): keep it.
            return current
        own = vars(owner)  # modules and classes alike; read before we overwrite it
        had_own = attr in own
        original_raw = own[attr] if had_own else None  # a staticmethod stays a staticmethod
        replacement = make(current)
        setattr(replacement, "__fcp_patched__", True)
        setattr(replacement, "__wrapped__", current)
        setattr(owner, attr, replacement)
        self._installed[target] = _Installed(
            target, group, owner, attr, original_raw, had_own, replacement
        )
        logger.info("megatron_fcp: patched %s (%s)", target, group)
        return replacement

    def revert(self, group: str | None = None) -> list[str]:
        """Restore every target of ``group`` (all groups when None); return the targets."""
        done = []
        for target in reversed(list(self._installed)):
            entry = self._installed[target]
            if group is not None and entry.group != group:
                continue
            if entry.had_own:
                setattr(entry.owner, entry.attr, entry.original_raw)
            else:
                delattr(entry.owner, entry.attr)
            del self._installed[target]
            done.append(target)
            logger.info("megatron_fcp: restored %s", target)
        return done

    def targets(self, group: str | None = None) -> list[str]:
        return [t for t, e in self._installed.items() if group is None or e.group == group]

    def replacement(self, target: str) -> Any:
        return self._installed[target].replacement if target in self._installed else None

    def original(self, target: str) -> Any:
        """The value attribute access returned before ``target`` was patched."""
        entry = self._installed.get(target)
        return None if entry is None else entry.replacement.__wrapped__


REGISTRY = PatchRegistry()
