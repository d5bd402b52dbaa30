"""The data-parallel collectives of a step, per layer on one DP stream per rank: the one rule of
their timing, which the simulator (:func:`vlmcompile.sim.simulator.simulate`), the stage-cut
evaluation (:func:`vlmcompile.planning.partition_problem.evaluate`) and the bubble schedule's evaluation
(:func:`vlmcompile.planning.bubble_schedule.evaluate_schedule`) all apply.

* **All-gather** (the distributed optimizer's parameters): at the start of the step every rank
  gathers the layers it holds, one after another, in the order its action list first runs them
  forward; a stage's first forward on a rank runs layer by layer, each waiting for its bucket
  (:func:`parameter_wait`).
* **Reduction** of the gradients: a layer's are complete when the last backward of its stage on
  the rank has passed it (a backward walks the stage's layers in reverse, each taking its share
  of the action's time; a W action, torch's split, writes every layer's as it ends); the rank
  reduces them in the order they become complete, one after another. Our runtime runs this rule
  (:class:`vlmcompile.runtime.gradients.OverlappedReduction`: a bucket per layer, each an
  asynchronous all-reduce started when it completes), as Megatron-LM's overlapped buckets do.

The step ends when the last compute or the last reduction ends (:func:`step_end`). Times are in
any unit, as long as all are in the same one (seconds, or a solver's integer units).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from vlmcompile.ir.actions import Action, ActionKind


@dataclass(frozen=True, slots=True)
class DPLayer:
    """One layer's figures for the DP stream, as the stage holding it runs it."""

    name: str
    fwd: float
    """Its forward (TP collectives included)."""
    bwd: float
    """Its whole backward (recompute included)."""
    weight_grad: float
    """The weight-gradient part (a W action's share)."""
    gather: float
    """Its parameters' all-gather."""
    reduce: float
    """Its gradients' reduction."""


class Collective(NamedTuple):
    rank: int
    kind: str
    """"all_gather" or "reduce_scatter"."""
    start: float
    end: float


def gather_times(
    actions: Sequence[Sequence[Action]], stage_layers: Sequence[Sequence[DPLayer]]
) -> tuple[list[dict[str, float]], list[Collective]]:
    """Per rank, when each of its layers' parameters are there; and the all-gathers as run."""
    gathered: list[dict[str, float]] = [{} for _ in actions]
    events: list[Collective] = []
    for rank, acts in enumerate(actions):
        clock = 0.0
        for a in acts:
            if a.kind is not ActionKind.F:
                continue
            for layer in stage_layers[a.stage]:
                if layer.name not in gathered[rank]:
                    gathered[rank][layer.name] = clock = clock + layer.gather
                    events.append(Collective(rank, "all_gather", clock - layer.gather, clock))
    return gathered, events


def parameter_wait(layers: Sequence[DPLayer], start: float, gathered: dict[str, float]) -> float:
    """How long a stage's first forward, started at ``start``, waits for its layers' parameters."""
    t, waited = start, 0.0
    for layer in layers:
        ready = gathered.get(layer.name, 0.0)
        if ready > t:
            waited += ready - t
            t = ready
        t += layer.fwd
    return waited


def reduction(
    backwards: Sequence[tuple[int, Action, float, float]],
    stage_layers: Sequence[Sequence[DPLayer]],
    num_ranks: int,
) -> tuple[list[float], list[Collective]]:
    """Per rank, when its last gradient reduction ends; and the reductions as run.

    Args:
        backwards: every backward (B or W) that ran, as (rank, action, start, end).
    """
    last: dict[tuple[int, int], tuple[Action, float, float]] = {}
    for rank, a, start, end in backwards:
        prev = last.get((a.stage, rank))
        if prev is None or end > prev[2]:
            last[(a.stage, rank)] = (a, start, end)
    ready: list[tuple[float, int, DPLayer]] = []
    for (stage, rank), (a, start, end) in last.items():
        layers = stage_layers[stage]
        if a.kind is ActionKind.W:  # torch's split writes every weight gradient as it ends
            ready += [(end, rank, layer) for layer in reversed(layers)]
            continue
        scale = (end - start) / max(sum(layer.bwd for layer in layers), 1e-30)
        t = start
        for layer in reversed(layers):  # the last layer's gradients first
            t = min(t + layer.bwd * scale, end)  # no rounding past the end
            ready.append((t, rank, layer))
    stream = [0.0] * num_ranks
    ends = [0.0] * num_ranks
    events = []
    for t, rank, layer in sorted(ready, key=lambda x: x[0]):
        begin = max(stream[rank], t)
        stream[rank] = begin + layer.reduce
        events.append(Collective(rank, "reduce_scatter", begin, stream[rank]))
        ends[rank] = max(ends[rank], stream[rank])
    return ends, events


def step_end(compute_end: float, reduced_end: Sequence[float]) -> float:
    """The step: the last compute or the last gradient reduction, whichever ends later."""
    return max(compute_end, *reduced_end) if reduced_end else compute_end
