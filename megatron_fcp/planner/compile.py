"""Plan compiler: CommGraph + causal need sets -> multicast trees -> rounds -> verified Plan.

Pure (no torch). :func:`megatron_fcp.planner.build.build_plan` (topology + graph name -> plan) is
the entry point callers use; it calls :func:`compile_plan`.

Note [Compiling a plan]
-----------------------
1. *Need sets.* Block ``(owner, chunk, part)`` goes to exactly the ranks of
   :func:`megatron_fcp.contract.needs.readers` (causal: chunk 1 of CP rank i only to CP ranks < i).
2. *Trees.* For each chunk the graph's builder gives a multicast tree from the owner to those
   readers using only graph edges (``CommGraph.tree``). A vertex of the tree that is not a reader is
   a relay the graph forces (e.g. a rail peer that forwards to its node); nothing else is sent.
   All parts of a chunk share the chunk's tree.
3. *Rounds.* Tree edge ``(u, v)`` at depth ``d`` (1 = leaves the owner) of part ``p`` is due in
   round ``d - 1 + p`` when the graph pipelines parts (part p+1 crosses the slow link while part
   p fans out), else ``d - 1``. With port limits (``max_sends`` / ``max_recvs`` per rank per
   round) edges are list-scheduled: each edge, in order of due round and then of the longest path
   below it, takes the first round >= due where both its ports are free; its children become due
   one round later. Without limits every edge lands on its due round (ASAP).
4. *Order.* Within a round, transfers on faster edges are listed first (ranks consume blocks in
   plan order, so an NVLink block should not queue behind one still crossing the network).
5. *Verify.* The plan is checked by :meth:`Plan.verify` (with the port limits) before return.

Under a sliding window (Note [Windowed need sets] in :mod:`megatron_fcp.contract.needs`) the
readers are the window's; the parts of one zigzag chunk may then have different readers (a later
part reaches further), so a chunk's tree spans the union of its parts' readers and each part's
copy is pruned back to the edges that lead to one of *its* readers (:func:`_prune_parts`): every
block still goes only where it is needed (or relayed to a need). Windowed plans are compiled as
objects (no wave tables) and drop trailing empty rounds.

Above :data:`CHECK_TREES_MAX_CP` ranks without port limits every edge lands on its due round and
the builders of ``hierarchical``, ``ring`` and ``full`` write those rounds as numpy columns (Note
[Compiling to a table] in :mod:`megatron_fcp.planner.table_compile`); a plan of more than
:data:`BALANCE_MAX_TRANSFERS` transfers keeps them as a table (Note [Columnar plans] in
:mod:`megatron_fcp.contract.table`), a smaller one is turned into objects and ordered by step 4.

The backward pass uses :meth:`Plan.backward_rounds` (rounds reversed, transfers flipped): the
same trees reduce dK/dV towards each owner.

Round table for ``hierarchical`` on two nodes of two ranks (ranks 0,1 | 2,3; non-causal)::

    round 0: 0->1 0->2 | 1->0 1->3 | 2->3 2->0 | 3->2 3->1    (NVLink + one rail each)
    round 1: 2->3:B(r0) 3->2:B(r1) 0->1:B(r2) 1->0:B(r3)       (fan-out of what crossed)
"""

from __future__ import annotations

import heapq
import weakref
from operator import attrgetter
from typing import Sequence

import numpy as np

from megatron_fcp.contract.blocks import (Block, PlanError, Transfer, cp_index_of, gc_paused, make_transfer,
                                          make_transfers, transfers_from_columns)
from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.needs import readers, zigzag_need_matrix
from megatron_fcp.contract.placement import Placement
from megatron_fcp.contract.plan import Plan, plan_mask
from megatron_fcp.contract.table import TransferTable, block_layout, small_int, table_rounds
from megatron_fcp.jit import isin_ints, jit, unique_ints
from megatron_fcp.planner.graph import CommGraph, runs_of
from megatron_fcp.planner.rounds import colour_rounds
from megatron_fcp.planner.tree_columns import Readers, TreeColumns
from megatron_fcp.topology.route_ids import first_use_ids

__all__ = ["placement_trees", "compile_plan", "compiles_alike"]


