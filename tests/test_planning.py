"""Policies side by side: ours is planned after every baseline and never simulates slower."""

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.passes.policies import plan_and_simulate
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
    assert {r.policy for r in run.baselines} == {"megatron", "megatron_balanced", "omnibal"}
    assert run.fits
    for row in run.baselines:
        if row.step_s is not None and row.fits:
            assert run.sim.step_time_s <= row.step_s * (1 + 1e-9), row
    assert "vs ours" in run.comparison_table()
