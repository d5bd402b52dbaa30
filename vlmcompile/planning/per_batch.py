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
when they time better), and a re-planning that overruns its time limit uses the last good
schedule (any schedule of the plan runs any batch: only the order of actions differs) and is
counted. The solve runs on the host, one batch ahead of the step that runs it
(:class:`~vlmcompile.data.steps.PackedSteps`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import usable_memory_bytes
from vlmcompile.cost_models.stage_costs import plan_costs
from vlmcompile.ir.actions import Action
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.packed import BatchPlan
from vlmcompile.ir.plan import Plan
from vlmcompile.planning import bubble_schedule as bs

SETTINGS = ((8, False), (1, False), (2, True), (16, False))
"""(lookahead, fill_only) of the list scheduler, tried in turn while time is left: the setting
the bubbles pass screens every encoder plan with first (:data:`passes.bubbles.SCREEN_LAYER`)."""
ORDERS = ("given", "light ends", "ascending")
"""Microbatch orders tried on each replica: as packed; the lightest encoder work at both ends
and the heaviest in the middle (where the encoder's work hides in the steady state); lightest
first."""
SOLVE_SHARE = 0.05
"""The default time limit of one batch's re-planning: this share of the planned step."""


@dataclass
class PerBatchScheduler:
    """Re-plans a plan's encoder-in-bubbles schedule per batch. ``problem``: the plan's
    (:func:`~vlmcompile.planning.bubble_schedule.problem_from`), its stages costed at the
    microbatch the work factors are relative to; ``static``: the plan's actions per rank."""

    problem: bs.BubbleProblem
    static: bs.RankActions
    time_limit_s: float | None = None
    """None: :data:`SOLVE_SHARE` of the static schedule's step as costed."""
    settings: tuple[tuple[int, bool], ...] = SETTINGS
    orders: tuple[str, ...] = ORDERS
    last_good: tuple[bs.RankActions, ...] | None = field(default=None, repr=False)
    timed_out: int = 0
    """Batches whose re-planning overran the limit (each ran the last good schedule)."""
    planned: int = 0

    def __post_init__(self):
        if len(self.static) != self.problem.num_ranks:
            raise PlanError(
                f"{len(self.static)} ranks' actions for a problem of {self.problem.num_ranks} ranks"
            )
        if self.time_limit_s is None:
            self.time_limit_s = SOLVE_SHARE * bs.evaluate_schedule(self.problem, self.static).step_s(
                self.problem
            )

    def schedule(self, work: Sequence[Sequence[tuple[float, float]]]) -> BatchPlan:
        """The schedule of one batch: ``work[d][j]`` is replica ``d``'s microbatch ``j``'s
        (encoder, LLM) work over the costed microbatch."""
        began = time.perf_counter()
        m = self.problem.num_microbatches
        if any(len(w) != m for w in work):
            raise PlanError(
                f"each replica runs {m} microbatches; work was given for {[len(w) for w in work]}"
            )
        static = max(self._timed(self.static, w) for w in work)
        chosen: list[tuple[bs.RankActions, tuple[int, ...], float]] = []
        for w in work:
            chosen.append(self._replica(w, began))
        solve_s = time.perf_counter() - began
        self.planned += 1
        if solve_s > self.time_limit_s and self.last_good is not None:
            self.timed_out += 1
            step = max(self._timed(acts, w) for acts, w in zip(self.last_good, work))
            identity = (tuple(range(m)),) * len(work)
            return BatchPlan(self.last_good, identity, step, static, solve_s, "last good")
        actions = tuple(c[0] for c in chosen)
        self.last_good = actions
        source = "static" if all(c[0] is self.static for c in chosen) else "re-planned"
        return BatchPlan(
            actions, tuple(c[1] for c in chosen), max(c[2] for c in chosen), static, solve_s, source
        )

    def _replica(self, work: Sequence[tuple[float, float]], began: float):
        """(actions numbered by packed microbatch, the order they run the LLM in, predicted step)
        of one replica: the best the settings and orders give before the time limit, or the
        plan's own actions where nothing times better."""
        m = self.problem.num_microbatches
        best = (self.static, tuple(range(m)), self._timed(self.static, work))
        tried = 0
        for order in self.orders:
            perm = ordered(work, order)
            problem = self.problem.with_work([work[k] for k in perm])
            for lookahead, fill_only in self.settings:
                if tried and time.perf_counter() - began > self.time_limit_s:
                    return best
                actions = bs.greedy(problem, lookahead=lookahead, fill_only=fill_only)
                tried += 1
                evaluation = bs.evaluate_schedule(problem, actions)
                if evaluation.fits and evaluation.step_s(problem) < best[2]:
                    best = (relabel(actions, perm), perm, evaluation.step_s(problem))
        return best

    def _timed(self, actions: bs.RankActions, work: Sequence[tuple[float, float]]) -> float:
        problem = self.problem.with_work(work)
        return bs.evaluate_schedule(problem, actions).step_s(problem)


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
    return tuple(tuple(Action(a.stage, a.kind, order[a.microbatch]) for a in acts) for acts in actions)


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


def per_batch_scheduler(
    plan: Plan, layer_graph: LayerGraph, cluster: Cluster, *, time_limit_s: float | None = None
) -> PerBatchScheduler:
    """The per-batch scheduler of a plan whose encoders have a plan of their own, its stages
    costed on ``layer_graph`` (annotated at the microbatch the work factors are relative to)."""
    problem = bs.problem_from(
        plan,
        plan_costs(plan, layer_graph, cluster),
        usable_memory_bytes(cluster.device.mem_bytes),
        local_ranks=cluster.ranks_on_this_machine,
    )
    return PerBatchScheduler(problem, plan.actions, time_limit_s=time_limit_s)
