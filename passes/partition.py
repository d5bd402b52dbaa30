"""Partition pass: stage cuts and per-layer recompute flags chosen jointly by CP-SAT.

The LayerGraph's layers, in captured (topological) order, are cut into pp x v consecutive
stages, and any layer whose checkpoint keeps less than its saved tensors may be recomputed.
The objective is the pipeline step time of 1F1B / interleaved 1F1B with point-to-point and
recompute time included; the constraint is every rank's memory at every step of its action
list (model states + activations in flight + recompute transient) within the device memory
less the reserve (:data:`~vlmcompile.cost_models.memory.MEMORY_RESERVE`). The model is in
:mod:`vlmcompile.stage_cuts`.

Branches of a multi-encoder model stay valid: contiguous cuts of a topological order put every
layer's inputs on the same or an earlier stage.

Only full recompute is offered per layer: selective recompute frees nothing under the
flash-attention kernels we annotate (see :mod:`vlmcompile.cost_models.memory`).

The solver starts from a warm start (the best baseline's cut and flags when the caller has one,
else the balanced split without recompute); the plan returned is the faster of the solver's
and the warm start's in the simulator, and the report says which and why.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tabulate import tabulate
from vlmcompile.cost_models.memory import (
    MEMORY_RESERVE,
    kept_activation_bytes,
    model_state_bytes,
    recompute_transient_bytes,
    usable_memory_bytes,
)
from vlmcompile.cost_models.stage_costs import cut_transfer_s, layer_costs, samples_per_microbatch
from vlmcompile.passes.megatron import (
    BaselineResult,
    ScheduleName,
    build_plan,
    num_microbatches,
    parallel_for,
)
from vlmcompile.passes.megatron_balanced import balanced_split

from vlmcompile.cluster import Cluster
from vlmcompile.errors import PlanError
from vlmcompile.layer_graph import LayerGraph
from vlmcompile.plan import Decision, Parallel, Plan, Reason, Recompute, Training
from vlmcompile.schedules import make_schedule
from vlmcompile.simulator import SimResult, simulate
from vlmcompile.stage_cuts import Infeasible, PartitionProblem, Solution, evaluate, memory_patterns, solve

GiB = 2**30


def partition_problem(
    layer_graph: LayerGraph,
    cluster: Cluster,
    parallel: Parallel,
    *,
    microbatch_size: int,
    num_microbatches: int,
    schedule: str,
) -> PartitionProblem:
    """The numbers CP-SAT needs, from the cost model (one TP rank, one microbatch)."""
    plain = layer_costs(layer_graph, cluster, parallel, microbatch_size=microbatch_size)
    every = {layer.name: Recompute.FULL for layer in layer_graph.layers}
    full = layer_costs(layer_graph, cluster, parallel, microbatch_size=microbatch_size, recompute=every)
    samples = samples_per_microbatch(layer_graph, microbatch_size)
    shard = {"samples": samples, "tp": parallel.tp, "sequence_parallel": parallel.sequence_parallel}
    p, v = parallel.pp, parallel.v
    # Cuts sit between neighbouring ranks, and with v > 1 also from the last rank back to the first.
    pairs = [(0, 1)] + ([(p - 1, 0)] if v > 1 and p > 2 else []) if p > 1 else []
    layers = layer_graph.layers
    act = [kept_activation_bytes(x, Recompute.NONE, **shard) for x in layers]
    act_rc = [kept_activation_bytes(x, Recompute.FULL, **shard) for x in layers]
    actions = make_schedule(schedule, p, num_microbatches, v=v)
    return PartitionProblem(
        names=tuple(x.name for x in layers),
        fwd_s=tuple(c.fwd_s + c.fwd_tp_comm_s for c in plain),
        bwd_s=tuple(c.input_grad_s + c.weight_grad_s + c.bwd_tp_comm_s for c in plain),
        redo_s=tuple(
            (f.input_grad_s + f.bwd_tp_comm_s) - (c.input_grad_s + c.bwd_tp_comm_s)
            for c, f in zip(plain, full)
        ),
        act_bytes=tuple(act),
        act_bytes_recompute=tuple(act_rc),
        transient_bytes=tuple(recompute_transient_bytes(x, Recompute.FULL, **shard) for x in layers),
        state_bytes=tuple(
            model_state_bytes(c.num_params, Training(), dp=parallel.dp, zero_stage=parallel.zero_stage).total
            for c in plain
        ),
        reduce_s=tuple(c.dp_reduce_s for c in plain),
        cut_s=tuple(
            max((sum(cut_transfer_s(x, cluster, parallel, samples, a, b)) for a, b in pairs), default=0.0)
            for x in layers
        ),
        recomputable=tuple(rc < a for a, rc in zip(act, act_rc)),
        num_ranks=p,
        v=v,
        num_microbatches=num_microbatches,
        memory_patterns=memory_patterns(actions, p * v),
        mem_cap_bytes=usable_memory_bytes(cluster.device.mem_bytes),
    )


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
    plan: Plan
    solution: Solution | None
    """None when the solver could not run (the warm start was returned as is)."""
    stages: tuple[StageRow, ...]
    sim: SimResult
    model_step_s: float
    """The solver model's step time for the plan returned (compare with ``sim.step_time_s``)."""
    warm_start_step_s: float | None
    """Simulated step of the warm start, when there was one."""

    @property
    def model_error(self) -> float:
        """(model - simulated) / simulated for the plan returned."""
        return (self.model_step_s - self.sim.step_time_s) / self.sim.step_time_s

    def stage_table(self) -> str:
        rows = []
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
                    f"{s.fwd_s * 1e3:.2f}",
                    f"{s.bwd_s * 1e3:.2f}",
                    f"{rc} (+{cost * 1e3:.2f} ms, -{freed / GiB:.2f} GiB)" if rc else "0",
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
            [s.index, name, f"{extra * 1e3:.3f}", f"{freed / 2**20:.1f}"]
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

    def __str__(self) -> str:
        solver = self.solution.summary() if self.solution else "solver not run"
        lines = [
            str(self.plan),
            "",
            solver,
            f"step time: solver model {self.model_step_s * 1e3:.2f} ms, simulator {self.sim.step_time_s * 1e3:.2f} ms "
            f"(model error {100 * self.model_error:+.1f} %; both predictions of the cost model)",
        ]
        if self.warm_start_step_s is not None:
            lines.append(f"warm start simulated: {self.warm_start_step_s * 1e3:.2f} ms")
        lines += ["", self.stage_table(), "", self.recompute_table()]
        return "\n".join(lines)


