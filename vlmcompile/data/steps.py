"""Training steps of packed samples: step ``k``'s global batch packed into a pipeline's
microbatches, the same on every rank, and the padded batch eager trains on for the same step.

A step packs the samples its global batch holds and those the step before deferred (they go
first, so no sample waits more than one step while the carried ones fit the step's rows); what
fits in none of its microbatches is deferred to the next step, counted in
:class:`~vlmcompile.ir.packed.PackedBatch`, never dropped. Which samples a step defers follows
from the sample lengths alone, so step ``k`` is computed from step 0 on without building the
tensors of the steps before it (a resumed run replays the lengths, not the steps).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from vlmcompile.data.families import Family
from vlmcompile.data.microbatches import assign
from vlmcompile.data.packed_step import step_inputs
from vlmcompile.data.packing import pack_assigned, padded_batch, sample_length
from vlmcompile.ir.errors import DataError, positive_int
from vlmcompile.ir.packed import BatchPlan, PackedBatch

Sample = Mapping[str, Any]


@dataclass
class PackedSteps:
    """``steps(k)``: step ``k``'s :class:`PackedBatch` for ``num_microbatches`` microbatches of
    ``tokens`` LLM tokens. ``samples(k)`` gives step ``k``'s global batch as a list of samples
    (a :class:`~vlmcompile.runtime.data.GlobalBatches` with ``collate=list``)."""

    samples: Callable[[int], Sequence[Sample]]
    family: Family
    tokens: int
    num_microbatches: int
    assignment: str = "greedy"
    """How a step's samples go to microbatches (:mod:`vlmcompile.data.microbatches`): ``greedy``
    or ``cp-sat`` (image rows even over microbatches and replicas, within the token budget), or
    ``tokens`` (longest first into the emptiest row). Greedy by default: on the synthetic
    datasets CP-SAT's heaviest microbatch is 1-4 % lighter at 100-1000 times the time
    (``benchmarks/dynamic_batches.py``)."""
    replicas: int = 1
    """Data-parallel replicas the microbatches are split over (each its ``1 / replicas``)."""
    schedule: Callable[[Sequence[int]], BatchPlan] | None = None
    """Image rows per microbatch (all of a step's, every replica's in turn) -> the step's own
    schedule. Solved on global rank 0 alone (the runner sends rank 0's to every rank), for step
    ``k + 1`` while step ``k`` trains."""
    _carried: dict[int, list[Sample]] = field(default_factory=lambda: {0: []}, repr=False)
    """Step -> the samples deferred into it (computed steps only)."""
    _planned: dict[int, tuple] = field(default_factory=dict, repr=False)
    """The last steps' :meth:`_plan` (a step is asked for several times: assigned once)."""
    _ahead: dict[int, Future] = field(default_factory=dict, repr=False)
    _solver: ThreadPoolExecutor | None = field(default=None, repr=False)

    def __post_init__(self):
        positive_int("tokens", self.tokens, "the LLM tokens of a microbatch")
        positive_int("num_microbatches", self.num_microbatches, "the microbatches of a step")

    def __getstate__(self) -> dict:
        # Pickled for the local launcher's ranks: a solver thread and its futures stay here.
        return {**self.__dict__, "_ahead": {}, "_solver": None, "_planned": {}}

    def _plan(self, step: int) -> tuple[list[Sample], list[list[int]], list[int]]:
        """Step ``step``'s samples (carried first), their indices per microbatch, the deferred."""
        if step not in self._planned:
            self._planned = {k: v for k, v in self._planned.items() if k >= step - 1}
            self._planned[step] = self._assigned(step)
        return self._planned[step]

    def _assigned(self, step: int) -> tuple[list[Sample], list[list[int]], list[int]]:
        carried = self._carried_into(step)
        todo = [*carried, *self.samples(step)]
        if not todo:
            raise DataError(f"step {step + 1} has no samples; the data gave an empty global batch")
        lengths = [sample_length(s, self.family, i) for i, s in enumerate(todo)]
        too_long = next((i for i, n in enumerate(lengths) if n > self.tokens), None)
        if too_long is not None:
            raise DataError(
                f"step {step + 1}: sample {too_long} of its global batch takes {lengths[too_long]} LLM tokens, "
                f"more than a microbatch's {self.tokens}; compile with tokens_per_microbatch >= "
                f"{lengths[too_long]}, or leave such samples out of the dataset"
            )
        vision = [self.family.vision_rows(s) for s in todo]
        made = assign(
            lengths,
            vision,
            self.num_microbatches,
            self.tokens,
            first=len(carried),
            replicas=self.replicas,
            method=self.assignment,
        )
        return todo, [list(r) for r in made.rows], list(made.deferred)

    def _carried_into(self, step: int) -> list[Sample]:
        known = max(k for k in self._carried if k <= step)
        for k in range(known, step):
            todo, _, deferred = self._plan(k)
            self._carried[k + 1] = [todo[i] for i in deferred]
        return self._carried[step]

    def trained(self, step: int) -> list[Sample]:
        """The samples step ``step`` trains on (carried in, and its own not deferred)."""
        todo, rows, _ = self._plan(step)
        return [todo[i] for row in rows for i in row]

    def __call__(self, step: int) -> PackedBatch:
        ahead = self._ahead.pop(step, None)
        if ahead is not None:
            ahead.result()  # the solve shares this object's state: let it finish first
        todo, rows, deferred = self._plan(step)
        self._carried[step + 1] = [todo[i] for i in deferred]
        packing = pack_assigned(todo, self.family, rows, self.tokens)
        microbatches = tuple(
            step_inputs(mb, self.family, packing.label_tokens) for mb in packing.microbatches
        )
        schedule = None
        if self.schedule is not None and _plans_here():
            schedule = ahead.result() if ahead is not None else self.schedule(self._image_rows(step))
            if self._solver is None:
                self._solver = ThreadPoolExecutor(1, thread_name_prefix="batch-schedule")
            self._ahead = {step + 1: self._solver.submit(self._solve_ahead, step + 1)}
        images = any(self.family.vision_rows(todo[i]) for row in rows for i in row)
        return PackedBatch(microbatches, len(todo) - len(deferred), tuple(deferred), schedule, images)

    def _image_rows(self, step: int) -> list[int]:
        """Image rows each of step ``step``'s microbatches carries, as its inputs count them
        (a microbatch without images runs the encoder on the family's smallest)."""
        todo, rows, _ = self._plan(step)
        return [max(1, sum(self.family.vision_rows(todo[i]) for i in row)) for row in rows]

    def _solve_ahead(self, step: int) -> BatchPlan:
        return self.schedule(self._image_rows(step))


@dataclass(frozen=True)
class PaddedSteps:
    """``steps(k)``: the samples packed step ``k`` trains on, right-padded in one batch (what an
    eager loop trains on for the same step: ``model(**batch).loss``)."""

    packed: PackedSteps

    def __call__(self, step: int) -> dict[str, torch.Tensor]:
        return padded_batch(self.packed.trained(step), self.packed.family)


def _plans_here() -> bool:
    """Whether this process makes the steps' schedules: global rank 0, or no ranks at all."""
    return not dist.is_initialized() or dist.get_rank() == 0
