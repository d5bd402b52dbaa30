"""Partition pass: stage cuts and per-layer recompute flags chosen jointly by CP-SAT.

The LayerGraph's layers, in captured (topological) order, are cut into pp x v consecutive
stages, and any layer whose checkpoint keeps less than its saved tensors may be recomputed.
The objective is the pipeline step time of 1F1B / interleaved 1F1B with point-to-point and
recompute time included; the constraint is every rank's memory at every step of its action
list (model states + activations in flight + recompute transient) within the device memory
less the reserve (:data:`~vlmcompile.cost_models.memory.MEMORY_RESERVE`). The model is in
:mod:`vlmcompile.planning.stage_cuts`, its numbers in :mod:`vlmcompile.planning.partition_problem`.

Branches of a multi-encoder model stay valid: contiguous cuts of a topological order put every
layer's inputs on the same or an earlier stage.

Only full recompute is offered per layer: selective recompute frees nothing under the
flash-attention kernels we annotate (see :mod:`vlmcompile.cost_models.memory`).

The solver starts from a warm start (the best baseline's cut and flags when the caller has one,
else the balanced split without recompute); the plan returned is the faster of the solver's
and the warm start's in the simulator, and the report says which and why. The solver's models
leave out the overlap of the DP collectives with compute (the simulator times them per layer),
so their optimum can simulate slower than a plan given to it: that is why the comparison is
made. A warm start may come from other degrees or another microbatch (a plan search's previous
candidate): its cuts and recompute are rebuilt and simulated at this request, so the two
compared are like for like.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from tabulate import tabulate

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import MEMORY_RESERVE
from vlmcompile.cost_models.stage_costs import samples_per_microbatch
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Parallel, Plan, Reason, Recompute
from vlmcompile.planning.build import build_plan
from vlmcompile.planning.candidate_bound import candidate_bound
from vlmcompile.planning.chunks import balanced_split, chunks_by_stage, stage_of_counts
from vlmcompile.planning.partition_problem import PartitionProblem, model_evaluation_s, partition_problem
from vlmcompile.planning.request import PlanRequest, SolverOptions
from vlmcompile.planning.result import PolicyResult
from vlmcompile.planning.schedules import Schedule
from vlmcompile.planning.stage_cuts import Infeasible, Solution, solve
from vlmcompile.planning.step_bound import StepBound
from vlmcompile.sim.simulator import SimResult, simulate
from vlmcompile.sim.units import column_decimals, format_ms

GiB = 2**30


@dataclass(frozen=True, slots=True)
class StageRow:
    index: int
    rank: int
    regions: dict[str, int]
    fwd_s: float
    bwd_s: float
    """Backward of one microbatch, recompute included."""
    recomputed: tuple[tuple[str, float, float], ...]
    """(layer, extra backward seconds per microbatch, bytes freed at the rank's peak)."""
    rank_peak_bytes: float
    limit_bytes: float
    boundary_bytes: float
    """Activations sent to the next stage per microbatch (0 for the last)."""


@dataclass(frozen=True, slots=True)
class PartitionReport:
    """How the stage cuts and recompute flags were chosen (the plan is its result's)."""

    solution: Solution | None
    """None when the solver could not run (the warm start was returned as is)."""
    stages: tuple[StageRow, ...]
    simulated_step_s: float
    """The simulated step of the plan the pass returned."""
    model_step_s: float
    """The solver model's step time for the plan returned (compare with ``simulated_step_s``)."""
    warm_start_step_s: float | None
    step_bound: StepBound | None = None
    """No cut and recompute choice at these degrees simulates faster
    (:mod:`vlmcompile.planning.step_bound`)."""
    """Simulated step of the warm start, when there was one."""

    @property
    def model_error(self) -> float:
        """(model - simulated) / simulated for the plan returned."""
        return (self.model_step_s - self.simulated_step_s) / self.simulated_step_s

    def stage_table(self) -> str:
        rows = []
        decimals = column_decimals([t for s in self.stages for t in (s.fwd_s, s.bwd_s)])
        for s in self.stages:
            regions = ", ".join(f"{k} {n}" for k, n in s.regions.items())
            rc = len(s.recomputed)
            cost = sum(x[1] for x in s.recomputed)
            freed = sum(x[2] for x in s.recomputed)
            rows.append(
                [
                    s.index,
                    s.rank,
                    regions,
                    format_ms(s.fwd_s, decimals=decimals),
                    format_ms(s.bwd_s, decimals=decimals),
                    f"{rc} (+{format_ms(cost)} ms, -{freed / GiB:.2f} GiB)" if rc else "0",
                    f"{s.rank_peak_bytes / GiB:.2f} / {s.limit_bytes / GiB:.2f}",
                    f"{s.boundary_bytes / 2**20:.2f}",
                ]
            )
        headers = [
            "stage",
            "rank",
            "layers by region",
            "fwd ms",
            "bwd ms",
            "recomputed (bwd cost, freed)",
            "rank peak / limit GiB",
            "boundary MiB",
        ]
        return tabulate(rows, headers=headers, disable_numparse=True)

    def recompute_table(self) -> str:
        rows = [
            [s.index, name, format_ms(extra), f"{freed / 2**20:.1f}"]
            for s in self.stages
            for name, extra, freed in s.recomputed
        ]
        if not rows:
            return "no layer is recomputed"
        return tabulate(
            rows,
            headers=["stage", "recomputed layer", "extra bwd ms / microbatch", "MiB freed at peak"],
            disable_numparse=True,
        )

    @property
    def bound_gap(self) -> float:
        """How far the plan's simulated step is above the step bound, as a share of the step (the
        solver's own gap is in its model's terms; this one is in the simulator's)."""
        if self.step_bound is None or self.simulated_step_s <= 0:
            return math.nan
        return max(0.0, (self.simulated_step_s - self.step_bound.step_s) / self.simulated_step_s)

    def __str__(self) -> str:
        solver = self.solution.summary() if self.solution else "solver not run"
        lines = [
            "stage cuts and recompute (CP-SAT):",
            solver,
            f"step time: solver model {format_ms(self.model_step_s)} ms, simulator {format_ms(self.simulated_step_s)} ms "
            f"(model error {100 * self.model_error:+.1f} %; both predictions of the cost model)",
        ]
        if self.warm_start_step_s is not None:
            lines.append(f"warm start simulated: {format_ms(self.warm_start_step_s)} ms")
        if self.step_bound is not None:
            lines.append(
                f"no cut and recompute choice at these degrees simulates faster than {format_ms(self.step_bound.step_s)} ms "
                f"({self.step_bound.binding} bound); this plan is {100 * self.bound_gap:.1f} % above it"
            )
        lines += ["", self.stage_table(), "", self.recompute_table()]
        return "\n".join(lines)


def partition(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    solver: SolverOptions = SolverOptions(),
    warm_start: Plan | Sequence[Plan] | None = None,
    explain_infeasible: bool = True,
) -> PolicyResult:
    """Choose stage cuts and per-layer recompute for ``request`` (see the module docstring).

    Args:
        solver: CP-SAT's time limit and workers; on a timeout the best plan found is returned
            and the report says so.
        warm_start: one plan or several (e.g. the best baseline's) with ``request``'s pp x v
            stages, for this request or other degrees (their cuts and recompute are taken): the
            solver starts from the fastest in the simulator, and that one is returned instead of
            the solver's plan if it simulates faster. Plans with other stages are ignored.
        explain_infeasible: where nothing fits, solve again for the least memory any cut needs
            and say it (up to the time limit once more; a plan search, which has many
            candidates and its own memory bound for each, skips it).

    Raises:
        PlanError: no cut and recompute choice fits in memory; the message gives the least
            memory any needs and the knobs that would lower it.
    """
    request.check_on(cluster)
    par = request.parallel
    if request.schedule_name not in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B):
        raise PlanError(
            f"the partition pass models 1f1b and interleaved_1f1b; schedule {request.schedule_name.value!r} "
            "is not modelled"
        )
    if par.pp * par.v > len(layer_graph.layers):
        raise PlanError(
            f"pp x v = {par.pp} x {par.v} = {par.pp * par.v} stages for {len(layer_graph.layers)} layers; "
            "every stage needs a layer"
        )
    problem = partition_problem(layer_graph, cluster, request)
    warm = _fastest_warm_start(layer_graph, cluster, request, problem, warm_start)
    try:
        solution = solve(problem, solver, hint=_hint(problem, warm[0] if warm else None))
    except Infeasible as err:
        if err.status == "INFEASIBLE" and explain_infeasible:
            raise PlanError(_no_fit_message(problem, request, solver)) from None
        if err.status == "INFEASIBLE":
            raise PlanError(
                f"CP-SAT proved that no stage cut and recompute choice fits in "
                f"{problem.mem_cap_bytes / GiB:.2f} GiB per rank at {par}, microbatch size {request.microbatch_size}"
            ) from None
        raise PlanError(
            f"CP-SAT found no plan within {solver.time_limit_s} s ({err.status}) at {par}; "
            "raise time_limit_s (no claim is made that none fits)"
        ) from None

    plan = _plan_from(layer_graph, cluster, request, problem, solution)
    sim = simulate(plan, layer_graph, cluster)
    warm_s = None
    if warm is not None:
        warm_plan, warm_sim = warm
        warm_s = warm_sim.step_time_s
        if warm_s < sim.step_time_s and warm_sim.fits:
            plan = _keep_warm_start(layer_graph, cluster, request, problem, solution, warm_plan, warm_s, sim)
            sim = simulate(plan, layer_graph, cluster)
    stage_of = tuple(plan.stage_of()[n] for n in problem.names)
    flags = tuple(plan.recompute_of(n) is not Recompute.NONE for n in problem.names)
    report = PartitionReport(
        solution=solution,
        stages=_stage_rows(problem, layer_graph, plan, sim),
        simulated_step_s=sim.step_time_s,
        model_step_s=model_evaluation_s(problem, stage_of, flags),
        warm_start_step_s=warm_s,
        step_bound=candidate_bound(layer_graph, cluster, request).chain,
    )
    return PolicyResult(plan=plan, sim=sim, report=report, recompute=f"per layer ({len(plan.recompute)})")


