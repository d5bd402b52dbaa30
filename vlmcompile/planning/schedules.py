"""Pipeline schedules as action-list generators: one list of :class:`Action` per pipeline rank.

* :func:`gpipe` - all forwards, then all backwards (Huang et al. 2019);
* :func:`one_f_one_b` - PipeDream-Flush / Megatron's non-interleaved 1F1B (Narayanan et al.
  2021): rank r runs p - r - 1 warm-up forwards, then alternates one forward and one backward;
* :func:`interleaved_one_f_one_b` - Megatron's interleaved 1F1B with v model chunks per rank
  (stage c * p + r on rank r); (p - r - 1) * 2 + (v - 1) * p warm-up forwards;
* :func:`zero_bubble` - a ZB-H1-style schedule (Qi et al. 2023): the backward split into
  input-gradient (I) and weight-gradient (W) actions; W is deferred into the time a rank would
  otherwise wait, with 1F1B's bound on microbatches in flight (p - r on rank r, counted until W).

Every generator returns ``tuple[tuple[Action, ...], ...]`` indexed by rank.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Mapping

from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.errors import PlanError

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741 - torch's letters
RankActions = tuple[tuple[Action, ...], ...]


def _check(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise PlanError(f"a schedule needs >= 1 rank and >= 1 microbatch (got {p} ranks, {m} microbatches)")


def gpipe(p: int, m: int) -> RankActions:
    _check(p, m)
    return tuple(
        tuple(Action(r, F, i) for i in range(m)) + tuple(Action(r, B, i) for i in range(m)) for r in range(p)
    )


def one_f_one_b(p: int, m: int) -> RankActions:
    _check(p, m)
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action(r, F, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action(r, F, warmup + i), Action(r, B, i)]
        acts += [Action(r, B, i) for i in range(m - warmup, m)]
        ranks.append(tuple(acts))
    return tuple(ranks)


def interleaved_one_f_one_b(p: int, m: int, v: int) -> RankActions:
    """Megatron-LM's interleaved schedule; microbatches go through the chunks in groups of p."""
    _check(p, m)
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        raise PlanError(
            f"the interleaved 1F1B schedule runs microbatches in groups of the pipeline size: {m} microbatches "
            f"is not a multiple of pp={p}; use {m // p * p or p} or {(m // p + 1) * p}"
        )
    total = m * v

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    ranks = []
    for r in range(p):
        # megatron-core 0.16's get_pp_rank_microbatches (older Megatron-LM ran every microbatch
        # in warm-up when m == p; 0.16 does not, and tests/planning checks we match it).
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)

        def fwd(k: int, r: int = r) -> Action:
            return Action(chunk(k, True) * p + r, F, microbatch(k))

        def bwd(k: int, r: int = r) -> Action:
            return Action(chunk(k, False) * p + r, B, microbatch(k))

        acts = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [fwd(k + warmup), bwd(k)]
        acts += [bwd(k) for k in range(total - warmup, total)]
        ranks.append(tuple(acts))
    return tuple(ranks)


def zero_bubble(
    p: int, m: int, stage_times: Mapping[ActionKind, tuple[float, ...]] | None = None
) -> RankActions:
    """ZB-H1-style: list-schedule each rank greedily in simulated time, preferring I (it unblocks
    the rank before), then F within the in-flight bound, then W (it fills what would be a wait).

    Args:
        stage_times: per action kind, one duration per stage (rank); unit times if omitted.
    """
    _check(p, m)
    times = stage_times or {k: (1.0,) * p for k in (F, I, W)}
    for kind in (F, I, W):
        if len(times.get(kind, ())) != p:
            raise PlanError(f"zero_bubble needs {p} {kind.value} durations, one per stage")
    finish: dict[Action, float] = {}
    acts: list[list[Action]] = [[] for _ in range(p)]
    next_f = [0] * p
    next_i = [0] * p
    next_w = [0] * p
    free_at = [0.0] * p
    events = [(0.0, r) for r in range(p)]
    heapq.heapify(events)

    def done_by(a: Action, t: float) -> bool:
        return a in finish and finish[a] <= t

    def choose(r: int, t: float) -> Action | None:
        if next_i[r] < next_f[r]:
            i = Action(r, I, next_i[r])
            downstream = Action(r + 1, I, next_i[r])
            if r == p - 1 or done_by(downstream, t):
                return i
        in_flight = next_f[r] - next_w[r]
        if next_f[r] < m and in_flight < p - r:
            if r == 0 or done_by(Action(r - 1, F, next_f[r]), t):
                return Action(r, F, next_f[r])
        if next_w[r] < next_i[r]:
            return Action(r, W, next_w[r])
        return None

    while events:
        t, r = heapq.heappop(events)
        if free_at[r] > t or len(acts[r]) == 3 * m:
            continue
        a = choose(r, t)
        if a is None:
            # Wait for the next action anywhere to finish, then look again.
            later = [f for f in finish.values() if f > t]
            if later:
                heapq.heappush(events, (min(later), r))
            continue
        end = t + times[a.kind][r]
        finish[a] = end
        acts[r].append(a)
        counter = {F: next_f, I: next_i, W: next_w}[a.kind]
        counter[r] += 1
        free_at[r] = end
        heapq.heappush(events, (end, r))
        for other in range(p):  # ranks waiting on this result re-check when it lands
            if other != r and free_at[other] <= end and len(acts[other]) < 3 * m:
                heapq.heappush(events, (end, other))
    if any(len(a) != 3 * m for a in acts):
        raise PlanError(f"zero_bubble could not schedule all actions for p={p}, m={m}")
    return tuple(tuple(a) for a in acts)


class Schedule(str, enum.Enum):
    """A schedule's name, as plans, requests and the CLI write it."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: Schedule | str) -> Schedule:
        try:
            return cls(name)
        except ValueError:
            raise PlanError(
                f"unknown schedule {name!r}; choose one of {', '.join(s.value for s in cls)}"
            ) from None

    @classmethod
    def default(cls, v: int) -> Schedule:
        """Megatron-LM's: 1F1B, interleaved when a rank holds several virtual stages."""
        return cls.INTERLEAVED_1F1B if v > 1 else cls.ONE_F_ONE_B


def make_schedule(
    name: Schedule | str,
    p: int,
    m: int,
    *,
    v: int = 1,
    stage_times: Mapping[ActionKind, tuple[float, ...]] | None = None,
) -> RankActions:
    """The named schedule for p ranks, m microbatches and v stages per rank. ``stage_times``
    (per kind, one per stage) is used by the schedules that place work by time (zero_bubble)."""
    schedule = Schedule.parse(name)
    if schedule is Schedule.INTERLEAVED_1F1B:
        return interleaved_one_f_one_b(p, m, v)
    if v > 1:
        raise PlanError(
            f"schedule {schedule.value!r} runs one stage per rank; with v={v} use interleaved_1f1b"
        )
    if schedule is Schedule.ZERO_BUBBLE:
        return zero_bubble(p, m, stage_times)
    return gpipe(p, m) if schedule is Schedule.GPIPE else one_f_one_b(p, m)
