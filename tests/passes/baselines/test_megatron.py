"""Megatron-LM baselines: where the layers go, the layout string, the balancing DP against
brute force, and the errors for splits Megatron cannot make."""

import dataclasses

import pytest

from tests.models import needs_transformers
from vlmcompile import compile
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.stage_costs import layer_costs
from vlmcompile.ir.errors import ClusterError, PlanError
from vlmcompile.ir.plan import Reason, Recompute
from vlmcompile.ir.regions import Region
from vlmcompile.passes.baselines.megatron import megatron
from vlmcompile.passes.baselines.megatron_balanced import megatron_balanced
from vlmcompile.passes.planning.partition import partition
from vlmcompile.planning.megatron_layout import megatron_layout
from vlmcompile.planning.model_parts import model_parts
from vlmcompile.planning.request import GlobalRecompute, NotApplicable, PlanRequest, SolverOptions

CLUSTER = Cluster.preset("h100x16")


def test_encoder_projector_and_embedding_share_stage_0(demo_graph):
    plan = megatron(demo_graph, CLUSTER, PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=16)).plan
    stage0 = plan.stages[0].layers
    for layer in demo_graph.in_region(Region.VISION, Region.PROJECTOR):
        assert layer.name in stage0
    assert "llm.embed" in stage0
    decoder = model_parts(demo_graph).decoder
    assert [sum(n in decoder for n in s.layers) for s in plan.stages] == [2, 2, 2, 2]
    assert plan.stages[-1].layers[-2:] == ("llm.norm", "head")
    assert [d.reason for d in plan.decisions][:2] == [Reason.ENCODER_ON_FIRST_STAGE, Reason.EVEN_SPLIT]
    assert plan.schedule == "1f1b" and plan.num_microbatches == 16 // (2 * 1)


def test_interleaved_places_virtual_stage_k_on_rank_k_mod_pp(demo_graph):
    plan = megatron(demo_graph, CLUSTER, PlanRequest.on(CLUSTER, tp=2, pp=2, v=2, global_batch=16)).plan
    assert plan.schedule == "interleaved_1f1b"
    assert [s.rank for s in plan.stages] == [0, 1, 0, 1]
    layout, note = megatron_layout(plan, demo_graph)
    assert layout == "Ett|tt|tt|ttL" and note == ""


def test_first_and_last_stage_counts(demo_graph):
    result = megatron(
        demo_graph,
        CLUSTER,
        PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=16),
        first_stage_layers=1,
        last_stage_layers=3,
    )
    assert result.report.layout == "Et|tt|tt|tttL"
    reasons = {d.reason for d in result.plan.decisions}
    assert {Reason.FIRST_STAGE_LAYERS, Reason.LAST_STAGE_LAYERS} <= reasons


def test_global_recompute_and_vision_switch(demo_graph):
    plan = megatron(
        demo_graph,
        CLUSTER,
        PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=16),
        recompute=GlobalRecompute(granularity="full", vision=True),
    ).plan
    decoder = model_parts(demo_graph).decoder
    assert all(plan.recompute_of(n) is Recompute.FULL for n in decoder)
    assert plan.recompute_of("encoders.0.blocks.0") is Recompute.FULL
    assert plan.recompute_of("llm.embed") is Recompute.NONE
    selective = megatron(
        demo_graph,
        CLUSTER,
        PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=16),
        recompute=GlobalRecompute(granularity="selective"),
    ).plan
    assert selective.recompute_of(decoder[0]) is Recompute.SELECTIVE
    assert selective.recompute_of("encoders.0.blocks.0") is Recompute.NONE


def _transformer_layers_per_stage(plan, layer_graph):
    chained = {Region.VISION, Region.LLM}
    return [
        sum(layer_graph[n].block and layer_graph[n].region in chained for n in s.layers) for s in plan.stages
    ]


def test_chain_splits_encoder_and_decoder_layers_as_one_chain(demo_graph):
    result = megatron(
        demo_graph, CLUSTER, PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=16), placement="chain"
    )
    plan = result.plan
    # 4 ViT + 8 decoder layers over 4 stages; the projector and the LLM embedding go with the
    # next transformer layer, the final norm and head with the last.
    assert _transformer_layers_per_stage(plan, demo_graph) == [3, 3, 3, 3]
    assert plan.stages[0].layers == ("encoders.0.embed", *(f"encoders.0.blocks.{i}" for i in range(3)))
    assert {"projectors.0", "llm.embed", "llm.blocks.0", "llm.blocks.1"} <= set(plan.stages[1].layers)
    assert plan.stages[-1].layers[-2:] == ("llm.norm", "head")
    assert any(d.reason is Reason.CHAIN_SPLIT for d in plan.decisions)
    assert (
        result.report.layout is None
        and "vision encoder on the first pipeline stage" in result.report.layout_note
    )


