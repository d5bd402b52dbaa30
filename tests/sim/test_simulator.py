"""The simulator against an independent reference (longest paths in the action DAG), its
bubble accounting, and the trace and PNG it exports."""

import dataclasses

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.sim_helpers import bubble_plan_with_tp, make_plan, rider_and_host, synthetic_costs
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.stage_costs import plan_costs
from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.regions import Region
from vlmcompile.passes.baselines.megatron import megatron
from vlmcompile.planning.request import PlanRequest
from vlmcompile.planning.schedules import gpipe, interleaved_one_f_one_b, one_f_one_b, zero_bubble
from vlmcompile.sim.simulator import CAUSES, simulate

CLUSTER = Cluster.preset("h100x8")


def reference_schedule(plan, fwd, bwd, wgt, send):
    """Start time of every action = longest path to it in the DAG of rank order and data
    dependencies (edge weights: the producer's duration plus the transfer to another rank)."""
    rank_of = {s.index: s.rank for s in plan.stages}
    kinds = {a.kind for acts in plan.actions for a in acts}
    grad = ActionKind.I if ActionKind.I in kinds else ActionKind.B

    def needs(a):
        # Written here, not imported: the forward of stage s needs stage s-1's forward; a
        # backward needs its own forward and stage s+1's input gradient; W needs its I.
        s, mb = a.stage, a.microbatch
        if a.kind is ActionKind.F:
            return [Action(s - 1, ActionKind.F, mb)] if s else []
        if a.kind is ActionKind.W:
            return [Action(s, ActionKind.I, mb)]
        return [Action(s, ActionKind.F, mb)] + ([Action(s + 1, grad, mb)] if s + 1 < plan.num_stages else [])

    def duration(a):
        k = a.stage
        return {
            ActionKind.F: fwd[k],
            ActionKind.B: bwd[k],
            ActionKind.I: bwd[k] - wgt[k],
            ActionKind.W: wgt[k],
        }[a.kind]

    g = nx.DiGraph()
    for acts in plan.actions:
        for a in acts:
            g.add_node(a)
        for a, b in zip(acts, acts[1:]):
            g.add_edge(a, b, w=duration(a))
    for acts in plan.actions:
        for a in acts:
            for d in needs(a):
                hop = send[d.stage] if rank_of[d.stage] != rank_of[a.stage] else 0.0
                w = duration(d) + hop
                if not g.has_edge(d, a) or g[d][a]["w"] < w:
                    g.add_edge(d, a, w=w)
    start = {}
    for a in nx.topological_sort(g):
        start[a] = max([start[p] + g[p][a]["w"] for p in g.predecessors(a)], default=0.0)
    end = {a: start[a] + duration(a) for a in start}
    step = max(end.values())
    busy = [sum(duration(a) for a in acts) for acts in plan.actions]
    return step, [step - b for b in busy]


@st.composite
def random_plans(draw):
    kind = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zero_bubble"]))
    p = draw(st.integers(1, 4))
    v = draw(st.integers(2, 3)) if kind == "interleaved" else 1
    m = p * draw(st.integers(1, 3)) if kind == "interleaved" else draw(st.integers(1, 6))
    acts = {
        "gpipe": lambda: gpipe(p, m),
        "1f1b": lambda: one_f_one_b(p, m),
        "interleaved": lambda: interleaved_one_f_one_b(p, m, v),
        "zero_bubble": lambda: zero_bubble(p, m),
    }[kind]()
    n = p * v
    t = st.floats(0.1, 5.0, allow_nan=False)
    fwd = [draw(t) for _ in range(n)]
    bwd = [draw(t) for _ in range(n)]
    wgt = [b * draw(st.floats(0.0, 0.9)) for b in bwd] if kind == "zero_bubble" else [0.0] * n
    send = [draw(st.floats(0.0, 1.0)) for _ in range(n)]
    return make_plan(acts, n, v=v), fwd, bwd, wgt, send


@settings(max_examples=80, deadline=None)
@given(case=random_plans())
def test_step_and_idle_time_agree_with_the_reference(case):
    plan, fwd, bwd, wgt, send = case
    result = simulate(
        plan, None, CLUSTER, costs=synthetic_costs(plan, fwd, bwd, weight_grad_s=wgt, send_s=send)
    )
    step, idle = reference_schedule(plan, fwd, bwd, wgt, send)
    assert result.step_time_s == pytest.approx(step)
    assert [sum(r.idle_s.values()) for r in result.ranks] == pytest.approx(idle, abs=1e-9)
    for r in result.ranks:
        assert r.busy_s + sum(r.idle_s.values()) == pytest.approx(result.step_time_s)
        assert all(v >= 0 for v in r.idle_s.values())