def compile_plan(
    cg: CommGraph,
    causal: bool = True,
    parts_per_chunk: int = 1,
    *,
    max_sends: int | None = None,
    max_recvs: int | None = None,
    verify: bool = True,
    balance: bool = True,
    placement: Placement | None = None,
    packing: str = "list",
    stagger_blocks: int = 1,
    columnar: bool = True,
    window: tuple[int, int] | None = None,
    seq_len: int | None = None,
) -> Plan:
    """Compile a CommGraph into a Plan; see Note [Compiling a plan].

    ``window`` (``(left, right)``, Megatron's convention; default: the placement's, or none) and
    ``seq_len`` (the padded global sequence: required for a windowed zigzag plan): need sets follow
    the windowed mask.

    ``packing`` (with port limits): ``"list"`` (list scheduling, the default) or ``"colour"``: with
    one send and one receive per rank per round and one-hop trees, exactly Delta rounds by bipartite
    edge colouring (Note [Optimal rounds] in :mod:`megatron_fcp.planner.rounds`); multi-hop trees
    fall back to list scheduling.

    ``stagger_blocks`` (placements only; default 1 = off): block ``b`` of an owner starts
    ``b mod stagger_blocks`` rounds late, so an owner's blocks pipeline through relays the way
    sub-blocks of a zigzag chunk do (the head-parallel KV stage holds ``2a`` blocks per group).

    ``placement``: a packed batch's blocks per CP rank (CP order = ``cg.ranks``); each block then
    gets its own tree to the ranks its documents need, and ``parts_per_chunk`` must be 1.

    ``columnar`` (default True): where plain waves are placed (above :data:`CHECK_TREES_MAX_CP`
    ranks, no port limits, zigzag) and the builder writes them as columns
    (``GraphBuilder.wave_table``: ``hierarchical``, ``ring``, ``full``), a plan of more than
    :data:`BALANCE_MAX_TRANSFERS` transfers keeps them in a table (Note [Columnar plans] in
    :mod:`megatron_fcp.contract.table`): the same rounds, materialised on first access of
    ``plan.rounds``. A packed batch's plan whose leaf edges are balanced (no port limits) is kept
    as a table too, whatever its size: ``auto`` verifies and prices its candidates from columns and
    only the chosen plan's rounds are ever built as objects. False builds objects as before (tests
    compare the two).
    """
    mask = plan_mask(causal, window, placement)
    if mask.windowed and placement is None:
        zigzag_need_matrix(len(cg.ranks), parts_per_chunk, mask, seq_len)  # checks seq_len first
    with gc_paused():
        return _compile(cg, causal, parts_per_chunk, max_sends, max_recvs, verify, balance, placement, packing,
                        stagger_blocks, columnar, mask, seq_len if mask.windowed else None)


def _sources(ranks, causal: "bool | Mask", placement: Placement | None, seq_len: int | None = None, P: int = 1):
    """``(owner, chunk, readers)`` of every block (every chunk under zigzag: the readers of any of
    its parts) that someone needs."""
    if placement is None:
        for i, owner in enumerate(ranks):
            for chunk in (0, 1):
                dests = readers(ranks, i, chunk, causal, seq_len=seq_len, parts_per_chunk=P)
                if dests:
                    yield owner, chunk, dests
        return
    need = placement.need_matrix()
    rank_arr = np.asarray(ranks, dtype=np.int64)
    for n, (i, b, _) in enumerate(placement.block_list()):
        if need[:, n].any():
            yield ranks[i], b, rank_arr[need[:, n]].tolist()


def _readers(ranks, causal: "bool | Mask", placement: Placement | None, seq_len: int | None = None,
             P: int = 1) -> tuple[np.ndarray, np.ndarray, Readers]:
    """:func:`_sources` as columns: ``(owner [trees], chunk [trees], readers)`` (global ranks), the
    blocks in the same order, each block's readers in CP order. A placement's come straight from
    its need matrix (the non-zeros of the needed blocks' columns)."""
    if placement is None:
        src = list(_sources(ranks, causal, None, seq_len, P))
        return (np.array([o for o, _, _ in src], dtype=np.int64), np.array([c for _, c, _ in src], dtype=np.int64),
                Readers.from_lists([d for _, _, d in src]))
    need = placement.need_matrix()                                          # [cp, blocks]
    rank_arr = np.asarray(ranks, dtype=np.int64)
    needed = np.nonzero(need.any(axis=0))[0]                                # [trees]: block-list columns
    tree, reader = np.nonzero(need[:, needed].T)                            # row-major: tree, then CP order
    ptr = np.zeros(len(needed) + 1, dtype=np.int64)
    np.cumsum(np.bincount(tree, minlength=len(needed)), out=ptr[1:])
    block_rank, block_chunk = _block_columns(placement)
    return rank_arr[block_rank[needed]], block_chunk[needed], Readers(ptr, rank_arr[reader])


