"""Megatron-LM balanced: the layer-balancing dynamic program of the Optimus appendix B.

Layers (encoder, projector and LLM, in pipeline order) are split into pp x v consecutive
virtual stages so that the slowest stage is as fast as possible (after Alpa, Zheng et al.
2022): with prefix sums T of per-layer times,

    F(l, 1) = T(l),    F(l, k) = min_{j < l} max(F(j, k - 1), T(l) - T(j)),

and the answer is F(L, pp x v). The paper estimates layer times from FLOPs; we take the cost
model's forward + backward time of each layer (TP collectives and recompute included), which
is FLOP-based on the same device. Everything else - recompute setting, schedule, placement of
virtual stage k on rank k mod pp - is Megatron's, so the two baselines differ only in the cut.

The program assumes a chain; a model with several encoders (branches that do not depend on
each other) is taken in its captured layer order, and the report says so.
"""

from __future__ import annotations

import numpy as np
from vlmcompile.cost_models.stage_costs import layer_costs
from vlmcompile.passes.megatron import (
    BaselineResult,
    ScheduleName,
    build_plan,
    model_parts,
    parallel_for,
    recompute_decision,
    recompute_flags,
)

from vlmcompile.cluster import Cluster
from vlmcompile.errors import PlanError
from vlmcompile.layer_graph import LayerGraph
from vlmcompile.plan import Decision, Reason, Recompute
from vlmcompile.regions import Region


def balanced_split(times: list[float], num_stages: int) -> list[int]:
    """Layers per stage minimising the largest stage sum; every stage gets at least one layer."""
    n = len(times)
    if num_stages > n:
        raise PlanError(
            f"{num_stages} virtual stages for {n} layers; every stage needs a layer, so lower pp x v"
        )
    prefix = np.concatenate([[0.0], np.cumsum(times)])
    best = prefix[1:].copy()  # F(l, 1) for l = 1..n, indexed l - 1
    choice = np.zeros((num_stages, n), dtype=np.int64)
    for k in range(1, num_stages):
        new = np.full(n, np.inf)
        for end in range(k, n):  # layers 0..end in k + 1 stages
            js = np.arange(k - 1, end)  # the first k stages end at layer j (inclusive)
            cost = np.maximum(best[js], prefix[end + 1] - prefix[js + 1])
            at = int(np.argmin(cost))
            new[end], choice[k, end] = cost[at], js[at]
        best = new
    counts = []
    end = n - 1
    for k in range(num_stages - 1, 0, -1):
        j = int(choice[k, end])
        counts.append(end - j)
        end = j
    counts.append(end + 1)
    return counts[::-1]


def megatron_balanced(
    layer_graph: LayerGraph,
    cluster: Cluster,
    *,
    tp: int,
    pp: int,
    v: int = 1,
    microbatch_size: int = 1,
    global_batch: int,
    recompute: Recompute | str = "none",
    recompute_vision: bool = False,
    schedule: ScheduleName | None = None,
    sequence_parallel: bool = True,
    zero_stage: int = 1,
) -> BaselineResult:
    parallel = parallel_for(
        cluster, tp=tp, pp=pp, v=v, sequence_parallel=sequence_parallel, zero_stage=zero_stage
    )
    parts = model_parts(layer_graph)
    flags = recompute_flags(layer_graph, parts, recompute, recompute_vision)
    costs = layer_costs(layer_graph, cluster, parallel, microbatch_size=microbatch_size, recompute=flags)
    times = [c.fwd_s + c.fwd_tp_comm_s + c.input_grad_s + c.weight_grad_s + c.bwd_tp_comm_s for c in costs]
    counts = balanced_split(times, pp * v)
    chunks, start = [], 0
    for count in counts:
        chunks.append([layer.name for layer in layer_graph.layers[start : start + count]])
        start += count
    stage_times = [
        sum(times[i] for i in range(s, s + c)) for s, c in zip(np.cumsum([0, *counts[:-1]]), counts)
    ]
    decisions = [
        Decision(
            "layer split",
            Reason.BALANCED,
            f"{len(times)} layers over {pp * v} virtual stages by the appendix-B dynamic program: "
            f"slowest stage {max(stage_times) * 1e3:.2f} ms, fastest {min(stage_times) * 1e3:.2f} ms "
            f"(fwd + bwd of one microbatch); layers per stage {counts}",
            {"max_stage_s": max(stage_times), "min_stage_s": min(stage_times)},
        ),
        recompute_decision(parts, recompute, recompute_vision),
    ]
    branches = _independent_branches(layer_graph)
    if branches > 1:
        decisions.append(
            Decision(
                "layer order",
                Reason.LINEARISED_BRANCHES,
                f"{branches} encoder branches do not depend on each other; the dynamic program assumes a chain, "
                "so they are taken in their captured order",
            )
        )
    return build_plan(
        layer_graph,
        cluster,
        policy="megatron_balanced",
        chunks=chunks,
        parallel=parallel,
        microbatch_size=microbatch_size,
        global_batch=global_batch,
        schedule=schedule,
        recompute=flags,
        decisions=decisions,
    )


def _independent_branches(layer_graph: LayerGraph) -> int:
    """Encoder entry layers: vision-region layers that read no other layer."""
    g = layer_graph.graph
    return sum(1 for layer in layer_graph.in_region(Region.VISION) if g.in_degree(layer.name) == 0)
