"""The LLM alone at a plan's degrees, and with the encoders' dependencies: the bounds no plan of the
VLM at those degrees beats."""

import dataclasses
import random

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.stage_costs import layer_costs
from vlmcompile.ir.actions import Action, execution_order
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.regions import ENCODER_SIDE
from vlmcompile.passes.planning.bubbles import bubbles
from vlmcompile.passes.planning.policies import plan_and_simulate
from vlmcompile.planning.llm_alone_bound import (
    dependency_bound,
    encoder_cost_recovered,
    encoder_delays,
    llm_alone_plan,
    llm_alone_step_s,
    llm_graph,
    placement_bound,
)
from vlmcompile.planning.request import PlanRequest, SolverOptions
from vlmcompile.sim.simulator import simulate

CLUSTER = Cluster.preset("h100x16")


def test_the_llm_graph_is_the_llm_side_layers_in_order(demo_graph):
    graph = llm_graph(demo_graph)
    kept = [layer.name for layer in demo_graph.layers if layer.region not in ENCODER_SIDE]
    assert [layer.name for layer in graph.layers] == kept
    assert [layer.index for layer in graph.layers] == list(range(len(kept)))
    assert all(src in kept and dst in kept for src, dst, _ in graph.edges)


@pytest.mark.parametrize(("tp", "pp", "v"), [(2, 4, 1), (1, 4, 2), (2, 1, 1)])
def test_no_baseline_at_the_same_degrees_beats_the_llm_alone(demo_graph, tp, pp, v):
    request = PlanRequest.on(CLUSTER, tp=tp, pp=pp, v=v, global_batch=32)
    policies = ["megatron", "megatron_balanced"] if pp > 1 else ["mimo_colocated"]
    bounds = set()
    for policy in policies:
        run = plan_and_simulate(demo_graph, CLUSTER, policy, request)
        alone = llm_alone_plan(run.plan, demo_graph, CLUSTER)
        par = alone.pipeline_parallel
        assert (par.dp, par.tp, par.pp, par.v) == (request.parallel.dp, tp, pp, v)
        assert alone.num_microbatches == run.plan.num_microbatches and alone.schedule == run.plan.schedule
        bound = llm_alone_step_s(run.plan, demo_graph, CLUSTER)
        assert 0 < bound < run.sim.step_time_s
        assert dependency_bound(alone, demo_graph, CLUSTER).step_s < run.sim.step_time_s
        bounds.add(round(bound, 12))
    assert len(bounds) == 1, "the bound depends on the degrees, not on the policy"


def test_the_share_recovered_runs_from_the_baseline_to_the_bound():
    assert encoder_cost_recovered(ours_s=1.0, baseline_s=1.0, llm_alone_s=0.8) == 0.0
    assert encoder_cost_recovered(ours_s=0.8, baseline_s=1.0, llm_alone_s=0.8) == 1.0
    assert encoder_cost_recovered(ours_s=0.9, baseline_s=1.0, llm_alone_s=0.8) == pytest.approx(0.5)
    assert encoder_cost_recovered(ours_s=1.1, baseline_s=1.0, llm_alone_s=0.8) < 0


FAST = SolverOptions(time_limit_s=4, workers=2)


