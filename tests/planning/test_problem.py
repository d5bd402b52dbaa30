"""The numbers of a stage-cut choice (planning/problem.py) against the simulator: the CP-SAT
model and every policy that searches cuts read memory from ``evaluate``, the simulator from
the plan; on any plan both must say the same."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.plan import Recompute
from vlmcompile.planning.build import build_plan
from vlmcompile.planning.chunks import chunks_by_stage
from vlmcompile.planning.problem import evaluate, partition_problem
from vlmcompile.planning.request import PlanRequest
from vlmcompile.sim.simulator import simulate


@st.composite
def choices(draw, num_layers: int):
    """A request on a small cluster, and a cut and recompute choice for it."""
    pp = draw(st.integers(1, 4))
    v = draw(st.integers(1, 2)) if pp > 1 and 2 * pp <= num_layers else 1
    per_rank = draw(st.integers(1, 3))
    m = pp * per_rank if v > 1 else draw(st.integers(1, 6))
    dp = draw(st.sampled_from([1, 2]))
    tp = draw(st.sampled_from([1, 8]))
    stages = pp * v
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=stages - 1, max_size=stages - 1)))
    bounds = [0, *cuts, num_layers]
    stage_of = tuple(k for k, (a, b) in enumerate(zip(bounds, bounds[1:])) for _ in range(b - a))
    flags = tuple(draw(st.lists(st.booleans(), min_size=num_layers, max_size=num_layers)))
    return tp, pp, v, m, dp, stage_of, flags


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_evaluate_and_the_simulator_agree_on_every_rank_peak_memory(demo_graph, data):
    names = [layer.name for layer in demo_graph.layers]
    tp, pp, v, m, dp, stage_of, flags = data.draw(choices(len(names)))
    cluster = Cluster.preset(f"h100x{tp * pp * dp}")
    request = PlanRequest.on(cluster, tp=tp, pp=pp, v=v, global_batch=m * dp)
    problem = partition_problem(demo_graph, cluster, request)
    flags = tuple(f and problem.recomputable[i] for i, f in enumerate(flags))
    plan = build_plan(
        demo_graph,
        cluster,
        request,
        policy="test",
        chunks=chunks_by_stage(names, stage_of, problem.num_stages),
        recompute={n: Recompute.FULL for n, f in zip(names, flags) if f},
        decisions=[],
    )
    sim = simulate(plan, demo_graph, cluster)
    ev = evaluate(problem, stage_of, flags)
    assert ev.peak_bytes == pytest.approx(sim.peak_mem_bytes, rel=1e-9)
    assert ev.fits == sim.fits
