"""Which activations a rank holds while each of its actions runs.

A microbatch is in flight on a stage from its forward until its last backward action (B, or W
when the stage's backward is split into I and W; never, on a stage with no backward); a stage that recomputes adds its transient
while its backward (B or I) runs. This is the one memory rule: the simulator's peak
(:mod:`vlmcompile.sim.simulator`) walks it with a plan's stage bytes, and the stage-cut model
(:func:`vlmcompile.planning.partition_problem.memory_patterns`) keeps its distinct patterns to state the
same peak as constraints.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from vlmcompile.ir.actions import Action, ActionKind

MemoryPattern = tuple[tuple[tuple[int, int], ...], int]
"""((stage, microbatches in flight), ...), and the stage whose backward runs (-1 for none)."""


def in_flight(actions: Sequence[Action]) -> Iterator[MemoryPattern]:
    """Per action of one rank's list, in order: what is in flight while it runs."""
    split = {a.stage for a in actions if a.kind is ActionKind.W}
    # A stage with no backward (no gradient reaches it) keeps nothing past its forward.
    backward = {a.stage for a in actions if a.kind is not ActionKind.F}
    live: dict[int, int] = {}
    for a in actions:
        busy = -1
        if a.kind is ActionKind.F and a.stage in backward:
            live[a.stage] = live.get(a.stage, 0) + 1
        elif a.kind in (ActionKind.B, ActionKind.I):
            busy = a.stage
        yield tuple(sorted((k, n) for k, n in live.items() if n)), busy
        if a.kind is ActionKind.B or (a.kind is ActionKind.W and a.stage in split):
            live[a.stage] -= 1


def held_together(actions: Sequence[Action], stages: Sequence[int]) -> int:
    """The most microbatches every one of ``stages`` holds at one moment of one rank's list:
    whatever each stage keeps per microbatch, the rank holds at least this many times their sum
    then (a lower bound on its peak that needs no cut). :func:`in_flight`'s counts, walked
    without its patterns: a count only grows at a forward, so the most is right after one."""
    most = 0
    for live in _counts_after_forwards(actions, stages):
        most = max(most, min(live))
    return most


def fullest_moment(actions: Sequence[Action], stages: Sequence[int]) -> tuple[int, ...]:
    """Per stage of ``stages``, the microbatches it holds at the moment one rank's list holds the
    most of them in all (the first such): whatever each keeps, the rank holds at least their
    bytes at once."""
    most, counts = -1, tuple(0 for _ in stages)
    for live in _counts_after_forwards(actions, stages):
        if sum(live) > most:
            most, counts = sum(live), tuple(live)
    return counts


def _counts_after_forwards(actions: Sequence[Action], stages: Sequence[int]) -> Iterator[list[int]]:
    """``stages``' in-flight counts (as :func:`in_flight` keeps them) right after each forward of
    one of them, and once before any (the same list, updated in place)."""
    split = {a.stage for a in actions if a.kind is ActionKind.W}
    backward = {a.stage for a in actions if a.kind is not ActionKind.F}
    where = {k: i for i, k in enumerate(stages)}
    live = [0] * len(stages)
    yield live
    for a in actions:
        i = where.get(a.stage)
        if i is None:
            continue
        if a.kind is ActionKind.F:
            if a.stage in backward:
                live[i] += 1
                yield live
        elif a.kind is ActionKind.B or (a.kind is ActionKind.W and a.stage in split):
            live[i] -= 1


def pattern_bytes(pattern: MemoryPattern, keep: Sequence, transient: Sequence) -> Any:
    """Bytes a pattern holds: microbatches in flight times what each stage keeps per
    microbatch, plus the transient of the stage whose backward runs (numbers or CP-SAT
    expressions)."""
    live, busy = pattern
    return sum(n * keep[k] for k, n in live) + (transient[busy] if busy >= 0 else 0)


def held_across_steps(
    actions: Sequence[Action], carried: Mapping[Action, Action], out_bytes: Sequence[float]
) -> list[float]:
    """Per action of one rank's list, the run-ahead outputs (``Plan.carried``: forward for the
    next batch -> the forward that takes its output) the rank holds while it runs: those the
    step before made for forwards on this rank, until that forward has run; and those this step
    makes for the next, from their forward on."""
    taken_by = {consumer: made for made, consumer in carried.items()}
    mine = set(actions)
    waiting = sum(out_bytes[made.stage] for consumer, made in taken_by.items() if consumer in mine)
    kept = 0.0
    out = []
    for a in actions:
        if a in carried:
            kept += out_bytes[a.stage]
        out.append(waiting + kept)
        if a in taken_by:
            waiting -= out_bytes[taken_by[a].stage]
    return out
