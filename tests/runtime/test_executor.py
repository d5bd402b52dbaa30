"""The runtime on local CPU ranks: one step's loss and every gradient equal eager training,
a dead rank fails the others with its name, and bad input gets a clear error."""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import re
import signal
import time

import pytest
import torch

from tests.models import build, needs_transformers
from tests.pipeline_helpers import (
    check_equal_to_eager,
    encoder_on_rank_1,
    even_plan,
    first_forwards_swapped,
    separate_plan,
)
from vlmcompile import compile
from vlmcompile.demo import eager_losses
from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.errors import PlanError
from vlmcompile.runtime.executor import BatchError, PipelineRunner
from vlmcompile.runtime.launch import LaunchError, launch
from vlmcompile.runtime.timed_steps import interleaved_steps, one_step

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


def _pipe(name, batch_size=4):
    model, batch = build(name, batch_size=batch_size)
    return model, batch, compile(model, batch, log=None)


CASES = {
    "1f1b": ("tiny", dict(pp=2, recompute=(2, 5))),
    "interleaved": ("tiny", dict(pp=2, v=2, recompute=(1,))),
    # Rank 1 holds stages 1 and 2 (the turn of the V): activations pass between them in-process.
    "v-shaped": ("tiny", dict(pp=2, v=2, placement="v", recompute=(2,))),
    "two-encoder": ("tiny-two-encoder", dict(pp=2, recompute=(3,))),
    # Cut after the LLM's embedding: the output layer tied to it is on the other rank.
    "tied-embeddings": ("tiny-tied", dict(pp=2, cuts=[6])),
    "dp2-pp2": ("tiny", dict(pp=2, dp=2, recompute=(4,))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_equals_eager(case):
    name, options = CASES[case]
    model, batch, pipe = _pipe(name)
    plan = even_plan(pipe.layer_graph, global_batch=4, **options)
    check_equal_to_eager(model, batch, pipe.launch(plan=plan, timeout_s=30))


@pytest.mark.parametrize(("policy", "pp"), [("torchtitan_vlm", 2), ("mimo_colocated", 1)])
def test_other_systems_plans_train_like_eager(policy, pp):
    model, batch = build("tiny", batch_size=4)
    pipe = compile(model, batch, cluster="cpu:2", log=None)
    plan = pipe.baseline(policy, tp=1, pp=pp, global_batch=4).plan
    assert plan.policy == policy
    check_equal_to_eager(model, batch, pipe.launch(plan=plan, timeout_s=30))


def test_encoder_stage_on_another_rank_than_the_first_llm_stage():
    model, batch, pipe = _pipe("tiny")
    plan = encoder_on_rank_1(pipe.layer_graph, global_batch=4)
    assert plan.stages[0].rank == 1 and plan.stages[1].rank == 0
    check_equal_to_eager(model, batch, pipe.launch(plan=plan, timeout_s=30))


@needs_transformers
@pytest.mark.hf
def test_transformers_llava_equals_eager():
    model, batch = build("hf-llava")  # 2 samples, exported at 2 rows: the runtime re-captures at 1
    pipe = compile(model, batch, log=None)
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=2, recompute=(6,))
    check_equal_to_eager(model, batch, pipe.launch(plan=plan, timeout_s=30))


def test_two_plans_interleaved_step_by_step_each_train_like_eager():
    # The demo's comparison: both runners share the ranks and the p2p tags, each its own weights.
    model, batch, pipe = _pipe("tiny")
    plans = (
        even_plan(pipe.layer_graph, pp=2, global_batch=4, recompute=(2,)),
        even_plan(pipe.layer_graph, pp=2, v=2, global_batch=4),
    )
    runners = tuple(copy.deepcopy(pipe.runner(plan, timeout_s=30)) for plan in plans)
    results = launch(interleaved_steps, runners, 2, args=(batch, 3, 0.1), timeout_s=30)
    expected = torch.tensor(eager_losses(copy.deepcopy(model), batch, 3, 0.1))
    assert not torch.allclose(expected[0], expected[-1]), "SGD should move the loss"
    for rank, per_plan in enumerate(results):
        for j, result in enumerate(per_plan):
            assert len(result["step_s"]) == 3 and all(t > 0 for t in result["step_s"])
            torch.testing.assert_close(
                torch.tensor(result["losses"]), expected, msg=lambda m, r=rank, j=j: f"rank {r} plan {j}: {m}"
            )


def _collection_during_actions(runners, batch, num_steps):
    """On each rank: whether automatic garbage collection was on during each action of the
    interleaved steps, and whether it is on after them."""
    seen = []
    for runner in runners:
        runner.on_action = lambda rank, action: seen.append(gc.isenabled())
    interleaved_steps(runners, batch, num_steps, 0.1)
    return seen, gc.isenabled()


def test_interleaved_steps_keep_garbage_collection_out_of_the_timed_steps():
    """A collection inside one plan's step made it measure up to 10 % slower than a copy of the
    same plan: it is paused inside every step (and collected between them), then resumed."""
    model, batch, pipe = _pipe("tiny")
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)
    runners = tuple(copy.deepcopy(pipe.runner(plan, timeout_s=30)) for _ in range(2))
    per_rank = launch(_collection_during_actions, runners, 2, args=(batch, 2), timeout_s=30)
    for rank, (seen, after) in enumerate(per_rank):
        assert len(seen) == 2 * 2 * len(plan.actions[rank]), "every action of both runners, both steps"
        assert not any(seen), "a collection could land inside a timed step"
        assert after, "automatic collection is on again after the steps"


