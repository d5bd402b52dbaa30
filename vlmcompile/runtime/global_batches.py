"""Global batches from a dataset of samples, the same on every rank.

Every rank builds the same :class:`GlobalBatches` and asks it for step ``k``'s global batch;
the runner then takes its data-parallel shard of it (and the label-token weights of the whole
batch, so the loss is eager's). A function of the step rather than an iterator: a resumed run
asks for step ``k`` directly, without replaying the steps before it; no sample is dropped at an
epoch's end (its last samples open the next step).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlmcompile.ir.errors import (
    ArgumentError,
    DataError,
    VlmCompileError,
    enough_samples,
    positive_int,
    user_facing,
)


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


@functools.lru_cache(maxsize=4)
def _epoch_order(samples: int, seed: int, shuffle: bool) -> torch.Tensor:
    """The order of one epoch of ``samples`` samples (seeded by ``seed``; the same on every rank),
    as int64 (8 bytes a sample: a step slices it)."""
    if not shuffle:
        return torch.arange(samples)
    return torch.randperm(samples, generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class GlobalBatches:
    """``batches(step)``: ``global_batch`` samples of ``dataset`` (anything with ``len`` and
    indexing) a step, taken in turn from a stream that runs through the dataset epoch after
    epoch, each epoch in its own order shuffled by ``seed`` (the same on every rank). No sample is
    left out: an epoch's last samples open the next step, with the next epoch's first ones (so a
    step across two epochs may hold a sample twice, as Megatron-LM's epochs joined end to end do).

    A checkpoint keeps where the next step starts in the stream (:meth:`state`); a run resumed
    from it goes on there (:meth:`resumed`), with the same or another global batch."""

    dataset: Any
    global_batch: int
    seed: int = 0
    shuffle: bool = True
    collate: Callable[[list], Mapping[str, Any]] = concat_samples
    start: tuple[int, int] = (0, 0)
    """(step, position): step ``start[0]`` begins at sample ``start[1]`` of the stream (a resumed
    run's first step; earlier steps are not asked for)."""

    @user_facing
    def __post_init__(self):
        positive_int("global_batch", self.global_batch, "the samples per step")
        enough_samples(len(self.dataset), self.global_batch)

    def position(self, step: int) -> int:
        """Where step ``step`` (0-based) begins in the stream: the samples the steps before it took."""
        first, at = self.start
        if step < first:
            raise ArgumentError(
                f"step {step + 1} comes before step {first + 1}, where these global batches start (a resumed run)"
            )
        return at + (step - first) * self.global_batch

    def epochs(self, step: int) -> float:
        """Epochs of the dataset the steps before step ``step`` took."""
        return self.position(step) / len(self.dataset)

    def indices(self, step: int) -> list[int]:
        position, samples = self.position(step), len(self.dataset)
        out: list[int] = []
        while len(out) < self.global_batch:
            epoch, k = divmod(position, samples)
            order = _epoch_order(samples, self.seed + epoch, self.shuffle)
            taken = order[k : k + self.global_batch - len(out)].tolist()
            out += taken
            position += len(taken)
        return out

    @property
    def stream(self) -> dict[str, Any]:
        """What fixes the stream: a run resumes only on the same."""
        return {"samples": len(self.dataset), "seed": self.seed, "shuffle": self.shuffle}

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint saved after step ``step`` (0-based) keeps: where the next step begins."""
        return {"stream": self.stream, "position": self.position(step + 1)}

    def resumed(self, step: int, state: Mapping[str, Any]) -> GlobalBatches:
        """These batches going on at step ``step`` from a checkpoint's :meth:`state`."""
        check_stream(state.get("stream", {}), self.stream)
        return dataclasses.replace(self, start=(step, int(state["position"])))

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


def check_stream(saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Refuse to resume a run on another stream of samples (another dataset size, seed or order)."""
    differ = [f"{k} {saved.get(k)!r} (now {now.get(k)!r})" for k in sorted(now) if saved.get(k) != now.get(k)]
    if saved and differ:
        raise DataError(
            f"the checkpoint's run drew its samples from another stream: {', '.join(differ)}. Resume with the "
            "same dataset, seed and shuffling, or start a new run"
        )
