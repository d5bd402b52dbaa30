"""A dataset's samples as a pipeline will see them: read the first samples, choose the token
budget and the microbatches a step needs, and describe the microbatches they pack into.

What the planner takes from it:

* the token budget: the longest sample, rounded up to 16, unless given (of a dataset that tells
  its samples' sizes, the first :data:`SIZED_LIMIT` are read; of any other, the first
  :data:`SCAN_LIMIT`);
* the microbatches a step of ``global_batch`` samples gets: the fewest with which packing the
  scanned steps in order (again in turn, to :data:`REPLAYED_STEPS` steps at least), each step's
  leftovers carried into the next (as :class:`~vlmcompile.data.steps.PackedSteps` trains),
  never defers more than :func:`deferral_limit` samples at once. Planning for the step that needs the most would pad
  every other step to it; planning below the mean would let the backlog grow without end;
* the samples of the microbatch with the most image rows, which the pipeline is captured and its
  memory planned at; its times are planned at the mean microbatch (:meth:`DatasetScan.expected_time`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from vlmcompile.data.families import Family
from vlmcompile.data.packing import (
    assign_rows,
    check_budget,
    fewest_rows,
    sample_length,
    sample_name,
    too_long,
)
from vlmcompile.ir.errors import DataError, enough_samples, positive_int
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.regions import ENCODER_SIDE

SCAN_LIMIT = 2048
"""Samples read at most (a dataset's first ones): enough for a p95, a few seconds here."""
REPLAYED_STEPS = 16
"""Steps packed at least when choosing the microbatches (the scanned ones, again in turn)."""


@dataclass(frozen=True, slots=True)
class Spread:
    """Mean, 95th percentile (nearest rank) and maximum of some values (counts or seconds)."""

    mean: float
    p95: float
    max: float

    @staticmethod
    def of(values: Sequence[float]) -> Spread:
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
    images: Spread | None
    """Images per microbatch, where the family's layout tells (None: InternVL's and Idefics3's tiles)."""
    pad_share: float
    largest: tuple[int, ...]
    """Dataset indices of the samples of the microbatch with the most image rows."""
    most_needed: int
    """Microbatches the scanned step that needed the most would take to defer nothing."""
    deferred: Spread
    """Samples a step defers into the next, over the scanned steps."""
    warning: str = ""
    """What the plan rests on too little of (one whole step, samples left out of the scan)."""

    def __str__(self) -> str:
        return self._summary() + (f"\nwarning: {self.warning}" if self.warning else "")

    def _summary(self) -> str:
        return (
            f"planned for the dataset: its first {self.scanned} of {self.of} samples in steps of {self.global_batch} "
            "(whole steps only) "
            f"pack into {self.microbatches} microbatches of {self.tokens} LLM tokens a step "
            f"(the busiest step needs {self.most_needed}; samples deferred to the next step, mean / p95 / max: "
            f"{self.deferred}); per microbatch (mean / p95 / max): LLM tokens {self.llm_tokens}, image rows "
            f"{self.image_rows}{'' if self.images is None else f', images {self.images}'}; padding {self.pad_share:.0%}; captured and memory planned at the largest "
            f"(samples {list(self.largest)[:8]}), times at the mean (the encoder's work scaled by mean / largest "
            "image rows)"
        )

    def expected_time(self, graph: LayerGraph) -> LayerGraph:
        """``graph`` (annotated at the largest microbatch) with the times of the mean one: the
        encoder and projector layers' work scaled by mean / largest image rows (linear in the
        rows: attention over a microbatch's patches grows faster, which this leaves out)."""
        rows = self.image_rows
        if not rows.max:
            return graph
        factor = rows.mean / rows.max
        why = f"encoder work scaled by {factor:.3f}: mean / largest image rows a microbatch ({rows.mean:.1f} / {rows.max})"
        return graph.with_time_scaled(dict.fromkeys(ENCODER_SIDE, factor), why)


def deferral_limit(global_batch: int) -> int:
    """Samples a step may defer at once under the planned microbatches: an eighth of a step."""
    return max(1, global_batch // 8)


def backlog_limit(global_batch: int) -> int:
    """Samples a step of a run may leave for the next: a whole step's. The plan aims at
    :func:`deferral_limit` on the steps it scanned; a run's steps in another order defer more at
    times, but a backlog of a whole step means the microbatches do not keep up with the data."""
    return global_batch


def _carried_over(
    steps: Sequence[Sequence[int]], lengths: Sequence[int], microbatches: int, budget: int
) -> tuple[list[tuple[int, ...]], list[int]]:
    """Packing ``steps`` (dataset indices) in order into ``microbatches`` rows of ``budget``
    tokens, what one step cannot place carried into the next first: every microbatch's samples,
    and the samples each step deferred."""
    carried: list[int] = []
    rows, deferred = [], []
    for step in steps:
        todo = [*carried, *step]
        assigned, left = assign_rows([lengths[i] for i in todo], microbatches, budget, first=len(carried))
        rows += [tuple(todo[j] for j in row) for row in assigned]
        carried = [todo[j] for j in left]
        deferred.append(len(carried))
    return rows, deferred


def scan(
    dataset: Any,
    family: Family,
    *,
    global_batch: int,
    tokens: int | None = None,
    limit: int = SCAN_LIMIT,
    log: TextIO | None = sys.stderr,
) -> DatasetScan:
    """Plan the packing of ``dataset`` (anything with ``len`` and indexing) for steps of
    ``global_batch`` samples. A dataset with ``sizes(i)`` (a manifest, a synthetic one) is read
    without building a sample, its first :data:`SIZED_LIMIT` samples; any other, its first
    ``limit`` samples (a run checks every sample before it starts:
    :func:`~vlmcompile.data.steps.check_run`). The token budget covers every sample read, and a sample over it, or a
    budget no microbatch could be built at, is named before anything is built."""
    positive_int("global_batch", global_batch, "the samples of a step")
    try:
        size = len(dataset)
    except TypeError:
        raise DataError(
            f"the dataset is a {type(dataset).__name__}; give one with len() and indexing"
        ) from None
    if size == 0:
        raise DataError("the dataset is empty; give one with at least one sample")
    enough_samples(size, global_batch)
    lengths, rows, images = _read(dataset, family, limit, log)
    count = len(lengths)
    longest = max(range(count), key=lambda i: lengths[i])
    budget = tokens or -(-lengths[longest] // 16) * 16
    over = [i for i, n in enumerate(lengths) if n > budget]
    if over:
        i = max(over, key=lambda i: lengths[i])
        raise too_long(sample_name(dataset, i), lengths[i], budget, len(over), count)
    check_budget(
        budget, sample_name(dataset, longest) if tokens is None else f"tokens_per_microbatch={tokens}"
    )
    steps = [range(k, min(k + global_batch, count)) for k in range(0, count, global_batch)]
    if len(steps) > 1 and len(steps[-1]) < global_batch:
        steps.pop()  # a partial last step would pad rows planned for a whole one
    warning = _scan_warning(count, size, len(steps), global_batch)
    most = max(fewest_rows([lengths[i] for i in step], budget) for step in steps)
    least = max(1, -(-sum(lengths[i] for step in steps for i in step) // (len(steps) * budget)))
    # Steps the scan saw, replayed in turn: a backlog that grows step after step shows (one scanned
    # step alone cannot show it).
    replayed = [steps[k % len(steps)] for k in range(max(len(steps), REPLAYED_STEPS))]
    for need in range(least, most + 1):
        microbatches, deferred = _carried_over(replayed, lengths, need, budget)
        if max(deferred) <= deferral_limit(global_batch):
            break
    filled = [m for m in microbatches if m]
    per_mb_tokens = [sum(lengths[i] for i in m) for m in filled]
    per_mb_rows = [sum(rows[i] for i in m) for m in filled]
    counted = None not in images
    largest = filled[max(range(len(filled)), key=lambda k: (per_mb_rows[k], -k))]
    return DatasetScan(
        count,
        size,
        budget,
        need,
        global_batch,
        Spread.of(per_mb_tokens),
        Spread.of(per_mb_rows),
        Spread.of([sum(images[i] for i in m) for m in filled]) if counted else None,
        1 - sum(per_mb_tokens) / (len(replayed) * need * budget),
        largest,
        most,
        Spread.of(deferred),
        warning,
    )


def _scan_warning(scanned: int, size: int, steps: int, global_batch: int) -> str:
    """A warning where the microbatch count rests on one whole step ("" otherwise): a run then
    meets steps the plan never saw. What it says to do depends on why: a dataset that small, or a
    scan that read only the first samples."""
    if steps >= 2:
        return ""
    left = scanned - global_batch
    out = f", {left} more in no whole step, left out" if left > 0 else ""
    why = (
        f"the dataset holds {size} samples: one whole step of {global_batch}{out}"
        if scanned == size
        else f"the scan read the first {scanned} of {size} samples: one whole step of {global_batch}{out}"
    )
    fix = (
        "give more samples, or a smaller --global-batch"
        if scanned == size
        else "plan for a smaller --global-batch"
    )
    return f"{why}; the microbatches a step gets are planned from that one step alone: {fix}, for a count that holds"


SIZED_LIMIT = 1 << 16
"""Samples of a dataset with ``sizes(i)`` a scan reads at most (a second or two)."""


def _read(
    dataset: Any, family: Family, limit: int, log: TextIO | None
) -> tuple[list[int], list[int], list[int | None]]:
    """LLM tokens, vision rows and images of the first samples: every one to :data:`SIZED_LIMIT`
    from the dataset's ``sizes(i)`` where it and the family tell them, else ``limit`` samples built."""
    if hasattr(dataset, "sizes") and hasattr(family, "sized"):
        count = min(len(dataset), SIZED_LIMIT)
        lengths, rows, images = [], [], []
        for i in range(count):
            sizes = dataset.sizes(i)
            n, v = family.sized(sizes)
            lengths.append(n)
            rows.append(v)
            images.append(family.images_of(sizes))
        return lengths, rows, images
    count = min(len(dataset), limit)
    lengths, rows, images = [], [], []
    for i in range(count):
        sample = dataset[i]
        lengths.append(sample_length(sample, family, sample_name(dataset, i)))
        rows.append(family.vision_rows(sample))
        images.append(family.images(sample))
        if log is not None and count > 200 and (i + 1) % 500 == 0:
            print(f"scanning the dataset: {i + 1}/{count} samples", file=log, flush=True)
    return lengths, rows, images