def _kill_rank_1_mid_step(runner, batch):
    def on_action(rank, action):
        if rank == 1 and action.microbatch == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    runner.on_action = on_action
    return one_step(runner, batch)


def test_a_dead_rank_fails_the_others_naming_it():
    model, batch, pipe = _pipe("tiny")
    plan = even_plan(pipe.layer_graph, pp=2, dp=2, global_batch=8)
    big = {k: torch.cat([v, v]) for k, v in batch.items()}
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_kill_rank_1_mid_step, pipe.runner(plan, timeout_s=20), 4, args=(big,), timeout_s=20)
    assert time.monotonic() - start < 60
    err = info.value
    assert err.first_failed == 1 and err.exit_codes[1] == -signal.SIGKILL
    assert all(code not in (0, None) for code in err.exit_codes.values()), err.exit_codes
    text = str(err)
    assert "rank 1 failed first: killed by SIGKILL" in text
    # rank 3, rank 1's pipeline peer, names it; the data-parallel peers name their group.
    assert re.search(r"rank 3: exited 1 .* waiting for .* from rank 1", text), text
    assert re.search(r"rank 0: exited 1 .* over ranks \[0, 1\]", text), text


def _hang_rank_1_mid_step(runner, batch):
    def on_action(rank, action):
        if rank == 1 and action.microbatch == 2:
            time.sleep(3600)  # alive, silent

    runner.on_action = on_action
    return one_step(runner, batch)


def test_a_hung_rank_times_the_others_out_and_is_killed():
    _, batch, pipe = _pipe("tiny")
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        runner = pipe.runner(plan, timeout_s=2)
        launch(_hang_rank_1_mid_step, runner, 2, args=(batch,), timeout_s=10, grace_s=0.5)
    # Rank 0 gives up 2 s into the wait and the launcher kills rank 1 half a second later: the
    # rest is start-up (two processes importing torch).
    assert time.monotonic() - start < 30
    text = str(info.value)
    assert info.value.exit_codes[0] == 1 and info.value.exit_codes[1] == -signal.SIGKILL, text
    assert re.search(r"rank 0: exited 1 .* timed out after \d+\.\d s waiting for .* from rank 1", text), text
    assert "rank 1: killed by the launcher" in text


def test_a_batch_of_other_shapes_names_the_tensor_and_the_expected_shape():
    _, batch, pipe = _pipe("tiny")
    runner = pipe.runner(even_plan(pipe.layer_graph, pp=2, global_batch=4))
    bad = dict(batch, input_ids=batch["input_ids"][:, :-1])
    with pytest.raises(
        BatchError, match=r"batch\['input_ids'\] is \[4, \d+\] torch.int64; the pipeline expects \[4, \d+\]"
    ):
        runner.step(bad)
    with pytest.raises(BatchError, match="lacks 'labels'"):
        runner.step({k: v for k, v in batch.items() if k != "labels"})


