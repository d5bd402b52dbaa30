"""The planning policies as data (:data:`POLICIES`, one :class:`~vlmcompile.planning.policy.Policy`
each), and how to run one, compare them, or search the degrees.

For the policies with one recompute setting for the whole model (Megatron's, torchtitan's, MIMO's)
``recompute="auto"`` does what their users do - the least global recompute whose plan fits in
memory (none, then selective, then full, then full with the vision encoder too). ``omnibal``
and ours choose recompute themselves. ``vlmcompile`` (:func:`vlmcompile`) is ours whole: it
plans every baseline for the same request (the fastest that fits is its partition's warm start,
and all are rows of its report), then the stage-cut partition, then the encoder-in-bubbles pass;
``partition`` is its first pass (with the baselines), ``bubbles`` its second alone. Every policy is held to the same memory
cap: device memory less :data:`~vlmcompile.cost_models.memory.MEMORY_RESERVE`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import fits, usable_memory_bytes
from vlmcompile.cost_models.stage_costs import plan_costs
from vlmcompile.ir.errors import ArgumentError, PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.meta_keys import PROFILE_SPREAD_META
from vlmcompile.ir.plan import Decision, Plan, Reason
from vlmcompile.passes.baselines.megatron import EncoderPlacement, megatron, megatron_layout_plan
from vlmcompile.passes.baselines.megatron_balanced import balanced_plan, megatron_balanced
from vlmcompile.passes.baselines.mimo_colocated import mimo_colocated
from vlmcompile.passes.baselines.omnibal import omnibal
from vlmcompile.passes.baselines.torchtitan_vlm import torchtitan_vlm
from vlmcompile.passes.planning.bubbles import bubbles
from vlmcompile.passes.planning.partition import partition
from vlmcompile.passes.planning.plan_search import plan_search
from vlmcompile.planning.candidate_bound import candidate_bound
from vlmcompile.planning.forked import forked_map
from vlmcompile.planning.megatron_layout import megatron_result
from vlmcompile.planning.model_parts import GLOBAL_LADDER
from vlmcompile.planning.policy import Policy
from vlmcompile.planning.request import (
    GlobalRecompute,
    NotApplicable,
    PlanRequest,
    SearchSpace,
    SolverOptions,
)
from vlmcompile.planning.result import PolicyResult, PolicyRow, Reports
from vlmcompile.sim.simulator import peak_memory_bytes
from vlmcompile.sim.units import format_ms


def stage_cuts(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    solver: SolverOptions = SolverOptions(),
) -> PolicyResult:
    """Our one-chain plan for ``request``: every baseline planned first (the rows of its
    comparison), then the stage-cut partition warm-started from the fastest that fits (so it is
    never slower, simulated, than a baseline at this request)."""
    runs, rows = compare_baselines(layer_graph, cluster, request)
    warm = fastest_baseline(runs, request)
    result = partition(layer_graph, cluster, request, solver=solver, warm_start=warm.plan if warm else None)
    return dataclasses.replace(result, baselines=mark_same_plans(rows, runs, result.plan))


def mark_same_plans(
    rows: Iterable[PolicyRow], runs: Iterable[PolicyResult], ours: Plan
) -> tuple[PolicyRow, ...]:
    """The baselines' rows, those whose plan is ``ours`` under its own name marked so (a reader
    learns that our policy found nothing better than theirs)."""
    same = {r.plan.policy for r in runs if ours.same_layout(r.plan)}
    return tuple(dataclasses.replace(row, same_as_ours=row.policy in same) for row in rows)


def vlmcompile(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    solver: SolverOptions = SolverOptions(),
) -> PolicyResult:
    """Our plan for ``request``: :func:`stage_cuts`, then the encoder-in-bubbles plan where it is
    faster (:func:`with_encoder_in_bubbles`), the baselines its comparison's rows."""
    chain = stage_cuts(layer_graph, cluster, request, solver=solver)
    best = with_encoder_in_bubbles(chain, layer_graph, cluster, request, solver)
    rows = chain.baselines
    if best.sim.step_time_s != chain.sim.step_time_s:  # encoders on a plan of their own: no baseline's
        rows = tuple(dataclasses.replace(r, same_as_ours=False) for r in rows)
    return dataclasses.replace(best, baselines=rows)


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy(
            "megatron",
            megatron,
            "Megatron-LM: the encoder with the first stage (llava) or in one chain with the decoder (chain), "
            "layers split evenly; the faster of the two in comparisons",
            options=("recompute", "placement", "first_stage_layers", "last_stage_layers"),
            baseline=True,
            global_recompute=True,
            variants=({"placement": EncoderPlacement.LLAVA}, {"placement": EncoderPlacement.CHAIN}),
            plan_only=megatron_layout_plan,
            finish=megatron_result,
        ),
        Policy(
            "megatron_balanced",
            megatron_balanced,
            "Megatron-LM with the layers balanced by time (the Optimus appendix B)",
            options=("recompute",),
            baseline=True,
            global_recompute=True,
            plan_only=balanced_plan,
            finish=megatron_result,
        ),
        Policy(
            "omnibal", omnibal, "OmniBal: balanced stage cuts, adaptive per-layer recompute", baseline=True
        ),
        Policy(
            "torchtitan_vlm",
            torchtitan_vlm,
            "torchtitan's pipeline_vlm: the encoder on stage 0, first_stage_less_layers tuned",
            options=("recompute",),
            baseline=True,
            global_recompute=True,
        ),
        Policy(
            "mimo_colocated",
            mimo_colocated,
            "Megatron MIMO's colocated layout: every module on every rank, no pipeline",
            options=("recompute",),
            baseline=True,
            global_recompute=True,
        ),
        Policy(
            "partition",
            stage_cuts,
            "ours, one chain: stage cuts and per-layer recompute chosen together by CP-SAT, started from the "
            "fastest baseline",
            options=("solver",),
        ),
        Policy(
            "bubbles",
            bubbles,
            "ours, the encoders on a plan of their own and their work in the LLM's bubbles",
            options=("solver",),
        ),
        Policy(
            "vlmcompile",
            vlmcompile,
            "ours: the faster of partition and bubbles, the partition started from the fastest baseline",
            options=("solver",),
        ),
    )
}
"""Every policy by name; a comparison plans the ``baseline`` ones beside ours."""
BASELINES = tuple(name for name, p in POLICIES.items() if p.baseline)
SOLVED_CANDIDATES = 2
"""Screened candidates a plan search partitions (and solves again with the timeline model): on
the Optimus setups at v > 1, 3 s of CP-SAT returned the screen's plan unchanged (UNKNOWN)."""


