"""Planning a contrastive step by memory: activations kept in one microbatch when they fit, else
recomputed in the fewest microbatches that fit, else refused; a count the caller gives is kept."""

from __future__ import annotations

import dataclasses

import pytest

from tests.models import build
from vlmcompile import compile
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import usable_memory_bytes
from vlmcompile.ir.contrastive_plan import MemoryPolicy, SampleSplit
from vlmcompile.ir.errors import ArgumentError
from vlmcompile.planning.contrastive import plan_towers, tower_memory
from vlmcompile.planning.request import SearchSpace


@pytest.fixture(scope="module")
def compiled():
    model, batch = build("tiny-contrastive", batch_size=8)
    return compile(model, batch, "cpu:2", search_space=SearchSpace(tower_placement="colocated"), log=None)


def _with_memory(mem_bytes: float) -> Cluster:
    cluster = Cluster.preset("cpu:2")
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, mem_bytes=int(mem_bytes)))


def _need(pipe, memory, microbatches):
    split = SampleSplit.even(8, 2, microbatches)
    return tower_memory(
        pipe.layer_graph, split, memory, embedding_width=pipe.tower_plan.loss.width, tile_rows=4
    ).total


def test_activations_are_kept_in_one_microbatch_when_they_fit(compiled):
    plan = compiled.tower_plan
    assert plan.memory is MemoryPolicy.KEEP and plan.split.microbatches == ((4,), (4,))
    assert [d.reason.value for d in plan.decisions] == ["coupled_loss_sharded", "tower_memory"]


def test_recompute_in_the_fewest_microbatches_that_fit(compiled):
    keep, two = _need(compiled, MemoryPolicy.KEEP, 1), _need(compiled, MemoryPolicy.RECOMPUTE, 2)
    assert two < keep
    cluster = _with_memory((keep + two) / 2 / usable_memory_bytes(1.0))
    plan = plan_towers(
        compiled.layer_graph,
        cluster,
        compiled.tower_plan.loss,
        global_batch=8,
        embedding_width=16,
        tile_rows=4,
    )
    assert plan.memory is MemoryPolicy.RECOMPUTE and plan.split.microbatches == ((2, 2), (2, 2))


def test_towers_that_fit_nowhere_are_refused(compiled):
    with pytest.raises(ArgumentError, match="do not fit .* give more devices or fewer samples"):
        plan_towers(
            compiled.layer_graph,
            _with_memory(1e3),
            compiled.tower_plan.loss,
            global_batch=8,
            embedding_width=16,
        )


def test_a_microbatch_count_given_is_kept_or_refused(compiled):
    loss = compiled.tower_plan.loss
    plan = plan_towers(
        compiled.layer_graph,
        Cluster.preset("cpu:2"),
        loss,
        global_batch=8,
        embedding_width=16,
        microbatches=3,
    )
    assert plan.split.microbatches == ((2, 1, 1), (2, 1, 1))
    with pytest.raises(ArgumentError, match="cannot fill 2 ranks x 5 microbatches"):
        plan_towers(
            compiled.layer_graph,
            Cluster.preset("cpu:2"),
            loss,
            global_batch=8,
            embedding_width=16,
            microbatches=5,
        )


def test_a_split_that_leaves_a_rank_without_samples_is_refused():
    with pytest.raises(ValueError, match="leave a rank or a microbatch without samples"):
        SampleSplit(3, (0, 3), ((1, 1, 1), ()))


def test_auto_placement_keeps_the_faster_predicted_step_and_says_both():
    model, batch = build("tiny-contrastive", batch_size=8)
    pipe = compile(model, batch, "cpu:4", log=None)
    plan = pipe.tower_plan
    said = [d for d in plan.decisions if d.reason.value == "tower_placement"]
    assert len(said) == 1 and "simulated" in said[0].detail
    colocated_ms, separate_ms = said[0].numbers["colocated_ms"], said[0].numbers["separate_ms"]
    chosen = "separate" if plan.separate is not None else "colocated"
    assert chosen == ("separate" if separate_ms < colocated_ms else "colocated")
    assert plan.predicted.step_s * 1e3 == pytest.approx(min(colocated_ms, separate_ms))
    if plan.separate is not None:  # each tower's ranks share the whole batch
        assert all(p.split.num_samples == 8 for p in plan.separate) and plan.num_ranks == 4


