"""Megatron-LM balanced: the layer-balancing dynamic program of the Optimus appendix B.

Layers (encoder, projector and LLM, in pipeline order) are split into pp x v consecutive
virtual stages so that the slowest stage is as fast as possible (after Alpa, Zheng et al.
2022): with prefix sums T of per-layer times,

    F(l, 1) = T(l),    F(l, k) = min_{j < l} max(F(j, k - 1), T(l) - T(j)),

and the answer is F(L, pp x v). The paper estimates layer times from FLOPs; we take the cost
model's forward + backward time of each layer (TP collectives and recompute included), which
is FLOP-based on the same device. Everything else - recompute setting, schedule, placement of
virtual stage k on rank k mod pp - is Megatron's, so the two baselines differ only in the cut.

The program (:func:`vlmcompile.planning.chunks.balanced_split`) assumes a chain; a model with
several encoders (branches that do not depend on each other) is taken in its captured layer
order, and the report says so.
"""

from __future__ import annotations

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.stage_costs import layer_costs
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Plan, Reason
from vlmcompile.planning.chunks import balanced_split, chunks_of
from vlmcompile.planning.megatron_layout import megatron_plan, megatron_result
from vlmcompile.planning.model_parts import (
    independent_branches,
    linearised_decision,
    model_parts,
    recompute_decision,
    recompute_flags,
)
from vlmcompile.planning.request import GlobalRecompute, PlanRequest
from vlmcompile.planning.result import PolicyResult
from vlmcompile.sim.units import format_ms


def megatron_balanced(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    recompute: GlobalRecompute = GlobalRecompute(),
) -> PolicyResult:
    """Megatron-LM with the layers balanced over the virtual stages (see the module docstring)."""
    plan = balanced_plan(layer_graph, cluster, request, recompute=recompute)
    return megatron_result(layer_graph, cluster, plan, recompute)


def balanced_plan(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    recompute: GlobalRecompute = GlobalRecompute(),
) -> Plan:
    """:func:`megatron_balanced`'s plan, not simulated."""
    parts = model_parts(layer_graph)
    flags = recompute_flags(layer_graph, parts, recompute)
    costs = layer_costs(
        layer_graph, cluster, request.parallel, microbatch_size=request.microbatch_size, recompute=flags
    )
    times = [c.b_s + c.f_s for c in costs]
    num_stages = request.parallel.pp * request.parallel.v
    counts = balanced_split(times, num_stages)
    chunks = chunks_of([layer.name for layer in layer_graph.layers], counts)
    stage_times = [sum(times[i] for i in range(s, s + c)) for s, c in zip(_starts(counts), counts)]
    decisions = [
        Decision(
            "layer split",
            Reason.BALANCED,
            f"{len(times)} layers over {num_stages} virtual stages by the appendix-B dynamic program: "
            f"slowest stage {format_ms(max(stage_times))} ms, fastest {format_ms(min(stage_times))} ms "
            f"(fwd + bwd of one microbatch); layers per stage {counts}",
            {"max_stage_s": max(stage_times), "min_stage_s": min(stage_times)},
        ),
        recompute_decision(parts, recompute),
    ]
    branches = independent_branches(layer_graph)
    if branches > 1:
        decisions.append(linearised_decision(branches, "the dynamic program"))
    return megatron_plan(
        layer_graph,
        cluster,
        request,
        policy="megatron_balanced",
        chunks=chunks,
        flags=flags,
        decisions=decisions,
    )


def _starts(counts: list[int]) -> list[int]:
    return [sum(counts[:k]) for k in range(len(counts))]
