"""What no plan of a plan-search candidate can beat, from the cost model: the step bounds of
:mod:`vlmcompile.planning.step_bound` over the candidate's layer costs (one chain, and
encoder-in-bubbles plans), and the least memory of its fullest rank."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import kept_activation_bytes, usable_memory_bytes
from vlmcompile.cost_models.stage_costs import (
    LayerCost,
    LayerCoster,
    layer_state_bytes,
    samples_per_microbatch,
)
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Parallel, Recompute
from vlmcompile.ir.regions import ENCODER_SIDE
from vlmcompile.planning.request import PlanRequest
from vlmcompile.planning.schedules import RankActions, Schedule, make_schedule
from vlmcompile.planning.step_bound import (
    BoundLayer,
    MemoryLayer,
    StageMemory,
    StepBound,
    bubbles_bound,
    chain_bound,
    least_peak_bytes,
    least_recompute_s,
    stage_cut_s,
)
from vlmcompile.sim.in_flight import fullest_moment, held_together


@dataclass(frozen=True, slots=True)
class CandidateBound:
    """What no plan of a candidate can beat (:mod:`vlmcompile.planning.step_bound`)."""

    chain: StepBound
    """The step of every one-chain plan (the plans the search partitions)."""
    bubbles: StepBound | None
    """The step of every encoder-in-bubbles plan (None: the model has no encoder, or nothing else)."""
    least_peak_bytes: float
    """The fullest rank's memory at its least, every layer recomputed where that keeps less."""
    cannot_run: str = ""
    """Why the cluster cannot run the candidate at all (its bounds are then infinite)."""
    stage_cut_s: float = 0.0
    """The one-chain plans that fit, over whole layers per stage (:func:`stage_cut_bound`; 0: not
    computed: it costs up to a second at a deep pipeline, so only candidates the search would
    otherwise plan get it)."""

    @property
    def step_s(self) -> float:
        return max(self.chain.step_s, self.stage_cut_s)

    @property
    def binding(self) -> str:
        """The term the bound is."""
        return "stage cuts" if self.stage_cut_s > self.chain.step_s else self.chain.binding


def candidate_bound(
    layer_graph: LayerGraph, cluster: Cluster, request: PlanRequest, cache: dict | None = None
) -> CandidateBound:
    """The bounds of one candidate from its layers' costs; ``cache`` keeps the costs and the
    schedule's in-flight counts between candidates that share them.

    Raises:
        ClusterError: the cluster cannot run the candidate's TP.
    """
    cache = {} if cache is None else cache
    par, mbs, m = request.parallel, request.microbatch_size, request.num_microbatches
    cluster.check_tensor_parallel(par.tp)
    precision = request.precision
    costed = _cached(cache, ("coster", precision), lambda: LayerCoster(layer_graph, cluster, precision))
    costs = _cached(
        cache, ("costs", par.tp, par.dp, mbs, precision), lambda: _costs(layer_graph, costed, par, mbs)
    )
    split = request.schedule_name is Schedule.ZERO_BUBBLE
    held = _cached(
        cache,
        ("in flight", par.pp, par.v, _scanned_microbatches(request), request.schedule_name),
        lambda: _held_per_rank(request),
    )
    memory = [keep for _, keep in costs]
    chain = chain_bound(
        [BoundLayer(c.f_s, c.b_s, c.dp_all_gather_s, c.dp_reduce_s) for c, _ in costs],
        p=par.pp,
        v=par.v,
        m=m,
        split_backward=split,
        recompute_s=least_recompute_s(memory, held, usable_memory_bytes(cluster.device.mem_bytes)),
    )
    least = least_peak_bytes(memory, held, p=par.pp, v=par.v)
    return CandidateBound(chain, _bubbles_bound(layer_graph, request, costs, split, costed, cache), least)


