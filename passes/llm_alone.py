"""The bound on what an encoder may cost: the same LLM without its encoders, at a plan's degrees.

Encoder work only adds to the LLM's: no plan of the VLM at given degrees (DP, TP, PP, v,
microbatches, schedule, recompute) can beat the LLM alone at them. The LLM alone is the plan's
LLM-side layers (every layer outside the encoders and their projectors) cut into the plan's
pp x v virtual stages balanced by their forward + backward time (the Optimus appendix-B program,
:func:`~vlmcompile.planning.chunks.balanced_split`), with the plan's recompute flags and schedule,
simulated. A benchmark states a plan's step over it (``llm_alone_step_s`` in ``vlmcompile plan
--json``) and the share of the encoder's cost a plan recovers against a baseline,
(baseline - ours) / (baseline - LLM alone).
"""

from __future__ import annotations

from dataclasses import replace

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.stage_costs import layer_costs
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Plan, Reason
from vlmcompile.ir.regions import ENCODER_SIDE
from vlmcompile.planning.build import build_plan
from vlmcompile.planning.chunks import balanced_split, chunks_of
from vlmcompile.planning.request import PlanRequest
from vlmcompile.sim.simulator import simulate


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
        global_batch=plan.num_microbatches * plan.microbatch_size * par.dp,
        microbatch_size=plan.microbatch_size,
        schedule=plan.schedule,
    )
    recompute = {layer.name: plan.recompute_of(layer.name) for layer in graph.layers}
    costs = layer_costs(graph, cluster, par, microbatch_size=plan.microbatch_size, recompute=recompute)
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


def llm_alone_step_s(plan: Plan, layer_graph: LayerGraph, cluster: Cluster) -> float:
    """The simulated step of :func:`llm_alone_plan` (a prediction of the cost model)."""
    alone = llm_alone_plan(plan, layer_graph, cluster)
    return simulate(alone, llm_graph(layer_graph), cluster).step_time_s


def encoder_cost_recovered(ours_s: float, baseline_s: float, llm_alone_s: float) -> float:
    """The share of what the encoder costs ``baseline`` (its step over the LLM alone) that our
    plan does not pay: 1.0 when ours runs as fast as the LLM alone, 0.0 when as slow as the
    baseline, below 0 when slower."""
    cost = baseline_s - llm_alone_s
    return (baseline_s - ours_s) / cost if cost > 0 else float("nan")