def plan_and_simulate(
    layer_graph: LayerGraph,
    cluster: Cluster,
    policy: str,
    request: PlanRequest,
    *,
    recompute: GlobalRecompute | Literal["auto"] = "auto",
    placement: EncoderPlacement | str | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    solver: SolverOptions | None = None,
) -> PolicyResult:
    """``policy``'s plan for ``request``, simulated.

    Args:
        recompute: a global recompute (the policies with ``global_recompute``), or "auto": the
            least that fits.
        placement: where ``megatron`` puts the encoder (:class:`EncoderPlacement`); None:
            ``uneven`` when first/last stage counts are given, else ``llava``.
        first_stage_layers, last_stage_layers: Megatron's decoder layers on the first and last
            pipeline stage (``--decoder-first/last-pipeline-num-layers``).
        solver: CP-SAT's limits (``partition``, ``bubbles``, ``vlmcompile``).

    Raises:
        ArgumentError: an unknown policy, or an option the policy does not take.
    """
    if policy not in POLICIES:
        raise ArgumentError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    chosen = POLICIES[policy]
    given = {
        name: value
        for name, value in (
            ("recompute", None if recompute == "auto" else recompute),
            ("placement", placement),
            ("first_stage_layers", first_stage_layers),
            ("last_stage_layers", last_stage_layers),
            ("solver", solver),
        )
        if value is not None
    }
    wrong = [name for name in given if name not in chosen.options]
    if wrong:
        raise ArgumentError(
            f"policy {policy!r} does not take {', '.join(wrong)}"
            + (" (it chooses recompute per layer)" if "recompute" in wrong else "")
        )
    if not chosen.global_recompute or "recompute" in given:
        return chosen.run(layer_graph, cluster, request, **given)
    run = functools.partial(chosen.run, layer_graph, cluster, request, **given)
    if chosen.plan_only is None:
        return _least_recompute_that_fits(
            lambda rung: run(recompute=rung), usable_memory_bytes(cluster.device.mem_bytes)
        )

    costs = {}  # the chosen setting's plan is timed with the costs its memory was read with

    def planned(rung: GlobalRecompute) -> tuple[Plan, list[float]]:
        plan = chosen.plan_only(layer_graph, cluster, request, recompute=rung, **given)
        costs[rung] = plan_costs(plan, layer_graph, cluster)
        return plan, peak_memory_bytes(plan, layer_graph, cluster, costs=costs[rung])

    return _least_recompute_that_fits(
        lambda rung, plan: chosen.finish(layer_graph, cluster, plan, rung, costs=costs[rung]),
        usable_memory_bytes(cluster.device.mem_bytes),
        planned,
    )


