"""The encoder-in-bubbles pass: its plan is valid, no slower than the phased schedule and no
faster than the bound, its report names every encoder plan tried, and bad input is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vlmcompile.compiler import zoo_layer_graph
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.stage_costs import plan_costs
from vlmcompile.ir.actions import Action
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Plan, Reason, Recompute
from vlmcompile.ir.regions import Region
from vlmcompile.passes.planning.bubbles import (
    _layer_level_hidden_s,
    bubbles,
    candidate_encoder_plans,
)
from vlmcompile.planning import bubble_schedule as bs
from vlmcompile.planning import encoder_plans as ep
from vlmcompile.planning.llm_alone_bound import llm_stages_of
from vlmcompile.planning.request import GlobalRecompute, PlanRequest, SolverOptions
from vlmcompile.planning.setups import SETUPS
from vlmcompile.sim.simulator import simulate

CLUSTER = Cluster.preset("cpu:2")
FAST = SolverOptions(time_limit_s=4, workers=2)


@pytest.fixture(scope="module")
def demo_bubbles(demo_graph):
    request = PlanRequest.on(CLUSTER, tp=1, pp=2, global_batch=4, sequence_parallel=False, zero_stage=0)
    return request, bubbles(demo_graph, CLUSTER, request, solver=FAST)


def test_the_plan_hides_encoder_work_between_the_phased_schedule_and_the_bound(demo_bubbles, demo_graph):
    request, result = demo_bubbles
    plan, report = result.plan, result.report
    plan.validate(demo_graph)
    assert result.fits
    assert plan.parallel[ep.ENCODER_GROUP].dp * plan.parallel[ep.ENCODER_GROUP].pp == 2
    # Each rank runs encoder and LLM work.
    for acts in plan.actions:
        groups = {plan.stages[a.stage].group for a in acts}
        assert groups == {ep.ENCODER_GROUP, ep.LLM_GROUP}
    assert report.step_s == pytest.approx(simulate(plan, demo_graph, CLUSTER).step_time_s)
    assert report.step_s < report.phased_step_s
    # No schedule beats every rank busy all the time.
    busy = sum(r.busy_s for r in result.sim.ranks) / plan.num_ranks
    assert report.step_s >= busy
    assert report.llm_alone_step_s < report.step_s
    assert 0 < report.hidden_share <= 1
    # The phased schedule runs the encoder's work where the LLM could have run: less of it sits in
    # the LLM's bubbles than in the scheduled plan.
    phased = dataclasses.replace(plan, actions=_phased_actions(plan), kernel_level={})
    phased_sim = simulate(phased, demo_graph, CLUSTER)
    costs = plan_costs(phased, demo_graph, CLUSTER)
    assert (
        _layer_level_hidden_s(phased, phased_sim, costs)
        < report.layer_hidden_share * report.encoder_compute_s
    )
    assert {d.reason for d in plan.decisions} >= {Reason.SEPARATE_ENCODER_PLAN, Reason.BUBBLE_SCHEDULE}


def test_the_report_names_every_encoder_plan_tried_and_the_solver(demo_bubbles, demo_graph):
    request, result = demo_bubbles
    report = result.report
    tried = {r.encoder for r in report.rows}
    assert tried == set(candidate_encoder_plans(demo_graph, request))
    assert [r.verdict for r in report.rows].count("chosen") == 1
    assert all(
        r.verdict == "chosen"
        or r.verdict.startswith(("slower", "does not fit", "pruned", "cannot", "skipped"))
        for r in report.rows
    )
    text = str(report)
    for needle in ("encoder plans tried", "phased -> scheduled", "CP-SAT", "hidden in bubbles", "wall time"):
        assert needle in text
    assert report.solver_status.split()[0] in ("OPTIMAL", "FEASIBLE", "UNKNOWN", "not")
    assert len(report.bubbles_before) == len(report.bubbles_after) == 2


def test_the_llm_alone_keeps_the_llm_stages_and_order(demo_bubbles):
    _, result = demo_bubbles
    alone = llm_stages_of(result.plan)
    alone.validate()
    first = next(s.index for s in result.plan.stages if s.group == ep.LLM_GROUP)
    assert [s.layers for s in alone.stages] == [s.layers for s in result.plan.stages[first:]]
    assert alone.actions == tuple(
        tuple(Action(a.stage - first, a.kind, a.microbatch) for a in acts if a.stage >= first)
        for acts in result.plan.actions
    )


def test_a_model_without_an_encoder_is_refused_and_planned_alone(demo_graph):
    llm_only = dataclasses.replace(
        demo_graph,
        layers=tuple(
            dataclasses.replace(layer, region=Region.LLM)
            if layer.region in (Region.VISION, Region.PROJECTOR)
            else layer
            for layer in demo_graph.layers
        ),
    )
    request = PlanRequest.on(CLUSTER, tp=1, pp=2, global_batch=4, sequence_parallel=False, zero_stage=0)
    with pytest.raises(
        PlanError, match="no encoder layers .* the LLM is planned alone by the other policies"
    ):
        bubbles(llm_only, CLUSTER, request, solver=FAST)


def test_encoder_plans_that_cannot_spread_over_the_gpus_are_refused_by_name(demo_graph):
    request = PlanRequest.on(CLUSTER, tp=1, pp=2, global_batch=4, sequence_parallel=False, zero_stage=0)
    with pytest.raises(PlanError, match=r"encoder PP=3 does not divide the LLM's PP=2"):
        bubbles(demo_graph, CLUSTER, request, solver=FAST, encoder_plans=[ep.EncoderPlan(pp=3, tp=1)])


def test_a_plan_whose_encoder_work_breaks_a_dependency_is_refused(demo_bubbles, tmp_path):
    _, result = demo_bubbles
    plan = result.plan
    # Move rank 0's first encoder forward behind everything else it runs: the first LLM stage
    # (on rank 0) then waits for an encoder output rank 0 has not made.
    acts = list(plan.actions[0])
    j = next(a for a in acts if plan.stages[a.stage].group == ep.ENCODER_GROUP).microbatch
    moved = [
        a
        for a in acts
        if plan.stages[a.stage].group == ep.ENCODER_GROUP and a.microbatch == j and a.kind.value == "F"
    ]
    broken = [a for a in acts if a not in moved] + moved
    bad = dataclasses.replace(plan, actions=(tuple(broken), *plan.actions[1:]))
    bad.save(tmp_path / "plan.json")
    with pytest.raises(PlanError, match="deadlock|runs on another rank than its forward"):
        Plan.load(tmp_path / "plan.json").validate()


def test_encoders_with_different_plans_are_refused_by_the_scheduler(demo_bubbles, demo_graph):
    """Optimus schedules several encoders as one (sec. 4.4): one encoder plan for all of them."""
    _, result = demo_bubbles
    plan = result.plan
    stages = list(plan.stages)
    stages[0] = dataclasses.replace(stages[0], group="encoder.b", replicas=())
    two = dataclasses.replace(
        plan,
        stages=tuple(stages),
        parallel={
            **plan.parallel,
            "encoder.b": dataclasses.replace(plan.parallel[ep.ENCODER_GROUP], dp=1, pp=2),
        },
    )
    from vlmcompile.cost_models.stage_costs import plan_costs

    with pytest.raises(PlanError, match="encoders have different plans"):
        bs.problem_from(two, plan_costs(two, demo_graph, CLUSTER), 1e12)


def test_the_plan_saves_and_loads_with_its_encoder_plan(demo_bubbles, tmp_path):
    _, result = demo_bubbles
    result.plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == result.plan
    assert loaded.parallel[ep.ENCODER_GROUP] == result.plan.parallel[ep.ENCODER_GROUP]
    assert any(s.replicas for s in loaded.stages)


def test_encoder_kernels_fill_the_llms_tp_gaps_where_it_has_them(demo_graph):
    """TP = 2: the LLM's actions leave their compute stream idle during TP collectives, and the
    list scheduler puts encoder actions inside them (the kernel level, Optimus design decision 3)."""
    cluster = Cluster.preset("h100x4")
    request = PlanRequest.on(cluster, tp=2, pp=2, global_batch=8)
    result = bubbles(demo_graph, cluster, request, solver=FAST)
    plan, report = result.plan, result.report
    plan.validate(demo_graph)
    assert plan.kernel_level, "expected encoder work inside the LLM's TP gaps"
    assert all(plan.stages[a.stage].group == ep.ENCODER_GROUP for a in plan.kernel_level)
    assert report.layer_level_step_s is not None and report.step_s < report.layer_level_step_s
    assert 0 < report.kernel_hidden_share <= 1
    assert "kernel level" in str(report)
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan  # the riders' spans too
    # Every rider runs from its first host's start to its last host's end in the simulation.
    runs = {r.action: r for r in result.sim.runs}
    for rider, hosts in plan.hosts_of().items():
        assert (runs[rider].start_s, runs[rider].end_s) == (runs[hosts[0]].start_s, runs[hosts[-1]].end_s)


def _phased_actions(plan):
    """Every encoder forward first and every encoder backward last on each rank, the LLM's order
    kept in between."""
    llm = plan.stages[-1].group
    out = []
    for acts in plan.actions:
        enc = [a for a in acts if plan.stages[a.stage].group != llm]
        out.append(
            tuple(a for a in enc if a.kind.value == "F")
            + tuple(a for a in acts if plan.stages[a.stage].group == llm)
            + tuple(a for a in enc if a.kind.value == "B")
        )
    return tuple(out)


def test_a_memory_budget_is_kept_by_recomputing_the_encoder_first(demo_bubbles, demo_graph):
    """Below the fastest plan's peak the pass recomputes, the encoder alone before the LLM's
    selective recompute (its activations are the ones this pass holds longest)."""
    request, result = demo_bubbles
    fastest_peak = max(result.sim.peak_mem_bytes)
    assert result.report.recompute == "none"
    for share in (0.9, 0.8, 0.7, 0.6, 0.5):
        budget = share * fastest_peak
        lean = bubbles(demo_graph, CLUSTER, request, solver=FAST, memory_budget_bytes=budget)
        assert max(lean.sim.peak_mem_bytes) <= budget
        assert lean.sim.step_time_s >= result.sim.step_time_s * (1 - 1e-9)
        if lean.report.recompute != "none":
            assert lean.report.recompute == "none + vision"
            break
    else:
        raise AssertionError("half the fastest plan's memory still needed no recompute")
    with pytest.raises(PlanError, match=r"no encoder plan fits in the memory budget \(0.0 GiB per rank\)"):
        bubbles(demo_graph, CLUSTER, request, solver=FAST, memory_budget_bytes=1024.0)
    with pytest.raises(PlanError, match="memory_budget_bytes=0; give a positive number"):
        bubbles(demo_graph, CLUSTER, request, solver=FAST, memory_budget_bytes=0)


@pytest.mark.slow
@pytest.mark.extended  # outside CI's 15 minutes (the README's test command runs it)
def test_a_budget_between_selective_and_full_recompute_recomputes_a_share_of_each_ranks_layers():
    # Optimus-Model-A at weak-A: its LLM's activations, not the encoder's, fill the memory.
    setup = SETUPS["optimus-weak-A"]
    graph, cluster, request = zoo_layer_graph(setup.model), Cluster.preset(setup.cluster), setup.request()
    solver = SolverOptions(time_limit_s=4, workers=2)
    budget = 36 * 2**30
    lean = bubbles(graph, cluster, request, solver=solver, memory_budget_bytes=budget)
    assert max(lean.sim.peak_mem_bytes) <= budget
    assert lean.report.recompute.startswith("selective + vision + full on the first")
    full = bubbles(
        graph,
        cluster,
        request,
        solver=solver,
        memory_budget_bytes=budget,
        recompute=GlobalRecompute(granularity=Recompute.FULL, vision=True),
    )
    assert lean.sim.step_time_s < full.sim.step_time_s
    shares = set()
    for rank in range(request.parallel.pp):
        layers = [n for s in lean.plan.stages if s.group == ep.LLM_GROUP and s.rank == rank for n in s.layers]
        fully = [lean.plan.recompute.get(n) is Recompute.FULL for n in layers]
        assert fully == sorted(fully, reverse=True), "the rank's first layers are the recomputed ones"
        shares.add(sum(fully) / len(layers))
    assert 0 < min(shares) and max(shares) < 1


def test_a_frozen_encoder_runs_forwards_only_in_the_bubbles_and_costs_less(demo_bubbles, demo_graph):
    request, trained = demo_bubbles
    frozen_graph = demo_graph.with_frozen(["vision"])
    result = bubbles(
        frozen_graph, CLUSTER, request, solver=FAST, encoder_plans=[ep.EncoderPlan(pp=2, tp=1, chunks=1)]
    )
    plan = result.plan
    plan.validate(frozen_graph)
    no_gradient = frozen_graph.forward_only()
    forward_only = {s.index for s in plan.stages if set(s.layers) <= no_gradient}
    assert forward_only and plan.forward_only_stages() == forward_only
    assert not [a for acts in plan.actions for a in acts if a.stage in forward_only and a.kind is not bs.F]
    # No vision backward, no vision weight gradient to reduce: a shorter step than training it.
    assert result.report.step_s < trained.report.step_s
    assert result.report.step_s == pytest.approx(simulate(plan, frozen_graph, CLUSTER).step_time_s)


def test_a_frozen_encoder_runs_the_next_batchs_forwards_in_this_steps_bubbles():
    """Optimus' single-node setup with its vision tower frozen (its projector trains, in the LLM's
    first stage): with the encoder forwards a batch ahead the LLM's first forwards wait for no
    encoder, and the step comes within 2 % of the same LLM alone."""
    setup = SETUPS["optimus-single-node"]
    graph = zoo_layer_graph(setup.model).with_frozen(["vision"])
    cluster, request = Cluster.preset(setup.cluster), setup.request()
    ahead = bubbles(graph, cluster, request, solver=SolverOptions(time_limit_s=2, workers=2))
    without = bubbles(
        graph, cluster, request, solver=SolverOptions(time_limit_s=2, workers=2, run_ahead=False)
    )
    plan = ahead.plan
    plan.validate(graph)
    assert plan.run_ahead == 1 and plan.ahead and not without.plan.ahead
    assert all(graph[n].region is Region.PROJECTOR for n in plan.stages[1].layers[:1]), (
        "the trainable projector leaves the frozen encoder's stage"
    )
    assert Reason.RUN_AHEAD in {d.reason for d in plan.decisions}
    assert ahead.sim.step_time_s < without.sim.step_time_s
    assert ahead.sim.step_time_s <= 1.02 * ahead.report.llm_alone_step_s
    assert ahead.sim.step_time_s == pytest.approx(simulate(plan, graph, cluster).step_time_s)
    # The LLM alone the pass measures against keeps none of the encoder's run-ahead forwards
    # (renumbered from stage 0 they would name LLM stages and skip their dependencies).
    alone = llm_stages_of(plan)
    assert not alone.ahead and alone.run_ahead == 0
    assert ahead.report.own_llm_alone_step_s == pytest.approx(simulate(alone, graph, cluster).step_time_s)