def test_a_world_size_other_than_the_plans_is_refused():
    _, batch, pipe = _pipe("tiny")
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)
    with pytest.raises(ValueError, match="runs on 2 ranks"):
        pipe.launch(plan=plan, nprocs=3)
    # Every rank refuses alike: the launcher raises that error once, not a report per rank.
    with pytest.raises(PlanError, match="the plan runs on 2 ranks .* torch.distributed has 1"):
        launch(one_step, pipe.runner(plan), 1, args=(batch,), timeout_s=20)


def test_a_plan_made_for_another_model_is_refused(tmp_path):
    _, _, pipe = _pipe("tiny")
    _, _, other = _pipe("tiny-two-encoder")
    path = tmp_path / "plan.json"
    even_plan(other.layer_graph, pp=2, global_batch=4).save(path)
    from vlmcompile.ir.plan import Plan

    with pytest.raises(PlanError, match=r"made for model .* \(fingerprint "):
        pipe.runner(Plan.load(path))


@pytest.mark.parametrize("policy", ["megatron", "vlmcompile"])
def test_cli_run_trains_a_zoo_model_on_local_ranks(policy, capsys):
    from vlmcompile.cli import main

    assert (
        main(
            [
                "run",
                "--model",
                "tiny",
                "--nprocs",
                "2",
                "--policy",
                policy,
                "--global-batch",
                "4",
                "--steps",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"plan '{policy}'" in out
    losses = [float(x) for x in out.split("losses: ")[1].splitlines()[0].split(", ")]
    assert len(losses) == 2 and losses[1] < losses[0]  # SGD on one batch lowers its loss


@needs_transformers
@pytest.mark.hf
@pytest.mark.extended  # outside CI's 15 minutes (the README's test command runs it)
def test_llama4s_complex_rotary_frequencies_cross_a_stage_cut():
    from vlmcompile import families

    model, batch = families.build_tiny("llama4")
    pipe = compile(model, batch, log=None)
    names = [layer.name for layer in pipe.layer_graph.layers]
    cut = names.index("language_model.model.layers.0")  # right after the rotary embedding
    assert any("complex" in str(o) for o in pipe.layer_graph[names[cut - 1]].outputs)
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=2, cuts=[cut])
    check_equal_to_eager(model, batch, pipe.launch(plan=plan, timeout_s=30))


@needs_transformers
@pytest.mark.hf
def test_batch_values_the_graph_is_fixed_to_must_come_back_unchanged():
    from vlmcompile import families

    model, batch = families.build_tiny("clip")
    pipe = compile(model, batch, log=None)
    runner = pipe.runner(even_plan(pipe.layer_graph, pp=1, microbatch_size=2, global_batch=2))
    runner.check_batch(batch)  # the compiled batch itself, return_loss=True included
    with pytest.raises(
        BatchError, match=r"batch\['return_loss'\] is False; the pipeline was compiled with True"
    ):
        runner.check_batch({**batch, "return_loss": False})

    # Eager attention: the one-shape capture, specialised on the grids (with sdpa a Qwen dict
    # batch is captured as its samples, packed, and fixes no grid).
    model, batch = families.build_tiny("qwen2-vl", attn_implementation="eager")
    pipe = compile(model, batch, log=None)
    assert pipe.packed is None
    runner = pipe.runner(even_plan(pipe.layer_graph, pp=1, global_batch=2))
    runner.check_batch(batch)
    other = batch["image_grid_thw"].clone()
    other[1] = torch.tensor([1, 2, 8])  # as many patches, another layout
    with pytest.raises(BatchError, match=r"microbatch 1's 'image_grid_thw' is \[\[1, 2, 8\]\].*captured for"):
        runner.check_batch({**batch, "image_grid_thw": other})


def test_a_microbatch_without_label_tokens_trains_like_eager():
    # Its own loss is a mean over no tokens (NaN); eager's loss over the whole batch never sees it.
    model, batch, pipe = _pipe("tiny")
    labels = batch["labels"].clone()
    labels[1] = -100
    batch = {**batch, "labels": labels}
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)
    results = pipe.launch(one_step, plan=plan, args=(batch,), timeout_s=30)
    assert torch.isfinite(results[0]["loss"])
    check_equal_to_eager(model, batch, results)


def test_a_data_parallel_replica_without_label_tokens_trains_like_eager():
    # Replica 1's whole shard has no label tokens: its last stage has no gradients of its own,
    # yet it must join the data-parallel all-reduce with the same tensors as replica 0.
    model, batch, pipe = _pipe("tiny", batch_size=8)
    labels = batch["labels"].clone()
    labels[4:] = -100
    batch = {**batch, "labels": labels}
    plan = even_plan(pipe.layer_graph, pp=2, dp=2, global_batch=8)
    results = pipe.launch(one_step, plan=plan, args=(batch,), timeout_s=30)
    check_equal_to_eager(model, batch, results)


def test_microbatches_may_run_in_another_order_on_each_rank():
    # The shape header goes with whichever microbatch a stage sends first; the receiver may want
    # another one first.
    model, batch, pipe = _pipe("tiny")
    swapped = first_forwards_swapped(even_plan(pipe.layer_graph, pp=2, global_batch=4))
    swapped.validate(pipe.layer_graph)
    assert swapped.actions[0][0].microbatch != swapped.actions[1][0].microbatch
    results = pipe.launch(plan=swapped, timeout_s=30)
    check_equal_to_eager(model, batch, results)


def test_a_runner_built_by_hand_validates_its_plan():
    _, _, pipe = _pipe("tiny")
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)
    broken = dataclasses.replace(plan, actions=(plan.actions[0][1:], plan.actions[1]))
    with pytest.raises(PlanError, match="rank 0 is missing 0F0"):
        PipelineRunner(broken, (), batch_shapes={})


