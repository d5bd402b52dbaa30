"""Schedules against their closed forms (identical stages, free communication) and validity."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.sim_helpers import make_plan, synthetic_costs
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.actions import ActionKind
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.placement import Placement
from vlmcompile.planning.schedules import (
    gpipe,
    interleaved_one_f_one_b,
    make_schedule,
    one_f_one_b,
    v_one_f_one_b,
    zero_bubble,
)
from vlmcompile.sim.simulator import simulate

CLUSTER = Cluster.preset("h100x8")
times = st.floats(min_value=0.1, max_value=10.0, allow_nan=False)


def _run(actions, num_stages, t_f, t_b, v=1, **kw):
    plan = make_plan(actions, num_stages, v=v)
    plan.validate()
    costs = synthetic_costs(plan, [t_f / v] * num_stages, [t_b / v] * num_stages, **kw)
    return plan, simulate(plan, None, CLUSTER, costs=costs)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 24), t_f=times, t_b=times)
def test_1f1b_step_and_bubble_match_the_closed_form(p, m, t_f, t_b):
    _, result = _run(one_f_one_b(p, m), p, t_f, t_b)
    assert result.step_time_s == pytest.approx((m + p - 1) * (t_f + t_b))
    assert result.bubble_share == pytest.approx((p - 1) / (m + p - 1))
    # every idle second of a uniform pipeline is warm-up, cool-down or in-between waiting
    share = result.idle_share()
    assert max(share["tp_comm"], share["dp_all_gather"], share["dp_reduce_scatter"]) < 1e-12


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 24), t_f=times, t_b=times)
def test_gpipe_step_matches_the_closed_form(p, m, t_f, t_b):
    _, result = _run(gpipe(p, m), p, t_f, t_b)
    assert result.step_time_s == pytest.approx((m + p - 1) * (t_f + t_b))


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), groups=st.integers(1, 4), v=st.integers(2, 4), t_f=times, t_b=times)
def test_interleaved_bubble_is_p_minus_1_over_v_m_of_the_ideal_time(p, groups, v, t_f, t_b):
    m = p * groups  # Megatron's interleaved schedule runs microbatches in groups of p
    _, result = _run(interleaved_one_f_one_b(p, m, v), p * v, t_f, t_b, v=v)
    ideal = m * (t_f + t_b)
    assert (result.step_time_s - ideal) / ideal == pytest.approx((p - 1) / (v * m))


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 24))
def test_1f1b_stage_s_holds_min_p_minus_s_m_microbatches_at_its_peak(p, m):
    _, result = _run(one_f_one_b(p, m), p, 1.0, 2.0, act_bytes=1.0)
    assert [r.peak_mem_bytes for r in result.ranks] == [min(p - s, m) for s in range(p)]


def test_gpipe_holds_every_microbatch():
    _, result = _run(gpipe(4, 6), 4, 1.0, 2.0)
    assert [r.peak_mem_bytes for r in result.ranks] == [6] * 4


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 16))
def test_zero_bubble_is_valid_and_beats_1f1b_when_weight_gradients_can_fill_bubbles(p, m):
    t_f, t_i, t_w = 1.0, 1.0, 1.0
    zb, zb_result = _run(zero_bubble(p, m), p, t_f, t_i + t_w, weight_grad_s=[t_w] * p)
    assert all(a.kind in (ActionKind.F, ActionKind.I, ActionKind.W) for acts in zb.actions for a in acts)
    _, base = _run(one_f_one_b(p, m), p, t_f, t_i + t_w)
    assert zb_result.step_time_s <= base.step_time_s + 1e-9
    if p > 1 and m >= p:
        assert zb_result.step_time_s < base.step_time_s
    # 1F1B's memory bound: at most p - r microbatches in flight on rank r
    assert all(r.peak_mem_bytes <= p - r.rank for r in zb_result.ranks)


def test_interleaved_needs_microbatches_in_groups_of_p():
    with pytest.raises(PlanError, match="not a multiple of pp=4; use 4 or 8"):
        interleaved_one_f_one_b(4, 6, 2)


def test_bad_sizes_are_rejected():
    with pytest.raises(PlanError, match=">= 1 microbatch"):
        one_f_one_b(4, 0)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 24))
def test_v_shaped_1f1b_is_valid_no_slower_than_1f1b_and_holds_at_most_twice_its_activations(p, m):
    # The same model work per rank: a chunk is half a 1F1B stage (forward 0.5, backward 1).
    stages = 2 * p
    times = {ActionKind.F: (0.5,) * stages, ActionKind.B: (1.0,) * stages}
    plan = make_plan(v_one_f_one_b(Placement(p, 2, "v"), m, times), stages, v=2, placement="v")
    plan.validate()
    assert [s.rank for s in plan.stages] == [*range(p), *reversed(range(p))]
    v_shaped = simulate(plan, None, CLUSTER, costs=synthetic_costs(plan, [0.5] * stages, [1.0] * stages))
    _, base = _run(one_f_one_b(p, m), p, 1.0, 2.0, act_bytes=2.0)
    assert v_shaped.step_time_s <= base.step_time_s + 1e-9
    assert max(r.peak_mem_bytes for r in v_shaped.ranks) <= 2 * max(r.peak_mem_bytes for r in base.ranks)


def test_schedules_that_need_the_loop_placement_refuse_a_v_shaped_one():
    with pytest.raises(PlanError, match="'interleaved_1f1b' runs the loop placement"):
        make_schedule("interleaved_1f1b", Placement(2, 2, "v"), 4)
    with pytest.raises(PlanError, match="v_1f1b runs a V-shaped placement; this one is 'loop'"):
        make_schedule("v_1f1b", Placement(2, 2), 4)


def test_zero_bubble_refuses_several_stages_per_rank():
    # Its bound on microbatches in flight would run them nearly one at a time there.
    for placement in (Placement(3, 2, "v"), Placement(3, 2)):
        with pytest.raises(
            PlanError, match="'zero_bubble' runs one stage per rank; with v=2 use interleaved_1f1b"
        ):
            zero_bubble(placement, 6)
