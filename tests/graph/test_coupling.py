"""Where a loss couples the samples: the contrastive losses capture can shard are found in the zoo's
and transformers' two-tower models, and everything else is refused, naming where samples meet."""

from __future__ import annotations

import pytest
import torch

from tests.models import TWO_TOWER_REGIONS as REGIONS
from tests.models import TwoTowers, build, needs_transformers, two_tower_batch
from vlmcompile.graph.contrastive import find_coupling
from vlmcompile.ir.contrastive_loss import LossKind
from vlmcompile.passes.graph.capture import capture


def _cut(model, batch):
    result = capture(
        model, batch, region_overrides=None if hasattr(model, "cfg") or hasattr(model, "config") else REGIONS
    )
    assert result.report.loss_split.verdict.value == "batch-coupled"
    return result.report.coupling


def test_the_zoo_pair_is_an_infonce_loss_over_its_two_embeddings():
    model, batch = build("tiny-contrastive", batch_size=4)
    cut = _cut(model, batch)
    assert cut.loss is not None and cut.loss.kind is LossKind.INFONCE
    assert cut.loss.width == model.cfg.embed_dim
    assert "equal to the model's own in value and gradients" in cut.loss.detail


@needs_transformers
@pytest.mark.hf
@pytest.mark.parametrize(
    ("name", "kind", "bias"), [("hf-clip", LossKind.INFONCE, False), ("hf-siglip", LossKind.SIGMOID, True)]
)
def test_transformers_pairs_are_found_with_their_temperature_and_bias(name, kind, bias):
    from vlmcompile import families

    model, batch = families.build_tiny_by_name(name, batch=4)
    cut = _cut(model, batch)
    assert cut.loss is not None, cut.refusal
    assert cut.loss.kind is kind and cut.loss.scale is not None
    assert (cut.loss.bias is not None) is bias


@pytest.mark.parametrize("loss", ["infonce", "image-rows", "batch-size"])
def test_our_own_two_towers_are_found(loss):
    """Whether the targets' arange(N) reads N off the logits, an embedding or a batch input."""
    cut = _cut(TwoTowers(loss), two_tower_batch())
    # scale * image @ text.T multiplies the image rows first: the temperature trains in the tower.
    assert cut.loss is not None and cut.loss.kind is LossKind.INFONCE and cut.loss.scale is None


def test_batchnorm_in_a_tower_is_refused_by_name():
    cut = _cut(TwoTowers(batchnorm=True).train(), two_tower_batch())
    assert cut.loss is None
    assert "meet inside a tower" in cut.refusal and "BatchNorm1d" in cut.refusal, cut.refusal


@pytest.mark.parametrize(
    ("loss", "says"),
    [
        ("one-tower", "a loss of one tower"),
        ("labels", "reads batch input 'labels'"),
        ("one-way", "none of the contrastive losses"),
    ],
)
def test_losses_it_cannot_shard_are_refused_saying_why(loss, says):
    cut = _cut(TwoTowers(loss), two_tower_batch())
    assert cut.loss is None and says in cut.refusal, cut.refusal


def test_a_batch_without_two_differing_samples_shows_no_coupling():
    model = TwoTowers()
    one = two_tower_batch(1)
    assert (
        "of one sample"
        in find_coupling(capture(model, two_tower_batch(), region_overrides=REGIONS).gm, one).refusal
    )
    same = {k: torch.cat([v[:1]] * 3) for k, v in two_tower_batch().items()}
    assert (
        "differs from sample 0"
        in find_coupling(capture(model, two_tower_batch(), region_overrides=REGIONS).gm, same).refusal
    )
