"""Policies side by side: ours is planned after every baseline and never simulates slower, and
the solver on its own, proven optimal, is no slower than any baseline either."""

import dataclasses

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import usable_memory_bytes
from vlmcompile.passes.baselines.mimo_colocated import mimo_colocated
from vlmcompile.passes.planning.partition import partition
from vlmcompile.passes.planning.policies import (
    BASELINES,
    POLICIES,
    _least_recompute_that_fits,
    compare_baselines,
    plan_and_simulate,
)
from vlmcompile.planning.request import GlobalRecompute, NotApplicable, PlanRequest, SolverOptions


@pytest.mark.parametrize("graph_name", ["demo_graph", "two_encoder_graph"])
@pytest.mark.parametrize("pp,v", [(2, 1), (4, 1), (2, 2)])
def test_ours_is_never_slower_than_a_baseline_that_fits(graph_name, pp, v, request):
    graph = request.getfixturevalue(graph_name)
    cluster = Cluster.preset("h100x8")
    run = plan_and_simulate(
        graph,
        cluster,
        "vlmcompile",
        PlanRequest.on(cluster, tp=1, pp=pp, v=v, global_batch=16),
        solver=SolverOptions(time_limit_s=5),
    )
    assert {r.policy for r in run.baselines} == set(BASELINES)
    assert run.fits
    for row in run.baselines:
        if row.step_s is not None and row.fits:
            assert run.sim.step_time_s <= row.step_s * (1 + 1e-9), row
    assert "vs ours" in run.comparison_table()


@pytest.mark.parametrize("graph_name", ["demo_graph", "two_encoder_graph"])
@pytest.mark.parametrize("pp,v", [(2, 1), (4, 1), (2, 2)])
def test_the_solver_alone_beats_or_ties_every_baseline_it_can_express(graph_name, pp, v, request):
    """Without the baselines' plans to start from. At DP = 1 the timeline model's step is the
    simulator's, so a proven optimum over cuts and full recompute is no slower than any
    baseline whose plan is such a choice (every one here: none needs recompute on H100s)."""
    graph = request.getfixturevalue(graph_name)
    cluster = Cluster.preset(f"h100x{pp}")
    plan_request = PlanRequest.on(cluster, tp=1, pp=pp, v=v, global_batch=8)
    ours = partition(graph, cluster, plan_request, solver=SolverOptions(time_limit_s=60, timeline_share=1.0))
    solution = ours.report.solution
    assert solution.status == "OPTIMAL" and solution.objective == "timeline", solution.summary()
    assert solution.objective_s == pytest.approx(ours.sim.step_time_s, rel=1e-4)
    _, rows = compare_baselines(graph, cluster, plan_request)
    planned = [r for r in rows if r.step_s is not None]
    assert planned and all(r.recompute in ("none", "per layer (0)") for r in planned), rows
    for row in planned:
        assert ours.sim.step_time_s <= row.step_s * (1 + 1e-4), row


def test_a_policy_that_cannot_express_the_request_says_n_a_and_why_in_full(demo_graph):
    cluster = Cluster.preset("h100x8")
    request = PlanRequest.on(cluster, tp=1, pp=2, global_batch=16)
    _, rows = compare_baselines(demo_graph, cluster, request)
    mimo = next(r for r in rows if r.policy == "mimo_colocated")
    assert not mimo.applies and mimo.fits_text == "n/a" and mimo.step_s is None
    with pytest.raises(NotApplicable) as refused:
        mimo_colocated(demo_graph, cluster, request)
    assert mimo.note == str(refused.value)  # whole: the source's hash and the advice included
    run = plan_and_simulate(demo_graph, cluster, "vlmcompile", request, solver=SolverOptions(time_limit_s=2))
    table = run.comparison_table()
    line = next(x for x in table.splitlines() if x.startswith("mimo_colocated"))
    assert line.split()[1:5] == ["-", "-", "-", "n/a"]
    assert "".join(mimo.note.split()) in "".join(table.split())
    # At PP = 1 the colocated layout applies and has a figure like every other policy.
    _, at_pp1 = compare_baselines(demo_graph, cluster, PlanRequest.on(cluster, tp=1, pp=1, global_batch=16))
    assert all(r.applies and r.step_s is not None for r in at_pp1), at_pp1


def test_every_baseline_that_cannot_split_the_layers_says_n_a(demo_graph):
    """16 stages for the demo's 8 decoder layers: Megatron (even split, or a chain of 12 layers)
    and torchtitan cannot express it; the balanced split and OmniBal can."""
    cluster = Cluster.preset("h100x16")
    _, rows = compare_baselines(demo_graph, cluster, PlanRequest.on(cluster, tp=1, pp=16, global_batch=16))
    by_policy = {r.policy: r for r in rows}
    assert {p for p, r in by_policy.items() if not r.applies} == {
        "megatron",
        "torchtitan_vlm",
        "mimo_colocated",
    }
    assert "llava: " in by_policy["megatron"].note and "chain: " in by_policy["megatron"].note
    assert by_policy["omnibal"].applies and by_policy["omnibal"].step_s is not None


