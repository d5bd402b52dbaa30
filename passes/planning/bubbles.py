"""The encoder-in-bubbles pass (Optimus secs. 3-4): the encoders get a parallel plan of their
own over the LLM's GPUs, and their work is scheduled into the LLM pipeline's idle time.

For a request (the LLM's DP/TP/PP, v, microbatches and schedule) the pass

1. enumerates the encoder plans (Optimus's model planner, sec. 4.1): PP_enc a divisor of
   PP_llm, TP_enc a divisor of TP_llm whose replicas share a microbatch evenly, and the
   granularity (encoder layers per scheduled action: ``chunks`` per encoder stage);
2. cuts the LLM's layers into PP x v virtual stages balanced by time (Optimus appendix B's
   program on the LLM alone) and each encoder plan's layers into PP_enc stages the same way;
3. prunes the encoder plans whose model states leave no room in memory;
4. schedules each: the phased schedule and one setting of each kind of the list scheduler
   (:func:`~vlmcompile.planning.bubble_schedule.greedy`, layer level and, where the LLM has TP
   collectives, kernel level), each simulated; the fastest few encoder plans get every setting,
   and the fastest go to the CP-SAT model
   (:func:`~vlmcompile.planning.bubble_schedule.solve_schedule`), whose schedules are simulated again;
5. keeps the fastest simulated plan that fits (in the device's memory, or a tighter budget),
   with the least recompute that lets any plan fit (:data:`~vlmcompile.planning.model_parts.RECOMPUTE_LADDER`: none, the
   encoder alone, selective, selective + encoder; then, on top of selective + encoder, the
   least share of every rank's LLM layers fully recomputed (bisection over eighths); then
   full, full + encoder).

The LLM's actions keep the request's schedule order on every rank; the encoder's are placed
around them. The report lists every encoder plan tried and why it lost, the bubbles of each
rank by cause before (the phased schedule: all encoder forwards first, all backwards last) and
after, the share of the encoder's work hidden in the LLM's bubbles, the solver's status,
objective, bound and gap, and the wall time.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from tabulate import tabulate

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import fits, usable_memory_bytes
from vlmcompile.cost_models.stage_costs import PlanCosts, layer_costs, plan_costs
from vlmcompile.ir.actions import dependencies
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Parallel, Plan, Reason, Recompute
from vlmcompile.planning import bubble_schedule as bs
from vlmcompile.planning import encoder_plans as ep
from vlmcompile.planning.build import build_separate_plan
from vlmcompile.planning.chunks import balanced_split, chunks_of
from vlmcompile.planning.forked import forked_map
from vlmcompile.planning.llm_alone_bound import (
    DependencyBound,
    EncoderDelays,
    PlacementBound,
    dependency_bound,
    encoder_delays,
    llm_alone_plan,
    llm_alone_step_s,
    llm_stages_of,
    placement_bound,
)
from vlmcompile.planning.model_parts import (
    HEAVIER_RUNGS,
    LIGHTER_RUNGS,
    PARTIAL_BASE,
    PARTIAL_SHARES,
    ModelParts,
    RecomputeRung,
    model_parts,
    recompute_flags,
)
from vlmcompile.planning.request import GAP_GOAL, GlobalRecompute, PlanRequest, SolverOptions
from vlmcompile.planning.result import PolicyResult
from vlmcompile.sim.simulator import CAUSES, SimResult, simulate
from vlmcompile.sim.timeline import transfer_of
from vlmcompile.sim.units import column_decimals, format_ms, ms_decimals

REFINED_PLANS = 3
"""Encoder plans (the fastest after the screen) the list scheduler tries every setting on."""


SOLVED_PLANS = 2
"""Encoder plans (the fastest after the list scheduler) CP-SAT schedules, each within the
solver's time limit / SOLVED_PLANS; one where the LLM has TP collectives."""
MAX_ENCODER_ACTIONS = 600
"""Encoder actions per step above which a finer granularity is not tried (CP-SAT's size)."""


@dataclass(frozen=True, slots=True)
class EncoderPlanRow:
    """One encoder plan the pass tried."""

    encoder: ep.EncoderPlan
    degrees: str
    """DP/TP/PP of the encoder group."""
    greedy_step_s: float | None
    """Simulated step of the better of the phased schedule and the list scheduler's (None: pruned)."""
    solved_step_s: float | None = None
    """Simulated step with CP-SAT's schedule (None: not solved)."""
    peak_gib: float | None = None
    fits: bool = False
    verdict: str = ""
    applies: bool = True
    """False: the encoder plan cannot be built at this request (the verdict says why)."""

    @property
    def fits_text(self) -> str:
        """yes / no for a plan with a peak; n/a where it cannot be built; - where it was skipped."""
        if not self.applies:
            return "n/a"
        if self.peak_gib is None:
            return "-"
        return "yes" if self.fits else "no"

    @property
    def step_s(self) -> float | None:
        steps = [s for s in (self.greedy_step_s, self.solved_step_s) if s is not None]
        return min(steps) if steps else None


