"""The demo's baselines: each pipelined policy at PP = 2 runs at the v its user would pick."""

from __future__ import annotations

import pytest

from tests.models import build
from vlmcompile import compile
from vlmcompile.demo import NUM_RANKS, V_CHOICES, baselines
from vlmcompile.ir.errors import PlanError


def test_each_pipelined_baseline_runs_at_its_fastest_v():
    model, batch = build("tiny", batch_size=4)
    pipe = compile(model, batch, cluster=f"cpu:{NUM_RANKS}", global_batch=4, log=None)
    chosen = dict(baselines(pipe, 4))
    steps = {}
    for v in V_CHOICES:
        try:
            run = pipe.baseline(
                "megatron_balanced", tp=1, pp=NUM_RANKS, v=v, global_batch=4, microbatch_size=1
            )
        except PlanError:
            continue
        steps[v] = run.sim.step_time_s
    assert len(steps) > 1, "the tiny model should allow several v"
    best = chosen["megatron_balanced"]
    assert best.sim.step_time_s == pytest.approx(min(steps.values()))
    assert best.plan.pipeline_parallel.v == min(steps, key=steps.get)
    assert chosen["megatron"].plan.pipeline_parallel.pp == NUM_RANKS
    assert chosen["mimo_colocated"].plan.pipeline_parallel.pp == 1
