"""A step's gradients on a rank: made apart from those the caller holds (only this step's are
reduced), added to them afterwards as eager's ``backward`` accumulates, and dropped where eager
training would have none."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


@contextlib.contextmanager
def added_to_held(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Within: ``params`` start without gradients, so a reduction sums this step's alone (the
    gradients held before, by a caller accumulating over steps, were summed when they were
    made); after: those held before are added back."""
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    yield
    for p, old in zip(params, held):
        if old is not None:
            p.grad = old if p.grad is None else p.grad + old


def drop_unused_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """``grad = None`` for the parameters whose gradient is zero everywhere, after a packed step
    without a single image: eager training on that step never runs the vision encoder, so its
    parameters get no gradient and AdamW skips them (no momentum step, no weight decay); here each
    microbatch ran the encoder on a stand-in image whose features reach no token, which gives
    exact zeros. Every rank holds the reduced gradients, so every rank drops the same ones."""
    for p in params:
        if p.grad is not None and not bool(p.grad.any()):
            p.grad = None
