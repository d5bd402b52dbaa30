"""The LLM alone at a plan's degrees: the bound no plan of the VLM at those degrees beats."""

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.regions import ENCODER_SIDE
from vlmcompile.passes.llm_alone import encoder_cost_recovered, llm_alone_plan, llm_alone_step_s, llm_graph
from vlmcompile.passes.policies import plan_and_simulate
from vlmcompile.planning.request import PlanRequest

CLUSTER = Cluster.preset("h100x16")


def test_the_llm_graph_is_the_llm_side_layers_in_order(demo_graph):
    graph = llm_graph(demo_graph)
    kept = [layer.name for layer in demo_graph.layers if layer.region not in ENCODER_SIDE]
    assert [layer.name for layer in graph.layers] == kept
    assert [layer.index for layer in graph.layers] == list(range(len(kept)))
    assert all(src in kept and dst in kept for src, dst, _ in graph.edges)


@pytest.mark.parametrize(("tp", "pp", "v"), [(2, 4, 1), (1, 4, 2), (2, 1, 1)])
def test_no_baseline_at_the_same_degrees_beats_the_llm_alone(demo_graph, tp, pp, v):
    request = PlanRequest.on(CLUSTER, tp=tp, pp=pp, v=v, global_batch=32)
    policies = ["megatron", "megatron_balanced"] if pp > 1 else ["mimo_colocated"]
    bounds = set()
    for policy in policies:
        run = plan_and_simulate(demo_graph, CLUSTER, policy, request)
        alone = llm_alone_plan(run.plan, demo_graph, CLUSTER)
        par = alone.pipeline_parallel
        assert (par.dp, par.tp, par.pp, par.v) == (request.parallel.dp, tp, pp, v)
        assert alone.num_microbatches == run.plan.num_microbatches and alone.schedule == run.plan.schedule
        bound = llm_alone_step_s(run.plan, demo_graph, CLUSTER)
        assert 0 < bound < run.sim.step_time_s
        bounds.add(round(bound, 12))
    assert len(bounds) == 1, "the bound depends on the degrees, not on the policy"


def test_the_share_recovered_runs_from_the_baseline_to_the_bound():
    assert encoder_cost_recovered(ours_s=1.0, baseline_s=1.0, llm_alone_s=0.8) == 0.0
    assert encoder_cost_recovered(ours_s=0.8, baseline_s=1.0, llm_alone_s=0.8) == 1.0
    assert encoder_cost_recovered(ours_s=0.9, baseline_s=1.0, llm_alone_s=0.8) == pytest.approx(0.5)
    assert encoder_cost_recovered(ours_s=1.1, baseline_s=1.0, llm_alone_s=0.8) < 0
