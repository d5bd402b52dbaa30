"""Plan search: the parallel degrees (TP, PP, DP, microbatch size, v) for a cluster.

Every combination the cluster allows is a candidate (TP a power of two within a node, PP
dividing what TP leaves, DP the rest, a microbatch size dividing the per-replica batch, v > 1
only where interleaving applies). Candidates are visited in order of a lower bound on their
step time - every layer's forward and backward spread over the PP ranks with no bubble,
m x sum(F + B) / pp - and

* rejected without solving when their model states alone, split evenly over the PP ranks,
  exceed the memory cap, or when the lower bound is no better than the best plan found;
* otherwise partitioned by CP-SAT (:func:`~vlmcompile.passes.partition.partition`) with its
  closed-form model only, and simulated.

The few fastest plans that fit (``polish``) are then solved again with the timeline model only,
started from their own cuts, for ``SolverOptions.timeline_share`` of the limit each: it times
the schedule action by action, which the closed form only bounds, and costs seconds per
candidate. The fastest simulated plan that fits wins.

A candidate's partition starts from every plan the search has for it: one given for its
request, the plan to beat there (``baseline``: the fastest baseline's, from
:func:`~vlmcompile.passes.policies.search_and_compare`), and the plan of the last solved
candidate with the same PP x v. The partition returns the fastest of them in the simulator when
the solver's own plan is slower - the solver's models leave out the DP collectives' overlap, so
their optimum is not always the simulator's - and so no candidate is slower than its baseline.

Work is reused: layer costs per (TP, DP, microbatch size) are computed once for the bounds.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from tabulate import tabulate

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import fits, usable_memory_bytes
from vlmcompile.cost_models.stage_costs import layer_costs, layer_state_bytes
from vlmcompile.ir.errors import ClusterError, PlanError, positive_int
from vlmcompile.ir.layer_graph import LayerGraph, format_bytes
from vlmcompile.ir.plan import Parallel, Plan, Reason
from vlmcompile.passes.partition import partition
from vlmcompile.planning.request import PlanRequest, SearchSpace, SolverOptions
from vlmcompile.planning.result import PolicyResult
from vlmcompile.sim.units import column_decimals, format_ms

REASON_WIDTH = 90
"""Characters per line of the search table's "why" column: a longer reason wraps, it is never cut."""


@dataclass(frozen=True, slots=True)
class CandidateRow:
    request: PlanRequest
    outcome: str
    """chosen, planned (slower than the chosen), pruned, or failed."""
    reason: str
    lower_bound_s: float
    step_s: float | None = None
    peak_bytes: float | None = None


