"""What no plan of a plan-search candidate can beat, from the cost model: the step bounds of
:mod:`vlmcompile.planning.step_bound` over the candidate's layer costs (one chain, and
encoder-in-bubbles plans), and the least memory of its fullest rank."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import kept_activation_bytes
from vlmcompile.cost_models.stage_costs import (
    LayerCost,
    LayerCoster,
    layer_costs,
    layer_state_bytes,
    samples_per_microbatch,
)
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Parallel, Recompute
from vlmcompile.ir.regions import ENCODER_SIDE
from vlmcompile.planning.request import PlanRequest
from vlmcompile.planning.schedules import Schedule, make_schedule
from vlmcompile.planning.step_bound import (
    BoundLayer,
    MemoryLayer,
    StepBound,
    bubbles_bound,
    chain_bound,
    least_peak_bytes,
)
from vlmcompile.sim.in_flight import in_flight


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

    @property
    def step_s(self) -> float:
        return self.chain.step_s


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
    costs = _cached(cache, ("costs", par.tp, par.dp, mbs), lambda: _costs(layer_graph, cluster, par, mbs))
    split = request.schedule_name is Schedule.ZERO_BUBBLE
    chain = chain_bound(
        [BoundLayer(c.f_s, c.b_s, c.dp_all_gather_s, c.dp_reduce_s) for c, _ in costs],
        p=par.pp,
        v=par.v,
        m=m,
        split_backward=split,
    )
    held = _cached(
        cache, ("in flight", par.pp, par.v, m, request.schedule_name), lambda: _most_in_flight(request)
    )
    least = least_peak_bytes([keep for _, keep in costs], held, p=par.pp, v=par.v)
    return CandidateBound(chain, _bubbles_bound(layer_graph, cluster, request, costs, split, cache), least)


def _costs(
    layer_graph: LayerGraph, cluster: Cluster, par: Parallel, microbatch_size: int
) -> list[tuple[LayerCost, MemoryLayer]]:
    """Each layer's cost without recompute, and its bytes at their least."""
    samples = samples_per_microbatch(layer_graph, microbatch_size)
    shard = {"samples": samples, "tp": par.tp, "sequence_parallel": par.sequence_parallel}
    out = []
    for layer, c in zip(
        layer_graph.layers, layer_costs(layer_graph, cluster, par, microbatch_size=microbatch_size)
    ):
        # A layer with no backward keeps nothing in flight (vlmcompile.sim.in_flight).
        keep = (
            min(kept_activation_bytes(layer, rc, **shard) for rc in (Recompute.NONE, Recompute.FULL))
            if c.b_s
            else 0.0
        )
        out.append((c, MemoryLayer(layer_state_bytes(c, par), keep)))
    return out


def _most_in_flight(request: PlanRequest) -> list[int]:
    """Per stage, the most microbatches the request's schedule keeps in flight on it (at least:
    with v > 1 the bound reads only the fewest, and every stage holds one from its forward to
    its backward; 1F1B's stage k holds min(p - k, m), Narayanan et al. 2021)."""
    par, m = request.parallel, request.num_microbatches
    if par.v > 1:
        return [1] * (par.pp * par.v)
    if request.schedule_name is Schedule.ONE_F_ONE_B:
        return [min(par.pp - k, m) for k in range(par.pp)]
    most = [0] * (par.pp * par.v)
    for acts in make_schedule(request.schedule_name, par.stage_placement, request.num_microbatches):
        for live, _ in in_flight(acts):
            for k, n in live:
                most[k] = max(most[k], n)
    return most


def _bubbles_bound(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    costs: list[tuple[LayerCost, MemoryLayer]],
    split: bool,
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
    costed = _cached(cache, ("coster",), lambda: LayerCoster(layer_graph, cluster))

    def encoder_compute(tp: int) -> float:
        at = dataclasses.replace(par, tp=tp)
        share = samples * tp / par.tp  # a replica's part of the microbatch (group_samples)
        costs = [costed(layer_graph.layers[i], at, samples=share) for i in encoder]
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
