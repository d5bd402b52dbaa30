"""The one check a plan passes on its way to the ranks: validated, its lowered lists checked, what
the runtime cannot run refused, once; a runner given the checked plan checks nothing again."""

import dataclasses

import pytest

from tests.models import build
from tests.pipeline_helpers import even_plan
from vlmcompile import compile
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Plan
from vlmcompile.ir.program import lower
from vlmcompile.runtime.capabilities import RUNTIME, RunnablePlan, runnable
from vlmcompile.runtime.executor import PipelineRunner


@pytest.fixture(scope="module")
def pipe():
    model, batch = build("tiny", batch_size=4)
    return compile(model, batch, log=None)


def test_a_plan_is_validated_once_on_its_way_to_the_ranks(pipe, monkeypatch):
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)
    calls = []
    validate = Plan.validate
    monkeypatch.setattr(Plan, "validate", lambda self, *a: calls.append(self) or validate(self, *a))
    runner = pipe.runner(plan)
    assert calls == [plan], "make_runner validates; the runner it makes does not again"
    assert runner.parallel == plan.pipeline_parallel and runner._lowered == lower(plan)
    calls.clear()
    PipelineRunner(runner.plan, runner.stages_all, batch_shapes={})
    assert calls == [plan], "a runner given a bare plan checks it itself"


def test_what_the_runtime_cannot_run_is_refused_by_name(pipe):
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)
    checked = runnable(plan)
    assert isinstance(checked, RunnablePlan) and checked.program == lower(plan)
    assert not RUNTIME.tensor_parallel
    group = next(iter(plan.parallel))
    wide = dataclasses.replace(
        plan, parallel={**plan.parallel, group: dataclasses.replace(plan.parallel[group], tp=2)}
    )
    with pytest.raises(PlanError, match=f"no tensor parallelism yet; this plan's group {group!r} has TP=2"):
        runnable(wide)
    broken = dataclasses.replace(plan, actions=(plan.actions[0][1:], plan.actions[1]))
    with pytest.raises(PlanError, match="rank 0 is missing 0F0"):
        runnable(broken)