SEPARATE = {
    "encoder dp over pp=2": ("tiny", dict(pp=2, encoder_pp=1, global_batch=4)),
    "encoder pipelined over pp=2": ("tiny", dict(pp=2, encoder_pp=2, global_batch=4, recompute=(1,))),
    "dp2 x pp2, encoder dp": ("tiny", dict(pp=2, dp=2, encoder_pp=1, global_batch=8, chunks=2)),
    "two encoders": ("tiny-two-encoder", dict(pp=2, encoder_pp=1, global_batch=4, chunks=3)),
}


@pytest.mark.parametrize("case", list(SEPARATE))
def test_encoders_with_a_plan_of_their_own_train_like_eager(case):
    """Encoder stages replicated over the LLM's pipeline ranks: each microbatch's encoder work on
    one holder, its output sent to the first LLM stage's rank, its gradients back, and the
    holders' gradients summed."""
    name, options = SEPARATE[case]
    model, batch, pipe = _pipe(name, batch_size=options["global_batch"])
    plan = separate_plan(pipe.layer_graph, **options)
    assert any(s.replicas for s in plan.stages) == (options["encoder_pp"] < options["pp"])
    check_equal_to_eager(model, batch, pipe.launch(plan=plan, timeout_s=30))


def test_microbatches_given_unevenly_to_encoder_pipelines_train_like_eager():
    model, batch, pipe = _pipe("tiny", batch_size=4)
    plan = separate_plan(pipe.layer_graph, pp=2, encoder_pp=1, global_batch=4, assignment=(1, 1, 1, 0))
    ranks = {a.microbatch: r for r, acts in enumerate(plan.actions) for a in acts if a.stage == 0}
    assert ranks == {0: 1, 1: 1, 2: 1, 3: 0}
    check_equal_to_eager(model, batch, pipe.launch(plan=plan, timeout_s=30))


def test_kernel_level_encoder_work_runs_before_its_host_and_trains_like_eager():
    """The runtime runs a kernel-level encoder action just before the LLM action it rides on (on
    one CPU rank the two kernels streams are one): numerics are those of eager training."""
    model, batch, pipe = _pipe("tiny", batch_size=4)
    plan = separate_plan(pipe.layer_graph, pp=2, encoder_pp=1, global_batch=4)
    llm = plan.stages[-1].group
    acts = list(plan.actions[1])
    rider = next(a for a in acts if plan.stages[a.stage].group != llm)
    rest = [a for a in acts if a != rider]
    host = next(a for a in rest if plan.stages[a.stage].group == llm)
    at = rest.index(host)
    fused = dataclasses.replace(
        plan,
        actions=(plan.actions[0], tuple(rest[:at] + [rider] + rest[at:])),
        kernel_level={rider: 1},
    )
    fused.validate(pipe.layer_graph)
    assert fused.hosts_of() == {rider: (host,)}
    check_equal_to_eager(model, batch, pipe.launch(plan=fused, timeout_s=30))