def test_a_policy_whose_plan_does_not_fit_says_no_not_n_a(demo_graph):
    cluster = Cluster.preset("h100x8")
    tiny = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, mem_bytes=2**20))
    _, rows = compare_baselines(demo_graph, tiny, PlanRequest.on(tiny, tp=1, pp=2, global_batch=16))
    applying = [r for r in rows if r.policy != "mimo_colocated"]
    assert all(r.applies and r.fits_text == "no" for r in applying), applying


def test_the_registry_says_what_each_policy_takes_and_runs(demo_graph):
    from vlmcompile.ir.errors import ArgumentError
    from vlmcompile.ir.plan import Reason
    from vlmcompile.passes.planning.policies import POLICIES

    assert BASELINES == ("megatron", "megatron_balanced", "omnibal", "torchtitan_vlm", "mimo_colocated")
    assert {n for n, p in POLICIES.items() if p.global_recompute} == {
        "megatron",
        "megatron_balanced",
        "torchtitan_vlm",
        "mimo_colocated",
    }
    cluster = Cluster.preset("h100x8")
    request = PlanRequest.on(cluster, tp=1, pp=2, global_batch=16)
    for name, policy in POLICIES.items():  # every option a policy does not take is refused by name
        if "solver" not in policy.options:
            with pytest.raises(ArgumentError, match=f"policy '{name}' does not take solver"):
                plan_and_simulate(demo_graph, cluster, name, request, solver=SolverOptions())
    with pytest.raises(ArgumentError, match="choose one of megatron, megatron_balanced, omnibal"):
        plan_and_simulate(demo_graph, cluster, "megatorn", request)
    # "vlmcompile" is what it runs: the partition, then the encoder-in-bubbles pass, which beats it
    # here; "partition" is the first alone, with the same comparison.
    solver = SolverOptions(time_limit_s=2)
    chain = plan_and_simulate(demo_graph, cluster, "partition", request, solver=solver)
    ours = plan_and_simulate(demo_graph, cluster, "vlmcompile", request, solver=solver)
    assert not any(d.reason is Reason.BUBBLE_SCHEDULE for d in chain.plan.decisions)
    assert any(d.reason is Reason.BUBBLE_SCHEDULE for d in ours.plan.decisions)
    assert ours.sim.step_time_s < chain.sim.step_time_s
    assert [r.policy for r in ours.baselines] == [r.policy for r in chain.baselines] == list(BASELINES)


@pytest.mark.parametrize("policy", ["megatron", "megatron_balanced"])
@pytest.mark.parametrize("share", [1.0, 0.5, 0.3, 0.05])
def test_the_least_recompute_judged_by_memory_alone_is_the_one_timed_each(demo_graph, policy, share):
    """The memory-first ladder (a setting's plan built, its peak read, only the chosen one
    timed) picks the plan and step the ladder of simulated plans picks, on a device whose memory
    makes it climb (``share``: of the peak without recompute)."""
    roomy = Cluster.preset("h100x8")
    request = PlanRequest.on(roomy, tp=1, pp=2, v=2, global_batch=16)
    whole = plan_and_simulate(
        demo_graph, roomy, policy, request, recompute=GlobalRecompute(granularity="none")
    )
    device = dataclasses.replace(
        roomy.device, mem_bytes=share * max(whole.sim.peak_mem_bytes) / usable_memory_bytes(1.0)
    )
    cluster = dataclasses.replace(roomy, device=device)
    fast = plan_and_simulate(demo_graph, cluster, policy, request)
    chosen = POLICIES[policy]
    timed = _least_recompute_that_fits(
        lambda rung: chosen.run(demo_graph, cluster, request, recompute=rung),
        usable_memory_bytes(device.mem_bytes),
    )
    assert fast.recompute == timed.recompute
    assert fast.plan == timed.plan
    assert fast.sim.step_time_s == timed.sim.step_time_s
    assert fast.plan.decisions[-1] == timed.plan.decisions[-1]  # the same settings tried, the same bytes
    assert (fast.recompute == "none") == (share == 1.0)  # below the peak without recompute it climbs


def test_a_baseline_whose_plan_is_ours_is_marked_and_the_report_says_so():
    """Where our partition finds nothing better than a baseline's plan, the comparison says that
    the two are one plan (not only a 1.000 ratio)."""
    import dataclasses

    from vlmcompile.compiler import zoo_layer_graph
    from vlmcompile.cost_models.cluster import Cluster
    from vlmcompile.passes.planning.policies import compare_baselines, mark_same_plans
    from vlmcompile.planning.request import PlanRequest

    graph = zoo_layer_graph("tiny")
    cluster = Cluster.preset("h100x8")
    request = PlanRequest.on(cluster, tp=1, pp=2, global_batch=8)
    runs, rows = compare_baselines(graph, cluster, request)
    theirs = runs[0]
    marked = mark_same_plans(rows, runs, theirs.plan)
    same = [r.policy for r in marked if r.same_as_ours]
    assert theirs.plan.policy in same
    assert all(theirs.plan.same_layout(r.plan) for r in runs if r.plan.policy in same)
    ours = dataclasses.replace(theirs, baselines=marked)
    text = str(ours)
    assert "the same plan as ours" in ours.comparison_table()
    assert f"our plan is {' and '.join(same)}'s plan" in text
    # A plan no baseline made marks none of them.
    other = dataclasses.replace(theirs.plan, microbatch_size=theirs.plan.microbatch_size + 1)
    assert not any(r.same_as_ours for r in mark_same_plans(rows, runs, other))
