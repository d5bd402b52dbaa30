"""From a policy's choices to a validated plan: stages where the placement puts them, the
request's schedule, an encoder plan's stages replicated over their holders."""

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.actions import ActionKind
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Reason, Recompute
from vlmcompile.planning import encoder_plans as ep
from vlmcompile.planning.build import build_plan, build_separate_plan
from vlmcompile.planning.request import PlanRequest

CLUSTER = Cluster.preset("h100x8")


def _chunks(layer_graph, stages):
    names = [layer.name for layer in layer_graph.layers]
    bounds = [k * len(names) // stages for k in range(stages + 1)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize(
    ("placement", "ranks", "schedule"),
    [("loop", [0, 1, 0, 1], "interleaved_1f1b"), ("v", [0, 1, 1, 0], "v_1f1b")],
)
def test_stages_sit_where_the_placement_says_and_run_its_schedule(demo_graph, placement, ranks, schedule):
    request = PlanRequest.on(CLUSTER, tp=1, pp=2, v=2, global_batch=16, placement=placement)
    plan = build_plan(
        demo_graph, CLUSTER, request, policy="test", chunks=_chunks(demo_graph, 4), recompute={}, decisions=[]
    )
    assert [s.rank for s in plan.stages] == ranks
    assert plan.schedule == schedule and plan.num_microbatches == 4
    assert plan.decisions[-1].reason is Reason.SCHEDULE and schedule in plan.decisions[-1].detail
    for rank, acts in enumerate(plan.actions):  # every action on the rank that holds its stage
        assert {plan.stages[a.stage].rank for a in acts} == {rank}


def test_a_plan_that_misses_a_layer_or_flags_an_unknown_one_is_refused(demo_graph):
    request = PlanRequest.on(CLUSTER, tp=1, pp=2, global_batch=16)
    chunks = _chunks(demo_graph, 2)
    with pytest.raises(PlanError, match="layers in no stage"):
        build_plan(
            demo_graph,
            CLUSTER,
            request,
            policy="t",
            chunks=[chunks[0], chunks[1][:-1]],
            recompute={},
            decisions=[],
        )
    with pytest.raises(PlanError, match="recompute flags for layers in no stage"):
        build_plan(
            demo_graph,
            CLUSTER,
            request,
            policy="t",
            chunks=chunks,
            recompute={"nope": Recompute.FULL},
            decisions=[],
        )


def test_an_encoder_plan_is_replicated_over_its_holders_and_phased_around_the_llm(demo_graph):
    request = PlanRequest.on(CLUSTER, tp=1, pp=2, global_batch=16)
    encoder = ep.EncoderPlan(pp=1, tp=1, chunks=2)
    count = ep.encoder_layer_count(demo_graph)
    names = [layer.name for layer in demo_graph.layers]
    plan = build_separate_plan(
        demo_graph,
        CLUSTER,
        request,
        encoder,
        policy="test",
        encoder_pieces=ep.encoder_chunks(demo_graph, encoder, [1.0] * count),
        llm_chunks=[names[count:12], names[12:]],
        recompute={},
        decisions=[],
    )
    assert [s.group for s in plan.stages] == ["encoder", "encoder", "llm", "llm"]
    assert [s.ranks for s in plan.stages[:2]] == [(0, 1), (0, 1)]
    assert plan.parallel["encoder"].dp == 8 and plan.parallel["llm"].dp == 4
    for acts in plan.actions:  # encoder forwards first, encoder backwards last (the phased order)
        groups = [(plan.stages[a.stage].group, a.kind) for a in acts]
        llm = [i for i, (g, _) in enumerate(groups) if g == "llm"]
        assert all(k is ActionKind.F for g, k in groups[: llm[0]]) and all(
            k is ActionKind.B for g, k in groups[llm[-1] + 1 :]
        )


def test_stages_no_gradient_reaches_get_forwards_only_and_a_plan_says_so(demo_graph):
    frozen = demo_graph.with_frozen(["vision"])
    request = PlanRequest.on(CLUSTER, tp=1, pp=2, v=2, global_batch=16)
    chunks = _chunks(frozen, 4)
    assert set(chunks[0]) <= frozen.forward_only() and not set(chunks[1]) <= frozen.forward_only()
    plan = build_plan(frozen, CLUSTER, request, policy="test", chunks=chunks, recompute={}, decisions=[])
    assert plan.forward_only_stages() == {0}
    kinds = {(a.stage, a.kind) for acts in plan.actions for a in acts}
    assert (0, ActionKind.F) in kinds and (0, ActionKind.B) not in kinds and (1, ActionKind.B) in kinds

    # Each plan checked against the other model: a backward where no gradient goes, none where one does.
    trained = build_plan(
        demo_graph, CLUSTER, request, policy="test", chunks=chunks, recompute={}, decisions=[]
    )
    with pytest.raises(PlanError, match="stage 0 has backward actions, but no gradient reaches its layers"):
        trained.validate(frozen)
    with pytest.raises(PlanError, match="stage 0 has no backward actions, but its layer .* needs one"):
        plan.validate(demo_graph)


def test_a_forward_only_stage_after_one_with_a_backward_is_refused(demo_graph):
    import dataclasses

    from vlmcompile.ir.actions import without_backward

    request = PlanRequest.on(CLUSTER, tp=1, pp=2, v=2, global_batch=16)
    plan = build_plan(
        demo_graph, CLUSTER, request, policy="test", chunks=_chunks(demo_graph, 4), recompute={}, decisions=[]
    )
    cut = dataclasses.replace(plan, actions=without_backward(plan.actions, frozenset({1})))
    with pytest.raises(PlanError, match="stage 1 has no backward actions, but stage 0 before it has"):
        cut.validate()
