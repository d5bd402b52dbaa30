"""The bound on what an encoder may cost: the same LLM without its encoders, at a plan's degrees.

Encoder work only adds to the LLM's: no plan of the VLM at given degrees (DP, TP, PP, v,
microbatches, schedule, recompute) can beat the LLM alone at them. The LLM alone is the plan's
LLM-side layers (every layer outside the encoders and their projectors) cut into the plan's
pp x v virtual stages balanced by their forward + backward time (the Optimus appendix-B program,
:func:`~vlmcompile.planning.chunks.balanced_split`), with the plan's recompute flags and schedule,
simulated. A benchmark states a plan's step over it (``llm_alone_step_s`` in ``vlmcompile plan
--json``) and the share of the encoder's cost a plan recovers against a baseline,
(baseline - ours) / (baseline - LLM alone).

The LLM alone ignores when the encoders' work may run. :func:`dependency_bound` adds it: an LLM
stage that reads encoder outputs cannot start a microbatch's forward before that microbatch's
encoder forward can have ended, and the step cannot end before each microbatch's encoder
backward has run after that stage's backward of it. Optimus (sec. 3.1, challenge 2) states these microbatch-level dependencies; every
plan made here keeps them, runs the encoders on whole microbatches, each encoder stage's
backward whole, and the LLM's actions in their schedule's order per rank.

At the two ends of the step the encoder's TP collectives count too. Encoder work hides its TP
collectives only inside an LLM action (kernel level, :mod:`vlmcompile.sim.kernel_stream`). Before
the LLM's first action, which every other LLM action follows (in 1F1B and interleaved 1F1B,
the first stage's first forward), no LLM action runs; after its last, which every other
precedes (there, the first stage's last backward), none does. So the encoder forward that first
action waits for, and the encoder backward after the last, run whole: compute and collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.stage_costs import layer_costs, plan_costs
from vlmcompile.ir.actions import Action, ActionKind, dependencies
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Parallel, Plan, Reason
from vlmcompile.ir.regions import ENCODER_SIDE
from vlmcompile.planning.build import build_plan
from vlmcompile.planning.chunks import balanced_split, chunks_of
from vlmcompile.planning.encoder_plans import LLM_GROUP
from vlmcompile.planning.request import PlanRequest
from vlmcompile.sim.simulator import SimResult, simulate
from vlmcompile.sim.timeline import complete_order, run_actions, transfer_of
from vlmcompile.sim.units import format_ms


def llm_graph(layer_graph: LayerGraph) -> LayerGraph:
    """The LLM-side layers of ``layer_graph`` alone (and the values they pass each other).

    Raises:
        PlanError: the model has no layer outside its encoders.
    """
    kept = [layer for layer in layer_graph.layers if layer.region not in ENCODER_SIDE]
    if not kept:
        raise PlanError("the model has no LLM layers (every layer is an encoder's or a projector's)")
    names = {layer.name for layer in kept}
    layers = tuple(replace(layer, index=i) for i, layer in enumerate(kept))
    edges = tuple(e for e in layer_graph.edges if e[0] in names and e[1] in names)
    return LayerGraph(layers, edges, {**layer_graph.meta, "llm_alone": True})


def llm_alone_plan(plan: Plan, layer_graph: LayerGraph, cluster: Cluster) -> Plan:
    """The LLM of ``plan``'s model alone at the plan's pipeline degrees, microbatches, schedule
    and recompute flags, its layers balanced over the virtual stages (see the module docstring)."""
    graph = llm_graph(layer_graph)
    par = plan.pipeline_parallel
    request = PlanRequest(
        parallel=par,
        global_batch=plan.global_batch,
        microbatch_size=plan.microbatch_size,
        schedule=plan.schedule,
        precision=plan.precision,
    )
    recompute = {layer.name: plan.recompute_of(layer.name) for layer in graph.layers}
    costs = layer_costs(
        graph,
        cluster,
        par,
        microbatch_size=plan.microbatch_size,
        recompute=recompute,
        precision=plan.precision,
    )
    num_stages = par.pp * par.v
    counts = balanced_split([c.f_s + c.b_s for c in costs], num_stages)
    said = Decision(
        "layer split",
        Reason.BALANCED,
        f"the LLM's {len(graph)} layers alone over {num_stages} virtual stages, balanced; layers per stage {counts}",
        {"layers_per_stage": counts},
    )
    return build_plan(
        graph,
        cluster,
        request,
        policy="llm_alone",
        chunks=chunks_of([layer.name for layer in graph.layers], counts),
        recompute=recompute,
        decisions=[said],
    )


def llm_stages_of(plan: Plan) -> Plan:
    """An encoder-in-bubbles plan's own LLM stages and actions, without the encoder's: the bound of
    the bubbles pass at its own stage cuts (:func:`llm_alone_plan` balances the LLM's layers
    instead)."""
    first = next(s.index for s in plan.stages if s.group == LLM_GROUP)
    stages = tuple(dataclasses.replace(s, index=s.index - first) for s in plan.stages[first:])
    actions = tuple(
        tuple(dataclasses.replace(a, stage=a.stage - first) for a in acts if a.stage >= first)
        for acts in plan.actions
    )
    return dataclasses.replace(
        plan,
        stages=stages,
        actions=actions,
        parallel={LLM_GROUP: plan.parallel[LLM_GROUP]},
        kernel_level={},
        # The run-ahead forwards are the encoder's; renumbered they would name LLM stages.
        run_ahead=0,
        ahead=frozenset(),
        recompute={k: v for k, v in plan.recompute.items() if any(k in s.layers for s in stages)},
    )


def llm_alone_step_s(
    plan: Plan, layer_graph: LayerGraph, cluster: Cluster, *, alone: Plan | None = None
) -> float:
    """The simulated step of :func:`llm_alone_plan` (a prediction of the cost model); ``alone``:
    that plan, where the caller has it already."""
    alone = alone or llm_alone_plan(plan, layer_graph, cluster)
    return simulate(alone, llm_graph(layer_graph), cluster).step_time_s


def encoder_cost_recovered(ours_s: float, baseline_s: float, llm_alone_s: float) -> float:
    """The share of what the encoder costs ``baseline`` (its step over the LLM alone) that our
    plan does not pay: 1.0 when ours runs as fast as the LLM alone, 0.0 when as slow as the
    baseline, below 0 when slower."""
    cost = baseline_s - llm_alone_s
    return (baseline_s - ours_s) / cost if cost > 0 else float("nan")


@dataclass(frozen=True, slots=True)
class DependencyBound:
    """A step no plan reaches that runs the given LLM stages, in their schedule's order, with the
    encoders' work of whole microbatches around them (see the module docstring)."""

    step_s: float
    head_s: float
    """The least time one microbatch's encoder forward takes along its longest path of layers into
    an LLM stage (compute only, as the TP collectives may hide inside LLM actions; 0 where no
    gradient reaches the encoder, which may run a batch ahead): that stage's forward of the
    microbatch starts no sooner."""
    tail_s: float
    """The same for one microbatch's encoder backward: the step ends no sooner after the LLM stage
    that sends the encoder its gradient has run that microbatch's backward."""
    llm_span_s: float
    """The LLM's actions alone, timed by the simulator's rule without DP collectives or encoders."""
    encoder_tp: int
    """The encoder TP the bound is taken at (its least over the TPs a plan may give the encoders)."""
    first_head_s: float
    """The encoder forward the LLM's first action waits for, with its TP collectives (no LLM
    action runs before it to hide them in): the step's start. ``head_s`` where the LLM's actions
    have no one first action reading the encoder."""
    last_tail_s: float
    """The encoder backward after the LLM's last action, with its TP collectives (no LLM action
    runs after it): the step's end. ``tail_s`` where the last action sends the encoder nothing."""

    def __str__(self) -> str:
        ends = (
            f"; the first LLM action waits {format_ms(self.first_head_s)} ms and the step ends "
            f"{format_ms(self.last_tail_s)} ms after the last (with the encoder's TP collectives: no LLM "
            "action runs there to hide them)"
            if (self.first_head_s, self.last_tail_s) != (self.head_s, self.tail_s)
            else ""
        )
        return (
            f"the LLM's actions alone {format_ms(self.llm_span_s)} ms; no LLM forward of a microbatch before "
            f"its encoder forward ({format_ms(self.head_s)} ms) and no step end before its encoder backward "
            f"({format_ms(self.tail_s)} ms) after the LLM's{ends}; encoder TP {self.encoder_tp}"
        )


