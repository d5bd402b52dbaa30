"""Transfers lowered into the action lists: a send right after its producer, a receive
RECEIVE_AHEAD actions before its consumer (a gradient's after its own forward), a carried value
sent as the step starts, and the lists checked whole."""

import dataclasses

import pytest

from tests.pipeline_helpers import even_plan
from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.program import RECEIVE_AHEAD, Comm, CommKind, check_lowered, compute_actions, lower

F, B = ActionKind.F, ActionKind.B


@pytest.mark.parametrize(
    "options", [dict(pp=2), dict(pp=4, v=2), dict(pp=2, v=2, placement="v"), dict(pp=2, dp=2)]
)
def test_each_transfer_is_sent_after_its_producer_and_received_ahead_of_its_consumer(demo_graph, options):
    plan = even_plan(demo_graph, global_batch=8, **options)
    lowered = lower(plan)
    check_lowered(plan, lowered)
    rank_of = plan.rank_of_action()
    for rank, ops in enumerate(lowered):
        assert compute_actions(ops) == list(plan.actions[rank])
        for k, op in enumerate(ops):
            if not isinstance(op, Comm):
                continue
            t = op.transfer
            if op.kind is CommKind.SEND:
                assert (
                    ops[k - 1] == t.producer
                    or isinstance(ops[k - 1], Comm)
                    and ops[k - 1].kind is CommKind.SEND
                )
                assert rank_of[t.consumer] != rank
            else:
                computes_before = compute_actions(ops[:k])
                consumer_at = plan.actions[rank].index(t.consumer)
                earliest = consumer_at - RECEIVE_AHEAD
                if t.kind is B:
                    earliest = max(
                        earliest, plan.actions[rank].index(Action(t.consumer.stage, F, t.microbatch)) + 1
                    )
                assert len(computes_before) == max(earliest, 0), op


def test_a_value_made_ahead_is_sent_as_the_next_step_starts(demo_graph):
    plan = even_plan(demo_graph, global_batch=8, pp=2)
    first = plan.actions[0][0]
    assert first == Action(0, F, 0)
    ahead = dataclasses.replace(plan, ahead=frozenset({first}))
    if not ahead.carried():
        pytest.skip("this plan's first forward feeds no other rank")
    lowered = lower(ahead)
    sender = plan.rank_of_action()[first]
    assert lowered[sender][0] == Comm(CommKind.SEND, lowered[sender][0].transfer)
    assert lowered[sender][0].transfer.producer == first
    late = [list(ops) for ops in lowered]
    late[sender].append(late[sender].pop(0))  # sent after the step's actions
    with pytest.raises(PlanError, match="a value made the step before is sent first"):
        check_lowered(ahead, late)


def test_lists_that_do_not_carry_their_transfers_as_run_are_refused(demo_graph):
    plan = even_plan(demo_graph, global_batch=4, pp=2)
    lowered = [list(ops) for ops in lower(plan)]
    receive = next(k for k, op in enumerate(lowered[1]) if isinstance(op, Comm))
    moved = [list(ops) for ops in lowered]
    op = moved[1].pop(receive)
    moved[1].append(op)  # after its consumer
    with pytest.raises(PlanError, match="comes after 1F0 or before the forward"):
        check_lowered(plan, moved)
    dropped = [list(ops) for ops in lowered]
    dropped[0] = [op for op in dropped[0] if not (isinstance(op, Comm) and op.kind is CommKind.SEND)][:]
    with pytest.raises(PlanError, match="lack send of 0F0's activations"):
        check_lowered(plan, dropped)
    elsewhere = [list(ops) for ops in lowered]
    elsewhere[0].insert(0, elsewhere[1][receive])
    with pytest.raises(PlanError, match="belongs on pipeline rank 1"):
        check_lowered(plan, elsewhere)
