"""Pipeline schedules as action-list generators: one list of :class:`Action` per pipeline rank.

* :func:`gpipe` - all forwards, then all backwards (Huang et al. 2019);
* :func:`one_f_one_b` - PipeDream-Flush / Megatron's non-interleaved 1F1B (Narayanan et al.
  2021): rank r runs p - r - 1 warm-up forwards, then alternates one forward and one backward;
* :func:`interleaved_one_f_one_b` - Megatron's interleaved 1F1B with v model chunks per rank
  (stage c * p + r on rank r); (p - r - 1) * 2 + (v - 1) * p warm-up forwards;
* :func:`zero_bubble` - a ZB-H1-style schedule (Qi et al. 2023): the backward split into
  input-gradient (I) and weight-gradient (W) actions; W is deferred into the time a rank would
  otherwise wait, with 1F1B's bound on microbatches in flight (p - r on rank r, counted until W);
* :func:`v_one_f_one_b` - 1F1B over a V-shaped placement (two or more chunks per rank, every
  other chunk coming back up the ranks). Its bound on microbatches in flight (2p - r on rank r,
  counted on the rank's first chunk until its backward) keeps the V busy where zero_bubble's
  would not.

The last two are made by one list scheduler (:func:`list_schedule`) over any placement
(:mod:`vlmcompile.ir.placement`). Which rank holds a stage is always the placement's to say.

Every generator returns ``tuple[tuple[Action, ...], ...]`` indexed by rank.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping

from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.errors import PlanError, choice
from vlmcompile.ir.placement import Placement, PlacementStyle
from vlmcompile.planning.list_clock import ListClock, Proposal

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741 - torch's letters
RankActions = tuple[tuple[Action, ...], ...]


def _check(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise PlanError(f"a schedule needs >= 1 rank and >= 1 microbatch (got {p} ranks, {m} microbatches)")


FIXED_ORDERS_KEPT = 32
"""Fixed-order schedules kept once made (the plan search and a policy's recompute settings ask
for the same ones again; a deep pipeline's takes a second to make)."""


@functools.lru_cache(maxsize=FIXED_ORDERS_KEPT)
def gpipe(p: int, m: int) -> RankActions:
    _check(p, m)
    return tuple(
        tuple(Action(r, F, i) for i in range(m)) + tuple(Action(r, B, i) for i in range(m)) for r in range(p)
    )


@functools.lru_cache(maxsize=FIXED_ORDERS_KEPT)
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


@functools.lru_cache(maxsize=FIXED_ORDERS_KEPT)
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
    placement = Placement(p, v, PlacementStyle.LOOP)

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
        stage_of_chunk = placement.stages_on(r)

        def fwd(k: int, stages: tuple[int, ...] = stage_of_chunk) -> Action:
            return Action(stages[chunk(k, True)], F, microbatch(k))

        def bwd(k: int, stages: tuple[int, ...] = stage_of_chunk) -> Action:
            return Action(stages[chunk(k, False)], B, microbatch(k))

        acts = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [fwd(k + warmup), bwd(k)]
        acts += [bwd(k) for k in range(total - warmup, total)]
        ranks.append(tuple(acts))
    return tuple(ranks)


def zero_bubble(
    placement: Placement | int,
    m: int,
    stage_times: Mapping[ActionKind, tuple[float, ...]] | None = None,
) -> RankActions:
    """ZB-H1-style (Qi et al. 2023): the backward split into I and W, list-scheduled in simulated
    time (:func:`list_schedule`) preferring I (it unblocks the rank before), then F, then W (it
    fills what would be a wait); rank r admits at most p - r microbatches, counted until their W.
    One stage per rank: with several, that bound holds microbatches back until their W comes back
    from the end of the chain, and the pipeline runs them nearly one at a time (2x 1F1B's step at
    p = 4), so v > 1 is refused until a schedule with its own bound (ZB-V) is written.

    Args:
        placement: where the stages sit (an int: p ranks, one stage each).
        stage_times: per action kind, one duration per stage; unit times if omitted.
    """
    placement = placement if isinstance(placement, Placement) else Placement(placement)
    if placement.v > 1:
        raise PlanError(
            f"schedule 'zero_bubble' runs one stage per rank; with v={placement.v} use interleaved_1f1b "
            "(or v_1f1b for a V-shaped placement)"
        )
    p = placement.pp
    return list_schedule(placement, m, prefer=(I, F, W), admit=lambda r: p - r, stage_times=stage_times)


def v_one_f_one_b(
    placement: Placement, m: int, stage_times: Mapping[ActionKind, tuple[float, ...]] | None = None
) -> RankActions:
    """1F1B over a V-shaped placement (:mod:`vlmcompile.ir.placement`), list-scheduled in
    simulated time: a rank runs a ready forward first (its later chunk's first), then a
    backward; rank r admits at most 2p - r microbatches on its first chunk (a microbatch's
    activations there live until the gradient has come back from the turn of the V). Full
    backwards (B), so the runtime runs it. Against 1F1B with the same work per rank (each chunk
    half a stage, a backward twice a forward) its step is 0.88-0.99x 1F1B's at 1.3-1.5x the
    peak activation memory (p 2-6, m 8-32; tests/planning/test_schedules.py bounds both)."""
    if placement.style is not PlacementStyle.V:
        raise PlanError(f"v_1f1b runs a V-shaped placement; this one is {placement.style.value!r}")
    p = placement.pp
    return list_schedule(placement, m, prefer=(F, B), admit=lambda r: 2 * p - r, stage_times=stage_times)


def _list_inputs(
    placement: Placement,
    m: int,
    prefer: tuple[ActionKind, ...],
    stage_times: Mapping[ActionKind, tuple[float, ...]] | None,
) -> Mapping[ActionKind, tuple[float, ...]]:
    """A list schedule's durations per kind and stage (unit times if none are given), its
    arguments checked."""
    _check(placement.pp, m)
    if set(prefer) not in ({F, I, W}, {F, B}):
        raise PlanError(
            f"a list schedule prefers F and B, or F, I and W; got {', '.join(k.value for k in prefer)}"
        )
    S = placement.num_stages
    times = stage_times or {k: (1.0,) * S for k in prefer}
    for kind in prefer:
        if len(times.get(kind, ())) != S:
            raise PlanError(f"the schedule needs {S} {kind.value} durations, one per stage")
    return times


def list_schedule(
    placement: Placement,
    m: int,
    *,
    prefer: tuple[ActionKind, ...],
    admit: Callable[[int], int],
    stage_times: Mapping[ActionKind, tuple[float, ...]] | None = None,
) -> RankActions:
    """Action lists made by running the pipeline in simulated time: whenever a rank is free it
    takes, of the actions whose inputs are there, one of the first kind in ``prefer`` that has
    one (``prefer`` names F and either B, or I and W). Among backward pieces the lowest
    microbatch goes first, then the later stage; among forwards the later stage first. A new
    microbatch enters the rank's first stage only while the rank holds fewer than
    ``admit(rank)`` microbatches there, counted until their last backward piece. Lists made so
    never deadlock: they are an order the pipeline ran in.

    Args:
        stage_times: per action kind, one duration per stage; unit times if omitted. Transfers
            are not timed (they only shift the order where they would change a choice).
    """
    times = _list_inputs(placement, m, prefer, stage_times)
    p, S = placement.pp, placement.num_stages
    split = I in prefer
    back = I if split else B
    stages_on = [placement.stages_on(r) for r in range(p)]
    clock = ListClock(p, S, split_backward=frozenset(range(S)) if split else frozenset())
    done = {kind: [0] * S for kind in (F, back, W)}  # per stage, the next microbatch of each kind
    acts: list[list[Action]] = [[] for _ in range(p)]
    per_rank = len(prefer) * m * placement.v

    def backward(r: int) -> list[tuple[Action, tuple]]:
        return [
            (Action(s, back, done[back][s]), (done[back][s], -s))
            for s in stages_on[r]
            if done[back][s] < done[F][s]
        ]

    def forward(r: int) -> list[tuple[Action, tuple]]:
        first = stages_on[r][0]
        holding = done[F][first] - done[W if split else back][first]
        return [
            (Action(s, F, done[F][s]), (-s,))
            for s in stages_on[r]
            if done[F][s] < m and not (s == first and holding >= admit(r))
        ]

    def weight(r: int) -> list[tuple[Action, tuple]]:
        return [(Action(s, W, done[W][s]), (done[W][s], -s)) for s in stages_on[r] if done[W][s] < done[I][s]]

    pick = {F: forward, B: backward, I: backward, W: weight}

    def propose(r: int) -> Proposal | None:
        """The rank's earliest start, and there the first kind in ``prefer`` (a tie: the rank
        order, as ranks free at one moment take their actions)."""
        if len(acts[r]) == per_rank:
            return None
        options = [
            (start, order, key, a)
            for order, kind in enumerate(prefer)
            for a, key in pick[kind](r)
            if (start := clock.start_at(a, r)) is not None
        ]
        if not options:
            return None
        start, _, _, a = min(options, key=lambda o: o[:3])
        return start, r, a

    def commit(r: int, a: Action, start: float) -> range:
        acts[r].append(a)
        done[a.kind][a.stage] += 1
        clock.commit(a, r, start + times[a.kind][a.stage])
        return range(p)

    clock.run(
        propose,
        commit,
        done=lambda: all(len(x) == per_rank for x in acts),
        what=f"the list schedule of {p} ranks, v={placement.v}, {m} microbatches",
    )
    return tuple(tuple(a) for a in acts)


class Schedule(str, enum.Enum):
    """A schedule's name, as plans, requests and the CLI write it."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"
    V_1F1B = "v_1f1b"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: Schedule | str) -> Schedule:
        return choice(cls, name, "schedule")

    @classmethod
    def default(cls, v: int, placement: PlacementStyle | str = PlacementStyle.LOOP) -> Schedule:
        """Megatron-LM's: 1F1B, interleaved when a rank holds several virtual stages; V-shaped
        1F1B for a V-shaped placement."""
        if v > 1 and PlacementStyle.parse(placement) is PlacementStyle.V:
            return cls.V_1F1B
        return cls.INTERLEAVED_1F1B if v > 1 else cls.ONE_F_ONE_B


def make_schedule(
    name: Schedule | str,
    placement: Placement,
    m: int,
    *,
    stage_times: Mapping[ActionKind, tuple[float, ...]] | None = None,
) -> RankActions:
    """The named schedule for ``placement``'s stages and m microbatches. ``stage_times`` (per
    kind, one per stage) is used by the schedules that place work by time (the list-scheduled
    ones: zero_bubble, v_1f1b)."""
    schedule = Schedule.parse(name)
    p, v = placement.pp, placement.v
    if schedule is Schedule.ZERO_BUBBLE:
        return zero_bubble(placement, m, stage_times)
    if schedule is Schedule.V_1F1B:
        return v_one_f_one_b(placement, m, stage_times)
    if v > 1 and placement.style is not PlacementStyle.LOOP:
        raise PlanError(
            f"schedule {schedule.value!r} runs the loop placement (stage k on rank k mod pp); a "
            f"{placement.style.value!r} placement with v={v} runs v_1f1b"
        )
    if schedule is Schedule.INTERLEAVED_1F1B:
        return interleaved_one_f_one_b(p, m, v)
    if v > 1:
        raise PlanError(
            f"schedule {schedule.value!r} runs one stage per rank; with v={v} use interleaved_1f1b"
        )
    return gpipe(p, m) if schedule is Schedule.GPIPE else one_f_one_b(p, m)
