"""The data-parallel stream of a rank: parameters gathered in the order first used, a first
forward waiting for them, gradients reduced as their layers' last backward passes them."""

import pytest

from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.sim import dp

F, B = ActionKind.F, ActionKind.B
STAGES = [
    (dp.DPLayer("a", 1.0, 2.0, 1.0, 0.5, 0.25), dp.DPLayer("b", 1.0, 2.0, 1.0, 0.5, 0.25)),
    (dp.DPLayer("c", 1.0, 4.0, 2.0, 3.0, 1.0),),
]


def test_each_rank_gathers_its_layers_in_the_order_it_first_runs_them():
    actions = [[Action(0, F, 0), Action(0, B, 0)], [Action(1, F, 0), Action(1, B, 0)]]
    gathered, events = dp.gather_times(actions, STAGES)
    assert gathered == [{"a": 0.5, "b": 1.0}, {"c": 3.0}]
    assert [(e.rank, e.kind, e.start, e.end) for e in events] == [
        (0, "all_gather", 0.0, 0.5),
        (0, "all_gather", 0.5, 1.0),
        (1, "all_gather", 0.0, 3.0),
    ]
    # Started at 0, layer a waits 0.5 for its parameters and b is there when a is done.
    assert dp.parameter_wait(STAGES[0], 0.0, gathered[0]) == 0.5
    assert dp.parameter_wait(STAGES[0], 2.0, gathered[0]) == 0.0


def test_gradients_are_reduced_as_the_last_backward_passes_their_layers():
    backwards = [(0, Action(0, B, 0), 10.0, 14.0), (0, Action(0, B, 1), 20.0, 24.0)]
    ends, events = dp.reduction(backwards, STAGES, 1)
    # The last backward (20-24) walks b then a, 2 each: b's gradients at 22, a's at 24.
    assert [(e.start, e.end) for e in events] == [(22.0, 22.25), (24.0, 24.25)]
    assert ends == [24.25] and dp.step_end(24.0, ends) == 24.25


def test_a_weight_gradient_action_makes_every_layers_gradients_as_it_ends():
    """torch's split backward (our W) writes the weights' gradients once it has them all."""
    stage = (dp.DPLayer("a", 1.0, 2.0, 1.0, 0.5, 0.25), dp.DPLayer("b", 1.0, 2.0, 3.0, 0.5, 0.5))
    ends, events = dp.reduction([(0, Action(0, ActionKind.W, 0), 0.0, 4.0)], [stage], 1)
    assert [(e.start, e.end) for e in events] == [(4.0, 4.5), (4.5, 4.75)] and ends == [4.75]
    assert dp.step_end(5.0, []) == 5.0


def test_a_stage_without_time_does_not_divide_by_zero():
    ends, _ = dp.reduction([(0, Action(0, B, 0), 1.0, 1.0)], [(dp.DPLayer("z", 0, 0, 0, 0, 0.5),)], 1)
    assert ends == [pytest.approx(1.5)]