def stage_cut_bound(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    bound: CandidateBound,
    cache: dict,
    enough_s: float = math.inf,
) -> CandidateBound:
    """``bound`` with its stage-cut term (:func:`~vlmcompile.planning.step_bound.stage_cut_s`: whole
    layers per stage, the recompute the cap forces on each rank), found early once it reaches
    ``enough_s``; ``cache`` as :func:`candidate_bound` filled it for this candidate."""
    if bound.cannot_run or bound.stage_cut_s or not _cuts_matter(request, bound, len(layer_graph.layers)):
        return bound
    par, m = request.parallel, request.num_microbatches
    costs = cache[("costs", par.tp, par.dp, request.microbatch_size, request.precision)]
    held = _cached(
        cache,
        ("fullest moment", par.pp, par.v, _scanned_microbatches(request), request.schedule_name),
        lambda: _held_per_stage(request),
    )
    memory = StageMemory(
        tuple(keep for _, keep in costs), held, usable_memory_bytes(cluster.device.mem_bytes)
    )
    cut = stage_cut_s(
        [BoundLayer(c.f_s, c.b_s, c.dp_all_gather_s, c.dp_reduce_s) for c, _ in costs],
        p=par.pp,
        v=par.v,
        m=m,
        split_backward=request.schedule_name is Schedule.ZERO_BUBBLE,
        memory=memory,
        enough_s=enough_s,
    )
    return dataclasses.replace(bound, stage_cut_s=cut)


STAGE_CUT_LAYERS = 3
"""Layers per stage under which whole layers make the stage-cut bound worth its time (with more,
the ranks even out as the relaxed bound assumes)."""


def _cuts_matter(request: PlanRequest, bound: CandidateBound, num_layers: int) -> bool:
    """Whether the stage-cut bound can add to ``bound``: few layers per stage (v > 1), or memory
    that forces recompute (its prices see which ranks must)."""
    par = request.parallel
    forced = any(name == "recompute to fit" for name, _ in bound.chain.terms)
    return forced or (par.v > 1 and num_layers < STAGE_CUT_LAYERS * par.pp * par.v)


def _costs(
    layer_graph: LayerGraph, costed: LayerCoster, par: Parallel, microbatch_size: int
) -> list[tuple[LayerCost, MemoryLayer]]:
    """Each layer's cost without recompute, and its bytes: kept whole, at their least, and the
    compute recompute adds to keep the least."""
    samples = samples_per_microbatch(layer_graph, microbatch_size)
    shard = {"samples": samples, "tp": par.tp, "sequence_parallel": par.sequence_parallel}
    out = []
    for layer in layer_graph.layers:
        c = costed.figures(layer, par, samples=samples)
        state = layer_state_bytes(c, par, costed.precision)
        whole = kept_activation_bytes(layer, Recompute.NONE, **shard)
        least = kept_activation_bytes(layer, Recompute.FULL, **shard)
        if not c.b_s:  # no backward: nothing kept in flight (vlmcompile.sim.in_flight)
            keep = MemoryLayer(state, 0.0)
        elif least < whole:
            redo = costed.figures(layer, par, samples=samples, recompute=Recompute.FULL).b_s - c.b_s
            keep = MemoryLayer(state, least, whole, redo)
        else:
            keep = MemoryLayer(state, whole)
        out.append((c, keep))
    return out


def _held_per_rank(request: PlanRequest) -> list[int]:
    """Per rank, the most microbatches every one of its stages holds at one moment of the
    request's schedule (1F1B's rank k: min(p - k, m), Narayanan et al. 2021); 1 where the
    schedule is not known before the cut (:func:`_scanned_schedule`)."""
    par, m = request.parallel, request.num_microbatches
    if request.schedule_name is Schedule.ONE_F_ONE_B:
        return [min(par.pp - k, m) for k in range(par.pp)]
    ranks = _scanned_schedule(request)
    if ranks is None:
        return [1] * par.pp
    placement = par.stage_placement
    return [held_together(acts, placement.stages_on(rank)) for rank, acts in enumerate(ranks)]


