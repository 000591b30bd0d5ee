"""Agreement: the ranks of a CP group prove they hold the same plan before the first transfer.

Every rank builds its plans on its own (the planner is pure and deterministic), so two ranks can
only disagree when their *inputs* differ: document lengths of a packed micro-batch read from
different data, a different config or topology file, tensors of another shape or dtype. Ranks that
disagree would post transfers that never match and hang. :func:`agree` turns that hang into an
error: each rank reduces the facts a plan depends on to one short digest per named field, the group
exchanges them in one ``all_gather_object`` (a few hundred bytes), and every rank raises
:class:`FCPAgreementError` naming the first field that differs and which ranks hold which value.

Skipping the collective must be decided the same way on every rank, or a rank that skips leaves
the others waiting: a rank cannot skip because *its* facts were agreed before, since another rank's
facts may have changed. :class:`AgreementCache` therefore keys agreement by an *epoch* that the
caller advances identically on every rank (the Megatron runtime: one per micro-batch): the first
call of an epoch agrees (one small collective), later calls of the same epoch compare their facts
with the agreed digests locally and raise at once if they differ. Without an epoch every call
agrees.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch.distributed as dist

__all__ = ["FCPAgreementError", "field_digests", "agree", "AgreementCache"]


class FCPAgreementError(RuntimeError):
    """The ranks of a CP group hold different plans (the message names the field and the ranks)."""


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def field_digests(fields: Mapping[str, Any]) -> dict[str, str]:
    """``{name: 16-hex digest of repr(value)}`` in the given order (values must have a stable repr:
    tuples, ints, strings, frozen dataclasses of those)."""
    return {name: _digest(value) for name, value in fields.items()}


def _describe(name: str, per_rank: list[dict[str, str]], ranks: list[int], values: Mapping[str, Any]) -> str:
    groups: dict[str, list[int]] = {}
    for r, digests in zip(ranks, per_rank):
        groups.setdefault(digests.get(name, "<missing>"), []).append(r)
    parts = [f"ranks {rs} hold {d}" for d, rs in groups.items()]
    mine = repr(values.get(name))
    mine = mine if len(mine) <= 200 else mine[:200] + "..."
    return f"'{name}' differs across the CP group: " + "; ".join(parts) + f" (this rank's value: {mine})"


def agree(fields: Mapping[str, Any], group: Any = None, *, what: str = "FCP plan") -> str:
    """Check that every rank of ``group`` passes the same ``fields``; return the combined digest.

    One ``all_gather_object`` over ``group`` (every rank of the group must call it, with its own
    values). Raises :class:`FCPAgreementError` on every rank when any field differs, naming the
    first differing field (in the given order) and the ranks on each side.
    """
    digests = field_digests(fields)
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, digests, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    for name in list(digests) + [n for g in gathered for n in g if n not in digests]:
        if len({g.get(name) for g in gathered}) > 1:
            raise FCPAgreementError(
                f"{what}: {_describe(name, gathered, ranks, fields)}. The ranks would post transfers "
                "that never match; give every rank of the CP group the same inputs (e.g. the same "
                "micro-batch's document lengths)"
            )
    return _digest(tuple(digests.items()))


class AgreementCache:
    """Agreement once per (group, epoch); see the module docstring for why the epoch is the caller's."""

    def __init__(self) -> None:
        self._agreed: dict[int, tuple[Any, dict[str, str]]] = {}  # id(group) -> (epoch, digests)

    def ensure(self, fields: Mapping[str, Any], group: Any = None, *, epoch: Any = None,
               what: str = "FCP plan") -> None:
        """Agree on ``fields`` (first call of ``epoch`` for ``group``, or every call when ``epoch``
        is None); in an epoch already agreed, raise :class:`FCPAgreementError` if ``fields`` differ
        from what was agreed (no collective)."""
        digests = field_digests(fields)
        seen = self._agreed.get(id(group))
        if epoch is not None and seen is not None and seen[0] == epoch:
            changed = [n for n in digests if seen[1].get(n) != digests[n]]
            if changed:
                raise FCPAgreementError(
                    f"{what}: '{changed[0]}' changed within one agreed epoch ({epoch!r}); every call of an "
                    "epoch (one micro-batch) must use the same inputs"
                )
            return
        agree(fields, group, what=what)
        self._agreed[id(group)] = (epoch, digests)
