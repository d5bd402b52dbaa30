import dataclasses
import functools

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import usable_memory_bytes
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Parallel, Reason
from vlmcompile.passes.planning.plan_search import CandidateRow, _no_plan_message, candidates, plan_search
from vlmcompile.passes.planning.policies import baseline_to_beat, plan_and_simulate, search_and_compare
from vlmcompile.planning.candidate_bound import CandidateBound, candidate_bound, stage_cut_bound
from vlmcompile.planning.partition_problem import evaluate
from vlmcompile.planning.request import GlobalRecompute, PlanRequest, SearchSpace, SolverOptions
from vlmcompile.planning.stage_cuts import Solution
from vlmcompile.planning.step_bound import StepBound
from vlmcompile.sim.units import column_decimals, format_ms


def _request(*, tp, pp, dp, v=1, microbatch_size=1, global_batch=16):
    return PlanRequest(
        parallel=Parallel(dp=dp, tp=tp, pp=pp, v=v),
        global_batch=global_batch,
        microbatch_size=microbatch_size,
    )


def test_candidates_respect_the_cluster_and_the_batch(demo_graph):
    cluster = Cluster.preset("h100x8")
    for r in candidates(demo_graph, cluster, global_batch=16):
        d = r.parallel
        assert d.tp * d.pp * d.dp == 8
        assert d.dp * r.microbatch_size * r.num_microbatches == 16
        assert d.v == 1 or (r.num_microbatches % d.pp == 0 and d.pp > 1)


def test_packed_microbatches_round_the_global_batch_up_to_each_candidates_degrees(demo_graph):
    """5 packed microbatches a step: without rounding no candidate with DP > 1 takes them; with it
    each takes the next multiple of its DP (x PP for v > 1), never fewer than 5."""
    cluster = Cluster.preset("h100x8")
    space = SearchSpace(microbatch_sizes=(1,), dp_choices=(2, 4, 8))
    assert candidates(demo_graph, cluster, global_batch=5, space=space) == []
    rounded = candidates(
        demo_graph, cluster, global_batch=5, space=dataclasses.replace(space, round_up_global_batch=True)
    )
    assert rounded
    for r in rounded:
        d = r.parallel
        unit = d.dp * (d.pp if d.v > 1 else 1)
        assert r.global_batch % unit == 0 and 5 <= r.global_batch < 5 + unit


@pytest.mark.slow
def test_search_returns_the_fastest_planned_candidate_and_reports_every_one(demo_graph):
    cluster = Cluster.preset("h100x8")
    # As search_and_compare runs it: every candidate starts from the fastest baseline at its
    # degrees (without one, a 2 s CP-SAT solve can end above megatron_balanced's plan).
    result = plan_search(
        demo_graph,
        cluster,
        global_batch=16,
        progress=False,
        solver=SolverOptions(time_limit_s=2),
        baseline=functools.partial(baseline_to_beat, demo_graph, cluster),
    )
    plan, report = result.plan, result.report
    assert str(plan) in str(result) and not hasattr(report, "chosen")  # the result owns the plan
    outcomes = [c.outcome for c in report.candidates]
    assert outcomes.count("chosen") == 1 and "pruned" in outcomes
    assert len(report.candidates) == len(candidates(demo_graph, cluster, global_batch=16))
    assert all(c.reason for c in report.candidates)
    chosen = next(c for c in report.candidates if c.outcome == "chosen")
    assert plan.parallel["model"] == chosen.request.parallel
    assert result.sim.step_time_s == chosen.step_s
    fitting = [
        c
        for c in report.candidates
        if c.outcome == "planned" and c.peak_bytes <= usable_memory_bytes(cluster.device.mem_bytes)
    ]
    assert fitting and all(chosen.step_s <= c.step_s for c in fitting)
    # Planned apart from the search, every candidate's plan simulates to at least its lower
    # bound, so a candidate pruned by its bound (no better than the best found) had no faster
    # plan; and none of those plans that fits beats the one chosen.
    for c in report.candidates:
        other = plan_and_simulate(demo_graph, cluster, "megatron_balanced", c.request)
        assert other.sim.step_time_s >= c.lower_bound_s * (1 - 1e-9), c
        if c.outcome == "pruned" and "lower bound" in c.reason:
            assert c.lower_bound_s >= chosen.step_s * (1 - 1e-9)
        if other.fits:
            assert other.sim.step_time_s >= chosen.step_s * (1 - 1e-9), c


