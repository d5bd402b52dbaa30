"""The demo VLM's Megatron plan at TP 2 x PP 4 and its simulated step, for the simulator's and the
traces' tests."""

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.passes.baselines.megatron import megatron
from vlmcompile.planning.request import PlanRequest
from vlmcompile.sim.simulator import simulate


@pytest.fixture(scope="module")
def demo_plan(demo_graph):
    cluster = Cluster.preset("h100x16")
    return megatron(demo_graph, cluster, PlanRequest.on(cluster, tp=2, pp=4, global_batch=16)).plan


@pytest.fixture(scope="module")
def demo_run(demo_graph, demo_plan):
    return simulate(demo_plan, demo_graph, Cluster.preset("h100x16"))
