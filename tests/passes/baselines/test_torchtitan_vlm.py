"""torchtitan's VLM split: its layer arithmetic, the encoder on stage 0, the tuned knob."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Reason
from vlmcompile.ir.regions import Region
from vlmcompile.passes.baselines.torchtitan_vlm import titan_layer_counts, torchtitan_vlm
from vlmcompile.planning.model_parts import model_parts
from vlmcompile.planning.request import PlanRequest

CLUSTER = Cluster.preset("h100x16")


@pytest.mark.parametrize(
    ("args", "counts"),
    [
        # What torchtitan's _generate_llm_fqn_per_model_part returned for these (run at b5bcd76c).
        ((32, 4, 1, 1), [8, 9, 8, 7]),
        ((32, 8, 1, 1), [4, 5, 4, 4, 4, 4, 4, 3]),
        ((32, 4, 3, 1), [6, 9, 9, 8]),
        ((28, 4, 2, 1), [6, 8, 8, 6]),
        ((28, 8, 1, 1), [3, 4, 4, 4, 4, 4, 3, 2]),
    ],
)
def test_layer_counts_are_torchtitans(args, counts):
    assert titan_layer_counts(*args) == counts


@given(layers=st.integers(1, 200), stages=st.integers(2, 64), first=st.integers(0, 6), last=st.integers(0, 6))
def test_layer_counts_keep_every_layer_or_refuse(layers, stages, first, last):
    base = (layers + first + last) // stages
    if base == 0 or first > base or last > base:
        with pytest.raises(PlanError):
            titan_layer_counts(layers, stages, first, last)
        return
    counts = titan_layer_counts(layers, stages, first, last)
    assert sum(counts) == layers and len(counts) == stages and min(counts) >= 0


def test_weight_above_the_minimum_stage_is_refused_with_the_range():
    with pytest.raises(PlanError, match=r"first_stage_less_layers=5 is outside torchtitan's range 0..4"):
        titan_layer_counts(32, 8, 5, 1)


def test_encoder_on_stage_0_and_the_knob_tuned_to_the_fastest(demo_graph):
    result = torchtitan_vlm(demo_graph, CLUSTER, PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=16))
    plan, report = result.plan, result.report
    for layer in demo_graph.in_region(Region.VISION, Region.PROJECTOR):
        assert layer.name in plan.stages[0].layers
    assert plan.stages[-1].layers[-2:] == ("llm.norm", "head")
    # 8 decoder layers + 1 + 1 over 4 stages: torchtitan accepts 0, 1 and 2.
    assert [k for k, _, _ in report.tried] == [0, 1, 2]
    fastest = min(s for _, s, fits in report.tried if fits)
    assert result.sim.step_time_s == pytest.approx(fastest)
    decoder = set(model_parts(demo_graph).decoder)
    counts = [sum(n in decoder for n in s.layers) for s in plan.stages]
    assert counts == titan_layer_counts(8, 4, report.first_stage_less_layers, 1)
    assert any(d.reason is Reason.TUNED_KNOB for d in plan.decisions)
    assert "pipeline_parallel_first_stage_less_layers" in str(report)


def test_a_given_knob_is_used_as_is(demo_graph):
    request = PlanRequest.on(CLUSTER, tp=2, pp=2, v=2, global_batch=16)
    result = torchtitan_vlm(demo_graph, CLUSTER, request, first_stage_less_layers=2)
    decoder = set(model_parts(demo_graph).decoder)
    assert [sum(n in decoder for n in s.layers) for s in result.plan.stages] == [
        1,
        3,
        3,
        1,
    ]  # E = 8 + 2 + 1 = 11: 3, 3, 3, 2 less 2 and 1
    assert [s.rank for s in result.plan.stages] == [0, 1, 0, 1]
    assert result.plan.schedule == "interleaved_1f1b"
