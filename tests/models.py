"""The tiny models the tests run on, as (model, sample batch) builders for parametrize."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlmcompile import models

ZOO = ["tiny", "tiny-two-encoder", "tiny-contrastive", "tiny-tied"]
HF = ["hf-llava", "hf-internvl", "hf-idefics3", "hf-paligemma"]

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers (pip install '.[test]')"
)


def build(name: str, batch_size: int = 2):
    """(model with real CPU weights, sample batch)."""
    if name.startswith("hf-"):
        from vlmcompile import families

        return families.build_tiny_by_name(name)
    return models.build(name), models.sample_batch(name, batch_size=batch_size)


ALL = ZOO + [pytest.param(n, marks=[needs_transformers, pytest.mark.hf]) for n in HF]


class TwoTowers(nn.Module):
    """Two small towers under a loss of choice (the variants a user might bring)."""

    def __init__(
        self, loss: str = "infonce", batchnorm: bool = False, batch_max: bool = False, shared: bool = False
    ):
        super().__init__()
        layers = [nn.Linear(12, 8)] + ([nn.BatchNorm1d(8)] if batchnorm else [])
        self.vision = nn.Sequential(*layers)
        self.text = nn.Embedding(20, 8)
        self.logit_scale = nn.Parameter(torch.tensor(1.5))
        self.loss = loss
        self.batch_max = batch_max
        self.shared = nn.Linear(8, 8) if shared else None  # one layer both towers run

    def forward(self, pixel_values, input_ids, labels):
        image = self.vision(pixel_values)
        if self.batch_max:  # a statistic over the batch that swapping one sample may not show
            image = image / image.abs().amax()
        image = F.normalize(image + 1, dim=-1) if self.batch_max else F.normalize(image, dim=-1)
        text = self.text(input_ids).mean(1)
        if self.shared is not None:
            image, text = self.shared(image), self.shared(text)
        text = F.normalize(text, dim=-1)
        if self.loss == "one-tower":
            text = image.flip(0)
        logits = self.logit_scale.exp() * image @ text.t()
        # The standard CLIP loss spells N in several ways: the logits', an embedding's, the batch's.
        size = {"image-rows": image.shape[0], "batch-size": pixel_values.shape[0]}.get(
            self.loss, logits.shape[0]
        )
        targets = labels if self.loss == "labels" else torch.arange(size)
        if self.loss == "one-way":
            return F.cross_entropy(logits, targets)
        return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.t(), targets)) / 2


TWO_TOWER_REGIONS = {"vision": "vision", "text": "text"}


def two_tower_batch(n=4):
    g = torch.Generator().manual_seed(0)
    return {
        "pixel_values": torch.randn(n, 12, generator=g),
        "input_ids": torch.randint(0, 20, (n, 5), generator=g),
        "labels": torch.randperm(n, generator=g),
    }
