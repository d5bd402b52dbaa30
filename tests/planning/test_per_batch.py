"""Per-batch schedules: re-planned for a batch's own microbatch costs, never slower than the
plan's actions on the same batch, numbered by packed microbatch, and the last good schedule
used (and counted) when re-planning overruns its limit."""

from __future__ import annotations

import gc
import pickle
import time

import pytest

from tests.planning.test_bubble_schedule import make_problem
from vlmcompile.ir.errors import PlanError
from vlmcompile.planning import bubble_schedule as bs
from vlmcompile.planning.per_batch import SOLVE_SHARE, PerBatchScheduler, ordered, packed_work, relabel


def _problem(microbatches=6):
    return make_problem(
        ranks=2,
        microbatches=microbatches,
        encoder_pp=1,
        enc_times=[(3, 6)],
        llm_times=[(4, 8), (4, 8)],
        send=1,
    )


def _static(problem):
    return bs.greedy(problem, lookahead=8)


def _same_actions(a: bs.RankActions, b: bs.RankActions) -> bool:
    return sorted(x for acts in a for x in acts) == sorted(x for acts in b for x in acts)


def test_work_factors_scale_each_microbatch_on_its_own_side():
    problem = _problem().with_work([(0.0, 1.0), (2.0, 1.0), (1.0, 0.5), (1, 1), (1, 1), (1, 1)])
    enc, llm = problem.stages[0], problem.stages[1]
    durations = {a: problem.duration(a) for j in range(3) for a in problem.encoder_actions(j)}
    assert [durations[a] for a in problem.encoder_actions(1)] == [2 * enc.fwd, 2 * enc.bwd]
    assert [durations[a] for a in problem.encoder_actions(0)] == [1, 1]  # never below one unit
    half = bs.Action(1, bs.B, 2)
    assert problem.duration(half) == round(0.5 * llm.bwd)
    with pytest.raises(PlanError, match="work is given for 2 microbatches"):
        _problem().with_work([(1, 1), (1, 1)])
    with pytest.raises(PlanError, match="finite and at least 0"):
        _problem(2).with_work([(1, 1), (-1, 1)])


def test_a_batch_of_uneven_encoder_work_is_re_planned_faster_than_the_static_schedule():
    problem = _problem()
    static = _static(problem)
    scheduler = PerBatchScheduler(problem, (static, {}), time_limit_s=60)
    heavy_first = [(4.0, 1.0), (3.0, 1.0), (0.2, 1.0), (0.2, 1.0), (0.2, 1.0), (0.2, 1.0)]
    batch = scheduler.schedule([heavy_first])
    assert batch.source == "re-planned" and batch.step_s < batch.static_step_s
    (actions,) = batch.actions
    assert _same_actions(actions, static)  # the same actions, numbered by packed microbatch
    timed = bs.evaluate_schedule(problem.with_work(heavy_first), actions)
    assert timed.step_s(problem) == pytest.approx(batch.step_s) and timed.fits
    # The heavy microbatches no longer open the pipeline: its LLM starts on a light one.
    assert batch.order[0][0] not in (0, 1)


def test_the_static_schedule_is_kept_where_nothing_times_better():
    problem = _problem()
    static = _static(problem)
    batch = PerBatchScheduler(problem, (static, {}), time_limit_s=60).schedule([[(1.0, 1.0)] * 6])
    assert batch.step_s <= batch.static_step_s
    if batch.source == "static":
        assert batch.actions == (static,)


def test_a_re_planning_over_its_time_limit_runs_the_last_good_schedule_and_is_counted():
    problem = _problem()
    scheduler = PerBatchScheduler(problem, (_static(problem), {}), time_limit_s=0.0)
    first = scheduler.schedule([[(2.0, 1.0)] + [(0.5, 1.0)] * 5])
    assert first.source != "last good"  # nothing good yet: its own schedule, late
    second = scheduler.schedule([[(0.5, 1.0)] * 5 + [(2.0, 1.0)]])
    assert second.source == "last good" and second.actions == first.actions
    assert (scheduler.timed_out, scheduler.planned) == (2, 2)
    # It travels to the local launcher's ranks with the data (its last good schedule too).
    assert pickle.loads(pickle.dumps(scheduler)).last_good == scheduler.last_good
    expected = bs.evaluate_schedule(problem.with_work([(0.5, 1.0)] * 5 + [(2.0, 1.0)]), first.actions[0])
    assert second.step_s == pytest.approx(expected.step_s(problem))


