"""A contrastive two-tower step on local CPU ranks: towers in several microbatches a rank, the loss
on the whole global batch; loss and every gradient equal eager's on that batch, also after SGD
steps with global-norm clipping. The negative controls - a loss per microbatch, a local loss
without the gathered embeddings' gradients, that gather under a mean all-reduce - are each
caught by the same check."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.models import TWO_TOWER_REGIONS, TwoTowers, build, needs_transformers, two_tower_batch
from tests.pipeline_helpers import check_equal_to_eager, eager_step
from vlmcompile import compile
from vlmcompile.ir.contrastive_loss import batch_loss
from vlmcompile.ir.errors import ArgumentError
from vlmcompile.ir.microbatch import num_samples
from vlmcompile.planning.contrastive_placement import separate_towers
from vlmcompile.planning.request import SearchSpace
from vlmcompile.runtime.collectives import Deadline, sum_gradients
from vlmcompile.runtime.contrastive import ContrastiveStep
from vlmcompile.runtime.launch import launch
from vlmcompile.runtime.timed_steps import one_step

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]
COLOCATED_2 = SearchSpace(tower_microbatches=2, tower_placement="colocated")
"""Both towers on each of the 2 ranks, 2 microbatches a rank (the tests' split, whatever compile
would choose)."""


def _compiled(name: str, samples: int = 7):
    if name.startswith("hf-"):
        from vlmcompile import families

        model, batch = families.build_tiny_by_name(name, batch=samples)
    else:
        model, batch = build(name, batch_size=samples)
    pipe = compile(model, batch, "cpu:2", search_space=COLOCATED_2, log=None)
    return model, batch, pipe


def every_step(steps, batch) -> list[dict]:
    """On each rank: one step of every contrastive step given (one launch for several plans)."""
    return [one_step(step, batch) for step in steps]


NAMES = [
    "tiny-contrastive",
    # CLIP also trains in test_transformers_vlms.py and the README's example: CI runs SigLIP here.
    pytest.param(
        "hf-clip", marks=[needs_transformers, pytest.mark.hf, pytest.mark.slow, pytest.mark.extended]
    ),
    pytest.param("hf-siglip", marks=[needs_transformers, pytest.mark.hf, pytest.mark.slow]),
]


@pytest.mark.parametrize("name", NAMES)
def test_one_step_equals_eager_on_the_whole_global_batch(name):
    model, batch, pipe = _compiled(name)
    # 7 samples on 2 ranks: 4 + 3, in microbatches of 2 + 2 and 2 + 1; loss tiles of 2 rows;
    # activations kept through the loss, and recomputed after it.
    plans = [dataclasses.replace(pipe.tower_plan, memory=m, tile_rows=2) for m in ("keep", "recompute")]
    assert all(p.split.microbatches == ((2, 2), (2, 1)) for p in plans)
    steps = [pipe.contrastive_step(p, timeout_s=60) for p in plans]
    per_rank = launch(every_step, steps, 2, args=(batch,), timeout_s=60)
    for k in range(len(plans)):
        check_equal_to_eager(model, batch, [rank[k] for rank in per_rank])


def sgd_steps(step: ContrastiveStep, batch, num_steps: int, lr: float, max_norm: float) -> dict:
    """``num_steps`` steps of SGD after a global-norm clip: the losses and the final parameters."""
    params = step.named_parameters()
    losses = []
    for _ in range(num_steps):
        for p in params.values():
            p.grad = None
        losses.append(step.step(batch))
        _sgd(list(params.values()), lr, max_norm)
    return {"losses": torch.stack(losses), "params": {n: p.detach() for n, p in params.items()}}


def _sgd(params, lr: float, max_norm: float) -> None:
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= lr * p.grad


@pytest.mark.parametrize(
    "name",
    [
        "tiny-contrastive",
        pytest.param(
            "hf-siglip", marks=[needs_transformers, pytest.mark.hf, pytest.mark.slow, pytest.mark.extended]
        ),
    ],
)
def test_three_sgd_steps_with_a_global_clip_equal_eager(name):
    model, batch, pipe = _compiled(name)
    eager = copy.deepcopy(model)
    _, grads = eager_step(eager, batch)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values() if g is not None]))
    max_norm = 0.7 * float(norm)  # binds on the first step at least
    plan = dataclasses.replace(pipe.tower_plan, tile_rows=3)
    results = pipe.launch(sgd_steps, plan=plan, args=(batch, 3, 0.5, max_norm), timeout_s=60)
    eager = copy.deepcopy(model)
    params = dict(eager.named_parameters())
    losses = []
    for _ in range(3):
        eager.zero_grad(set_to_none=True)
        loss, _ = eager_step(eager, batch)
        losses.append(loss)
        _sgd(list(params.values()), 0.5, max_norm)
    for rank, result in enumerate(results):
        torch.testing.assert_close(
            result["losses"], torch.stack(losses), msg=lambda m, r=rank: f"rank {r}: {m}"
        )
        for n, p in result["params"].items():
            torch.testing.assert_close(p, params[n].detach(), msg=lambda m, n=n: f"{n}: {m}")


class _LossPerMicrobatch(ContrastiveStep):
    """NeMo's mistake: each microbatch's own contrastive loss, weighted by its samples."""

    def step(self, batch):
        rank = dist.get_rank()
        total = torch.zeros(())
        for mb in self._microbatches(batch, rank, 0):  # both towers on every rank: the same microbatches
            a, b = self._run_tower(mb, 0), self._run_tower(mb, 1)
            outs = list(self.scalars()) if self.scalars is not None else []
            values = dict(zip(self.loss.scalars, outs))
            loss = batch_loss(self.loss, a, b, values.get(self.loss.scale), values.get(self.loss.bias))
            loss = loss * num_samples(mb) / self.split.num_samples
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        sum_gradients(self.parameters(), None, Deadline(rank, 60), "grads", {})
        return total


class _LocalLoss(ContrastiveStep):
    """open_clip's ``--local-loss`` without ``--gather-with-grad``: the gathered embeddings carry
    no gradient back to the ranks that made them."""

    def _scatter(self, full, tower, rank, world, deadline):
        return torch.zeros((self.placements[tower].rows_of(rank)[1], *full.shape[1:]))


class _LocalLossMeanReduced(_LocalLoss):
    """The same gather under DDP's mean all-reduce: gradients divided by the world size."""

    def step(self, batch):
        loss = super().step(batch)
        for p in self.parameters():
            if p.grad is not None:
                p.grad /= dist.get_world_size()
        return loss


