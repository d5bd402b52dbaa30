"""A policy as data, and the result that owns its plan: decisions join the plan through
with_decisions, and a report part is found whatever reports sit behind the plan."""

import dataclasses

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.plan import Decision, Reason
from vlmcompile.passes.baselines.megatron import megatron
from vlmcompile.planning.megatron_layout import MegatronReport
from vlmcompile.planning.policy import Policy
from vlmcompile.planning.request import PlanRequest
from vlmcompile.planning.result import Reports


def test_a_policy_record_refuses_options_nobody_passes():
    with pytest.raises(ValueError, match="unknown options \\['learning_rate'\\]"):
        Policy("x", megatron, "x", options=("learning_rate",))
    with pytest.raises(ValueError, match="global recompute setting but takes no recompute option"):
        Policy("x", megatron, "x", global_recompute=True)


def test_with_decisions_is_the_one_way_a_decision_joins_the_plan(demo_graph):
    cluster = Cluster.preset("h100x8")
    result = megatron(demo_graph, cluster, PlanRequest.on(cluster, tp=1, pp=2, global_batch=8))
    said = Decision("microbatches", Reason.LOSS_COUPLED, "one microbatch")
    later = result.with_decisions(said, report=Reports((result.report, "another pass")))
    assert later.plan.decisions[-1] is said and said not in result.plan.decisions
    assert later.sim is result.sim  # the simulation holds no plan to go stale
    assert "[loss_coupled] microbatches: one microbatch" in str(later)
    assert str(later).count("plan 'megatron'") == 1
    assert later.report_part(MegatronReport) is result.report and later.report_part(str) == "another pass"
    assert result.report_part(Reports) is None
    assert dataclasses.replace(later, report=result.report).report_part(MegatronReport) is result.report