@dataclass(frozen=True, slots=True)
class SearchReport:
    """Every candidate the search considered and what became of it (the plan chosen is its
    result's)."""

    cluster: str
    candidates: tuple[CandidateRow, ...]
    wall_s: float

    def table(self, limit: int | None = 40) -> str:
        order = {"chosen": 0, "planned": 1, "failed": 2, "pruned": 3}
        rows = sorted(self.candidates, key=lambda c: (order[c.outcome], c.step_s or c.lower_bound_s))
        shown = rows if limit is None else rows[:limit]
        # One number of decimals for both time columns, enough to tell the closest rows apart.
        decimals = column_decimals([*(c.step_s for c in shown), *(c.lower_bound_s for c in shown)])
        lines = [
            [
                str(c.request),
                c.outcome,
                format_ms(c.step_s, decimals=decimals),
                format_ms(c.lower_bound_s, decimals=decimals),
                f"{c.peak_bytes / 2**30:.1f}" if c.peak_bytes is not None else "-",
                c.reason,
            ]
            for c in shown
        ]
        table = tabulate(
            lines,
            headers=["degrees", "outcome", "simulated ms", "lower bound ms", "peak GiB", "why"],
            disable_numparse=True,
            maxcolwidths=[None, None, None, None, None, REASON_WIDTH],
        )
        more = f"\n... and {len(rows) - len(shown)} more" if len(shown) < len(rows) else ""
        return table + more

    def __str__(self) -> str:
        counts = {
            k: sum(c.outcome == k for c in self.candidates) for k in ("chosen", "planned", "pruned", "failed")
        }
        head = (
            f"plan search on {self.cluster}: {len(self.candidates)} candidates in {self.wall_s:.1f} s "
            f"({counts['planned'] + counts['chosen']} planned, {counts['pruned']} pruned, {counts['failed']} failed)"
        )
        return f"{head}\n{self.table()}"


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
                            parallel=Parallel(dp=dp, tp=tp, pp=pp, v=v, zero_stage=cluster.zero_stage),
                            global_batch=batch,
                            microbatch_size=mbs,
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
            candidate the search partitions; its partition starts from it too, so the plan
            chosen is never slower than that request's baseline.
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
    costs_cache: dict = {}
    bounds = {r: _bounds(layer_graph, cluster, r, costs_cache) for r in todo}
    todo.sort(key=lambda r: bounds[r][0])
    bar = _progress(len(todo) + min(polish, len(todo)), progress)
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    with_closed_form = dataclasses.replace(solver, timeline_share=0.0)
    rows, results = _visit_all(
        layer_graph, cluster, todo, bounds, cap, with_closed_form, warm_starts or {}, baseline, bar
    )
    if not any(res.fits for res in results.values()):
        bar.close()
        raise PlanError(
            _no_plan_message(list(rows.values()), cap, cluster.name, min(b[1] for b in bounds.values()))
        )
    if solver.timeline_share > 0:
        _polish(layer_graph, cluster, rows, results, solver, polish, bar)
    bar.close()
    best_request = min(
        (r for r, res in results.items() if res.fits), key=lambda r: results[r].sim.step_time_s
    )
    best = results[best_request]
    row = rows[best_request]
    rows[best_request] = dataclasses.replace(
        row, outcome="chosen", reason=f"fastest simulated plan that fits; {row.reason}"
    )
    report = SearchReport(cluster.name, tuple(rows.values()), time.perf_counter() - start)
    return dataclasses.replace(best, report=report)


