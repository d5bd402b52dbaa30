import dataclasses

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import usable_memory_bytes
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Reason, Recompute
from vlmcompile.passes.baselines.megatron_balanced import megatron_balanced
from vlmcompile.passes.planning.partition import partition
from vlmcompile.planning.partition_problem import evaluate
from vlmcompile.planning.request import PlanRequest
from vlmcompile.planning.stage_cuts import Solution
from vlmcompile.sim.simulator import simulate


def small_memory(cluster: Cluster, mem_bytes: float) -> Cluster:
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, mem_bytes=int(mem_bytes)))


@pytest.fixture(scope="module")
def h100():
    return Cluster.preset("h100x8")


def test_plan_is_valid_and_within_memory(demo_graph, h100):
    result = partition(demo_graph, h100, PlanRequest.on(h100, tp=1, pp=4, global_batch=16, microbatch_size=1))
    plan = result.plan
    plan.validate(demo_graph)
    simulate(plan, demo_graph, h100).check_fits(plan)
    assert plan.policy == "vlmcompile"
    assert sorted(n for s in plan.stages for n in s.layers) == sorted(x.name for x in demo_graph.layers)
    sim = simulate(plan, demo_graph, h100)
    assert max(sim.peak_mem_bytes) <= usable_memory_bytes(h100.device.mem_bytes)
    assert result.report.solution.status == "OPTIMAL"
    assert any(d.reason is Reason.SOLVED for d in plan.decisions)
    text = str(result.report)
    assert "CP-SAT optimal in" in text and "boundary MiB" in text
    # the step bound, in the simulator's terms: the plan is above it, and the report says by how much
    bound = result.report.step_bound
    assert 0 < bound.step_s <= sim.step_time_s
    assert 0 <= result.report.bound_gap < 1
    assert f"{100 * result.report.bound_gap:.1f} % above it" in text


def test_a_proved_infeasible_request_can_skip_the_least_memory_solve(demo_graph, h100):
    tiny = small_memory(h100, 2**20)
    with pytest.raises(PlanError, match=r"CP-SAT proved that no stage cut and recompute choice fits"):
        partition(
            demo_graph,
            tiny,
            PlanRequest.on(tiny, tp=1, pp=2, global_batch=8, microbatch_size=1),
            explain_infeasible=False,
        )


def test_two_encoder_branches_keep_inputs_on_earlier_stages(two_encoder_graph, h100):
    plan = partition(
        two_encoder_graph, h100, PlanRequest.on(h100, tp=1, pp=4, global_batch=8, microbatch_size=1)
    ).plan
    stage = plan.stage_of()
    for producer, consumer in two_encoder_graph.graph.edges:
        assert stage[producer] <= stage[consumer], (producer, consumer)


def test_tight_memory_makes_it_recompute_and_still_fit(demo_graph, h100):
    loose = partition(demo_graph, h100, PlanRequest.on(h100, tp=1, pp=2, global_batch=64, microbatch_size=4))
    assert not loose.plan.recompute
    peak = max(loose.sim.peak_mem_bytes)
    states = max(loose.sim.ranks[r].static_bytes for r in range(2))
    # Room for the model states and a little under half the activations.
    tight = small_memory(h100, (states + 0.45 * (peak - states)) / 0.95)
    result = partition(
        demo_graph, tight, PlanRequest.on(tight, tp=1, pp=2, global_batch=64, microbatch_size=4)
    )
    assert result.plan.recompute, "no layer recomputed under a cap that the plain plan exceeds"
    assert all(v is Recompute.FULL for v in result.plan.recompute.values())
    assert max(result.sim.peak_mem_bytes) <= usable_memory_bytes(tight.device.mem_bytes)
    flagged = [d for d in result.plan.decisions if d.reason is Reason.LAYER_RECOMPUTE]
    assert {d.subject for d in flagged} == set(result.plan.recompute)
    assert result.sim.step_time_s > loose.sim.step_time_s


def test_no_fit_names_the_least_memory_and_the_knobs(demo_graph, h100):
    with pytest.raises(PlanError, match=r"least memory any cut and recompute choice needs .* GiB.*Try"):
        partition(
            demo_graph,
            small_memory(h100, 2**20),
            PlanRequest.on(small_memory(h100, 2**20), tp=1, pp=2, global_batch=8, microbatch_size=1),
        )


