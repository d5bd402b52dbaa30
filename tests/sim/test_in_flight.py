import pytest

from vlmcompile.ir.actions import ActionKind
from vlmcompile.ir.placement import Placement
from vlmcompile.planning.schedules import make_schedule
from vlmcompile.sim.in_flight import fullest_moment, held_together, in_flight, pattern_bytes


@pytest.mark.parametrize(
    ("schedule", "v", "most"),
    [
        ("gpipe", 1, lambda p, m, r: m),
        ("1f1b", 1, lambda p, m, r: min(p - r, m)),
        ("zero_bubble", 1, None),
        ("interleaved_1f1b", 2, None),
    ],
)
def test_every_microbatch_is_held_from_its_forward_to_its_last_backward(schedule, v, most):
    p, m = 4, 8
    for rank, actions in enumerate(make_schedule(schedule, Placement(p, v), m)):
        patterns = list(in_flight(actions))
        assert len(patterns) == len(actions)
        forwards = 0
        for action, (live, busy) in zip(actions, patterns):
            held = dict(live)
            forwards += action.kind is ActionKind.F
            assert all(0 < n <= m for n in held.values())
            assert sum(held.values()) <= forwards
            if action.kind is ActionKind.F:
                assert held[action.stage] >= 1 and busy == -1
            elif action.kind in (ActionKind.B, ActionKind.I):
                assert busy == action.stage and held[action.stage] >= 1
            else:
                assert busy == -1
        # After the last action every microbatch is released: the last one holds only itself.
        last_live, _ = patterns[-1]
        assert sum(n for _, n in last_live) == 1
        if most is not None:
            assert max(dict(live).get(rank, 0) for live, _ in patterns) == most(p, m, rank)


def test_pattern_bytes_counts_kept_bytes_per_microbatch_and_the_running_transient():
    keep, transient = [10.0, 100.0], [1.0, 7.0]
    assert pattern_bytes((((0, 2), (1, 3)), -1), keep, transient) == 320.0
    assert pattern_bytes((((0, 2), (1, 3)), -1), keep, transient) + 7.0 == pattern_bytes(
        (((0, 2), (1, 3)), 1), keep, transient
    )


def test_outputs_made_a_batch_ahead_are_held_across_the_step_boundary():
    """Rank 0 takes 0F0's output (made the step before) in 1F0 and makes the next batch's 0F0
    and 0F1; 0F1's output goes to rank 1's 1F1 at the next step's start."""
    from vlmcompile.ir.actions import Action
    from vlmcompile.sim.in_flight import held_across_steps

    F, B = ActionKind.F, ActionKind.B
    carried = {Action(0, F, 0): Action(1, F, 0), Action(0, F, 1): Action(1, F, 1)}
    rank_0 = [Action(1, F, 0), Action(0, F, 0), Action(1, B, 0), Action(0, F, 1)]
    # 1F0 holds its input while it runs; then the step's own 0F0 and 0F1 outputs stay.
    assert held_across_steps(rank_0, carried, [10, 0]) == [10, 10, 10, 20]
    # Rank 1 gets 0F1's output as the step starts and holds it until 1F1 has taken it.
    rank_1 = [Action(1, F, 1), Action(1, B, 1)]
    assert held_across_steps(rank_1, carried, [10, 0]) == [10, 0]


@pytest.mark.parametrize(
    "schedule, p, v",
    [
        ("1f1b", 3, 1),
        ("gpipe", 2, 1),
        ("zero_bubble", 3, 1),
        ("interleaved_1f1b", 2, 2),
        ("interleaved_1f1b", 3, 3),
    ],
)
def test_what_every_stage_holds_at_once_is_read_off_the_patterns(schedule, p, v):
    """held_together and fullest_moment walk the counts without the patterns; they say what the
    patterns do at every moment (the most of the least count, the counts where the sum is most)."""
    placement = Placement(p, v)
    for m in (p, 2 * p, 4 * p):
        for rank, acts in enumerate(make_schedule(schedule, placement, m)):
            stages = placement.stages_on(rank)
            moments = [tuple(dict(live).get(k, 0) for k in stages) for live, _ in in_flight(acts)]
            assert held_together(acts, stages) == max(min(c) for c in moments)
            fullest = max(moments, key=sum)  # the first of the fullest
            assert fullest_moment(acts, stages) == fullest
