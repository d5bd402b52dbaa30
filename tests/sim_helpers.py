"""Plans with made-up stage costs, for testing schedules and the simulator apart from the cost model."""

from __future__ import annotations

import dataclasses

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.stage_costs import LayerCost, PlanCosts, StageCost
from vlmcompile.ir.actions import Action
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Parallel, Plan, Stage


def make_plan(
    actions: tuple[tuple[Action, ...], ...],
    num_stages: int,
    *,
    schedule: str = "test",
    v: int = 1,
    placement: str = "loop",
) -> Plan:
    p = len(actions)
    parallel = Parallel(dp=1, tp=1, pp=p, v=v, placement=placement)
    where = parallel.stage_placement
    return Plan(
        model="synthetic",
        policy="test",
        stages=tuple(Stage(index=k, rank=where.rank_of(k), layers=(f"layer{k}",)) for k in range(num_stages)),
        parallel={"model": parallel},
        microbatch_size=1,
        num_microbatches=1 + max(a.microbatch for acts in actions for a in acts),
        actions=actions,
        schedule=schedule,
    )


def synthetic_costs(
    plan: Plan,
    fwd_s: list[float],
    bwd_s: list[float],
    *,
    weight_grad_s: list[float] | None = None,
    send_s: list[float] | None = None,
    act_bytes: float = 1.0,
) -> PlanCosts:
    """Stage k takes fwd_s[k] forward and bwd_s[k] backward (of which weight_grad_s[k] is W);
    sending its output (or gradient) to a neighbour on another rank takes send_s[k]."""
    n = plan.num_stages
    w = weight_grad_s or [0.0] * n
    send = send_s or [0.0] * n
    stages = []
    for s in plan.stages:
        k = s.index
        layer = LayerCost(f"layer{k}", fwd_s[k], bwd_s[k] - w[k], w[k], 0.0, 0.0, 0.0, 0.0, 0.0)
        nxt = k + 1 < n and plan.stages[k + 1].rank != s.rank
        prv = k > 0 and plan.stages[k - 1].rank != s.rank
        stages.append(
            StageCost(k, s.rank, (layer,), send[k] if nxt else 0.0, send[k] if prv else 0.0, act_bytes, 0.0)
        )
    return PlanCosts(
        tuple(stages), (0.0,) * plan.num_ranks, model_flops=0.0, recompute_flops=0.0, samples=1.0
    )


def bubble_plan_with_tp(demo_graph):
    from vlmcompile.passes.planning.bubbles import bubbles
    from vlmcompile.planning.request import PlanRequest, SolverOptions

    cluster = Cluster.preset("h100x4")
    request = PlanRequest.on(cluster, tp=2, pp=2, global_batch=4)
    return cluster, bubbles(
        demo_graph, cluster, request, solver=SolverOptions(time_limit_s=2, workers=2)
    ).plan


def rider_and_host(plan, kind=None):
    """An encoder action (of ``kind``) on rank 1 moved right before an LLM action there that it
    does not feed."""
    from vlmcompile.ir.actions import dependencies

    acts = list(plan.actions[1])
    llm = plan.stages[-1].group
    for e in acts:
        if plan.stages[e.stage].group == llm or kind not in (None, e.kind):
            continue
        for host in acts:
            if plan.stages[host.stage].group != llm:
                continue
            if e in dependencies(host, plan.num_stages) or host in dependencies(e, plan.num_stages):
                continue
            rest = [a for a in acts if a != e]
            at = rest.index(host)
            moved = rest[:at] + [e] + rest[at:]
            candidate = dataclasses.replace(
                plan, actions=(plan.actions[0], tuple(moved)), kernel_level={e: 1}
            )
            try:
                candidate.validate()
            except PlanError:
                continue
            return candidate, e, host
    raise AssertionError("no encoder action could ride an LLM action on rank 1")
