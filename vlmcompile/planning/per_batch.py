"""The encoder-in-bubbles schedule re-planned for every global batch.

A plan's stage cuts and LLM schedule are made once; its encoder actions were placed for the
planned microbatch. Variable data breaks that: a step's microbatches carry from none to many
images, so the encoder's share of each differs, and a schedule placed for the mean leaves new
bubbles every step (PipeWeaver measures per-batch work varying 4x even after packing). Here a
batch's microbatches are costed from what they carry (:func:`packed_work`), and the list
scheduler (:func:`~vlmcompile.planning.bubble_schedule.greedy`) places the encoder's work again
for them, for each data-parallel replica (each runs its own microbatches; the replicas meet only
at the gradient reduction, so their schedules may differ), in the microbatch order that times
best of a few (:data:`ORDERS`): an encoder-heavy microbatch first exposes its encoder forward
before the pipeline fills, one last its backward after the LLM's drain.

A schedule is never worse than the plan's own actions timed on the same batch (they are kept
when they time better). Re-planning is anytime: a try that would end past the time limit is not
started (judged by what such tries took lately), and one that ends past it anyway is not used:
the step runs the best schedule timed on its batch by the limit, or, where even the first
timing ran late, the last good schedule (any schedule of the plan runs any batch: only the order
of actions differs); both are counted. The solve runs on the host, one batch ahead of the step
that runs it (:class:`~vlmcompile.data.steps.PackedSteps`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import fits, usable_memory_bytes
from vlmcompile.cost_models.stage_costs import PlanCosts, plan_costs
from vlmcompile.ir.actions import Action
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.gc_pause import collection_deferred
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.packed import BatchPlan
from vlmcompile.ir.plan import Plan
from vlmcompile.planning import bubble_schedule as bs
from vlmcompile.sim.simulator import simulate_step

ORDERS = ("given", "light ends", "ascending")
"""Microbatch orders tried on each replica: as packed; the lightest encoder work at both ends
and the heaviest in the middle (where the encoder's work hides in the steady state); lightest
first."""
SOLVE_SHARE = 0.04
"""The default time limit of one batch's re-planning: this share of the planned step (under
the 5 % a re-planning may cost, for a try that overruns its estimate)."""
ESTIMATE_DECAY = 0.9
"""A try's expected time is the longest lately: the last, or this share of the previous estimate."""


Schedule = tuple[bs.RankActions, Mapping[Action, int]]
"""Per pipeline rank its actions, and the encoder actions run at kernel level (-> LLM actions spanned)."""
Evaluate = Callable[[Schedule, Sequence[tuple[float, float]]], tuple[float, bool]]
"""(schedule, per-microbatch work) -> (predicted step s, fits in memory)."""


