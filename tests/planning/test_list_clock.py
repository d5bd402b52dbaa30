"""The list schedulers' one clock: the earliest start anywhere is committed first, inputs arrive
with their transfer from another rank, and a clock with nothing to run says it is stuck."""

import pytest

from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.errors import PlanError
from vlmcompile.planning.list_clock import ListClock

F, B = ActionKind.F, ActionKind.B


def test_a_two_stage_chain_runs_in_the_order_time_allows():
    # Stage 0 on rank 0, stage 1 on rank 1; forwards take 1, backwards 2, a transfer 0.5.
    clock = ListClock(2, 2, transfer=lambda dep, a: 0.5)
    lists = {0: [Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1)], 1: []}
    lists[1] = [Action(1, F, 0), Action(1, B, 0), Action(1, F, 1), Action(1, B, 1)]
    ran: list[tuple[float, int, Action]] = []

    def propose(rank):
        todo = lists[rank]
        if not todo:
            return None
        start = clock.start_at(todo[0], rank)
        return None if start is None else (start, 0, todo[0])

    def commit(rank, a, start):
        lists[rank].pop(0)
        clock.commit(a, rank, start + (1 if a.kind is F else 2))
        ran.append((start, rank, a))
        return {1 - rank}

    clock.run(propose, commit, done=lambda: not lists[0] and not lists[1])
    starts = {a: start for start, _, a in ran}
    assert starts[Action(1, F, 0)] == 1.5  # rank 0's forward ends at 1, then the transfer
    assert starts[Action(0, B, 0)] == max(2.0, starts[Action(1, B, 0)] + 2 + 0.5)
    assert [start for start, _, _ in ran] == sorted(start for start, _, _ in ran)
    assert clock.ready_at(Action(0, B, 1), 0) == clock.ends[Action(1, B, 1)][0] + 0.5


def test_a_clock_with_nothing_that_can_run_says_it_is_stuck():
    clock = ListClock(1, 2)
    with pytest.raises(PlanError, match="stuck"):
        # Stage 1's forward waits for stage 0's, which nobody runs.
        clock.run(
            lambda r: None if clock.start_at(Action(1, F, 0), r) is None else (0, 0, Action(1, F, 0)),
            lambda r, a, s: (),
            done=lambda: False,
        )