def placement_trees(cg: CommGraph, placement: Placement) -> tuple[Readers, TreeColumns]:
    """Every needed block's readers and its tree in ``cg`` over ``placement``, as columns (the
    compiler's first step, before staggering), kept on the placement per graph object: ``auto``
    reads a candidate's trees for its floor before deciding to compile it (Note [Pruning auto] in
    :mod:`megatron_fcp.planner.build`), and the compile then reuses them. A placement's readers are
    its need matrix's (its mask is in it)."""
    key = ("trees", id(cg))
    got = placement._cache.get(key)
    if got is not None and got[0]() is cg:
        return got[1]
    owner, chunk, readers_of = _readers(cg.ranks, placement.mask, placement)
    out = (readers_of, cg.tree_columns(owner, chunk, readers_of))
    for a in (*out[0], *out[1]):
        a.flags.writeable = False     # shared by the floor and the compile: read only
    placement._cache[key] = (weakref.ref(cg), out)
    return out


def compiles_alike(cg: CommGraph, other: CommGraph, placement: Placement) -> bool:
    """Whether :func:`compile_plan` over ``placement`` (the same other arguments, no port limits)
    gives ``other`` the plan it gives ``cg``, transfer for transfer, only its name differing: both
    are builders' graphs over the same ranks and topology (every bandwidth the compiler reads is the
    topology's route), with the same ``pipeline_parts`` and no relative KV sizes, the group is one
    whose trees the compiler reads as :func:`placement_trees` (up to :data:`CHECK_TREES_MAX_CP`
    ranks), and those trees are equal. Those are all the compiler reads of a graph besides its
    name. ``auto`` then times one of them (Note [Pruning auto] in
    :mod:`megatron_fcp.planner.build`): at cp = 256, ``a = 8``, ``full``, ``hierarchical``,
    ``leader`` and ``entry`` all send each block straight to its readers (one virtual rank per
    node). ``other``'s trees are checked against ``other`` as its compile would (PlanError)."""
    if not (cg.builder is not None and other.builder is not None and cg.ranks == other.ranks
            and cg.topology is not None and cg.topology is other.topology
            and len(cg.ranks) <= CHECK_TREES_MAX_CP and cg.pipeline_parts == other.pipeline_parts
            and not cg.meta.get("kv_sizes") and not other.meta.get("kv_sizes")):
        return False
    mine = placement_trees(cg, placement)[1]
    readers_of, theirs = placement_trees(other, placement)
    if not all(np.array_equal(x, y) for x, y in zip(mine, theirs)):
        return False
    _check_trees(other, theirs, readers_of)
    return True


