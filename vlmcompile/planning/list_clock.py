"""The one clock of the list schedulers (:func:`vlmcompile.planning.schedules.list_schedule`,
:func:`vlmcompile.planning.bubble_schedule.greedy`): the pipeline run in simulated time, one
action committed at a time.

Every rank proposes the action it would run next and when it could start it (after the rank is
free and the action's inputs have arrived: their producers' ends, plus the transfer when they ran
on another rank). The proposal that starts earliest is committed (ties: the lower priority, then
the lower rank); then the proposals that may have changed are asked again. Lists made so never
deadlock: they are an order the pipeline ran in.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from vlmcompile.ir.actions import Action, dependencies, interned
from vlmcompile.ir.errors import PlanError

Proposal = tuple[float, Any, Action]
"""(start, priority, action): a lower priority goes first among proposals that start together."""


class ListClock:
    """The state every list scheduler shares: when each rank is free, when and where each
    committed action ended, and when an action's inputs are there."""

    def __init__(
        self,
        num_ranks: int,
        num_stages: int,
        *,
        transfer: Callable[[Action, Action], float] = lambda _dep, _action: 0,
        split_backward: frozenset[int] = frozenset(),
        ahead: frozenset[Action] = frozenset(),
    ):
        self.num_ranks, self.num_stages = num_ranks, num_stages
        self.ahead = interned(ahead)
        """Forwards for the next global batch (``Plan.ahead``)."""
        self.transfer = transfer
        self.split_backward = split_backward
        self.free: list[float] = [0] * num_ranks
        self.ends: dict[Action, tuple[float, int]] = {}
        """Committed action -> (its end, its rank)."""
        # Per rank, action -> when its inputs are there: once every input is committed, it stays put.
        self._ready: list[dict[Action, float]] = [{} for _ in range(num_ranks)]

    def inputs(self, a: Action) -> tuple[Action, ...]:
        return dependencies(a, self.num_stages, self.split_backward, self.ahead)

    def ready_at(self, a: Action, rank: int) -> float | None:
        """When ``a``'s inputs are on ``rank``; None while one of them is not committed."""
        known = self._ready[rank]
        t = known.get(a)
        if t is not None:
            return t
        t = 0
        ends = self.ends
        for d in dependencies(a, self.num_stages, self.split_backward, self.ahead):
            ended = ends.get(d)
            if ended is None:
                return None
            end, where = ended
            if where != rank:
                end += self.transfer(d, a)
            if end > t:
                t = end
        known[a] = t
        return t

    def start_at(self, a: Action, rank: int) -> float | None:
        """When ``a`` could start on ``rank``: free, and its inputs there."""
        ready = self.ready_at(a, rank)
        return None if ready is None else max(self.free[rank], ready)

    def commit(self, a: Action, rank: int, end: float) -> None:
        self.ends[a] = (end, rank)
        self.free[rank] = end

    def run(
        self,
        propose: Callable[[int], Proposal | None],
        commit: Callable[[int, Action, float], Iterable[int]],
        *,
        done: Callable[[], bool],
        refresh_all: Callable[[], Hashable] | None = None,
        what: str = "the list scheduler",
    ) -> None:
        """Commit proposals until ``done()``.

        Args:
            propose: a rank's proposal, or None when it has nothing it can run.
            commit: run the chosen action on its rank from its start (and :meth:`commit` it);
                returns the other ranks whose proposals it may change.
            refresh_all: a value that, when it changes, makes every rank propose again.
            what: the schedule being made, for the error when no rank can run anything.
        """
        proposals: dict[int, Proposal | None] = {}
        stale = set(range(self.num_ranks))
        seen = None
        while not done():
            if refresh_all is not None and (key := refresh_all()) != seen:
                stale, seen = set(range(self.num_ranks)), key
            for rank in stale:
                proposals[rank] = propose(rank)
            best = min(
                ((p[0], p[1], rank, p[2]) for rank, p in proposals.items() if p is not None),
                default=None,
            )
            if best is None:
                raise PlanError(f"{what} is stuck: no rank can run its next action")
            start, _, rank, action = best
            stale = {rank, *commit(rank, action, start)}
