"""Zero-bubble plans train: a backward split into I (input gradients, sent at once) and W (weight
gradients, later) gives eager's loss and every gradient, with W deferred past later forwards,
with recomputed layers, tied and frozen parameters."""

from __future__ import annotations

import dataclasses

import pytest

from tests.models import build
from tests.pipeline_helpers import check_equal_to_eager, even_plan
from vlmcompile import compile
from vlmcompile.ir.actions import ActionKind
from vlmcompile.runtime.launch import launch
from vlmcompile.runtime.timed_steps import one_step

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


def _every_step(runners, batches):
    return [one_step(runner, batch) for runner, batch in zip(runners, batches)]


def _deferred(plan):
    """The plan with every W of the last rank moved after its next forward (the schedule puts
    each right after its I at PP = 2): W then runs from what its I kept, a microbatch later."""
    acts = list(plan.actions[-1])
    for k in range(len(acts) - 2):
        if acts[k].kind is ActionKind.W and acts[k + 1].kind is ActionKind.F:
            acts[k], acts[k + 1] = acts[k + 1], acts[k]
    out = dataclasses.replace(plan, actions=(*plan.actions[:-1], tuple(acts)))
    out.validate()
    return out


def test_zero_bubble_plans_train_like_eager():
    cases = []
    for name, frozen, options in (
        ("tiny", False, dict(recompute=(2, 5))),
        ("tiny-tied", False, dict(cuts=[6])),  # the embedding's gradient: W on rank 0, the head's on rank 1
        ("tiny", True, {}),  # the encoder frozen: stage 1's inputs take no gradient, its W runs it all
    ):
        model, batch = build(name, batch_size=4)
        if frozen:
            model.encoders.requires_grad_(False)
        pipe = compile(model, batch, log=None)
        plan = even_plan(pipe.layer_graph, pp=2, global_batch=4, schedule="zero_bubble", **options)
        assert {a.kind for acts in plan.actions for a in acts} == {ActionKind.F, ActionKind.I, ActionKind.W}
        cases.append((model, batch, pipe.runner(plan, timeout_s=60)))
        deferred = _deferred(plan)
        assert deferred.actions != plan.actions
        cases.append((model, batch, pipe.runner(deferred, timeout_s=60)))
    per_rank = launch(_every_step, [c[2] for c in cases], 2, args=([c[1] for c in cases],), timeout_s=60)
    for k, (model, batch, _) in enumerate(cases):
        check_equal_to_eager(model, batch, [rank[k] for rank in per_rank])