def _lopsided_solver(problem, *_args, **_kwargs) -> Solution:
    """A solver that answers with every layer but the last on stage 0 (a poor plan)."""
    stage_of = tuple(max(0, i - problem.num_layers + problem.num_stages) for i in range(problem.num_layers))
    flags = (False,) * problem.num_layers
    ev = evaluate(problem, stage_of, flags)
    return Solution(stage_of, flags, ev, "FEASIBLE", ev.step_s, 0.0, 0.0, True)


def test_a_faster_warm_start_is_kept_and_said(demo_graph, h100, monkeypatch):
    request = PlanRequest.on(h100, tp=1, pp=2, global_batch=16)
    warm = megatron_balanced(demo_graph, h100, request).plan
    # The choice between the solver's plan and the warm start, not the solver, is under test.
    monkeypatch.setattr("vlmcompile.passes.planning.partition.solve", _lopsided_solver)
    result = partition(demo_graph, h100, request, warm_start=warm)
    assert [s.layers for s in result.plan.stages] == [s.layers for s in warm.stages]
    said = [d for d in result.plan.decisions if d.reason is Reason.WARM_START]
    assert len(said) == 1 and said[0].numbers["warm_start_s"] < said[0].numbers["solver_plan_s"]
    assert result.sim.step_time_s == pytest.approx(simulate(warm, demo_graph, h100).step_time_s)
    assert result.report.warm_start_step_s == pytest.approx(result.sim.step_time_s)


def test_a_slower_warm_start_is_not_kept(demo_graph, h100, monkeypatch):
    request = PlanRequest.on(h100, tp=1, pp=2, global_batch=16)
    with monkeypatch.context() as patch:
        patch.setattr("vlmcompile.passes.planning.partition.solve", _lopsided_solver)
        lopsided = partition(demo_graph, h100, request).plan
    result = partition(demo_graph, h100, request, warm_start=lopsided)
    assert not any(d.reason is Reason.WARM_START for d in result.plan.decisions)
    assert result.plan.stage_of() != lopsided.stage_of()
    assert result.sim.step_time_s < result.report.warm_start_step_s


def test_schedules_it_does_not_model_are_refused(demo_graph, h100):
    with pytest.raises(PlanError, match="zero_bubble"):
        partition(demo_graph, h100, PlanRequest.on(h100, tp=1, pp=2, global_batch=8, schedule="zero_bubble"))


def test_a_warm_start_made_for_other_microbatches_is_judged_at_this_request(demo_graph, h100, monkeypatch):
    """A plan search hands on the last candidate's plan, made for another microbatch size: the
    choice between it and the solver's plan is made with both simulated at this request."""
    request = PlanRequest.on(h100, tp=1, pp=2, global_batch=16, microbatch_size=1)
    other = megatron_balanced(
        demo_graph, h100, PlanRequest.on(h100, tp=1, pp=2, global_batch=16, microbatch_size=2)
    ).plan
    monkeypatch.setattr("vlmcompile.passes.planning.partition.solve", _lopsided_solver)
    result = partition(demo_graph, h100, request, warm_start=other)
    assert (result.plan.microbatch_size, result.plan.num_microbatches) == (1, 4)
    assert [s.layers for s in result.plan.stages] == [s.layers for s in other.stages]
    said = next(d for d in result.plan.decisions if d.reason is Reason.WARM_START)
    assert said.numbers["warm_start_s"] == pytest.approx(result.sim.step_time_s)
    assert result.report.warm_start_step_s == pytest.approx(result.sim.step_time_s)
    assert simulate(other, demo_graph, h100).step_time_s != pytest.approx(result.sim.step_time_s)


def test_of_several_warm_starts_the_fastest_is_kept(demo_graph, h100, monkeypatch):
    request = PlanRequest.on(h100, tp=1, pp=2, global_batch=16)
    with monkeypatch.context() as patch:
        patch.setattr("vlmcompile.passes.planning.partition.solve", _lopsided_solver)
        lopsided = partition(demo_graph, h100, request).plan
    balanced = megatron_balanced(demo_graph, h100, request).plan
    monkeypatch.setattr("vlmcompile.passes.planning.partition.solve", _lopsided_solver)
    result = partition(demo_graph, h100, request, warm_start=[lopsided, balanced])
    assert [s.layers for s in result.plan.stages] == [s.layers for s in balanced.stages]
    assert result.sim.step_time_s == pytest.approx(simulate(balanced, demo_graph, h100).step_time_s)
