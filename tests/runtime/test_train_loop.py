"""The training loop on local CPU ranks: AdamW with an LR schedule and a global gradient clip
trains like eager step for step; checkpoints resume with the same losses and load into the
original model."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import shutil
import statistics

import pytest
import torch

from tests.models import build, needs_transformers
from tests.pipeline_helpers import even_plan
from vlmcompile import compile
from vlmcompile.models.synthetic_batches import SyntheticBatches
from vlmcompile.runtime.checkpoint import CheckpointError, load_checkpoint
from vlmcompile.runtime.train_loop import NonFiniteStepError, TrainConfig, eager_training

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]


def _setup(name, **plan_options):
    model, batch = build(name, batch_size=4)
    pipe = compile(model, batch, log=None)
    plan = even_plan(pipe.layer_graph, global_batch=4, **plan_options)
    return model, pipe, plan


# A clip small enough to bind on most steps: the test must see clipping, not a no-op.
CONFIG = dict(lr=3e-3, warmup_steps=3, max_grad_norm=0.5, weight_decay=0.1)


@pytest.mark.parametrize(
    ("name", "plan_options", "transfers"),
    [
        ("tiny", dict(pp=2, recompute=(2,)), "auto"),
        ("tiny-tied", dict(pp=2, cuts=[6]), "auto"),  # the embedding on rank 0, its tied head on rank 1
        ("tiny", dict(pp=2, dp=2), "auto"),
        pytest.param("tiny", dict(pp=2, v=2), "ordered", marks=pytest.mark.extended),  # test_transfers has it
    ],
    ids=["pp2", "tied-pp2", "pp2-dp2", "interleaved-ordered-transfers"],
)
def test_twenty_adamw_steps_equal_eager(name, plan_options, transfers, tmp_path):
    model, pipe, plan = _setup(name, **plan_options)
    if name == "tiny-tied":
        ranks = {layer: s.rank for s in plan.stages for layer in s.layers}
        assert ranks["llm.embed"] != ranks["head"], "the tie must cross ranks"
    data = SyntheticBatches(name, 4)
    config = TrainConfig(steps=20, log_jsonl=str(tmp_path / "log.jsonl"), **CONFIG)
    result = pipe.train(data, config, plan=plan, transfers=transfers, timeout_s=60)
    expected = eager_training(copy.deepcopy(model), data, config)
    with torch.no_grad():
        untrained = [float(model(**data(step))) for step in range(20)]
    # Random tokens leave nothing to learn, but the steps must change the losses beyond the tolerance.
    assert max(abs(a - b) for a, b in zip(expected, untrained)) > 0.01, "AdamW should move the loss"
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(expected))
    norms = [m.grad_norm for m in result.steps]
    assert max(norms) > CONFIG["max_grad_norm"], "the clip never bound: the test would not see it"
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 21))
    assert all(x["samples_per_s"] > 0 and 0 < x["mfu"] < 1 for x in lines)
    # The schedule, written out: linear warm-up over 3 steps, then cosine from lr to lr / 10.
    peak, warmup = CONFIG["lr"], CONFIG["warmup_steps"]
    expected_lr = [
        peak * (k + 1) / warmup
        if k < warmup
        else peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - warmup) / 17)))
        for k in range(20)
    ]
    assert [x["lr"] for x in lines] == pytest.approx(expected_lr)


@pytest.mark.extended  # outside CI's 15 minutes; test_preemption's stop-and-resume case stays
def test_a_resumed_run_continues_with_the_same_losses_and_loads_into_the_model(tmp_path):
    model, pipe, plan = _setup("tiny", pp=2, dp=2)
    data = SyntheticBatches("tiny", 4)
    whole = pipe.train(data, TrainConfig(steps=8, **CONFIG), plan=plan, timeout_s=60)
    ckpt = str(tmp_path / "ckpt")
    first = pipe.train(
        data, TrainConfig(steps=8, checkpoint_dir=ckpt, checkpoint_every=4, **CONFIG), plan=plan, timeout_s=60
    )
    assert first.checkpoints[0].endswith("step_000004")
    # A run stopped after step 4: resume from the step-4 checkpoint under another plan's ranks.
    shutil.rmtree(tmp_path / "ckpt" / "step_000008")
    other = even_plan(pipe.layer_graph, pp=2, v=2, global_batch=4)
    resumed = pipe.train(
        data, TrainConfig(steps=8, checkpoint_dir=ckpt, resume=True, **CONFIG), plan=other, timeout_s=60
    )
    assert resumed.resumed_from == 4 and [m.step for m in resumed.steps] == [5, 6, 7, 8]
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(whole.losses[4:]))

    saved = load_checkpoint(tmp_path / "ckpt" / "step_000008")
    assert saved["step"] == 8
    original = copy.deepcopy(model)
    original.load_state_dict(saved["model"])  # strict: every name is the original model's
    config = TrainConfig(steps=8, **CONFIG)
    eager = copy.deepcopy(model)
    eager_training(eager, data, config)
    # Adam divides by sqrt(v): a gradient near zero summed in another order moves its update by
    # more than fp32's default tolerance, though every loss above matched.
    for name, p in eager.state_dict().items():
        torch.testing.assert_close(
            original.state_dict()[name], p, atol=2e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.extended  # outside CI's 15 minutes (the README's test command runs it)
def test_a_checkpoint_of_another_model_names_the_parameters_that_differ(tmp_path):
    _, pipe, plan = _setup("tiny", pp=2)
    ckpt = str(tmp_path / "ckpt")
    pipe.train(
        SyntheticBatches("tiny", 4), TrainConfig(steps=1, checkpoint_dir=ckpt), plan=plan, timeout_s=60
    )
    _, other_pipe, other_plan = _setup("tiny-two-encoder", pp=2)
    with pytest.raises(Exception, match=r"not of this model: \d+ parameters missing from it \(") as info:
        other_pipe.train(
            SyntheticBatches("tiny-two-encoder", 4),
            TrainConfig(steps=2, checkpoint_dir=ckpt, resume=True),
            plan=other_plan,
            timeout_s=60,
        )
    assert "CheckpointError" in str(info.value)
    # The other way round: the larger model's checkpoint holds what the smaller one lacks.
    bigger = str(tmp_path / "bigger")
    other_pipe.train(
        SyntheticBatches("tiny-two-encoder", 4),
        TrainConfig(steps=1, checkpoint_dir=bigger),
        plan=other_plan,
        timeout_s=60,
    )
    with pytest.raises(Exception, match=r"tensors the model does not have \(encoders\.1\."):
        pipe.train(
            SyntheticBatches("tiny", 4),
            TrainConfig(steps=2, checkpoint_dir=bigger, resume=True),
            plan=plan,
            timeout_s=60,
        )


@pytest.mark.extended  # outside CI's 15 minutes (the README's test command runs it)
def test_a_run_resumed_under_another_lr_schedule_is_refused_naming_what_changed(tmp_path):
    _, pipe, plan = _setup("tiny", pp=2)
    ckpt = str(tmp_path / "ckpt")
    data = SyntheticBatches("tiny", 4)
    pipe.train(data, TrainConfig(steps=4, checkpoint_dir=ckpt, checkpoint_every=2), plan=plan, timeout_s=60)
    shutil.rmtree(tmp_path / "ckpt" / "step_000004")  # stopped after step 2
    with pytest.raises(
        Exception, match=r"another LR schedule: decay_steps 4 \(now 6\), lr 0.0001 \(now 0.001\)"
    ):
        pipe.train(
            data, TrainConfig(steps=6, lr=1e-3, checkpoint_dir=ckpt, resume=True), plan=plan, timeout_s=60
        )
    # Extended with the decay's end kept: accepted.
    longer = pipe.train(
        data, TrainConfig(steps=6, decay_steps=4, checkpoint_dir=ckpt, resume=True), plan=plan, timeout_s=60
    )
    assert [m.step for m in longer.steps] == [3, 4, 5, 6]


def test_mfu_is_over_the_peak_of_the_device_the_ranks_run_on():
    from vlmcompile.cost_models.cluster import Cluster

    _, pipe, plan = _setup("tiny", pp=2)
    runner = pipe.runner(dataclasses.replace(plan, cluster="a100x2"), timeout_s=60)
    gpu = pipe.throughput(runner, on_gpu=True)
    assert gpu.peak_flops_per_s == Cluster.preset("a100x2").device.peak_flops_per_s
    cpu = pipe.throughput(runner, on_gpu=False)
    assert cpu.peak_flops_per_s == Cluster.preset("cpu:2").device.peak_flops_per_s
    assert cpu.global_batch == 4 and cpu.mfu(1.0) == pytest.approx(
        4 * cpu.flops_per_sample / (2 * cpu.peak_flops_per_s)
    )


def test_training_on_gpus_without_torchrun_says_to_use_it():
    _, pipe, plan = _setup("tiny", pp=2)
    with pytest.raises(ValueError, match="start one process per GPU with torchrun"):
        pipe.train(SyntheticBatches("tiny", 4), TrainConfig(steps=1), plan=plan, device="cuda")


def test_bad_training_options_are_named():
    with pytest.raises(ValueError, match="steps=0"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="warmup_steps=5 must be between 0 and steps=3"):
        TrainConfig(steps=3, warmup_steps=5)
    with pytest.raises(ValueError, match="need a checkpoint_dir"):
        TrainConfig(steps=3, resume=True)


def test_data_whose_batches_do_not_match_the_compiled_shapes_is_refused_before_ranks_start():
    _, pipe, plan = _setup("tiny", pp=2)
    with pytest.raises(ValueError, match=r"batch\['pixel_values'\] is \[8, .*; the pipeline expects \[4, "):
        pipe.train(SyntheticBatches("tiny", 8), TrainConfig(steps=2), plan=plan, timeout_s=60)


def test_a_later_batch_of_other_shapes_names_its_step():
    _, pipe, plan = _setup("tiny", pp=2)
    batches = [SyntheticBatches("tiny", 4)(0), SyntheticBatches("tiny", 2)(1)]
    with pytest.raises(Exception, match=r"global batch for step 2: batch\['pixel_values'\] is \[2, "):
        pipe.train(iter(batches), TrainConfig(steps=2), plan=plan, timeout_s=60)


def _batches_with_nan_pixels(step: int, sample: int, steps: int) -> list[dict]:
    """``steps`` global batches of 4 samples; sample ``sample`` of step ``step`` (1-based) has a
    NaN pixel."""
    batches = [SyntheticBatches("tiny", 4)(k) for k in range(steps)]
    batches[step - 1]["pixel_values"][sample].view(-1)[7] = float("nan")
    return batches


def test_a_non_finite_step_stops_before_the_update_naming_the_step_and_the_samples(tmp_path):
    """NaN pixels in sample 3 of step 3 (data-parallel rank 1's shard): the run stops before
    step 3's update, in one line, and nothing non-finite is saved or made latest."""
    _, pipe, plan = _setup("tiny", pp=2, dp=2)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(NonFiniteStepError) as info:
        pipe.train(
            _batches_with_nan_pixels(3, 3, 5),
            TrainConfig(steps=5, checkpoint_dir=str(ckpt), checkpoint_every=1),
            plan=plan,
            timeout_s=60,
        )
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "step 3: the loss is nan and the gradient norm nan: stopped before the optimizer step"
    )
    assert (
        "batch['pixel_values'] holds NaN or infinite values in sample 3 (the shard of data-parallel rank 1)"
        in message
    )
    assert f"the newest checkpoint is {ckpt / 'step_000002'}" in message
    assert "--skip-nonfinite-steps" in message
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000001", "step_000002"]
    assert (ckpt / "latest").read_text() == "step_000002\n"
    saved = load_checkpoint(ckpt)["model"]
    assert all(torch.isfinite(t).all() for t in saved.values())