@pytest.mark.parametrize(
    ("cluster", "tp", "pp", "v", "frozen"),
    [
        ("cpu:2", 1, 2, 1, False),
        ("h100x4", 2, 2, 1, False),
        ("h100x4", 1, 2, 2, False),
        ("h100x4", 2, 2, 1, True),
    ],
)
def test_no_schedule_the_bubble_pass_tries_beats_the_dependency_bound(demo_graph, cluster, tp, pp, v, frozen):
    """Every schedule the pass simulated (phased, list, CP-SAT at its optimum where it proves one,
    kernel level) takes at least the bound; the bound is above the LLM's actions alone by the
    encoder work at the two ends."""
    cluster = Cluster.preset(cluster)
    graph = demo_graph.with_frozen(["vision"]) if frozen else demo_graph
    request = PlanRequest.on(cluster, tp=tp, pp=pp, v=v, global_batch=8)
    result = bubbles(graph, cluster, request, solver=FAST)
    report = result.report
    bound = report.dependency_bound
    steps = [report.step_s, report.phased_step_s]
    steps += [s for r in report.rows for s in (r.greedy_step_s, r.solved_step_s) if s is not None]
    assert len(steps) > 3
    assert min(steps) >= bound.step_s * (1 - 1e-9)
    assert bound.step_s <= report.step_s
    # Where the step goes past the plan's own LLM stages alone adds up to the difference (the
    # start is not held to the bound's head: the LLM alone waits for its parameters' all-gather
    # at the start too, which the encoder's first forwards overlap).
    delays = report.delays
    assert delays.total_s == pytest.approx(report.step_s - report.own_llm_alone_step_s, abs=1e-12)
    assert delays.start_s >= 0
    if not frozen and request.parallel.dp == 1:  # no all-gather for the encoder to overlap
        assert delays.start_s >= bound.first_head_s * (1 - 1e-9)
    assert "over its own LLM stages alone" in str(report)
    # No schedule of the chosen placement beats its placement bound: not the pass's, not the
    # phased one, not others made from the pass's by moving encoder work.
    placed = report.placement_bound
    assert (
        max(bound.llm_span_s, 0.0) <= placed.step_s <= min(report.step_s, report.phased_step_s) * (1 + 1e-9)
    )
    assert "simulated, no schedule with each action on its rank here ends sooner than" in str(report)
    others = _reordered(result.plan, random.Random(len(steps)))
    assert len(others) >= 3
    for plan in others:
        assert simulate(plan, graph, cluster).step_time_s >= placed.step_s * (1 - 1e-9)
    if frozen:
        # The tower's forwards may run a batch ahead, and no gradient goes below the projector.
        trained = bubbles(demo_graph, cluster, request, solver=FAST).report.dependency_bound
        assert bound.head_s < trained.head_s and bound.tail_s < trained.tail_s
    else:
        assert 0 < bound.head_s < bound.tail_s  # a backward costs more than its forward
        assert bound.step_s >= bound.llm_span_s + bound.head_s
        # The encoder work at the two ends runs with its TP collectives: nothing hides them there.
        assert bound.step_s >= (bound.llm_span_s + bound.last_tail_s) * (1 - 1e-9)
        widened = (bound.first_head_s > bound.head_s, bound.last_tail_s > bound.tail_s)
        assert widened == ((True, True) if tp > 1 else (False, False))


def _reordered(plan, rng: random.Random, tries: int = 12) -> list:
    """Other schedules of ``plan``'s placement: its kernel-level work at layer level, and encoder
    actions moved past a neighbouring LLM action at random (those that deadlock left out)."""
    out = []
    llm = {s.index for s in plan.stages if s.group == "llm"}
    for k in range(tries):
        lists = []
        for acts in plan.actions:
            acts = list(acts)
            for j in range(len(acts) - 1):
                if k and (acts[j].stage in llm) != (acts[j + 1].stage in llm) and rng.random() < 0.3:
                    acts[j], acts[j + 1] = acts[j + 1], acts[j]
            lists.append(tuple(acts))
        other = dataclasses.replace(plan, actions=tuple(lists), kernel_level={})
        order, _ = execution_order(other.actions, other.num_stages, other.split_backward(), {}, other.ahead)
        if len(order) == sum(len(a) for a in other.actions):
            out.append(other)
    return out


@pytest.mark.parametrize(
    ("schedule", "v", "ends_whole"),
    [("1f1b", 1, True), ("interleaved_1f1b", 2, True), ("zero_bubble", 1, False)],
)
def test_the_encoder_work_at_the_ends_counts_its_tp_collectives(demo_graph, schedule, v, ends_whole):
    """Before the LLM's first action and after its last no LLM action runs to hide the encoder's
    TP collectives in: the bound counts them there, and only there. A zero-bubble schedule ends
    on weight gradients, after which the encoder's backward may still ride inside LLM actions."""
    request = PlanRequest.on(CLUSTER, tp=2, pp=4, v=v, global_batch=32, schedule=schedule)
    run = plan_and_simulate(demo_graph, CLUSTER, "megatron_balanced", request)
    alone = llm_alone_plan(run.plan, demo_graph, CLUSTER)
    bound = dependency_bound(alone, demo_graph, CLUSTER)
    assert bound.first_head_s > bound.head_s > 0  # every schedule here starts on one forward
    assert (bound.last_tail_s > bound.tail_s) == ends_whole
    if not ends_whole:
        assert bound.last_tail_s == bound.tail_s
    assert bound.step_s >= (bound.llm_span_s + bound.first_head_s) * (1 - 1e-9)
    assert bound.step_s < run.sim.step_time_s
    assert "the first LLM action waits" in str(bound)


