"""Training loops over a :class:`~vlmcompile.runtime.executor.PipelineRunner`: one step
returning the gradients, and timed steps of one or several runners (for measured comparisons)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from vlmcompile.ir.gc_pause import collection_deferred
from vlmcompile.runtime.executor import PipelineRunner


def one_step(runner: PipelineRunner, batch: Mapping[str, Any]) -> dict[str, Any]:
    """One training step (no optimizer): the loss and this rank's gradients by original name."""
    for p in runner.parameters():
        p.grad = None
    loss = runner.step(batch)
    return {
        "loss": loss,
        "grads": {n: p.grad for n, p in runner.named_parameters().items()},
    }


def timed_steps(
    runner: PipelineRunner, batch: Mapping[str, Any], num_steps: int, lr: float
) -> dict[str, Any]:
    """``num_steps`` training steps with SGD(lr) on the same batch; this rank's losses and step
    times (the ranks start every step together, after a barrier)."""
    return interleaved_steps((runner,), batch, num_steps, lr)[0]


def interleaved_steps(
    runners: Sequence[PipelineRunner],
    batch: Mapping[str, Any],
    num_steps: int,
    lr: float,
    on_step: Callable[[int, list[dict[str, list[float]]]], None] | None = None,
) -> list[dict[str, Any]]:
    """``num_steps`` training steps of every runner (each with its own parameters and SGD(lr))
    on the same batch, interleaved step by step, the order reversed every other step (A B, B A,
    A B, ...): a shared machine's speed drifts over minutes, and interleaving puts the drift on
    every plan alike. Per runner, this rank's losses and step times; the ranks start every step
    together, after a barrier. ``on_step(k, results so far)`` is called after every round.

    Garbage is collected before each step, outside its time, and automatic collection is paused
    inside it: a process holding several runners' modules and graphs collects for long enough
    that whichever step a collection lands in measured up to 10 % slower than a copy of the same
    plan (demo model, 2 CPU ranks, 2026-11-27), and a collection on one rank holds the other up."""
    optimizers = [torch.optim.SGD(r.parameters(), lr=lr) for r in runners]
    out: list[dict[str, list[float]]] = [{"losses": [], "step_s": []} for _ in runners]
    for k in range(num_steps):
        order = range(len(runners)) if k % 2 == 0 else reversed(range(len(runners)))
        for j in order:
            optimizers[j].zero_grad(set_to_none=True)
            gc.collect()
            runners[j]._wait(dist.barrier(async_op=True), "the barrier that starts every step together")
            with collection_deferred():
                start = time.perf_counter()
                # The same batch again: a plan that runs forwards a batch ahead runs them for it.
                loss = runners[j].step(batch, next_batch=batch if k + 1 < num_steps else None)
                out[j]["step_s"].append(time.perf_counter() - start)
            optimizers[j].step()
            out[j]["losses"].append(float(loss))
        if on_step is not None:
            on_step(k, out)
    return out