@dataclass(frozen=True, slots=True)
class BubbleReport:
    """What the encoder-in-bubbles pass tried and how its plan's bubbles changed (the plan is its
    result's)."""

    request: PlanRequest
    recompute: str
    rows: tuple[EncoderPlanRow, ...]
    chosen: ep.EncoderPlan
    encoder_parallel: Parallel
    """The chosen encoder plan's degrees."""
    phased_step_s: float
    """The chosen plan with every encoder forward before the LLM's work and every backward after."""
    step_s: float
    llm_alone_step_s: float
    """The same LLM without the encoders at the same degrees, schedule and recompute (the bound this
    pass aims at): on this plan's LLM stages or balanced anew (:mod:`vlmcompile.planning.llm_alone_bound`),
    whichever is faster."""
    encoder_compute_s: float
    """Encoder compute of one step (TP collectives left out), summed over the ranks of one LLM
    pipeline."""
    bubbles_before: tuple[dict[str, float], ...]
    bubbles_after: tuple[dict[str, float], ...]
    solver_status: str
    objective_s: float | None
    bound_s: float | None
    gap: float | None
    wall_s: float
    notes: tuple[str, ...] = field(default=())

    layer_hidden_share: float = 0.0
    """The share of the encoder's compute run at layer level while its rank's next LLM action
    could not start yet (its inputs were not there): inside a pipeline bubble."""
    kernel_hidden_share: float = 0.0
    """The share of the encoder's compute run at kernel level inside the LLM's TP gaps (what
    lengthened a host is not counted)."""
    layer_level_step_s: float | None = None
    """The step before encoder work moved into the TP gaps (None: the same as ``step_s``)."""
    dependency_bound: DependencyBound | None = None
    """The LLM alone with the encoder-LLM dependencies of one microbatch at each end
    (:func:`~vlmcompile.planning.llm_alone_bound.dependency_bound`), on this plan's LLM stages or
    balanced anew, whichever is lower."""
    delays: EncoderDelays | None = None
    """Where the step exceeds this plan's own LLM stages run alone, split by when."""
    own_llm_alone_step_s: float | None = None
    """This plan's own LLM stages run alone (what ``delays`` are measured against)."""
    placement_bound: PlacementBound | None = None
    """The least step any schedule of this plan's placement can reach (each action on its rank,
    the LLM's order: :func:`~vlmcompile.planning.llm_alone_bound.placement_bound`): what is above it is
    the encoder's order and level on those ranks."""

    @property
    def hidden_share(self) -> float:
        """The share of the encoder's compute hidden in the LLM's bubbles, layer and kernel level."""
        return self.layer_hidden_share + self.kernel_hidden_share

    @property
    def encoder_overhead(self) -> float:
        """Our step over the LLM-alone step at the same degrees (1.0: the encoders are free)."""
        return self.step_s / self.llm_alone_step_s if self.llm_alone_step_s > 0 else float("inf")

    def rows_table(self) -> str:
        decimals = column_decimals(s for r in self.rows for s in (r.greedy_step_s, r.solved_step_s))
        lines = [
            [
                str(r.encoder),
                r.degrees,
                format_ms(r.greedy_step_s, decimals=decimals),
                format_ms(r.solved_step_s, decimals=decimals),
                f"{r.peak_gib:.1f}" if r.peak_gib is not None else "-",
                r.fits_text,
                r.verdict,
            ]
            for r in self.rows
        ]
        return tabulate(
            lines,
            headers=[
                "encoder plan",
                "DP/TP/PP",
                "phased or list ms",
                "CP-SAT ms",
                "peak GiB",
                "fits",
                "verdict",
            ],
            disable_numparse=True,
            maxcolwidths=[None] * 6 + [80],  # a long verdict wraps, never cut
        )

    def bubbles_table(self) -> str:
        lines = []
        decimals = ms_decimals(self.step_s)  # idle times are parts of a step: its precision
        for rank, (before, after) in enumerate(zip(self.bubbles_before, self.bubbles_after)):
            lines.append(
                [rank]
                + [
                    f"{format_ms(before[c], decimals=decimals)} -> {format_ms(after[c], decimals=decimals)}"
                    for c in CAUSES
                ]
            )
        return tabulate(lines, headers=["rank", *[f"{c} ms" for c in CAUSES]], disable_numparse=True)

    def delays_line(self) -> str:
        """Where the step goes past this plan's LLM stages alone, each end against its bound."""
        line = f"over its own LLM stages alone ({format_ms(self.own_llm_alone_step_s)} ms): {self.delays}"
        bound = self.dependency_bound
        if bound is None:
            return line
        return (
            f"{line} (the dependency bound's: {format_ms(bound.first_head_s)} ms before the start, "
            f"{format_ms(bound.last_tail_s)} ms past the end)"
        )

    def __str__(self) -> str:
        gap = f", gap {100 * self.gap:.2f} %" if self.gap is not None else ""
        if self.gap is not None and self.gap > GAP_GOAL:
            gap += (
                f" (above {100 * GAP_GOAL:.0f} %: the bound is the LLM's actions alone after the first encoder forward and before "
                "the last encoder backward, so encoder work no schedule hides in the bubbles is above it"
                + ("" if self.solver_status == "OPTIMAL" else "; CP-SAT stopped at its time limit")
                + ")"
            )
        objective = (
            f"objective {format_ms(self.objective_s)} ms, bound {format_ms(self.bound_s)} ms{gap}"
            if self.objective_s is not None and self.bound_s is not None
            else "no objective"
        )
        head = [
            f"encoder work in the LLM's bubbles for {self.request}: {self.chosen} "
            f"({self.encoder_parallel}), recompute {self.recompute}",
            f"simulated step {format_ms(self.step_s)} ms; phased (encoder forwards first, backwards last) "
            f"{format_ms(self.phased_step_s)} ms; the LLM alone {format_ms(self.llm_alone_step_s)} ms "
            f"(encoder overhead {self.encoder_overhead:.3f}x)",
            f"encoder compute hidden in bubbles: {100 * self.hidden_share:.0f} % of {format_ms(self.encoder_compute_s)} ms "
            f"(layer level {100 * self.layer_hidden_share:.0f} %, kernel level {100 * self.kernel_hidden_share:.0f} %"
            + (
                f": {format_ms(self.layer_level_step_s)} -> {format_ms(self.step_s)} ms"
                if self.layer_level_step_s is not None
                else ""
            )
            + ")",
            *(
                [
                    f"the LLM alone with the encoders' dependencies: {format_ms(self.dependency_bound.step_s)} ms "
                    f"({self.dependency_bound.step_s / self.llm_alone_step_s:.3f}x the LLM alone): "
                    f"{self.dependency_bound}"
                ]
                if self.dependency_bound is not None and self.llm_alone_step_s > 0
                else []
            ),
            *([self.delays_line()] if self.delays is not None else []),
            *(
                [
                    f"simulated, no schedule with each action on its rank here ends sooner than {self.placement_bound} "
                    f"({self.placement_bound.step_s / self.llm_alone_step_s:.3f}x the LLM alone)"
                ]
                if self.placement_bound is not None and self.llm_alone_step_s > 0
                else []
            ),
            f"CP-SAT {self.solver_status}: {objective}; pass wall time {self.wall_s:.1f} s",
            *self.notes,
            "",
            "encoder plans tried (simulated):",
            self.rows_table(),
            "",
            "idle per rank by cause, phased -> scheduled (simulated):",
            self.bubbles_table(),
        ]
        return "\n".join(head)