def test_a_real_plan_accounts_for_every_second_on_every_rank(demo_run):
    for r in demo_run.ranks:
        assert r.busy_s > 0
        assert r.busy_s + sum(r.idle_s[c] for c in CAUSES) == pytest.approx(demo_run.step_time_s)
    share = demo_run.idle_share()
    assert share["tp_comm"] > 0  # TP=2: every block all-reduces
    assert share["pp_warmup"] > 0 and share["pp_cooldown"] > 0
    assert 0 < demo_run.mfu < 1
    assert "simulated step" in str(demo_run) and "prediction" in str(demo_run)


def test_more_microbatches_shrink_warmup_and_cooldown(demo_graph):
    # Megatron's stage 0 carries the whole encoder, so waits in the steady phase (pp_other)
    # grow with the microbatches; warm-up and cool-down are paid once and shrink in share.
    cluster = Cluster.preset("h100x16")
    shares = []
    for batch in (8, 32):
        plan = megatron(demo_graph, cluster, PlanRequest.on(cluster, tp=2, pp=4, global_batch=batch)).plan
        result = simulate(plan, demo_graph, cluster)
        s = result.idle_share()
        shares.append(s["pp_warmup"] + s["pp_cooldown"])
    assert shares[1] < shares[0]


def test_a_kernel_level_encoder_action_shares_its_hosts_interval(demo_graph):
    cluster, plan = bubble_plan_with_tp(demo_graph)
    fused, rider, host = rider_and_host(plan)
    assert fused.hosts_of() == {rider: (host,)}
    costs = plan_costs(fused, demo_graph, cluster)
    sim = simulate(fused, demo_graph, cluster, costs=costs)
    runs = {r.action: r for r in sim.runs}
    r, h = runs[rider], runs[host]
    assert (r.start_s, r.end_s) == (h.start_s, h.end_s) and r.inside == host
    host_cost, rider_cost = costs.stages[host.stage], costs.stages[rider.stage]
    g_host, g_rider = host_cost.tp_comm_s(host.kind), rider_cost.tp_comm_s(rider.kind)
    c_rider = rider_cost.compute_s(rider.kind)
    own = host_cost.action_s(host.kind) + h.dp_wait_s
    assert g_host > 0  # TP = 2: the host has communication gaps
    expected = max(own + max(0.0, c_rider - g_host), g_host + g_rider)
    assert h.end_s - h.start_s == pytest.approx(expected)
    # The riders' compute counts as busy; busy and idle still add up to the step on every rank.
    for stats in sim.ranks:
        assert stats.busy_s + sum(stats.idle_s.values()) == pytest.approx(sim.step_time_s)


