"""Encoder work in the LLM's bubbles: the scheduling problem and its two solvers.

The numbers are a :class:`BubbleProblem`: a plan whose encoders have a plan of their own
(:mod:`vlmcompile.planning.encoder_plans`), its stages' action times, transfers and activation
bytes in integer units, the LLM's action lists, and each rank's memory left for activations.
The LLM's actions keep their order on every rank (the schedule the request names: 1F1B or
interleaved 1F1B); the encoder's actions are placed around them. The constraints (Optimus
sec. 2.3, challenge 2):

* iteration: every encoder action of the step runs in the step;
* encoder-internal: microbatch j's forward of encoder stage i after stage i - 1's, its backward
  before stage i - 1's (the chain's dependencies), all on the encoder pipeline j is given to;
* encoder-LLM: j's encoder forward ends before the first LLM stage's forward of j starts (plus
  the transfer when they run on different ranks); its encoder backward starts after the first
  LLM stage's backward of j (plus the transfer back);
* one action at a time per rank, and per rank the activations in flight plus the recompute
  transient of a running backward within the rank's memory at every step (the simulator's rule,
  :mod:`vlmcompile.sim.in_flight`).

These are the timing rules of :func:`vlmcompile.sim.timeline.run_actions`, and
:func:`evaluate_schedule` times the DP collectives as the simulator does
(:mod:`vlmcompile.sim.dp`): the step of a layer-level schedule here is the simulator's. The
CP-SAT model leaves the DP collectives out (its objective and bound are the actions' alone).

:func:`greedy` is a list scheduler (each rank runs its next LLM action when it can, and ready
encoder work when it would otherwise wait); :func:`solve_schedule` is the CP-SAT model (interval
variables per rank, one optional set per encoder pipeline for each microbatch), warm-started
from the greedy schedule. :func:`evaluate_schedule` times any schedule of the problem.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from vlmcompile.cost_models.memory import fits
from vlmcompile.cost_models.stage_costs import PlanCosts
from vlmcompile.ir.actions import Action, ActionKind, carried, dependencies, interned
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Plan
from vlmcompile.planning.list_clock import ListClock, Proposal
from vlmcompile.sim import dp
from vlmcompile.sim.in_flight import held_across_steps, in_flight, pattern_bytes
from vlmcompile.sim.kernel_stream import HostFill, KernelStream
from vlmcompile.sim.simulator import dp_layer
from vlmcompile.sim.timeline import run_actions

F, B = ActionKind.F, ActionKind.B
RankActions = tuple[tuple[Action, ...], ...]

LNS_ONLY_ABOVE = 2_000
"""Interval variables above which CP-SAT runs only its large-neighbourhood workers."""
UNITS_PER_STEP = 1_000_000
"""Time resolution: about this many units in the slowest rank's work (a millionth of a step)."""


@dataclass(frozen=True, slots=True)
class StageUnits:
    """One stage of the chain in integer units (times) and bytes (memory)."""

    ranks: tuple[int, ...]
    """Its holders; for an encoder stage, holder k belongs to encoder pipeline k."""
    fwd: int
    bwd: int
    send_fwd: int
    """To the next stage, when it runs on another rank."""
    send_bwd: int
    """To the previous stage, when it runs on another rank."""
    keep: int
    """Activation bytes kept per microbatch from its forward to its backward."""
    transient: int
    """Extra bytes while its backward runs (recompute)."""
    fwd_tp: int = 0
    """The part of ``fwd`` spent in TP collectives (the compute stream's gaps)."""
    bwd_tp: int = 0
    out: int = 0
    """Bytes of one microbatch's output (held across the step boundary when it runs ahead)."""