def _least_recompute_that_fits(
    run: Callable[..., PolicyResult],
    cap: float,
    planned: Callable[[GlobalRecompute], tuple[Plan, list[float]]] | None = None,
) -> PolicyResult:
    """The first setting of :data:`GLOBAL_LADDER` whose plan fits (else the last), simulated:
    ``run(rung)``; with ``planned`` (a setting's plan and its peak memory per rank, not timed)
    only the setting chosen is timed, ``run(rung, plan)`` finishing its plan."""
    tried = []
    for k, rung in enumerate(GLOBAL_LADDER):
        if planned is None:
            result = run(rung)
        else:
            plan, held = planned(rung)
            if not fits(held, cap) and k + 1 < len(GLOBAL_LADDER):
                tried.append(f"{rung}: {max(held) / 2**30:.1f} GiB")
                continue
            result = run(rung, plan)
        tried.append(f"{rung}: {max(result.sim.peak_mem_bytes) / 2**30:.1f} GiB")
        if result.fits:
            break
    verdict = (
        "fits" if result.fits else f"does not fit even with the most recompute (cap {cap / 2**30:.1f} GiB)"
    )
    return result.with_decisions(
        Decision(
            "recompute",
            Reason.GLOBAL_RECOMPUTE,
            f"auto: least recompute that fits; tried {'; '.join(tried)}; {verdict}",
        )
    )


def with_encoder_in_bubbles(
    result: PolicyResult,
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    solver: SolverOptions,
    *,
    also: Iterable[PlanRequest] = (),
) -> PolicyResult:
    """The faster of ``result`` (one chain of stage cuts) and the encoder-in-bubbles plan for the
    same request (:func:`~vlmcompile.passes.planning.bubbles.bubbles`), the other's step in a decision;
    ``also``: other requests the encoder-in-bubbles pass may take instead (another v)."""
    tried, errors, todo = [], [], []
    for req in (request, *also):
        # an encoder-in-bubbles plan at ``req`` that cannot beat the plan in hand is not made
        bound = candidate_bound(layer_graph, cluster, req).bubbles
        if req != request and result.fits and bound is not None and bound.step_s >= result.sim.step_time_s:
            errors.append(
                f"{req}: no encoder-in-bubbles plan there can beat {format_ms(bound.step_s)} ms ({bound.binding})"
            )
        else:
            todo.append(req)
    # one request per core: each pass is Python from its screen to its list schedules
    made = forked_map(
        lambda req: bubbles(layer_graph, cluster, req, solver=solver), todo, solver.num_workers, (PlanError,)
    )
    for req, outcome in zip(todo, made):
        if outcome.error is None:
            tried.append(outcome.answer)
        else:
            errors.append(f"{req}: {outcome.error}")
    if not tried:
        said = Decision(
            "encoder plan", Reason.SEPARATE_ENCODER_PLAN, f"no encoder-in-bubbles plan: {'; '.join(errors)}"
        )
        return result.with_decisions(said)
    other = min(tried, key=lambda r: (not r.fits, r.sim.step_time_s))
    ours, theirs = result.sim.step_time_s, other.sim.step_time_s
    if other.fits and (not result.fits or theirs < ours):
        said = Decision(
            "plan",
            Reason.SEPARATE_ENCODER_PLAN,
            f"the encoder-in-bubbles plan ({format_ms(theirs)} ms simulated) beats the best single chain of stage "
            f"cuts ({format_ms(ours)} ms)",
            {"chain_step_s": ours, "step_s": theirs},
        )
        return other.with_decisions(said, report=Reports((result.report, other.report)))
    said = Decision(
        "plan",
        Reason.SEPARATE_ENCODER_PLAN,
        f"the encoder-in-bubbles plan ({format_ms(theirs)} ms simulated"
        + ("" if other.fits else ", over the memory cap")
        + f") does not beat this chain of stage cuts ({format_ms(ours)} ms)",
        {"bubbles_step_s": theirs, "step_s": ours},
    )
    return result.with_decisions(said)


