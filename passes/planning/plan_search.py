"""Plan search: the parallel degrees (TP, PP, DP, microbatch size, v) for a cluster.

Every combination the cluster allows is a candidate (TP a power of two within a node, PP
dividing what TP leaves, DP the rest, a microbatch size dividing the per-replica batch, v > 1
only where interleaving applies). Each gets lower bounds on the step of every plan of it that
fits and on its fullest rank's memory (:mod:`vlmcompile.planning.candidate_bound`), and the
candidates are visited best bound first:

* a candidate whose memory bound is over the cap, or whose step bound is no better than the
  best plan found, is pruned without planning;
* the rest get the stage-cut bound (whole layers per stage and the recompute the cap forces on
  each rank; up to a second at a deep pipeline, so only here), are pruned by it the same way,
  and are otherwise screened with a quick plan (``screen``: a baseline's) in worker processes on
  every core; the ``solve_top`` fastest screens are partitioned by CP-SAT
  (:func:`~vlmcompile.passes.planning.partition.partition`) with its closed-form model only, and simulated.

The few fastest plans that fit (``polish``) are then solved again with the timeline model only,
started from their own cuts, for ``SolverOptions.timeline_share`` of the limit each: it times
the schedule action by action, which the closed form only bounds, and costs seconds per
candidate. The fastest simulated plan that fits wins.

A candidate's partition starts from every plan the search has for it: one given for its
request, the plan to beat there (``baseline``: the fastest baseline's, from
:func:`~vlmcompile.passes.planning.policies.search_and_compare`), and the plan of the last solved
candidate with the same PP x v. The partition returns the fastest of them in the simulator when
the solver's own plan is slower - the solver's models leave out the DP collectives' overlap, so
their optimum is not always the simulator's - and so no candidate is slower than its baseline.

Work is reused: layer costs per (TP, DP, microbatch size) are computed once for the bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from tabulate import tabulate

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import plan_precision, usable_memory_bytes
from vlmcompile.ir.errors import ClusterError, PlanError, positive_int
from vlmcompile.ir.layer_graph import LayerGraph, format_bytes
from vlmcompile.ir.plan import Parallel, Plan, Reason
from vlmcompile.passes.planning.partition import partition
from vlmcompile.planning.candidate_bound import CandidateBound, candidate_bound, stage_cut_bound
from vlmcompile.planning.forked import call_in_worker, can_fork, forked_map, forked_pool
from vlmcompile.planning.request import PlanRequest, SearchSpace, SolverOptions
from vlmcompile.planning.result import PolicyResult
from vlmcompile.planning.stage_cuts import TIMELINE_ACTIONS
from vlmcompile.planning.step_bound import (
    StepBound,
)
from vlmcompile.sim.units import column_decimals, format_ms

REASON_WIDTH = 90
"""Characters per line of the search table's "why" column: a longer reason wraps, it is never cut."""


@dataclass(frozen=True, slots=True)
class CandidateRow:
    request: PlanRequest
    outcome: str
    """chosen, planned (partitioned; slower than the chosen), screened (a quick plan only), pruned,
    or failed."""
    reason: str
    bound: CandidateBound
    step_s: float | None = None
    peak_bytes: float | None = None

    @property
    def lower_bound_s(self) -> float:
        """No one-chain plan of the candidate that fits the memory cap is faster."""
        return self.bound.step_s


