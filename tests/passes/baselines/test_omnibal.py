import dataclasses
import itertools

import numpy as np
import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import usable_memory_bytes
from vlmcompile.ir.plan import Parallel, Reason
from vlmcompile.passes.baselines.omnibal import adaptive_recompute, anchor_counts, jittered, omnibal
from vlmcompile.planning.partition_problem import evaluate, partition_problem
from vlmcompile.planning.request import PlanRequest
from vlmcompile.sim.simulator import simulate


def test_anchor_cuts_sit_where_the_forward_prefix_is_closest_to_k_over_s():
    times = [5.0, 1.0, 1.0, 1.0, 4.0, 1.0, 1.0, 2.0]
    counts = anchor_counts(times, 3)
    assert sum(counts) == len(times) and min(counts) >= 1
    prefix = np.concatenate([[0.0], np.cumsum(times)])
    cuts = np.cumsum(counts)[:-1]
    for k, cut in enumerate(cuts, 1):
        target = prefix[-1] * k / 3
        assert abs(prefix[cut] - target) == min(abs(prefix[c] - target) for c in range(1, len(times)))


def test_anchor_of_uniform_layers_is_even():
    assert anchor_counts([1.0] * 12, 4) == [3, 3, 3, 3]


def test_jitter_of_radius_one_over_four_stages_gives_the_papers_27_candidates():
    cands = jittered((10, 20, 30), 40, radius=1, limit=10_000)
    assert len(cands) == 27
    assert set(cands) == {(10 + a, 20 + b, 30 + c) for a, b, c in itertools.product((-1, 0, 1), repeat=3)}


def test_jitter_gives_every_valid_cut_within_the_radius_and_no_other():
    # Cuts near the ends and each other: many offsets would empty a stage.
    anchor, n, radius = (1, 3, 5), 7, 2
    got = jittered(anchor, n, radius=radius, limit=10_000)
    offsets = range(-radius, radius + 1)
    every = {tuple(c + d for c, d in zip(anchor, ds)) for ds in itertools.product(offsets, repeat=3)}
    valid = {c for c in every if 0 < c[0] < c[1] < c[2] < n}
    assert anchor in got and set(got) == valid and len(got) == len(valid) == 19
    # Above the limit: a sample of them, the anchor always among it, every one valid.
    sampled = jittered(anchor, n, radius=radius, limit=5)
    assert anchor in sampled and set(sampled) <= valid and 1 < len(sampled) <= 6


@pytest.fixture(scope="module")
def h100():
    return Cluster.preset("h100x8")


def test_adaptive_recompute_is_the_fewest_per_rank(demo_graph, h100):
    request = PlanRequest(parallel=Parallel(dp=4, tp=1, pp=2), global_batch=64, microbatch_size=4)
    problem = partition_problem(demo_graph, h100, request)
    stage_of = tuple(0 if i < 9 else 1 for i in range(problem.num_layers))
    plain = evaluate(problem, stage_of, [False] * problem.num_layers)
    cap = 0.5 * (max(plain.peak_bytes) + min(plain.peak_bytes))
    tight = dataclasses.replace(problem, mem_cap_bytes=cap)
    flags = adaptive_recompute(tight, stage_of)
    assert flags is not None and any(flags)
    assert evaluate(tight, stage_of, flags).fits
    for i in [i for i, f in enumerate(flags) if f]:
        fewer = list(flags)
        fewer[i] = False
        rank = stage_of[i] % 2
        assert evaluate(tight, stage_of, fewer).peak_bytes[rank] > cap, f"layer {i} was not needed"


def test_omnibal_plan_is_valid_fits_and_explains_itself(demo_graph, h100):
    result = omnibal(demo_graph, h100, PlanRequest.on(h100, tp=1, pp=4, global_batch=16))
    plan = result.plan
    plan.validate(demo_graph)
    simulate(plan, demo_graph, h100).check_fits(plan)
    assert plan.policy == "omnibal"
    reasons = {d.reason for d in plan.decisions}
    assert {Reason.GREEDY_ANCHOR, Reason.JITTERED_CUTS, Reason.ADAPTIVE_RECOMPUTE} <= reasons
    report = result.report
    assert report.num_candidates == 27 and len(report.evaluated) == 10
    assert all(c.fits for c in report.evaluated if c.step_s is not None)
    best = min(c.step_s for c in report.evaluated if c.fits)
    sim = simulate(plan, demo_graph, h100)
    assert sim.step_time_s == pytest.approx(best)
    assert max(sim.peak_mem_bytes) <= usable_memory_bytes(h100.device.mem_bytes)