def candidate_encoder_plans(layer_graph: LayerGraph, request: PlanRequest) -> list[ep.EncoderPlan]:
    """Every encoder plan Optimus's planner enumerates for the request, at granularities from one
    action per encoder stage to about one per encoder layer (bounded by CP-SAT's size)."""
    llm, m = request.parallel, request.num_microbatches
    layers = ep.encoder_layer_count(layer_graph)
    out = []
    for pp in _divisors(llm.pp):
        for tp in _divisors(llm.tp):
            if request.microbatch_size % (llm.tp // tp):
                continue
            chunks = 1
            while pp * chunks <= layers:
                if chunks > 1 and 2 * chunks * pp * m > MAX_ENCODER_ACTIONS:
                    break
                out.append(ep.EncoderPlan(pp=pp, tp=tp, chunks=chunks))
                chunks *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def bubbles(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    solver: SolverOptions = SolverOptions(),
    encoder_plans: list[ep.EncoderPlan] | None = None,
    recompute: GlobalRecompute | None = None,
    memory_budget_bytes: float | None = None,
) -> PolicyResult:
    """The fastest simulated plan with the encoders on a plan of their own and their work in the
    LLM's bubbles (see the module docstring). Raises :class:`PlanError` for a model without an
    encoder (plan the LLM alone with the other policies) or when no encoder plan fits.

    Args:
        recompute: one global recompute setting; None: the least of :data:`~vlmcompile.planning.model_parts.RECOMPUTE_LADDER`
            that lets a plan fit.
        memory_budget_bytes: a per-rank peak to plan within, below the device's cap (e.g. the
            memory a baseline plan needs); None: the device's cap.
    """
    started = time.perf_counter()
    request.check_on(cluster)
    count = ep.encoder_layer_count(layer_graph)
    if count == 0:
        raise PlanError(
            "the model has no encoder layers before its LLM; there is no encoder work to place in bubbles - "
            "the LLM is planned alone by the other policies"
        )
    llm = request.parallel
    candidates = encoder_plans or candidate_encoder_plans(layer_graph, request)
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    if memory_budget_bytes is not None:
        if not 0 < memory_budget_bytes:
            raise PlanError(
                f"memory_budget_bytes={memory_budget_bytes!r}; give a positive number of bytes per rank"
            )
        cap = min(cap, memory_budget_bytes)
    errors: list[_NoneFits] = []
    inputs = _Inputs(
        layer_graph,
        cluster,
        request,
        tuple(candidates),
        model_parts(layer_graph),
        count,
        solver,
        started,
        cap,
    )

    def plan_at(rung: RecomputeRung) -> PolicyResult | None:
        try:
            return _plan_at(inputs, rung)
        except _NoneFits as err:
            errors.append(err)
            return None

    if recompute is not None:
        most = RecomputeRung(recompute)
        result = plan_at(most)
    else:
        most = HEAVIER_RUNGS[-1]
        result = _first(plan_at, LIGHTER_RUNGS) or _least_share(plan_at) or _first(plan_at, HEAVIER_RUNGS)
    if result is not None:
        return result
    within = "the memory budget" if memory_budget_bytes is not None else "memory"
    raise PlanError(
        f"no encoder plan fits in {within} ({cap / 2**30:.1f} GiB per rank) at {llm}, even with recompute "
        f"{most}: {errors[-1]}"
    )


class _NoneFits(Exception):
    pass


def _first(plan_at, rungs) -> PolicyResult | None:
    """The plan at the first of ``rungs`` that fits, if one does."""
    for rung in rungs:
        result = plan_at(rung)
        if result is not None:
            return result
    return None


def _least_share(plan_at) -> PolicyResult | None:
    """The plan at the least of :data:`PARTIAL_SHARES` that fits (bisection), if one does."""
    best, low, high = None, 0, len(PARTIAL_SHARES) - 1
    while low <= high:
        mid = (low + high) // 2
        result = plan_at(RecomputeRung(PARTIAL_BASE, PARTIAL_SHARES[mid]))
        if result is None:
            low = mid + 1
        else:
            best, high = result, mid - 1
    return best


@dataclass(slots=True)
class _Candidate:
    """An encoder plan with its phased plan, costs and problem, and its best schedule so far."""

    encoder: ep.EncoderPlan
    phased: Plan
    phased_sim: SimResult
    costs: PlanCosts
    problem: bs.BubbleProblem
    """The problem :attr:`plan` schedules (with run-ahead forwards, or the base problem)."""
    plan: Plan
    sim: SimResult
    cap: float
    """The per-rank memory the plan must fit in (the device's cap or a tighter budget)."""
    solution: bs.BubbleSolution | None = None
    base_problem: bs.BubbleProblem | None = None
    """The problem with no forward run ahead (set from :attr:`problem` at first)."""
    layer_level_s: float | None = None
    """The fastest layer-level schedule's step (the kernel level's starting point)."""

    def __post_init__(self):
        if self.base_problem is None:
            self.base_problem = self.problem

    def fits(self, sim: SimResult) -> bool:
        return sim.fits_within(self.cap)


@dataclass(frozen=True, slots=True)
class _Inputs:
    """What every recompute rung of one pass plans from."""

    layer_graph: LayerGraph
    cluster: Cluster
    request: PlanRequest
    candidates: tuple[ep.EncoderPlan, ...]
    parts: ModelParts
    count: int
    """Encoder layers at the start of the layer order."""
    solver: SolverOptions
    started: float
    cap: float
    """The per-rank memory a plan must fit in (the device's cap or a tighter budget)."""

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layer_graph.layers]


