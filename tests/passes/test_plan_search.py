import dataclasses

import pytest
from vlmcompile.cost_models.memory import usable_memory_bytes
from vlmcompile.passes.plan_search import CandidateRow, Degrees, _no_plan_message, candidates, plan_search

from vlmcompile.cluster import Cluster
from vlmcompile.errors import PlanError


def test_candidates_respect_the_cluster_and_the_batch(demo_graph):
    cluster = Cluster.preset("h100x8")
    for d in candidates(demo_graph, cluster, global_batch=16):
        assert d.tp * d.pp * d.dp == 8
        assert d.dp * d.microbatch_size * d.num_microbatches == 16
        assert d.v == 1 or (d.num_microbatches % d.pp == 0 and d.pp > 1)


def test_search_returns_the_fastest_planned_candidate_and_reports_every_one(demo_graph):
    cluster = Cluster.preset("h100x8")
    plan, report = plan_search(demo_graph, cluster, global_batch=16, progress=False, time_limit_s=2)
    outcomes = [c.outcome for c in report.candidates]
    assert outcomes.count("chosen") == 1
    assert len(report.candidates) == len(candidates(demo_graph, cluster, global_batch=16))
    chosen = next(c for c in report.candidates if c.outcome == "chosen")
    planned = [
        c
        for c in report.candidates
        if c.outcome == "planned" and c.peak_bytes <= usable_memory_bytes(cluster.device.mem_bytes)
    ]
    assert all(chosen.step_s <= c.step_s for c in planned)
    assert all(c.reason for c in report.candidates)
    par = plan.parallel["model"]
    assert (par.tp, par.pp, par.dp, par.v) == (
        chosen.degrees.tp,
        chosen.degrees.pp,
        chosen.degrees.dp,
        chosen.degrees.v,
    )
    # A pruned candidate's lower bound really is no better than the best found.
    for c in report.candidates:
        if c.outcome == "pruned" and "lower bound" in c.reason:
            assert c.lower_bound_s >= chosen.step_s * (1 - 1e-9)


def test_included_degrees_are_considered(demo_graph):
    cluster = Cluster.preset("h100x8")
    extra = Degrees(tp=1, pp=2, dp=4, v=1, microbatch_size=1, num_microbatches=4)
    _, report = plan_search(
        demo_graph, cluster, global_batch=16, include=[extra], microbatch_sizes=(2,), progress=False
    )
    assert extra in {c.degrees for c in report.candidates}


def test_no_candidate_fits_says_what_is_needed(demo_graph):
    cluster = Cluster.preset("h100x8")
    tiny = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, mem_bytes=2**20))
    with pytest.raises(
        PlanError, match=r"no parallel plan fits .* pruned: their model states alone exceed the cap \(least"
    ):
        plan_search(demo_graph, tiny, global_batch=16, progress=False)


def test_the_no_plan_error_names_each_cause_with_its_count():
    d1 = Degrees(tp=1, pp=2, dp=4, v=1, microbatch_size=1, num_microbatches=4)
    d2 = Degrees(tp=1, pp=4, dp=2, v=1, microbatch_size=1, num_microbatches=8)
    d3 = Degrees(tp=2, pp=4, dp=1, v=1, microbatch_size=1, num_microbatches=16)
    rows = [
        CandidateRow(d1, "failed", "virtual stages [3] get no layers", 1.0),
        CandidateRow(d2, "failed", "virtual stages [3] get no layers", 1.0),
        CandidateRow(d3, "planned", "optimal", 1.0, step_s=2.0, peak_bytes=90 * 2**30),
        CandidateRow(d1, "pruned", "model states", 1.0),
    ]
    message = _no_plan_message(rows, 75 * 2**30, "h100x8", 80 * 2**30)
    assert "of 4 candidates" in message
    assert f"2 could not be planned (virtual stages [3] get no layers; e.g. {d1})" in message
    assert f"1 planned but over the cap (least peak 90.0 GiB at {d3})" in message
    assert "1 pruned" in message and "least 80.0 GiB per rank" in message


def test_a_warm_started_candidate_is_never_worse_than_its_warm_start(demo_graph):
    from vlmcompile.planning import plan_and_simulate

    cluster = Cluster.preset("h100x8")
    given = plan_and_simulate(demo_graph, cluster, "omnibal", tp=1, pp=4, global_batch=16)
    d = Degrees(tp=1, pp=4, dp=2, v=1, microbatch_size=1, num_microbatches=8)
    # A tiny time limit: the solver alone may stop short; the warm start bounds the answer.
    plan, report = plan_search(
        demo_graph,
        cluster,
        global_batch=16,
        tp_choices=(1,),
        pp_choices=(4,),
        microbatch_sizes=(1,),
        v_choices=(1,),
        include=[d],
        warm_starts={d: given.plan},
        time_limit_s=0.05,
        progress=False,
    )
    assert [c.degrees for c in report.candidates] == [d]
    assert report.sim.step_time_s <= given.sim.step_time_s * (1 + 1e-9)