@dataclass
class PerBatchScheduler:
    """Re-plans a plan's encoder-in-bubbles schedule per batch. ``problem``: the plan's
    (:func:`~vlmcompile.planning.bubble_schedule.problem_from`), its stages costed at the
    microbatch the work factors are relative to; ``static``: the plan's schedule; ``evaluate``:
    how a schedule is timed on a batch (None: the problem's own timeline, layer level only;
    :func:`per_batch_scheduler` gives the simulator's)."""

    problem: bs.BubbleProblem
    static: Schedule
    evaluate: Evaluate | None = None
    time_limit_s: float | None = None
    """Per replica (on a cluster each replica's host solves its own); None: :data:`SOLVE_SHARE`
    of the static schedule's step as costed, shared by the ``replicas_per_host``."""
    replicas_per_host: int = 1
    """Replicas one host re-plans in turn (the local launcher's rank 0 plans every replica's)."""
    settings: tuple[tuple[int, bool], ...] = bs.PER_BATCH_SETTINGS
    orders: tuple[str, ...] = ORDERS
    kernel_level: bool = False
    """Place encoder work inside the LLM's TP gaps too (where the LLM has TP collectives)."""
    last_good: tuple[Schedule, ...] | None = field(default=None, repr=False)
    timed_out: int = 0
    """Replica schedules whose re-planning overran the limit (a late try not used, or no timing
    by the limit: the last good schedule)."""
    planned: int = 0
    _took: dict = field(default_factory=dict, repr=False)
    """Seconds a timing ("evaluate") and a list scheduler's run (per setting) are expected to
    take: measured once at the start, then the longest lately (:data:`ESTIMATE_DECAY`)."""

    def __post_init__(self):
        if len(self.static[0]) != self.problem.num_ranks:
            raise PlanError(
                f"{len(self.static[0])} ranks' actions for a problem of {self.problem.num_ranks} ranks"
            )
        if self.evaluate is None:
            self.evaluate = self._timeline
        if self.time_limit_s is None:
            self.time_limit_s = SOLVE_SHARE * self.evaluate(self.static, ())[0] / self.replicas_per_host
        if not self._took:
            self._seed_estimates()

    def _seed_estimates(self) -> None:
        """Each try's time, measured once on the plan's own microbatches: without it the first
        batch would start every try and run late (the list scheduler's settings differ several
        fold, and a timing of actions not timed before takes longer than the plan's own)."""
        for setting in self.settings:
            started = time.perf_counter()
            riders = {} if self.kernel_level else None
            bs.greedy(self.problem, lookahead=setting[0], fill_only=setting[1], riders=riders)
            self._took[setting] = time.perf_counter() - started
        reverse = tuple(reversed(range(self.problem.num_microbatches)))
        started = time.perf_counter()
        self.evaluate(_relabelled(*self.static, reverse), ())
        self._took["evaluate"] = time.perf_counter() - started

    def schedule(self, work: Sequence[Sequence[tuple[float, float]]]) -> BatchPlan:
        """The schedule of one batch: ``work[d][j]`` is replica ``d``'s microbatch ``j``'s
        (encoder, LLM) work over the costed microbatch."""
        # A collection of the whole heap inside a solve (0.29 s of a 0.18 s limit at Optimus
        # scale here, the heap a training process holds) would take it past its limit.
        with collection_deferred():
            return self._schedule(work)

    def _schedule(self, work: Sequence[Sequence[tuple[float, float]]]) -> BatchPlan:
        began = time.perf_counter()
        m = self.problem.num_microbatches
        if any(len(w) != m for w in work):
            raise PlanError(
                f"each replica runs {m} microbatches; work was given for {[len(w) for w in work]}"
            )
        chosen, late, fell_back, static = [], 0, 0, 0.0
        for d, w in enumerate(work):
            start = time.perf_counter()
            deadline = start + self.time_limit_s
            # Not counted in the estimate of a try: the plan's own schedule times faster, its
            # execution order and memory kept from the batch before (sim.simulator's layout).
            own = self.evaluate(self.static, w)[0]
            static = max(static, own)
            if time.perf_counter() > deadline:
                # Not even the plan's own timing by the limit: the last good schedule (the plan's
                # own on a first batch).
                if self.last_good is None:
                    late += 1
                    chosen.append((self.static, tuple(range(m)), own))
                else:
                    fell_back += 1
                    last = self.last_good[d]
                    chosen.append((last, tuple(range(m)), self.evaluate(last, w)[0]))
                continue
            best, overran = self._replica(w, own, deadline)
            late += overran
            chosen.append(best)
        self.planned += 1
        self.timed_out += late + fell_back
        schedules = tuple(c[0] for c in chosen)
        self.last_good = schedules
        if fell_back:
            source = (
                "last good"
                if fell_back == len(work)
                else f"re-planned ({fell_back} replicas on the last good)"
            )
        else:
            source = "static" if all(c[0] is self.static for c in chosen) else "re-planned"
        return BatchPlan(
            tuple(c[0][0] for c in chosen),
            tuple(c[1] for c in chosen),
            max(c[2] for c in chosen),
            static,
            time.perf_counter() - began,
            source,
            tuple(dict(c[0][1]) for c in chosen),
            late + fell_back,
        )

    def _replica(self, work: Sequence[tuple[float, float]], static_step: float, deadline: float):
        """((schedule numbered by packed microbatch, the order its LLM runs them in, predicted
        step), whether a try ended past the deadline) of one replica: the best the orders and
        settings give by the deadline, or the plan's own where nothing times better."""
        m = self.problem.num_microbatches
        best = (self.static, tuple(range(m)), static_step)
        # The plan's own schedule with the microbatches in another order first (one timing each),
        # then new schedules (a list scheduler's run as well).
        tries = [(order, None) for order in self.orders[1:]]
        tries += [(order, setting) for order in self.orders for setting in self.settings]
        for order, setting in tries:
            need = self._took["evaluate"] + (self._took[setting] if setting else 0.0)
            if time.perf_counter() + need > deadline:
                continue  # a cheaper try may still fit
            perm = ordered(work, order)
            if setting is None:
                actions, kernel_level = self.static
            else:
                started = time.perf_counter()
                kernel_level = {} if self.kernel_level else None
                problem = self.problem.with_work([work[k] for k in perm])
                actions = bs.greedy(problem, lookahead=setting[0], fill_only=setting[1], riders=kernel_level)
                self._expect(setting, time.perf_counter() - started)
            schedule = _relabelled(actions, kernel_level, perm)
            step, fits = self._timed(schedule, work)
            if time.perf_counter() > deadline:
                return best, True  # too late for its step
            if fits and step < best[2]:
                best = (schedule, perm, step)
        return best, False

    def _expect(self, what, took: float) -> None:
        self._took[what] = max(took, ESTIMATE_DECAY * self._took[what])

    def _timed(self, schedule: Schedule, work: Sequence[tuple[float, float]]) -> tuple[float, bool]:
        started = time.perf_counter()
        out = self.evaluate(schedule, work)
        self._expect("evaluate", time.perf_counter() - started)
        return out

    def _timeline(self, schedule: Schedule, work: Sequence[tuple[float, float]]) -> tuple[float, bool]:
        problem = self.problem.with_work(work) if work else self.problem
        evaluation = bs.evaluate_schedule(problem, schedule[0])
        return evaluation.step_s(problem), evaluation.fits