def _plan_at(inputs: _Inputs, rung: RecomputeRung) -> PolicyResult:
    """The pass at one recompute rung: the LLM cut, every encoder plan screened, the fastest
    refined and solved; raises :class:`_NoneFits` when no encoder plan fits."""
    llm_chunks, flags = _llm_cut(inputs, rung)
    rows, scored = _screen(inputs, llm_chunks, flags)
    fitting = sorted((c for c in scored if c.fits(c.sim)), key=lambda c: c.sim.step_time_s)
    if not fitting:
        raise _NoneFits(
            "; ".join(f"{r.encoder}: {r.verdict or 'over the memory cap'}" for r in rows.values())
        )
    _refine(inputs, fitting, rows)
    fitting.sort(key=lambda c: c.sim.step_time_s)
    _solve(inputs, fitting, rows)
    chosen = min(fitting, key=lambda c: c.sim.step_time_s)
    layer_level = chosen.layer_level_s if chosen.layer_level_s is not None else chosen.sim.step_time_s
    table = tuple(dataclasses.replace(r, verdict=r.verdict or _verdict(r, chosen)) for r in rows.values())
    return _result(inputs, rung, chosen, table, layer_level)


def _llm_cut(inputs: _Inputs, rung: RecomputeRung) -> tuple[list[list[str]], dict[str, Recompute]]:
    """The LLM's layers cut into PP x v stages balanced by time (appendix B's program on the LLM
    alone), and the rung's per-layer recompute flags for that cut."""
    llm, count = inputs.request.parallel, inputs.count
    llm_costs = layer_costs(
        inputs.layer_graph,
        inputs.cluster,
        llm,
        microbatch_size=inputs.request.microbatch_size,
        recompute=recompute_flags(inputs.layer_graph, inputs.parts, rung.base),
        precision=inputs.request.precision,
    )
    llm_chunks = chunks_of(
        inputs.names[count:], balanced_split([c.f_s + c.b_s for c in llm_costs[count:]], llm.pp * llm.v)
    )
    return llm_chunks, rung.flags(inputs.layer_graph, inputs.parts, llm_chunks, llm)


