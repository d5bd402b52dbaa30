"""A packed step without a single image trains like eager: eager never runs the vision encoder
on it, so the encoder's parameters get no gradient and AdamW leaves them alone (no momentum
step, no weight decay); the pipeline runs the encoder on a stand-in image and must drop the
all-zero gradients that gives."""

from __future__ import annotations

import copy
import dataclasses

import torch

from vlmcompile import families, models
from vlmcompile.data.packed_step import PackedStep
from vlmcompile.data.steps import PackedSteps, PaddedSteps
from vlmcompile.data.synthetic import SyntheticDataset
from vlmcompile.runtime.global_batches import GlobalBatches
from vlmcompile.runtime.gradients import drop_unused_gradients


def test_only_all_zero_gradients_are_dropped():
    used, unused, untouched = (torch.nn.Parameter(torch.ones(3)) for _ in range(3))
    used.grad, unused.grad = torch.tensor([0.0, 1e-30, 0.0]), torch.zeros(3)
    drop_unused_gradients([used, unused, untouched])
    assert used.grad is not None and unused.grad is None and untouched.grad is None


def test_an_optimizer_with_state_over_a_text_only_step_matches_eager_only_with_the_zeros_dropped():
    # SGD with momentum and weight decay skips a parameter without a gradient as AdamW does,
    # without AdamW's scaling of gradients that are zero but for rounding (a key bias's) up to
    # a step of lr, which would hide what this checks.
    model = models.build("tiny")
    family = families.layout_of(model)
    data = SyntheticDataset(
        "interleaved", family, 24, seed=3, text_only=0.5, text_scale=1 / 30, pixel_scale=16 / 640
    )
    batches = dataclasses.replace(GlobalBatches(data, 2, seed=0), collate=list)
    steps = PackedSteps(batches, family, 4 * max(data[i]["input_ids"].numel() for i in range(len(data))), 2)
    text_only = [k for k in range(12) if not steps(k).images]
    with_images = [k for k in range(12) if steps(k).images]
    assert text_only and with_images, "the steps mix image steps and text-only ones"
    order = [with_images[0], text_only[0], with_images[1]]

    def train(packed: bool, drop: bool) -> list[torch.Tensor]:
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
        step = PackedStep(m, family)
        for k in order:
            opt.zero_grad(set_to_none=True)
            if packed:
                batch = steps(k)
                for mb in batch.microbatches:
                    step(**mb).backward()
                if drop and not batch.images:
                    drop_unused_gradients(list(m.parameters()))
            else:
                m(**PaddedSteps(steps)(k)).backward()
            opt.step()
        return [p.detach().clone() for p in m.parameters()]

    eager, dropped, kept = train(False, False), train(True, True), train(True, False)
    for a, b in zip(eager, dropped):
        torch.testing.assert_close(b, a)
    assert any(not torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(eager, kept))