def _block_columns(placement: Placement) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``(owner's CP index, index in its blocks)`` of every block, in ``block_list`` order."""
    per = placement.blocks_per_rank()
    rank = np.repeat(np.arange(len(per), dtype=np.int64), per)
    first = np.concatenate(([0], np.cumsum(per)[:-1])).astype(np.int64)
    return rank, np.arange(len(rank), dtype=np.int64) - first[rank]


def _compile(cg, causal, parts_per_chunk, max_sends, max_recvs, verify, balance, placement, packing="list",
             stagger_blocks=1, columnar=True, mask: Mask | None = None, seq_len: int | None = None) -> Plan:
    mask = mask or Mask(bool(causal))
    windowed = mask.windowed
    if not isinstance(stagger_blocks, int) or stagger_blocks < 1 or (stagger_blocks > 1 and placement is None):
        raise PlanError(f"stagger_blocks: an integer >= 1, above 1 only over a placement (zigzag plans stagger "
                        f"sub-blocks: parts_per_chunk), got {stagger_blocks!r}")
    if packing not in ("list", "colour"):
        raise PlanError(f"packing: must be 'list' or 'colour', got {packing!r}")
    if packing == "colour" and (max_sends, max_recvs) != (1, 1):
        raise PlanError("packing='colour' packs one send and one receive per rank per round: pass max_sends=1, "
                        "max_recvs=1")
    if not isinstance(parts_per_chunk, int) or parts_per_chunk < 1:
        raise PlanError(f"parts_per_chunk: must be an integer >= 1, got {parts_per_chunk!r}")
    if placement is not None and placement.window != mask.window:
        raise PlanError(f"placement: its window is {placement.window}, the plan's {mask.window}; place the batch "
                        "with place_packed(window=...) and compile with the same window")
    if placement is not None and (placement.cp != len(cg.ranks) or placement.causal != causal or parts_per_chunk != 1):
        raise PlanError(f"placement: has {placement.cp} ranks and causal={placement.causal}, the graph "
                        f"{len(cg.ranks)} ranks and causal={causal}; parts_per_chunk must be 1 (got "
                        f"{parts_per_chunk}): cut blocks with place_packed(block_tokens=...)")
    for name, v in (("max_sends", max_sends), ("max_recvs", max_recvs)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise PlanError(f"{name}: must be None (unlimited) or an integer >= 1, got {v!r}")
    ranks = cg.ranks
    stagger = cg.pipeline_parts
    check = len(ranks) <= CHECK_TREES_MAX_CP
    P = parts_per_chunk
    limited = max_sends is not None or max_recvs is not None
    sizes = cg.meta.get("kv_sizes")
    header = dict(name=cg.name, max_sends=max_sends, max_recvs=max_recvs, placement=placement,
                  kv_sizes=tuple(float(sizes.get(r, 1.0)) for r in ranks) if sizes else None,
                  window=mask.window, seq_len=seq_len)
    need_of = mask if windowed else causal  # what the readers follow
    table = None
    if not check and not limited and placement is None and columnar and cg.builder is not None and not windowed:
        table = cg.builder.wave_table(cg, causal, P)  # the waves below, as columns (or None)
    if table is not None and table.num_transfers > BALANCE_MAX_TRANSFERS:
        plan = Plan(ranks, None, causal, P, table=table, **header)
        return plan.verify(max_sends=max_sends, max_recvs=max_recvs) if verify else plan
    if table is not None:
        plan_rounds = table_rounds(table, ranks, np.full(len(ranks), 2), P)  # small: objects, then reordered
    elif not check and not limited:
        # large group: trees as runs of equal depth straight into waves (no per-edge tuples)
        runs = [(owner, chunk, [(d + chunk % stagger_blocks, us, vs) for d, us, vs in cg.tree_runs(owner, dests, chunk)])
                for owner, chunk, dests in _sources(ranks, need_of, placement, seq_len, P)]
        plan_rounds = _waves(runs, P, stagger)
    else:
        # every block's tree as columns (Note [Trees as columns]); the list-based schedulers below
        # read them back as (owner, chunk, edges, depths) per tree
        if placement is not None:
            readers_of, cols = placement_trees(cg, placement)
        else:
            owner, chunk, readers_of = _readers(ranks, need_of, placement, seq_len, P)
            cols = cg.tree_columns(owner, chunk, readers_of)
        cols = cols.staggered(stagger_blocks)
        if check:
            _check_trees(cg, cols, readers_of)
        if limited and packing == "colour" and int(cols.depth.max(initial=1)) == 1:
            plan_rounds = colour_rounds([make_transfer(u, v, Block(o, c, p)) for o, c, tree, _ in cols.as_trees()
                                         for p in range(P) for u, v in tree])
        elif limited:
            plan_rounds = _list_schedule(cols.as_trees(), P, stagger, max_sends, max_recvs)
        elif balance and cg.topology is not None and stagger and P * cols.num_edges <= BALANCE_MAX_TRANSFERS:
            tree_w = _tree_weights(cg, placement, cols)
            if placement is not None and columnar and cols.num_edges:
                balanced, _ = _balanced_columns(cg, cols, P, tree_w)
                plan = Plan(ranks, None, causal, P, table=_placement_table(cg, balanced, placement.blocks_per_rank()),
                            **header)
                return plan.verify(max_sends=max_sends, max_recvs=max_recvs) if verify else plan
            plan_rounds = _balanced_waves(cg, cols, P, tree_w)
        else:
            plan_rounds = _waves([(o, c, runs_of(t, d)) for o, c, t, d in cols.as_trees()], P, stagger)

    if windowed and placement is None and P > 1:
        plan_rounds = _prune_parts(plan_rounds, zigzag_need_matrix(len(ranks), P, mask, seq_len), ranks, P)
    while (placement is not None or windowed) and plan_rounds and not plan_rounds[-1]:
        plan_rounds = plan_rounds[:-1]  # trailing rounds left empty (plain zigzag plans keep them: golden digests)
    if sum(len(r) for r in plan_rounds) <= BALANCE_MAX_TRANSFERS:
        plan_rounds = _fast_links_first(cg, plan_rounds)
    plan = Plan(ranks, plan_rounds, causal, P, **header)
    if verify:
        plan.verify(max_sends=max_sends, max_recvs=max_recvs)
    return plan


CHECK_TREES_MAX_CP = 256
"""Up to this CP size every multicast tree is checked against the graph (edges exist, parents
first, all readers reached); larger groups rely on the builders' tests and on Plan.verify."""

BALANCE_MAX_TRANSFERS = 200_000
"""Above this many transfers the compiler keeps plain waves (leaf balancing is O(transfers x rounds))."""


def _prune_parts(rounds, need: np.ndarray, ranks, P: int) -> tuple[tuple[Transfer, ...], ...]:
    """Drop the transfers of a sub-block that lead to none of its readers (Note [Compiling a
    plan], windows): scanning rounds last to first, a transfer stays iff its receiver needs the
    block or forwards it in a later round (by a transfer that stayed); a staying transfer makes its
    sender a forwarder of the block. ``need``: ``[cp, 2*cp*P]`` (block id ``(owner*2+chunk)*P+part``)."""
    pos = {r: i for i, r in enumerate(ranks)}
    forwards: set[tuple[int, Block]] = set()
    out = []
    for rnd in reversed(rounds):
        keep = [t for t in rnd if (t.dst, t.block) in forwards
                or need[pos[t.dst], (pos[t.block.owner] * 2 + t.block.chunk) * P + t.block.part]]
        forwards.update((t.src, t.block) for t in keep)
        out.append(tuple(keep))
    return tuple(reversed(out))


def _waves(tree_runs, P: int, stagger: bool) -> tuple[tuple[Transfer, ...], ...]:
    """ASAP placement: edge at depth d of part p in round d-1 (+p when staggered).

    Each tree comes as runs of equal depth (:func:`runs_of`); a run is appended to its round as
    one batch (:func:`~megatron_fcp.contract.blocks.make_transfers`; the 1,024-rank plan creates ~1.5M
    transfers here).
    """
    rounds: dict[int, list[Transfer]] = {}
    for owner, chunk, runs in tree_runs:
        for p in range(P):
            b = Block(owner, chunk, p)
            shift = p - 1 if stagger else -1
            for d, us, vs in runs:
                k = d + shift
                rnd = rounds.get(k)
                if rnd is None:
                    rounds[k] = rnd = []
                rnd.extend(make_transfers(us, vs, b))
    n = max(rounds, default=-1) + 1
    return tuple(tuple(rounds.get(k, ())) for k in range(n))


def _tree_weights(cg: CommGraph, placement: Placement | None, cols: TreeColumns) -> np.ndarray:
    """float64 ``[trees]``: each tree's block's bytes relative to the mean block: tokens over the
    mean of all the placement's blocks, else the graph's per-owner KV sizes (``balanced``), else 1."""
    if placement is not None:
        all_tokens = placement.tokens_of(*_block_columns(placement))
        mean = int(all_tokens.sum()) / max(len(all_tokens), 1)
        tokens = placement.tokens_of(cp_index_of(cg.ranks)(cols.owner), cols.chunk)
        return tokens / mean
    per_owner = cg.meta.get("kv_sizes") or {}
    return np.array([float(per_owner.get(o, 1.0)) for o in cols.owner.tolist()], dtype=np.float64)


def _balanced_waves(cg: CommGraph, cols: TreeColumns, P: int, tree_w: np.ndarray) -> tuple[tuple[Transfer, ...], ...]:
    """:func:`_balanced_columns` as rounds of transfers."""
    (rnd, src, dst, owner, chunk, part), n = _balanced_columns(cg, cols, P, tree_w)
    blocks: dict[tuple[int, int, int], Block] = {}
    flat = transfers_from_columns(src.tolist(), dst.tolist(),
                                  [blocks.setdefault(b, Block(*b)) for b in zip(owner.tolist(), chunk.tolist(),
                                                                                 part.tolist())])
    ends = np.searchsorted(rnd, np.arange(n + 1)).tolist()
    return tuple(tuple(flat[ends[j]:ends[j + 1]]) for j in range(n))


def _balanced_columns(cg: CommGraph, cols: TreeColumns, P: int,
                      tree_w: np.ndarray) -> tuple[tuple[np.ndarray, ...], int]:
    """Waves, then leaf edges moved into rounds with spare capacity on their route's resources;
    ``(round, src, dst, owner, chunk, part)`` int64 columns in plan order (rounds ascending; in a
    round its relay edges in tree order, then its leaves in the order they were placed), and the
    number of wave rounds (the last ones may be left empty). ``tree_w``: each tree's relative bytes.

    Edges into relays keep their wave round (the pipeline's backbone). A *leaf* edge (its
    receiver forwards nothing) may run in any round from one after its sender got the block up to
    the last wave round; leaf edges are placed latest-due first, each into the round whose
    bottleneck time (max over resources of bytes / bandwidth) grows least, earliest on ties. On
    rail-striped graphs this moves each owner's own NVLink sends into the rounds where NVLink
    idles while the first sub-blocks cross the network.
    """
    topo = cg.topology
    # every edge of every tree (trees in order, edges parents first), then each part: column index
    # e * P + p is the e-th edge's part p, the order the rounds list them in
    tree_of, us, vs, depth = cols.tree_of, cols.u, cols.v, cols.depth                  # [E] each
    owners, chunk_of = cols.owner, cols.chunk                                          # [trees]
    span = int(max(us.max(initial=0), vs.max(initial=0))) + 1
    into_relay = isin_ints(tree_of * span + vs, tree_of * span + us, len(owners) * span)  # [E]: v forwards it
    pair = us * span + vs
    uniq, _, pair_of = unique_ints(pair, span * span)                                  # routes once per pair
    # each pair's resources, numbered densely in order of first use (Note [Route ids])
    table = topo.route_ids()
    lens, topo_ids = table.gather(table.rows(uniq // span, uniq % span))
    pair_ids, used = first_use_ids(topo_ids)
    pair_ptr = np.zeros(len(uniq) + 1, dtype=np.int64)
    np.cumsum(lens, out=pair_ptr[1:])
    bws = table.resource_bandwidth[used]                                               # [resources]
    parts = np.arange(P, dtype=np.int64)
    col_edge = np.repeat(np.arange(len(tree_of), dtype=np.int64), P)                   # [E * P]
    col_part = np.tile(parts, len(tree_of))
    k = depth[col_edge] - 1 + col_part                                                 # the edge's wave round
    n = int(k.max(initial=0)) + 1
    rigid = into_relay[col_edge]
    rigid_cols = np.nonzero(rigid)[0]
    leaf_cols = np.nonzero(~rigid)[0]
    # a leaf is due from its wave round (its parent's round + 1), or from round 0 sent by its owner
    due = np.where(us[col_edge[leaf_cols]] == owners[tree_of[col_edge[leaf_cols]]], 0, k[leaf_cols])
    latest_first = np.argsort(-due, kind="stable")
    leaf_cols, due = leaf_cols[latest_first], due[latest_first]
    leaf_round = _leaf_rounds(
        n, bws,
        k[rigid_cols], pair_of[col_edge[rigid_cols]], tree_w[tree_of[col_edge[rigid_cols]]],
        due, pair_of[col_edge[leaf_cols]], tree_w[tree_of[col_edge[leaf_cols]]], pair_ptr, pair_ids)
    # each round: its rigid edges in order, then its leaves in placing order
    cols = np.concatenate([rigid_cols, leaf_cols])
    rnd = np.concatenate([k[rigid_cols], leaf_round])
    by_round = np.argsort(rnd, kind="stable")
    cols, rnd = cols[by_round], rnd[by_round]
    edge, t = col_edge[cols], tree_of[col_edge[cols]]
    return (rnd, us[edge], vs[edge], owners[t], chunk_of[t], col_part[cols]), n


@jit
def _leaf_rounds(n, bws, rigid_k, rigid_pair, rigid_w, leaf_due, leaf_pair, leaf_w, pair_ptr, pair_ids):
    """The round of each leaf edge (:func:`_balanced_waves`; compiled, Note [Compiled planning
    loops] in :mod:`megatron_fcp.jit`). ``bws[i]``: resource ``i``'s bandwidth; route ``j`` the
    resources ``pair_ids[pair_ptr[j]:pair_ptr[j + 1]]``; rigid edge ``e`` in round ``rigid_k[e]``
    over route ``rigid_pair[e]`` with ``rigid_w[e]`` relative bytes; the leaves likewise,
    latest-due first, each from ``leaf_due`` on. A round's time is its busiest resource's bytes
    over bandwidth; each leaf goes to the round whose time grows least (by more than 1e-15), the
    earliest on ties, stopping at one where it does not grow."""
    load = np.zeros((n, bws.shape[0]))            # [rounds, resources]: relative bytes
    cur = np.zeros(n)                             # [rounds]: the busiest resource's time
    for e in range(rigid_k.shape[0]):
        k = rigid_k[e]
        j = rigid_pair[e]
        for q in range(pair_ptr[j], pair_ptr[j + 1]):
            i = pair_ids[q]
            x = load[k, i] + rigid_w[e]
            load[k, i] = x
            if x / bws[i] > cur[k]:
                cur[k] = x / bws[i]
    out = np.empty(leaf_due.shape[0], dtype=np.int64)
    for e in range(leaf_due.shape[0]):
        w = leaf_w[e]
        j = leaf_pair[e]
        best_k = leaf_due[e]
        best_inc = np.inf
        found = False
        for k in range(leaf_due[e], n):
            t = cur[k]
            for q in range(pair_ptr[j], pair_ptr[j + 1]):
                i = pair_ids[q]
                x = (load[k, i] + w) / bws[i]
                if x > t:
                    t = x
            inc = t - cur[k]
            if not found or inc < best_inc - 1e-15:
                best_k, best_inc, found = k, inc, True
                if inc <= 0:
                    break
        for q in range(pair_ptr[j], pair_ptr[j + 1]):
            i = pair_ids[q]
            x = load[best_k, i] + w
            load[best_k, i] = x
            if x / bws[i] > cur[best_k]:
                cur[best_k] = x / bws[i]
        out[e] = best_k
    return out


def _fast_links_first(cg: CommGraph, rounds) -> tuple[tuple[Transfer, ...], ...]:
    """Order each round's transfers by edge bandwidth, fastest first (stable: :func:`_fast_order`)."""
    flat = [t for rnd in rounds for t in rnd]
    if not flat:
        return tuple(tuple(rnd) for rnd in rounds)
    lens = [len(rnd) for rnd in rounds]
    rnd_of = np.repeat(np.arange(len(rounds), dtype=np.int64), lens)
    src = np.fromiter(map(attrgetter("src"), flat), dtype=np.int64, count=len(flat))
    dst = np.fromiter(map(attrgetter("dst"), flat), dtype=np.int64, count=len(flat))
    order = _fast_order(cg, rnd_of, src, dst).tolist()
    ends = np.cumsum([0] + lens).tolist()
    return tuple(tuple(flat[i] for i in order[ends[k]:ends[k + 1]]) for k in range(len(rounds)))


def _fast_order(cg: CommGraph, rnd: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The permutation that orders each round's transfers (columns in plan order) by edge
    bandwidth, fastest first, stable.

    Ranks consume received blocks in plan order (bitwise-reproducible accumulation), so a block
    on NVLink listed after a block crossing the network would wait for it; listing fast edges
    first lets compute start as soon as the first blocks land. Same-pair transfers keep their
    relative order (same bandwidth), which is what send/receive matching relies on. One stable
    sort of all transfers by (round, -bandwidth), each pair's bandwidth read once.
    """
    span = int(max(src.max(initial=0), dst.max(initial=0))) + 1
    uniq, _, pair_of = unique_ints(src * span + dst, span * span)
    bw = cg.bandwidths(uniq // span, uniq % span)
    return np.lexsort((-bw[pair_of], rnd))                      # by round, then fastest; stable


def _placement_table(cg: CommGraph, cols: tuple[np.ndarray, ...], chunks: np.ndarray) -> TransferTable:
    """A packed plan's balanced columns as its transfer table (Note [Columnar plans] in
    :mod:`megatron_fcp.contract.table`), fast links first in each round and trailing empty rounds
    dropped, as the object path does (the same rounds once materialised): the compiled candidates
    of ``auto`` are priced and verified from columns, and only the chosen plan's rounds are ever
    built as objects, when something reads them."""
    rnd, src, dst, owner, chunk, part = cols
    order = _fast_order(cg, rnd, src, dst)
    rnd, src, dst, owner, chunk, part = (c[order] for c in (rnd, src, dst, owner, chunk, part))
    pos = cp_index_of(cg.ranks)
    offset, _, nb = block_layout(chunks, 1)
    n = int(rnd.max()) + 1
    starts = np.searchsorted(rnd, np.arange(n + 1)).astype(np.int64)
    idx = small_int(max(len(cg.ranks), nb))
    return TransferTable(starts, pos(src).astype(idx), pos(dst).astype(idx),
                         (offset[pos(owner)] + chunk + part).astype(idx))


def _check_trees(cg: CommGraph, cols: TreeColumns, readers_of: Readers) -> None:
    """:func:`_check_tree` of every tree at once (numpy over all edges: edges of the graph, parents
    reached first, no rank reached twice, every reader reached); the first tree at fault is checked
    again on its own, which raises its message."""
    tree_of, us, vs, owners = cols.tree_of, cols.u, cols.v, cols.owner
    E = len(us)
    read_tree, reads = readers_of.tree_of(), readers_of.ranks
    span = int(max(us.max(initial=0), vs.max(initial=0), owners.max(initial=0), reads.max(initial=0))) + 1
    uniq, _, pair_of = unique_ints(us * span + vs, span * span)
    is_edge = cg.has_edges(uniq // span, uniq % span)
    vkey = tree_of * span + vs
    keys, first, _ = unique_ints(vkey, len(owners) * span)                             # each reached rank's edge
    at = np.minimum(np.searchsorted(keys, tree_of * span + us), max(len(keys) - 1, 0))
    parent_first = (us == owners[tree_of]) | ((keys[at] == tree_of * span + us) & (first[at] < np.arange(E)))
    once = (first[np.searchsorted(keys, vkey)] == np.arange(E)) & (vs != owners[tree_of])
    edge_bad = ~is_edge[pair_of] | ~parent_first | ~once                                   # [E]
    rkey = read_tree * span + reads
    missing = ~(isin_ints(rkey, keys, len(owners) * span) | (reads == owners[read_tree]))
    bad = np.zeros(len(owners), dtype=bool)
    bad[tree_of[edge_bad]] = True
    bad[read_tree[missing]] = True
    if bad.any():
        t = int(np.argmax(bad))
        lo, hi = np.searchsorted(tree_of, [t, t + 1])
        _check_tree(cg, int(owners[t]), readers_of.of(t), list(zip(us[lo:hi].tolist(), vs[lo:hi].tolist())))
        raise AssertionError(f"tree {t} of {cg.name!r} found at fault by the vectorised check only (a bug)")


def _check_tree(cg: CommGraph, owner: int, dests: Sequence[int], tree) -> None:
    reached = {owner}
    for u, v in tree:
        if not cg.has_edge(u, v):
            raise PlanError(f"graph {cg.name!r}: multicast tree of rank {owner} uses {u}->{v}, not an edge of the graph")
        if u not in reached:
            raise PlanError(f"graph {cg.name!r}: tree of rank {owner} forwards from {u} before reaching it")
        if v in reached:
            raise PlanError(f"graph {cg.name!r}: tree of rank {owner} reaches {v} twice")
        reached.add(v)
    missing = set(dests) - reached
    if missing:
        raise PlanError(f"graph {cg.name!r}: tree of rank {owner} misses reader(s) {sorted(missing)[:4]}")


def _list_schedule(trees, P, stagger, max_sends, max_recvs) -> tuple[tuple[Transfer, ...], ...]:
    """List scheduling under per-round port limits (step 3 of Note [Compiling a plan])."""
    ms = max_sends if max_sends is not None else 1 << 30
    mr = max_recvs if max_recvs is not None else 1 << 30
    sends: dict[tuple[int, int], int] = {}
    recvs: dict[tuple[int, int], int] = {}
    rounds: dict[int, list[Transfer]] = {}
    heap = []
    seq = 0
    children_of = []  # per tree: dict parent -> list of edge indices
    heights = []
    for t, (owner, chunk, tree, depths) in enumerate(trees):
        ch: dict[int, list[int]] = {}
        for e, (u, v) in enumerate(tree):
            ch.setdefault(u, []).append(e)
        children_of.append(ch)
        h = {}
        for e in range(len(tree) - 1, -1, -1):
            v = tree[e][1]
            h[e] = 1 + max((h[c] for c in ch.get(v, ())), default=0)
        heights.append(h)
        for p in range(P):
            for e in ch.get(owner, ()):
                heapq.heappush(heap, (p if stagger else 0, -h[e], seq, t, e, p))
                seq += 1
    while heap:
        due, _, _, t, e, p = heapq.heappop(heap)
        owner, chunk, tree, _ = trees[t]
        u, v = tree[e]
        k = due
        while sends.get((k, u), 0) >= ms or recvs.get((k, v), 0) >= mr:
            k += 1
        sends[(k, u)] = sends.get((k, u), 0) + 1
        recvs[(k, v)] = recvs.get((k, v), 0) + 1
        rounds.setdefault(k, []).append(Transfer(u, v, Block(owner, chunk, p)))
        for c in children_of[t].get(v, ()):
            heapq.heappush(heap, (k + 1, -heights[t][c], seq, t, c, p))
            seq += 1
    n = max(rounds, default=-1) + 1
    return tuple(tuple(rounds.get(k, ())) for k in range(n))