def _screen(
    inputs: _Inputs, llm_chunks: list[list[str]], flags: dict[str, Recompute]
) -> tuple[dict[ep.EncoderPlan, EncoderPlanRow], list[_Candidate]]:
    """Every encoder plan with one setting of each kind of the list scheduler: its row, and its
    candidate where it could be planned. A finer granularity is tried while it keeps helping: a
    step no faster than the coarser plan's stops the (pp, tp) pair's refinement (marked by an
    infinite step)."""
    rows: dict[ep.EncoderPlan, EncoderPlanRow] = {}
    scored: list[_Candidate] = []
    finest: dict[tuple[int, int], tuple[int, float]] = {}  # (pp, tp) -> (chunks, step) of the last tried
    for encoder in inputs.candidates:
        last = finest.get((encoder.pp, encoder.tp))
        if last is not None and last[0] < encoder.chunks and last[1] == float("inf"):
            rows[encoder] = EncoderPlanRow(
                encoder, "-", None, verdict=f"skipped: {last[0]} chunks per stage were no faster than fewer"
            )
            continue
        rows[encoder], best = _screen_one(inputs, encoder, llm_chunks, flags)
        if best is None:
            continue
        scored.append(best)
        step = best.sim.step_time_s if best.fits(best.sim) else float("inf")
        finest[(encoder.pp, encoder.tp)] = (
            encoder.chunks,
            float("inf") if last is not None and step >= last[1] else step,
        )
    return rows, scored


def _screen_one(
    inputs: _Inputs, encoder: ep.EncoderPlan, llm_chunks: list[list[str]], flags: dict[str, Recompute]
) -> tuple[EncoderPlanRow, _Candidate | None]:
    """One encoder plan: its phased plan (Optimus's initial schedule, a candidate too: the list
    scheduler's choices can lose to it where the encoder work is large against the bubbles) and
    the screen's list schedules, the fastest kept."""
    layer_graph, cluster, request, llm = (
        inputs.layer_graph,
        inputs.cluster,
        inputs.request,
        inputs.request.parallel,
    )
    try:
        encoder.check_against(llm, request.microbatch_size)
    except PlanError as err:
        return EncoderPlanRow(encoder, "-", None, verdict=f"cannot: {err}", applies=False), None
    enc_par = encoder.parallel(llm)
    degrees = f"{enc_par.dp}/{enc_par.tp}/{enc_par.pp}"
    try:
        enc_costs = layer_costs(
            layer_graph,
            cluster,
            enc_par,
            microbatch_size=request.microbatch_size,
            recompute=flags,
            precision=request.precision,
        )
        pieces = ep.encoder_chunks(layer_graph, encoder, [c.f_s + c.b_s for c in enc_costs[: inputs.count]])
        phased = build_separate_plan(
            layer_graph,
            cluster,
            request,
            encoder,
            policy="vlmcompile",
            encoder_pieces=pieces,
            llm_chunks=llm_chunks,
            recompute=flags,
            decisions=[],
        )
    except PlanError as err:
        return EncoderPlanRow(encoder, degrees, None, verdict=f"cannot: {err}", applies=False), None
    costs = plan_costs(phased, layer_graph, cluster)
    states = max(costs.static_bytes)
    if not fits([states], inputs.cap):
        verdict = f"pruned: model states {states / 2**30:.1f} GiB over the {inputs.cap / 2**30:.1f} GiB cap"
        return EncoderPlanRow(encoder, degrees, None, peak_gib=states / 2**30, verdict=verdict), None
    problem = bs.problem_from(phased, costs, inputs.cap)
    phased_sim = simulate(phased, layer_graph, cluster, costs=costs)
    best = _Candidate(encoder, phased, phased_sim, costs, problem, phased, phased_sim, inputs.cap)
    best.layer_level_s = phased_sim.step_time_s if best.fits(phased_sim) else None
    kernel = bs.SCREEN_KERNEL if llm.tp > 1 else ()
    _improve(
        best, layer_graph, cluster, bs.SCREEN_LAYER, kernel, run_ahead=inputs.solver.run_ahead, screen=True
    )
    row = EncoderPlanRow(
        encoder,
        degrees,
        best.sim.step_time_s,
        peak_gib=max(best.sim.peak_mem_bytes) / 2**30,
        fits=best.fits(best.sim),
    )
    return row, best