def partition(
    layer_graph: LayerGraph,
    cluster: Cluster,
    *,
    tp: int,
    pp: int,
    v: int = 1,
    microbatch_size: int = 1,
    global_batch: int,
    schedule: ScheduleName | None = None,
    sequence_parallel: bool = True,
    zero_stage: int = 1,
    time_limit_s: float = 10.0,
    warm_start: Plan | None = None,
    workers: int | None = None,
) -> BaselineResult:
    """Choose stage cuts and per-layer recompute for these degrees (see the module docstring).

    Args:
        warm_start: a plan at the same degrees (e.g. the best baseline's) to start the solver from
            and to return instead if the simulator finds it faster.
        time_limit_s: CP-SAT's limit; on a timeout the best plan found is returned and the
            report says so.

    Raises:
        PlanError: no cut and recompute choice fits in memory; the message gives the least
            memory any needs and the knobs that would lower it.
    """
    parallel = parallel_for(
        cluster, tp=tp, pp=pp, v=v, sequence_parallel=sequence_parallel, zero_stage=zero_stage
    )
    name = schedule or ("interleaved_1f1b" if v > 1 else "1f1b")
    if name not in ("1f1b", "interleaved_1f1b"):
        raise PlanError(
            f"the partition pass models 1f1b and interleaved_1f1b; schedule {name!r} is not modelled"
        )
    m = num_microbatches(global_batch, parallel.dp, microbatch_size)
    if pp * v > len(layer_graph.layers):
        raise PlanError(
            f"pp x v = {pp} x {v} = {pp * v} stages for {len(layer_graph.layers)} layers; every stage needs a layer"
        )
    problem = partition_problem(
        layer_graph, cluster, parallel, microbatch_size=microbatch_size, num_microbatches=m, schedule=name
    )
    hint = _hint(problem, layer_graph, warm_start)
    try:
        solution = solve(problem, time_limit_s=time_limit_s, hint=hint, workers=workers)
    except Infeasible as err:
        if err.status == "INFEASIBLE":
            raise PlanError(
                _no_fit_message(problem, parallel, microbatch_size, time_limit_s, workers)
            ) from None
        raise PlanError(
            f"CP-SAT found no plan within {time_limit_s} s ({err.status}) at {parallel}; "
            "raise time_limit_s (no claim is made that none fits)"
        ) from None

    options = dict(
        parallel=parallel, microbatch_size=microbatch_size, global_batch=global_batch, schedule=name
    )
    ours = _plan_from(layer_graph, cluster, problem, solution, options)
    sim = simulate(ours.plan, layer_graph, cluster)
    warm_s = None
    chosen, chosen_sim = ours, sim
    if warm_start is not None:
        warm_sim = simulate(warm_start, layer_graph, cluster)
        warm_s = warm_sim.step_time_s
        cap = problem.mem_cap_bytes
        if warm_s < sim.step_time_s and max(warm_sim.peak_mem_bytes) <= cap:
            kept = _plan_from(
                layer_graph,
                cluster,
                problem,
                solution,
                options,
                chunks=[list(st.layers) for st in warm_start.stages],
                recompute=dict(warm_start.recompute),
                note=Decision(
                    "stage cuts",
                    Reason.WARM_START,
                    f"the warm start ({warm_start.policy}) simulates faster ({warm_s * 1e3:.2f} ms) than the "
                    f"solver's plan ({sim.step_time_s * 1e3:.2f} ms), so its cuts and recompute are kept",
                    {"warm_start_s": warm_s, "solver_plan_s": sim.step_time_s},
                ),
            )
            chosen, chosen_sim = kept, simulate(kept.plan, layer_graph, cluster)
    plan = chosen.plan
    stage_of = tuple(plan.stage_of()[n] for n in problem.names)
    flags = tuple(plan.recompute_of(n) is not Recompute.NONE for n in problem.names)
    report = PartitionReport(
        plan=plan,
        solution=solution,
        stages=_stage_rows(problem, layer_graph, plan, chosen_sim),
        sim=chosen_sim,
        model_step_s=evaluate(problem, stage_of, flags).step_s,
        warm_start_step_s=warm_s,
    )
    return BaselineResult(plan, report)