def ordered(work: Sequence[tuple[float, float]], order: str) -> tuple[int, ...]:
    """Microbatch indices in ``order`` (one of :data:`ORDERS`) by their encoder work."""
    given = tuple(range(len(work)))
    if order == "given":
        return given
    lightest = sorted(given, key=lambda j: (work[j][0], j))
    if order == "ascending":
        return tuple(lightest)
    if order == "light ends":
        # Alternate the lightest to the front and the back; the heaviest meet in the middle.
        front, back = [], []
        for k, j in enumerate(lightest):
            (front if k % 2 == 0 else back).append(j)
        return tuple(front + back[::-1])
    raise PlanError(f"unknown microbatch order {order!r}; use one of {ORDERS}")


def packed_work(image_rows: Sequence[int], reference_rows: int) -> list[tuple[float, float]]:
    """(encoder, LLM) work of packed microbatches of ``image_rows`` image rows each over the
    microbatch the stages were costed at (``reference_rows`` rows). A packed microbatch is one
    row of the token budget, so the LLM's work is the same in each (padding is computed)."""
    if reference_rows <= 0:
        raise PlanError(f"reference_rows={reference_rows}: the costed microbatch must carry image rows")
    return [(rows / reference_rows, 1.0) for rows in image_rows]


def relabel(actions: bs.RankActions, order: Sequence[int]) -> bs.RankActions:
    """Actions numbered in schedule order, renumbered to the packed microbatches they run
    (schedule microbatch ``j`` is packed microbatch ``order[j]``)."""
    return tuple(tuple(_renumbered(a, order) for a in acts) for acts in actions)


def _renumbered(a: Action, order: Sequence[int]) -> Action:
    return Action(a.stage, a.kind, order[a.microbatch])


def _relabelled(actions: bs.RankActions, kernel_level: Mapping[Action, int] | None, order) -> Schedule:
    """A schedule made in ``order`` (see :func:`relabel`), its kernel-level marks renumbered too."""
    return relabel(actions, order), {_renumbered(a, order): n for a, n in (kernel_level or {}).items()}


@dataclass
class RowsScheduler:
    """Image rows per microbatch of a packed step (every replica's in turn) -> the step's
    schedule (what :class:`~vlmcompile.data.steps.PackedSteps` calls)."""

    scheduler: PerBatchScheduler
    reference_rows: int
    """Image rows of the microbatch the stages were costed at (the captured one)."""
    replicas: int

    def __call__(self, image_rows: Sequence[int]) -> BatchPlan:
        m = self.scheduler.problem.num_microbatches
        if len(image_rows) != m * self.replicas:
            raise PlanError(
                f"{len(image_rows)} microbatches in the step; the plan runs {m} on each of {self.replicas} replicas"
            )
        return self.scheduler.schedule(
            [packed_work(image_rows[d * m : (d + 1) * m], self.reference_rows) for d in range(self.replicas)]
        )


@dataclass(frozen=True)
class SimulatedStep:
    """A schedule of ``plan`` timed by the simulator on microbatches of given work (an
    :data:`Evaluate`; a class, so that the scheduler travels to the local launcher's ranks)."""

    plan: Plan
    layer_graph: LayerGraph
    cluster: Cluster
    costs: PlanCosts
    cap: float

    def __call__(self, schedule: Schedule, work: Sequence[tuple[float, float]]) -> tuple[float, bool]:
        actions, kernel_level = schedule
        timed = dataclasses.replace(self.plan, actions=actions, kernel_level=kernel_level)
        step, peaks = simulate_step(
            timed, self.layer_graph, self.cluster, costs=self.costs, work=work or None
        )
        return step, fits(peaks, self.cap)


def per_batch_scheduler(
    plan: Plan,
    layer_graph: LayerGraph,
    cluster: Cluster,
    *,
    time_limit_s: float | None = None,
    replicas_per_host: int = 1,
) -> PerBatchScheduler:
    """The per-batch scheduler of a plan whose encoders have a plan of their own, its stages
    costed on ``layer_graph`` (annotated at the microbatch the work factors are relative to)."""
    costs = plan_costs(plan, layer_graph, cluster)
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    problem = bs.problem_from(plan, costs, cap)

    return PerBatchScheduler(
        problem,
        (plan.actions, plan.kernel_level),
        SimulatedStep(plan, layer_graph, cluster, costs, cap),
        time_limit_s=time_limit_s,
        replicas_per_host=replicas_per_host,
        kernel_level=any(s.fwd_tp or s.bwd_tp for s in problem.stages),
    )
