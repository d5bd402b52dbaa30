"""Where a contrastive model's towers go: both on every rank, or each on ranks of its own.

DistMM (sections 4-5) puts each tower on devices of its own, so a device's gradient all-reduce
carries one tower and each tower runs a larger batch per device, and balances the towers with its
data load balancer: a tower's devices share the whole batch, so the split of the devices sets
each tower's samples per device, and it is chosen so both towers end their forward phase
together. Here every split of the ranks is predicted (:func:`~vlmcompile.planning.towers.predict_step`)
against the colocated plan, each tower's ranks holding only its layers, and the fastest that fits
memory is kept, the runner-up's figures in the decision.
"""

from __future__ import annotations

import dataclasses

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import usable_memory_bytes
from vlmcompile.ir.errors import ArgumentError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Reason
from vlmcompile.ir.tower_plan import MemoryPolicy, SampleSplit, TowerPlacement, TowerPlan
from vlmcompile.planning import towers

PLACEMENTS = ("auto", "colocated", "separate")


def separate_towers(
    plan: TowerPlan,
    ranks: tuple[int, int],
    microbatches: tuple[int, int] = (1, 1),
    memory: tuple[MemoryPolicy | None, MemoryPolicy | None] = (None, None),
) -> TowerPlan:
    """``plan`` with tower 0 on the first ``ranks[0]`` ranks and tower 1 on the next ``ranks[1]``
    (DistMM's placement), each spreading the whole batch over its ranks in ``microbatches`` a rank.

    Raises:
        ArgumentError: a tower without ranks, or fewer samples than a tower's ranks x microbatches.
    """
    if min(ranks) < 1:
        raise ArgumentError(f"tower ranks {ranks}: each tower needs one rank at least")
    n = plan.global_batch
    placements = (
        TowerPlacement(tuple(range(ranks[0])), SampleSplit.even(n, ranks[0], microbatches[0]), memory[0]),
        TowerPlacement(
            tuple(range(ranks[0], sum(ranks))), SampleSplit.even(n, ranks[1], microbatches[1]), memory[1]
        ),
    )
    decision = Decision(
        "placement",
        Reason.TOWER_PLACEMENT,
        f"tower 0 on ranks {list(placements[0].ranks)}, tower 1 on ranks {list(placements[1].ranks)} "
        f"({microbatches[0]} and {microbatches[1]} microbatches a rank)",
    )
    kept = tuple(d for d in plan.decisions if d.reason is not Reason.TOWER_PLACEMENT)
    split = SampleSplit.even(n, sum(ranks), 1)
    return dataclasses.replace(
        plan, split=split, separate=placements, decisions=(*kept, decision), predicted=None
    )


def choose_placement(
    layer_graph: LayerGraph,
    cluster: Cluster,
    colocated: TowerPlan,
    *,
    placement: str,
    microbatches: int | None = None,
) -> TowerPlan:
    """The colocated plan, or the separate split of the ranks with the fastest predicted step that
    fits (module docstring), with the comparison as a decision. Separate, each tower gets its own
    activation policy and microbatch count: ``microbatches`` if given, else the cheapest that fits
    its ranks (kept in one microbatch, else recomputed in the fewest).

    Raises:
        ArgumentError: an unknown ``placement``, or "separate" where no split fits.
    """
    if placement not in PLACEMENTS:
        raise ArgumentError(f"tower placement {placement!r}; choose one of {PLACEMENTS}")
    ranks, n = colocated.num_ranks, colocated.global_batch
    if placement == "colocated" or ranks < 2:
        return colocated
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    options = []
    for k0 in range(1, ranks):
        k = (k0, ranks - k0)
        chosen = [_tower_fit(layer_graph, colocated, t, k[t], microbatches, cap) for t in (0, 1)]
        if None in chosen:
            continue
        plan = separate_towers(colocated, k, (chosen[0][1], chosen[1][1]), (chosen[0][0], chosen[1][0]))
        predicted = towers.predict_step(layer_graph, cluster, plan)
        if predicted.mem_bytes <= cap:
            options.append(dataclasses.replace(plan, predicted=predicted))
    if not options:
        if placement == "separate":
            raise ArgumentError(
                f"no split of {ranks} ranks between the towers fits {cluster.device.name} at {n} samples a step; "
                "place them colocated or give more devices"
            )
        return colocated
    best = min(options, key=lambda p: p.predicted.step_s)
    ms = {"colocated": colocated.predicted.step_s * 1e3, "separate": best.predicted.step_s * 1e3}
    k0 = len(best.separate[0].ranks)
    chosen = best if placement == "separate" or ms["separate"] < ms["colocated"] else colocated
    said = "separate" if chosen is best else "colocated"
    detail = (
        f"{said}: predicted step {ms['colocated']:.3g} ms with both towers on every rank, {ms['separate']:.3g} ms "
        f"with tower 0 on {k0} and tower 1 on {ranks - k0} of {ranks} ranks (the best split; simulated)"
    )
    decision = Decision("placement", Reason.TOWER_PLACEMENT, detail, {f"{k}_ms": v for k, v in ms.items()})
    kept = tuple(d for d in chosen.decisions if d.reason is not Reason.TOWER_PLACEMENT)
    return dataclasses.replace(chosen, decisions=(*kept, decision))


def _tower_fit(
    layer_graph: LayerGraph, plan: TowerPlan, tower: int, ranks: int, microbatches: int | None, cap: float
) -> tuple[MemoryPolicy, int] | None:
    """The cheapest (policy, microbatches a rank) with which one tower fits ``ranks`` ranks."""
    n = plan.global_batch
    layers = towers.tower_layers(layer_graph, plan.loss, tower)
    for policy, m in towers.memory_options(None, microbatches, n // ranks):
        if n < ranks * m:
            continue
        split = SampleSplit.even(n, ranks, m)
        need = towers.tower_memory(
            layer_graph,
            split,
            policy,
            embedding_width=plan.loss.width,
            tile_rows=plan.tile_rows,
            layers=layers,
        )
        if need.total <= cap:
            return policy, m
    return None