def _keep_warm_start(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    problem: PartitionProblem,
    solution: Solution,
    warm_start: Plan,
    warm_s: float,
    solver_sim: SimResult,
) -> Plan:
    """The warm start's cuts and recompute, with the solver's decisions and why they lost."""
    return _plan_from(
        layer_graph,
        cluster,
        request,
        problem,
        solution,
        chunks=[list(st.layers) for st in warm_start.stages],
        recompute=dict(warm_start.recompute),
        note=Decision(
            "stage cuts",
            Reason.WARM_START,
            f"the warm start ({warm_start.policy}) simulates faster ({format_ms(warm_s)} ms) than the "
            f"solver's plan ({format_ms(solver_sim.step_time_s)} ms), so its cuts and recompute are kept",
            {"warm_start_s": warm_s, "solver_plan_s": solver_sim.step_time_s},
        ),
    )


def _fastest_warm_start(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    problem: PartitionProblem,
    given: Plan | Sequence[Plan] | None,
) -> tuple[Plan, SimResult] | None:
    """The warm start that simulates fastest at ``request`` (one that fits before one that does
    not), each rebuilt for ``request`` where it was made for other degrees or microbatches;
    None when none has ``request``'s stages over the same layers."""
    plans = [given] if isinstance(given, Plan) else list(given or ())
    usable = [
        p
        for p in plans
        if set(p.parallel) == {"model"}
        and p.num_stages == problem.num_stages
        and set(p.stage_of()) == set(problem.names)
    ]
    timed = []
    for p in usable:
        at_request = p if _made_for(p, request) else _rebuilt(layer_graph, cluster, request, p)
        timed.append((at_request, simulate(at_request, layer_graph, cluster)))
    return min(timed, key=lambda ps: (not ps[1].fits, ps[1].step_time_s)) if timed else None


