"""A plan's action lists with their transfers lowered in: per pipeline rank, its compute actions
and the sends and receives between them, in the order the rank issues them.

A value crosses ranks when an action's output is the input of an action on another pipeline
rank: a forward's activations for the next stage (``F``), a backward's input gradients for the
stage before (``B``; none to a stage with no backward). Each such :class:`Transfer` becomes a
``SEND`` on its producer's rank, right after the producing action, and a ``RECV`` on its
consumer's rank, :data:`RECEIVE_AHEAD` compute actions before the consumer (not before the
rank's own forward whose output shapes a gradient's buffers take). A run-ahead forward's output
that crosses the step boundary (``Plan.carried``) is sent as the next step starts: its ``SEND``
heads its rank's list. Transfers within a rank are not listed (the value stays in memory).

This is what torch's pipelining lowers (``_add_send_recv``) and what our runtime interprets
(:mod:`vlmcompile.runtime.executor`); the runtime's one check of a plan on its way to the ranks
(:func:`vlmcompile.runtime.capabilities.runnable`) checks it (:func:`check_lowered`). Its compute
entries are the plan's action lists, in order: those are what ``Plan.validate``'s deadlock check
and the simulator run, where a send or a receive takes no time (the simulator times a transfer
between the actions it joins), so they lower nothing (a paper-scale plan of 32,768 actions lowers in 0.3-0.6 s on
this machine, and its deadlock check takes 0.2 s). Ordered transports
(NCCL pairs messages by order, not by tag) issue a pair's transfers in :func:`transfer_order`:
the order their sends take when the lists run with every action taking no time.
"""

from __future__ import annotations

import enum
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from vlmcompile.ir.actions import Action, ActionKind, execution_order
from vlmcompile.ir.errors import PlanError

RECEIVE_AHEAD = 2
"""Compute actions ahead of its consumer at which a receive is posted. gloo moves a message only
once its receive is posted (the sender waits for the receiver's ready notice), and its own
thread then moves it while the rank computes. A receive posted only when its action starts
costs the whole transfer there, plus the wait for a sender busy computing: 3-14 ms for the
demo's 0.5 MB activations on a 2-core machine, against 0.14 ms unloaded."""


class Transfer(NamedTuple):
    """One value crossing ranks: a forward's activations for the next stage (``kind`` F) or a
    backward's input gradients for the stage before (``kind`` B, or I where the backward is
    split into input- and weight-gradient actions). A tuple: lowering a
    paper-scale plan hashes some hundred thousand of them."""

    kind: ActionKind
    stage: int
    """The producing action's stage."""
    microbatch: int
    src: int
    """Pipeline rank that produces it."""
    dst: int
    """Pipeline rank that consumes it."""

    @property
    def producer(self) -> Action:
        return Action(self.stage, self.kind, self.microbatch)

    @property
    def consumer(self) -> Action:
        step = 1 if self.kind is ActionKind.F else -1
        return Action(self.stage + step, self.kind, self.microbatch)

    def __str__(self) -> str:
        what = "activations" if self.kind is ActionKind.F else "input gradients"
        return f"{self.producer}'s {what}"


class CommKind(enum.Enum):
    SEND = "send"
    RECV = "recv"


class Comm(NamedTuple):
    """A send or a receive of a :class:`Transfer`, in a rank's list."""

    kind: CommKind
    transfer: Transfer

    def __str__(self) -> str:
        return f"{self.kind.value.upper()}({self.transfer})"


Op = Action | Comm
"""One entry of a rank's lowered list."""


def transfers(plan) -> list[Transfer]:
    """Every value of a step that crosses pipeline ranks, in the order of its producers in the
    lists run with every action taking no time (carried ones first: they are sent as the step
    starts)."""
    return [t for t, _, _ in _ends(plan)]


def _ends(plan) -> list[tuple[Transfer, Action, Action]]:
    """(transfer, its producer, its consumer) of :func:`transfers`."""
    rank_of = plan.rank_of_action()
    order, _ = execution_order(
        plan.actions, plan.num_stages, plan.split_backward(), plan.hosts_of(), plan.ahead
    )
    last = plan.num_stages - 1
    carried = plan.carried()
    split = plan.split_backward()
    out = []
    for a in sorted(carried) + [a for _, _, a in order if a not in carried]:
        if a.kind is ActionKind.F and a.stage < last:
            consumer = Action(a.stage + 1, ActionKind.F, a.microbatch)
        elif a.kind in (ActionKind.B, ActionKind.I) and a.stage > 0:
            # a split backward's input gradients come from its I; the stage before takes them
            # into its I or its whole B
            grad = ActionKind.I if a.stage - 1 in split else ActionKind.B
            consumer = Action(a.stage - 1, grad, a.microbatch)
        else:
            continue
        dst = rank_of.get(consumer)
        if dst is not None and dst != rank_of[a]:
            out.append((Transfer(a.kind, a.stage, a.microbatch, rank_of[a], dst), a, consumer))
    return out


def lower(plan) -> tuple[tuple[Op, ...], ...]:
    """Per pipeline rank: its actions with the sends and receives of its transfers placed in
    (see the module's docstring). Kept per schedule: validation, the simulator and every rank
    ask for the same plan's."""
    key = _key(plan)
    with _LOCK:
        kept = _LOWERED.get(key)
    if kept is None:
        kept = _lower(plan)
        with _LOCK:
            if len(_LOWERED) >= _KEPT:
                _LOWERED.pop(next(iter(_LOWERED)))
            _LOWERED[key] = kept
    return kept


