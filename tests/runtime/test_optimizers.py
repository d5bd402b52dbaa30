"""ZeRO as planned: ZeRO-1 shards the optimizer states over each data-parallel group and trains
exactly as eager (losses, gradients, weights); checkpoints reshard between ZeRO stages and data-
parallel degrees; stages the runtime does not run are refused before launch."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models import build
from tests.pipeline_helpers import check_equal_to_eager, even_plan, separate_plan
from vlmcompile import compile
from vlmcompile.ir.errors import PlanError
from vlmcompile.runtime.capabilities import runnable
from vlmcompile.runtime.checkpoint_dir import Start
from vlmcompile.runtime.launch import launch
from vlmcompile.runtime.timed_steps import one_step
from vlmcompile.runtime.train_loop import TrainConfig, eager_training, train_on_rank

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

CONFIG = dict(lr=3e-3, warmup_steps=1, max_grad_norm=0.5, weight_decay=0.1)


def _tied_frozen():
    """The tiny VLM with its output layer tied to its embedding, its vision encoder frozen."""
    model, batch = build("tiny-tied", batch_size=4)
    model.encoders.requires_grad_(False)
    return model, batch, compile(model, batch, log=None)


def _step_then_train(runners, batch, steps, config, throughput):
    """Per runner: one step's loss and gradients, then ``steps`` AdamW steps (``config``): their
    losses, the weights after, and the names of the parameters whose optimizer states this rank holds."""
    from vlmcompile.runtime.optimizers import local_states, make_optimizer

    out = []
    for runner in runners:
        first = one_step(runner, batch)
        result = train_on_rank(runner, steps, config, throughput, start=Start())
        weights = {n: p.detach().clone() for n, p in runner.named_parameters().items()}
        # The optimizer the loop made, made again: which states does this rank hold after a step?
        opt = make_optimizer(runner.trainable_parameters(), config.adamw, shards=runner.groups.shards)
        runner.step(batch)
        opt.step()
        names = {id(p): n for n, p in runner.named_parameters().items()}
        out.append(
            {
                **first,
                "losses": result.losses,
                "weights": weights,
                "states": sorted(names[id(p)] for p in local_states(opt)),
            }
        )
    return out


@pytest.mark.parametrize(("pp", "dp"), [(1, 2), (2, 2)], ids=["dp2", "pp2-dp2"])
def test_zero1_trains_like_eager_with_each_state_on_one_data_parallel_rank(pp, dp):
    model, batch, pipe = _tied_frozen()
    plan = even_plan(
        pipe.layer_graph, pp=pp, dp=dp, global_batch=4, zero_stage=1, cuts=[6] if pp == 2 else None
    )
    assert plan.pipeline_parallel.zero_stage == 1
    config = TrainConfig(steps=3, **CONFIG)
    steps = [batch, {**batch, "pixel_values": batch["pixel_values"] * -1}, batch]
    runner = pipe.runner(plan, timeout_s=60)
    per_rank = launch(
        _step_then_train,
        [runner],
        pp * dp,
        args=(batch, steps, config, pipe.throughput(runner)),
        timeout_s=60,
    )
    check_equal_to_eager(model, batch, [r[0] for r in per_rank])
    eager = copy.deepcopy(model)
    expected = eager_training(eager, steps, config)
    trained = dict(eager.named_parameters(remove_duplicate=False))
    for rank, (result,) in enumerate(per_rank):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected))
        for name, w in result["weights"].items():
            torch.testing.assert_close(w, trained[name], msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
    # Each trainable parameter's AdamW states on exactly one rank of its data-parallel group.
    for p_rank in range(pp):
        group = [per_rank[p_rank * dp + d][0] for d in range(dp)]
        held = [set(r["states"]) for r in group]
        assert all(held) and not set.intersection(*held), held
        trainable = {n for n in group[0]["weights"] if not n.startswith("encoders.")}
        assert set.union(*held) == trainable


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(zero_stage=2), "zero_stage=2; the runtime runs ZeRO stages 0, 1"),
        (dict(zero_stage=3), "zero_stage=3; the runtime runs ZeRO stages 0, 1"),
        (dict(zero_stage=1, dp=1), "zero_stage=1 at DP=1: there is no data-parallel group to shard over"),
    ],
)
def test_a_zero_stage_the_runtime_cannot_run_is_refused_naming_it(change, message):
    _, _, pipe = _tied_frozen()
    dp = change.pop("dp", 2)
    plan = even_plan(pipe.layer_graph, pp=2, dp=dp, global_batch=4, **change)
    with pytest.raises(PlanError, match=message):
        runnable(plan)


def test_a_checkpoint_resumes_at_another_zero_stage_and_data_parallel_degree(tmp_path):
    """Saved under ZeRO-1 at PP = 2 x DP = 2 (each rank its share of the AdamW states), resumed
    at ZeRO-0 on PP = 2 alone, saved again and resumed under ZeRO-1: DCP reshards by original
    names, and every step's loss is the uninterrupted eager run's."""
    model, batch, pipe = _tied_frozen()
    data = [batch, {**batch, "pixel_values": batch["pixel_values"] * -1}] * 3
    expected = eager_training(copy.deepcopy(model), data, TrainConfig(steps=6, **CONFIG))
    zero1 = even_plan(pipe.layer_graph, pp=2, dp=2, global_batch=4, zero_stage=1, cuts=[6])
    plain = even_plan(pipe.layer_graph, pp=2, global_batch=4, cuts=[6])
    losses = []
    for steps, plan in ((2, zero1), (4, plain), (6, zero1)):
        config = TrainConfig(
            steps=steps, decay_steps=6, checkpoint_dir=str(tmp_path / "ckpt"), resume=steps > 2, **CONFIG
        )
        result = pipe.train(data, config, plan=plan, timeout_s=60)
        assert result.resumed_from == steps - 2
        losses += result.losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))


ENCODER_PARAMS = {
    "tiny-tied": ("encoders.", "projectors."),
    "hf-llava": ("model.vision_tower.", "model.multi_modal_projector."),
}
"""Per model, the prefixes of the parameters its encoder stage holds."""


@pytest.mark.parametrize("name", list(ENCODER_PARAMS))
def test_zero1_shards_an_encoder_stage_over_every_rank_holding_it(name):
    """The encoder on a plan of its own, its one stage replicated over both pipeline ranks at DP = 2:
    the encoder group's DP is 4, and so is the group its AdamW states are sharded over (the memory
    model's budget); the LLM stages' states over their data-parallel pairs. Trains as eager."""
    model, batch = build(name, batch_size=8)
    pipe = compile(model, batch, log=None)
    samples = len(batch["input_ids"])
    plan = separate_plan(pipe.layer_graph, pp=2, dp=2, encoder_pp=1, global_batch=samples, zero_stage=1)
    encoder = next(s for s in plan.stages if s.replicas)
    assert plan.parallel[encoder.group].dp == 4 and plan.parallel[encoder.group].zero_stage == 1
    config = TrainConfig(steps=3, **CONFIG)
    steps = [batch, {**batch, "pixel_values": batch["pixel_values"] * -1}, batch]
    runner = pipe.runner(plan, timeout_s=60)
    per_rank = [
        r[0]
        for r in launch(
            _step_then_train, [runner], 4, args=(batch, steps, config, pipe.throughput(runner)), timeout_s=60
        )
    ]
    check_equal_to_eager(model, batch, per_rank)
    expected = eager_training(copy.deepcopy(model), steps, config)
    for result in per_rank:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected))
    held = [set(r["states"]) for r in per_rank]
    # AdamW keeps states for the parameters that get a gradient (LLaVA's last vision layer gets none).
    stepped = [{n for n, g in r["grads"].items() if g is not None} for r in per_rank]
    encoder_names = {n for n in stepped[0] if n.startswith(ENCODER_PARAMS[name])}
    assert encoder_names
    owners = [[rank for rank in range(4) if n in held[rank]] for n in sorted(encoder_names)]
    assert all(len(o) == 1 for o in owners), owners
    assert len({o[0] for o in owners}) > 1  # spread over the group, not all on one rank
    for p_rank in range(2):
        group = [held[p_rank * 2 + d] - encoder_names for d in range(2)]
        assert not group[0] & group[1]
        assert group[0] | group[1] == stepped[p_rank * 2] - encoder_names


def test_a_checkpoint_of_sharded_encoder_states_resumes_unsharded_and_back(tmp_path):
    """Saved with the encoder's states sharded over 4 ranks and the LLM's over pairs, resumed at
    ZeRO-0 and again at ZeRO-1: every loss is the uninterrupted eager run's."""
    model, batch = build("tiny-tied", batch_size=8)
    pipe = compile(model, batch, log=None)
    data = [batch, {**batch, "pixel_values": batch["pixel_values"] * -1}] * 3
    expected = eager_training(copy.deepcopy(model), data, TrainConfig(steps=6, **CONFIG))
    plans = [
        separate_plan(pipe.layer_graph, pp=2, dp=2, encoder_pp=1, global_batch=8, zero_stage=zero)
        for zero in (1, 0, 1)
    ]
    losses = []
    for steps, plan in zip((2, 4, 6), plans):
        config = TrainConfig(
            steps=steps, decay_steps=6, checkpoint_dir=str(tmp_path / "ckpt"), resume=steps > 2, **CONFIG
        )
        losses += pipe.train(data, config, plan=plan, timeout_s=60).losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))
