"""Actions written like torch's (2F0), what each waits for, and action lists run with no time:
their order, and where a deadlock stops them."""

import copy
import dataclasses
import os
import pickle
import subprocess
import sys

import numpy
import pytest

from vlmcompile.ir.actions import Action, ActionKind, carried, dependencies, execution_order, format_grid

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741


def test_an_action_reads_back_as_written():
    for text in ("0F0", "12B3", "4I10", "7W2"):
        assert str(Action.from_str(text)) == text
    with pytest.raises(ValueError, match="'F0' is not an action; write <stage><F|B|I|W><microbatch>"):
        Action.from_str("F0")
    with pytest.raises(ValueError, match="must be >= 0"):
        Action(-1, F, 0)


def test_equal_actions_are_one_object_however_they_are_made():
    # Equality is identity (and the hash the object's): any way of making an action must give
    # the one already made, or a dict keyed by it would miss.
    a = Action(2, B, 3)
    made = [
        Action(2, "B", 3),
        Action.from_str("2B3"),
        dataclasses.replace(Action(5, B, 3), stage=2),
        copy.copy(a),
        copy.deepcopy(a),
        pickle.loads(pickle.dumps(a)),
    ]
    assert all(b is a for b in made)
    assert a.kind is B and {a: 1}[Action(2, B, 3)] == 1
    assert Action(2, F, 3) != a and Action(2, B, 4) != a
    assert sorted([Action(1, W, 0), Action(0, F, 9), Action(1, B, 2), Action(1, B, 1)]) == [
        Action(0, F, 9),
        Action(1, B, 1),
        Action(1, B, 2),
        Action(1, W, 0),
    ]
    # Whoever makes an action first decides its fields for everyone: they are ints, however given.
    assert str(Action(True, W, 77)) == "1W77" and Action(numpy.int64(1), W, 77) is Action(1, W, 77)
    with pytest.raises(TypeError, match="'float' object cannot be interpreted as an integer"):
        Action(0, F, 0.5)
    with pytest.raises(ValueError, match="'X' is not a valid ActionKind"):
        Action(0, "X", 0)
    with pytest.raises(TypeError, match="not supported between instances of 'Action' and 'tuple'"):
        assert Action(0, F, 1) < (0, "F", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.stage = 1


def test_the_outputs_carried_across_the_step_come_in_action_order():
    # Built from a set, whose order is its actions' addresses: the dict is sorted all the same.
    ahead = frozenset(Action(s, F, m) for s in (0, 1) for m in (3, 0, 2))
    assert list(carried(ahead)) == [Action(1, F, 0), Action(1, F, 2), Action(1, F, 3)]
    assert carried(ahead)[Action(1, F, 2)] is Action(2, F, 2)


def test_what_each_kind_waits_for():
    assert dependencies(Action(0, F, 3), 4) == ()
    assert dependencies(Action(2, F, 3), 4) == (Action(1, F, 3),)
    assert dependencies(Action(2, B, 3), 4) == (Action(2, F, 3), Action(3, B, 3))
    assert dependencies(Action(3, B, 3), 4) == (Action(3, F, 3),)  # the last stage: its own forward
    # With split backwards the stage before waits for the input gradient (I), and W for I.
    assert dependencies(Action(2, B, 3), 4, frozenset({3})) == (Action(2, F, 3), Action(3, I, 3))
    assert dependencies(Action(3, W, 3), 4, frozenset({3})) == (Action(3, I, 3),)


def test_an_action_unpickled_in_a_process_with_another_hash_seed_finds_its_key():
    # An action's hash is its object's, and a str's hash (its kind's) differs from process to
    # process: plans travel to spawned ranks as pickles, whose actions must be this process's.
    code = (
        "import pickle, sys; from vlmcompile.ir.actions import Action, ActionKind; "
        "sys.stdout.buffer.write(pickle.dumps({Action(2, ActionKind.B, 3): 'here'}))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    made = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=60, check=True)
    assert pickle.loads(made.stdout)[Action(2, B, 3)] == "here"


def test_lists_run_in_an_order_that_respects_every_dependency_or_stop_at_the_deadlock():
    good = [[Action(0, F, 0), Action(0, B, 0)], [Action(1, F, 0), Action(1, B, 0)]]
    order, position = execution_order(good, 2)
    ran = [a for _, _, a in order]
    assert position == [2, 2] and all(ran.index(d) < ran.index(a) for a in ran for d in dependencies(a, 2))
    stuck = [[Action(0, B, 0), Action(0, F, 0)], [Action(1, F, 0), Action(1, B, 0)]]
    _, position = execution_order(stuck, 2)
    assert position == [0, 0]


def test_the_grid_shows_each_ranks_steps_and_marks():
    grid = format_grid([[Action(0, F, 0), Action(0, B, 0)], [Action(1, F, 0)]], mark={(1, 0): "<- here"})
    lines = grid.splitlines()
    assert lines[0].split() == ["step", "rank", "0", "rank", "1"]
    assert lines[1].split() == ["0", "0F0", "1F0", "<-", "here"] and lines[2].split() == ["1", "0B0"]


def test_a_kept_execution_order_is_handed_out_as_a_copy():
    """Validation and simulation share the order of the same lists; neither may change the other's."""
    from vlmcompile.planning.schedules import one_f_one_b

    lists = one_f_one_b(3, 4)
    first, position = execution_order(lists, 3)
    first.clear()
    position[0] = -1
    again, position_again = execution_order([list(acts) for acts in lists], 3)
    assert len(again) == sum(map(len, lists)) and position_again == [len(acts) for acts in lists]
