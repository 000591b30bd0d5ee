"""The backward program: every "which backward" decision for a plan, made once. Pure, no ``torch``.

Note [Backward program]
-----------------------
A plan says how the forward moves KV. Its backward has more choices, and each one must come out
the same on every rank (the posts between a pair match by order), in the cost model (the planner
prices what will run) and in the emulator. :func:`compile_backward` makes all of them in one place
from the plan, the size of one token's K and V, and the :class:`BackwardPolicy`
(``--fcp-backward-kv``, ``--fcp-kv-memory-budget``)::

    mode      keep | resend        choose_backward_kv: keep while every rank's need set fits the
                                   budget (default: its own shard's KV, what the ring holds)
    keepers   ranks that start     first_keepers: under auto -> resend, the ranks whose first
              from the forward     step fits the budget keep it from the forward
    form      chain | waves        chain_steps: a plan whose blocks travel chains (the ring) and
                                   whose steps stay balanced streams one hop per step (Note
                                   [Streaming chain backward]); any other runs in waves (Note
                                   [Backward waves])
    steps / waves, first_fetch     the schedule itself; first_fetch: the part of wave 0 that is
                                   re-sent when only some ranks kept theirs
    kept(rank)                     what the forward saves for this rank's backward

The executor is built with the program and runs it (the forward keeps ``kept(rank)``; the backward
runner walks ``steps`` or ``waves``); the cost model prices the same object
(:func:`~megatron_fcp.cost.backward.simulate_backward_waves`); the emulator's workloads
build theirs through it. :meth:`BackwardProgram.posts` lists what a rank posts, in order: a test
holds the executor's recorded posts against it for every plan of the test matrix.

Block sizes. The program's sizes are the executor's receive buffers: a block's tokens
(:meth:`~megatron_fcp.contract.plan.Plan.block_tokens`: the placement's span, or the zigzag
sub-block of the padded global sequence) times ``token_bytes``, the K and V of one token of every
sequence of the micro-batch in the input dtype. Budgets are in the same bytes.

Programs are memoised per plan object (every layer of a model runs the same settled plan).

The plan walked. A plan whose backward walks another graph (Note [A backward on another graph] in
:mod:`megatron_fcp.contract.plan`) compiles the program of its :attr:`~megatron_fcp.contract.plan.Plan.backward_plan`:
:func:`compile_backward`, :func:`resend_keep_limits` and :func:`compiled_programs` read that plan,
and :attr:`BackwardProgram.plan` is it. What the program keeps from the forward is then a subset of
what that plan delivers, which the forward delivers too (checked when the two are joined).

Note [Backward KV modes]
------------------------
Backward recomputes each block's scores from its K and V (flash-attn's recipe), so a rank needs
every block it computed on again. Two ways to have them:

* ``keep`` -- the forward saves every received block it needs until backward: no KV traffic in
  backward, but a rank holds its whole need set between the two passes (under causal zigzag CP
  rank 0 keeps ``2*(cp-1)`` of the ``2*cp`` chunks, ``cp-1`` times its own KV), for every layer.
* ``resend`` -- the backward re-sends the KV along the plan's transfers, a wave or a chain step at
  a time (Note [Backward waves] in :mod:`megatron_fcp.attention.backward_waves`, Note [Streaming
  chain backward] in :mod:`megatron_fcp.schedule.chains`): between the passes a rank holds only
  its own K and V (plus, under ``auto``, its first step's), within backward at most two waves or
  steps -- what Transformer Engine's ring holds in flight beside its own KV.
* ``auto`` (the default everywhere: API, plugin, CLI, emulator) -- ``keep`` while the kept bytes
  fit the budget on *every* rank of the group, else ``resend`` with the first step kept by the
  ranks where it fits (TE's ring saves its last received shard for its backward, which saves it
  one step). The default budget (:data:`RING_BUDGET`) is one KV pair the size of the rank's own
  shard, so ``auto`` never holds more received KV between the passes than the ring does.

``keep`` and ``resend`` walk the same waves or steps and cast at the same points, so outputs and
gradients are bitwise identical for a fixed plan. Every choice reads only the plan and the block
sizes, never one rank's own state: re-sending needs the senders, so all ranks must agree.
:class:`~megatron_fcp.attention.stats.FCPStats` records what was held: ``saved_kv_bytes``
(received KV from forward to backward), ``peak_kv_bytes``, ``backward_peak_kv_bytes``,
``backward_waves`` and ``resend_bytes_sent``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from megatron_fcp.contract.blocks import Block, Transfer, gc_paused
from megatron_fcp.contract.plan import Plan
from megatron_fcp.memo import memo
from megatron_fcp.schedule.chains import (ChainStep, chain_steps, first_keepers, first_kept_blocks, first_wave_fetch,
                                          keep_limits)
from megatron_fcp.schedule.waves import BACKWARD_KV_MODES, RING_BUDGET, BlockBytes, Wave, choose_backward_kv, plan_waves

__all__ = ["BackwardPolicy", "WaveBackward", "BackwardProgram", "ProgramPost", "compile_backward", "compiled_programs",
           "resend_keep_limits",
           "RING_BUDGET", "BACKWARD_KV_MODES"]


@dataclass(frozen=True)
class BackwardPolicy:
    """What the user asks of the backward. ``backward_kv``: ``auto`` (default: keep while it fits
    the budget), ``keep`` or ``resend`` (``--fcp-backward-kv``); ``kv_memory_budget``: received KV
    bytes a rank may hold between the passes, or :data:`RING_BUDGET` (its own shard's K and V:
    what the ring holds; ``--fcp-kv-memory-budget``). The micro-batch is in the program's block
    bytes, not here."""

    backward_kv: str = "auto"
    kv_memory_budget: int = RING_BUDGET

    def __post_init__(self) -> None:
        if self.backward_kv not in BACKWARD_KV_MODES:
            raise ValueError(f"backward_kv must be one of {BACKWARD_KV_MODES}, got {self.backward_kv!r} "
                             "(--fcp-backward-kv)")
        b = self.kv_memory_budget
        if not isinstance(b, int) or isinstance(b, bool) or b < RING_BUDGET:
            raise ValueError(f"kv_memory_budget must be bytes >= 0 or {RING_BUDGET} (the ring's), got {b!r} "
                             "(--fcp-kv-memory-budget)")


@dataclass(frozen=True)
class WaveBackward(BackwardPolicy):
    """A :class:`BackwardPolicy` for pricing a plan with the backward the executor will run (the
    planner, ``choose_schedule``, the emulator's predictions). ``micro_batch``: sequences per
    attention call (``--micro-batch-size``): it scales a block's bytes, so it matters only against
    a budget in bytes. ``buffered_sends``: a rank's wait on its sends returns once their receivers
    have posted (gloo over TCP, the emulated cluster: the socket takes the bytes then); default, as
    NCCL, a send is waited until it arrives (Note [Wave pipeline timeline] in
    :mod:`megatron_fcp.cost.timeline`). ``held_routes``: a message holds every resource of its
    route at once (the emulated cluster's links, same Note). Cost models take ``backward=None`` for the plain
    one-pass backward with kept KV (:func:`~megatron_fcp.cost.backward.simulate_plan_backward`)."""

    micro_batch: int = 1
    buffered_sends: bool = False
    held_routes: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.micro_batch, int) or isinstance(self.micro_batch, bool) or self.micro_batch < 1:
            raise ValueError(f"micro_batch must be an integer >= 1, got {self.micro_batch!r} (--micro-batch-size)")


@dataclass(frozen=True)
class ProgramPost:
    """One round a rank posts in backward, as the transport sees it: ``phase`` ``"backward"``
    (dK/dV partials, transfers flipped) or ``"resend"`` (KV again, forward direction), the plan
    round (waves) or step (chain) index, and the rank's sends and receives in post order. A rank
    posts a round of the schedule even when it has nothing in it (the lists are then empty)."""

    phase: str
    round_index: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


def _flip(t: Transfer) -> Transfer:
    return Transfer(t.dst, t.src, t.block)


@dataclass(frozen=True, eq=False)
class BackwardProgram:
    """The compiled backward of one plan (Note [Backward program]). Plain data: build it with
    :func:`compile_backward`."""

    plan: Plan                                     # the plan walked: the forward's backward_plan
    policy: BackwardPolicy
    token_bytes: int                               # K and V of one token, micro-batch included
    seq_len: int | None                            # zigzag: the padded global sequence; None: a placement
    mode: str                                      # "keep" | "resend"
    keepers: frozenset[int]                        # ranks whose first step comes from the forward
    steps: tuple[ChainStep, ...] | None            # the chain's steps (form "chain")
    waves: tuple[Wave, ...] | None                 # the waves (form "waves")
    first_fetch: Wave | None                       # waves under resend: wave 0 cut to what is re-sent
    _kept: dict[int, frozenset[Block]] = field(repr=False)

    @property
    def form(self) -> str:
        """``"chain"`` (Note [Streaming chain backward]) or ``"waves"`` (Note [Backward waves])."""
        return "chain" if self.steps is not None else "waves"

    @property
    def first_kept(self) -> bool:
        """Every rank starts from its first step kept from the forward (the steps shift by one)."""
        return len(self.keepers) == len(self.plan.ranks)

    @property
    def resend(self) -> bool:
        return self.mode == "resend"

    def block_bytes(self, block: Block) -> int:
        """One block's K and V (or dK and dV) in bytes, as the executor allocates them."""
        return self.plan.block_tokens(block, self.seq_len) * self.token_bytes

    def kept(self, rank: int) -> frozenset[Block]:
        """The received blocks the forward saves for ``rank``'s backward: its need set under
        ``keep``; under ``resend`` its first step's blocks when it is a keeper, else none."""
        return self._kept.get(rank, frozenset())

    def kept_bytes(self, rank: int) -> int:
        """Received KV bytes ``rank`` holds between forward and backward."""
        return sum(self.block_bytes(b) for b in self.kept(rank))

    def keep_first(self, rank: int) -> frozenset[Block] | None:
        """Under ``resend``: the first step's blocks ``rank`` keeps (None when it keeps none, or
        under ``keep``, where it keeps everything it computes on)."""
        if self.mode == "keep" or rank not in self.keepers:
            return None
        return self.kept(rank)

    def posts(self, rank: int) -> tuple[ProgramPost, ...]:
        """Everything ``rank`` posts in backward, in post order (what a counting transport records)."""
        return self._chain_posts(rank) if self.steps is not None else self._wave_posts(rank)

    # -- what the runners post -------------------------------------------------------------------
    def _chain_posts(self, rank: int) -> tuple[ProgramPost, ...]:
        """One round per step: the step's KV hops (resend), then its partials, then its homes."""
        out = []
        for s, st in enumerate(self.steps):
            sends, recvs = [], []
            for t in (st.kv if self.resend else ()):
                if t.src == rank:
                    sends.append(t)
                elif t.dst == rank:
                    recvs.append(t)
            for t in st.grad + st.home:
                if t.src == rank:
                    sends.append(t)
                elif t.dst == rank:
                    recvs.append(t)
            out.append(ProgramPost("backward", s, tuple(sends), tuple(recvs)))
        return tuple(out)

    def wave_queue(self) -> tuple[tuple[str, int, int], ...]:
        """The waves' posts in order, the same on every rank: ``(phase, wave, plan round)``.
        Per wave w the reduction of wave w-1 (rounds last to first) and, under resend, the re-send of
        wave w+1 (rounds first to last), interleaved round by round, the longer one's rest behind;
        ahead of everything the re-send of wave 0 (or its :attr:`first_fetch`) unless it was kept
        (Note [Backward waves]; the executor's pump posts exactly this queue)."""
        waves = self.waves or ()
        queue: list[tuple[str, int, int]] = []

        def extend(chains: list[tuple[str, int, tuple[int, ...]]]) -> None:
            n = max((len(r) for _, _, r in chains), default=0)
            queue.extend((ph, w, rs[j]) for j in range(n) for ph, w, rs in chains if j < len(rs))

        if self.resend and waves and not self.first_kept:
            wave0 = waves[0] if self.first_fetch is None else self.first_fetch
            extend([("resend", 0, wave0.rounds)])
        for w in range(len(waves) + 1):
            chains = []
            if w > 0:
                chains.append(("backward", w - 1, tuple(reversed(waves[w - 1].rounds))))
            if self.resend and w + 1 < len(waves):
                chains.append(("resend", w + 1, waves[w + 1].rounds))
            extend(chains)
        return tuple(queue)

    def _wave_posts(self, rank: int) -> tuple[ProgramPost, ...]:
        plan, waves = self.plan, self.waves or ()
        out = []
        for phase, w, r in self.wave_queue():
            wave = self.first_fetch if (phase == "resend" and w == 0 and self.first_fetch is not None) else waves[w]
            if phase == "resend":
                sends = tuple(t for t in plan.sends(rank, r) if wave.has(r, t))
                recvs = tuple(t for t in plan.recvs(rank, r) if wave.has(r, t))
            else:
                sends = tuple(_flip(t) for t in plan.recvs(rank, r) if wave.has(r, t))
                recvs = tuple(_flip(t) for t in plan.sends(rank, r) if wave.has(r, t))
            out.append(ProgramPost(phase, r, sends, recvs))
        return tuple(out)


@gc_paused()
def compile_backward(plan: Plan, token_bytes: int, policy: BackwardPolicy | None = None, *,
                     seq_len: int | None = None, budget: int | None = None) -> BackwardProgram:
    """The backward program of ``plan`` (Note [Backward program]), memoised on the plan object.

    token_bytes: K and V of one token in bytes (``2 * b * h_kv * d * element size``; ``b`` the
    sequences of one call). seq_len: the zigzag plan's padded global sequence (the executor's
    ``s_local * cp``); ignored over a placement. budget: bytes a rank receives per wave or step
    (default: the largest shard per wave or chain step); for studies,
    never set by the executor. A plan whose backward walks another plan compiles that one's
    program (:attr:`~megatron_fcp.contract.plan.Plan.backward_plan`)."""
    plan = plan.backward_plan
    # the decision's inputs alone: a WaveBackward's pricing options do not change the program
    policy = BackwardPolicy() if policy is None else BackwardPolicy(policy.backward_kv, policy.kv_memory_budget)
    if plan.placement is None and seq_len is None:
        raise ValueError("compile_backward: a zigzag plan needs seq_len (the padded global sequence length)")
    seq_len = None if plan.placement is not None else int(seq_len)
    key = (int(token_bytes), seq_len, policy, budget)
    while True:
        with _LOCK:
            got = _cached(plan, key)
            if got is not None:
                return got
            busy = _COMPILING.get((id(plan), key))
            if busy is None:              # this thread compiles it
                busy = _COMPILING[(id(plan), key)] = threading.Event()
                break
        busy.wait()   # the in-process harness runs every rank in a thread: one compile for all of them
    # compiled outside the lock: a batch planned ahead in the background (Note [Planning a packed
    # batch ahead] in megatron_fcp.patches.runtime) must not hold up the step's lookups of other
    # plans for a compile of up to seconds
    try:
        program = _compile(plan, int(token_bytes), policy, seq_len, budget)
        with _LOCK:
            memo(plan).setdefault("programs", {})[key] = program
        return program
    finally:
        with _LOCK:
            _COMPILING.pop((id(plan), key)).set()  # waiters find it cached (or, if it raised, compile it)


def _cached(plan: Plan, key: tuple) -> "BackwardProgram | None":
    """The program compiled for ``plan`` (this object) and ``key``, or None; call under ``_LOCK``."""
    return memo(plan).get("programs", {}).get(key)


# a plan's programs are kept on it, {key: program} in compile order (Note [Caches live with their
# object] in megatron_fcp.memo); the compiles under way are keyed by the plan's id, which is alive
# while its compile runs
_COMPILING: dict[tuple[int, tuple], threading.Event] = {}  # (id(plan), key) being compiled -> set when done
_LOCK = threading.Lock()


def compiled_programs(plan: Plan) -> tuple[BackwardProgram, ...]:
    """The programs compiled for ``plan`` (this object) in this process so far, in compile order:
    what ran, for reports and for tests that hold the recorded posts against it (those of its
    :attr:`~megatron_fcp.contract.plan.Plan.backward_plan`)."""
    plan = plan.backward_plan
    with _LOCK:
        return tuple(memo(plan).get("programs", {}).values())


def resend_keep_limits(plan: Plan, token_bytes: int, policy: BackwardPolicy | None = None, *,
                       seq_len: int | None = None) -> dict[int, int] | None:
    """What :func:`compile_backward` will decide about re-sending, before the schedule is packed:
    None where the backward keeps every received block (``keep``: no KV re-sent), else per rank
    the most received KV bytes it may start from (the first step kept from the forward, Note
    [Backward KV modes]; 0 under an explicit ``resend``). The same decision as the program's, so
    a floor on re-sent bytes (:func:`~megatron_fcp.cost.floors.reduction_floor`) holds for it."""
    plan = plan.backward_plan
    policy = BackwardPolicy() if policy is None else BackwardPolicy(policy.backward_kv, policy.kv_memory_budget)
    seq_len = None if plan.placement is not None else seq_len
    size = _sizes(plan, int(token_bytes), seq_len)
    if _mode(plan, size, policy, ("program", int(token_bytes), seq_len)) == "keep":
        return None
    if policy.backward_kv != "auto":
        return dict.fromkeys(plan.ranks, 0)
    return keep_limits(plan, size, policy.kv_memory_budget)


def _sizes(plan: Plan, token_bytes: int, seq_len: int | None) -> BlockBytes:
    """A block's K and V bytes in the program's units: its tokens times ``token_bytes``."""
    return BlockBytes(plan, token_bytes, seq_len)


def _mode(plan: Plan, size, policy: BackwardPolicy, cache_key) -> str:
    """``keep`` or ``resend``: the program's one call of :func:`choose_backward_kv`."""
    return choose_backward_kv(policy.backward_kv, plan, size, policy.kv_memory_budget, cache_key=cache_key)


def _compile(plan: Plan, token_bytes: int, policy: BackwardPolicy, seq_len: int | None,
             budget: int | None) -> BackwardProgram:
    size = _sizes(plan, token_bytes, seq_len)
    ck = ("program", token_bytes, seq_len)       # the chain/wave caches: what size depends on besides the plan
    requested, budget_kv = policy.backward_kv, policy.kv_memory_budget
    mode = _mode(plan, size, policy, ck)
    keepers = first_keepers(requested, mode, plan, size, budget_kv, cache_key=ck) if budget is None else frozenset()
    first_kept = len(keepers) == len(plan.ranks)
    steps = chain_steps(plan, size, budget, cache_key=ck, first_kept=first_kept)
    waves = None if steps is not None else plan_waves(plan, size, budget, cache_key=ck)
    first = None
    if steps is None and mode == "resend" and budget is None:
        first = first_wave_fetch(plan, size, keepers, cache_key=ck)
    if mode == "keep":
        kept = {r: plan.needs(r) for r in plan.ranks}
    elif keepers:
        got = first_kept_blocks(plan, size, cache_key=ck)
        kept = {r: frozenset(got.get(r, ())) for r in keepers}
    else:
        kept = {}
    return BackwardProgram(plan, policy, token_bytes, seq_len, mode, keepers, steps, waves, first, kept)