def _receives_posted_at_each_action(runner, batch):
    seen = []
    runner.on_action = lambda rank, action: seen.append(
        (action, frozenset(t.consumer for t in runner._state.exchange.posted) - {action})
    )
    out = one_step(runner, batch)
    return {**out, "posted_ahead": seen}


def test_receives_are_posted_before_their_action_runs():
    # gloo moves a message only once its receive is posted: a receive posted ahead lets the
    # transfer run while this rank computes.
    model, batch, pipe = _pipe("tiny")
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)
    results = pipe.launch(_receives_posted_at_each_action, plan=plan, args=(batch,), timeout_s=30)
    check_equal_to_eager(model, batch, results)
    last = plan.actions[1]
    ahead = {a for action, posted in results[1]["posted_ahead"] for a in posted}
    # Rank 1 (the last stage) takes every forward's activations from rank 0; all but the first
    # (whose shape header comes with it) are posted while an earlier action runs.
    later_forwards = {a for a in last if a.kind.value == "F" and a.microbatch != last[0].microbatch}
    assert later_forwards <= ahead
    first = results[0]["posted_ahead"]
    assert any(a.kind.value == "B" for _, posted in first for a in posted), (
        "rank 0 posts gradients' receives ahead"
    )


def test_a_v_shaped_plan_is_built_simulated_and_trains_like_eager():
    from vlmcompile.cost_models.cluster import Cluster
    from vlmcompile.sim.simulator import simulate

    model, batch, pipe = _pipe("tiny")
    plan = even_plan(pipe.layer_graph, pp=2, v=2, placement="v", global_batch=4, recompute=(1,))
    assert plan.schedule == "v_1f1b"
    assert [s.rank for s in plan.stages] == [0, 1, 1, 0]  # stage 3, with the loss, back on rank 0
    sim = simulate(plan, pipe.layer_graph, Cluster.preset("cpu:2"))
    assert sim.fits and sim.step_time_s > 0
    # The turn of the V (stage 1 -> 2) stays on rank 1: its forward waits for no transfer.
    runs = {r.action: r for r in sim.runs}
    assert runs[Action(2, ActionKind.F, 0)].start_s == runs[Action(1, ActionKind.F, 0)].end_s
    check_equal_to_eager(model, batch, pipe.launch(plan=plan, timeout_s=30))


def _bf16_casts_of_one_step(runner, batch):
    """One bf16 step, counting every bf16 cast of each of this rank's parameters."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names = {p.untyped_storage().data_ptr(): n for n, p in runner.named_parameters().items()}
    casts = dict.fromkeys(names.values(), 0)

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
                name = names.get(args[0].untyped_storage().data_ptr())
                if name is not None:
                    casts[name] += 1
            return func(*args, **kwargs)

    runner.autocast_dtype = torch.bfloat16
    with Casts():
        out = one_step(runner, batch)
    trains = {n for n, p in runner.named_parameters().items() if p.requires_grad}
    return {"casts": casts, "trains": trains, "loss": out["loss"]}


def test_a_bf16_step_casts_each_weight_once_whatever_its_microbatches():
    """Autocast casts a weight for each forward that reads it; the step keeps the first cast
    (torch's autocast cache, held for the step) so 4 microbatches in flight hold one bf16 copy
    of each trainable weight, not four, recomputed layers included. A frozen weight is cast
    where it is read (torch caches only leaves that take gradients), and its copies are dropped
    with the forward that made them."""
    model, batch = build("tiny", batch_size=4)
    model.encoders.requires_grad_(False)
    pipe = compile(model, batch, log=None)
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4, recompute=(3, 6))
    assert plan.num_microbatches == 4
    per_rank = launch(
        _bf16_casts_of_one_step, pipe.runner(plan, timeout_s=30), 2, args=(batch,), timeout_s=30
    )
    cast = set()
    for rank in per_rank:
        trained = {n: c for n, c in rank["casts"].items() if n in rank["trains"] and c}
        assert trained and set(trained.values()) == {1}, rank["casts"]
        cast |= set(trained)
        frozen = {n: c for n, c in rank["casts"].items() if n not in rank["trains"] and c}
        assert all(c == 4 for c in frozen.values()), frozen
    assert any(n.startswith("encoders.") for r in per_rank for n, c in r["casts"].items() if c == 4)
    assert len(cast) > 4
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(**batch)
    torch.testing.assert_close(per_rank[0]["loss"], expected.detach(), rtol=2**-7, atol=0.0)