def mistakes_and_accumulation(steps, batch) -> dict:
    """On each rank: one step of every step given, and two steps of the first without zeroing the
    gradients in between (gradient accumulation)."""
    out = {"steps": every_step(steps, batch)}
    right = steps[0]
    for p in right.parameters():
        p.grad = None
    right.step(batch)
    right.step(batch)
    out["accumulated"] = {n: p.grad for n, p in right.named_parameters().items()}
    return out


def test_each_known_mistake_is_caught_by_the_check_and_gradients_accumulate():
    model, batch, pipe = _compiled("tiny-contrastive")
    right = pipe.contrastive_step(timeout_s=60)
    wrong = []
    for cls in (_LossPerMicrobatch, _LocalLoss, _LocalLossMeanReduced):
        step = cls.__new__(cls)
        step.__dict__.update(right.__dict__)
        wrong.append(step)
    per_rank = launch(mistakes_and_accumulation, [right, *wrong], 2, args=(batch,), timeout_s=60)
    check_equal_to_eager(model, batch, [rank["steps"][0] for rank in per_rank])
    for k in range(1, len(wrong) + 1):
        with pytest.raises(AssertionError, match="not close"):
            check_equal_to_eager(model, batch, [rank["steps"][k] for rank in per_rank])
    # Two steps into the same .grad: twice eager's gradient, not the first summed over the ranks again.
    _, grads = eager_step(model, batch)
    for rank in per_rank:
        for n, g in rank["accumulated"].items():
            # Two roundings of each gradient: twice assert_close's fp32 tolerances.
            torch.testing.assert_close(
                g, 2 * grads[n], rtol=2.6e-6, atol=2e-5, msg=lambda m, n=n: f"{n}: {m}"
            )