def test_skipped_non_finite_steps_train_like_eager_that_skips_them(tmp_path):
    """``on_nonfinite="skip"``: the step's update, optimizer state and LR step are left out, as
    an eager loop that skips the step; the count is in the metrics."""
    model, pipe, plan = _setup("tiny", pp=2, dp=2)
    data = _batches_with_nan_pixels(2, 0, 5)
    config = TrainConfig(steps=5, on_nonfinite="skip", **CONFIG)
    result = pipe.train(
        data, dataclasses.replace(config, checkpoint_dir=str(tmp_path / "ckpt")), plan=plan, timeout_s=60
    )
    eager = copy.deepcopy(model)
    expected = eager_training(eager, data, config)
    assert math.isnan(expected[1]) and math.isnan(result.losses[1])
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(expected), equal_nan=True)
    assert [m.skipped for m in result.steps] == [False, True, False, False, False]
    assert [m.skipped_steps for m in result.steps] == [0, 1, 1, 1, 1] and result.skipped_steps == 1
    assert "1 steps skipped (non-finite)" in str(result)
    assert "step 2: skipped: loss nan" in str(result.steps[1])
    saved = load_checkpoint(tmp_path / "ckpt")["model"]
    for name, p in eager.state_dict().items():
        torch.testing.assert_close(saved[name], p, atol=2e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


def _bf16_step(runner, batch):
    from vlmcompile.runtime.timed_steps import one_step

    out = one_step(runner, batch)
    dtypes = {str(p.dtype) for p in runner.parameters()} | {
        str(g.dtype) for g in out["grads"].values() if g is not None
    }
    return {**out, "dtypes": dtypes}


@pytest.mark.extended  # outside CI's 15 minutes (the README's test command runs it)
def test_bf16_autocast_keeps_fp32_weights_and_gradients_and_matches_eager_autocast():
    from vlmcompile.runtime.launch import launch

    model, pipe, plan = _setup("tiny", pp=2, dp=2)
    batch = SyntheticBatches("tiny", 4)(0)
    runner = pipe.runner(plan, timeout_s=60)
    runner.autocast_dtype = torch.bfloat16
    results = launch(_bf16_step, runner, 4, args=(batch,), timeout_s=60)
    eager = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = eager(**batch)
    loss.backward()
    fp32 = copy.deepcopy(model)
    fp32(**batch).backward()
    grads = dict(eager.named_parameters())
    for result in results:
        assert result["dtypes"] == {"torch.float32"}
        torch.testing.assert_close(result["loss"], loss.detach().float(), rtol=1e-3, atol=1e-3)
        for name, g in result["grads"].items():
            torch.testing.assert_close(
                g, grads[name].grad, rtol=2e-2, atol=2e-3, msg=lambda m, n=name: f"{n}: {m}"
            )
    # bf16 compute is what ran: the loss differs from fp32 eager's by more than fp32 noise.
    with torch.no_grad():
        assert abs(float(results[0]["loss"]) - float(fp32(**batch))) > 1e-5


@pytest.mark.parametrize(
    "name", ["tiny-tied", pytest.param("hf-llava", marks=[needs_transformers, pytest.mark.hf])]
)
def test_a_checkpoint_loads_strictly_into_the_original_model(name, tmp_path):
    """Tied parameters under each of their names, persistent buffers included: the original
    model's own ``load_state_dict`` (strict) takes the checkpoint."""
    model, batch = build(name, batch_size=4)
    pipe = compile(model, batch, log=None)
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
    cuts = [6] if name == "tiny-tied" else None  # the tied embedding and head on two ranks
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=rows, cuts=cuts)
    ckpt = tmp_path / "ckpt"
    pipe.train(
        [batch, batch], TrainConfig(steps=2, checkpoint_dir=str(ckpt), lr=1e-2), plan=plan, timeout_s=60
    )
    saved = load_checkpoint(ckpt / "step_000002")
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(saved["model"])  # strict
    changed = [
        n for n, p in fresh.named_parameters() if not torch.equal(p, dict(model.named_parameters())[n])
    ]
    assert changed, "two AdamW steps should have moved the weights"
    assert set(saved["model"]) == set(model.state_dict())


