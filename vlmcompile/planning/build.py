"""From a policy's choices to a plan: stages from chunks of layers (virtual stage k on rank
k mod pp, Megatron-LM's interleaved placement), the request's schedule as action lists, and
the plan validated. Every policy ends here, so their plans differ only in what they chose."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.stage_costs import chunk_action_times, layer_costs
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Plan, Reason, Recompute, Stage
from vlmcompile.planning.request import PlanRequest
from vlmcompile.planning.schedules import make_schedule


def build_plan(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    policy: str,
    chunks: Sequence[Sequence[str]],
    recompute: Mapping[str, Recompute],
    decisions: Sequence[Decision],
) -> Plan:
    """The validated plan of ``chunks`` (layer names per virtual stage, in stage order)."""
    request.check_on(cluster)
    par, m = request.parallel, request.num_microbatches
    schedule = request.schedule_name
    costs = {
        c.name: c
        for c in layer_costs(
            layer_graph, cluster, par, microbatch_size=request.microbatch_size, recompute=recompute
        )
    }
    actions = make_schedule(schedule, par.pp, m, v=par.v, stage_times=chunk_action_times(costs, chunks))
    said = Decision(
        "schedule", Reason.SCHEDULE, f"{schedule} over {par.pp} ranks, {m} microbatches", {"microbatches": m}
    )
    plan = Plan(
        model=str(layer_graph.meta.get("model", "?")),
        fingerprint=layer_graph.fingerprint(),
        policy=policy,
        cluster=cluster.name,
        stages=tuple(Stage(index=k, rank=k % par.pp, layers=tuple(chunk)) for k, chunk in enumerate(chunks)),
        parallel={"model": par},
        microbatch_size=request.microbatch_size,
        num_microbatches=m,
        actions=actions,
        schedule=schedule.value,
        recompute=dict(recompute),
        decisions=(*decisions, said),
    )
    plan.validate(layer_graph)
    return plan