def _refine(inputs: _Inputs, fitting: list[_Candidate], rows: dict[ep.EncoderPlan, EncoderPlanRow]) -> None:
    """The screen ran one setting of each kind per encoder plan; the fastest few get every one,
    one plan per core."""
    if inputs.request.parallel.tp > 1:
        layer, kernel = bs.GREEDY_SETTINGS[-1:], _unscreened(bs.KERNEL_SETTINGS, bs.SCREEN_KERNEL)
    else:
        layer, kernel = _unscreened(bs.GREEDY_SETTINGS, bs.SCREEN_LAYER), ()

    def improved(cand: _Candidate) -> tuple:
        _improve(
            cand,
            inputs.layer_graph,
            inputs.cluster,
            layer,
            kernel,
            run_ahead=inputs.solver.run_ahead,
            screen=False,
        )
        return cand.plan, cand.sim, cand.problem, cand.layer_level_s

    chosen = fitting[:REFINED_PLANS]
    for cand, outcome in zip(chosen, forked_map(improved, chosen, inputs.solver.num_workers)):
        cand.plan, cand.sim, cand.problem, cand.layer_level_s = outcome.answer
        rows[cand.encoder] = dataclasses.replace(
            rows[cand.encoder],
            greedy_step_s=cand.sim.step_time_s,
            peak_gib=max(cand.sim.peak_mem_bytes) / 2**30,
        )


def _solve(inputs: _Inputs, fitting: list[_Candidate], rows: dict[ep.EncoderPlan, EncoderPlanRow]) -> None:
    """CP-SAT schedules the fastest plans (layer-level work only: where the LLM has TP gaps the
    list scheduler's kernel-level schedules beat its on every Optimus setup, so it solves the
    fastest plan alone); a faster schedule that fits replaces the candidate's."""
    solver, tp = inputs.solver, inputs.request.parallel.tp
    for cand in fitting[: SOLVED_PLANS if tp == 1 else 1]:
        solution = bs.solve_schedule(
            cand.problem,
            time_limit_s=solver.time_limit_s / SOLVED_PLANS,
            num_workers=solver.num_workers,
            hint=cand.plan.actions,
        )
        plan = scheduled_plan(cand.phased, cand.problem, solution.actions, {})
        plan.validate(inputs.layer_graph)
        sim = simulate(plan, inputs.layer_graph, inputs.cluster, costs=cand.costs)
        rows[cand.encoder] = dataclasses.replace(rows[cand.encoder], solved_step_s=sim.step_time_s)
        if cand.fits(sim):
            cand.layer_level_s = min(cand.layer_level_s or sim.step_time_s, sim.step_time_s)
        if cand.fits(sim) and sim.step_time_s < cand.sim.step_time_s:
            cand.plan, cand.sim = plan, sim
        cand.solution = solution


def _result(inputs: _Inputs, rung: RecomputeRung, chosen: _Candidate, rows, layer_level_s) -> PolicyResult:
    layer_graph, cluster, request = inputs.layer_graph, inputs.cluster, inputs.request
    plan, sim, solution = chosen.plan, chosen.sim, chosen.solution
    phased_sim = chosen.phased_sim
    # The bound: the LLM alone, on our plan's LLM stages or balanced anew, whichever is faster.
    own, balanced = llm_stages_of(plan), llm_alone_plan(plan, layer_graph, cluster)
    own_sim = simulate(own, layer_graph, cluster)
    alone_s = min(own_sim.step_time_s, llm_alone_step_s(plan, layer_graph, cluster, alone=balanced))
    llm_stages = range(chosen.problem.first_llm_stage, plan.num_stages)
    delays = encoder_delays(sim, llm_stages, own_sim)
    bound = min((dependency_bound(p, layer_graph, cluster) for p in (own, balanced)), key=lambda b: b.step_s)
    encoder_stages = chosen.costs.stages[: chosen.problem.encoder_stages]
    encoder_compute = plan.num_microbatches * sum(
        c.action_s(kind) - c.tp_comm_s(kind) for c in encoder_stages for kind in (bs.F, bs.B)
    )
    # Rider compute inside the hosts' TP gaps (what lengthened a host is not hidden).
    kernel_compute = sum(
        min(r.rider_compute_s, chosen.costs.stages[r.action.stage].tp_comm_s(r.action.kind))
        for r in sim.runs
        if r.rider_compute_s
    )
    solved = solution is not None and solution.status.split()[0] in ("OPTIMAL", "FEASIBLE")
    used = (
        "the phased schedule"
        if plan.actions == chosen.phased.actions
        else "CP-SAT"
        if solved and plan.actions == solution.actions
        else "the list scheduler"
    )
    decisions = _decisions(request, chosen, plan, sim, rows, used, layer_level_s)
    unit = chosen.problem.unit_s
    report = BubbleReport(
        request=request,
        recompute=str(rung),
        rows=rows,
        chosen=chosen.encoder,
        encoder_parallel=plan.parallel[ep.ENCODER_GROUP],
        phased_step_s=phased_sim.step_time_s,
        step_s=sim.step_time_s,
        llm_alone_step_s=alone_s,
        encoder_compute_s=encoder_compute,
        bubbles_before=tuple(dict(r.idle_s) for r in phased_sim.ranks),
        bubbles_after=tuple(dict(r.idle_s) for r in sim.ranks),
        solver_status=solution.status if solution is not None else "not run",
        objective_s=solution.objective * unit if solution is not None else None,
        bound_s=solution.bound * unit if solution is not None else None,
        gap=solution.gap if solution is not None else None,
        wall_s=time.perf_counter() - inputs.started,
        notes=(f"schedule used: {used}",),
        layer_hidden_share=_share(_layer_level_hidden_s(plan, sim, chosen.costs), encoder_compute),
        kernel_hidden_share=_share(kernel_compute, encoder_compute),
        layer_level_step_s=layer_level_s if plan.kernel_level else None,
        dependency_bound=bound,
        delays=delays,
        own_llm_alone_step_s=own_sim.step_time_s,
        placement_bound=placement_bound(plan, sim, llm_stages, own_sim, transfer_of(chosen.costs.stages)),
    )
    return PolicyResult(plan=plan, sim=sim, report=report, recompute=str(rung)).with_decisions(*decisions)


