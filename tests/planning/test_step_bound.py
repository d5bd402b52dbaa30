"""The step bounds against exhaustive search: no cut and recompute choice of a small random
problem, timed by the simulator's rules (:func:`~vlmcompile.planning.partition_problem.evaluate`), is
faster than the bound."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmcompile.ir.placement import Placement
from vlmcompile.ir.plan import Parallel
from vlmcompile.planning.candidate_bound import INTERLEAVED_SCAN_GROUPS, _held_per_rank, _held_per_stage
from vlmcompile.planning.partition_problem import PartitionProblem, evaluate
from vlmcompile.planning.request import PlanRequest
from vlmcompile.planning.schedules import make_schedule
from vlmcompile.planning.step_bound import (
    BoundLayer,
    MemoryLayer,
    StageMemory,
    bubbles_bound,
    chain_bound,
    least_peak_bytes,
    least_recompute_s,
    stage_cut_s,
)
from vlmcompile.sim.in_flight import fullest_moment, held_together


@st.composite
def problems(draw) -> PartitionProblem:
    p, v = draw(st.sampled_from([(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (3, 2)]))
    L = draw(st.integers(p * v, 8 if p * v <= 4 else 7))
    m = draw(st.sampled_from([p, 2 * p] if v > 1 else [1, 2, 3, 5, 8]))
    ints = st.integers(0, 40)
    fwd = [float(draw(ints)) for _ in range(L)]
    sometimes = draw(st.booleans())
    act = [float(draw(st.integers(1, 50))) for _ in range(L)]
    return PartitionProblem(
        names=tuple(f"l{i}" for i in range(L)),
        fwd_s=tuple(fwd),
        bwd_s=tuple(float(2 * f + draw(st.integers(0, 10))) for f in fwd),
        redo_s=tuple(fwd),
        act_bytes=tuple(act),
        act_bytes_recompute=tuple(float(draw(st.integers(1, 60))) for _ in act),
        transient_bytes=tuple(float(draw(st.integers(0, 20))) for _ in act),
        state_bytes=tuple(float(draw(st.integers(0, 100))) for _ in act),
        reduce_s=tuple(float(draw(st.integers(0, 30))) if sometimes else 0.0 for _ in range(L)),
        gather_s=tuple(float(draw(st.integers(0, 20))) if sometimes else 0.0 for _ in range(L)),
        send_fwd_s=tuple(tuple(float(draw(st.integers(0, 8))) for _ in range(L)) for _ in range(p * v - 1)),
        send_bwd_s=tuple(tuple(float(draw(st.integers(0, 8))) for _ in range(L)) for _ in range(p * v - 1)),
        recomputable=tuple(draw(st.booleans()) for _ in range(L)),
        num_ranks=p,
        v=v,
        num_microbatches=m,
        actions=make_schedule("interleaved_1f1b" if v > 1 else "1f1b", Placement(p, v), m),
        mem_cap_bytes=1e30,
    )


def layers_of(problem: PartitionProblem) -> list[BoundLayer]:
    return [
        BoundLayer(f, b, g, r)
        for f, b, g, r in zip(problem.fwd_s, problem.bwd_s, problem.gather_s, problem.reduce_s)
    ]


def every_plan(problem: PartitionProblem):
    L, S = problem.num_layers, problem.num_stages
    recomputable = [i for i in range(L) if problem.recomputable[i]]
    for cuts in itertools.combinations(range(1, L), S - 1):
        edges = (0, *cuts, L)
        stage_of = [k for k in range(S) for _ in range(edges[k], edges[k + 1])]
        for bits in itertools.product([False, True], repeat=len(recomputable)):
            flags = [False] * L
            for i, bit in zip(recomputable, bits):
                flags[i] = bit
            yield evaluate(problem, stage_of, flags)


def memory_layers_of(problem: PartitionProblem) -> list[MemoryLayer]:
    return [
        MemoryLayer(s, min(a, rc), a, redo) if can and rc < a else MemoryLayer(s, a)
        for s, a, rc, can, redo in zip(
            problem.state_bytes,
            problem.act_bytes,
            problem.act_bytes_recompute,
            problem.recomputable,
            problem.redo_s,
        )
    ]


def held_per_rank(problem: PartitionProblem) -> list[int]:
    placement = Placement(problem.num_ranks, problem.v)
    return [held_together(acts, placement.stages_on(r)) for r, acts in enumerate(problem.actions)]


@settings(max_examples=90, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_no_plan_beats_the_chain_bound_or_needs_less_memory_than_the_memory_bound(problem):
    plans = list(every_plan(problem))
    bound = chain_bound(layers_of(problem), p=problem.num_ranks, v=problem.v, m=problem.num_microbatches)
    assert bound.step_s <= min(e.step_s for e in plans) * (1 + 1e-9)
    memory = least_peak_bytes(
        memory_layers_of(problem), held_per_rank(problem), p=problem.num_ranks, v=problem.v
    )
    assert memory <= min(max(e.peak_bytes) for e in plans) * (1 + 1e-9)


def test_recompute_the_cap_forces_is_the_cheapest_per_byte_first():
    layers = [MemoryLayer(0.0, 1.0, 5.0, 2.0), MemoryLayer(0.0, 1.0, 3.0, 4.0), MemoryLayer(0.0, 7.0)]
    # One rank holding one microbatch: the layers keep 15 bytes whole, 9 at least.
    assert least_recompute_s(layers, [1], 15.0) == 0.0
    assert least_recompute_s(layers, [1], 13.0) == pytest.approx(1.0)  # half of the first
    assert least_recompute_s(layers, [1], 10.0) == pytest.approx(2.0 + 4.0 / 2)
    assert least_recompute_s(layers, [1], 8.0) == math.inf


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_the_split_backward_bound_is_no_larger(problem):
    # Zero-bubble's split backward may run the drain early: its bound leaves the drain out.
    args = dict(p=problem.num_ranks, v=problem.v, m=problem.num_microbatches)
    split = chain_bound(layers_of(problem), split_backward=True, **args)
    assert split.step_s <= chain_bound(layers_of(problem), **args).step_s * (1 + 1e-12)


def test_one_stage_per_rank_is_exact_on_uniform_layers():
    # 1F1B on equal stages: (m + p - 1) stage times, which the bound must reach, not only stay under.
    p, m = 4, 8
    layers = [BoundLayer(1.0, 2.0)] * 8
    bound = chain_bound(layers, p=p, v=1, m=m)
    assert bound.binding == "pipeline"
    assert bound.step_s == pytest.approx((m + p - 1) * 2 * 3.0, rel=1e-9)


def test_the_dp_tail_and_head_add_to_the_pipeline():
    layers = [BoundLayer(1.0, 2.0, gather_s=5.0, reduce_s=7.0)] + [BoundLayer(1.0, 2.0)] * 3
    plain = chain_bound([BoundLayer(1.0, 2.0)] * 4, p=1, v=1, m=2).step_s
    assert chain_bound(layers, p=1, v=1, m=2).step_s == pytest.approx(plain + 5.0 + 7.0)


def test_the_encoder_work_counts_in_the_bubbles_bound():
    llm = [BoundLayer(1.0, 2.0)] * 4
    alone = bubbles_bound(llm, 12.0, 0.0, p=2, v=1, m=4)
    heavy = bubbles_bound(llm, 12.0, 40.0, p=2, v=1, m=4)
    assert heavy.binding == "compute with the encoders"
    assert heavy.step_s == pytest.approx(4 * (12.0 + 40.0) / 2)
    assert alone.step_s == chain_bound(llm, p=2, v=1, m=4).step_s


@pytest.mark.parametrize("bad", [dict(p=0), dict(v=0), dict(m=0)])
def test_bad_degrees_are_refused(bad):
    args = dict(p=2, v=1, m=2) | bad
    with pytest.raises(ValueError, match="integer >= 1"):
        chain_bound([BoundLayer(1.0, 2.0)] * 2, **args)


def stage_memory_of(problem: PartitionProblem, cap: float) -> StageMemory:
    placement = Placement(problem.num_ranks, problem.v)
    held = [0] * problem.num_stages
    for r, acts in enumerate(problem.actions):
        stages = placement.stages_on(r)
        for k, n in zip(stages, fullest_moment(acts, stages)):
            held[k] = n
    return StageMemory(tuple(memory_layers_of(problem)), tuple(held), cap)


@settings(max_examples=45, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.floats(0.0, 1.0))
def test_no_plan_that_fits_a_cap_beats_the_bounds_it_gives(problem, where):
    # A cap between the least peak and the most: some plans fit, some need recompute to.
    plans = list(every_plan(problem))
    peaks = sorted(max(e.peak_bytes) for e in plans)
    cap = peaks[0] + where * (peaks[-1] - peaks[0])
    fastest_fitting = min(e.step_s for e in plans if max(e.peak_bytes) <= cap)
    args = dict(p=problem.num_ranks, v=problem.v, m=problem.num_microbatches)
    extra = least_recompute_s(memory_layers_of(problem), held_per_rank(problem), cap)
    assert math.isfinite(extra)
    assert chain_bound(layers_of(problem), recompute_s=extra, **args).step_s <= fastest_fitting * (1 + 1e-9)
    alone = stage_cut_s(layers_of(problem), **args)
    assert alone <= min(e.step_s for e in plans) * (1 + 1e-9)
    fitting = stage_cut_s(layers_of(problem), memory=stage_memory_of(problem, cap), **args)
    assert fitting <= fastest_fitting * (1 + 1e-9)


def test_the_stage_cut_bound_sees_whole_layers():
    # 4 layers on 4 stages of 2 ranks (v = 2): the cut is forced, and rank 1 holds the heavy last
    # layer and a light one, where the relaxed bound spreads the work over both ranks.
    layers = [BoundLayer(1.0, 2.0)] * 3 + [BoundLayer(10.0, 20.0)]
    m = 4
    relaxed = chain_bound(layers, p=2, v=2, m=m).step_s
    whole = stage_cut_s(layers, p=2, v=2, m=m)
    forced = 3.0 + m * (3.0 + 30.0)  # rank 1 waits for layer 0, then runs layers 1 and 3
    assert relaxed < forced
    assert whole == pytest.approx(forced, rel=1e-6)


@pytest.mark.parametrize("p, v", [(2, 2), (3, 2), (4, 3), (8, 2)])
def test_an_interleaved_schedule_holds_no_more_past_its_scanned_groups(p, v):
    # The candidate bounds scan INTERLEAVED_SCAN_GROUPS groups of p microbatches: the counts of a
    # longer schedule are the same.
    placement = Placement(p, v)
    for m in (INTERLEAVED_SCAN_GROUPS * p + p, 16 * p):
        acts = make_schedule("interleaved_1f1b", placement, m)
        every = [held_together(a, placement.stages_on(r)) for r, a in enumerate(acts)]
        request = PlanRequest(parallel=Parallel(dp=1, tp=1, pp=p, v=v), global_batch=m, microbatch_size=1)
        assert _held_per_rank(request) == every
        fullest = [0] * (p * v)
        for r, a in enumerate(acts):
            for k, n in zip(placement.stages_on(r), fullest_moment(a, placement.stages_on(r))):
                fullest[k] = n
        assert list(_held_per_stage(request)) == fullest
