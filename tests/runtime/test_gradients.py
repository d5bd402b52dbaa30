"""The data-parallel gradient reduction overlaps the backwards: a bucket a layer, started while
the layer's last backward on the rank runs, in one order on every member; the gradients equal
eager's (a parameter two stages on one rank hold included)."""

from __future__ import annotations

import pytest

from tests.models import build
from tests.pipeline_helpers import check_equal_to_eager, even_plan
from vlmcompile import compile
from vlmcompile.ir.actions import ActionKind
from vlmcompile.runtime.launch import launch
from vlmcompile.runtime.timed_steps import one_step

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


def _step_watching_launches(runners, batch):
    """Per runner: one step, and for each bucket started, the action running as it started."""
    out = []
    for runner in runners:
        runner.setup()
        reduction, started = runner.reduction, []
        launch_ready = reduction._launch_ready

        def watched(reduction=reduction, started=started, launch_ready=launch_ready):
            before = len(reduction.works or ())
            launch_ready()
            for k in range(before, len(reduction.works or ())):
                finals = {str(reduction.final_of[id(p)]) for p in reduction.buckets[k]}
                started.append((str(reduction.running), finals))

        reduction._launch_ready = watched
        result = one_step(runner, batch)
        finals = {a.stage: str(a) for a in runner.actions if a.kind is ActionKind.B}
        out.append({**result, "started": started, "buckets": len(reduction.buckets), "finals": finals})
    return out


def test_each_layers_reduction_starts_during_its_last_backward_and_the_sums_equal_eager():
    cases = []
    for name, options in (
        ("tiny", dict(pp=1, dp=2)),
        # V-shaped: rank 0 holds stages 0 and 3, the embedding and the output layer tied to it.
        ("tiny-tied", dict(pp=2, dp=2, v=2, placement="v")),
    ):
        model, batch = build(name, batch_size=8)
        pipe = compile(model, batch, log=None)
        plan = even_plan(pipe.layer_graph, global_batch=8, **options)
        cases.append((model, batch, pipe.runner(plan, timeout_s=60), plan.pipeline_parallel.world_size))
    for model, batch, runner, world in cases:
        per_rank = launch(_step_watching_launches, [runner], world, args=(batch,), timeout_s=60)
        check_equal_to_eager(model, batch, [r[0] for r in per_rank])
        for (r,) in per_rank:
            assert len(r["started"]) == r["buckets"] > 1
            # Each started by an accumulation hook while its layer's last backward ran (none
            # waited for the action's end), and each stage's last backward started some.
            assert all(finals == {running} for running, finals in r["started"]), r["started"]
            assert {running for running, _ in r["started"]} == set(r["finals"].values())
