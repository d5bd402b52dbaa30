"""The baselines of benchmarks/contrastive.py on DistMM's CLIP-S: each is the plan its users
would run, and ours, a superset of their choices, is never slower at their largest batch nor
limited to a smaller exact batch; a plan that does not fit says so."""

from __future__ import annotations

import dataclasses

import pytest

from tests.bench_helpers import load_benchmark
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.errors import ArgumentError


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("contrastive")


@pytest.fixture(scope="module")
def problem(bench, clip_s):
    return bench.Problem("CLIP-S", "v100", Cluster.preset("v100x8"), *clip_s)


def test_ours_trains_a_larger_exact_batch_and_is_never_slower_at_theirs(bench, problem):
    largest = {p: bench.largest_batch(p, problem) for p in bench.POLICIES}
    assert all(largest[b] <= largest["vlmcompile"] for b in bench.BASELINES)
    assert (
        largest["megatron"] > 0 and largest["open_clip"] < largest["megatron"]
    )  # 16 B a parameter on every GPU
    for baseline in ("megatron", "one_microbatch"):
        n = largest[baseline]
        theirs, ours = bench.plan(baseline, problem, n), bench.plan("vlmcompile", problem, n)
        assert ours.predicted.step_s <= theirs.predicted.step_s * (1 + 1e-9)
        with pytest.raises(ArgumentError, match="do not fit"):
            bench.plan(baseline, problem, n + problem.cluster.num_gpus)


def test_the_baselines_run_the_whole_batch_in_one_microbatch_with_their_own_states(bench, problem):
    with pytest.raises(ArgumentError, match=r"tp 1 checkpoint x1: 1\d\.\d\d GiB"):  # 16 B x 1.1e9 parameters
        bench.plan("open_clip", problem, 64)
    megatron = bench.plan("megatron", problem, 64)
    cluster = problem.cluster
    larger = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, mem_bytes=32 * 2**30))
    open_clip = bench.plan("open_clip", dataclasses.replace(problem, cluster=larger), 64)
    for plan in (megatron, open_clip):
        assert plan.separate is None and {len(m) for m in plan.split.microbatches} == {1}
    assert open_clip.tp == 1 and open_clip.zero_stage == 0 and open_clip.precision.param_bytes == 4
    one = bench.plan("one_microbatch", problem, 8)
    assert one.split.num_ranks == 1 and one.num_ranks <= 8  # DP = 1; the other GPUs wait
    row = bench.figures(problem, megatron)
    assert row["samples_per_s"] == pytest.approx(64 / megatron.predicted.step_s)
    assert 0 < row["mfu"]["text"] < row["mfu"]["vision"] < 1  # the image tower does most of the work