def test_the_encoder_work_nothing_can_hide_is_the_first_forward_and_the_last_backward(demo_graph):
    """In a plan of the bubble pass, the encoder actions no LLM action can run beside are the
    forwards of the microbatch the LLM's first action reads and the backwards after its last."""
    from vlmcompile.planning.llm_alone_bound import _encoder_work_at_the_ends
    from vlmcompile.sim.timeline import complete_order

    cluster = Cluster.preset("h100x4")
    request = PlanRequest.on(cluster, tp=2, pp=2, v=1, global_batch=8)
    plan = bubbles(demo_graph, cluster, request, solver=FAST).plan
    llm = range(min(s.index for s in plan.stages if s.group == "llm"), plan.num_stages)
    order = complete_order(plan.actions, plan.num_stages, plan.split_backward(), plan.hosts_of(), plan.ahead)
    whole = _encoder_work_at_the_ends(plan, llm, order)
    llm_actions = [a for _, _, a in order if a.stage in llm]
    first, last = llm_actions[0], llm_actions[-1]
    assert (first.kind, last.kind, first.stage, last.stage) == ("F", "B", llm.start, llm.start)
    encoder = [s.index for s in plan.stages if s.index not in llm]
    assert whole == {Action(s, "F", first.microbatch) for s in encoder} | {
        Action(s, "B", last.microbatch) for s in encoder
    }


def test_the_placement_bound_refuses_a_plan_without_llm_stages(demo_graph):
    request = PlanRequest.on(CLUSTER, tp=2, pp=4, v=1, global_batch=32)
    run = plan_and_simulate(demo_graph, CLUSTER, "megatron_balanced", request)
    with pytest.raises(PlanError, match="LLM stages"):
        placement_bound(run.plan, run.sim, range(0), run.sim, lambda _d, _a: 0.0)


def test_an_encoder_nothing_trains_in_costs_the_bound_nothing(demo_graph):
    """With every encoder-side layer frozen (LLaVA's second stage with the projector frozen too),
    the encoders run a batch ahead and no gradient reaches them: the bound is the LLM's actions."""
    request = PlanRequest.on(CLUSTER, tp=2, pp=4, v=1, global_batch=32)
    run = plan_and_simulate(demo_graph, CLUSTER, "megatron_balanced", request)
    graph = demo_graph.with_frozen(["vision", "projector"])
    bound = dependency_bound(llm_alone_plan(run.plan, graph, CLUSTER), graph, CLUSTER)
    assert bound.head_s == bound.tail_s == 0
    assert bound.step_s == pytest.approx(bound.llm_span_s)
    trained = dependency_bound(llm_alone_plan(run.plan, demo_graph, CLUSTER), demo_graph, CLUSTER)
    assert trained.step_s > trained.llm_span_s
    # Without DP collectives the LLM's actions take no longer than the simulated LLM alone.
    assert trained.llm_span_s <= llm_alone_step_s(run.plan, demo_graph, CLUSTER) * (1 + 1e-9)


def test_two_towers_in_parallel_wait_for_the_longer_not_for_both(two_encoder_graph):
    """The tiny two-encoder model's towers both feed the LLM: a microbatch's encoder forward is
    the longer tower (with its projector), not the two in a row, which a plan could run on two
    ranks at once."""
    cluster = Cluster.preset("h100x4")
    request = PlanRequest.on(cluster, tp=1, pp=2, global_batch=8)
    run = plan_and_simulate(two_encoder_graph, cluster, "megatron_balanced", request)
    bound = dependency_bound(llm_alone_plan(run.plan, two_encoder_graph, cluster), two_encoder_graph, cluster)
    costs = layer_costs(
        two_encoder_graph, cluster, request.parallel, microbatch_size=run.plan.microbatch_size
    )
    forward = {layer.name: c.fwd_s for layer, c in zip(two_encoder_graph.layers, costs)}
    towers = [
        sum(s for name, s in forward.items() if name.startswith((f"encoders.{i}.", f"projectors.{i}")))
        for i in (0, 1)
    ]
    assert bound.head_s == pytest.approx(max(towers))
    assert bound.head_s < sum(towers)


def test_encoder_delays_refuse_a_plan_without_llm_stages(demo_graph):
    request = PlanRequest.on(CLUSTER, tp=2, pp=4, v=1, global_batch=32)
    run = plan_and_simulate(demo_graph, CLUSTER, "megatron_balanced", request)
    with pytest.raises(PlanError, match="LLM stages"):
        encoder_delays(run.sim, range(0), run.sim)