def test_chain_gives_the_remainder_to_the_first_stages(demo_graph):
    plan = megatron(
        demo_graph, CLUSTER, PlanRequest.on(CLUSTER, tp=2, pp=4, v=2, global_batch=16), placement="chain"
    ).plan
    assert _transformer_layers_per_stage(plan, demo_graph) == [2, 2, 2, 2, 1, 1, 1, 1]
    assert [s.rank for s in plan.stages] == [0, 1, 2, 3, 0, 1, 2, 3]
    split = next(d for d in plan.decisions if d.reason is Reason.CHAIN_SPLIT)
    assert "2 on the first 4 and 1 on the other 4" in split.detail


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"placement": "ring"},
            r"Megatron encoder placement 'ring' is unknown; choose one of llava, chain, uneven",
        ),
        (
            {"placement": "chain", "v": 4},
            r"placement 'chain' splits 12 encoder and decoder layers over pp x v = 4 x 4 = 16 virtual stages",
        ),
        ({"placement": "uneven"}, r"placement 'uneven' needs first_stage_layers"),
        ({"placement": "llava", "first_stage_layers": 1}, r"are the 'uneven' placement's"),
    ],
)
def test_placements_refuse_what_they_cannot_do(demo_graph, options, message):
    v = options.pop("v", 1)
    with pytest.raises(PlanError, match=message):
        megatron(demo_graph, CLUSTER, PlanRequest.on(CLUSTER, tp=2, pp=4, v=v, global_batch=16), **options)


def test_hfu_counts_the_recomputed_forward(demo_graph):
    request = PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=16)
    none = megatron(demo_graph, CLUSTER, request).sim
    assert none.hfu == pytest.approx(none.mfu)
    full = megatron(demo_graph, CLUSTER, request, recompute=GlobalRecompute(granularity="full")).sim
    decoder = model_parts(demo_graph).decoder
    fwd = sum(demo_graph[n].fwd_flops for n in decoder)
    fwd_bwd = sum(
        demo_graph[n].fwd_flops + demo_graph[n].bwd_flops for n in (layer.name for layer in demo_graph.layers)
    )
    # Full recompute runs every decoder layer's forward twice: HFU / MFU is that share more.
    assert full.hfu / full.mfu == pytest.approx(1 + fwd / fwd_bwd)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"tp": 2, "pp": 3}, ClusterError, r"tp x pp = 2 x 3 = 6 does not divide the 16 GPUs"),
        (
            {"tp": 2, "pp": 2, "v": 3},
            PlanError,
            r"8 decoder layers do not split evenly over pp x v = 2 x 3 = 6",
        ),
        (
            {"tp": 2, "pp": 4, "global_batch": 15},
            PlanError,
            r"global batch 15 is not a multiple of dp x microbatch",
        ),
        ({"tp": 2, "pp": 4, "first_stage_layers": 3}, PlanError, r"leave 5 for the 3 other pipeline stages"),
    ],
)
def test_splits_megatron_cannot_make_are_refused(demo_graph, kwargs, error, message):
    split = {k: kwargs.pop(k) for k in ("first_stage_layers", "last_stage_layers") if k in kwargs}
    with pytest.raises(error, match=message):
        megatron(demo_graph, CLUSTER, PlanRequest.on(CLUSTER, **({"global_batch": 16} | kwargs)), **split)


