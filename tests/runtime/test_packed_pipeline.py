"""Packed pipelines on 2 CPU ranks: samples with any number of images (none included) and any
length, one capture, shapes that differ on every microbatch and rank, several schedules and the
encoder-in-bubbles plan, and loss and every gradient equal to eager on the same samples
right-padded in one batch. One launch runs every case (a launch costs seconds of start-up)."""

import pytest
import torch

from tests.models import needs_transformers
from tests.pipeline_helpers import check_equal_to_eager, even_plan
from vlmcompile.runtime.launch import launch
from vlmcompile.runtime.training import one_step

pytestmark = [needs_transformers, pytest.mark.hf, pytest.mark.multiproc]

DATASETS = {  # model -> (distribution, pixel scale to the tiny models' 28 px tiles)
    "hf-llava": ("llava-chat", 28 / 640),
    "hf-internvl": ("internvl-tiles", 28 / 448),
    "hf-qwen2-vl": ("qwen-native", 1 / 16),
    "hf-qwen2.5-vl": ("interleaved", 28 / 640),
}


def _samples(family, name, count, seed=1):
    from vlmcompile.data.synthetic import SyntheticDataset

    distribution, scale = DATASETS[name]
    data = SyntheticDataset(
        distribution, family, 64, seed=seed, text_only=0.3, text_scale=1 / 30, pixel_scale=scale
    )
    text_only = [i for i in range(64) if not data.sizes(i).images]
    return [data[i] for i in [*range(count - 1), text_only[-1]]]


def _compiled(name, longest=0):
    from vlmcompile import compile
    from vlmcompile.data.families import family_of
    from vlmcompile.models import hf_tiny
    from vlmcompile.planning.request import SearchSpace

    model = hf_tiny.build(name, batch=1)[0]
    family = family_of(model)
    samples = _samples(family, name, 8)
    lengths = [s["input_ids"].numel() for s in samples]
    tokens = max(max(lengths), sum(lengths) // 3, longest)  # rows of 1 to 4 samples: image counts vary
    space = SearchSpace(pp_choices=(2,))
    pipe = compile(model, samples, "cpu:2", search_space=space, tokens_per_microbatch=tokens, log=None)
    return model, family, samples, pipe


def _every_step(pairs):
    return [one_step(runner, batch) for runner, batch in pairs]


def test_packed_pipelines_train_like_eager_on_any_mix_of_images():
    from vlmcompile.data.packing import padded_batch

    cases = []  # (name, model, padded samples, runner, packed batch)
    for name in DATASETS:
        model, family, samples, pipe = _compiled(name)
        plans = [pipe.plan]
        if name == "hf-qwen2-vl":
            assert any(s.rank != pipe.plan.stages[0].rank for s in pipe.plan.stages[:2]), (
                "an encoder pipeline"
            )
            rows = pipe.plan.num_microbatches
            plans += [
                even_plan(pipe.layer_graph, pp=2, v=2, global_batch=rows),  # interleaved 1F1B
                even_plan(pipe.layer_graph, pp=1, dp=2, global_batch=2 * rows),  # each rank its own shapes
            ]
        for plan in plans:
            packed = pipe.pack(samples, plan)
            assert not packed.deferred
            rows = [mb["pixel_values"].shape[0] for mb in packed.microbatches]
            assert len(set(rows)) >= 2, rows  # image rows differ from microbatch to microbatch
            cases.append(
                (
                    f"{name} {plan.schedule} pp={plan.pipeline_parallel.pp}",
                    model,
                    padded_batch(samples, family),
                    pipe.runner(plan, timeout_s=60),
                    packed,
                )
            )
    per_rank = launch(_every_step, [(c[3], c[4]) for c in cases], 2, timeout_s=60)
    for k, (label, model, padded, _, _) in enumerate(cases):
        try:
            check_equal_to_eager(model, padded, [results[k] for results in per_rank])
        except AssertionError as err:
            raise AssertionError(f"{label}: {err}") from None


CONFIG = dict(lr=3e-3, warmup_steps=3, max_grad_norm=0.5, weight_decay=0.1)


@pytest.mark.parametrize("name", ["hf-qwen2-vl", "hf-llava"])
def test_twenty_adamw_steps_on_variable_data_equal_eager(name):
    """GlobalBatches of a synthetic dataset (text-only samples in it): every step other samples,
    image counts and sizes; the per-step losses equal eager's on the same steps' samples padded."""
    import copy

    from vlmcompile.data.families import family_of
    from vlmcompile.data.steps import PaddedSteps
    from vlmcompile.data.synthetic import SyntheticDataset
    from vlmcompile.models import hf_tiny
    from vlmcompile.runtime.data import GlobalBatches
    from vlmcompile.runtime.trainer import TrainConfig, eager_training

    distribution, scale = DATASETS[name]
    family = family_of(hf_tiny.build(name, batch=1)[0])
    dataset = SyntheticDataset(
        distribution, family, 40, seed=5, text_only=0.3, text_scale=1 / 30, pixel_scale=scale
    )
    longest = max(dataset[i]["input_ids"].numel() for i in range(len(dataset)))
    model, family, samples, pipe = _compiled(name, longest)
    data = GlobalBatches(dataset, 6, seed=2)
    config = TrainConfig(steps=20, **CONFIG)
    steps = pipe.packed_steps(data)
    shapes = {tuple(mb["pixel_values"].shape[0] for mb in steps(k).microbatches) for k in range(20)}
    assert len(shapes) > 5, shapes  # image rows per microbatch change from step to step
    eager = copy.deepcopy(model)
    result = pipe.train(data, config, timeout_s=60)
    expected = eager_training(eager, PaddedSteps(pipe.packed_steps(data)), config)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(expected))