def test_included_degrees_are_considered(demo_graph):
    cluster = Cluster.preset("h100x8")
    extra = _request(tp=1, pp=2, dp=4)
    report = plan_search(
        demo_graph,
        cluster,
        global_batch=16,
        include=[extra],
        space=SearchSpace(microbatch_sizes=(2,)),
        progress=False,
    ).report
    assert extra in {c.request for c in report.candidates}


def test_no_candidate_fits_says_what_is_needed(demo_graph):
    cluster = Cluster.preset("h100x8")
    tiny = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, mem_bytes=2**20))
    with pytest.raises(
        PlanError,
        match=r"no parallel plan fits .* pruned: even with every layer recomputed they need more than the cap \(least",
    ):
        plan_search(demo_graph, tiny, global_batch=16, progress=False)


def test_the_no_plan_error_names_each_cause_with_its_count():
    d1 = _request(tp=1, pp=2, dp=4)
    d2 = _request(tp=1, pp=4, dp=2)
    d3 = _request(tp=2, pp=4, dp=1)
    bound = CandidateBound(StepBound((("work over ranks", 1.0),)), None, 0.0)
    rows = [
        CandidateRow(d1, "failed", "virtual stages [3] get no layers", bound),
        CandidateRow(d2, "failed", "virtual stages [3] get no layers", bound),
        CandidateRow(d3, "planned", "optimal", bound, step_s=2.0, peak_bytes=90 * 2**30),
        CandidateRow(d1, "pruned", "model states", CandidateBound(bound.chain, None, 80 * 2**30)),
        CandidateRow(d2, "pruned", "lower bound >= best found", bound),  # not for memory: not counted
    ]
    message = _no_plan_message(rows, 75 * 2**30, "h100x8")
    assert "of 5 candidates" in message
    assert f"2 could not be planned (virtual stages [3] get no layers; e.g. {d1})" in message
    assert f"1 planned but over the cap (least peak 90.00 GiB at {d3}, 15.00 GiB (20 %) over it)" in message
    assert "1 pruned" in message and "least 80.00 GiB on a fullest rank, 5.00 GiB (7 %) over it" in message


@pytest.mark.parametrize("cluster", ["cpu:1", "cpu:2"])
def test_a_screen_that_meets_its_own_bound_is_kept(cluster):
    """One pipeline stage, no gradient reduction (one rank, or nothing trainable): the screen's
    step is its lower bound, so no candidate is partitioned, and its plan is the search's."""
    from vlmcompile import compile, models

    model = models.build("tiny")
    if cluster == "cpu:2":
        model.requires_grad_(False)
    pipe = compile(model, models.sample_batch("tiny", batch_size=4), cluster, log=None)
    assert pipe.planned.fits and pipe.plan.pipeline_parallel.pp == 1


def test_a_warm_started_candidate_is_never_worse_than_its_warm_start(demo_graph):
    from vlmcompile.passes.planning.policies import plan_and_simulate

    cluster = Cluster.preset("h100x8")
    given = plan_and_simulate(
        demo_graph, cluster, "omnibal", PlanRequest.on(cluster, tp=1, pp=4, global_batch=16)
    )
    d = _request(tp=1, pp=4, dp=2)
    # A tiny time limit: the solver alone may stop short; the warm start bounds the answer.
    result = plan_search(
        demo_graph,
        cluster,
        global_batch=16,
        space=SearchSpace(tp_choices=(1,), pp_choices=(4,), microbatch_sizes=(1,), v_choices=(1,)),
        include=[d],
        warm_starts={d: given.plan},
        solver=SolverOptions(time_limit_s=0.05),
        progress=False,
    )
    assert [c.request for c in result.report.candidates] == [d]
    assert result.sim.step_time_s <= given.sim.step_time_s * (1 + 1e-9)


