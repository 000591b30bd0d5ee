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

:class:`LastAgreed` serves callers without an epoch (``fcp_attention`` outside Megatron): a rank
skips the collective only when its facts equal the *last* facts its group agreed on. Every
agreement leaves the same "last" on every rank of the group, so two ranks can never both skip
while holding different plans: a rank whose plan changed calls the collective, and if a peer
skipped (its plan did not change) the call cannot complete and raises at the timeout instead of
letting the two post transfers that do not match. Alternating between two plans therefore agrees
on every call (one small collective); repeating one plan agrees once.

Every agreement is bounded: one ``all_gather`` of a fixed 4 KiB slot per rank, waited for at
most ``timeout_s``; a rank that is dead, stuck, or failed its own checks before reaching the
agreement makes its peers raise :class:`FCPAgreementError` instead of waiting forever.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from megatron_fcp.attention.groups import VirtualGroup

__all__ = ["FCPAgreementError", "field_digests", "agree", "gather_json", "AgreementCache", "LastAgreed",
           "DEFAULT_AGREEMENT_TIMEOUT_S"]

DEFAULT_AGREEMENT_TIMEOUT_S = 300.0
_SLOT = 4096  # bytes per rank in the agreement all_gather: a length header + JSON [[name, digest], ...]


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


def _gather_digests(digests: dict[str, str], group: Any, timeout_s: float, what: str,
                    ranks: list[int]) -> list[dict[str, str]]:
    """All ranks' digests: one bounded ``all_gather`` of a fixed-size byte slot per rank."""
    payload = json.dumps(list(digests.items())).encode()
    if len(payload) > _SLOT - 8:
        raise ValueError(f"{what}: {len(digests)} agreement fields do not fit the {_SLOT}-byte slot")
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    mine = torch.zeros(_SLOT, dtype=torch.uint8)
    mine[:8 + len(payload)] = torch.frombuffer(bytearray(len(payload).to_bytes(8, "little") + payload),
                                               dtype=torch.uint8)
    mine = mine.to(device)
    slots = [torch.empty_like(mine) for _ in ranks]
    _bounded(dist.all_gather(slots, mine, group=group, async_op=True), timeout_s,
             f"{what}: agreement across the CP group {ranks}")
    out = []
    for slot in slots:
        raw = bytes(slot.cpu().tolist())
        n = int.from_bytes(raw[:8], "little")
        out.append(dict(json.loads(raw[8:8 + n].decode())))
    return out


def _bounded(work: Any, timeout_s: float, what: str) -> None:
    """Wait for a collective at most ``timeout_s``; raise :class:`FCPAgreementError` (``what`` did
    not complete ...) if it does not complete."""
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        ok, err = False, exc
    else:
        err = None
    if ok is False:
        raise FCPAgreementError(
            f"{what} did not complete within {timeout_s:g} s"
            + (f" ({err})" if err is not None else "") + ": a rank of the group is dead, stuck, failed "
            "its own checks before this point, or holds a plan its group agreed on before (see the other "
            "ranks' errors); the group is unusable after this"
        ) from err


def gather_json(obj: Any, group: Any = None, *, what: str, timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S) -> list:
    """Every rank's JSON-serialisable ``obj`` in rank order: two bounded ``all_gather`` (the payload
    lengths, then the payloads padded to the longest), each waited for at most ``timeout_s``
    (:class:`FCPAgreementError` otherwise). JSON keeps floats exact (shortest round-tripping repr)."""
    world = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    payload = json.dumps(obj).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in ranks]
    _bounded(dist.all_gather(sizes, size, group=group, async_op=True), timeout_s, f"{what}: exchange across the ranks {ranks}")
    n = [int(x.item()) for x in sizes]
    mine = torch.zeros(max(n), dtype=torch.uint8)
    mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else mine[:0]
    mine = mine.to(device)
    slots = [torch.empty_like(mine) for _ in ranks]
    _bounded(dist.all_gather(slots, mine, group=group, async_op=True), timeout_s, f"{what}: exchange across the ranks {ranks}")
    return [json.loads(bytes(slot[:k].cpu().tolist()).decode()) for slot, k in zip(slots, n)]


def agree(fields: Mapping[str, Any], group: Any = None, *, what: str = "FCP plan",
          timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S) -> str:
    """Check that every rank of ``group`` passes the same ``fields``; return the combined digest.

    One ``all_gather`` of a 4 KiB slot per rank over ``group`` (every rank of the group must call
    it, with its own values), waited for at most ``timeout_s``. Raises
    :class:`FCPAgreementError` on every rank when any field differs, naming the first differing
    field (in the given order) and the ranks on each side, or when the group does not complete
    the exchange in time.
    """
    digests = field_digests(fields)
    if isinstance(group, VirtualGroup):  # ranks in one process: the group gathers the digests itself
        ranks = list(group.ranks)
        gathered = group.all_gather_object(digests, timeout_s, what)
    else:
        world = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        gathered = _gather_digests(digests, group, timeout_s, what, ranks)
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
               what: str = "FCP plan", timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S) -> None:
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
        agree(fields, group, what=what, timeout_s=timeout_s)
        self._agreed[id(group)] = (epoch, digests)


class LastAgreed:
    """Agreement on the first use of a plan per group, without an epoch (see the module docstring):
    skip only when the facts equal the last ones this group agreed on."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[Any, str]] = {}  # id(group) -> (group, combined digest)

    def ensure(self, fields: Mapping[str, Any], group: Any, *, what: str = "FCP plan",
               timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S) -> bool:
        """Agree on ``fields`` unless they are what ``group`` agreed on last; True if a collective ran."""
        key = _digest(tuple(field_digests(fields).items()))
        seen = self._last.get(id(group))
        if seen is not None and seen[0] is group and seen[1] == key:
            return False
        self._last.pop(id(group), None)  # a failed agreement leaves nothing to skip on
        agree(fields, group, what=what, timeout_s=timeout_s)
        self._last[id(group)] = (group, key)
        return True

    def clear(self) -> None:
        self._last.clear()