def _decisions(
    request, chosen: _Candidate, plan: Plan, sim: SimResult, rows, used: str, layer_level_s
) -> list:
    """What the pass decided, with its reasons: the encoder plan, the schedule, any run-ahead and
    kernel-level work."""
    phased_sim = chosen.phased_sim
    decisions = [
        Decision(
            "encoder plan",
            Reason.SEPARATE_ENCODER_PLAN,
            f"{chosen.encoder} ({plan.parallel[ep.ENCODER_GROUP]}) beside the LLM's {request.parallel}: the "
            f"fastest of {len(rows)} encoder plans tried (simulated {format_ms(sim.step_time_s)} ms)",
            {"step_s": sim.step_time_s},
        ),
        Decision(
            "schedule",
            Reason.BUBBLE_SCHEDULE,
            f"{used}: encoder work placed around the LLM's {request.schedule_name.value} order "
            f"(phased {format_ms(phased_sim.step_time_s)} ms -> {format_ms(sim.step_time_s)} ms simulated)",
            {"phased_step_s": phased_sim.step_time_s, "step_s": sim.step_time_s},
        ),
    ]
    if plan.ahead:
        microbatches = sorted({a.microbatch for a in plan.ahead})
        decisions.append(
            Decision(
                "run ahead",
                Reason.RUN_AHEAD,
                f"the frozen encoder's forwards of microbatches {microbatches} run one global batch ahead, in "
                f"the step before's bubbles: the LLM's first forwards wait for no encoder (outputs held "
                f"across the step boundary are counted in memory)",
                {"microbatches": float(len(microbatches)), "step_s": sim.step_time_s},
            )
        )
    if plan.kernel_level:
        decisions.append(
            Decision(
                "kernel level",
                Reason.BUBBLE_SCHEDULE,
                f"{len(plan.kernel_level)} encoder actions run inside LLM actions' TP gaps "
                f"({format_ms(layer_level_s)} -> {format_ms(sim.step_time_s)} ms simulated)",
                {"layer_level_step_s": layer_level_s, "step_s": sim.step_time_s},
            )
        )
    return decisions


def _improve(
    cand: _Candidate, layer_graph, cluster, layer_settings, kernel_settings, *, run_ahead: bool, screen: bool
) -> None:
    """Keep in ``cand`` the fastest of its schedule and the list scheduler's with these settings:
    the layer-level ones ranked by the problem's own timeline (the simulator's rules less the DP
    collectives) and only the best simulated, as simulating every one costs most of the pass's
    time at paper scale; the kernel-level ones (encoder work in the LLM's TP gaps, Optimus design
    decision 3) simulated each. A frozen encoder is scheduled with its forwards run one batch ahead
    too (:func:`ahead_problem`)."""
    problems = _problems(cand, cluster.ranks_on_this_machine, run_ahead=run_ahead, screen=screen)
    for problem in problems:
        _schedule_by(cand, problem, layer_graph, cluster, layer_settings, kernel_settings)
    if not cand.fits(cand.sim) and all(p is not cand.base_problem for p in problems):
        # The outputs held across the step may not fit where a schedule without them does.
        _schedule_by(cand, cand.base_problem, layer_graph, cluster, layer_settings, kernel_settings)


def _schedule_by(cand: _Candidate, problem, layer_graph, cluster, layer_settings, kernel_settings) -> None:
    """The list scheduler's schedules of ``problem`` with these settings, the fastest kept in ``cand``."""
    layer_schedules = [
        bs.greedy(problem, lookahead=lookahead, fill_only=fill_only)
        for lookahead, fill_only in layer_settings
    ]
    schedules = []
    if len(layer_schedules) == 1:  # nothing to rank
        schedules.append((layer_schedules[0], {}))
    elif layer_schedules:
        schedules.append(
            (min(layer_schedules, key=lambda acts: _rank_key(bs.evaluate_schedule(problem, acts))), {})
        )
    for lookahead, fill_only, end_room in kernel_settings:
        riders: dict = {}
        actions = bs.greedy(
            problem, lookahead=lookahead, fill_only=fill_only, riders=riders, end_room=end_room
        )
        schedules.append((actions, riders))
    for actions, kernel_level in schedules:
        plan = scheduled_plan(cand.phased, problem, actions, kernel_level)
        sim = simulate(plan, layer_graph, cluster, costs=cand.costs)
        if not kernel_level and cand.fits(sim):
            cand.layer_level_s = min(cand.layer_level_s or sim.step_time_s, sim.step_time_s)
        if (not cand.fits(sim), sim.step_time_s) < (not cand.fits(cand.sim), cand.sim.step_time_s):
            cand.plan, cand.sim, cand.problem = plan, sim, problem


