"""One accounting: on any plan, the stage-cut numbers (planning/partition_problem.py) and the simulator
say the same step time and peak memory at any DP (both time the data-parallel collectives with
:mod:`vlmcompile.sim.dp`), and so does the CP-SAT model at DP = 1.

The CP-SAT model states the DP stream linearly (a rank's gradient reduction starts with its last
backward; no parameter all-gather), so its own step is compared at DP = 1 only. Transfers
between stages and TP collectives are in all three.
"""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.plan import Recompute
from vlmcompile.planning.build import build_plan
from vlmcompile.planning.chunks import chunks_by_stage
from vlmcompile.planning.partition_problem import evaluate, partition_problem
from vlmcompile.planning.request import PlanRequest, SolverOptions
from vlmcompile.planning.stage_cuts import solve
from vlmcompile.sim.simulator import simulate


@st.composite
def choices(draw, num_layers: int, *, dp_choices=(1, 2)):
    """Degrees on a small cluster, and a cut and recompute choice for them."""
    pp = draw(st.integers(1, 4))
    v = draw(st.integers(1, 2)) if pp > 1 and 2 * pp <= num_layers else 1
    per_rank = draw(st.integers(1, 3))
    m = pp * per_rank if v > 1 else draw(st.integers(1, 6))
    dp = draw(st.sampled_from(dp_choices))
    tp = draw(st.sampled_from([1, 8]))
    stages = pp * v
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=stages - 1, max_size=stages - 1)))
    bounds = [0, *cuts, num_layers]
    stage_of = tuple(k for k, (a, b) in enumerate(zip(bounds, bounds[1:])) for _ in range(b - a))
    flags = tuple(draw(st.lists(st.booleans(), min_size=num_layers, max_size=num_layers)))
    return tp, pp, v, m, dp, stage_of, flags


def _problem_and_simulation(layer_graph, tp, pp, v, m, dp, stage_of, flags):
    names = [layer.name for layer in layer_graph.layers]
    cluster = Cluster.preset(f"h100x{tp * pp * dp}")
    request = PlanRequest.on(cluster, tp=tp, pp=pp, v=v, global_batch=m * dp)
    problem = partition_problem(layer_graph, cluster, request)
    flags = tuple(f and problem.recomputable[i] for i, f in enumerate(flags))
    plan = build_plan(
        layer_graph,
        cluster,
        request,
        policy="test",
        chunks=chunks_by_stage(names, stage_of, problem.num_stages),
        recompute={n: Recompute.FULL for n, f in zip(names, flags) if f},
        decisions=[],
    )
    return problem, flags, simulate(plan, layer_graph, cluster)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_evaluate_and_the_simulator_agree_on_every_rank_peak_memory(demo_graph, data):
    tp, pp, v, m, dp, stage_of, flags = data.draw(choices(len(demo_graph.layers)))
    problem, flags, sim = _problem_and_simulation(demo_graph, tp, pp, v, m, dp, stage_of, flags)
    ev = evaluate(problem, stage_of, flags)
    assert ev.peak_bytes == pytest.approx(sim.peak_mem_bytes, rel=1e-9)
    assert ev.fits == sim.fits


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_evaluate_and_the_simulator_agree_on_the_step_time_at_any_dp(demo_graph, data):
    tp, pp, v, m, dp, stage_of, flags = data.draw(choices(len(demo_graph.layers), dp_choices=(1, 2, 4)))
    problem, flags, sim = _problem_and_simulation(demo_graph, tp, pp, v, m, dp, stage_of, flags)
    assert evaluate(problem, stage_of, flags).step_s == pytest.approx(sim.step_time_s, rel=1e-9)


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_the_dp_collectives_count_in_evaluate_as_in_the_simulator(demo_graph, zero_stage):
    # Enough DP that the gradient reduction outlasts the drain: the step is the DP stream's.
    names = [layer.name for layer in demo_graph.layers]
    cluster = Cluster.preset("h100x64")
    request = PlanRequest.on(cluster, tp=1, pp=2, global_batch=32, zero_stage=zero_stage)
    problem = partition_problem(demo_graph, cluster, request)
    stage_of = tuple(0 if i < len(names) // 2 else 1 for i in range(len(names)))
    flags = (False,) * len(names)
    plan = build_plan(
        demo_graph,
        cluster,
        request,
        policy="test",
        chunks=chunks_by_stage(names, stage_of, 2),
        recompute={},
        decisions=[],
    )
    sim = simulate(plan, demo_graph, cluster)
    assert sim.idle_share()["dp_reduce_scatter"] > 0
    assert evaluate(problem, stage_of, flags).step_s == pytest.approx(sim.step_time_s, rel=1e-9)
    without_dp = dataclasses.replace(problem, reduce_s=(0.0,) * len(names), gather_s=(0.0,) * len(names))
    assert evaluate(without_dp, stage_of, flags).step_s < sim.step_time_s


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_the_cp_sat_model_of_a_plan_is_the_simulators_step_and_memory(demo_graph, data):
    tp, pp, v, m, dp, stage_of, flags = data.draw(choices(len(demo_graph.layers), dp_choices=(1,)))
    problem, flags, sim = _problem_and_simulation(demo_graph, tp, pp, v, m, dp, stage_of, flags)
    # No memory cap: the plan is given, the model only evaluates it.
    loose = dataclasses.replace(problem, mem_cap_bytes=1e30)
    solution = solve(loose, SolverOptions(time_limit_s=20, workers=1), fixed=(stage_of, flags))
    assert solution.status == "OPTIMAL" and solution.objective == "timeline"
    # Times are rounded to a millionth of a microbatch's work per layer, summed over the actions.
    assert solution.objective_s == pytest.approx(sim.step_time_s, rel=1e-4)
    assert solution.stage_of == stage_of and solution.recompute == flags
    assert solution.evaluation.peak_bytes == pytest.approx(sim.peak_mem_bytes, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    st.sets(
        st.tuples(
            st.lists(
                st.tuples(st.integers(0, 3), st.integers(1, 3)), max_size=4, unique_by=lambda x: x[0]
            ).map(lambda live: tuple(sorted(live))),
            st.integers(-1, 3),
        ),
        max_size=12,
    )
)
def test_the_patterns_kept_are_those_no_other_covers(patterns):
    """Against the rule written out: a pattern covers another where it holds at least as many
    microbatches of every stage, its transient the same or the other's none."""
    from vlmcompile.planning.partition_problem import _undominated

    def covers(big, small):
        b = dict(big[0])
        return small[1] in (-1, big[1]) and all(b.get(k, 0) >= n for k, n in small[0])

    expected = {x for x in patterns if not any(y != x and covers(y, x) for y in patterns)}
    assert set(_undominated(set(patterns))) == expected