def test_a_frozen_tower_and_temperature_train_like_eager():
    # LiT: the image tower locked, and here the temperature too; only the text tower trains.
    model, batch = build("tiny-contrastive", batch_size=7)
    for p in [*model.vision.parameters(), *model.head.image_proj.parameters(), model.head.logit_scale]:
        p.requires_grad_(False)
    pipe = compile(model, batch, "cpu:2", search_space=COLOCATED_2, log=None)
    plans = [dataclasses.replace(pipe.tower_plan, memory=m) for m in ("keep", "recompute")]
    per_rank = launch(every_step, [pipe.contrastive_step(p) for p in plans], 2, args=(batch,), timeout_s=60)
    for k in range(len(plans)):
        results = [rank[k] for rank in per_rank]
        assert all(results[0]["grads"][n] is None for n in ("head.logit_scale", "vision.embed.pos"))
        check_equal_to_eager(model, batch, results)


def test_a_global_batch_smaller_than_the_ranks_is_refused():
    model, batch = build("tiny-contrastive", batch_size=2)
    with pytest.raises(ArgumentError, match="cannot give each of 4 ranks a sample; give at least 4"):
        compile(model, batch, "cpu:4", log=None)


SIGLIP = [needs_transformers, pytest.mark.hf, pytest.mark.slow]


@pytest.mark.parametrize(
    ("name", "ranks", "microbatches"),
    [
        ("tiny-contrastive", (1, 1), (2, 3)),
        ("tiny-contrastive", (2, 1), (2, 1)),
        # (SigLIP's towers apart run extended only: CI's 15 minutes; the tiny pair covers them.)
        pytest.param("hf-siglip", (1, 1), (2, 3), marks=[*SIGLIP, pytest.mark.extended]),
        pytest.param("hf-siglip", (2, 1), (2, 1), marks=[*SIGLIP, pytest.mark.extended]),
    ],
)
def test_towers_on_ranks_of_their_own_train_like_eager(name, ranks, microbatches):
    model, batch, pipe = _compiled(name)
    plan = separate_towers(pipe.tower_plan, ranks, microbatches)
    assert plan.num_ranks == sum(ranks) and plan.placement(1).ranks == tuple(range(ranks[0], sum(ranks)))
    # Each tower its own activation policy: the first keeps, the second recomputes.
    own = [dataclasses.replace(p, memory=m) for p, m in zip(plan.separate, ("keep", "recompute"))]
    plans = [
        plan,
        dataclasses.replace(plan, memory="recompute", tile_rows=2),
        dataclasses.replace(plan, separate=tuple(own)),
    ]
    per_rank = launch(
        every_step, [pipe.contrastive_step(p) for p in plans], sum(ranks), args=(batch,), timeout_s=60
    )
    for k in range(len(plans)):
        results = [rank[k] for rank in per_rank]
        # A rank holds its tower's parameters (and the loss's scalars), not the other tower's.
        held = [set(r["grads"]) for r in results]
        assert held[0] != held[-1]
        check_equal_to_eager(model, batch, results)


def test_a_layer_both_towers_run_sums_its_gradient_over_both_towers_ranks():
    model, batch = TwoTowers(shared=True), two_tower_batch(6)
    space = SearchSpace(tower_placement="separate")
    pipe = compile(model, batch, "cpu:2", region_overrides=TWO_TOWER_REGIONS, search_space=space, log=None)
    assert pipe.tower_plan.separate is not None
    check_equal_to_eager(model, batch, pipe.launch(timeout_s=60))


def test_a_clip_loss_with_targets_of_the_batch_size_trains_split_like_eager():
    """``torch.arange(pixel_values.shape[0])``: the batch's size is a constant of the loss, which
    trains on the whole global batch, split over the ranks (not refused as reading the input)."""
    model, batch = TwoTowers("batch-size"), two_tower_batch(6)
    pipe = compile(
        model, batch, "cpu:2", region_overrides=TWO_TOWER_REGIONS, search_space=COLOCATED_2, log=None
    )
    assert pipe.tower_plan is not None, pipe.report
    check_equal_to_eager(model, batch, pipe.launch(timeout_s=60))
