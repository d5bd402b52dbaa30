"""Plans with made-up stage costs, for testing schedules and the simulator apart from the cost model."""

from __future__ import annotations

from vlmcompile.cost_models.stage_costs import LayerCost, PlanCosts, StageCost
from vlmcompile.ir.actions import Action
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
