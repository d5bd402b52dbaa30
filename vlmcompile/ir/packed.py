"""What capture, codegen and the runtime share about packed training data: the layout a
pipeline was captured for (:class:`PackedLayout`) and one step's microbatches
(:class:`PackedBatch`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vlmcompile.ir.actions import Action
from vlmcompile.ir.shape_plan import InputSizes


@dataclass(frozen=True, slots=True)
class VaryingDim:
    """A dimension of a microbatch input that differs between microbatches."""

    key: str
    dim: int
    name: str
    """What it counts (``tiles``, ``merged_patches``, ``image_tokens``)."""
    low: int
    high: int
    """The bounds the capture holds for."""


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """A pipeline captured once for packed microbatches of ``tokens`` LLM tokens a row."""

    family: str
    tokens: int
    """LLM tokens of a microbatch (its one row): fixed, so the LLM's stage boundaries are."""
    varying: tuple[VaryingDim, ...]
    input_sizes: InputSizes
    """How the size symbols of the captured graph are read off a microbatch."""

    def describe(self) -> str:
        dims = ", ".join(f"{v.key}[{v.dim}] ({v.name}) {v.low}..{v.high}" for v in self.varying)
        return f"{self.family} microbatches of {self.tokens} LLM tokens; varying: {dims}"


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """One step's packed microbatches, the same on every rank: data-parallel rank ``d`` of ``D``
    runs ``microbatches[d * m : (d + 1) * m]``. Each microbatch's loss is already its share of
    the step's loss (summed over the step's label tokens), so they add up with no weights."""

    microbatches: tuple[Mapping[str, Any], ...]
    num_samples: int
    """Samples packed into them."""
    deferred: tuple[int, ...] = ()
    """Indices (in the samples given) of those left for the next step."""
    schedule: BatchPlan | None = None
    """This batch's own schedule (re-planned for its microbatches); None: the plan's."""
    images: bool = True
    """Whether any of its samples has an image. Without one, eager training never runs the
    vision encoder (its parameters get no gradient, and AdamW leaves them alone), while each
    microbatch here still runs it on the family's smallest image: the runtime then drops the
    all-zero gradients that gives (:func:`vlmcompile.runtime.gradients.drop_unused_gradients`)."""


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """The schedule one batch runs, made for its microbatches on one host (global rank 0, whose
    copy every rank runs: ranks that planned apart could disagree, and a pipeline whose ranks
    disagree hangs)."""

    actions: tuple[tuple[tuple[Action, ...], ...], ...]
    """Per data-parallel replica, per pipeline rank, its actions (numbered by packed microbatch)."""
    order: tuple[tuple[int, ...], ...]
    """Per replica, its packed microbatches (0-based) in the order its LLM runs them."""
    step_s: float
    """The step the cost model predicts for the batch under these actions."""
    static_step_s: float
    """... and under the plan's own."""
    solve_s: float
    source: str
    """``re-planned``, ``static`` (the plan's own actions timed best) or ``last good`` (the
    re-planning timed nothing by its limit)."""
    kernel_level: tuple[Mapping[Action, int], ...] = ()
    """Per replica, its encoder actions run inside LLM actions' TP gaps (see
    ``Plan.kernel_level``); empty: none."""
    late: int = 0
    """Replicas whose re-planning overran its time limit: a try that ended past it went unused
    (``last good``: not even the plan's own timing was done by then)."""

    @property
    def gain(self) -> float:
        """Predicted step under the plan's own actions over this one (1.10: 10 % faster)."""
        return self.static_step_s / self.step_s if self.step_s else 1.0


def nonfinite_keys(values: Mapping[str, Any]) -> list[str]:
    """The keys of ``values`` whose floating-point tensors hold NaN or infinite values."""
    return [
        key
        for key, value in values.items()
        if isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and not bool(torch.isfinite(value).all())
    ]