def dependency_bound(llm_plan: Plan, layer_graph: LayerGraph, cluster: Cluster) -> DependencyBound:
    """The least step of a plan of ``layer_graph``'s model whose LLM runs as ``llm_plan`` does
    (its stages, schedule and per-rank order: :func:`llm_alone_plan`, or a plan's own LLM stages)
    with the encoder-side layers ``llm_plan`` does not hold around it: an LLM stage's forward of a
    microbatch starts after the encoder forward it reads can have run, and the encoder backward
    of a microbatch runs after the backward of the LLM stage that sends it the gradient. Compute
    only (TP collectives may hide), at each encoder TP a plan may choose (a divisor of the LLM's
    whose replicas share a microbatch), the least kept."""
    held = {name for stage in llm_plan.stages for name in stage.layers}
    outside = [layer.name for layer in layer_graph.layers if layer.name not in held]
    llm = llm_plan.pipeline_parallel
    stages = plan_costs(llm_plan, layer_graph, cluster).stages
    transfer = transfer_of(stages)
    first, last = _ends(llm_plan)

    def bound(paths: dict[int, _EncoderPath], tp: int) -> DependencyBound:
        first_head = paths[first.stage].fwd_whole_s if first is not None and first.stage in paths else None
        last_tail = paths[last.stage].bwd_whole_s if last is not None and last.stage in paths else None

        def duration(a, start: float) -> float:
            head = paths[a.stage].fwd_s if a.kind is ActionKind.F and a.stage in paths else 0.0
            if a is first and first_head is not None:
                head = first_head
            return max(0.0, head - start) + stages[a.stage].action_s(a.kind)

        timed = run_actions(llm_plan.actions, llm_plan.num_stages, duration=duration, transfer=transfer)
        step = max(t.end_s for t in timed)
        for t in timed:
            if t.action.kind in (ActionKind.B, ActionKind.I) and t.action.stage in paths:
                tail = (
                    last_tail if t.action is last and last_tail is not None else paths[t.action.stage].bwd_s
                )
                step = max(step, t.end_s + tail)
        head = max((p.fwd_s for p in paths.values()), default=0.0)
        tail = max((p.bwd_s for p in paths.values()), default=0.0)
        return DependencyBound(
            step,
            head,
            tail,
            0.0,
            tp,
            first_head_s=head if first_head is None else first_head,
            last_tail_s=tail if last_tail is None else last_tail,
        )

    span = bound({}, llm.tp).step_s
    options = {
        tp: _encoder_paths(layer_graph, cluster, llm, tp, llm_plan, outside)
        for tp in range(1, llm.tp + 1)
        if llm.tp % tp == 0 and llm_plan.microbatch_size % (llm.tp // tp) == 0
    }
    # The step grows with every stage's encoder work: a TP whose work is nowhere less than
    # another's cannot give a lower bound (timing the LLM's actions is the cost here).
    kept = [tp for tp in options if not any(_dominates(options[o], options[tp]) for o in options if o != tp)]
    best = min((bound(options[tp], tp) for tp in kept), key=lambda b: b.step_s)
    return replace(best, llm_span_s=span)


def _dominates(a: dict[int, _EncoderPath], b: dict[int, _EncoderPath]) -> bool:
    """``a``'s encoder work is nowhere more than ``b``'s and somewhere less."""
    pairs = [(x, y) for k in b for x, y in zip(a[k], b[k])]
    return all(x <= y for x, y in pairs) and any(x < y for x, y in pairs)


def _ends(plan: Plan, llm_stages: range | None = None) -> tuple[Action | None, Action | None]:
    """Of the plan's LLM actions (on ``llm_stages``; default all), the one every other follows
    and the one every other precedes (along the dependencies and each rank's order); None where
    no one action is."""
    split = plan.split_backward()
    llm = [[a for a in acts if llm_stages is None or a.stage in llm_stages] for acts in plan.actions]
    preceded: set[Action] = set()
    followed: set[Action] = set()
    for acts in llm:
        for before, after in zip(acts, acts[1:]):
            followed.add(before)
            preceded.add(after)
        for a in acts:
            deps = [
                d
                for d in dependencies(a, plan.num_stages, split, plan.ahead)
                if llm_stages is None or d.stage in llm_stages
            ]
            followed.update(deps)
            if deps:
                preceded.add(a)
    every = [a for acts in llm for a in acts]
    roots = [a for a in every if a not in preceded]
    sinks = [a for a in every if a not in followed]
    # In a DAG the one action nothing precedes is an ancestor of every other, and the one that
    # nothing follows a descendant of every other.
    return (roots[0] if len(roots) == 1 else None), (sinks[0] if len(sinks) == 1 else None)


class _EncoderPath(NamedTuple):
    """One microbatch's encoder work along its longest path of layers into an LLM stage."""

    fwd_s: float
    """Forward compute (TP collectives may hide inside LLM actions)."""
    bwd_s: float
    """Backward compute."""
    fwd_whole_s: float
    """Forward with its TP collectives: where no LLM action runs beside it."""
    bwd_whole_s: float
    """Backward with its TP collectives."""


def _encoder_paths(
    layer_graph: LayerGraph, cluster: Cluster, llm: Parallel, tp: int, llm_plan: Plan, outside: list[str]
) -> dict[int, _EncoderPath]:
    """Per LLM stage that reads encoder-side layers: one microbatch's encoder work along the
    longest path of them into it, at encoder TP ``tp`` (its replicas share the microbatch). Layers
    no gradient reaches may run a batch ahead: their forward waits for nothing."""
    if not outside:
        return {}
    stage_of = {name: stage.index for stage in llm_plan.stages for name in stage.layers}
    costs = dict(
        zip(
            (layer.name for layer in layer_graph.layers),
            layer_costs(
                layer_graph,
                cluster,
                replace(llm, tp=tp),
                microbatch_size=llm_plan.microbatch_size // (llm.tp // tp),
                precision=llm_plan.precision,
            ),
        )
    )
    ahead = layer_graph.forward_only()
    preds: dict[str, list[str]] = {n: [] for n in outside}
    into: dict[int, list[str]] = {}
    for src, dst, _ in layer_graph.edges:
        if src in preds and dst in preds:
            preds[dst].append(src)
        elif src in preds and dst in stage_of:
            into.setdefault(stage_of[dst], []).append(src)
    path: dict[str, _EncoderPath] = {}
    trained_before: dict[str, bool] = {}
    for n in outside:  # pipeline order: a layer's inputs come before it
        c, before = costs[n], preds[n]
        trained_before[n] = any(
            layer_graph[p].num_params > layer_graph[p].num_frozen_params or trained_before[p] for p in before
        )
        waits = n not in ahead
        input_grad = trained_before[n]
        own = _EncoderPath(
            c.fwd_s if waits else 0.0,
            (c.input_grad_s if input_grad else 0.0) + c.weight_grad_s,
            c.f_s if waits else 0.0,
            (c.i_s if input_grad else 0.0) + c.w_s,
        )
        path[n] = _EncoderPath(
            *(x + max((path[p][i] for p in before), default=0.0) for i, x in enumerate(own))
        )
    return {
        stage: _EncoderPath(*(max(path[n][i] for n in sources) for i in range(len(_EncoderPath._fields))))
        for stage, sources in into.items()
    }


@dataclass(frozen=True, slots=True)
class EncoderDelays:
    """Where a plan's step exceeds its own LLM stages run alone (the same actions in the same
    order per rank, no encoder work), split by when; the three add up to the difference."""

    start_s: float
    """How much later the LLM's first action starts: its first stage waits for encoder forwards
    (the dependency bound's head, less what the LLM alone waits for its parameters' all-gather)."""
    stretch_s: float
    """How much later again the LLM's last action ends: encoder work run among the LLM's actions
    that delayed them (in the pipeline's warm-up and cool-down, or beyond a host's TP gaps).
    Below 0 where the LLM's actions took less time from first to last than alone (waits of the
    LLM alone, e.g. for its parameters' all-gather, hidden under the encoder's work)."""
    tail_s: float
    """How much longer the step runs past the LLM's last action than the LLM alone's does: the
    encoder work left for the end (backwards, the dependency bound's tail being one microbatch's;
    with a frozen encoder run ahead, the next batch's forwards) and its DP collectives."""

    @property
    def total_s(self) -> float:
        return self.start_s + self.stretch_s + self.tail_s

    def __str__(self) -> str:
        return (
            f"the LLM starts {format_ms(self.start_s)} ms later, its actions stretch {format_ms(self.stretch_s)} ms, "
            f"the step runs {format_ms(self.tail_s)} ms longer past its last action"
        )


def encoder_delays(sim: SimResult, llm_stages: range, alone: SimResult) -> EncoderDelays:
    """:class:`EncoderDelays` of a plan simulated as ``sim`` whose LLM is ``llm_stages``, against
    ``alone``: the same LLM stages and per-rank order without the encoders, simulated (its
    stages numbered from 0)."""
    llm = [r for r in sim.runs if r.action.stage in llm_stages]
    if not llm or not alone.runs:
        raise PlanError("a plan without LLM actions has no encoder delays; give the plan's LLM stages")
    start = min(r.start_s for r in llm) - min(r.start_s for r in alone.runs)
    llm_end, alone_end = max(r.end_s for r in llm), max(r.end_s for r in alone.runs)
    return EncoderDelays(
        start_s=start,
        stretch_s=llm_end - alone_end - start,
        tail_s=(sim.step_time_s - llm_end) - (alone.step_time_s - alone_end),
    )


@dataclass(frozen=True, slots=True)
class PlacementBound:
    """A step no schedule of a plan's placement reaches. The placement: every action on the
    rank the plan runs it on (so which holder of a replicated encoder stage runs each
    microbatch), the LLM's actions in their order per rank, and the same forwards run a batch
    ahead; the encoder's actions in any order per rank and at either level (layer or kernel).
    Another assignment of microbatches to an encoder stage's holders, or other forwards run
    ahead, is another placement with a bound of its own.

    Each action has a release, a time before which it cannot start: an LLM action not before it
    starts with the LLM alone (encoder work only delays the LLM's), and no action before its
    inputs can have been made and sent (along the dependencies: releases, then an LLM action's
    own compute and TP collectives or an encoder action's compute, then the transfers between
    ranks). An encoder action the LLM's first action waits for, or one after the LLM's last,
    counts its TP collectives too: no LLM action runs beside it to hide them. A rank computes one
    thing at a time (a kernel-level rider's compute fills its host's TP gaps; it does not run
    beside the host's own) and runs its LLM actions one after another, so it finishes no sooner
    than any release T plus the compute of its actions released at T or later, or their LLM
    actions' own time where that is more. The bound is the largest such
    figure over every rank and release, or the LLM alone's last action's end where that is
    later. Against the step it says how much of a plan's gap is its schedule's: the dependency
    bound (:func:`dependency_bound`) holds for any encoder placement, this one for the plan's."""

    step_s: float
    rank: int
    """The rank the bound is reached on (-1: the LLM alone's last action)."""
    release_s: float
    """From when that rank's work ``work_s`` cannot start earlier."""
    work_s: float
    """What the rank runs of the actions released then or later: their compute, or where more,
    its LLM actions' own time (compute and TP collectives)."""
    encoder_compute_s: float
    """The encoder's time among those actions: compute, and TP collectives where nothing hides
    them."""

    def __str__(self) -> str:
        if self.rank < 0:
            return f"{format_ms(self.step_s)} ms, the end of its LLM actions alone"
        return (
            f"{format_ms(self.step_s)} ms: rank {self.rank} has {format_ms(self.work_s)} ms of work "
            f"({format_ms(self.encoder_compute_s)} ms of it the encoder's) that cannot start before "
            f"{format_ms(self.release_s)} ms"
        )


def placement_bound(
    plan: Plan,
    sim: SimResult,
    llm_stages: range,
    alone: SimResult,
    transfer: Callable[[Action, Action], float],
) -> PlacementBound:
    """:class:`PlacementBound` of ``plan`` (simulated as ``sim``, for its actions' compute and
    ranks) whose LLM is ``llm_stages``, against ``alone``: the same LLM stages and per-rank
    order without the encoders, simulated at the same work per microbatch (its stages numbered
    from 0). ``transfer``: the simulator's time from an action's end until one on another rank
    may use its output."""
    if not alone.runs or not any(r.action.stage in llm_stages for r in sim.runs):
        raise PlanError("a plan without LLM actions has no placement bound; give the plan's LLM stages")
    first = llm_stages.start
    # An LLM action starts no sooner than alone and takes its own time at least (its compute and
    # TP collectives; riders only fill the gaps): its output exists no sooner than that after.
    alone_run = {Action(r.action.stage + first, r.action.kind, r.action.microbatch): r for r in alone.runs}
    run_of = {r.action: r for r in sim.runs}
    split = plan.split_backward()
    order = complete_order(plan.actions, plan.num_stages, split, plan.hosts_of(), plan.ahead)
    whole = _encoder_work_at_the_ends(plan, llm_stages, order)
    # An encoder action's time on its rank: its compute, and its TP collectives where no LLM
    # action can run beside it to hide them.
    encoder_s = {
        a: r.compute_s + (r.tp_comm_s if a in whole else 0.0)
        for a, r in run_of.items()
        if a.stage not in llm_stages
    }
    release: dict[Action, float] = {}
    ready: dict[Action, float] = {}  # the earliest its output can exist
    last_llm: dict[int, Action] = {}
    by_rank: dict[int, list[Action]] = {}
    for rank, _, a in order:
        by_rank.setdefault(rank, []).append(a)
        t = max(
            (
                ready[d] + (transfer(d, a) if run_of[d].rank != rank else 0.0)
                for d in dependencies(a, plan.num_stages, split, plan.ahead)
            ),
            default=0.0,
        )
        if a.stage in llm_stages:
            own = alone_run[a]
            t = max(t, own.start_s, ready[last_llm[rank]] if rank in last_llm else 0.0)
            last_llm[rank] = a
            ready[a] = t + own.compute_s + own.tp_comm_s
        else:
            ready[a] = t + encoder_s[a]
        release[a] = t
    best = PlacementBound(max(r.end_s for r in alone.runs), -1, 0.0, 0.0, 0.0)
    for rank, acts in by_rank.items():
        # From a release on, the rank computes what is released then or later, one thing at a
        # time, and runs its LLM actions (with their TP collectives) one after another.
        compute = encoder = llm = 0.0
        for a in sorted(acts, key=release.__getitem__, reverse=True):
            if a.stage in llm_stages:
                compute += run_of[a].compute_s
                llm += alone_run[a].compute_s + alone_run[a].tp_comm_s
            else:
                compute += encoder_s[a]
                encoder += encoder_s[a]
            work = max(compute, llm)
            if release[a] + work > best.step_s:
                best = PlacementBound(release[a] + work, rank, release[a], work, encoder)
    return best


def _encoder_work_at_the_ends(plan: Plan, llm_stages: range, order) -> set[Action]:
    """The encoder actions no LLM action can run beside: those the LLM's first action waits for,
    and those after its last (:func:`_ends`), in ``order`` (an execution order of the plan)."""
    first, last = _ends(plan, llm_stages)
    split = plan.split_backward()

    def deps(a: Action) -> tuple[Action, ...]:
        return dependencies(a, plan.num_stages, split, plan.ahead)

    whole: set[Action] = set()
    if first is not None:
        stack = [d for d in deps(first) if d.stage not in llm_stages]
        while stack:
            d = stack.pop()
            if d not in whole:
                whole.add(d)
                stack.extend(e for e in deps(d) if e.stage not in llm_stages)
    if last is not None:
        after = {last}
        for _, _, a in order:
            if a.stage not in llm_stages and any(d in after for d in deps(a)):
                after.add(a)
        whole |= after - {last}
    return whole