def compare_baselines(
    layer_graph: LayerGraph, cluster: Cluster, request: PlanRequest
) -> tuple[list[PolicyResult], tuple[PolicyRow, ...]]:
    """Every baseline for ``request``; a policy that cannot plan it gets a row saying why in full
    ("n/a" where its layout cannot express the request: :class:`NotApplicable`). ``megatron`` is
    its best even placement (``llava`` or ``chain``): the faster plan that fits, as its users
    would pick."""
    runs, rows = [], []
    for policy in BASELINES:
        variants = POLICIES[policy].variants
        tried, errors, applies = [], [], False
        for options in variants:
            said = ", ".join(f"{k} {getattr(v, 'value', v)}" for k, v in options.items())
            try:
                tried.append((said, plan_and_simulate(layer_graph, cluster, policy, request, **options)))
            except PlanError as err:
                applies = applies or not isinstance(err, NotApplicable)
                errors.append(f"{said.split(' ', 1)[-1]}: {err}" if said else str(err))
        if not tried:
            rows.append(PolicyRow(policy, None, False, "-", "; ".join(errors), applies=applies))
            continue
        said, run = min(tried, key=lambda sr: (not sr[1].fits, sr[1].sim.step_time_s))
        runs.append(run)
        rows.append(
            PolicyRow(policy, run.sim.step_time_s, run.fits, run.recompute, said if len(variants) > 1 else "")
        )
    return runs, tuple(rows)


def fastest_baseline(runs: Iterable[PolicyResult], request: PlanRequest) -> PolicyResult | None:
    """The fastest of ``runs`` that fits with ``request``'s pp x v stages (a plan our partition
    can start from and keep), or None."""
    stages = request.parallel.pp * request.parallel.v
    fitting = [r for r in runs if r.fits and r.plan.num_stages == stages]
    return min(fitting, key=lambda r: r.sim.step_time_s) if fitting else None


def baseline_to_beat(
    layer_graph: LayerGraph, cluster: Cluster, request: PlanRequest, planned: dict | None = None
) -> Plan | None:
    """The plan of the fastest baseline that fits at ``request`` (:func:`fastest_baseline`), for the
    plan search to start that candidate from; None where none does. ``planned``: the baselines
    already planned per request (:func:`baselines_at`), filled in here."""
    best = fastest_baseline(baselines_at(layer_graph, cluster, request, planned)[0], request)
    return best.plan if best is not None else None


def baselines_at(
    layer_graph: LayerGraph, cluster: Cluster, request: PlanRequest, planned: dict | None = None
) -> tuple[list[PolicyResult], tuple[PolicyRow, ...]]:
    """:func:`compare_baselines` at ``request``, planned once per request where ``planned`` keeps them."""
    if planned is None:
        return compare_baselines(layer_graph, cluster, request)
    if request not in planned:
        planned[request] = compare_baselines(layer_graph, cluster, request)
    return planned[request]


def _request_of(plan: Plan, global_batch: int) -> PlanRequest:
    """The request ``plan`` answers, at ``global_batch``."""
    return PlanRequest(
        parallel=plan.pipeline_parallel,
        global_batch=global_batch,
        microbatch_size=plan.microbatch_size,
        precision=plan.precision,
    )