def test_only_the_fastest_closed_form_plans_are_polished_with_the_timeline(demo_graph):
    cluster = Cluster.preset("h100x8")
    space = SearchSpace(tp_choices=(1,), pp_choices=(2, 4), microbatch_sizes=(1,), v_choices=(1, 2))
    solver = SolverOptions(time_limit_s=1.0, workers=1)
    cap = usable_memory_bytes(cluster.device.mem_bytes)

    def rows(polish):
        report = plan_search(
            demo_graph, cluster, global_batch=16, space=space, solver=solver, polish=polish
        ).report
        return [c for c in report.candidates if c.outcome in ("planned", "chosen") and c.peak_bytes <= cap]

    unpolished = rows(0)
    assert len(unpolished) >= 3
    assert not any("timeline" in c.reason for c in unpolished)
    polished_rows = rows(2)
    polished = [c for c in polished_rows if "timeline polish" in c.reason]
    others = [c for c in polished_rows if "timeline polish" not in c.reason]
    assert len(polished) == 2
    # The polish solves the timeline alone, from the plan it has; it does not redo the closed form.
    assert not any("closed form:" in c.reason for c in polished)
    # The polish starts from the closed-form plan, so a polished row stays ahead of the rest.
    assert max(c.step_s for c in polished) <= min(c.step_s for c in others) * (1 + 1e-9)


def test_a_negative_polish_is_refused_by_name(demo_graph):
    with pytest.raises(PlanError, match="polish=-1"):
        plan_search(demo_graph, Cluster.preset("h100x8"), global_batch=16, polish=-1, progress=False)


def test_the_search_is_never_slower_than_a_baseline_at_the_degrees_it_chooses(demo_graph):
    """At DP=4 TP=1 PP=4 V=2 on 16 H100s the solver's optimum simulates slower than OmniBal's cuts
    (its models leave out the DP collectives' overlap); the search must start that candidate from
    the baselines' plans, as a plan at fixed degrees does, and keep the faster."""
    cluster = Cluster.preset("h100x16")
    run = search_and_compare(
        demo_graph,
        cluster,
        global_batch=16,
        space=SearchSpace(tp_choices=(1,), pp_choices=(4,), microbatch_sizes=(1,), v_choices=(2,)),
        solver=SolverOptions(time_limit_s=2, workers=1),
        progress=False,
    )
    fitting = [r for r in run.baselines if r.step_s is not None and r.fits]
    assert {r.policy for r in fitting} >= {"megatron", "megatron_balanced", "omnibal"}
    for row in fitting:
        assert run.sim.step_time_s <= row.step_s * (1 + 1e-9), row


def test_the_last_check_keeps_a_faster_baseline_the_search_did_not_start_from(demo_graph, monkeypatch):
    """A search that never saw the baselines (a solver that answers badly, no encoder-in-bubbles
    plan): the plan returned still starts from the fastest baseline at the degrees chosen and keeps
    its cuts."""
    from vlmcompile.passes.planning import policies

    real_search = policies.plan_search

    def search_without_baselines(*args, baseline=None, **kwargs):
        return real_search(*args, **kwargs)

    def lopsided(problem, *_args, **_kwargs) -> Solution:
        stage_of = tuple(
            max(0, i - problem.num_layers + problem.num_stages) for i in range(problem.num_layers)
        )
        flags = (False,) * problem.num_layers
        ev = evaluate(problem, stage_of, flags)
        return Solution(stage_of, flags, ev, "FEASIBLE", ev.step_s, 0.0, 0.0, True)

    monkeypatch.setattr(policies, "plan_search", search_without_baselines)
    monkeypatch.setattr(policies, "with_encoder_in_bubbles", lambda result, *_args, **_kwargs: result)
    monkeypatch.setattr("vlmcompile.passes.planning.partition.solve", lopsided)
    cluster = Cluster.preset("h100x8")
    run = policies.search_and_compare(
        demo_graph,
        cluster,
        global_batch=16,
        space=SearchSpace(tp_choices=(1,), pp_choices=(4,), microbatch_sizes=(1,), v_choices=(1,)),
        solver=SolverOptions(time_limit_s=1, workers=1),
        progress=False,
    )
    fastest = min(r.step_s for r in run.baselines if r.step_s is not None and r.fits)
    assert run.sim.step_time_s <= fastest * (1 + 1e-9)
    assert any(d.reason is Reason.WARM_START for d in run.plan.decisions)


