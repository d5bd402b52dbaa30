"""forked_map: every call's answer in order, on other processes where there are cores."""

import os

import pytest

from vlmcompile.ir.errors import PlanError
from vlmcompile.planning.forked import forked_map


def _where(x: int) -> tuple[int, int]:
    if x == 3:
        raise PlanError("three cannot be planned")
    return x * x, os.getpid()


def test_answers_come_back_in_order_from_other_processes():
    made = forked_map(_where, [1, 2, 3, 4], cores=2, catch=(PlanError,))
    assert [o.answer[0] if o.answer else None for o in made] == [1, 4, None, 16]
    assert isinstance(made[2].error, PlanError) and "three" in str(made[2].error)
    assert made[0].answer[1] == os.getpid()  # the first here
    assert {o.answer[1] for o in (made[1], made[3])} != {os.getpid()}  # the others forked


def test_one_core_runs_every_call_here():
    made = forked_map(_where, [1, 2], cores=1)
    assert [o.answer for o in made] == [(1, os.getpid()), (4, os.getpid())]


def test_an_error_it_does_not_catch_is_raised_from_a_worker():
    with pytest.raises(PlanError, match="three"):
        forked_map(_where, [1, 3], cores=2)


def _nested(x: int) -> list[int]:
    # a worker's own calls run in it: its answers carry its pid
    return [o.answer[1] for o in forked_map(_where, [x, x + 10], cores=2)]


def test_a_worker_runs_its_own_calls_itself():
    made = forked_map(_nested, [1, 2], cores=2)
    inner = made[1].answer
    assert inner[0] == inner[1] != os.getpid()
