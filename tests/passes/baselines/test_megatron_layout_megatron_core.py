"""Our exported ``--pipeline-model-parallel-layout`` strings, parsed by megatron-core 0.16's own
``PipelineParallelLayerLayout``: the same decoder layers, embedding and loss on every (pipeline
rank, virtual stage) as our plan."""

import warnings

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.passes.baselines.megatron import megatron
from vlmcompile.planning.megatron_layout import megatron_layout
from vlmcompile.planning.model_parts import model_parts
from vlmcompile.planning.request import PlanRequest


@pytest.fixture(scope="module")
def megatron_core():
    """megatron-core's layer types and layout parser, imported by the worker that runs this file
    only (2 s of imports, not every worker's collection)."""
    with warnings.catch_warnings():  # no Transformer Engine / Apex here: it says so and falls back
        warnings.simplefilter("ignore")
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    return LayerType, PipelineParallelLayerLayout


CLUSTER = Cluster.preset("h100x16")


@pytest.mark.parametrize(
    ("pp", "v", "first", "last"),
    [
        (2, 1, None, None),
        (4, 1, None, None),
        (8, 1, None, None),
        (2, 2, None, None),
        (2, 4, None, None),
        (4, 2, None, None),
        (4, 1, 1, 3),
        (4, 1, 5, None),
        (2, 1, None, 2),
        (4, 2, 2, 2),
    ],
)
def test_megatron_core_parses_our_layout_to_our_stages(megatron_core, demo_graph, pp, v, first, last):
    LayerType, PipelineParallelLayerLayout = megatron_core  # noqa: N806 (megatron-core's names)
    request = PlanRequest.on(CLUSTER, tp=2, pp=pp, v=v, global_batch=16)
    plan = megatron(demo_graph, CLUSTER, request, first_stage_layers=first, last_stage_layers=last).plan
    layout, note = megatron_layout(plan, demo_graph)
    assert layout is not None, note
    parsed = PipelineParallelLayerLayout(layout, pipeline_model_parallel_size=pp)
    assert parsed.virtual_pipeline_model_parallel_size == v
    decoder = model_parts(demo_graph).decoder
    parsed.validate_layer_layout(num_layers=len(decoder), mtp_num_layers=0)
    for stage in plan.stages:
        theirs = parsed.layout[stage.rank][stage.index // pp]
        assert stage.rank == stage.index % pp
        assert theirs.count(LayerType.decoder) == sum(n in decoder for n in stage.layers), stage
        assert (LayerType.embedding in theirs) == ("llm.embed" in stage.layers)
        assert (LayerType.loss in theirs) == (stage.index == plan.num_stages - 1)