@dataclass(frozen=True, slots=True)
class SearchReport:
    """Every candidate the search considered and what became of it (the plan chosen is its
    result's)."""

    cluster: str
    candidates: tuple[CandidateRow, ...]
    wall_s: float
    returned: tuple[str, float] | None = None
    """What the search's caller returned instead of its chosen one-chain plan (the encoder-in-
    bubbles plan, a re-partition) and its simulated step; None: the chosen plan itself."""

    def table(self, limit: int | None = 40) -> str:
        order = {"chosen": 0, "planned": 1, "screened": 2, "failed": 3, "pruned": 4}
        rows = sorted(self.candidates, key=lambda c: (order[c.outcome], c.step_s or c.lower_bound_s))
        shown = rows if limit is None else rows[:limit]
        # One number of decimals for both time columns, enough to tell the closest rows apart.
        finite = [c.lower_bound_s for c in shown if math.isfinite(c.lower_bound_s)]
        decimals = column_decimals([*(c.step_s for c in shown), *finite])
        lines = [
            [
                str(c.request),
                "best chain" if c.outcome == "chosen" and self.returned else c.outcome,
                format_ms(c.step_s, decimals=decimals),
                format_ms(c.lower_bound_s, decimals=decimals) if math.isfinite(c.lower_bound_s) else "-",
                c.bound.binding if math.isfinite(c.lower_bound_s) else "-",
                format_ms(c.bound.bubbles.step_s, decimals=decimals) if c.bound.bubbles else "-",
                f"{c.peak_bytes / 2**30:.1f}" if c.peak_bytes is not None else "-",
                c.reason,
            ]
            for c in shown
        ]
        table = tabulate(
            lines,
            headers=[
                "degrees",
                "outcome",
                "simulated ms",
                "lower bound ms",
                "bound by",
                "encoder plans bound ms",
                "peak GiB",
                "why",
            ],
            disable_numparse=True,
            maxcolwidths=[None, None, None, None, 12, 10, None, REASON_WIDTH],
        )
        more = f"\n... and {len(rows) - len(shown)} more" if len(shown) < len(rows) else ""
        return table + more

    def __str__(self) -> str:
        counts = {
            k: sum(c.outcome == k for c in self.candidates)
            for k in ("chosen", "planned", "screened", "pruned", "failed")
        }
        head = (
            f"plan search on {self.cluster}: {len(self.candidates)} candidates in {self.wall_s:.1f} s "
            f"({counts['planned'] + counts['chosen']} planned, {counts['screened']} screened, "
            f"{counts['pruned']} pruned, {counts['failed']} failed)"
        )
        return f"{head}\n{self.proof()}\n{self.table()}"

    @property
    def least_chain_bound_s(self) -> float:
        """No one-chain plan of any candidate that fits is faster: a pruned candidate's bound is at least the
        plan that pruned it, a failed one has no plan, the rest have their own bound."""
        return min(
            (c.lower_bound_s for c in self.candidates if c.outcome not in ("pruned", "failed")),
            default=math.inf,
        )

    @property
    def least_bubbles_bound_s(self) -> float | None:
        """No encoder-in-bubbles plan of any candidate the cluster can run is faster."""
        found = [
            c.bound.bubbles.step_s for c in self.candidates if c.bound.bubbles and not c.bound.cannot_run
        ]
        return min(found) if found else None

    def runner_up(self, chosen: Parallel, cap_bytes: float) -> CandidateRow | None:
        """The fastest simulated candidate at other degrees than ``chosen`` that fits ``cap_bytes``."""
        others = [
            c
            for c in self.candidates
            if c.step_s is not None
            and c.outcome in ("chosen", "planned", "screened")
            and c.request.parallel != chosen
            and c.peak_bytes is not None  # a plan's peak is known: it was simulated
            and c.peak_bytes <= cap_bytes
        ]
        return min(others, key=lambda c: c.step_s) if others else None

    def proof(self) -> str:
        """What the bounds prove about the plan chosen (one chain) and what they leave open."""
        chosen = next((c for c in self.candidates if c.outcome == "chosen"), None)
        if chosen is None:
            return "no plan chosen"
        least = self.least_chain_bound_s
        which = "the best one-chain plan" if self.returned else "the one chosen"
        said = (
            f"proved: no one-chain plan that fits, of any candidate, is faster than {format_ms(least)} ms; {which}, "
            f"{format_ms(chosen.step_s)} ms, is {max(0.0, 100 * (chosen.step_s - least) / chosen.step_s):.1f} % above that"
        )
        bubbles = self.least_bubbles_bound_s
        if bubbles is not None:
            said += f"; no encoder-in-bubbles plan is faster than {format_ms(bubbles)} ms (the least bound of any candidate)"
        if self.returned:
            how, step_s = self.returned
            said += f"\nchosen: {how}, {format_ms(step_s)} ms simulated (faster than the best one-chain plan)"
        return said


