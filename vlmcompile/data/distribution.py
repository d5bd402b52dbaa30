"""A dataset's samples as a pipeline will see them: read the first samples, choose the token
budget and the microbatches a step needs, and describe the microbatches they pack into.

What the planner takes from it: the token budget (the longest sample, rounded up to 16, unless
given), the microbatches a step of ``global_batch`` samples needs (the most any scanned step
needed, so no scanned sample is deferred), and the samples of the microbatch with the most image
rows, which the pipeline is captured and its memory planned at: the largest microbatch the
packer emitted on the scan (its times are planned at the mean: ``LayerGraph.with_time_scaled``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from vlmcompile.data.families import Family
from vlmcompile.data.packing import assign_rows, fewest_rows, sample_length
from vlmcompile.ir.errors import DataError, positive_int

SCAN_LIMIT = 2048
"""Samples read at most (a dataset's first ones): enough for a p95, a few seconds here."""


@dataclass(frozen=True, slots=True)
class Spread:
    mean: float
    p95: int
    max: int

    @staticmethod
    def of(values: Sequence[int]) -> Spread:
        ordered = sorted(values)
        p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
        return Spread(sum(values) / len(values), p95, ordered[-1])

    def __str__(self) -> str:
        return f"{self.mean:.1f} / {self.p95} / {self.max}"


@dataclass(frozen=True, slots=True)
class DatasetScan:
    """What :func:`scan` found."""

    scanned: int
    of: int
    tokens: int
    """LLM tokens of a microbatch."""
    microbatches: int
    """Microbatches a step of ``global_batch`` samples needs."""
    global_batch: int
    llm_tokens: Spread
    """Sample tokens per microbatch."""
    image_rows: Spread
    """Tiles or patches per microbatch."""
    pad_share: float
    largest: tuple[int, ...]
    """Dataset indices of the samples of the microbatch with the most image rows."""

    def __str__(self) -> str:
        return (
            f"planned for the dataset: its first {self.scanned} of {self.of} samples in steps of {self.global_batch} "
            "(whole steps only) "
            f"pack into {self.microbatches} microbatches of {self.tokens} LLM tokens a step; per microbatch "
            f"(mean / p95 / max): LLM tokens {self.llm_tokens}, image rows {self.image_rows}; padding "
            f"{self.pad_share:.0%}; captured and memory planned at the largest (samples {list(self.largest)[:8]}), "
            "times at the mean (the encoder's work scaled by mean / largest image rows)"
        )


def scan(
    dataset: Any,
    family: Family,
    *,
    global_batch: int,
    tokens: int | None = None,
    limit: int = SCAN_LIMIT,
    log: TextIO | None = sys.stderr,
) -> DatasetScan:
    """Read the first ``limit`` samples of ``dataset`` (anything with ``len`` and indexing) and
    plan its packing for steps of ``global_batch`` samples."""
    positive_int("global_batch", global_batch, "the samples of a step")
    try:
        size = len(dataset)
    except TypeError:
        raise DataError(
            f"the dataset is a {type(dataset).__name__}; give one with len() and indexing"
        ) from None
    if size == 0:
        raise DataError("the dataset is empty; give one with at least one sample")
    count = min(size, limit)
    lengths, rows = [], []
    for i in range(count):
        sample = dataset[i]
        lengths.append(sample_length(sample, family, i))
        rows.append(family.vision_rows(sample))
        if log is not None and count > 200 and (i + 1) % 500 == 0:
            print(f"scanning the dataset: {i + 1}/{count} samples", file=log, flush=True)
    budget = tokens or -(-max(lengths) // 16) * 16
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if too_long:
        raise DataError(
            f"{len(too_long)} of the first {count} samples take more LLM tokens than tokens_per_microbatch={budget} "
            f"(sample {too_long[0]}: {lengths[too_long[0]]}); give at least {max(lengths)}, or leave them out"
        )
    steps = [range(k, min(k + global_batch, count)) for k in range(0, count, global_batch)]
    if len(steps) > 1 and len(steps[-1]) < global_batch:
        steps.pop()  # a partial last step would pad rows planned for a whole one
    need = max(fewest_rows([lengths[i] for i in step], budget) for step in steps)
    per_mb_tokens, per_mb_rows, largest, used, packed = [], [], (), 0, 0
    for step in steps:
        assigned, _ = assign_rows([lengths[i] for i in step], need, budget)
        for row in assigned:
            if not row:
                continue
            members = tuple(step[j] for j in row)
            per_mb_tokens.append(sum(lengths[i] for i in members))
            packed += per_mb_tokens[-1]
            per_mb_rows.append(sum(rows[i] for i in members))
            if per_mb_rows[-1] > max(per_mb_rows[:-1], default=-1):
                largest = members
        used += need
    return DatasetScan(
        count,
        size,
        budget,
        need,
        global_batch,
        Spread.of(per_mb_tokens),
        Spread.of(per_mb_rows),
        1 - packed / (used * budget),
        largest,
    )
