"""Does the model's loss split over microbatches? Checked by capture on the sample batch.

A pipeline runs each microbatch alone and adds their losses, weighted by their share of the
label tokens (:func:`vlmcompile.ir.microbatch.label_weights`). That equals the loss of the whole
batch when the loss is a mean (or sum) over samples, and is silently wrong when it couples the
samples: a CLIP-style contrastive loss compares every image with every text of the batch. So
capture runs the model on every sample of the sample batch alone and compares the weighted sum
with the loss of the whole batch. The same run checks that the batch splits into samples as
:func:`vlmcompile.ir.microbatch.take` cuts it (Qwen-VL's patches: the same number per sample).

A model whose loss does not split trains only as one microbatch on one data-parallel rank: the
plan search keeps to such plans and the runtime refuses others. A recognised contrastive loss is
the exception: its towers are microbatched and the loss runs on the whole batch
(:mod:`vlmcompile.graph.contrastive`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vlmcompile.ir.errors import SampleBatchError
from vlmcompile.ir.microbatch import IGNORE_INDEX, label_weights, num_samples, rows_per_sample, take


class LossSplit(str, enum.Enum):
    PER_SAMPLE = "per-sample"
    """The loss of the batch is the weighted sum of the samples' losses."""
    BATCH_COUPLED = "batch-coupled"
    """It is not (or the model cannot run on one sample): one microbatch, DP = 1 (unless it is a
    recognised contrastive loss: towers microbatched, the loss on the whole batch,
    :mod:`vlmcompile.graph.contrastive`)."""
    UNCHECKED = "unchecked"
    """Meta tensors, or a one-sample batch: nothing to compare."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class LossSplitCheck:
    verdict: LossSplit
    detail: str

    def __str__(self) -> str:
        return f"{self.verdict}: {self.detail}"


def check_loss_split(
    loss_of: Callable[[Mapping[str, Any]], torch.Tensor], batch: Mapping[str, Any]
) -> LossSplitCheck:
    """Compare ``loss_of(batch)`` with the label-weighted sum of ``loss_of`` on each sample.

    Args:
        loss_of: runs the model eagerly on a batch and returns its loss.
        batch: the sample batch (real tensors).
    """
    if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in batch.values()):
        return LossSplitCheck(LossSplit.UNCHECKED, "meta tensors hold no values")
    try:
        samples = num_samples(batch)
        rows = rows_per_sample(batch)
    except SampleBatchError as err:
        return LossSplitCheck(LossSplit.BATCH_COUPLED, f"the batch does not split by sample: {err}")
    if samples < 2:
        # Nothing to split: take the one sample twice. A contrastive loss of two equal pairs
        # (log 2) is not that of one pair (0), and a plan may still split bigger batches.
        if any(not isinstance(v, torch.Tensor) for v in batch.values()):
            return LossSplitCheck(LossSplit.UNCHECKED, "one sample, and Python values that may be per sample")
        batch = {k: torch.cat([v, v]) if rows[k] else v for k, v in batch.items()}
        samples = 2
    batches = [batch]
    uneven = _uneven_labels(batch, samples)
    if uneven is not None:
        # With as many label tokens in every sample, a mean over samples and a mean over
        # tokens agree; the runtime weights by tokens, so check on uneven counts as well.
        batches.append(uneven)
    for b in batches:
        verdict = _compare(loss_of, b, samples, rows)
        if verdict.verdict is not LossSplit.PER_SAMPLE:
            return verdict
    return verdict


def _compare(loss_of, batch: Mapping[str, Any], samples: int, rows: Mapping[str, int]) -> LossSplitCheck:
    weights = label_weights(batch, samples)
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)
        whole = loss_of(batch)
        if not isinstance(whole, torch.Tensor) or whole.numel() != 1:
            shape = list(whole.shape) if isinstance(whole, torch.Tensor) else type(whole).__name__
            return LossSplitCheck(LossSplit.UNCHECKED, f"the model returns {shape}, not a scalar loss")
        try:
            parts = []
            for i in range(samples):
                torch.manual_seed(0)
                parts.append(loss_of(take(batch, i, 1, rows)).double() if weights[i] > 0 else None)
        except Exception as err:  # whatever the model raises on a sample of its own
            return LossSplitCheck(
                LossSplit.BATCH_COUPLED,
                f"the model does not run on one sample of the batch ({type(err).__name__}: {str(err)[:200]})",
            )
    # A sample without label tokens weighs nothing (its own loss is a mean over nothing: NaN).
    combined = sum(w * p for w, p in zip(weights, parts) if w > 0)
    rtol = 1e-4 if whole.dtype in (torch.float32, torch.float64) else 2e-2
    if torch.allclose(whole.double(), combined, rtol=rtol, atol=rtol / 10):
        return LossSplitCheck(
            LossSplit.PER_SAMPLE,
            f"loss of the {samples} samples together {whole.item():.6g} = label-weighted sum of each alone",
        )
    return LossSplitCheck(
        LossSplit.BATCH_COUPLED,
        f"loss of the {samples} samples together {whole.item():.6g}, label-weighted sum of each alone "
        f"{combined.item():.6g}: the loss couples the samples of a batch (a contrastive loss does) or is "
        "not a mean over label tokens",
    )


def _uneven_labels(batch: Mapping[str, Any], samples: int) -> dict[str, Any] | None:
    """The batch with the second half of sample 0's label tokens ignored, when every sample
    has as many label tokens; else None."""
    labels = batch.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2 or labels.shape[0] != samples:
        return None
    counts = {int((row[1:] != IGNORE_INDEX).sum()) for row in labels}
    if len(counts) != 1 or counts.pop() < 2:
        return None
    labels = labels.clone()
    kept = (labels[0] != IGNORE_INDEX).nonzero().flatten()
    labels[0, kept[len(kept) // 2 :]] = IGNORE_INDEX
    return {**batch, "labels": labels}


def coupled_loss_error(detail: str) -> str:
    """What to tell a user whose plan splits a batch the loss couples."""
    return (
        f"this model's loss does not split over microbatches ({detail}); a pipeline that adds "
        "microbatch losses would train it wrong. Plan it as one microbatch on one data-parallel "
        "rank: microbatch size = global batch and DP = 1 (compile() does so by itself)"
    )
