"""Actions: one unit of pipeline work, a forward or backward of one stage on one microbatch.

Written like torch.distributed.pipelining's ``_Action``: ``2F0`` is the forward of stage 2 on
microbatch 0; ``B`` is a full backward, ``I`` and ``W`` its input-gradient and
weight-gradient halves (zero-bubble schedules run them apart). A schedule is one action list
per pipeline rank, executed in order; :func:`format_grid` prints it as a step x rank grid.
"""

from __future__ import annotations

import enum
import functools
import operator
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache


class ActionKind(str, enum.Enum):
    F = "F"
    """forward"""
    B = "B"
    """full backward (input and weight gradients)"""
    I = "I"  # noqa: E741 - the name torch and the zero-bubble paper use
    """input-gradient half of the backward"""
    W = "W"
    """weight-gradient half of the backward"""


_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")
_ACTIONS: dict[tuple[int, ActionKind | str, int], Action] = {}
"""Every action made in this process, by its fields: an action is one object for good. Never
cleared: an action made after a clear would be another object than an equal one kept before it
(in a plan, in :func:`dependencies`' cache), and a lookup of the one by the other would miss."""


@functools.total_ordering  # <=, >, >= from < and == (identity: equal actions are one object)
@dataclass(frozen=True, slots=True, eq=False, init=False)
class Action:
    """One pipeline action: a stage's forward or (part of its) backward of a microbatch.

    Equal actions are one object: made once, then looked up. So equality is identity and the
    hash is the object's, both in C: schedulers and the simulator look actions up in dicts
    millions of times, and with a Python ``__hash__`` / ``__eq__`` the bubble pass took 36 s on
    Optimus strong-1536 where it takes 28 s now. Actions sort by (stage, kind, microbatch)."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __new__(cls, stage: int, kind: ActionKind | str, microbatch: int) -> Action:
        made = _ACTIONS.get((stage, kind, microbatch))
        if made is not None:
            return made
        if stage < 0 or microbatch < 0:
            raise ValueError(
                f"action {stage}{getattr(kind, 'value', kind)}{microbatch}: stage and microbatch must be >= 0"
            )
        # The first maker's field types are everyone's after: 1, not True or numpy's int64.
        stage, kind, microbatch = operator.index(stage), ActionKind(kind), operator.index(microbatch)
        self = object.__new__(cls)
        for name, value in (("stage", stage), ("kind", kind), ("microbatch", microbatch)):
            object.__setattr__(self, name, value)
        # setdefault: of two threads making the same new action, both get the one kept.
        return _ACTIONS.setdefault((stage, kind, microbatch), self)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Action):
            return NotImplemented
        return (self.stage, self.kind.value, self.microbatch) < (
            other.stage,
            other.kind.value,
            other.microbatch,
        )

    def __reduce__(self):
        # Rebuilt from its fields, so an unpickled action is this process's one object.
        return (Action, (self.stage, self.kind, self.microbatch))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def from_str(cls, text: str) -> Action:
        match = _ACTION.match(text.strip())
        if not match:
            raise ValueError(f"{text!r} is not an action; write <stage><F|B|I|W><microbatch>, e.g. 2F0")
        return cls(int(match[1]), ActionKind(match[2]), int(match[3]))


_INTERNED: dict[frozenset[Action], frozenset[Action]] = {}


def interned(ahead: frozenset[Action]) -> frozenset[Action]:
    """One object for every equal set of run-ahead forwards. :func:`dependencies` is cached on
    its arguments, and a lookup with an equal set that is another object compares the two sets
    whole (hundreds of actions at paper scale), on every call; the same object compares at once."""
    if len(_INTERNED) > 256:
        _INTERNED.clear()
    return _INTERNED.setdefault(ahead, ahead)


def carried(ahead: frozenset[Action]) -> dict[Action, Action]:
    """The forwards of ``ahead`` (run one global batch ahead) whose output crosses the step
    boundary -> the forward of the next step that takes it (not ahead itself)."""
    out = {}
    # A set's order is its actions' addresses: sorted, the dict's order is the same every run.
    for a in sorted(ahead):
        taker = Action(a.stage + 1, ActionKind.F, a.microbatch)
        if taker not in ahead:
            out[a] = taker
    return out


@lru_cache(maxsize=1 << 18)
def dependencies(
    action: Action,
    num_stages: int,
    split_backward: frozenset[int] = frozenset(),
    ahead: frozenset[Action] = frozenset(),
) -> tuple[Action, ...]:
    """The actions that must finish before ``action`` may start. ``split_backward`` holds the
    stages whose backward runs as I + W (their input gradient is what the stage before waits for).
    ``ahead`` holds the forwards that run for the next global batch (``Plan.ahead``): a forward
    of this batch whose input such a forward makes got it from the step before, and waits for
    nothing. Cached: timing a schedule asks for every action's, and re-planning times many
    schedules of the same actions."""
    s, m = action.stage, action.microbatch
    if action.kind is ActionKind.F:
        if s == 0 or (action not in ahead and Action(s - 1, ActionKind.F, m) in ahead):
            return ()
        return (Action(s - 1, ActionKind.F, m),)
    if action.kind is ActionKind.W:
        return (Action(s, ActionKind.I, m),)
    if s + 1 < num_stages:
        grad = ActionKind.I if s + 1 in split_backward else ActionKind.B
        return (Action(s, ActionKind.F, m), Action(s + 1, grad, m))
    return (Action(s, ActionKind.F, m),)


def hosts_of(
    rank_actions: Sequence[Sequence[Action]],
    kernel_level: Mapping[Action, int],
    is_host: Callable[[Action], bool],
) -> dict[Action, tuple[Action, ...]]:
    """Each kernel-level action's hosts: the ``kernel_level[a]`` actions after it on its rank for
    which ``is_host`` holds (the pipeline group's; fewer where the list ends first)."""
    hosts: dict[Action, tuple[Action, ...]] = {}
    if not kernel_level:
        return hosts
    for acts in rank_actions:
        llm = [a for a in acts if is_host(a)]
        seen = 0  # the rank's hosts before the current action
        for a in acts:
            if a in kernel_level:
                hosts[a] = tuple(llm[seen : seen + kernel_level[a]])
            elif is_host(a):
                seen += 1
    return hosts


def without_backward(
    actions: Sequence[Sequence[Action]], stages: frozenset[int]
) -> tuple[tuple[Action, ...], ...]:
    """The action lists less the backward actions (B, I, W) of ``stages``: stages no gradient
    reaches (frozen, with nothing trainable before them), which run forwards only."""
    return tuple(
        tuple(a for a in acts if a.kind is ActionKind.F or a.stage not in stages) for acts in actions
    )


def execution_order(
    rank_actions: Sequence[Sequence[Action]],
    num_stages: int,
    split_backward: frozenset[int] = frozenset(),
    hosts: Mapping[Action, Sequence[Action]] | None = None,
    ahead: frozenset[Action] = frozenset(),
) -> tuple[list[tuple[int, int, Action]], list[int]]:
    """Run the lists with every action taking no time. Returns (rank, step, action) in an order
    where each action follows its rank's earlier actions and its dependencies, and where each
    rank stopped: ``len`` of its list when it finished, else the step it is stuck at (deadlock).
    ``hosts`` maps kernel-level actions to the actions they run inside (``Plan.hosts_of``): their
    output is ready when their last host is done; ``ahead``: the forwards for the next batch
    (:func:`dependencies`). The last few answers are kept: a plan's validation and its
    simulation ask for the same lists' order (paper-scale lists: 100,000 actions and more)."""
    hosts = hosts or {}
    ahead = interned(ahead)
    key = (
        tuple(map(tuple, rank_actions)),
        num_stages,
        frozenset(split_backward),
        frozenset((a, tuple(h)) for a, h in hosts.items()),
        ahead,
    )
    with _ORDERS_LOCK:
        kept = _ORDERS.get(key)
    if kept is None:
        kept = _execution_order(key[0], num_stages, split_backward, hosts, ahead)
        with _ORDERS_LOCK:
            if len(_ORDERS) >= _ORDERS_KEPT:
                _ORDERS.pop(next(iter(_ORDERS)))
            _ORDERS[key] = kept
    return list(kept[0]), list(kept[1])


_ORDERS: dict[tuple, tuple[list[tuple[int, int, Action]], list[int]]] = {}
_ORDERS_KEPT = 8
_ORDERS_LOCK = threading.Lock()
"""Re-planning orders schedules on a thread of its own (one batch ahead of the step)."""


def _execution_order(
    rank_actions: Sequence[Sequence[Action]],
    num_stages: int,
    split_backward: frozenset[int],
    hosts: Mapping[Action, Sequence[Action]],
    ahead: frozenset[Action],
) -> tuple[list[tuple[int, int, Action]], list[int]]:
    done: set[Action] = set()
    order: list[tuple[int, int, Action]] = []
    position = [0] * len(rank_actions)

    def ready(d: Action, a: Action) -> bool:
        if d not in done:
            return False
        if d not in hosts:
            return True
        # A rider's output is ready with its last host, and to a rider that starts in that same
        # host too (a rank's riders run one after the other).
        last = hosts[d][-1]
        return last in done or (a in hosts and hosts[a][:1] == (last,))

    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(rank_actions):
            while position[rank] < len(acts):
                a = acts[position[rank]]
                if not all(ready(d, a) for d in dependencies(a, num_stages, split_backward, ahead)):
                    break
                done.add(a)
                order.append((rank, position[rank], a))
                position[rank] += 1
                progress = True
    return order, position


def format_grid(
    rank_actions: Sequence[Sequence[Action]],
    *,
    mark: dict[tuple[int, int], str] | None = None,
    steps: range | None = None,
) -> str:
    """Step x rank grid: row i holds each rank's i-th action. ``mark`` maps (rank, step) to a
    note printed next to that cell (e.g. ``<- stuck``); ``steps`` limits the rows shown."""
    mark = mark or {}
    num_steps = max((len(a) for a in rank_actions), default=0)
    shown = steps if steps is not None else range(num_steps)
    cells = [
        [
            str(rank_actions[r][i]) + (f" {mark[(r, i)]}" if (r, i) in mark else "")
            if i < len(rank_actions[r])
            else ""
            for r in range(len(rank_actions))
        ]
        for i in shown
    ]
    width = max([len(c) for row in cells for c in row] + [len(f"rank {len(rank_actions) - 1}")])
    header = "step  " + "  ".join(f"rank {r}".ljust(width) for r in range(len(rank_actions)))
    lines = [header.rstrip()]
    for i, row in zip(shown, cells):
        lines.append(f"{i:<4}  " + "  ".join(c.ljust(width) for c in row).rstrip())
    if steps is not None and (steps.start > 0 or steps.stop < num_steps):
        lines.append(f"(steps {steps.start}-{steps.stop - 1} of {num_steps})")
    return "\n".join(lines)