def test_a_try_that_ends_past_the_limit_is_not_used_and_none_is_started_that_would():
    problem = _problem()
    static = _static(problem)
    timed, slow = [], []

    def slow_after_the_first(schedule, work):  # the plan's own timing fast, every try slow
        timed.append(schedule)
        if slow and schedule[0] is not static:
            time.sleep(0.3)
        timed_on = problem.with_work(work) if work else problem
        evaluation = bs.evaluate_schedule(timed_on, schedule[0])
        return evaluation.step_s(timed_on), evaluation.fits

    scheduler = PerBatchScheduler(problem, (static, {}), evaluate=slow_after_the_first, time_limit_s=0.2)
    slow.append(True)  # slower than the estimates measured at the start said
    timed.clear()
    heavy_first = [(4.0, 1.0), (3.0, 1.0)] + [(0.2, 1.0)] * 4  # re-planned faster given the time
    batch = scheduler.schedule([heavy_first])
    assert (batch.source, batch.actions, batch.late, scheduler.timed_out) == ("static", (static,), 1, 1)
    assert len(timed) == 2  # the plan's own, then one try that ran late
    # Tries now take 0.3 s, over the limit: none starts, and nothing ran late.
    batch = scheduler.schedule([heavy_first])
    assert (batch.source, len(timed), batch.late, scheduler.timed_out) == ("static", 3, 0, 1)


def test_the_default_limit_is_a_share_of_the_step_split_over_the_replicas_one_host_plans():
    problem = _problem()
    one = PerBatchScheduler(problem, (_static(problem), {}))
    two = PerBatchScheduler(problem, (_static(problem), {}), replicas_per_host=2)
    step = bs.evaluate_schedule(problem, _static(problem)).step_s(problem)
    assert one.time_limit_s == pytest.approx(SOLVE_SHARE * step) and SOLVE_SHARE < 0.05
    assert two.time_limit_s == pytest.approx(one.time_limit_s / 2)


def test_garbage_collection_waits_for_a_solve_and_a_callers_pause_is_kept():
    problem = _problem()
    static = _static(problem)
    seen = []

    def evaluate(schedule, work):
        seen.append(gc.isenabled())
        timed_on = problem.with_work(work) if work else problem
        evaluation = bs.evaluate_schedule(timed_on, schedule[0])
        return evaluation.step_s(timed_on), evaluation.fits

    scheduler = PerBatchScheduler(problem, (static, {}), evaluate=evaluate, time_limit_s=60)
    assert gc.isenabled()
    seen.clear()
    scheduler.schedule([[(2.0, 1.0)] + [(0.5, 1.0)] * 5])
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        scheduler.schedule([[(2.0, 1.0)] + [(0.5, 1.0)] * 5])
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_replicas_get_schedules_of_their_own():
    problem = _problem()
    scheduler = PerBatchScheduler(problem, (_static(problem), {}), time_limit_s=60)
    even, skewed = [(1.0, 1.0)] * 6, [(3.0, 1.0), (0.1, 1.0)] * 3
    batch = scheduler.schedule([even, skewed])
    assert len(batch.actions) == 2 and len(batch.order) == 2
    with pytest.raises(PlanError, match="each replica runs 6 microbatches"):
        scheduler.schedule([even[:5]])


def test_orders_and_relabelling_are_permutations():
    work = [(w, 1.0) for w in (5, 1, 4, 2, 3, 0)]
    assert ordered(work, "ascending") == (5, 1, 3, 4, 2, 0)
    ends = ordered(work, "light ends")
    assert sorted(ends) == list(range(6)) and work[ends[0]][0] == 0 and work[ends[-1]][0] == 1
    assert max(range(6), key=lambda k: work[ends[k]][0]) in (2, 3)  # the heaviest in the middle
    with pytest.raises(PlanError, match="unknown microbatch order"):
        ordered(work, "random")
    actions = ((bs.Action(0, bs.F, 0), bs.Action(0, bs.F, 1)),)
    assert relabel(actions, (1, 0)) == ((bs.Action(0, bs.F, 1), bs.Action(0, bs.F, 0)),)
    assert packed_work([4, 0, 8], 8) == [(0.5, 1.0), (0.0, 1.0), (1.0, 1.0)]
    with pytest.raises(PlanError, match="reference_rows=0"):
        packed_work([1], 0)


def test_re_planning_a_plan_without_an_encoder_plan_of_its_own_is_refused():
    from vlmcompile import compile, families, models
    from vlmcompile.data.synthetic import SyntheticDataset
    from vlmcompile.ir.errors import ArgumentError
    from vlmcompile.planning.request import SearchSpace

    model = models.build("tiny")
    data = SyntheticDataset(
        "interleaved", families.layout_of(model), 8, seed=1, text_scale=1 / 30, pixel_scale=16 / 640
    )
    samples = [data[i] for i in range(8)]
    tokens = max(s["input_ids"].numel() for s in samples) * 3
    pipe = compile(
        model,
        samples,
        "cpu:2",
        search_space=SearchSpace(pp_choices=(2,)),
        tokens_per_microbatch=tokens,
        log=None,
    )
    assert len({s.group for s in pipe.plan.stages}) == 1
    with pytest.raises(
        ArgumentError, match="gives the encoders no plan of their own to schedule into bubbles"
    ):
        pipe.rows_scheduler()
    assert pipe._re_plans(pipe.plan, None) is False  # not asked: trains on the plan's schedule
