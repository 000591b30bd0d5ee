"""Ranks grouped into nodes by hostname.

:func:`group_ranks_by_host` is pure; :func:`gather_host_info` is the only code of the detection
package that talks to a process group, and it imports ``torch.distributed`` inside the function,
so parsing and building topologies never need it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

__all__ = ["HostGroups", "group_ranks_by_host", "gather_host_info"]


@dataclass(frozen=True)
class HostGroups:
    """Ranks grouped into nodes by hostname.

    ``hosts[k]`` is node ``k``'s hostname (nodes in order of their lowest rank) and ``ranks[k]``
    its global ranks ordered by local rank (``LOCAL_RANK`` when known, else ascending rank).
    ``fabric[k]`` is node ``k``'s NVLink fabric id (:mod:`.fabric`) when gathered, else empty.
    """

    hosts: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...]
    fabric: tuple[str | None, ...] = ()

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)

    @property
    def ranks_per_node(self) -> int:
        return len(self.ranks[0])

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.ranks)

    @property
    def contiguous(self) -> bool:
        """True for the launcher's usual layout: node ``k`` holds ranks ``k*g .. k*g+g-1`` in order."""
        g = self.ranks_per_node
        return all(r == tuple(range(k * g, k * g + g)) for k, r in enumerate(self.ranks))

    def node_of(self, rank: int) -> int:
        for k, rs in enumerate(self.ranks):
            if rank in rs:
                return k
        raise KeyError(f"rank {rank} is not in any node ({self.world_size} ranks)")

    def local_rank_of(self, rank: int) -> int:
        return self.ranks[self.node_of(rank)].index(rank)


def group_ranks_by_host(
    hostnames: Sequence[str],
    *,
    ranks: Sequence[int] | None = None,
    local_ranks: Sequence[int | None] | None = None,
    local_world_sizes: Sequence[int | None] | None = None,
) -> HostGroups:
    """Group ranks into nodes: entry ``i`` of every list describes global rank ``ranks[i]``
    (default ``i``). Pure; :func:`gather_host_info` feeds it from a process group.

    Checks, each a ``ValueError`` that names the host/rank and the fix: every node has the same
    number of ranks; a rank's ``LOCAL_WORLD_SIZE`` (when known) equals the number of ranks that
    share its hostname (a mismatch usually means two machines report the same hostname, e.g.
    containers, or a launcher that set it wrongly); ``LOCAL_RANK`` values on a host are exactly
    ``0..g-1``. Ranks on a node are ordered by ``LOCAL_RANK`` when every rank gave one.
    """
    n = len(hostnames)
    if n == 0:
        raise ValueError("group_ranks_by_host: no hostnames (empty process group?)")
    ranks = list(range(n)) if ranks is None else list(ranks)
    for name, seq in (("ranks", ranks), ("local_ranks", local_ranks), ("local_world_sizes", local_world_sizes)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"group_ranks_by_host: {name} has {len(seq)} entries, hostnames has {n}")
    if len(set(ranks)) != n:
        raise ValueError(f"group_ranks_by_host: duplicate ranks in {ranks}")
    for i, h in enumerate(hostnames):
        if not isinstance(h, str) or not h:
            raise ValueError(f"group_ranks_by_host: rank {ranks[i]} has an empty/invalid hostname {h!r}")

    members: dict[str, list[int]] = {}
    for i, h in enumerate(hostnames):
        members.setdefault(h, []).append(i)  # indices into the lists
    sizes = {h: len(ix) for h, ix in members.items()}

    if local_world_sizes is not None:
        for i, lws in enumerate(local_world_sizes):
            if lws is not None and lws != sizes[hostnames[i]]:
                raise ValueError(
                    f"rank {ranks[i]} on host {hostnames[i]!r} has LOCAL_WORLD_SIZE={lws} but "
                    f"{sizes[hostnames[i]]} ranks report that hostname; if several machines share a "
                    f"hostname (containers), pass distinct names or describe the cluster with --topology FILE.yaml"
                )
    if len(set(sizes.values())) > 1:
        desc = ", ".join(f"{h}: {c}" for h, c in sizes.items())
        raise ValueError(
            f"uneven nodes (ranks per host: {desc}); FCP's topology needs the same number of ranks "
            f"on every node: launch the same --nproc-per-node everywhere or describe the cluster with --topology FILE.yaml"
        )
    g = next(iter(sizes.values()))

    use_local = local_ranks is not None and all(lr is not None for lr in local_ranks)
    if local_ranks is not None and not use_local and any(lr is not None for lr in local_ranks):
        missing = [ranks[i] for i, lr in enumerate(local_ranks) if lr is None]
        raise ValueError(f"LOCAL_RANK is set on some ranks but not on ranks {missing}; set it everywhere or nowhere")
    groups = []
    for h, ix in members.items():
        if use_local:
            seen: dict[int, int] = {}
            for i in ix:
                lr = local_ranks[i]
                if lr in seen:
                    raise ValueError(f"ranks {ranks[seen[lr]]} and {ranks[i]} on host {h!r} both have LOCAL_RANK={lr}")
                seen[lr] = i
            if sorted(seen) != list(range(g)):
                raise ValueError(f"host {h!r}: LOCAL_RANK values {sorted(seen)} are not 0..{g - 1}")
            ordered = [ranks[seen[lr]] for lr in range(g)]
        else:
            ordered = sorted(ranks[i] for i in ix)
        groups.append((h, tuple(ordered)))
    groups.sort(key=lambda hr: min(hr[1]))
    return HostGroups(hosts=tuple(h for h, _ in groups), ranks=tuple(r for _, r in groups))


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def gather_host_info(group=None, *, hostname: str | None = None) -> HostGroups:
    """Gather ``(hostname, LOCAL_RANK, LOCAL_WORLD_SIZE, NVLink fabric id)`` from every rank of ``group`` (default:
    the world) with one ``all_gather_object`` and group them with :func:`group_ranks_by_host`.

    ``hostname`` defaults to ``socket.gethostname()``; an emulated cluster whose "nodes" share one
    kernel passes its own node names. Every rank receives the same list, so a bad layout raises
    the same ``ValueError`` on all ranks (nobody is left waiting). Imports ``torch.distributed``
    here only, so the rest of this module stays importable without it.
    """
    import socket

    import torch.distributed as dist  # lazy: detection parsing must not need torch.distributed

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gather_host_info needs an initialised torch.distributed process group")
    from megatron_fcp.topology.detect.fabric import read_nvlink_fabric

    mine = (hostname or socket.gethostname(), _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE"),
            read_nvlink_fabric())
    size = dist.get_world_size(group)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    global_ranks = [dist.get_global_rank(group, i) for i in range(size)] if group is not None else list(range(size))
    lrs = [g[1] for g in gathered]
    lwss = [g[2] for g in gathered]
    groups = group_ranks_by_host(
        [g[0] for g in gathered],
        ranks=global_ranks,
        local_ranks=lrs if any(x is not None for x in lrs) else None,
        local_world_sizes=lwss,
    )
    by_rank = {global_ranks[i]: g[3] for i, g in enumerate(gathered)}
    fabric = tuple(by_rank[rs[0]] for rs in groups.ranks)
    return HostGroups(groups.hosts, groups.ranks, fabric if any(f is not None for f in fabric) else ())
