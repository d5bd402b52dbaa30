"""Planning a contrastive step by memory: activations kept in one microbatch when they fit, else
recomputed in the fewest microbatches that fit, else refused; a count the caller gives is kept."""

from __future__ import annotations

import dataclasses

import pytest

from tests.models import build
from vlmcompile import compile
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import usable_memory_bytes
from vlmcompile.ir.errors import ArgumentError
from vlmcompile.ir.tower_plan import MemoryPolicy, SampleSplit
from vlmcompile.planning.request import SearchSpace
from vlmcompile.planning.towers import plan_towers, tower_memory


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