def test_the_step_alone_is_the_full_simulations_step_and_memory(demo_graph):
    # What per-batch re-planning times its candidates with: simulate less its report.
    from vlmcompile.sim.simulator import simulate_step

    cluster, plan = bubble_plan_with_tp(demo_graph)
    fused, rider, _ = rider_and_host(plan)
    costs = plan_costs(fused, demo_graph, cluster)
    for case in (fused, dataclasses.replace(fused, kernel_level={rider: 2}), plan):
        for work in (None, [(2.5, 1.0), (0.0, 0.5)] * (case.num_microbatches // 2)):
            case_costs = costs if case is fused else plan_costs(case, demo_graph, cluster)
            full = simulate(case, demo_graph, cluster, costs=case_costs, work=work)
            step, peaks = simulate_step(case, demo_graph, cluster, costs=case_costs, work=work)
            assert (step, peaks) == (full.step_time_s, full.peak_mem_bytes)


def test_a_rider_spanning_two_hosts_runs_from_the_first_ones_start_to_the_seconds_end(demo_graph):
    cluster, plan = bubble_plan_with_tp(demo_graph)
    fused, rider, host = rider_and_host(plan)
    wide = dataclasses.replace(fused, kernel_level={rider: 2})
    wide.validate()
    first, second = wide.hosts_of()[rider]
    assert first == host
    costs = plan_costs(wide, demo_graph, cluster)
    sim = simulate(wide, demo_graph, cluster, costs=costs)
    runs = {r.action: r for r in sim.runs}
    assert (runs[rider].start_s, runs[rider].end_s) == (runs[first].start_s, runs[second].end_s)
    # The first host gives the rider what its gap holds for its compute and its compute for the
    # rider's collectives; the second runs the rest.
    rider_cost, first_cost = costs.stages[rider.stage], costs.stages[first.stage]
    c_rider, g_rider = rider_cost.compute_s(rider.kind), rider_cost.tp_comm_s(rider.kind)
    share = min(1.0, first_cost.tp_comm_s(first.kind) / c_rider, first_cost.compute_s(first.kind) / g_rider)
    assert share < 1  # the case this test is about
    assert runs[first].rider_compute_s == pytest.approx(share * c_rider, rel=1e-6)
    assert runs[first].rider_compute_s + runs[second].rider_compute_s == pytest.approx(c_rider)
    for stats in sim.ranks:
        assert stats.busy_s + sum(stats.idle_s.values()) == pytest.approx(sim.step_time_s)


def test_a_kernel_level_backward_frees_its_activations_after_its_last_host(demo_graph):
    cluster, plan = bubble_plan_with_tp(demo_graph)
    fused, rider, host = rider_and_host(plan, ActionKind.B)
    costs = plan_costs(fused, demo_graph, cluster)
    layer_level = simulate(dataclasses.replace(fused, kernel_level={}), demo_graph, cluster, costs=costs)
    spanning = dataclasses.replace(fused, kernel_level={rider: 2})
    spanning.validate()
    last = spanning.hosts_of()[rider][-1]
    # The same list with the backward placed after its last host holds what the rider holds.
    acts = list(fused.actions[1])
    acts.remove(rider)
    acts.insert(acts.index(last) + 1, rider)
    moved = dataclasses.replace(fused, actions=(fused.actions[0], tuple(acts)), kernel_level={})
    held = simulate(moved, demo_graph, cluster, costs=costs).peak_mem_bytes[1]
    assert simulate(spanning, demo_graph, cluster, costs=costs).peak_mem_bytes[1] == pytest.approx(held)
    assert held >= layer_level.peak_mem_bytes[1]


def test_kernel_level_marks_that_cannot_run_are_refused(demo_graph):
    _, plan = bubble_plan_with_tp(demo_graph)
    fused, rider, host = rider_and_host(plan)
    with pytest.raises(PlanError, match="is marked kernel-level, but it is the pipeline's own work"):
        dataclasses.replace(fused, kernel_level={host: 1}).validate()
    last = plan.actions[1][-1]
    if plan.stages[last.stage].group != plan.stages[-1].group:
        with pytest.raises(PlanError, match="spans 1 LLM action.s., but rank 1 has 0 after it"):
            dataclasses.replace(plan, kernel_level={last: 1}).validate()
    with pytest.raises(PlanError, match="too few hosts"):
        dataclasses.replace(fused, kernel_level={rider: 10_000}).validate()
    with pytest.raises(PlanError, match="spans 0 LLM action"):
        dataclasses.replace(fused, kernel_level={rider: 0}).validate()
    with pytest.raises(PlanError, match="kernel-level action 0F99 is in no rank's action list"):
        dataclasses.replace(fused, kernel_level={Action.from_str("0F99"): 1}).validate()


def test_a_microbatchs_work_scales_its_encoder_and_llm_layers_apart(demo_graph):
    """Variable data: each microbatch's encoder-side and LLM-side layers scale by its own factors;
    factors of one change nothing."""
    from tests.pipeline_helpers import even_plan
    from vlmcompile.cost_models.cluster import Cluster
    from vlmcompile.ir.regions import ENCODER_SIDE
    from vlmcompile.sim.simulator import simulate

    cluster = Cluster.preset("h100x2")
    plan = even_plan(demo_graph, pp=2, global_batch=4)
    base = simulate(plan, demo_graph, cluster)
    same = simulate(plan, demo_graph, cluster, work=[(1.0, 1.0)] * 4)
    assert same.step_time_s == base.step_time_s
    first = plan.stages[0]
    assert any(demo_graph[name].region in ENCODER_SIDE for name in first.layers)
    heavy = simulate(plan, demo_graph, cluster, work=[(3.0, 1.0)] + [(1.0, 1.0)] * 3)
    light = simulate(plan, demo_graph, cluster, work=[(0.0, 1.0)] * 4)
    assert light.step_time_s < base.step_time_s < heavy.step_time_s
    for sim in (heavy, light):  # busy time is the scaled compute: busy and idle add up to the step
        for stats in sim.ranks:
            assert stats.busy_s + sum(stats.idle_s.values()) == pytest.approx(sim.step_time_s)
    assert sum(r.busy_s for r in light.ranks) < sum(r.busy_s for r in base.ranks)
    runs = {(r.action.stage, r.action.kind.name, r.action.microbatch): r for r in heavy.runs}
    base_runs = {(r.action.stage, r.action.kind.name, r.action.microbatch): r for r in base.runs}
    last = len(plan.stages) - 1  # no encoder layer there: its actions keep their time
    assert runs[last, "F", 0].end_s - runs[last, "F", 0].start_s == pytest.approx(
        base_runs[last, "F", 0].end_s - base_runs[last, "F", 0].start_s
    )
    span = runs[0, "F", 0].end_s - runs[0, "F", 0].start_s
    assert span > base_runs[0, "F", 0].end_s - base_runs[0, "F", 0].start_s


def test_a_plan_whose_action_lists_are_lists_is_timed_like_its_tuples(demo_graph):
    # The simulator keeps a layout per action lists across calls: a plan built with lists (not
    # hashable) must still be timed, and alike.
    from tests.pipeline_helpers import even_plan
    from vlmcompile.cost_models.cluster import Cluster

    cluster = Cluster.preset("h100x2")
    plan = even_plan(demo_graph, pp=2, global_batch=4)
    listed = dataclasses.replace(plan, actions=[list(acts) for acts in plan.actions])
    assert (
        simulate(listed, demo_graph, cluster).step_time_s == simulate(plan, demo_graph, cluster).step_time_s
    )


def test_a_frozen_encoder_costs_its_forward_only_and_mfu_counts_the_work_that_runs(demo_graph):
    from tests.pipeline_helpers import even_plan

    frozen_graph = demo_graph.with_frozen(["vision"])
    cluster = Cluster.preset("cpu:2")
    cuts = [next(i for i, layer in enumerate(demo_graph.layers) if layer.region.value != "vision")]
    trained = even_plan(demo_graph, pp=2, global_batch=4, cuts=cuts)
    frozen = even_plan(frozen_graph, pp=2, global_batch=4, cuts=cuts)
    assert frozen.forward_only_stages() == {0} and not trained.forward_only_stages()
    a, b = simulate(trained, demo_graph, cluster), simulate(frozen, frozen_graph, cluster)
    costs = plan_costs(frozen, frozen_graph, cluster)
    # Stage 0 (the vision encoder alone) keeps nothing, sends no gradient back, takes no backward.
    assert costs.stages[0].act_bytes == 0 and costs.stages[1].send_bwd_s == 0
    assert b.ranks[0].peak_mem_bytes < a.ranks[0].peak_mem_bytes
    assert b.step_time_s < a.step_time_s
    # MFU: the frozen encoder's backward FLOPs do not run, so they are not counted.
    vision = demo_graph.in_region(Region.VISION)
    saved = 4 * sum(layer.bwd_flops for layer in vision)
    assert plan_costs(trained, demo_graph, cluster).model_flops - costs.model_flops == pytest.approx(saved)


@settings(max_examples=60, deadline=None)
@given(case=random_plans(), data=st.data())
def test_each_ranks_peak_is_its_fullest_pattern_at_the_first_step_holding_it(case, data):
    """The simulator reads each rank's distinct in-flight patterns once per schedule and prices
    them per cost model: the same peak, and the same first step at it, as every action walked."""
    from vlmcompile.sim.in_flight import in_flight, pattern_bytes

    plan, fwd, bwd, wgt, send = case
    base = synthetic_costs(plan, fwd, bwd, weight_grad_s=wgt, send_s=send)
    sizes = st.integers(0, 3).map(float)  # small integers: ties, where the first step must win
    for _ in range(2):  # a second cost model on the same schedule reads the kept patterns
        stages = tuple(
            dataclasses.replace(s, act_bytes=data.draw(sizes), transient_bytes=data.draw(sizes))
            for s in base.stages
        )
        costs = dataclasses.replace(base, stages=stages)
        ranks = simulate(plan, None, CLUSTER, costs=costs).ranks
        keep, transient = [s.act_bytes for s in stages], [s.transient_bytes for s in stages]
        for rank, acts in enumerate(plan.actions):
            held = [pattern_bytes(p, keep, transient) for p in in_flight(acts)]
            peak = max(held, default=0.0)
            assert ranks[rank].peak_mem_bytes - ranks[rank].static_bytes == peak
            assert ranks[rank].peak_step == (held.index(peak) if peak > 0 else 0)