def test_global_batches_from_a_dataset_train_like_eager_across_epochs():
    from vlmcompile.runtime.global_batches import GlobalBatches

    model, pipe, plan = _setup("tiny", pp=2, dp=2)
    samples = [SyntheticBatches("tiny", 1, seed=k)(0) for k in range(10)]
    data = GlobalBatches(samples, 4, seed=3)
    first_epoch = data.indices(0) + data.indices(1) + data.indices(2)[:2]
    assert sorted(first_epoch) == list(range(10)), "an epoch takes each sample once, its last two included"
    second_epoch = data.indices(2)[2:] + data.indices(3) + data.indices(4)
    assert sorted(second_epoch) == list(range(10)) and second_epoch != first_epoch, "each epoch its own order"
    config = TrainConfig(steps=5, **CONFIG)
    result = pipe.train(data, config, plan=plan, timeout_s=60)
    torch.testing.assert_close(
        torch.tensor(result.losses), torch.tensor(eager_training(copy.deepcopy(model), data, config))
    )
    assert result.samples == 20 and result.epochs == 2.0 and "20 samples trained (2.00 epochs" in str(result)
    with pytest.raises(ValueError, match="holds 10 samples, fewer than global_batch=16"):
        GlobalBatches(samples, 16)


@pytest.mark.extended  # outside CI's 15 minutes (the README's test command runs it)
def test_any_torch_optimizer_trains_like_eager_and_resumes_with_its_own_state(tmp_path):
    """SGD with momentum (state: momentum_buffer) instead of AdamW, a constant LR: equal to eager,
    and a run resumed from step 3 continues with the uninterrupted run's losses."""
    model, pipe, plan = _setup("tiny", pp=2)
    data = SyntheticBatches("tiny", 4)
    sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    config = TrainConfig(steps=6, decay="constant", max_grad_norm=None)
    ckpt = str(tmp_path / "ckpt")
    whole = pipe.train(
        data,
        dataclasses.replace(config, checkpoint_dir=ckpt, checkpoint_every=3),
        plan=plan,
        optimizer=sgd,
        timeout_s=60,
    )
    expected = eager_training(copy.deepcopy(model), data, config, optimizer_factory=sgd)
    torch.testing.assert_close(torch.tensor(whole.losses), torch.tensor(expected))
    shutil.rmtree(tmp_path / "ckpt" / "step_000006")  # stopped after step 3
    resumed = pipe.train(
        data,
        dataclasses.replace(config, checkpoint_dir=ckpt, resume=True),
        plan=plan,
        optimizer=sgd,
        timeout_s=60,
    )
    assert resumed.resumed_from == 3
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(expected[3:]))
    states = load_checkpoint(tmp_path / "ckpt" / "step_000003")["optimizer"]
    assert states and all(set(s) == {"momentum_buffer"} for s in states.values()), (
        "the optimizer's own state is saved"
    )


