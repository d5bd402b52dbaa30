"""Splitting a batch into microbatches by sample, and each microbatch's share of the loss.

Most inputs hold one row per sample (``input_ids``, ``pixel_values`` of LLaVA). Some hold a
fixed number of rows per sample: Qwen-VL's ``pixel_values`` are the flattened patches of every
image, ``16 x batch`` rows for 16 patches an image. :func:`rows_per_sample` reads that number
off the sample batch, and :func:`take` cuts samples ``[start, start + count)`` out of a batch
with it. Whether that cut is right for a model (every sample the same number of patches) is
what the capture pass checks on the sample batch (:mod:`vlmcompile.graph.loss_split`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vlmcompile.ir.errors import SampleBatchError

IGNORE_INDEX = -100
"""Label of a token the loss skips (transformers' convention, and the zoo's)."""


def num_samples(batch: Mapping[str, Any]) -> int:
    """Samples in a batch: the leading size of ``input_ids`` if there is one (image inputs of
    transformers models stack the images or patches of all samples), else the leading size the
    tensors share."""
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if "input_ids" in tensors:
        return int(tensors["input_ids"].shape[0])
    leading = {int(v.shape[0]) for v in tensors.values()}
    if len(leading) != 1:
        raise SampleBatchError(
            f"cannot tell the number of samples of a batch whose tensors lead with {sorted(leading)}; "
            "give every input the batch as its first dimension, or pass input_ids"
        )
    return leading.pop()


def rows_per_sample(batch: Mapping[str, Any]) -> dict[str, int]:
    """Batch key -> rows each sample holds in that tensor (0: not split, every microbatch gets
    the value whole: Python values and 0-d tensors)."""
    samples = num_samples(batch)
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = 0
            continue
        rows = int(value.shape[0])
        if rows % samples:
            raise SampleBatchError(
                f"batch[{key!r}] has {rows} rows, not a multiple of the batch's {samples} samples, so it cannot "
                "be split into microbatches; give it one row (or the same number of rows) per sample"
            )
        out[key] = rows // samples
    return out


def take(batch: Mapping[str, Any], start: int, count: int, rows: Mapping[str, int]) -> dict[str, Any]:
    """Samples ``[start, start + count)`` of ``batch``."""
    return {k: v[start * rows[k] : (start + count) * rows[k]] if rows.get(k) else v for k, v in batch.items()}


def label_weights(batch: Mapping[str, Any], num_parts: int) -> list[float]:
    """Each of ``num_parts`` equal sample slices' share of the label tokens (equal shares without
    labels): the weights under which microbatch losses add up to the loss of the whole batch when
    the model's loss is a mean over label tokens."""
    labels = batch.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        return [1.0 / num_parts] * num_parts
    counts = [int((part[..., 1:] != IGNORE_INDEX).sum()) for part in labels.chunk(num_parts)]
    total = sum(counts)
    if total == 0:
        return [1.0 / num_parts] * num_parts
    return [c / total for c in counts]