def test_separate_towers_split_every_rank_between_them():
    model, batch = build("tiny-contrastive", batch_size=8)
    pipe = compile(model, batch, "cpu:4", search_space=SearchSpace(tower_placement="separate"), log=None)
    ranks = [p.ranks for p in pipe.tower_plan.separate]
    assert sorted(ranks[0] + ranks[1]) == [0, 1, 2, 3] and min(len(r) for r in ranks) >= 1
    assert "each tower on ranks of its own" in str(pipe.tower_plan)
    assert all(pipe.tower_plan.memory_of(t) is MemoryPolicy.KEEP for t in (0, 1))  # fits: nothing runs twice
    cells = [c for line in pipe.tower_plan.grid()[1:] for c in line.split(":")[1].split()]
    assert cells == ["0"] * len(ranks[0]) + ["1"] * len(ranks[1])
    with pytest.raises(ArgumentError, match="tower placement 'apart'"):
        compile(model, batch, "cpu:4", search_space=SearchSpace(tower_placement="apart"), log=None)


# -- tensor parallelism and the baselines' rule, on a paper-size pair planned on meta tensors --------
# (``clip_s``: tests/planning/conftest.py)


def test_a_paper_size_pair_gets_its_loss_from_a_narrow_copy(clip_s):
    layer_graph, loss = clip_s
    assert loss.kind.value == "infonce" and loss.width == 1024
    names = {layer.name for layer in layer_graph.layers}
    assert set(loss.tower_layers[0]) | set(loss.tower_layers[1]) == names  # every layer in a tower
    assert any(n.startswith("vision.") for n in loss.tower_layers[0])
    assert not any(n.startswith("vision.") for n in loss.tower_layers[1])
    from vlmcompile.compiler import zoo_contrastive_loss
    from vlmcompile.ir.errors import ModelError

    with pytest.raises(ModelError, match="'demo' is not a contrastive two-tower model; zoo pairs: .*CLIP-S"):
        zoo_contrastive_loss("demo")


def test_tensor_parallel_shards_states_and_activations(clip_s):
    layer_graph, loss = clip_s
    split = SampleSplit.even(64, 1, 1)
    one, two = (
        tower_memory(layer_graph, split, MemoryPolicy.KEEP, embedding_width=1024, tile_rows=8, tp=tp)
        for tp in (1, 2)
    )
    assert two.states < 0.55 * one.states and two.activations < 0.55 * one.activations
    kept, checkpointed = (
        tower_memory(layer_graph, split, memory, embedding_width=1024, tile_rows=8)
        for memory in (MemoryPolicy.KEEP, MemoryPolicy.CHECKPOINT)
    )
    assert checkpointed.activations < 0.5 * kept.activations and checkpointed.states == kept.states