def _visit_all(
    layer_graph: LayerGraph,
    cluster: Cluster,
    todo: Sequence[PlanRequest],
    bounds: Mapping[PlanRequest, tuple[float, float]],
    cap: float,
    solver: SolverOptions,
    warm_starts: Mapping[PlanRequest, Plan],
    baseline: Callable[[PlanRequest], Plan | None] | None,
    bar,
) -> tuple[dict[PlanRequest, CandidateRow], dict[PlanRequest, PolicyResult]]:
    """Every candidate in ``todo``'s order: its row, and its plan where it has one. A solved
    candidate's plan warm-starts the next one with the same PP x v."""
    rows: dict[PlanRequest, CandidateRow] = {}
    results: dict[PlanRequest, PolicyResult] = {}
    best: PolicyResult | None = None
    hints: dict[tuple[int, int], Plan] = {}
    for request in todo:
        bar.update(1)
        par = request.parallel
        given = [p for p in (warm_starts.get(request), hints.get((par.pp, par.v))) if p is not None]
        rows[request], result = _visit(
            layer_graph, cluster, request, bounds[request], cap, best, solver, given, baseline
        )
        if result is None:
            continue
        results[request] = result
        hints[(par.pp, par.v)] = result.plan
        if result.fits and (best is None or result.sim.step_time_s < best.sim.step_time_s):
            best = result
        bar.set_postfix_str(f"best {format_ms(best.sim.step_time_s)} ms" if best else "none fits yet")
    return rows, results


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
    from its closed-form plan (and kept where no faster); updates ``rows`` and ``results`` in place."""
    fitting = sorted((r for r, res in results.items() if res.fits), key=lambda r: results[r].sim.step_time_s)
    timeline_only = dataclasses.replace(solver, closed_form=False)
    for request in fitting[:count]:
        bar.update(1)
        try:
            result = partition(
                layer_graph, cluster, request, solver=timeline_only, warm_start=results[request].plan
            )
        except (PlanError, ClusterError):
            continue  # the closed-form plan stands; its row already says how it was made
        if result.fits and result.sim.step_time_s <= results[request].sim.step_time_s:
            results[request] = result
            rows[request] = dataclasses.replace(
                rows[request],
                reason="timeline polish: " + _how_made(result),
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


def _visit(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    bounds: tuple[float, float],
    cap: float,
    best: PolicyResult | None,
    solver: SolverOptions,
    warm_starts: Sequence[Plan],
    baseline: Callable[[PlanRequest], Plan | None] | None,
) -> tuple[CandidateRow, PolicyResult | None]:
    """One candidate: pruned by its bounds, or partitioned from ``warm_starts`` and the plan to
    beat there (``baseline``); its row, and its plan if it has one."""
    lower, states = bounds
    if not fits([states], cap):
        return CandidateRow(
            request, "pruned", f"model states alone need {states / 2**30:.1f} GiB per rank", lower
        ), None
    if best is not None and lower >= best.sim.step_time_s:
        why = f"lower bound >= best found ({format_ms(best.sim.step_time_s)} ms)"
        return CandidateRow(request, "pruned", why, lower), None
    try:
        to_beat = baseline(request) if baseline is not None else None
        starts = [*warm_starts, to_beat] if to_beat is not None else list(warm_starts)
        result = partition(layer_graph, cluster, request, solver=solver, warm_start=starts)
    except (PlanError, ClusterError) as err:
        return CandidateRow(request, "failed", str(err), lower), None
    sim = result.sim
    return CandidateRow(
        request, "planned", _how_made(result), lower, sim.step_time_s, max(sim.peak_mem_bytes)
    ), result


def _how_made(result: PolicyResult) -> str:
    """The solver's summary, and where a warm start simulated faster than its plan, that one's."""
    kept = [d.detail for d in result.plan.decisions if d.reason is Reason.WARM_START]
    return "; ".join([result.report.solution.summary(), *kept[-1:]])


def _no_plan_message(rows: Sequence[CandidateRow], cap: float, cluster: str, least_states: float) -> str:
    """Why every candidate lost, by cause: planning errors (grouped by message), plans over the
    memory cap (the least peak), candidates pruned by their model states."""
    parts = []
    failed: dict[str, list[PlanRequest]] = {}
    for r in rows:
        if r.outcome == "failed":
            failed.setdefault(r.reason, []).append(r.request)
    for reason, degrees in sorted(failed.items(), key=lambda kv: -len(kv[1])):
        parts.append(f"{len(degrees)} could not be planned ({reason}; e.g. {degrees[0]})")
    over = [r for r in rows if r.outcome == "planned" and r.peak_bytes is not None]
    if over:
        least = min(over, key=lambda r: r.peak_bytes)
        parts.append(
            f"{len(over)} planned but over the cap (least peak {format_bytes(least.peak_bytes)} at {least.request})"
        )
    pruned = sum(r.outcome == "pruned" for r in rows)
    if pruned:
        parts.append(
            f"{pruned} pruned: their model states alone exceed the cap (least {format_bytes(least_states)} per rank)"
        )
    return (
        f"no parallel plan fits in {format_bytes(cap)} per rank on {cluster}, of {len(rows)} candidates: "
        + "; ".join(parts)
        + ". Fix the planning errors above, or for memory: more GPUs (more PP / TP), ZeRO-2/3, smaller microbatches"
    )


def _bounds(
    layer_graph: LayerGraph, cluster: Cluster, request: PlanRequest, cache: dict
) -> tuple[float, float]:
    """(step-time lower bound, model states per rank if split evenly over the PP ranks); layer
    costs depend on TP, DP and the microbatch only, so ``cache`` holds them per that key."""
    par = request.parallel
    key = (par.tp, par.dp, request.microbatch_size)
    try:
        if key not in cache:
            cache[key] = layer_costs(layer_graph, cluster, par, microbatch_size=request.microbatch_size)
    except ClusterError:
        return float("inf"), float("inf")
    costs = cache[key]
    work = sum(c.f_s + c.b_s for c in costs)
    states = sum(layer_state_bytes(c, par) for c in costs)
    return request.num_microbatches * work / par.pp, states / par.pp


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total, desc="plan search", unit="candidate", disable=not enabled, file=sys.stderr, leave=False
    )