def test_metrics_add_up_and_checkpoints_are_announced_and_kept(tmp_path, capfd):
    """Every step logs its rates and every rank's peak memory; the summary's figures are the
    medians of the JSON lines' same steps; each save prints a line, ``keep_last`` removes the
    older ones, and ``load_checkpoint`` of the run's directory follows ``latest``."""
    _, pipe, plan = _setup("tiny", pp=2)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    config = TrainConfig(
        steps=6,
        checkpoint_dir=str(ckpt),
        checkpoint_every=2,
        keep_last=2,
        log_jsonl=str(log),
        progress=True,
        **CONFIG,
    )
    result = pipe.train(SyntheticBatches("tiny", 4), config, plan=plan, timeout_s=60)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for x in lines:
        assert len(x["peak_mem_bytes"]) == 2 and min(x["peak_mem_bytes"]) > 2**20
        assert x["tokens_per_s"] > x["samples_per_s"] > 0
        per_sample = x["tokens_per_s"] / x["samples_per_s"]
        assert per_sample == pytest.approx(round(per_sample)), "tokens per sample is a whole sequence"
    medians = result.medians()
    for key in ("step_s", "samples_per_s", "tokens_per_s", "mfu"):
        assert medians[key] == pytest.approx(statistics.median(x[key] for x in lines[1:])), key
    text = str(result)
    assert (
        f"medians over steps 2-6: step {medians['step_s']:.3f} s, {medians['samples_per_s']:.2f} samples/s"
        in text
    )
    assert f"MFU {100 * medians['mfu']:.1f} %" in text

    assert sorted(p.name for p in ckpt.iterdir()) == [
        ".vlmcompile.lock",
        "latest",
        "step_000004",
        "step_000006",
    ]
    assert [p.rsplit("/", 1)[1] for p in result.checkpoints] == ["step_000004", "step_000006"]
    assert load_checkpoint(ckpt)["step"] == 6
    err = capfd.readouterr().err
    assert err.count("saved checkpoint") == 3 and "removed" in err and "(keep_last)" in err
    assert "ETA 0:0" in err
    with pytest.raises(CheckpointError, match="holds no checkpoint; give a step_NNNNNN directory"):
        load_checkpoint(tmp_path)