def test_balanced_plan_spreads_the_encoder_and_says_why_megatron_cannot(demo_graph):
    result = megatron_balanced(demo_graph, CLUSTER, PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=16))
    plan = result.plan
    assert any(layer.startswith("encoders") for layer in plan.stages[1].layers)
    assert result.report.layout is None
    assert "vision encoder on the first pipeline stage only" in result.report.layout_note
    balanced = next(d for d in plan.decisions if d.reason is Reason.BALANCED)
    request = PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=16)
    even = megatron(demo_graph, CLUSTER, request)
    # The decision's slowest stage is the cost model's, and slower stages are what the even
    # split of decoder layers leaves: the encoder weighs on its first stage.
    costs = {c.name: c for c in layer_costs(demo_graph, CLUSTER, request.parallel, microbatch_size=1)}

    def slowest(p):
        return max(sum(costs[n].f_s + costs[n].b_s for n in s.layers) for s in p.stages)

    assert balanced.numbers["max_stage_s"] == pytest.approx(slowest(plan), rel=1e-9)
    assert slowest(plan) < 0.9 * slowest(even.plan)
    assert result.sim.step_time_s < even.sim.step_time_s


def test_two_encoders_are_linearised_and_reported(two_encoder_graph):
    cluster = Cluster.preset("h100x2")
    plan = megatron_balanced(
        two_encoder_graph, cluster, PlanRequest.on(cluster, tp=1, pp=2, global_batch=4)
    ).plan
    assert any(d.reason is Reason.LINEARISED_BRANCHES for d in plan.decisions)


def test_too_many_virtual_stages_for_the_layers(demo_graph):
    with pytest.raises(PlanError, match="every stage needs a layer"):
        megatron_balanced(demo_graph, CLUSTER, PlanRequest.on(CLUSTER, tp=2, pp=4, v=6, global_batch=16))


def test_zero_bubble_schedule_gets_the_stages_real_times(demo_graph):
    cluster = Cluster.preset("h100x8")
    plan = megatron_balanced(
        demo_graph, cluster, PlanRequest.on(cluster, tp=1, pp=4, global_batch=8, schedule="zero_bubble")
    ).plan
    assert plan.split_backward() == frozenset(range(4))
    with pytest.raises(
        PlanError, match="'zero_bubble' runs one stage per rank; with v=2 use interleaved_1f1b"
    ):
        megatron(
            demo_graph,
            cluster,
            PlanRequest.on(cluster, tp=1, pp=2, v=2, global_batch=8, schedule="zero_bubble"),
        )
    with pytest.raises(PlanError, match="'1f1b' runs one stage per rank; with v=2 use interleaved_1f1b"):
        megatron(
            demo_graph, cluster, PlanRequest.on(cluster, tp=1, pp=2, v=2, global_batch=8, schedule="1f1b")
        )


def test_megatron_has_no_v_shaped_placement(demo_graph):
    cluster = Cluster.preset("h100x8")
    request = PlanRequest.on(cluster, tp=1, pp=2, v=2, global_batch=8, placement="v")
    assert request.schedule_name.value == "v_1f1b"
    with pytest.raises(NotApplicable, match="no 'v' placement"):
        megatron(demo_graph, cluster, request)


@needs_transformers
@pytest.mark.hf
def test_decoder_layers_are_found_by_structure_whatever_the_attention_kernel():
    from vlmcompile import families

    # Eager attention is matmul + softmax: no attention kernel for the FLOP counter to see.
    model, batch = families.build_tiny("llava", attn_implementation="eager")
    graph = compile(model, batch, log=None).layer_graph
    llm_blocks = [layer.name for layer in graph.layers if layer.region is Region.LLM and layer.block]
    assert llm_blocks == ["model.language_model.layers.0", "model.language_model.layers.1"]
    assert all(graph[name].fwd_attn_flops == 0 for name in llm_blocks)
    assert model_parts(graph).decoder == tuple(llm_blocks)
    run = megatron(
        graph, Cluster.preset("cpu:2"), PlanRequest.on(Cluster.preset("cpu:2"), tp=1, pp=2, global_batch=2)
    )
    assert run.report.layout == "Et|tL"


def test_the_layout_export_never_fails_a_plan(demo_graph):
    # No layer is a block: Megatron's split has nothing to split, but a plan that is not
    # Megatron's is still made, and only the optional layout says why it is missing.
    flat = dataclasses.replace(
        demo_graph, layers=tuple(dataclasses.replace(x, block=False) for x in demo_graph.layers)
    )
    with pytest.raises(PlanError, match="no LLM decoder layers"):
        model_parts(flat)
    result = partition(
        flat,
        Cluster.preset("h100x8"),
        PlanRequest.on(Cluster.preset("h100x8"), tp=1, pp=2, global_batch=8),
        solver=SolverOptions(time_limit_s=2),
    )
    layout, note = megatron_layout(result.plan, flat)
    assert layout is None and "no LLM decoder layers" in note