def chunks_from(problem: PartitionProblem, stage_of) -> list[list[str]]:
    """Layer names per stage, in order, from each layer's stage index."""
    chunks: list[list[str]] = [[] for _ in range(problem.num_stages)]
    for name, k in zip(problem.names, stage_of):
        chunks[k].append(name)
    return chunks


def _hint(problem: PartitionProblem, layer_graph: LayerGraph, warm_start: Plan | None):
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
    stage_of = tuple(k for k, c in enumerate(counts) for _ in range(c))
    return stage_of, (False,) * problem.num_layers


def _plan_from(
    layer_graph, cluster, problem, solution, options, *, chunks=None, recompute=None, note=None
) -> BaselineResult:
    if chunks is None:
        chunks = chunks_from(problem, solution.stage_of)
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
                    f"recomputed: +{redo * 1e3:.3f} ms backward per microbatch, keeps "
                    f"{act_rc / 2**20:.1f} MiB instead of {act / 2**20:.1f} MiB per microbatch in flight",
                    {"extra_s": redo, "kept_bytes": act_rc, "saved_bytes": act},
                )
            )
    if note is not None:
        decisions.append(note)
    return build_plan(
        layer_graph,
        cluster,
        policy="vlmcompile",
        chunks=chunks,
        recompute=recompute,
        decisions=decisions,
        **options,
    )


def _stage_rows(
    problem: PartitionProblem, layer_graph: LayerGraph, plan: Plan, sim: SimResult
) -> tuple[StageRow, ...]:
    index = {n: i for i, n in enumerate(problem.names)}
    in_flight = {}
    for patterns in problem.memory_patterns:
        for live, _ in patterns:
            for k, n in live:
                in_flight[k] = max(in_flight.get(k, 0), n)
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
                        in_flight.get(stage.index, 1)
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


def _no_fit_message(problem, parallel, microbatch_size, time_limit_s, workers) -> str:
    try:
        least = solve(problem, time_limit_s=time_limit_s, workers=workers, minimize_memory=True)
        peak = max(least.evaluation.peak_bytes)
        rank = least.evaluation.peak_bytes.index(peak)
        states = sum(
            problem.state_bytes[i] for i, k in enumerate(least.stage_of) if k % problem.num_ranks == rank
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
