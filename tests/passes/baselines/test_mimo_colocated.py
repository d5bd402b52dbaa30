"""Megatron MIMO's colocated layout: every module on every rank, no pipeline."""

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Reason
from vlmcompile.passes.baselines.mimo_colocated import mimo_colocated
from vlmcompile.planning.request import PlanRequest

CLUSTER = Cluster.preset("h100x16")


def test_every_layer_on_every_rank(demo_graph):
    result = mimo_colocated(demo_graph, CLUSTER, PlanRequest.on(CLUSTER, tp=2, pp=1, global_batch=16))
    plan = result.plan
    assert plan.num_stages == 1 and plan.stages[0].layers == tuple(layer.name for layer in demo_graph.layers)
    assert plan.parallel["model"].dp == 8
    assert plan.decisions[0].reason is Reason.COLOCATED
    assert result.sim.step_time_s > 0


def test_a_pipeline_is_refused_naming_the_source(demo_graph):
    with pytest.raises(
        PlanError, match=r"mimo_colocated runs every module on every rank .* cannot plan pp=2, v=1"
    ):
        mimo_colocated(demo_graph, CLUSTER, PlanRequest.on(CLUSTER, tp=2, pp=2, global_batch=16))