def search_and_compare(
    layer_graph: LayerGraph,
    cluster: Cluster,
    *,
    global_batch: int,
    space: SearchSpace = SearchSpace(),
    solver: SolverOptions = SolverOptions(time_limit_s=3.0),
    include: Iterable[PlanRequest] = (),
    warm_starts: Mapping[PlanRequest, Plan] | None = None,
    progress: bool = True,
) -> PolicyResult:
    """The plan search's best plan (its report the search's), with every baseline planned for the
    request it chose; ``include`` and ``warm_starts`` as for
    :func:`~vlmcompile.passes.planning.plan_search.plan_search`.

    Every candidate the bounds leave is screened with ``megatron_balanced`` (the layers balanced by
    time, the least recompute that fits); the fastest few are partitioned, each from the fastest
    baseline at its degrees, so the plan returned is never slower (simulated) than a baseline at
    the request it is made for. Each request's baselines are planned once."""
    planned: dict[PlanRequest, tuple[list[PolicyResult], tuple[PolicyRow, ...]]] = {}
    result = plan_search(
        layer_graph,
        cluster,
        global_batch=global_batch,
        space=space,
        solver=solver,
        include=include,
        warm_starts=warm_starts,
        baseline=functools.partial(baseline_to_beat, layer_graph, cluster, planned=planned),
        screen=functools.partial(plan_and_simulate, layer_graph, cluster, "megatron_balanced"),
        solve_top=SOLVED_CANDIDATES,
        polish=SOLVED_CANDIDATES,
        progress=progress,
    )
    plan = result.plan
    # The batch the chosen candidate runs (packed microbatches round it up to its degrees).
    global_batch = plan.global_batch
    request = _request_of(plan, global_batch)
    searched, chain_s = result.report, result.sim.step_time_s
    # The bubbles fill best where the pipeline leaves the most: v = 1 is tried beside the v chosen.
    others = [request.with_degrees(v=1)] if request.parallel.v > 1 else []
    result = with_encoder_in_bubbles(result, layer_graph, cluster, request, solver, also=others)
    how = "the encoder-in-bubbles plan" if result.sim.step_time_s != chain_s else None
    plan = result.plan
    request = _request_of(plan, global_batch)
    runs, rows = baselines_at(layer_graph, cluster, request, planned)
    faster = fastest_baseline(runs, request)
    later: tuple = ()
    if faster is not None and faster.sim.step_time_s < result.sim.step_time_s:
        # Only where the search did not partition this request itself (the encoder-in-bubbles plan
        # took a v the search space left out, or the search's partition failed there).
        result = partition(layer_graph, cluster, request, solver=solver, warm_start=faster.plan)
        plan, later = result.plan, (result.report,)
        how = f"a partition warm-started from {faster.plan.policy}'s plan"
    if how is not None:  # the search's table says which plan came back, and why it is another
        searched = dataclasses.replace(
            searched, returned=(f"{how} at {plan.pipeline_parallel}", result.sim.step_time_s)
        )
    rows = mark_same_plans(rows, runs, plan)
    said = Decision(
        "parallel degrees",
        Reason.PLAN_SEARCH,
        f"{plan.pipeline_parallel}, microbatch {plan.microbatch_size}: fastest simulated of "
        f"{len(searched.candidates)} candidates",
    )
    tie = noise_tie(searched, result, layer_graph.meta.get(PROFILE_SPREAD_META), cluster)
    said = (said, tie) if tie is not None else (said,)
    # The search's report first, then the passes after it (the encoder-in-bubbles pass's).
    later = later or (result.report.parts[1:] if isinstance(result.report, Reports) else ())
    report = Reports((searched, *later)) if later else searched
    return dataclasses.replace(result.with_decisions(*said, report=report), baselines=rows)


def noise_tie(searched, result: PolicyResult, spread: float | None, cluster: Cluster) -> Decision | None:
    """Where the layer times were measured here (the profile pass), a decision naming the runner-up
    at other degrees when the plan chosen beats it by less than the profile's spread: which of the
    two is faster then depends on the machine's load while it was profiled, not on the plans."""
    if not spread:
        return None
    other = searched.runner_up(result.plan.pipeline_parallel, usable_memory_bytes(cluster.device.mem_bytes))
    ours = result.sim.step_time_s
    if other is None or (other.step_s - ours) / ours >= spread:
        return None
    return Decision(
        "parallel degrees",
        Reason.PLAN_SEARCH,
        f"within the noise: {result.plan.pipeline_parallel} ({format_ms(ours)} ms simulated) and "
        f"{other.request.parallel} ({format_ms(other.step_s)} ms) differ by {100 * (other.step_s - ours) / ours:.1f} %, "
        f"less than the {100 * spread:.0f} % the profile's rounds spread over: on this machine at another "
        "load either may be the faster; measure both to choose",
        {"runner_up": str(other.request.parallel), "runner_up_step_s": other.step_s, "spread": spread},
    )