def _made_for(plan: Plan, request: PlanRequest) -> bool:
    return (
        plan.pipeline_parallel == request.parallel
        and plan.microbatch_size == request.microbatch_size
        and plan.num_microbatches == request.num_microbatches
        and plan.schedule == request.schedule_name.value
    )


def _rebuilt(layer_graph: LayerGraph, cluster: Cluster, request: PlanRequest, plan: Plan) -> Plan:
    """``plan``'s stages and recompute as a plan for ``request`` (a start for the solver: its
    decisions are not carried over)."""
    return build_plan(
        layer_graph,
        cluster,
        request,
        policy=plan.policy,
        chunks=[list(st.layers) for st in plan.stages],
        recompute=dict(plan.recompute),
        decisions=[],
    )


def _hint(problem: PartitionProblem, warm_start: Plan | None) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    if warm_start is not None:
        where = warm_start.stage_of()
        if set(where) == set(problem.names) and warm_start.num_stages == problem.num_stages:
            return (
                tuple(where[n] for n in problem.names),
                tuple(
                    warm_start.recompute_of(n) is not Recompute.NONE and problem.recomputable[i]
                    for i, n in enumerate(problem.names)
                ),
            )
    counts = balanced_split([f + b for f, b in zip(problem.fwd_s, problem.bwd_s)], problem.num_stages)
    return stage_of_counts(counts), (False,) * problem.num_layers