def candidates(
    layer_graph: LayerGraph, cluster: Cluster, *, global_batch: int, space: SearchSpace = SearchSpace()
) -> list[PlanRequest]:
    """Every request in ``space`` the cluster and the global batch allow."""
    num_layers = len(layer_graph.layers)
    tps = space.tp_choices or [
        t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node and cluster.num_gpus % t == 0
    ]
    out = []
    for tp in tps:
        for pp in range(1, min(num_layers, cluster.num_gpus // tp) + 1):
            if (cluster.num_gpus // tp) % pp or (space.pp_choices is not None and pp not in space.pp_choices):
                continue
            dp = cluster.num_gpus // (tp * pp)
            if space.dp_choices is not None and dp not in space.dp_choices:
                continue
            for mbs in space.microbatch_sizes:
                for v in space.v_choices:
                    batch = _global_batch_of(global_batch, dp * mbs, pp if v > 1 else 1, space)
                    if batch is None or (v > 1 and (pp == 1 or pp * v > num_layers)):
                        continue
                    out.append(
                        PlanRequest(
                            parallel=Parallel(dp=dp, tp=tp, pp=pp, v=v, zero_stage=cluster.zero_stage(dp)),
                            global_batch=batch,
                            microbatch_size=mbs,
                            precision=plan_precision(cluster.ranks_on_this_machine),
                        )
                    )
    return list(dict.fromkeys(out))


def _global_batch_of(
    global_batch: int, per_microbatch: int, microbatch_multiple: int, space: SearchSpace
) -> int | None:
    """The global batch a candidate runs: ``global_batch`` when it divides into microbatches of
    ``per_microbatch`` samples (over the DP ranks), a multiple of ``microbatch_multiple`` of them;
    else the next one that does when the space rounds up (packed microbatches), else None."""
    unit = per_microbatch * microbatch_multiple
    if global_batch % unit == 0:
        return global_batch
    return -(-global_batch // unit) * unit if space.round_up_global_batch else None


def plan_search(
    layer_graph: LayerGraph,
    cluster: Cluster,
    *,
    global_batch: int,
    space: SearchSpace = SearchSpace(),
    solver: SolverOptions = SolverOptions(time_limit_s=3.0),
    include: Iterable[PlanRequest] = (),
    warm_starts: Mapping[PlanRequest, Plan] | None = None,
    baseline: Callable[[PlanRequest], Plan | None] | None = None,
    screen: Callable[[PlanRequest], PolicyResult | None] | None = None,
    solve_top: int = 3,
    polish: int = 4,
    progress: bool = True,
) -> PolicyResult:
    """The fastest plan (simulated) over the degrees the cluster allows; see the module docstring.

    Args:
        space: the degrees to choose from (default: all the cluster allows).
        solver: CP-SAT's limits per candidate.
        include: requests to consider on top of the enumerated ones (e.g. a paper's).
        warm_starts: plans already made for some requests (e.g. our partition at a paper's, with
            a longer time limit): the partition of those candidates starts from them, so the
            search never returns a slower plan than one it was given.
        baseline: the plan to beat at a request (None where there is none), asked for each
            candidate the search partitions (with a screen: the fastest screened one); its
            partition starts from it too, so that plan is never slower than its request's
            baseline. A screened candidate partitioned without it may be chosen: the caller
            checks the chosen request's baselines (:func:`~vlmcompile.passes.planning.policies.search_and_compare`).
        screen: a quick plan for a request (a baseline's): every candidate the bounds leave gets
            one, and only the ``solve_top`` fastest of those are partitioned (None: every
            candidate the bounds leave is partitioned).
        solve_top: how many screened candidates are partitioned.
        polish: how many of the fastest plans found with the closed-form model are solved again
            with the timeline model (0: none).
        progress: a progress bar on stderr.

    Raises:
        PlanError: no candidate fits; the message names the least memory any needs and the knobs.
    """
    positive_int("global_batch", global_batch, "the samples per training step")
    if polish < 0:
        raise PlanError(
            f"polish={polish!r}; give how many plans to solve again with the timeline model, 0 or more"
        )
    start = time.perf_counter()
    todo = _requests(layer_graph, cluster, global_batch, space, include)
    costs: dict = {}
    bounds = _bounds_of(layer_graph, cluster, todo, costs)
    # Best bound first; the candidates whose screens simulate the longest action lists after the
    # others (the best plan found by then prunes those its bound can: each is still screened or
    # pruned by a plan it cannot beat, so the plan chosen is the same).
    todo.sort(key=lambda r: (_screen_actions(r) > DEFERRED_ACTIONS, bounds[r].step_s))
    bar = _progress(len(todo) + min(polish, len(todo)), progress)
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    with_closed_form = dataclasses.replace(solver, timeline_share=0.0)
    refine = functools.partial(stage_cut_bound, layer_graph, cluster, cache=costs)
    visits = _Visits(
        layer_graph, cluster, bounds, cap, with_closed_form, warm_starts or {}, baseline, screen, refine, bar
    )
    rows, results = _visit_all(visits, todo, solve_top)
    if not any(res.fits for res in results.values()):
        bar.close()
        raise PlanError(_no_plan_message(list(rows.values()), cap, cluster.name))
    if solver.timeline_share > 0:
        _polish(layer_graph, cluster, rows, results, solver, polish, bar)
    bar.close()
    best = min((r for r, res in results.items() if res.fits), key=lambda r: results[r].sim.step_time_s)
    row = rows[best]
    rows[best] = dataclasses.replace(
        row, outcome="chosen", reason=f"fastest simulated plan that fits; {row.reason}"
    )
    report = SearchReport(cluster.name, tuple(rows.values()), time.perf_counter() - start)
    return dataclasses.replace(results[best], report=report)


DEFERRED_ACTIONS = 20_000
"""A candidate whose pipeline runs more actions than this (PP x v x microbatches, forward and
backward) is visited after those with fewer: its screen costs seconds (Qwen1.5-110B on 64 GPUs
at DP = 1: 512 microbatches, up to 131,072 actions, 4-8 s each)."""


def _screen_actions(request: PlanRequest) -> int:
    par = request.parallel
    return 2 * par.pp * par.v * request.num_microbatches


def _visit_all(
    visits: _Visits, todo: Sequence[PlanRequest], solve_top: int
) -> tuple[dict[PlanRequest, CandidateRow], dict[PlanRequest, PolicyResult]]:
    """Every candidate in ``todo``'s order (best bound first): pruned, screened or solved; its row,
    and its plan where it has one."""
    visits.screen_all(todo)
    if visits.screen is not None:
        visits.solve_unscreened(todo)
        visits.solve_screened(solve_top)
    return visits.rows, visits.results


@dataclass
class _Visits:
    """The candidates visited so far: their rows, plans, screens and the incumbent. A solved
    candidate's plan warm-starts the next one with the same PP x v."""

    layer_graph: LayerGraph
    cluster: Cluster
    bounds: dict[PlanRequest, CandidateBound]
    """Each candidate's bounds, with the stage-cut term once it is computed."""
    cap: float
    solver: SolverOptions
    warm_starts: Mapping[PlanRequest, Plan]
    baseline: Callable[[PlanRequest], Plan | None] | None
    screen: Callable[[PlanRequest], PolicyResult | None] | None
    refine: Callable[..., CandidateBound]
    """(request, bound, enough_s) -> the bound with its stage-cut term (candidate_bound.stage_cut_bound)."""
    bar: object
    rows: dict[PlanRequest, CandidateRow] = field(default_factory=dict)
    results: dict[PlanRequest, PolicyResult] = field(default_factory=dict)
    screens: dict[PlanRequest, tuple[float, bool]] = field(default_factory=dict)
    """(step, fits) of each screened plan."""
    best: _Incumbent = field(default_factory=lambda: _Incumbent())
    hints: dict[tuple[int, int], Plan] = field(default_factory=dict)

    def solve(self, request: PlanRequest, *given: Plan | None, to_beat: bool = True) -> None:
        """Partition ``request`` from ``given``, its warm start and the last plan of its PP x v
        (and, with ``to_beat``, from the plan of its fastest baseline)."""
        self.take_solved(request, *self.partitioned(request, *given, to_beat=to_beat))

    def partitioned(
        self, request: PlanRequest, *given: Plan | None, to_beat: bool = True
    ) -> tuple[CandidateRow, PolicyResult | None]:
        """:meth:`solve`'s partition: the candidate's row, and its plan where it has one."""
        par = request.parallel
        starts = [
            p
            for p in (self.warm_starts.get(request), *given, self.hints.get((par.pp, par.v)))
            if p is not None
        ]
        baseline = self.baseline if to_beat else None
        return _solve(
            self.layer_graph, self.cluster, request, self.bounds[request], self.solver, starts, baseline
        )

    def take_solved(self, request: PlanRequest, row: CandidateRow, result: PolicyResult | None) -> None:
        """A partition's row and plan into the search: the plan kept where no slower than one in
        hand, the incumbent offered it."""
        par = request.parallel
        if result is None:
            self.rows.setdefault(request, row)  # a screened plan stands where the solve failed
            return
        kept = self.results.get(request)
        if kept is None or not kept.fits or result.sim.step_time_s <= kept.sim.step_time_s:
            self.rows[request], self.results[request] = row, result
        self.hints[(par.pp, par.v)] = result.plan
        self.best.offer(request, self.results[request])

    def screen_all(self, todo: Sequence[PlanRequest]) -> None:
        """Prune, screen (or, without a screen, solve) every candidate, best bound first."""
        with _ScreenPool(self.screen, self.refine, self.solver.num_workers) as pool:
            pending: dict[Future, PlanRequest] = {}
            for request in todo:
                while len(pending) >= pool.width:  # take results first: the incumbent prunes best fresh
                    # whichever finishes first, so a long screen holds up no other worker
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        self._take(pending.pop(future), future)
                        pool.offer(self.best.step_s)
                self.bar.update(1)
                pruned = _pruned(request, self.bounds[request], self.cap, self.best)
                if pruned is not None:
                    self.rows[request] = pruned
                elif self.screen is None or request in self.warm_starts:
                    self.bounds[request] = self.refine(
                        request, self.bounds[request], enough_s=self.best.step_s
                    )
                    pruned = _pruned(request, self.bounds[request], self.cap, self.best)
                    if pruned is not None:
                        self.rows[request] = pruned
                    else:
                        self.solve(request)
                else:
                    pending[pool.submit(request, self.bounds[request], self.best.step_s)] = request
            for future in list(pending):
                self._take(pending.pop(future), future)
                pool.offer(self.best.step_s)

    def _take(self, request: PlanRequest, future: Future) -> None:
        outcome = future.result()
        bound = self.bounds[request] = outcome.bound or self.bounds[request]
        pruned = _pruned(request, bound, self.cap, self.best) if outcome.pruned else None
        if pruned is not None:
            self.rows[request] = pruned
            return
        self.rows[request], figures = _screened(request, bound, outcome)
        if figures is not None:
            self.screens[request] = figures
            self.best.offer_step(request, *figures)
        self.bar.set_postfix_str(self.best.progress())

    def solve_unscreened(self, todo: Sequence[PlanRequest]) -> None:
        """A candidate the screen cannot plan (its layout cannot express the model) is partitioned
        where its bound can still beat the best plan, as it would be without a screen."""
        for request in todo:
            row = self.rows[request]
            if (
                row.outcome == "failed"
                and row.reason.startswith("screen:")
                and self.bounds[request].step_s < self.best.step_s
            ):
                del self.rows[request]
                self.solve(request)
                if self.rows[request].outcome == "failed":
                    failed = self.rows[request]
                    self.rows[request] = dataclasses.replace(failed, reason=f"{failed.reason}; {row.reason}")

    def solve_screened(self, solve_top: int) -> None:
        """Partition the ``solve_top`` fastest screens that fit (where none does, the fastest: the
        partition may cut by memory where the screen's balanced cut cannot fit), each only while
        its bound can beat the best plan."""
        order = sorted(self.screens, key=lambda r: (not self.screens[r][1], self.screens[r][0]))
        todo = [r for r in order[:solve_top] if self.bounds[r].step_s < self.best.step_s]
        incumbent = self.best.request
        if incumbent in self.screens and incumbent not in todo and incumbent not in self.results:
            # Its screen met its own lower bound, so no partition beats it: keep its plan (a
            # worker sent its figures only), or the search would end with none that fits.
            self.results[incumbent] = self.screen(incumbent)

        def solved(request: PlanRequest) -> tuple[PolicyResult, tuple[CandidateRow, PolicyResult | None]]:
            quick = self.screen(request)  # its plan again, here: a worker sends figures, not plans
            # Every baseline is planned for the fastest screen only (the search most often chooses
            # it, and its comparison then has them: that one is solved in this process, where the
            # baselines are kept); the others start from their screen.
            return quick, self.partitioned(request, quick.plan, to_beat=request == order[0])

        # One candidate per core (each solve is Python around CP-SAT); a plan one finds is not
        # the other's warm start, as it would be one after the other with the same PP x v.
        for request, outcome in zip(todo, forked_map(solved, todo, self.solver.num_workers)):
            quick, (row, result) = outcome.answer
            self.take_solved(request, row, result)
            if request not in self.results and quick.fits:  # the solve failed; the screen stands
                self.results[request] = quick
        for rank, request in enumerate(order[solve_top:], start=solve_top + 1):
            row = self.rows[request]
            said = f"not solved: screened plan {rank} by speed (the {solve_top} fastest are partitioned)"
            self.rows[request] = dataclasses.replace(row, reason=f"{row.reason}; {said}")


class _Incumbent:
    """The fastest plan that fits found so far."""

    def __init__(self):
        self.request: PlanRequest | None = None
        self.step_s = math.inf

    def offer(self, request: PlanRequest, result: PolicyResult) -> None:
        self.offer_step(request, result.sim.step_time_s, result.fits)

    def offer_step(self, request: PlanRequest, step_s: float, fits: bool) -> None:
        if fits and step_s < self.step_s:
            self.request, self.step_s = request, step_s

    def progress(self) -> str:
        return f"best {format_ms(self.step_s)} ms" if self.request else "none fits yet"


def _pruned(request: PlanRequest, bound: CandidateBound, cap: float, best: _Incumbent) -> CandidateRow | None:
    """The row of a candidate its bounds rule out (or the cluster cannot run); None: visit it."""
    row = functools.partial(CandidateRow, request, bound=bound)
    if bound.cannot_run:
        return row("failed", bound.cannot_run)
    if bound.least_peak_bytes > cap:
        return row(
            "pruned",
            f"needs at least {format_bytes(bound.least_peak_bytes)} on its fullest rank with every layer "
            f"recomputed; the cap is {format_bytes(cap)}",
        )
    if bound.step_s >= best.step_s:
        return row(
            "pruned",
            f"lower bound ({bound.binding}) >= best found, {format_ms(best.step_s)} ms at {best.request}",
        )
    return None


def _screened(
    request: PlanRequest, bound: CandidateBound, outcome: _ScreenOutcome
) -> tuple[CandidateRow, tuple[float, bool] | None]:
    """A screened candidate's row, and its plan's (step, fits) where it has one."""
    row = functools.partial(CandidateRow, request, bound=bound)
    if outcome.error is not None:
        return row("failed", f"screen: {outcome.error}"), None
    why = f"screened: {outcome.policy}, recompute {outcome.recompute}" + (
        "" if outcome.fits else ", over the cap"
    )
    return row("screened", why, step_s=outcome.step_s, peak_bytes=outcome.peak_bytes), (
        outcome.step_s,
        outcome.fits,
    )


@dataclass(frozen=True, slots=True)
class _ScreenOutcome:
    """What a screen worker sends back: a plan's figures (a plan itself pickles slower than the
    screen makes it), or why there is none."""

    step_s: float = math.inf
    fits: bool = False
    peak_bytes: float = 0.0
    policy: str = ""
    recompute: str = ""
    error: str | None = None
    bound: CandidateBound | None = None
    """The candidate's bound with its stage-cut term."""
    pruned: bool = False
    """Not screened: the stage-cut bound reached the best plan found when it was sent."""


def _screen_one(
    screen: Callable[[PlanRequest], PolicyResult | None],
    refine: Callable[..., CandidateBound],
    request: PlanRequest,
    bound: CandidateBound,
    enough: Callable[[], float],
) -> _ScreenOutcome:
    """The candidate's stage-cut bound first (seconds at most), then, where that bound can still
    beat ``enough()`` (the best plan found so far), its screened plan's figures."""
    bound = refine(request, bound, enough_s=enough())
    if bound.step_s >= enough():
        return _ScreenOutcome(bound=bound, pruned=True)
    try:
        result = screen(request)
    except (PlanError, ClusterError) as err:
        return _ScreenOutcome(error=str(err), bound=bound)
    if result is None:
        return _ScreenOutcome(error="the screen has no plan here", bound=bound)
    sim = result.sim
    return _ScreenOutcome(
        sim.step_time_s,
        result.fits,
        max(sim.peak_mem_bytes),
        result.plan.policy,
        result.recompute,
        bound=bound,
    )


class _ScreenPool:
    """Screens on every core: forked worker processes (the screen is Python, one core each), or
    in this process where there is one core or no screen."""

    def __init__(
        self,
        screen: Callable[[PlanRequest], PolicyResult | None] | None,
        refine: Callable[..., CandidateBound],
        cores: int,
    ):
        self.screen, self.refine = screen, refine
        forked = screen is not None and cores > 1 and can_fork()
        self.width = cores if forked else 1
        self.executor = None
        if forked:
            # made before the workers fork: they read it, this process writes it (one float)
            self.best_s = multiprocessing.get_context("fork").Value("d", math.inf, lock=False)
            best = self.best_s

            def screened(sent: tuple[PlanRequest, CandidateBound, float]) -> _ScreenOutcome:
                request, bound, enough_s = sent
                return _screen_one(screen, refine, request, bound, lambda: min(enough_s, best.value))

            self.executor = forked_pool(screened, cores)

    def submit(self, request: PlanRequest, bound: CandidateBound, enough_s: float) -> Future:
        if self.executor is not None:
            return self.executor.submit(call_in_worker, (request, bound, enough_s))
        done: Future = Future()
        done.set_result(_screen_one(self.screen, self.refine, request, bound, lambda: enough_s))
        return done

    def offer(self, best_s: float) -> None:
        """A faster plan found: the workers prune by it from now on (sent before or not)."""
        if self.executor is not None:
            self.best_s.value = min(self.best_s.value, best_s)

    def __enter__(self) -> _ScreenPool:
        return self

    def __exit__(self, *exc) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)


def _polish(
    layer_graph: LayerGraph,
    cluster: Cluster,
    rows: dict[PlanRequest, CandidateRow],
    results: dict[PlanRequest, PolicyResult],
    solver: SolverOptions,
    count: int,
    bar,
) -> None:
    """Solve the ``count`` fastest fitting plans again with the timeline model only, each started
    from its closed-form plan (and kept where no faster), at once on the cores, but those whose
    closed-form solve found no plan of its own and those the timeline model would leave to the
    closed form (:data:`~vlmcompile.planning.stage_cuts.TIMELINE_ACTIONS`); updates ``rows`` and
    ``results`` in place."""
    fitting = sorted((r for r, res in results.items() if res.fits), key=lambda r: results[r].sim.step_time_s)
    timeline_only = dataclasses.replace(solver, closed_form=False)
    todo = []
    for request in fitting[:count]:
        bar.update(1)
        solved = getattr(results[request].report, "solution", None)
        if solved is not None and solved.status.startswith("UNKNOWN"):
            # the closed form found no plan of its own in its time; the larger timeline model, in
            # a share of that time, does not either (the Optimus setups at v > 1)
            said = "no timeline polish: the closed form found no plan of its own in its time"
        elif sum(map(len, results[request].plan.actions)) > TIMELINE_ACTIONS:
            # the solve would be the closed form's again (nothing is solved twice)
            said = f"no timeline polish: its action lists hold over {TIMELINE_ACTIONS} actions"
        else:
            todo.append(request)
            continue
        rows[request] = dataclasses.replace(rows[request], reason=f"{rows[request].reason}; {said}")
    polished = forked_map(
        lambda r: partition(layer_graph, cluster, r, solver=timeline_only, warm_start=results[r].plan),
        todo,
        solver.num_workers,
        (PlanError, ClusterError),
    )
    for request, outcome in zip(todo, polished):
        result = outcome.answer
        if result is None:
            continue  # the closed-form plan stands; its row already says how it was made
        if result.fits and result.sim.step_time_s <= results[request].sim.step_time_s:
            results[request] = result
            rows[request] = dataclasses.replace(
                rows[request],
                outcome="planned",
                reason=f"timeline polish: {_how_made(result)}; "
                f"{_above(result.sim.step_time_s, rows[request].lower_bound_s)} above the candidate's lower bound",
                step_s=result.sim.step_time_s,
                peak_bytes=max(result.sim.peak_mem_bytes),
            )


def _requests(
    layer_graph: LayerGraph,
    cluster: Cluster,
    global_batch: int,
    space: SearchSpace,
    include: Iterable[PlanRequest],
) -> list[PlanRequest]:
    """The candidates: ``include`` and the enumerated ones, each once."""
    todo = list(
        dict.fromkeys([*include, *candidates(layer_graph, cluster, global_batch=global_batch, space=space)])
    )
    if not todo:
        only_dp = f" and DP in {list(space.dp_choices)}" if space.dp_choices is not None else ""
        raise PlanError(
            f"no parallel degrees divide global batch {global_batch} over {cluster.num_gpus} GPUs with microbatch sizes "
            f"{list(space.microbatch_sizes)}{only_dp}; use a global batch that is a multiple of the GPU count"
        )
    return todo


def _solve(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    bound: CandidateBound,
    solver: SolverOptions,
    warm_starts: Sequence[Plan],
    baseline: Callable[[PlanRequest], Plan | None] | None,
) -> tuple[CandidateRow, PolicyResult | None]:
    """One candidate partitioned from ``warm_starts`` and the plan to beat there (``baseline``);
    its row, and its plan if it has one."""
    row = functools.partial(CandidateRow, request, bound=bound)
    try:
        to_beat = baseline(request) if baseline is not None else None
        starts = [*warm_starts, to_beat] if to_beat is not None else list(warm_starts)
        result = partition(
            layer_graph, cluster, request, solver=solver, warm_start=starts, explain_infeasible=False
        )
    except (PlanError, ClusterError) as err:
        return row("failed", str(err)), None
    sim = result.sim
    why = f"{_how_made(result)}; {_above(sim.step_time_s, bound.step_s)} above the candidate's lower bound"
    return row("planned", why, step_s=sim.step_time_s, peak_bytes=max(sim.peak_mem_bytes)), result


def _above(step_s: float, bound_s: float) -> str:
    return f"{100 * (step_s - bound_s) / step_s:.1f} %"


def _how_made(result: PolicyResult) -> str:
    """The solver's summary, and where a warm start simulated faster than its plan, that one's."""
    kept = [d.detail for d in result.plan.decisions if d.reason is Reason.WARM_START]
    return "; ".join([result.report.solution.summary(), *kept[-1:]])


def _over(need: float, cap: float) -> str:
    """How far ``need`` is over ``cap``, in bytes and as a share of the cap."""
    return f"{format_bytes(need - cap)} ({100 * (need - cap) / cap:.0f} %) over it"


def _no_plan_message(rows: Sequence[CandidateRow], cap: float, cluster: str) -> str:
    """Why every candidate lost, by cause: planning errors (grouped by message), plans over the
    memory cap (the least peak), candidates pruned by their model states."""
    parts = []
    failed: dict[str, list[PlanRequest]] = {}
    for r in rows:
        if r.outcome == "failed":
            failed.setdefault(r.reason, []).append(r.request)
    for reason, degrees in sorted(failed.items(), key=lambda kv: -len(kv[1])):
        parts.append(f"{len(degrees)} could not be planned ({reason}; e.g. {degrees[0]})")
    over = [r for r in rows if r.outcome in ("planned", "screened") and (r.peak_bytes or 0) > cap]
    if over:
        least = min(over, key=lambda r: r.peak_bytes)
        parts.append(
            f"{len(over)} planned but over the cap (least peak {format_bytes(least.peak_bytes)} at {least.request}, "
            f"{_over(least.peak_bytes, cap)})"
        )
    pruned = [
        r for r in rows if r.outcome == "pruned" and r.bound is not None and r.bound.least_peak_bytes > cap
    ]
    if pruned:
        least_pruned = min(r.bound.least_peak_bytes for r in pruned)
        parts.append(
            f"{len(pruned)} pruned: even with every layer recomputed they need more than the cap (least "
            f"{format_bytes(least_pruned)} on a fullest rank, {_over(least_pruned, cap)})"
        )
    if not parts:  # every plan fits and none was kept: a fault of the search, not of the model
        raise AssertionError(f"the plan search kept no plan on {cluster}, though none is over the cap")
    return (
        f"no parallel plan fits in {format_bytes(cap)} per rank on {cluster}, of {len(rows)} candidates: "
        + "; ".join(parts)
        + (". Fix the planning errors above, or for memory: " if failed else ". For memory: ")
        + "more GPUs (more PP / TP), ZeRO-2/3, smaller microbatches"
    )


def _bounds_of(
    layer_graph: LayerGraph, cluster: Cluster, todo: Sequence[PlanRequest], cache: dict
) -> dict[PlanRequest, CandidateBound]:
    """Every candidate's bounds; one the cluster cannot run (its TP) gets infinite ones. ``cache``
    keeps the layer costs for the stage-cut bounds later."""
    out = {}
    for request in todo:
        try:
            out[request] = candidate_bound(layer_graph, cluster, request, cache)
        except ClusterError as err:
            never = StepBound((("cannot run", float("inf")),))
            out[request] = CandidateBound(never, None, float("inf"), cannot_run=str(err))
    return out


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total, desc="plan search", unit="candidate", disable=not enabled, file=sys.stderr, leave=False
    )