def _problems(
    cand: _Candidate, local_ranks: bool, *, run_ahead: bool, screen: bool
) -> list[bs.BubbleProblem]:
    """The problems to schedule a candidate by: where the encoder's forwards may run ahead, with
    them all ahead (:func:`ahead_problem`), and in the refinement also with none ahead where that
    never beat the phased schedule (running ahead lifts constraints, but holds outputs)."""
    ahead = ahead_problem(cand.base_problem, local_ranks) if run_ahead else None
    if ahead is None:
        return [cand.base_problem]
    return [ahead] + ([] if screen or cand.problem.ahead else [cand.base_problem])


def ahead_problem(problem: bs.BubbleProblem, local_ranks: bool) -> bs.BubbleProblem | None:
    """Where no gradient reaches the encoder, ``problem`` with every microbatch's encoder forwards
    run one global batch ahead, in the step before's bubbles (the LLM's forwards then wait for no
    encoder); else None. On ranks this machine runs, only where each encoder pipeline lies on one
    rank (the runtime runs a run-ahead chain on one rank). Running the first 1 or PP microbatches
    ahead instead was no faster on Optimus' weak-C, strong-2048 and single-node setups, frozen
    (simulated, 2026-11-26)."""
    frozen = set(range(problem.encoder_stages)) <= problem.forward_only
    one_rank = len({problem.stages[s].ranks for s in range(problem.encoder_stages)}) == 1
    if not frozen or (local_ranks and not one_rank):
        return None
    return dataclasses.replace(problem, ahead=frozenset(range(problem.num_microbatches)))


def scheduled_plan(phased: Plan, problem: bs.BubbleProblem, actions, kernel_level) -> Plan:
    """``phased`` running a schedule of ``problem`` (its run-ahead forwards included)."""
    return dataclasses.replace(
        phased,
        actions=actions,
        kernel_level=kernel_level,
        run_ahead=1 if problem.ahead else 0,
        ahead=problem.ahead_actions,
    )


def _layer_level_hidden_s(plan: Plan, sim: SimResult, costs: PlanCosts) -> float:
    """Encoder compute run at layer level while its rank's next LLM action could not start yet for
    want of the LLM's own inputs (another LLM stage's output), or after the rank's last LLM action
    while another rank still ran the LLM: the part of the encoder's work that sat in pipeline
    bubbles. What the LLM waited for from the encoder does not count as hidden."""
    llm = plan.stages[-1].group
    end = {r.action: (r.end_s, r.rank) for r in sim.runs}
    runs_of: dict[int, list] = {}
    for run in sim.runs:
        if run.inside is None:
            runs_of.setdefault(run.rank, []).append(run)
    llm_end = max(r.end_s for r in sim.runs if plan.stages[r.action.stage].group == llm)

    transfer = transfer_of(costs.stages)

    def llm_inputs_at(run) -> float:
        return max(
            (
                end[d][0] + (transfer(d, run.action) if end[d][1] != run.rank else 0.0)
                for d in dependencies(run.action, plan.num_stages)
                if plan.stages[d.stage].group == llm
            ),
            default=0.0,
        )

    hidden = 0.0
    for runs in runs_of.values():
        could_start = llm_end  # when the rank's next LLM action had its LLM inputs (walking back)
        for run in sorted(runs, key=lambda r: r.start_s, reverse=True):
            if plan.stages[run.action.stage].group == llm:
                could_start = llm_inputs_at(run)
                continue
            span = run.end_s - run.start_s
            if span > 0:
                hidden += run.compute_s * max(0.0, min(run.end_s, could_start) - run.start_s) / span
    return hidden


def _unscreened(settings, screened):
    """The settings the screen has not run already."""
    return tuple(x for x in settings if x not in screened)


def _share(part: float, whole: float) -> float:
    return min(1.0, part / whole) if whole > 0 else 0.0


def _rank_key(evaluation: bs.ScheduleEvaluation) -> tuple[bool, int]:
    return (not evaluation.fits, evaluation.step)


def _verdict(row: EncoderPlanRow, chosen: _Candidate) -> str:
    if row.encoder == chosen.encoder:
        return "chosen"
    if not row.fits:
        return "does not fit in memory"
    step = row.step_s
    if step is None:
        return "-"
    if math.isclose(step, chosen.sim.step_time_s, rel_tol=1e-9):
        return "as fast (a tie: the first found is kept)"
    return f"slower: +{format_ms(step - chosen.sim.step_time_s)} ms"
