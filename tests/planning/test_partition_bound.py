"""The bounds given to the partition's CP-SAT models against exhaustive search on small problems."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings

from tests.planning.test_stage_cuts import _large_problem, enumerate_plans, problems
from vlmcompile.planning.partition_bound import Units, closed_form_bound, timeline_bound
from vlmcompile.planning.partition_problem import PartitionProblem, model_step, stage_figures, stage_timeline
from vlmcompile.planning.request import SolverOptions
from vlmcompile.planning.stage_cuts import _solve_one

UNITS = Units(time=round, mem=lambda x: math.ceil(x - 1e-9), cap=0)


def _closed_form(problem: PartitionProblem, fig) -> float:
    """The closed-form objective (v T) as the CP-SAT model states it (its cut transfers are the
    timeline's), from one plan's figures; the test checks it against the model itself."""
    p, v, m = problem.num_ranks, problem.v, problem.num_microbatches
    work = [sum(fig.fwd[k] + fig.bwd[k] for k in problem.stages_on[r]) for r in range(p)]
    tail = max(0, *(fig.reduce[r] - sum(fig.bwd[: r + 1]) for r in range(p)))
    return (v * m - 1) * max(work) + sum(work) + v * tail


def _least(problem: PartitionProblem):
    """The least closed form and the least timeline step of the plans that fit, and the plan of
    the least closed form (None: none fits)."""
    closed = timeline = math.inf
    best = None
    for stage_of, masks, _, peak in enumerate_plans(problem):
        for mask, used in zip(masks, peak):
            if used > problem.mem_cap_bytes:
                continue
            fig = stage_figures(problem, stage_of, mask)
            if _closed_form(problem, fig) < closed:
                closed, best = _closed_form(problem, fig), (tuple(stage_of), tuple(mask))
            timeline = min(timeline, model_step(fig, stage_timeline(problem, fig)))
    return None if best is None else (closed, timeline, best)


def _model_closed_form(problem: PartitionProblem, plan) -> float:
    """The CP-SAT closed-form model's own objective for one plan (every variable fixed)."""
    solution = _solve_one(problem, "closed form", 20.0, SolverOptions(workers=1), (1.0, 1.0), fixed=plan)
    return solution.objective_s * problem.v


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_the_bounds_are_at_most_every_plan_that_fits(problem):
    least = _least(problem)
    units = Units(UNITS.time, UNITS.mem, int(problem.mem_cap_bytes))
    closed, timeline = closed_form_bound(problem, units), timeline_bound(problem, units)
    if least is None:
        return  # nothing fits: any bound holds
    # the reference is the model's objective: a bound on another formula proves nothing
    assert _model_closed_form(problem, least[2]) == pytest.approx(least[0])
    assert closed <= least[0] + 1e-9
    assert timeline <= least[1] + 1e-9
    # not a trivial bound: at least the work spread evenly over the ranks
    p, v, m = problem.num_ranks, problem.v, problem.num_microbatches
    plain = sum(problem.fwd_s) + sum(problem.bwd_s)
    assert closed >= math.floor((v * m - 1) * plain / p + plain) - 1
    assert timeline >= math.floor(m * plain / p) - 1


def test_the_dp_reduction_after_the_last_backward_lifts_the_timeline_bound():
    """The timeline model starts a rank's DP reduction with its last backward: with heavy
    reductions that is the binding term, and the bound must take it and stay below every plan."""
    problem = dataclasses.replace(_large_problem(6, 2, 2), reduce_s=(40.0,) * 6)
    least = _least(problem)
    units = Units(
        time=lambda x: round(1000 * x), mem=lambda x: math.ceil(x - 1e-9), cap=int(problem.mem_cap_bytes)
    )
    with_reduce = timeline_bound(problem, units) / 1000
    without = timeline_bound(dataclasses.replace(problem, reduce_s=(0.0,) * 6), units) / 1000
    assert with_reduce <= least[1] * (1 + 1e-6)
    assert with_reduce > without + 40  # at least one layer's reduction after the last backward starts
