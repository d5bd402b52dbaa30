"""An encoder plan beside the LLM's: which plans spread over the LLM's GPUs, which ranks hold each
encoder stage, and how microbatches are dealt to the encoder pipelines."""

import pytest

from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Parallel
from vlmcompile.planning import encoder_plans as ep

LLM = Parallel(dp=2, tp=4, pp=4)


def test_an_encoder_plan_spreads_over_the_llms_gpus():
    plan = ep.EncoderPlan(pp=2, tp=2)
    plan.check_against(LLM, microbatch_size=2)
    assert plan.parallel(LLM).dp == 2 * 4 * 4 // (2 * 2)
    assert plan.pipelines(LLM) == 2 and plan.holders(1, LLM) == (1, 3)
    with pytest.raises(PlanError, match="encoder PP=3 does not divide the LLM's PP=4"):
        ep.EncoderPlan(pp=3, tp=1).check_against(LLM, 2)
    with pytest.raises(PlanError, match="cannot share a microbatch of 1 samples evenly"):
        ep.EncoderPlan(pp=1, tp=2).check_against(LLM, 1)


@pytest.mark.parametrize(("m", "pipelines", "counts"), [(5, 2, None), (6, 3, [1, 2, 3]), (4, 4, None)])
def test_microbatches_are_dealt_round_robin_in_the_counts_asked(m, pipelines, counts):
    dealt = ep.pipeline_of_microbatch(m, pipelines, counts)
    expected = counts or [m // pipelines + (k < m % pipelines) for k in range(pipelines)]
    assert [dealt.count(k) for k in range(pipelines)] == expected
    firsts = [dealt.index(k) for k in range(pipelines) if k in dealt]
    assert firsts == sorted(firsts) and max(firsts) < pipelines  # every pipeline starts early
    with pytest.raises(PlanError, match="must give 5 microbatches to 2 encoder pipelines"):
        ep.pipeline_of_microbatch(5, 2, [1, 1])


def test_the_encoder_layers_lead_the_demo_and_cut_into_balanced_pieces(demo_graph):
    count = ep.encoder_layer_count(demo_graph)
    names = [layer.name for layer in demo_graph.layers]
    assert names[count - 1] == "projectors.0" and names[count] == "llm.embed"
    pieces = ep.encoder_chunks(demo_graph, ep.EncoderPlan(pp=2, tp=1, chunks=2), [1.0] * count)
    assert [len(p) for p in pieces] == [2, 2] and [n for part in pieces for p in part for n in p] == names[
        :count
    ]
    with pytest.raises(PlanError, match="needs 16 encoder pieces, but the model has 7 encoder layers"):
        ep.encoder_chunks(demo_graph, ep.EncoderPlan(pp=2, tp=1, chunks=8), [1.0] * count)