def _plan_from(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    problem: PartitionProblem,
    solution: Solution,
    *,
    chunks: list[list[str]] | None = None,
    recompute: dict[str, Recompute] | None = None,
    note: Decision | None = None,
) -> Plan:
    if chunks is None:
        chunks = chunks_by_stage(problem.names, solution.stage_of, problem.num_stages)
        recompute = {n: Recompute.FULL for n, f in zip(problem.names, solution.recompute) if f}
    flags = [recompute.get(n, Recompute.NONE) is not Recompute.NONE for n in problem.names]
    decisions = [
        Decision(
            "stage cuts",
            Reason.SOLVER_TIMEOUT if solution.timed_out else Reason.SOLVED,
            f"{solution.summary()}; layers per stage {[len(c) for c in chunks]}",
            {
                "objective_s": solution.objective_s,
                "bound_s": solution.bound_s,
                "gap": solution.gap,
                "solve_s": solution.wall_s,
            },
        ),
    ]
    for name, flag, redo, act, act_rc in zip(
        problem.names, flags, problem.redo_s, problem.act_bytes, problem.act_bytes_recompute
    ):
        if flag:
            decisions.append(
                Decision(
                    name,
                    Reason.LAYER_RECOMPUTE,
                    f"recomputed: +{format_ms(redo)} ms backward per microbatch, keeps "
                    f"{act_rc / 2**20:.1f} MiB instead of {act / 2**20:.1f} MiB per microbatch in flight",
                    {"extra_s": redo, "kept_bytes": act_rc, "saved_bytes": act},
                )
            )
    if note is not None:
        decisions.append(note)
    return build_plan(
        layer_graph,
        cluster,
        request,
        policy="vlmcompile",
        chunks=chunks,
        recompute=recompute,
        decisions=decisions,
    )


def _stage_rows(
    problem: PartitionProblem, layer_graph: LayerGraph, plan: Plan, sim: SimResult
) -> tuple[StageRow, ...]:
    index = {n: i for i, n in enumerate(problem.names)}
    in_flight = problem.most_in_flight
    rows = []
    for stage in plan.stages:
        ids = [index[n] for n in stage.layers]
        flagged = [i for i in ids if plan.recompute_of(problem.names[i]) is not Recompute.NONE]
        last = layer_graph[stage.layers[-1]]
        rows.append(
            StageRow(
                index=stage.index,
                rank=stage.rank,
                regions=dict(Counter(str(layer_graph[n].region) for n in stage.layers)),
                fwd_s=sum(problem.fwd_s[i] for i in ids),
                bwd_s=sum(problem.bwd_s[i] + (problem.redo_s[i] if i in flagged else 0.0) for i in ids),
                recomputed=tuple(
                    (
                        problem.names[i],
                        problem.redo_s[i],
                        max(in_flight[stage.index], 1)
                        * (problem.act_bytes[i] - problem.act_bytes_recompute[i]),
                    )
                    for i in flagged
                ),
                rank_peak_bytes=sim.peak_mem_bytes[stage.rank],
                limit_bytes=problem.mem_cap_bytes,
                boundary_bytes=0.0
                if stage.index == plan.num_stages - 1
                else last.boundary_fwd_bytes * samples_per_microbatch(layer_graph, plan.microbatch_size),
            )
        )
    return tuple(rows)


def _no_fit_message(problem: PartitionProblem, request: PlanRequest, solver: SolverOptions) -> str:
    parallel, microbatch_size = request.parallel, request.microbatch_size
    try:
        least = solve(problem, solver, minimize_memory=True)
        peak = max(least.evaluation.peak_bytes)
        rank = least.evaluation.peak_bytes.index(peak)
        states = sum(
            problem.state_bytes[i] for i, k in enumerate(least.stage_of) if problem.rank_of_stage[k] == rank
        )
        # In this mode the solver's objective and bound are bytes.
        exact = (
            "is" if least.status == "OPTIMAL" else f"is at least {least.bound_s / GiB:.2f} GiB and at most"
        )
        need = (
            f"the least memory any cut and recompute choice needs {exact} {peak / GiB:.2f} GiB on its fullest rank "
            f"({states / GiB:.2f} GiB model states, {(peak - states) / GiB:.2f} GiB activations)"
        )
        knobs = _knobs(states, peak - states, parallel, microbatch_size)
    except Infeasible:
        need, knobs = "the least memory needed could not be found", "more PP or TP"
    return (
        f"no stage cut and recompute choice fits in {problem.mem_cap_bytes / GiB:.2f} GiB per rank "
        f"(device memory less the {100 * MEMORY_RESERVE:.0f} % reserve) at {parallel}, microbatch size "
        f"{microbatch_size}: {need}. Try {knobs}"
    )


def _knobs(states: float, activations: float, parallel: Parallel, microbatch_size: int) -> str:
    out = []
    if states >= activations:
        out += [f"more PP (now {parallel.pp}) or more TP (now {parallel.tp}) to split the model states"]
        if parallel.zero_stage < 3 and parallel.dp > 1:
            out.append(f"ZeRO stage {parallel.zero_stage + 1} to shard more states over DP={parallel.dp}")
    else:
        if microbatch_size > 1:
            out.append(f"a smaller microbatch (now {microbatch_size}) to shrink the activations")
        out.append(f"more TP (now {parallel.tp}, with sequence parallelism) to shard the activations")
        out.append(f"more PP (now {parallel.pp}) so each rank holds fewer layers' activations")
    return "; ".join(out)