def test_the_search_table_prints_times_that_tell_close_plans_apart(demo_graph):
    cluster = Cluster.preset("h100x8")
    report = plan_search(
        demo_graph,
        cluster,
        global_batch=16,
        space=SearchSpace(tp_choices=(1,), pp_choices=(2, 4), microbatch_sizes=(1,), v_choices=(1,)),
        solver=SolverOptions(time_limit_s=1, workers=1),
        polish=0,
        progress=False,
    ).report
    steps = {round(c.step_s, 12) for c in report.candidates if c.step_s is not None}
    assert len(steps) == 2
    shown = {format_ms(s, decimals=column_decimals(steps)) for s in steps}
    assert len(shown) == 2 and all(s in report.table() for s in shown)


@pytest.mark.parametrize(
    "tp, pp, v, microbatch_size, tight",
    [
        (1, 2, 1, 2, False),
        (2, 4, 1, 1, False),
        (1, 4, 2, 1, False),
        (2, 2, 2, 2, False),
        (1, 4, 2, 1, True),
        (2, 2, 2, 2, True),
    ],
)
def test_no_policy_plans_a_candidate_below_its_bounds(
    demo_graph, two_encoder_graph, tp, pp, v, microbatch_size, tight
):
    """Every policy's plan of a candidate that fits simulates to at least the candidate's step
    bound with its stage-cut term (an encoder-in-bubbles plan to at least its own bound), and any
    plan peaks at no less than its memory bound; ``tight``: a device whose memory makes the plans
    that fit recompute (megatron_balanced's peak halfway between no recompute and the most)."""
    roomy = Cluster.preset("h100x8")
    for graph in (demo_graph, two_encoder_graph):
        request = PlanRequest.on(roomy, tp=tp, pp=pp, v=v, global_batch=16, microbatch_size=microbatch_size)
        cluster = roomy
        if tight:
            peaks = [
                max(
                    plan_and_simulate(
                        graph, roomy, "megatron_balanced", request, recompute=rc
                    ).sim.peak_mem_bytes
                )
                for rc in (
                    GlobalRecompute(granularity="none"),
                    GlobalRecompute(granularity="full", vision=True),
                )
            ]
            usable = usable_memory_bytes(1.0)
            device = dataclasses.replace(roomy.device, mem_bytes=sum(peaks) / 2 / usable)
            cluster = dataclasses.replace(roomy, device=device)
        cache: dict = {}
        bound = candidate_bound(graph, cluster, request, cache)
        bound = stage_cut_bound(graph, cluster, request, bound, cache)
        assert bound.bubbles is not None
        fitted = 0
        for policy in ("megatron", "megatron_balanced", "omnibal", "partition", "bubbles"):
            try:
                run = plan_and_simulate(
                    graph,
                    cluster,
                    policy,
                    request,
                    **(
                        {"solver": SolverOptions(time_limit_s=1, workers=1)}
                        if policy in ("partition", "bubbles")
                        else {}
                    ),
                )
            except PlanError:
                continue  # this policy cannot plan these degrees
            least = bound.bubbles.step_s if policy == "bubbles" else bound.step_s
            if run.fits:
                fitted += 1
                assert run.sim.step_time_s >= least * (1 - 1e-9), (policy, bound)
            if policy != "bubbles":
                assert max(run.sim.peak_mem_bytes) >= bound.least_peak_bytes * (1 - 1e-9), policy
        assert fitted, "no plan fits: the test checks nothing"


def test_the_screen_partitions_only_the_fastest_screened_candidates(demo_graph):
    cluster = Cluster.preset("h100x8")
    screened_with = []

    def screen(request):
        screened_with.append(request)
        return plan_and_simulate(demo_graph, cluster, "megatron_balanced", request)

    result = plan_search(
        demo_graph,
        cluster,
        global_batch=16,
        solver=SolverOptions(time_limit_s=1, workers=1),
        screen=screen,
        solve_top=2,
        polish=0,
        progress=False,
    )
    rows = result.report.candidates
    assert len(rows) == len(candidates(demo_graph, cluster, global_batch=16))
    solved = [c for c in rows if c.outcome in ("planned", "chosen")]
    screened = [c for c in rows if c.outcome == "screened"]
    assert 1 <= len(solved) <= 2 and screened
    # the solved ones were the fastest screens that fit; the rest say where they stood
    fastest_left = min(c.step_s for c in screened if "over the cap" not in c.reason)
    assert all("not solved" in c.reason for c in screened if "over the cap" not in c.reason)
    chosen = next(c for c in rows if c.outcome == "chosen")
    assert chosen.step_s <= fastest_left * (1 + 1e-9)
    for c in rows:
        if c.outcome == "pruned" and "lower bound" in c.reason:
            assert c.lower_bound_s >= chosen.step_s * (1 - 1e-9) or "at DP=" in c.reason
        if c.outcome in ("screened", "planned", "chosen"):
            assert c.request in screened_with
            assert c.step_s >= c.lower_bound_s * (1 - 1e-9)