def _lower(plan) -> tuple[tuple[Op, ...], ...]:
    carried = plan.carried()
    sends: dict[Action, list[Comm]] = defaultdict(list)
    receives: dict[tuple[int, int], list[Comm]] = defaultdict(list)
    head: dict[int, list[Comm]] = defaultdict(list)
    index = {a: k for acts in plan.actions for k, a in enumerate(acts)}
    for t, producer, consumer in _ends(plan):
        send = Comm(CommKind.SEND, t)
        if producer in carried:
            head[t.src].append(send)  # made the step before, sent as this one starts
        else:
            sends[producer].append(send)
        at = index[consumer] - RECEIVE_AHEAD
        if t.kind is not ActionKind.F:  # its buffers take the shapes of this rank's own forward's output
            at = max(at, index[Action(consumer.stage, ActionKind.F, t.microbatch)] + 1)
        receives[(t.dst, max(at, 0))].append(Comm(CommKind.RECV, t))
    out = []
    for rank, acts in enumerate(plan.actions):
        ops: list[Op] = list(head[rank])
        for k, a in enumerate(acts):
            ops += receives.get((rank, k), ())
            ops.append(a)
            ops += sends.get(a, ())
        out.append(tuple(ops))
    return tuple(out)


def compute_actions(ops: Sequence[Op]) -> list[Action]:
    """A lowered list's compute actions (what takes time in the simulator)."""
    return [op for op in ops if isinstance(op, Action)]


def transfer_order(plan) -> dict[int, dict[int, list[Transfer]]]:
    """Per pipeline rank, per peer pipeline rank: the transfers between the two (either way) in
    the order both issue them: their sends' order in the lowered lists run with every action
    taking no time.

    Why it cannot deadlock: when a rank needs transfer M, every transfer before M in its pair's
    order was produced earlier in that run. Its own sends there come from actions before the one
    waiting for M in its list, so it has issued them; the peer's sends there need nothing from
    this rank that it has not issued; and the receives there have known shapes, since the
    forward whose output gradient a receive brings ran before."""
    out: dict[int, dict[int, list[Transfer]]] = defaultdict(lambda: defaultdict(list))
    for t in transfers(plan):
        out[t.src][t.dst].append(t)
        out[t.dst][t.src].append(t)
    return {r: dict(peers) for r, peers in out.items()}


def check_lowered(plan, lowered: Sequence[Sequence[Op]] | None = None) -> None:
    """Every cross-rank transfer sent once on its producer's rank after its producer, received
    once on its consumer's rank before its consumer (a gradient after the rank's own forward),
    and the compute actions those of the plan, in its order; else a :class:`PlanError`."""
    lowered = lower(plan) if lowered is None else lowered
    # Keyed by producing action (one transfer each, hashed by identity): a paper-scale plan's
    # lists hold some hundred thousand entries.
    ends = {producer: (t, consumer) for t, producer, consumer in _ends(plan)}
    carried = plan.carried()
    seen: dict[CommKind, set[Action]] = {CommKind.SEND: set(), CommKind.RECV: set()}
    for rank, ops in enumerate(lowered):
        if compute_actions(ops) != list(plan.actions[rank]):
            raise PlanError(
                f"pipeline rank {rank}'s lowered list does not hold its actions in the plan's order"
            )
        done: set[Action] = set()
        for k, op in enumerate(ops):
            if isinstance(op, Action):
                done.add(op)
                continue
            fault = _fault(op, rank, ends, done, carried, seen[op.kind])
            if fault:
                raise PlanError(f"pipeline rank {rank}'s lowered list, entry {k}: {op} {fault}")
    missing = [
        f"{kind.value} of {t}"
        for producer, (t, _) in ends.items()
        for kind in CommKind
        if producer not in seen[kind]
    ]
    if missing:
        raise PlanError(f"the lowered lists lack {', '.join(missing[:5])}")


def _fault(op: Comm, rank: int, ends, done: set[Action], carried, seen: set[Action]) -> str | None:
    """What is wrong with ``op`` where it stands in ``rank``'s list (``done``: the actions
    before it; ``seen``: the producers of the ops of its kind before it), or None."""
    t = op.transfer
    producer = Action(t.stage, t.kind, t.microbatch)
    if producer not in ends or ends[producer][0] != t:
        return "is no transfer of the plan"
    if producer in seen:
        return "is listed twice"
    seen.add(producer)
    own = t.src if op.kind is CommKind.SEND else t.dst
    if rank != own:
        return f"belongs on pipeline rank {own}"
    consumer = ends[producer][1]
    if op.kind is CommKind.SEND:
        if producer in carried:  # made the step before: sent before this step computes anything
            return (
                f"comes after {len(done)} actions; a value made the step before is sent first"
                if done
                else None
            )
        return None if producer in done else f"comes before {producer}, which makes the value"
    if consumer in done or (
        t.kind is not ActionKind.F and Action(consumer.stage, ActionKind.F, t.microbatch) not in done
    ):
        return f"comes after {consumer} or before the forward whose shapes it takes"
    return None


def _key(plan) -> tuple:
    return (
        tuple(tuple(acts) for acts in plan.actions),
        tuple((s.index, s.ranks, s.group) for s in plan.stages),
        frozenset((plan.kernel_level or {}).items()),
        plan.num_stages,
        plan.ahead,
    )


_LOWERED: dict[tuple, tuple[tuple[Op, ...], ...]] = {}
_KEPT = 8
_LOCK = threading.Lock()
"""Re-planning lowers schedules on a thread of its own (one batch ahead of the step)."""
