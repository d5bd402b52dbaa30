"""Codegen for a contrastive loss: the tower modules cut where capture found the loss, recaptured
per microbatch size for export graphs, a batch the towers were not captured for refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.models import TWO_TOWER_REGIONS, TwoTowers, build, needs_transformers, two_tower_batch
from vlmcompile import compile
from vlmcompile.ir.contrastive_plan import SampleSplit
from vlmcompile.ir.errors import PlanError
from vlmcompile.passes.codegen.contrastive import codegen_towers, coupled_loss_of
from vlmcompile.passes.graph.capture import capture
from vlmcompile.planning.request import SearchSpace
from vlmcompile.runtime.executor import BatchError

COLOCATED = SearchSpace(tower_placement="colocated")


def test_the_zoo_pair_splits_into_its_two_towers():
    model, batch = build("tiny-contrastive", batch_size=6)
    pipe = compile(model, batch, "cpu:2", search_space=COLOCATED, log=None)
    plan = dataclasses.replace(pipe.tower_plan, split=SampleSplit.even(6, 2, 2))
    step, report = codegen_towers(pipe.gm, plan, model=model, sample_batch=batch)
    vision = sum(p.numel() for p in model.vision.parameters())
    text = sum(p.numel() for p in model.text.parameters())
    assert report.sizes == (1, 2) and report.recaptured == ()  # fx graphs take any size
    # The zoo multiplies the image rows by the temperature: it trains in the image tower.
    image = vision + model.head.image_proj.weight.numel() + 1
    assert report.params == (image, text + model.head.text_proj.weight.numel(), 0)
    assert set(step.named_parameters()) == {n for n, _ in model.named_parameters()}


@needs_transformers
@pytest.mark.hf
def test_an_exported_pair_is_captured_again_for_each_microbatch_size():
    from vlmcompile import families

    model, batch = families.build_tiny("clip", batch=5)
    pipe = compile(model, batch, "cpu:2", search_space=COLOCATED, log=None)
    plan = dataclasses.replace(pipe.tower_plan, split=SampleSplit.even(5, 2, 2))  # 2+1, 1+1
    _, report = codegen_towers(pipe.gm, plan, model=model, sample_batch=batch)
    assert report.sizes == (1, 2) and report.recaptured == (1, 2)


def test_a_batch_the_towers_were_not_captured_for_is_refused():
    model, batch = build("tiny-contrastive", batch_size=4)
    step = compile(model, batch, "cpu:2", log=None).contrastive_step()
    step.check_batch(batch)
    with pytest.raises(
        BatchError, match=r"batch\['input_ids'\] is \[4, 5\] torch.int64; the towers expect \[8\]"
    ):
        step.check_batch({**batch, "input_ids": batch["input_ids"][:, :5]})
    with pytest.raises(BatchError, match="holds 3 samples; the step was planned for 4"):
        step.check_batch({k: v[:3] for k, v in batch.items()})
    with pytest.raises(BatchError, match=r"keys \['extra'\]"):
        step.check_batch({**batch, "extra": torch.zeros(4)})


def test_a_coupled_loss_capture_refused_is_not_cut():
    gm = capture(TwoTowers(batchnorm=True), two_tower_batch(), region_overrides=TWO_TOWER_REGIONS).gm
    with pytest.raises(PlanError, match="cannot be microbatched: the samples of a batch meet inside a tower"):
        coupled_loss_of(gm)


def test_a_tower_that_mixes_samples_unseen_by_capture_is_refused():
    # The batch's largest value sits in sample 3: swapping sample 0 for sample 1 keeps the max, so
    # capture accepts the cut; sample 0 alone has another max, which codegen's check sees.
    batch = two_tower_batch()
    batch["pixel_values"][3] *= 10
    model = TwoTowers(batch_max=True)
    assert capture(model, batch, region_overrides=TWO_TOWER_REGIONS).report.coupling.loss is not None
    with pytest.raises(PlanError, match="on the first 1 samples alone differs .* mixes the samples"):
        compile(
            model,
            batch,
            "cpu:2",
            region_overrides=TWO_TOWER_REGIONS,
            search_space=SearchSpace(tower_microbatches=2, tower_placement="colocated"),
            log=None,
        )


def test_train_says_how_to_train_a_contrastive_model():
    model, batch = build("tiny-contrastive", batch_size=4)
    pipe = compile(model, batch, "cpu:2", search_space=COLOCATED, log=None)
    with pytest.raises(PlanError, match="does not run contrastive two-tower steps yet"):
        pipe.train(lambda k: batch, None)