def _held_per_stage(request: PlanRequest) -> tuple[int, ...]:
    """Per stage, the microbatches it holds at the moment its rank holds the most
    (:func:`~vlmcompile.sim.in_flight.fullest_moment`); where the schedule is not known before
    the cut, a rank's first stage holds microbatch 0 between its forward and its backward, and
    nothing else is counted."""
    par = request.parallel
    placement = par.stage_placement
    held = [0] * (par.pp * par.v)
    ranks = _scanned_schedule(request)
    for rank in range(par.pp):
        stages = placement.stages_on(rank)
        if ranks is None:
            held[stages[0]] = 1
            continue
        for k, n in zip(stages, fullest_moment(ranks[rank], stages)):
            held[k] = n
    return tuple(held)


INTERLEAVED_SCAN_GROUPS = 3
"""Groups of p microbatches an interleaved 1F1B schedule is scanned for its in-flight counts:
past its warm-up (under 2p microbatches' forwards) every group repeats the same pattern, so more
microbatches hold no more (checked up to 16 groups in the tests)."""


def _scanned_schedule(request: PlanRequest) -> RankActions | None:
    """The request's action lists to read in-flight counts off (interleaved 1F1B over
    :data:`INTERLEAVED_SCAN_GROUPS` groups of p microbatches), or None where the schedule orders
    work by the stages' times (zero-bubble, v_1f1b) and so is not known before the cut."""
    if request.schedule_name in (Schedule.ZERO_BUBBLE, Schedule.V_1F1B):
        return None
    return make_schedule(
        request.schedule_name, request.parallel.stage_placement, _scanned_microbatches(request)
    )


def _scanned_microbatches(request: PlanRequest) -> int:
    m, p = request.num_microbatches, request.parallel.pp
    if request.schedule_name is Schedule.INTERLEAVED_1F1B:
        return min(m, INTERLEAVED_SCAN_GROUPS * p)
    return m


def _bubbles_bound(
    layer_graph: LayerGraph,
    request: PlanRequest,
    costs: list[tuple[LayerCost, MemoryLayer]],
    split: bool,
    costed: LayerCoster,
    cache: dict,
) -> StepBound | None:
    """The LLM's own chain, and its compute with the encoders' at their cheapest TP over the ranks
    (the encoder-in-bubbles pass's TPs: divisors of the LLM's that share a microbatch evenly)."""
    par = request.parallel
    encoder = [i for i, layer in enumerate(layer_graph.layers) if layer.region in ENCODER_SIDE]
    llm = [i for i in range(len(layer_graph.layers)) if i not in set(encoder)]
    if not encoder or not llm:
        return None
    tps = [
        t for t in range(1, par.tp + 1) if par.tp % t == 0 and request.microbatch_size % (par.tp // t) == 0
    ]
    samples = samples_per_microbatch(layer_graph, request.microbatch_size)

    def encoder_compute(tp: int) -> float:
        at = dataclasses.replace(par, tp=tp)
        share = samples * tp / par.tp  # a replica's part of the microbatch (group_samples)
        costs = [costed.figures(layer_graph.layers[i], at, samples=share) for i in encoder]
        return sum(c.fwd_s + c.input_grad_s + c.weight_grad_s for c in costs)

    least = min(
        _cached(
            cache,
            ("encoder compute", tp, par.tp, par.dp, request.microbatch_size),
            lambda t=tp: encoder_compute(t),
        )
        for tp in tps
    )
    llm_costs = [costs[i][0] for i in llm]
    return bubbles_bound(
        [BoundLayer(c.f_s, c.b_s, c.dp_all_gather_s, c.dp_reduce_s) for c in llm_costs],
        sum(c.fwd_s + c.input_grad_s + c.weight_grad_s for c in llm_costs),
        least,
        p=par.pp,
        v=par.v,
        m=request.num_microbatches,
        split_backward=split,
    )


def _cached(cache: dict, key, make):
    if key not in cache:
        cache[key] = make()
    return cache[key]
