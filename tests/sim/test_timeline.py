"""The one timing rule: an action starts when its rank is free and its inputs have arrived (the
producer's end, plus the transfer only between ranks); action lists that deadlock are refused."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.errors import PlanError
from vlmcompile.sim.timeline import run_actions, transfer_between_stages

F, B = ActionKind.F, ActionKind.B


def test_a_two_rank_chain_waits_for_inputs_and_their_transfer():
    lists = [
        [Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1)],
        [Action(1, F, 0), Action(1, B, 0), Action(1, F, 1), Action(1, B, 1)],
    ]
    transfer = transfer_between_stages([0.5, 0.0], [0.0, 0.25])
    timed = {
        t.action: t
        for t in run_actions(lists, 2, duration=lambda a, _s: 1.0 if a.kind is F else 2.0, transfer=transfer)
    }
    assert timed[Action(1, F, 0)].start_s == 1.5  # 0F0 ends at 1, its activations take 0.5
    assert timed[Action(1, B, 0)].start_s == 2.5  # right after its own forward: same stage, no transfer
    assert timed[Action(0, B, 0)].start_s == 4.75  # 1B0 ends at 4.5, its gradients take 0.25
    assert timed[Action(1, F, 1)].start_s == 4.5  # 0F1 was there at 2.5; rank 1 was busy until 4.5
    assert [t.step for t in timed.values() if t.rank == 1] == sorted(
        t.step for t in timed.values() if t.rank == 1
    )


def test_two_stages_on_one_rank_hand_over_without_a_transfer():
    # A V-shaped turn: stages 1 and 2 on rank 1.
    lists = [[Action(0, F, 0), Action(3, F, 0)], [Action(1, F, 0), Action(2, F, 0)]]
    transfer = transfer_between_stages([1.0] * 4, [1.0] * 4)
    ranks = {0: 0, 3: 0, 1: 1, 2: 1}
    timed = {t.action: t for t in run_actions(lists, 4, duration=lambda a, _s: 1.0, transfer=transfer)}
    assert all(t.rank == ranks[a.stage] for a, t in timed.items())
    assert timed[Action(2, F, 0)].start_s == timed[Action(1, F, 0)].end_s
    assert timed[Action(3, F, 0)].start_s == timed[Action(2, F, 0)].end_s + 1.0


def test_lists_that_deadlock_are_refused_naming_the_next_actions():
    lists = [[Action(0, B, 0), Action(0, F, 0)], [Action(1, F, 0), Action(1, B, 0)]]
    with pytest.raises(PlanError, match=r"deadlock \(next actions \['0B0', '1F0'\]\)"):
        run_actions(lists, 2, duration=lambda a, _s: 1.0, transfer=lambda d, a: 0.0)


def test_an_output_made_a_batch_ahead_is_sent_as_the_step_starts():
    """Rank 1 makes microbatch 0's encoder output for the next step (0F0 runs ahead); rank 0's 1F0
    takes the one made the step before, which waits for nothing but its transfer from rank 1."""
    from vlmcompile.ir.actions import Action, ActionKind
    from vlmcompile.sim.timeline import run_actions

    F = ActionKind.F
    ahead = frozenset({Action(0, F, 0)})
    timed = run_actions(
        [[Action(1, F, 0)], [Action(0, F, 0)]],
        2,
        duration=lambda a, _start: 5.0,
        transfer=lambda _made, _taker: 2.0,
        ahead=ahead,
    )
    starts = {t.action: t.start_s for t in timed}
    assert starts == {Action(1, F, 0): 2.0, Action(0, F, 0): 0.0}
    # On one rank nothing moves: the taker starts at once.
    same = run_actions(
        [[Action(1, F, 0), Action(0, F, 0)]],
        2,
        duration=lambda a, _s: 5.0,
        transfer=lambda *_: 2.0,
        ahead=ahead,
    )
    assert {t.action: t.start_s for t in same}[Action(1, F, 0)] == 0.0


@settings(max_examples=40, deadline=None)
@given(
    schedule=st.sampled_from(["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble"]),
    pp=st.integers(1, 4),
    m=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_the_plain_loop_times_every_action_as_the_one_with_riders(schedule, pp, m, seed):
    """run_actions' loop for lists without riders or carried outputs, against its general loop on
    the same lists (a split backward included): every start and end equal."""
    import random

    from vlmcompile.ir.placement import Placement
    from vlmcompile.planning.schedules import make_schedule
    from vlmcompile.sim.timeline import _run_plain, _run_with_riders, _Timing, complete_order

    v = 2 if schedule == "interleaved_1f1b" else 1
    m = m * pp if v > 1 else m  # interleaved: microbatches in groups of the pipeline size
    stages = pp * v
    rng = random.Random(seed)
    cost = {k: tuple(rng.uniform(0.5, 3.0) for _ in range(stages)) for k in ActionKind}
    lists = make_schedule(schedule, Placement(pp, v), m, stage_times=cost)
    split = frozenset(a.stage for acts in lists for a in acts if a.kind is ActionKind.I)
    order = complete_order(lists, stages, split, {})
    transfer = transfer_between_stages(
        [rng.uniform(0, 1) for _ in range(stages)], [rng.uniform(0, 1) for _ in range(stages)]
    )
    timing = _Timing(pp, stages, split, frozenset(), lambda a, _s: cost[a.kind][a.stage], transfer)
    assert _run_plain(order, timing) == _run_with_riders(order, timing, {}, None, {})