@dataclass(frozen=True, slots=True)
class BubbleProblem:
    stages: tuple[StageUnits, ...]
    encoder_stages: int
    """The chain's first ``encoder_stages`` stages are the encoder's."""
    num_microbatches: int
    llm_actions: RankActions
    """Per pipeline rank, its LLM actions in the order they keep."""
    mem_limit: tuple[int, ...]
    """Per rank, the bytes its activations may take (the cap less its model states)."""
    unit_s: float
    """Seconds per time unit."""
    dp_layers: tuple[tuple[dp.DPLayer, ...], ...] = ()
    """Per stage, its layers' figures for the DP stream, in units (:mod:`vlmcompile.sim.dp`);
    empty: no DP collectives."""
    work: tuple[tuple[float, float], ...] = ()
    """Per microbatch, its (encoder, LLM) work over the stages' figures (variable data: a
    microbatch of half the image rows the stages were costed at is 0.5 on the encoder); empty:
    every microbatch as costed. Memory stays at the figures (the plan's bound)."""
    forward_only: frozenset[int] = frozenset()
    """Encoder stages no gradient reaches (frozen, nothing trainable before them): forwards only."""
    ahead: frozenset[int] = frozenset()
    """Microbatches whose encoder forwards run one global batch ahead (``Plan.ahead``): this
    step's are for the next batch, and the LLM's first forward of one has its input at the
    step's start. Only where every encoder stage is forward-only (a frozen encoder)."""

    def __post_init__(self):
        if not 0 < self.encoder_stages < len(self.stages):
            raise PlanError(
                f"a bubble schedule needs encoder stages and LLM stages; got {self.encoder_stages} encoder "
                f"stages of {len(self.stages)}"
            )
        counts = {len(self.stages[s].ranks) for s in range(self.encoder_stages)}
        if len(counts) != 1:
            raise PlanError(f"encoder stages held by different numbers of ranks {sorted(counts)}")
        if self.work and len(self.work) != self.num_microbatches:
            raise PlanError(
                f"work is given for {len(self.work)} microbatches; the schedule has {self.num_microbatches}"
            )
        if any(not (math.isfinite(f) and f >= 0) for pair in self.work for f in pair):
            raise PlanError(f"work factors must be finite and at least 0; got {self.work}")
        if self.ahead and not set(range(self.encoder_stages)) <= self.forward_only:
            raise PlanError(
                "encoder forwards run ahead only when no gradient reaches the encoder (frozen, nothing "
                "trainable before it)"
            )
        if any(not 0 <= j < self.num_microbatches for j in self.ahead):
            raise PlanError(
                f"run-ahead microbatches {sorted(self.ahead)} outside 0..{self.num_microbatches - 1}"
            )

    @property
    def ahead_actions(self) -> frozenset[Action]:
        """The forwards that run for the next batch (``Plan.ahead``)."""
        return interned(frozenset(Action(s, F, j) for j in self.ahead for s in range(self.encoder_stages)))

    def carried(self) -> dict[Action, Action]:
        """Run-ahead output -> the LLM forward that takes it (``Plan.carried``)."""
        return carried(self.ahead_actions)

    def with_work(self, work: Sequence[tuple[float, float]]) -> BubbleProblem:
        """The same schedule problem for microbatches of ``work`` (see :attr:`work`)."""
        return dataclasses.replace(self, work=tuple((float(e), float(m)) for e, m in work))

    def factor(self, a: Action) -> float:
        """Action ``a``'s work over its stage's figures."""
        if not self.work:
            return 1.0
        encoder, llm = self.work[a.microbatch]
        return encoder if a.stage < self.encoder_stages else llm

    @property
    def num_ranks(self) -> int:
        return len(self.llm_actions)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def pipelines(self) -> int:
        return len(self.stages[0].ranks)

    @property
    def first_llm_stage(self) -> int:
        return self.encoder_stages

    def duration(self, a: Action) -> int:
        s = self.stages[a.stage]
        units = s.fwd if a.kind is F else s.bwd
        return units if not self.work else max(1, round(units * self.factor(a)))

    def transfer(self, dep: Action, action: Action) -> int:
        """Units from ``dep``'s end until ``action`` may start, when they run on different ranks."""
        if dep.stage == action.stage:
            return 0
        s = self.stages[dep.stage]
        return s.send_fwd if dep.kind is F else s.send_bwd

    def encoder_actions(self, microbatch: int) -> list[Action]:
        """Microbatch ``microbatch``'s encoder actions in dependency order."""
        fwd = [Action(s, F, microbatch) for s in range(self.encoder_stages)]
        return fwd + [
            Action(s, B, microbatch)
            for s in reversed(range(self.encoder_stages))
            if s not in self.forward_only
        ]

    def rank_of(self, a: Action, pipeline: int) -> int:
        """The rank that runs encoder action ``a`` when its microbatch is on encoder ``pipeline``."""
        return self.stages[a.stage].ranks[pipeline]

    def work_per_rank(self) -> list[int]:
        """Each rank's LLM work plus an even share of the encoder's (a lower bound's ingredients)."""
        enc = sum(self.duration(a) for j in range(self.num_microbatches) for a in self.encoder_actions(j))
        llm = [sum(self.duration(a) for a in acts) for acts in self.llm_actions]
        return [w + enc // self.num_ranks for w in llm]


def problem_from(
    plan: Plan,
    costs: PlanCosts,
    mem_cap_bytes: float,
    *,
    unit_s: float | None = None,
) -> BubbleProblem:
    """The scheduling problem of a plan with a separate encoder group (its stages' costs from
    :func:`~vlmcompile.cost_models.stage_costs.plan_costs`; ``mem_cap_bytes`` per rank)."""
    groups = [s.group for s in plan.stages]
    first_llm = groups.index(plan.stages[-1].group)
    encoder_groups = sorted(set(groups[:first_llm]))
    if len(encoder_groups) > 1:
        raise PlanError(
            f"the encoders have different plans ({', '.join(f'{g}: {plan.parallel[g]}' for g in encoder_groups)}); "
            "the scheduler places one encoder plan, as Optimus schedules several encoders as one (sec. 4.4) - "
            "give every encoder the same degrees"
        )
    if first_llm == 0 or any(g == plan.stages[-1].group for g in groups[:first_llm]):
        raise PlanError("the plan has no encoder stages before its LLM stages to schedule")
    if any(g == groups[0] for g in groups[first_llm:]):
        raise PlanError(
            "the plan's encoder and LLM stages interleave in its chain; encoder stages must come first"
        )
    stage_costs = costs.stages
    if unit_s is None:
        heaviest = max(sum(stage_costs[a.stage].action_s(a.kind) for a in acts) for acts in plan.actions)
        unit_s = max(heaviest, 1e-12) / UNITS_PER_STEP

    def units(seconds: float, minimum: int = 0) -> int:
        return max(minimum, round(seconds / unit_s))

    figures = tuple(
        StageUnits(
            ranks=stage.ranks,
            fwd=units(c.action_s(F), 1),
            bwd=units(c.action_s(B), 1),
            send_fwd=units(c.send_fwd_s),
            send_bwd=units(c.send_bwd_s),
            keep=math.ceil(c.act_bytes),
            transient=math.ceil(c.transient_bytes),
            fwd_tp=units(c.fwd_tp_comm_s),
            bwd_tp=units(c.bwd_tp_comm_s),
            out=math.ceil(c.out_bytes),
        )
        for stage, c in zip(plan.stages, stage_costs)
    )
    llm_actions = tuple(tuple(a for a in acts if a.stage >= first_llm) for acts in plan.actions)
    limits = tuple(max(0, math.floor(mem_cap_bytes - static)) for static in costs.static_bytes)
    dp_layers = tuple(tuple(_in_units(dp_layer(c), unit_s) for c in stage.layers) for stage in stage_costs)
    return BubbleProblem(
        figures,
        first_llm,
        plan.num_microbatches,
        llm_actions,
        limits,
        unit_s,
        dp_layers,
        forward_only=plan.forward_only_stages(),
    )


def _in_units(layer: dp.DPLayer, unit_s: float) -> dp.DPLayer:
    return dp.DPLayer(
        layer.name,
        layer.fwd / unit_s,
        layer.bwd / unit_s,
        layer.weight_grad / unit_s,
        layer.gather / unit_s,
        layer.reduce / unit_s,
    )


# ---- timing any schedule ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ScheduleEvaluation:
    step: int
    """Units until the last action or the last DP gradient reduction ends, and any wait for
    parameters included (:mod:`vlmcompile.sim.dp`)."""
    peak_bytes: tuple[int, ...]
    fits: bool

    def step_s(self, problem: BubbleProblem) -> float:
        return self.step * problem.unit_s


def evaluate_schedule(problem: BubbleProblem, actions: RankActions) -> ScheduleEvaluation:
    """The step of per-rank action lists under the problem's rules, their data-parallel
    collectives timed as the simulator times them (:mod:`vlmcompile.sim.dp`), and each rank's
    peak bytes."""
    peaks = tuple(rank_peak(problem, acts) for acts in actions)
    return ScheduleEvaluation(round(_step(problem, actions)), peaks, fits(peaks, problem.mem_limit))


def _timed(problem: BubbleProblem, actions: RankActions) -> list:
    """The actions of a schedule timed by the problem's figures alone (no DP collectives)."""
    return run_actions(
        actions,
        problem.num_stages,
        duration=lambda a, _s: problem.duration(a),
        transfer=problem.transfer,
        ahead=problem.ahead_actions,
    )


def _step(problem: BubbleProblem, actions: RankActions) -> float:
    if not any(layer.gather or layer.reduce for stage in problem.dp_layers for layer in stage):
        return max((t.end_s for t in _timed(problem, actions)), default=0)
    gathered, _ = dp.gather_times(actions, problem.dp_layers)
    rank_of = {a: rank for rank, acts in enumerate(actions) for a in acts}
    first_forwards: set[tuple[int, int]] = set()

    def duration(a: Action, start: float) -> float:
        rank = rank_of[a]
        if a.kind is not F or (rank, a.stage) in first_forwards:
            return problem.duration(a)
        first_forwards.add((rank, a.stage))
        return problem.duration(a) + dp.parameter_wait(problem.dp_layers[a.stage], start, gathered[rank])

    timed = run_actions(
        actions, problem.num_stages, duration=duration, transfer=problem.transfer, ahead=problem.ahead_actions
    )
    last_end = [0.0] * problem.num_ranks
    for t in timed:
        last_end[t.rank] = max(last_end[t.rank], t.end_s)
    reduced, _ = dp.reduction(
        [(t.rank, t.action, t.start_s, t.end_s) for t in timed if t.action.kind is B],
        problem.dp_layers,
        problem.num_ranks,
    )
    return dp.step_end(max(last_end, default=0.0), reduced)


def rank_peak(problem: BubbleProblem, acts: Sequence[Action]) -> int:
    keep = [s.keep for s in problem.stages]
    transient = [s.transient for s in problem.stages]
    across = held_across_steps(acts, problem.carried(), [s.out for s in problem.stages])
    return max(
        (pattern_bytes(p, keep, transient) + held for p, held in zip(in_flight(acts), across)), default=0
    )


# ---- the list scheduler ----------------------------------------------------------------------
GREEDY_SETTINGS = ((1, False), (1, True), (2, False), (2, True), (4, False), (8, False), (16, False))
"""(lookahead, fill_only) settings of the list scheduler tried on the fastest encoder plans."""
KERNEL_SETTINGS = (
    (4, False, False),
    (8, False, False),
    (16, False, True),
    (8, True, False),
    (32, True, True),
)
"""Settings (lookahead, fill_only, end_room) of the list scheduler run with encoder work inside
the LLM's TP gaps too. Where the LLM has TP collectives these schedules won on every Optimus
setup (the layer-level ones by 2-8 %), so the layer-level settings are cut to one there (the
kernel level's reference)."""
SCREEN_LAYER, SCREEN_KERNEL = ((8, False),), ((16, True, True),)
"""The settings every encoder plan is screened with: those that won most often."""
PER_BATCH_SETTINGS = ((8, False), (1, False), (2, True), (16, False))
"""(lookahead, fill_only) a batch's re-planning (:mod:`vlmcompile.planning.per_batch`) tries in
turn while its time lasts: the screen's setting first."""


def greedy(
    problem: BubbleProblem,
    *,
    lookahead: int = 1,
    fill_only: bool = False,
    riders: dict[Action, int] | None = None,
    end_room: bool = False,
) -> RankActions:
    """A schedule made one action at a time, the earliest-starting first: a rank runs its next
    LLM action when it can, and while it would wait, ready encoder work (forwards of the
    microbatches the first LLM stage needs next, at most ``lookahead`` ahead of it; backwards
    once their gradients are back). With ``fill_only`` encoder work goes only into gaps it fits
    (it never delays a ready LLM action), except the forward the first LLM stage waits for.
    A microbatch goes to the encoder pipeline whose first rank takes its first encoder forward.

    With ``riders`` (a dict the schedule's kernel-level actions and their spans are written to),
    each LLM action with TP collectives also runs encoder work inside it (Optimus's
    ``AssignKernels``, by the rule of :mod:`vlmcompile.sim.kernel_stream`): the rank's open
    riders first, then ready encoder actions while its TP gaps have room. A rider stays open
    over the rank's next LLM actions until its work is done, and closes early (its rest
    lengthening the host) where the rank's next LLM action would wait for it, directly or
    through the pipeline. With ``end_room`` a rider is opened only where the TP gaps of the
    rank's LLM actions from there on can take it and the riders open before it: what they cannot
    take would lengthen the rank's last LLM action, on the pipeline's final backward wave. (A
    heuristic: it counts whole gaps, while a rider whose TP collectives outgrow a host's compute
    leaves part of that host's gap unused.)"""
    scheduler = _ListScheduler(
        problem, lookahead, fill_only, kernels=_Kernels(problem, end_room) if riders is not None else None
    )
    actions = scheduler.run()
    if riders is not None:
        riders.update(scheduler.kernels.spans)
    return actions


class _ListScheduler:
    """The state of one :func:`greedy` run on the list schedulers' clock
    (:class:`~vlmcompile.planning.list_clock.ListClock`): each rank's place in its LLM actions,
    the activation bytes it holds, which encoder pipeline each microbatch went to and how far its
    encoder actions have got, and the microbatch the first LLM stage needs next."""

    def __init__(self, problem: BubbleProblem, lookahead: int, fill_only: bool, *, kernels: _Kernels | None):
        self.p, self.lookahead, self.fill_only, self.kernels = problem, lookahead, fill_only, kernels
        self.clock = ListClock(
            problem.num_ranks, problem.num_stages, transfer=problem.transfer, ahead=problem.ahead_actions
        )
        m = problem.num_microbatches
        self.position = [0] * problem.num_ranks
        self.out: list[list[Action]] = [[] for _ in range(problem.num_ranks)]
        self.pipeline_of: dict[int, int] = {}
        self.live = [0] * problem.num_ranks
        self.keep = [0 if k in problem.forward_only else s.keep for k, s in enumerate(problem.stages)]
        self.first = problem.first_llm_stage
        self.sequences = [problem.encoder_actions(j) for j in range(m)]
        self.done_enc = [0] * m
        self.unstarted = list(range(m))
        """Microbatches no encoder action has started of, in order."""
        self.waiting_on: list[set[int]] = [set() for _ in range(problem.num_ranks)]
        """Per rank, the microbatches started on an encoder pipeline whose next encoder action
        it runs."""
        self.need = 0
        """The microbatch the first LLM stage needs next."""
        # The encoder actions a rank may run next change for every rank when a microbatch starts
        # (the unstarted ones are on offer to every first rank) or the first LLM stage moves on,
        # and for one rank when one of its microbatches' encoder actions starts or ends: cached
        # per rank between such changes, and only the ranks whose offer changed propose again.
        self.version = 0
        self.offer_changed: set[int] = set()
        self.cached: dict[int, tuple[int, int, list[Action]]] = {}
        self.holders = [set(s.ranks) for s in problem.stages]
        self.total = sum(len(a) for a in problem.llm_actions) + sum(len(seq) for seq in self.sequences)

    def run(self) -> RankActions:
        # A rank's proposal changes only when its own state, the inputs of its actions, or the
        # encoder work on offer change: the clock asks those ranks alone again after each commit.
        self.clock.run(
            self.propose,
            self.commit,
            done=lambda: len(self.clock.ends) >= self.total,
            refresh_all=self.encoder_state,
            what="the greedy bubble schedule",
        )
        return tuple(tuple(acts) for acts in self.out)

    def encoder_state(self) -> tuple[int, int]:
        while self.need < self.p.num_microbatches and Action(self.first, F, self.need) in self.clock.ends:
            self.need += 1
        return self.version, self.need

    def candidates(self, rank: int) -> list[Action]:
        hit = self.cached.get(rank)
        if hit is None or hit[:2] != (self.version, self.need):
            hit = self.cached[rank] = (self.version, self.need, self._encoder_candidates(rank))
        return hit[2]

    def _encoder_candidates(self, rank: int) -> list[Action]:
        """Encoder actions ``rank`` may run next: each microbatch's next one (its encoder actions
        run in dependency order), on the rank its pipeline puts it (a microbatch not yet given to
        a pipeline: its first forward, on any first rank); forwards at most ``lookahead``
        microbatches ahead of the one the LLM needs next (run-ahead ones: of the first not
        started). Microbatches in order; only those started and the first unstarted ones are
        looked at (a paper-scale step has hundreds)."""
        problem, need, lookahead, kernels = self.p, self.need, self.lookahead, self.kernels
        unstarted_ahead = (
            next((j for j in self.unstarted if j in problem.ahead), None) if problem.ahead else None
        )
        ahead_limit = unstarted_ahead + lookahead if unstarted_ahead is not None else problem.num_microbatches
        # An unstarted microbatch's next action is its first forward: past both limits none runs.
        stop = max(need + lookahead, ahead_limit if unstarted_ahead is not None else 0)
        fresh = itertools.takewhile(lambda j: j < stop, self.unstarted)
        out = []
        for j in sorted((*self.waiting_on[rank], *fresh)):
            a = self.sequences[j][self.done_enc[j]]
            if kernels is not None and a in kernels.open:
                continue  # running at kernel level: its microbatch's next action waits for it
            if a.kind is F and j >= (ahead_limit if j in problem.ahead else need + lookahead):
                continue
            # A started microbatch waits on this rank; an unstarted one starts on any first rank.
            if j in self.pipeline_of or rank in problem.stages[a.stage].ranks:
                out.append(a)
        return out

    def propose(self, rank: int) -> Proposal | None:
        """The rank's next action and when it would start: its next LLM action, or ready encoder
        work that starts earlier (or fits before it, with ``fill_only``)."""
        p, clock = self.p, self.clock
        llm = p.llm_actions[rank]
        llm_next = llm[self.position[rank]] if self.position[rank] < len(llm) else None
        llm_start = clock.start_at(llm_next, rank) if llm_next is not None else None
        choice: Proposal | None = (llm_start, 0, llm_next) if llm_start is not None else None
        # Paper-scale steps offer dozens of ready encoder backwards at every proposal: nothing
        # starts before the rank is free, so once the choice starts then, only a candidate of a
        # lower priority can beat it, and the others are passed over before their inputs are looked up.
        free, ready_at, need, ahead = clock.free[rank], clock.ready_at, self.need, p.ahead
        for a in self.candidates(rank):
            urgent = a.kind is F and a.microbatch == need and a.microbatch not in ahead
            # Run-ahead forwards (for the next batch) last: nothing this step waits for them.
            rank_of_kind = 0 if urgent else 1 if a.kind is B else 3 if a.microbatch in ahead else 2
            priority = rank_of_kind * (p.num_microbatches + 1) + a.microbatch + 1
            if choice is not None and choice[0] <= free and priority >= choice[1]:
                continue
            ready = ready_at(a, rank)
            if ready is None:
                continue
            start = ready if ready > free else free
            if not urgent and a.kind is F and self.live[rank] + self.keep[a.stage] > p.mem_limit[rank]:
                continue  # the one the LLM waits for runs anyway: the evaluation says if it fits
            if llm_start is not None and not urgent:
                if start + p.duration(a) > llm_start if self.fill_only else start >= llm_start:
                    continue
            if choice is None or (start, priority) < choice[:2]:
                choice = (start, priority, a)
        return choice

    def commit(self, rank: int, a: Action, start: float) -> set[int]:
        p = self.p
        duration, opened, closed = p.duration(a), [], []
        if self.kernels is not None and a.stage >= self.first:
            duration, opened, closed = self.kernels.host(
                a, rank, self.position[rank], self.need, self.ready_riders(rank, a, start), self.start_encoder
            )
        elif a.stage < self.first:
            self.start_encoder(a, rank)
        end = start + duration
        self.out[rank].extend(opened)
        self.out[rank].append(a)
        for e in closed:
            self.finish(e, end, rank)
        self.finish(a, end, rank)
        touched, self.offer_changed = self.offer_changed, set()
        for done in (a, *closed):
            for neighbour in (done.stage - 1, done.stage + 1):
                if 0 <= neighbour < p.num_stages:
                    touched |= self.holders[neighbour]
        return touched

    def ready_riders(self, rank: int, host: Action, start: float):
        """Encoder actions that may run inside ``host`` (started at ``start``) on ``rank``."""
        p = self.p
        return (
            e
            for e in list(self.candidates(rank))
            if e not in self.clock.inputs(host)
            and (r := self.clock.ready_at(e, rank)) is not None
            and r <= start
            and (
                e.kind is not F
                or (
                    (e.microbatch > self.need or e.microbatch in p.ahead)
                    and self.live[rank] + self.keep[e.stage] <= p.mem_limit[rank]
                )
            )
        )

    def start_encoder(self, a: Action, rank: int) -> None:
        if a.microbatch not in self.pipeline_of:
            self.version += 1
            self.pipeline_of[a.microbatch] = self.p.stages[a.stage].ranks.index(rank)
            self.unstarted.remove(a.microbatch)
            self.waiting_on[rank].add(a.microbatch)
        self._offer_changed(rank)
        if a.kind is F:
            self.live[rank] += self.keep[a.stage]

    def _offer_changed(self, rank: int) -> None:
        self.cached.pop(rank, None)
        self.offer_changed.add(rank)

    def finish(self, a: Action, end: float, rank: int) -> None:
        self.clock.commit(a, rank, end)
        if a.stage >= self.first:
            self.position[rank] += 1
            self.live[rank] += self.keep[a.stage] if a.kind is F else -self.keep[a.stage]
        else:
            j, pipeline = a.microbatch, self.pipeline_of[a.microbatch]
            self.waiting_on[rank].discard(j)
            self._offer_changed(rank)
            self.done_enc[j] += 1
            if self.done_enc[j] < len(self.sequences[j]):
                then = self.p.rank_of(self.sequences[j][self.done_enc[j]], pipeline)
                self.waiting_on[then].add(j)
                self._offer_changed(then)
            if a.kind is B:
                self.live[rank] -= self.keep[a.stage]


class _Kernels:
    """The list scheduler's kernel level: per rank, the open riders (:class:`KernelStream`) and
    how many LLM actions each has spanned so far."""

    def __init__(self, problem: BubbleProblem, end_room: bool = False):
        self.p = problem
        self.streams = [KernelStream(lambda a: _split(problem, a)[::-1]) for _ in range(problem.num_ranks)]
        self.spans: dict[Action, int] = {}
        self.open: set[Action] = set()
        self.needs = _forward_needs(problem)
        # Per rank, the TP gaps of its LLM actions from each on to its last: a rider opened where
        # those cannot take it is closed at the rank's last LLM action, lengthening it, and a
        # rank's last LLM action is on the pipeline's final backward wave - except the first LLM
        # stage's, which ends the LLM: what is left there runs at the end either way.
        self.gaps_left: list[list[float]] | None = None
        if end_room:
            self.gaps_left = []
            for acts in problem.llm_actions:
                left, total = [0.0] * (len(acts) + 1), 0.0
                for i in range(len(acts) - 1, -1, -1):
                    total += _split(problem, acts[i])[0]
                    left[i] = total
                ends_llm = bool(acts) and acts[-1].stage == problem.first_llm_stage
                self.gaps_left.append([math.inf] * len(left) if ends_llm else left)

    def host(self, a: Action, rank: int, index: int, need: int, candidates, start_encoder):
        """Run the rank's open riders and new ones inside LLM action ``a`` (its ``index``-th);
        returns (its duration with them, the riders opened here, the riders finished here)."""
        p, stream = self.p, self.streams[rank]
        llm = p.llm_actions[rank]
        after = llm[index + 1] if index + 1 < len(llm) else None
        waited = self.needs[after] if after is not None else -1
        # Close here what the rank's next LLM action would wait for, what the first LLM stage
        # needs now, and everything at the rank's last LLM action.
        closing = {
            e
            for e in stream.remaining
            if after is None
            or (
                e.kind is F
                and e.microbatch not in p.ahead
                and (waited >> e.microbatch & 1 or e.microbatch <= need)
            )
        }
        gap, busy = _split(p, a)
        fill = HostFill(gap, busy)
        spanning = list(stream.remaining)
        finished = stream.fill(fill, closing)
        opened = []
        # What the rank's TP gaps from this host on can still take (all: without end_room).
        room = self.gaps_left[rank][index] if self.gaps_left is not None else math.inf
        if room < math.inf:
            room -= fill.rider_compute + sum(left * stream.work(r)[0] for r, left in stream.remaining.items())
        for e in candidates:
            if fill.gap_left <= 0 or fill.compute_left <= 0:
                break
            if e.kind is F and waited >> e.microbatch & 1:
                continue  # the next LLM action needs it: it would close at once, beyond the gap
            if stream.work(e)[0] > room:
                continue  # it would run on past the rank's last LLM action's gap, delaying it
            room -= stream.work(e)[0]
            stream.open(e)
            start_encoder(e, rank)
            self.open.add(e)
            opened.append(e)
            finished += stream.fill(fill, closing | ({e} if after is None else set()))
        for e in spanning + opened:
            self.spans[e] = self.spans.get(e, 0) + 1
        for e in finished:
            self.open.discard(e)
        return fill.duration(p.duration(a)), opened, finished


def _forward_needs(problem: BubbleProblem) -> dict[Action, int]:
    """Per LLM action, the microbatches whose encoder forward it waits for, directly or through
    the LLM's other actions (their rank order and stage dependencies), as a bit mask."""
    first = problem.first_llm_stage
    ahead = problem.ahead_actions
    needs: dict[Action, int] = {}
    position = [0] * problem.num_ranks
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(problem.llm_actions):
            while position[rank] < len(acts):
                a = acts[position[rank]]
                inputs = [
                    d for d in dependencies(a, problem.num_stages, frozenset(), ahead) if d.stage >= first
                ]
                if any(d not in needs for d in inputs):
                    break
                mask = needs[acts[position[rank] - 1]] if position[rank] else 0
                for d in inputs:
                    mask |= needs[d]
                if a.stage == first and a.kind is F and a.microbatch not in problem.ahead:
                    mask |= 1 << a.microbatch
                needs[a] = mask
                position[rank] += 1
                progress = True
    return needs


def _split(problem: BubbleProblem, a: Action) -> tuple[int, int]:
    """(TP collectives, compute) of an action, in units."""
    fig = problem.stages[a.stage]
    tp = round((fig.fwd_tp if a.kind is F else fig.bwd_tp) * problem.factor(a))
    total = problem.duration(a)
    return min(tp, total), total - min(tp, total)


def schedule_bound(problem: BubbleProblem) -> int:
    """A lower bound on the CP-SAT model's step (units; its objective leaves the DP collectives
    out): the LLM's actions alone in their order, timed by the problem's rules, after the encoder's
    forwards of microbatch 0 (unless they ran a batch ahead) and before, for every microbatch whose
    encoder trains, its encoder backwards.

    Encoder work only occupies ranks and adds dependencies, so no LLM action starts earlier than
    it does alone; and every LLM action waits, through its rank's order or its inputs, for the
    first LLM forward of microbatch 0, so the whole LLM timeline shifts by that forward's wait.
    Transfers to and from the encoder are left out (they only add)."""
    e = problem.encoder_stages
    original: dict[Action, Action] = {}
    lists = []
    for acts in problem.llm_actions:
        row = []
        for a in acts:
            alone = Action(a.stage - e, a.kind, a.microbatch)
            original[alone] = a
            row.append(alone)
        lists.append(row)
    timed = run_actions(
        lists,
        problem.num_stages - e,
        duration=lambda a, _s: problem.duration(original[a]),
        transfer=lambda dep, a: problem.transfer(original[dep], original[a]),
    )
    wait = 0 if 0 in problem.ahead else sum(problem.duration(Action(s, F, 0)) for s in range(e))
    step = max((t.end_s for t in timed), default=0)
    trained = [s for s in range(e) if s not in problem.forward_only]
    for t in timed:
        if t.action.stage == 0 and t.action.kind is B and trained:
            after = sum(problem.duration(Action(s, B, t.action.microbatch)) for s in trained)
            step = max(step, t.end_s + after)
    return max(round(wait + step), max(_rank_bounds(problem), default=0))


def _rank_bounds(problem: BubbleProblem) -> list[int]:
    """Per rank, and for all ranks together: no action of it starts before the shortest chain of
    forwards any of them waits for, it runs its work one action at a time (its LLM actions and the
    encoder stages every pipeline puts on it; together, the mean of all), and after its last
    action the shortest chain of backwards that any of them leaves still runs."""
    e, m, S = problem.encoder_stages, problem.num_microbatches, problem.num_stages
    trained = [s for s in range(S) if s >= e or s not in problem.forward_only]

    def chain(kind: ActionKind, j: int, stages) -> int:
        return sum(problem.duration(Action(s, kind, j)) for s in stages)

    def before(a: Action) -> int:
        """The forwards (and, for a backward, the later stages' backwards) it waits for."""
        first = e if a.stage >= e and a.microbatch in problem.ahead else 0
        if a.kind is F:
            return chain(F, a.microbatch, range(first, a.stage))
        return chain(F, a.microbatch, range(first, S)) + chain(B, a.microbatch, range(a.stage + 1, S))

    def after(a: Action) -> int:
        """What still runs after it: the rest of its microbatch's forwards and every backward, or
        for a backward the earlier stages' backwards."""
        j = a.microbatch
        if a.kind is B:
            return chain(B, j, (s for s in trained if s < a.stage))
        if a.stage < e and j in problem.ahead:  # for the next batch: the rest of its encoder forwards
            return chain(F, j, range(a.stage + 1, e))
        return chain(F, j, range(a.stage + 1, S)) + chain(B, j, trained)

    fixed = [
        s
        for s in range(e)
        if len({problem.rank_of(Action(s, F, 0), k) for k in range(problem.pipelines)}) == 1
    ]
    out = []
    for rank, acts in enumerate(problem.llm_actions):
        mine = list(acts)
        for s in fixed:
            if problem.rank_of(Action(s, F, 0), 0) == rank:
                mine += [a for j in range(m) for a in problem.encoder_actions(j) if a.stage == s]
        if mine:
            work = sum(problem.duration(a) for a in mine)
            out.append(min(map(before, mine)) + work + min(map(after, mine)))
    # Every rank together: some rank runs at least the mean of all the work, the encoder's
    # wherever its pipelines put it, between the shortest chains of any action.
    every = [a for acts in problem.llm_actions for a in acts]
    every += [a for j in range(m) for a in problem.encoder_actions(j)]
    mean = math.ceil(sum(map(problem.duration, every)) / problem.num_ranks)
    out.append(min(map(before, every)) + mean + min(map(after, every)))
    return out


# ---- the CP-SAT model ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BubbleSolution:
    actions: RankActions
    step: int
    """The schedule's step in units (:func:`evaluate_schedule`'s)."""
    status: str
    """CP-SAT's status: OPTIMAL, FEASIBLE (stopped at the time limit), or how it fell back."""
    objective: int
    bound: int
    wall_s: float

    @property
    def gap(self) -> float:
        return (self.objective - self.bound) / self.objective if self.objective > 0 else 0.0

    @property
    def timed_out(self) -> bool:
        return self.status != "OPTIMAL"


def solve_schedule(
    problem: BubbleProblem,
    *,
    time_limit_s: float = 10.0,
    num_workers: int = 2,
    hint: RankActions | None = None,
    memory: bool = True,
    bounded: bool = True,
) -> BubbleSolution:
    """The schedule with the shortest step (CP-SAT), within ``time_limit_s``; ``hint`` warm-starts
    it (default: the greedy schedule). A timeout returns the best schedule found and says so.
    ``bounded``: give the model :func:`schedule_bound` as a constraint on its step."""
    started = time.perf_counter()
    hint = hint if hint is not None else greedy(problem)
    model = _ScheduleModel(problem, memory=memory)
    model.add_hint(hint)
    hinted = evaluate_schedule(problem, hint)
    # The model's objective leaves the DP collectives out, as its bound does.
    hinted_objective = round(_step(dataclasses.replace(problem, dp_layers=()), hint))
    lower = schedule_bound(problem) if bounded else 0
    if lower > hinted_objective and (hinted.fits or not memory):
        lower = 0  # above a schedule that fits: a wrong bound is never trusted over the schedule
    if lower:
        model.cp.add(model.step >= lower)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = num_workers
    solver.parameters.catch_sigint_signal = False
    solver.parameters.cp_model_probing_level = 0  # as in the partition: presolve probing ate the limit
    if len(model.intervals) > LNS_ONLY_ABOVE:
        # On paper-scale problems the full-problem workers' first pass ignores the time limit
        # (strong-3072, 3,300 intervals: 10.4 s against a 5 s limit, no better solution found);
        # the large-neighbourhood workers keep to it and improve the warm start where they can.
        solver.parameters.use_lns_only = True
        # Its presolve propagates the precedences for seconds (Yi-34B's 256 microbatches: 5 s, 265
        # loops, then no solution at all); without it the hint is the first solution at once.
        solver.parameters.cp_model_presolve = False
    status = solver.solve(model.cp)
    wall = time.perf_counter() - started
    name = solver.status_name(status)
    if status == cp_model.INFEASIBLE and lower:
        # Only CP-SAT's own proof refuses a problem, never the bound it was given: solve again without.
        left = max(0.05 * time_limit_s, time_limit_s - wall)
        return solve_schedule(
            problem, time_limit_s=left, num_workers=num_workers, hint=hint, memory=memory, bounded=False
        )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE:
            raise PlanError(
                "no schedule of the encoder work keeps every rank within memory; recompute more, use a "
                "larger encoder PP, or fewer microbatches"
            )
        bound = max(int(solver.best_objective_bound), lower) if status == cp_model.UNKNOWN else 0
        bound = min(bound, hinted_objective)
        return BubbleSolution(
            hint, hinted.step, f"{name} (the warm start returned)", hinted_objective, bound, wall
        )
    actions = model.read(solver)
    found = evaluate_schedule(problem, actions)
    if hinted.step < found.step and (hinted.fits or not memory):  # never worse than its start
        actions, found = hint, hinted
    objective = int(round(solver.objective_value))
    return BubbleSolution(
        actions,
        found.step,
        name,
        objective,
        min(max(int(solver.best_objective_bound), lower), objective),
        wall,
    )


class _ScheduleModel:
    """Interval variables per action; an encoder action has one optional copy per encoder
    pipeline, present when its microbatch is on that pipeline."""

    def __init__(self, problem: BubbleProblem, *, memory: bool):
        self.p = problem
        cp = self.cp = cp_model.CpModel()
        heaviest = max((f for pair in problem.work for f in pair), default=1.0)
        horizon = math.ceil(
            sum(s.fwd + s.bwd + s.send_fwd + s.send_bwd for s in problem.stages)
            * problem.num_microbatches
            * max(1.0, heaviest)
        )
        self.horizon = horizon
        m, pipes = problem.num_microbatches, problem.pipelines
        self.on: dict[tuple[int, int], cp_model.IntVar] = {}
        for j in range(m):
            lits = [cp.new_bool_var(f"mb{j}_on{k}") for k in range(pipes)]
            cp.add_exactly_one(lits)
            for k, lit in enumerate(lits):
                self.on[(j, k)] = lit
        # (action, pipeline or -1) -> (start, end, rank, presence literal or None)
        self.vars: dict[tuple[Action, int], tuple] = {}
        self.intervals: dict[tuple[Action, int], cp_model.IntervalVar] = {}
        self.hold_sizes: dict[tuple[Action, int], cp_model.IntVar] = {}
        per_rank: dict[int, list] = {r: [] for r in range(problem.num_ranks)}
        for rank, acts in enumerate(problem.llm_actions):
            prev_end = None
            for a in acts:
                start = cp.new_int_var(0, horizon, f"s{a}")
                end = cp.new_int_var(0, horizon, f"e{a}")
                self.intervals[(a, -1)] = cp.new_interval_var(start, problem.duration(a), end, f"i{a}")
                per_rank[rank].append(self.intervals[(a, -1)])
                self.vars[(a, -1)] = (start, end, rank, None)
                if prev_end is not None:
                    cp.add(start >= prev_end)
                prev_end = end
        for j in range(m):
            for a in problem.encoder_actions(j):
                for k in range(pipes):
                    rank = problem.rank_of(a, k)
                    lit = self.on[(j, k)]
                    start = cp.new_int_var(0, horizon, f"s{a}p{k}")
                    end = cp.new_int_var(0, horizon, f"e{a}p{k}")
                    self.intervals[(a, k)] = cp.new_optional_interval_var(
                        start, problem.duration(a), end, lit, f"i{a}p{k}"
                    )
                    per_rank[rank].append(self.intervals[(a, k)])
                    self.vars[(a, k)] = (start, end, rank, lit)
        for intervals in per_rank.values():
            cp.add_no_overlap(intervals)
        self._dependencies()
        self.step = cp.new_int_var(0, horizon, "step")
        for _start, end, _, lit in self.vars.values():
            c = cp.add(self.step >= end)
            if lit is not None:
                c.only_enforce_if(lit)
        # Each rank's load bounds the step (redundant with the intervals, but it gives the solver
        # the bound it otherwise proves slowly): its LLM work plus the encoder work put on it.
        load: dict[int, list] = {r: [] for r in range(problem.num_ranks)}
        for (a, _k), (_start, _end, rank, lit) in self.vars.items():
            load[rank].append(problem.duration(a) if lit is None else problem.duration(a) * lit)
        for terms in load.values():
            cp.add(self.step >= sum(terms))
        if memory:
            self._memory()
        cp.minimize(self.step)

    def _copies(self, a: Action) -> list[tuple]:
        if a.stage >= self.p.encoder_stages:
            return [self.vars[(a, -1)]]
        return [self.vars[(a, k)] for k in range(self.p.pipelines)]

    def _dependencies(self) -> None:
        p, cp = self.p, self.cp
        every = [a for (a, k) in self.vars if k <= 0]
        ahead = p.ahead_actions
        for a in every:
            for d in dependencies(a, p.num_stages, frozenset(), ahead):
                for start, _, rank, lit in self._copies(a):
                    for _, d_end, d_rank, d_lit in self._copies(d):
                        gap = p.transfer(d, a) if d_rank != rank else 0
                        if lit is not None and d_lit is not None and lit is not d_lit:
                            continue  # encoder copies on different pipelines never both exist
                        c = cp.add(start >= d_end + gap)
                        lits = [x for x in (lit, d_lit) if x is not None]
                        if lits:
                            c.only_enforce_if(lits[0] if len(set(map(id, lits))) == 1 else lits)

    def _memory(self) -> None:
        """Per rank: a microbatch's activations of a stage are held from its forward's start to its
        backward's end, and a backward holds its recompute transient while it runs (the rule of
        :mod:`vlmcompile.sim.in_flight`); their sum stays within the rank's memory (a cumulative
        constraint over these hold intervals)."""
        p, cp = self.p, self.cp
        held: dict[int, list[tuple]] = {r: [] for r in range(p.num_ranks)}
        for (a, k), (start, _end, rank, lit) in self.vars.items():
            if a.kind is not F or a.stage in p.forward_only:
                continue  # a forward-only stage keeps nothing (no backward to keep it for)
            fig = p.stages[a.stage]
            _b_start, b_end, _, _ = self.vars[(Action(a.stage, B, a.microbatch), k)]
            if fig.keep:
                size = self.hold_sizes[(a, k)] = cp.new_int_var(0, self.horizon, f"hold{a}p{k}")
                interval = (
                    cp.new_interval_var(start, size, b_end, f"h{a}")
                    if lit is None
                    else cp.new_optional_interval_var(start, size, b_end, lit, f"h{a}p{k}")
                )
                held[rank].append((interval, fig.keep))
            if fig.transient:
                held[rank].append((self.intervals[(Action(a.stage, B, a.microbatch), k)], fig.transient))
        for rank, items in held.items():
            if items:
                cp.add_cumulative([i for i, _ in items], [d for _, d in items], p.mem_limit[rank])

    def add_hint(self, actions: RankActions) -> None:
        p = self.p
        where = {t.action: (t.rank, int(t.start_s), int(t.end_s)) for t in _timed(p, actions)}
        for j in range(p.num_microbatches):
            first = Action(0, F, j)
            k = p.stages[0].ranks.index(where[first][0]) if first in where else 0
            for kk in range(p.pipelines):
                self.cp.add_hint(self.on[(j, kk)], kk == k)
        for (a, k), (start, end, _rank, lit) in self.vars.items():
            if a in where and (lit is None or p.rank_of(a, k) == where[a][0]):
                self.cp.add_hint(start, where[a][1])
                self.cp.add_hint(end, where[a][2])
            else:  # an absent copy: any value, but a complete hint is one CP-SAT can take at once
                self.cp.add_hint(start, 0)
                self.cp.add_hint(end, p.duration(a))
        self.cp.add_hint(self.step, max((t[2] for t in where.values()), default=0))
        for (a, k), size in self.hold_sizes.items():
            back = Action(a.stage, B, a.microbatch)
            present = a in where and (k < 0 or p.rank_of(a, k) == where[a][0])
            self.cp.add_hint(size, where[back][2] - where[a][1] if present else p.duration(back))

    def read(self, solver: cp_model.CpSolver) -> RankActions:
        placed: list[list[tuple[int, int, Action]]] = [[] for _ in range(self.p.num_ranks)]
        for (a, _k), (start, _end, rank, lit) in self.vars.items():
            if lit is None or solver.boolean_value(lit):
                # LLM actions keep their order: ties go by position (the order constraint holds them).
                placed[rank].append((solver.value(start), 0 if lit is None else 1, a))
        return tuple(tuple(a for _, _, a in sorted(acts, key=lambda x: (x[0], x[1]))) for acts in placed)
