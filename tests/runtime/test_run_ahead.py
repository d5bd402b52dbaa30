"""A frozen encoder's forwards one global batch ahead (``Plan.ahead``): each step runs the next
batch's encoder forwards in its bubbles and starts with the outputs the step before made for it.
Training stays eager's over 10 AdamW steps of different batches, across a resume from a
checkpoint, and when the next batch is not given (or another batch comes than the one promised):
then the step makes its encoder outputs at its start."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models import build, needs_transformers
from tests.pipeline_helpers import check_equal_to_eager, run_ahead_plan
from vlmcompile import compile
from vlmcompile.ir.actions import ActionKind
from vlmcompile.models.synthetic_batches import SyntheticBatches
from vlmcompile.runtime.checkpoint import load_checkpoint
from vlmcompile.runtime.launch import launch
from vlmcompile.runtime.train_loop import TrainConfig, eager_training

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

GLOBAL_BATCH = 4
CONFIG = dict(lr=3e-3, weight_decay=0.1, max_grad_norm=0.5)


def _frozen_vision(name: str):
    if name.startswith("hf-"):
        from vlmcompile import families

        model, batch = families.build_tiny_by_name(name, batch=GLOBAL_BATCH)
        model.model.vision_tower.requires_grad_(False)
        # Other images each step (the text, and so the shapes, stay).
        return (
            model,
            batch,
            [{**batch, "pixel_values": batch["pixel_values"] * (1 + 0.1 * k)} for k in range(10)],
        )
    model, batch = build(name, batch_size=GLOBAL_BATCH)
    model.encoders.requires_grad_(False)
    return model, batch, SyntheticBatches(name, GLOBAL_BATCH)


def _steps_with_promises(runner, batches, promises, drop_before=None):
    """Steps of ``batches`` with ``next_batch=promises[k]`` (no optimizer); per step the loss,
    this rank's gradients, and how many steps so far made their run-ahead outputs at their start."""
    out = []
    for k, (batch, promised) in enumerate(zip(batches, promises)):
        if k == drop_before:
            runner.drop_carried()  # what loading a checkpoint does
        for p in runner.parameters():
            p.grad = None
        loss = runner.step(batch, next_batch=promised)
        grads = {n: p.grad for n, p in runner.named_parameters().items()}
        out.append(({"loss": loss, "grads": grads}, runner.run_ahead_recomputed))
    return out


@pytest.mark.parametrize(
    ("name", "ahead", "dp"),
    [
        ("tiny", 4, 1),
        pytest.param("tiny", 1, 1, marks=pytest.mark.extended),
        pytest.param("tiny", 2, 2, marks=pytest.mark.extended),
        pytest.param("demo", 2, 1, marks=pytest.mark.extended),
        pytest.param("hf-llava", 4, 1, marks=[needs_transformers, pytest.mark.hf, pytest.mark.extended]),
    ],
)
def test_ten_steps_with_the_encoder_a_batch_ahead_train_as_eager(name, ahead, dp, tmp_path):
    model, batch, data = _frozen_vision(name)
    pipe = compile(model, batch, log=None)
    plan = run_ahead_plan(pipe.layer_graph, dp=dp, global_batch=GLOBAL_BATCH, ahead=ahead)
    assert plan.run_ahead == 1 and len(plan.ahead) == ahead
    assert {a.kind for a in plan.ahead} == {ActionKind.F} and plan.forward_only_stages() == {0}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    config = TrainConfig(steps=10, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=5, **CONFIG)
    result = pipe.train(data, config, plan=plan, timeout_s=60)
    eager = copy.deepcopy(model)
    expected = eager_training(eager, data, config)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(expected))
    assert len(set(result.losses)) > 1, "the batches must differ from step to step"
    saved = load_checkpoint(tmp_path / "ckpt")["model"]
    for n, p in eager.named_parameters():
        if n in before:
            assert torch.equal(saved[n], before[n]), f"frozen {n} changed"
        else:
            torch.testing.assert_close(saved[n], p.detach(), atol=2e-4, rtol=1e-3)


def test_a_resumed_run_makes_its_encoder_outputs_again_and_trains_as_eager(tmp_path):
    model, batch, data = _frozen_vision("tiny")
    pipe = compile(model, batch, log=None)
    plan = run_ahead_plan(pipe.layer_graph, global_batch=GLOBAL_BATCH, ahead=4)
    ckpt = str(tmp_path / "ckpt")
    schedule = dict(checkpoint_dir=ckpt, checkpoint_every=5, decay_steps=10, **CONFIG)
    first = pipe.train(data, TrainConfig(steps=5, **schedule), plan=plan, timeout_s=60)
    config = TrainConfig(steps=10, resume=True, **schedule)
    rest = pipe.train(data, config, plan=plan, timeout_s=60)
    expected = eager_training(copy.deepcopy(model), data, config)
    torch.testing.assert_close(torch.tensor(first.losses + rest.losses), torch.tensor(expected))


@pytest.mark.parametrize("transfers", ["tagged", "ordered"])
def test_a_step_without_its_promised_batch_makes_the_encoder_outputs_itself(transfers):
    """The runner's own steps: the outputs made ahead are used only for the batch they were made
    for; a step given no next batch leaves the next to make its own. Ordered transfers (NCCL's
    pairing, on gloo) send the outputs made ahead first, as the step starts."""
    model, batch, data = _frozen_vision("tiny")
    pipe = compile(model, batch, log=None)
    plan = run_ahead_plan(pipe.layer_graph, global_batch=GLOBAL_BATCH, ahead=4)
    b = [data(k) for k in range(5)]
    # step 0 makes its own; 1 and 2 use the ones made ahead; 2 promises nothing, so 3 makes its own;
    # 3 promises b[4] but step 4 gets b[0]: it makes its own again; 4 promises b[1], but they are
    # dropped before step 5 (as a checkpoint load does): it makes its own too.
    batches, promises = [b[0], b[1], b[2], b[3], b[0], b[1]], [b[1], b[2], None, b[4], b[1], None]
    runner = pipe.runner(plan, timeout_s=60)
    runner.transfers = transfers
    results = launch(_steps_with_promises, runner, 2, args=(batches, promises, 5), timeout_s=60)
    for k, batch in enumerate(batches):  # no optimizer step: each step is eager's on its batch
        check_equal_to_eager(model, batch, [steps[k][0] for steps in results])
    producers = {r for r, acts in enumerate(plan.actions) if set(acts) & set(plan.carried())}
    assert producers, "some rank makes outputs for the next step"
    for rank, steps in enumerate(results):
        made = [count for _, count in steps]
        assert made == ([1, 1, 1, 2, 3, 4] if rank in producers else [0] * 6), (rank, made)