def test_screens_on_two_cores_reach_the_same_plan(demo_graph):
    cluster = Cluster.preset("h100x8")
    space = SearchSpace(tp_choices=(1, 2), microbatch_sizes=(1,), v_choices=(1, 2))
    screen = functools.partial(plan_and_simulate, demo_graph, cluster, "megatron_balanced")
    runs = [
        plan_search(
            demo_graph,
            cluster,
            global_batch=16,
            space=space,
            solver=SolverOptions(time_limit_s=1, workers=workers),
            screen=screen,
            solve_top=1,
            polish=0,
            progress=False,
        )
        for workers in (1, 2)
    ]
    one, two = (r.report.candidates for r in runs)
    assert {c.request for c in one} == {c.request for c in two}
    assert runs[1].sim.step_time_s <= runs[0].sim.step_time_s * (1 + 1e-6)


def test_candidates_with_long_action_lists_are_visited_last_and_the_plan_stays(demo_graph, monkeypatch):
    """Visiting the longest pipelines last prunes more of them by the plan found first; each is
    still screened or pruned by a plan it cannot beat, so the plan chosen is the same."""
    import vlmcompile.passes.planning.plan_search as search

    cluster = Cluster.preset("h100x8")
    space = SearchSpace(tp_choices=(1, 2), microbatch_sizes=(1,), v_choices=(1, 2))
    screen = functools.partial(plan_and_simulate, demo_graph, cluster, "megatron_balanced")
    first_check = search._pruned

    def run(deferred_actions):
        order = []

        def pruned(request, *rest):
            order.append(request)
            return first_check(request, *rest)

        monkeypatch.setattr(search, "_pruned", pruned)
        monkeypatch.setattr(search, "DEFERRED_ACTIONS", deferred_actions)
        result = search.plan_search(
            demo_graph,
            cluster,
            global_batch=16,
            space=space,
            solver=SolverOptions(time_limit_s=1, workers=1),
            screen=screen,
            solve_top=1,
            polish=0,
            progress=False,
        )
        return result, list(dict.fromkeys(order))

    plain, order = run(10**9)
    threshold = sorted(search._screen_actions(r) for r in order)[len(order) // 2]
    deferred, later = run(threshold)
    long = [r for r in order if search._screen_actions(r) > threshold]
    assert long and later[-len(long) :] == long  # last, in their bounds' order
    assert deferred.plan.pipeline_parallel == plain.plan.pipeline_parallel
    assert deferred.sim.step_time_s == pytest.approx(plain.sim.step_time_s, rel=1e-9)


def test_the_table_and_the_proof_name_the_plan_returned_when_it_is_not_the_best_chain(demo_graph):
    """A plan other than the search's best one chain came back (the encoder-in-bubbles plan):
    the table no longer calls that row "chosen", and the proof line names what was returned."""
    import dataclasses as dc

    from vlmcompile.passes.planning.plan_search import SearchReport

    cluster = Cluster.preset("h100x8")
    result = plan_search(
        demo_graph, cluster, global_batch=16, progress=False, solver=SolverOptions(time_limit_s=1.0)
    )
    report = result.report
    assert "chosen" in report.table() and "\nchosen:" not in report.proof()
    returned = dc.replace(report, returned=("the encoder-in-bubbles plan at DP=1 TP=1 PP=2 V=1", 0.001))
    assert isinstance(returned, SearchReport)
    table = returned.table()
    assert " chosen " not in table and "best chain" in table
    proof = returned.proof()
    assert (
        "the best one-chain plan" in proof
        and "chosen: the encoder-in-bubbles plan at DP=1 TP=1 PP=2 V=1, 1.000" in proof
    )
