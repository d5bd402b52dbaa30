"""Policies side by side: ours is planned after every baseline and never simulates slower, and
the solver on its own, proven optimal, is no slower than any baseline either."""

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.passes.partition import partition
from vlmcompile.passes.policies import BASELINES, compare_baselines, plan_and_simulate
from vlmcompile.planning.request import PlanRequest, SolverOptions


@pytest.mark.parametrize("graph_name", ["demo_graph", "two_encoder_graph"])
@pytest.mark.parametrize("pp,v", [(2, 1), (4, 1), (2, 2)])
def test_ours_is_never_slower_than_a_baseline_that_fits(graph_name, pp, v, request):
    graph = request.getfixturevalue(graph_name)
    cluster = Cluster.preset("h100x8")
    run = plan_and_simulate(
        graph,
        cluster,
        "vlmcompile",
        PlanRequest.on(cluster, tp=1, pp=pp, v=v, global_batch=16),
        solver=SolverOptions(time_limit_s=5),
    )
    assert {r.policy for r in run.baselines} == set(BASELINES)
    assert run.fits
    for row in run.baselines:
        if row.step_s is not None and row.fits:
            assert run.sim.step_time_s <= row.step_s * (1 + 1e-9), row
    assert "vs ours" in run.comparison_table()


@pytest.mark.parametrize("graph_name", ["demo_graph", "two_encoder_graph"])
@pytest.mark.parametrize("pp,v", [(2, 1), (4, 1), (2, 2)])
def test_the_solver_alone_beats_or_ties_every_baseline_it_can_express(graph_name, pp, v, request):
    """Without the baselines' plans to start from. At DP = 1 the timeline model's step is the
    simulator's, so a proven optimum over cuts and full recompute is no slower than any
    baseline whose plan is such a choice (every one here: none needs recompute on H100s)."""
    graph = request.getfixturevalue(graph_name)
    cluster = Cluster.preset(f"h100x{pp}")
    plan_request = PlanRequest.on(cluster, tp=1, pp=pp, v=v, global_batch=8)
    ours = partition(graph, cluster, plan_request, solver=SolverOptions(time_limit_s=60, timeline_share=1.0))
    solution = ours.report.solution
    assert solution.status == "OPTIMAL" and solution.objective == "timeline", solution.summary()
    assert solution.objective_s == pytest.approx(ours.sim.step_time_s, rel=1e-4)
    _, rows = compare_baselines(graph, cluster, plan_request)
    planned = [r for r in rows if r.step_s is not None]
    assert planned and all(r.recompute in ("none", "per layer (0)") for r in planned), rows
    for row in planned:
        assert ours.sim.step_time_s <= row.step_s * (1 + 1e-4), row
