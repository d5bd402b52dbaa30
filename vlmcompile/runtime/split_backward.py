"""A stage's backward split in two actions, as zero-bubble schedules place them (Qi et al. 2023):
I computes the gradients of the stage's inputs (what the stage before waits for) and keeps what
the weights' gradients need; W computes those later, in a bubble. torch's own split
(``torch.distributed.pipelining._backward``) does the work: I takes the gradients at the
autograd nodes where the weights' branches leave the input path, W runs from there.

A stage whose inputs take no gradient (the first, or one after frozen stages only) has nothing
for I to send: its whole backward runs as W. Every gradient lands in ``.grad`` as a whole
backward leaves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlmcompile.runtime.wire import floats


@dataclass(slots=True)
class WeightWork:
    """What a W action computes: from torch's saved branches (``groups``), or, where I had no
    input to differentiate, the whole backward of ``outputs``."""

    weights: list[torch.nn.Parameter]
    groups: list[dict[str, Any]] | None = None
    outputs: list[torch.Tensor] | None = None
    grads: list[torch.Tensor] | None = None


def backward_from(out: Any, grads: Sequence, *, last: bool) -> tuple[list[torch.Tensor], list | None]:
    """(the saved outputs a backward starts from, their gradients): the last stage's scaled loss
    (None for a microbatch without label tokens), or the outputs that need gradients, each with
    the gradient received for it."""
    if last:
        return ([out], None) if out is not None and out.requires_grad else ([], None)
    pairs = [(o, g) for o, g in zip(floats(out), grads) if o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def input_gradients(
    outputs: list, grads: list | None, leaves: Sequence, stage: torch.nn.Module
) -> WeightWork:
    """The I action: the inputs' gradients into their ``.grad``; what its W needs, returned."""
    from torch.distributed.pipelining._backward import stage_backward_input

    weights = [p for p in stage.parameters() if p.requires_grad]
    inputs = [x for x in leaves if x.requires_grad]
    if not inputs:
        return WeightWork(weights, outputs=outputs, grads=grads)
    # torch detaches the outputs in place once done, which a view refuses: start from a copy.
    outputs = [o.clone() if o._is_view() else o for o in outputs]
    _, groups = stage_backward_input(outputs, grads, inputs, iter(weights))
    return WeightWork(weights, groups=groups)


def weight_gradients(work: WeightWork | None) -> None:
    """The W action: the weights' gradients added to their ``.grad`` (None: its I had nothing to
    start from, a microbatch without label tokens)."""
    if work is None:
        return
    if work.groups is None:
        torch.autograd.backward(work.outputs, work.grads)
        return
    from torch.distributed.pipelining._backward import stage_backward_weight

    stage_backward_weight(iter(work.weights), work.groups)