@dataclasses.dataclass(frozen=True)
class _DataFailingAt:
    """Good global batches, but step ``at`` (0-based) fails alike on every rank, as a broken
    sample does."""

    good: SyntheticBatches
    at: int

    def __call__(self, step: int):
        from vlmcompile.ir.errors import DataError

        if step == self.at:
            raise DataError("sample 3 of this step cannot be read (a broken file)")
        return self.good(step)


def test_a_step_whose_data_fails_saves_the_steps_before_it_and_the_run_goes_on_from_there(tmp_path):
    from vlmcompile.ir.errors import DataError

    model, pipe, plan = _setup("tiny", pp=2)
    good = SyntheticBatches("tiny", 4)
    config = TrainConfig(steps=4, checkpoint_dir=str(tmp_path / "ckpt"), **CONFIG)
    with pytest.raises(DataError) as info:
        pipe.train(_DataFailingAt(good, 2), config, plan=plan, timeout_s=60)
    message = str(info.value)
    assert "the data's global batch for step 3: sample 3 of this step cannot be read" in message, message
    assert (
        f"the steps before it were saved first: the newest checkpoint is {tmp_path / 'ckpt' / 'step_000002'}"
        in message
    )
    resumed = pipe.train(good, dataclasses.replace(config, resume=True), plan=plan, timeout_s=60)
    assert [m.step for m in resumed.steps] == [3, 4]
    expected = eager_training(copy.deepcopy(model), good, TrainConfig(steps=4, **CONFIG))
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(expected[2:]))


def test_a_step_without_label_tokens_stops_saying_so_after_saving_the_steps_before_it(tmp_path):
    """Every label of step 2 is -100: its loss is 0/0 in eager too. The stop names that cause (not
    a divergence), after saving step 1 (no checkpoint was due)."""
    _, pipe, plan = _setup("tiny", pp=2)
    batches = [SyntheticBatches("tiny", 4)(k) for k in range(3)]
    batches[1]["labels"] = torch.full_like(batches[1]["labels"], -100)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(NonFiniteStepError) as info:
        pipe.train(batches, TrainConfig(steps=3, checkpoint_dir=str(ckpt)), plan=plan, timeout_s=60)
    message = str(info.value)
    assert message.startswith("step 2: the loss is nan"), message
    assert "the global batch has no label token (every label is -100), so its loss is 0/0" in message
    assert "diverged" not in message
    assert f"the steps before it were saved first: the newest checkpoint is {ckpt / 'step_000001'}" in message
