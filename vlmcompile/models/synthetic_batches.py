"""Synthetic training data for the zoo models: a fresh random global batch per step, with the
sample batch's shapes and token layout (what the compiled pipeline was specialised on)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmcompile.ir.errors import positive_int


@dataclass(frozen=True, slots=True)
class SyntheticBatches:
    """``batches(step)``: the global batch of ``step``, the same on every rank (seeded by the
    step), so each data-parallel rank takes its own shard of one global batch."""

    model: str
    global_batch: int
    seed: int = 0

    def __post_init__(self):
        positive_int("global_batch", self.global_batch, "the samples per step")

    def __call__(self, step: int) -> dict[str, torch.Tensor]:
        from vlmcompile import models

        return models.sample_batch(self.model, batch_size=self.global_batch, seed=self.seed + 1000 * step + 1)