def test_a_pair_too_large_for_one_gpu_plans_at_the_tensor_parallel_degree_that_fits(clip_s):
    layer_graph, loss = clip_s
    cluster = Cluster.preset("v100x8")
    kw = dict(global_batch=128, embedding_width=1024, microbatches=1, memory="keep")
    with pytest.raises(ArgumentError, match="do not fit V100-16GB"):
        plan_towers(layer_graph, cluster, loss, **kw)
    plan = plan_towers(layer_graph, cluster, loss, tensor_parallel=(1, 2, 4, 8), **kw)
    assert plan.tp > 1 and plan.num_ranks == 8 and plan.split.num_ranks == 8 // plan.tp
    assert plan.predicted.mem_bytes <= usable_memory_bytes(cluster.device.mem_bytes)
    assert f"tp {plan.tp}" in str(plan)
    assert [plan.placement(0).rows_of(r) for r in range(plan.tp)] == [(0, 128 // (8 // plan.tp))] * plan.tp


def test_the_contrastive_runtime_refuses_what_it_does_not_run(clip_s):
    from vlmcompile.ir.errors import PlanError
    from vlmcompile.passes.codegen.contrastive import _check_runnable

    layer_graph, loss = clip_s
    cluster = Cluster.preset("v100x8")
    kw = dict(global_batch=64, embedding_width=1024, microbatches=1)
    wide = plan_towers(layer_graph, cluster, loss, memory="keep", tensor_parallel=(2,), **kw)
    with pytest.raises(PlanError, match="tp 2; the contrastive runtime runs tp 1"):
        _check_runnable(wide)
    checkpointed = plan_towers(layer_graph, cluster, loss, memory="checkpoint", **kw)
    with pytest.raises(PlanError, match="checkpoints every layer"):
        _check_runnable(checkpointed)


def test_separate_towers_keep_tensor_parallel_groups_inside_a_node(clip_s):
    from vlmcompile.planning.contrastive_placement import separate_towers

    layer_graph, loss = clip_s
    colocated = plan_towers(
        layer_graph, Cluster.preset("v100x8"), loss, global_batch=64, embedding_width=1024
    )
    plan = separate_towers(colocated, (6, 2), tp=(2, 2))
    assert plan.placement(0).dp == 3 and plan.placement(1).ranks == (6, 7)
    with pytest.raises(ArgumentError, match="must start on a multiple of its tp"):
        separate_towers(colocated, (5, 4), tp=(5, 4))
    with pytest.raises(ArgumentError, match="tp x pp must divide its ranks"):
        separate_towers(colocated, (6, 2), tp=(4, 1))


@pytest.mark.parametrize("seed", range(20))
def test_the_bisected_recompute_count_is_the_fewest_that_fits(seed):
    import random

    from vlmcompile.planning.contrastive import TowerMemory, cheapest_fit, memory_options

    rng = random.Random(seed)
    n, ranks = rng.randint(4, 300), rng.randint(1, 4)
    per_sample, states = rng.uniform(1, 10), rng.uniform(0, 50)
    cap = rng.uniform(states, states + per_sample * n)

    def need_of(policy, count):
        split = SampleSplit.even(n, ranks, count)
        held = split.count(0) if policy is MemoryPolicy.KEEP else max(split.microbatches[0])
        return split, TowerMemory(states, held * per_sample, 0.0)

    fixed, counts = memory_options(None, None, n // ranks)
    options = [*fixed, *((MemoryPolicy.RECOMPUTE, m) for m in counts)]
    linear = next(((p, need_of(p, m)[0]) for p, m in options if need_of(p, m)[1].total <= cap), None)
    found = cheapest_fit((fixed, counts), need_of, cap)
    assert (found is None) == (linear is None)
    if found is not None:
        assert (found[0], found[1].microbatches) == (linear[0], linear[1].microbatches)


def test_pipeline_stages_are_consecutive_and_balanced(clip_s):
    from vlmcompile.planning.contrastive import pipeline_stages, tower_layers

    layer_graph, loss = clip_s
    vision = tower_layers(layer_graph, loss, 0)
    stages = pipeline_stages(vision, 4)
    assert [layer for stage in stages for layer in stage] == vision and all(stages)
    work = [sum(x.fwd_flops + x.bwd_flops for x in stage) for stage in stages]
    largest_layer = max(x.fwd_flops + x.bwd_flops for x in vision)
    assert max(work) <= sum(work) / 4 + largest_layer


def test_pipeline_stages_fill_and_drain_and_shard_the_states(clip_s):
    from vlmcompile.ir.contrastive_plan import TowerPlacement
    from vlmcompile.planning.contrastive import group_phases, tower_layers

    layer_graph, loss = clip_s
    cluster = Cluster.preset("v100x8")
    base = plan_towers(layer_graph, cluster, loss, global_batch=64, embedding_width=1024)
    vision = tower_layers(layer_graph, loss, 0)

    def forward_s(pp, microbatches):  # two data-parallel groups of 32 samples, pp stages each
        split = SampleSplit.even(64, 2, microbatches)
        placement = TowerPlacement(tuple(range(2 * pp)), split, MemoryPolicy.RECOMPUTE, 1, pp)
        return group_phases(layer_graph, cluster, base, placement, vision, (), MemoryPolicy.RECOMPUTE)[0]

    # One microbatch runs the stages one after another; eight keep both busy but for the fill:
    # 9 steps of half the work, 0.56 of one stage's time.
    assert forward_s(2, 1) >= 0.95 * forward_s(1, 1)
    assert forward_s(2, 8) <= 0.65 * forward_s(1, 1)
    one, two = (
        tower_memory(
            layer_graph,
            SampleSplit.even(64, 2, 8),
            MemoryPolicy.RECOMPUTE,
            embedding_width=1024,
            tile_rows=8,
            layers=vision,
            pp=pp,
        )
        for pp in (1, 2)
    )
    assert two.states < 0.6 * one.states
    placement = TowerPlacement(tuple(range(8)), SampleSplit.even(64, 2, 1), None, 2, 2)
    assert [placement.rows_of(r)[0] for r in range(8)] == [0, 0, 32, 32, 0, 0, 32, 32]  # tp, then dp, then pp


def test_towers_apart_take_pipeline_stages_where_nothing_else_fits(clip_s):
    from vlmcompile.ir.errors import PlanError
    from vlmcompile.passes.codegen.contrastive import _check_runnable
    from vlmcompile.planning.contrastive_placement import place_towers

    layer_graph, loss = clip_s
    cluster = Cluster.preset("v100x8")
    small = dataclasses.replace(
        cluster,
        device=dataclasses.replace(cluster.device, mem_bytes=int(4.5 * 2**30 / usable_memory_bytes(1.0))),
    )
    kw = dict(global_batch=64, embedding_width=1024, placement="separate")
    with pytest.raises(ArgumentError, match="do not fit"):
        place_towers(layer_graph, small, loss, **kw)
    plan = place_towers(layer_graph, small, loss, pipeline_parallel=(1, 2, 4), **kw)
    assert max(plan.placement(t).pp for t in (0, 1)) > 1
    assert plan.predicted.mem_bytes <= usable_memory_bytes(small.device.mem_bytes)
    assert "pp " in str(plan)
    with pytest.raises(PlanError, match=r"at pp \d; the contrastive runtime runs pp 1"):
        _check_runnable(plan)


def test_a_profiled_plan_is_predicted_with_times_at_each_towers_microbatch():
    model, batch = build("tiny-contrastive", batch_size=8)
    kw = dict(profile=True, log=None)
    together = compile(model, batch, "cpu:2", search_space=SearchSpace(tower_placement="colocated"), **kw)
    assert "tower_times" not in [d.reason.value for d in together.tower_plan.decisions]  # 4 rows, as timed
    apart = compile(model, batch, "cpu:2", search_space=SearchSpace(tower_placement="separate"), **kw)
    said = [d for d in apart.tower_plan.decisions if d.reason.value == "tower_times"]
    assert len(said) == 1 and "8 and 8 samples" in said[0].detail and "times at 4" in said[0].detail
    from vlmcompile.planning.contrastive import predict_step

    # The plan's forward is predicted from times at 8 rows, not from the pass's times at 4.
    at_4 = predict_step(apart.layer_graph, Cluster.preset("cpu:2"), apart.tower_plan)
    assert at_4.towers_fwd_s != apart.tower_plan.predicted.towers_fwd_s
    assert 0.2 < apart.tower_plan.predicted.towers_fwd_s / at_4.towers_fwd_s < 5
