"""Global batches from a dataset of samples, the same on every rank.

Every rank builds the same :class:`GlobalBatches` and asks it for step ``k``'s global batch;
the runner then takes its data-parallel shard of it (and the label-token weights of the whole
batch, so the loss is eager's). A function of the step rather than an iterator: a resumed run
asks for step ``k`` directly, without replaying the steps before it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlmcompile.ir.errors import ArgumentError, VlmCompileError, positive_int


def concat_samples(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Samples that are batches of one (``models.sample_batch(batch_size=1)``, a transformers
    processor's output for one example) joined along their first dimension; a non-tensor value
    must be the same in every sample."""
    out: dict[str, Any] = {}
    keys = set(samples[0])
    for i, sample in enumerate(samples):
        if set(sample) != keys:
            differ = sorted(keys ^ set(sample))
            raise ArgumentError(
                f"sample {i} of the batch has other keys than sample 0 (differing: {differ}); give every "
                "sample the same keys, or a collate function that fills the missing ones"
            )
    for key, first in samples[0].items():
        values = [s[key] for s in samples]
        if isinstance(first, torch.Tensor):
            shapes = [tuple(v.shape[1:]) if isinstance(v, torch.Tensor) else None for v in values]
            other = next((i for i, shape in enumerate(shapes) if shape != shapes[0]), None)
            if other is not None:
                got = list(values[other].shape) if shapes[other] is not None else type(values[other]).__name__
                raise ArgumentError(
                    f"samples of one batch differ in {key!r}: sample 0 is {list(first.shape)}, sample {other} "
                    f"{got}. The pipeline is compiled for one batch shape: pad or crop every sample's "
                    f"{key!r} to one shape (in the dataset, or a collate function given as collate=...)"
                )
            out[key] = torch.cat(values)
        elif any(v != first for v in values):
            raise ArgumentError(f"samples disagree on {key!r} ({values[:3]}...); give a collate function")
        else:
            out[key] = first
    return out


@dataclass(frozen=True)
class GlobalBatches:
    """``batches(step)``: ``global_batch`` samples of ``dataset`` (anything with ``len`` and
    indexing), in an order shuffled per epoch by ``seed`` (the same on every rank). An epoch's
    last partial batch is left out: the pipeline was compiled for one batch shape."""

    dataset: Any
    global_batch: int
    seed: int = 0
    shuffle: bool = True
    collate: Callable[[list], Mapping[str, Any]] = concat_samples

    def __post_init__(self):
        positive_int("global_batch", self.global_batch, "the samples per step")
        if len(self.dataset) < self.global_batch:
            raise ArgumentError(
                f"the dataset holds {len(self.dataset)} samples, fewer than global_batch={self.global_batch}"
            )

    @property
    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.global_batch

    def indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        if self.shuffle:
            order = torch.randperm(
                len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch)
            )
        else:
            order = torch.arange(len(self.dataset))
        return order[k * self.global_batch : (k + 1) * self.global_batch].tolist()

    def __call__(self, step: int) -> Mapping[str, Any]:
        indices = self.indices(step)
        samples = [self.dataset[i] for i in indices]
        try:
            return self.collate(samples)
        except VlmCompileError as err:
            raise type(err)(f"{err} (dataset indices {indices})") from None
        except Exception as err:  # the user's collate: say which samples, keep its traceback
            name = getattr(self.collate, "__qualname__", type(self.collate).__name__)
            raise ArgumentError(
                f"the collate function {name} failed on dataset indices {indices}: "
                f"{type(err).__name__}: {err}"
            ) from err
