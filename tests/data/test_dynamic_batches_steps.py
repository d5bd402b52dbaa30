"""The steps benchmarks/dynamic_batches.py times: packed steps take every sample once, in
stream order, within each microbatch's tokens, and a stream too short is said, not padded out."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.bench_helpers import load_benchmark
from vlmcompile.data.balance import SampleSizes


def _module():
    return load_benchmark("dynamic_batches")


@pytest.mark.parametrize("method", ["tokens", "greedy"])
def test_packed_steps_take_every_sample_once_within_the_budget(method):
    bench = _module()
    rng = np.random.default_rng(0)
    sizes = SampleSizes(rng.integers(50, 900, 3000), rng.integers(0, 9, 3000))
    planned = SimpleNamespace(microbatches=4, replicas=2, capacity=1024, global_batch=16)
    steps = bench.packed_steps(sizes, planned, 20, method)
    seen = [i for step in steps for row in step for i in row]
    assert len(seen) == len(set(seen)) and len(steps) == 20
    assert all(len(step) == 8 for step in steps)
    assert all(sum(int(sizes.llm_tokens[i]) for i in row) <= 1024 for step in steps for row in step)
    assert max(seen) < 3000 and sorted(seen)[: len(seen) // 2] == list(range(len(seen) // 2))
    with pytest.raises(RuntimeError, match="the sample stream ran out"):
        bench.packed_steps(SampleSizes(sizes.llm_tokens[:30], sizes.vision_rows[:30]), planned, 20, method)
    megatron = bench.megatron_steps(sizes, planned, 3)
    assert [len(mb) for mb in megatron[0]] == [2] * 8 and megatron[1][0] == [16, 17]


def test_no_simulated_step_beats_its_bound(demo_graph):
    # The bound each method is reported against: the LLM alone, or the step's whole compute
    # spread over every rank; a step under it would make the figure meaningless.
    from vlmcompile.cost_models.cluster import Cluster
    from vlmcompile.cost_models.stage_costs import plan_costs
    from vlmcompile.passes.planning.bubbles import bubbles
    from vlmcompile.planning.request import PlanRequest, SolverOptions
    from vlmcompile.sim.simulator import simulate

    bench = _module()
    cluster = Cluster.preset("h100x2")
    request = PlanRequest.on(cluster, tp=1, pp=2, global_batch=8)
    made = bubbles(demo_graph, cluster, request, solver=SolverOptions(time_limit_s=4, workers=1))
    plan = made.plan
    planned = SimpleNamespace(
        ours=plan,
        graph=demo_graph,
        microbatches=plan.num_microbatches,
        replicas=1,
        llm_alone_s=made.report.llm_alone_step_s,
    )
    costs = plan_costs(plan, demo_graph, cluster)
    per_microbatch = bench.busy_per_microbatch(planned, cluster, costs)
    assert all(side > 0 for side in per_microbatch)
    rng = np.random.default_rng(0)
    tight = 0.0
    for _ in range(6):
        work = [(float(e), 1.0) for e in rng.uniform(0.0, 4.0, plan.num_microbatches)]
        step = simulate(plan, demo_graph, cluster, costs=costs, work=work).step_time_s
        bound = bench.step_bound(work, per_microbatch, planned)
        assert bound <= step * (1 + 1e-9)
        tight = max(tight, bound / step)
    assert tight > 0.5  # a bound, not a figure far below every step
