"""Where a contrastive model's towers go: both on every rank, or each on ranks of its own.

DistMM (sections 4-5) puts each tower on devices of its own, so a device's gradient all-reduce
carries one tower and each tower runs a larger batch per device, and balances the towers with its
data load balancer: a tower's devices share the whole batch, so the split of the devices sets
each tower's samples per device, and it is chosen so both towers end their forward phase
together. Here every split of the ranks is predicted (:func:`~vlmcompile.planning.contrastive.predict_step`)
against the colocated plan, each tower's ranks holding only its layers, and the fastest that fits
memory is kept, the runner-up's figures in the decision.
"""

from __future__ import annotations

import dataclasses
import itertools

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import usable_memory_bytes
from vlmcompile.ir.contrastive_loss import ContrastiveLoss
from vlmcompile.ir.contrastive_plan import ContrastivePlan, MemoryPolicy, SampleSplit, TowerPlacement
from vlmcompile.ir.errors import ArgumentError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Reason
from vlmcompile.planning import contrastive

PLACEMENTS = ("auto", "colocated", "separate")


def separate_towers(
    plan: ContrastivePlan,
    ranks: tuple[int, int],
    microbatches: tuple[int, int] = (1, 1),
    memory: tuple[MemoryPolicy | None, MemoryPolicy | None] = (None, None),
    tp: tuple[int, int] = (1, 1),
    pp: tuple[int, int] = (1, 1),
) -> ContrastivePlan:
    """``plan`` with tower 0 on the first ``ranks[0]`` ranks and tower 1 on the next ``ranks[1]``
    (DistMM's placement), each spreading the whole batch over its data-parallel groups of
    ``tp x pp`` ranks in ``microbatches`` a group.

    Raises:
        ArgumentError: a tower without ranks, degrees that do not divide its tower's ranks or a
            ``tp`` that would cross a node (tower 1's groups start at rank ``ranks[0]``), or
            fewer samples than a tower's groups x microbatches.
    """
    if min(ranks) < 1:
        raise ArgumentError(f"tower ranks {ranks}: each tower needs one rank at least")
    if any(k % (t * p) for k, t, p in zip(ranks, tp, pp)) or ranks[0] % tp[1]:
        raise ArgumentError(
            f"tower ranks {ranks} at tp {tp} and pp {pp}: each tower's tp x pp must divide its ranks, and "
            "tower 1's tensor-parallel groups must start on a multiple of its tp (inside one node)"
        )
    n = plan.global_batch
    starts = (0, ranks[0])
    placements = tuple(
        TowerPlacement(
            tuple(range(starts[t], starts[t] + ranks[t])),
            SampleSplit.even(n, ranks[t] // (tp[t] * pp[t]), microbatches[t]),
            memory[t],
            tp[t],
            pp[t],
        )
        for t in (0, 1)
    )
    degrees = "" if tp == pp == (1, 1) else f", tp {tp[0]} and {tp[1]}, pp {pp[0]} and {pp[1]}"
    decision = Decision(
        "placement",
        Reason.TOWER_PLACEMENT,
        f"tower 0 on ranks {list(placements[0].ranks)}, tower 1 on ranks {list(placements[1].ranks)} "
        f"({microbatches[0]} and {microbatches[1]} microbatches a rank{degrees})",
    )
    kept = tuple(d for d in plan.decisions if d.reason is not Reason.TOWER_PLACEMENT)
    split = SampleSplit.even(n, sum(ranks), 1)
    return dataclasses.replace(
        plan, split=split, separate=placements, decisions=(*kept, decision), predicted=None
    )


def place_towers(
    layer_graph: LayerGraph,
    cluster: Cluster,
    loss: ContrastiveLoss,
    *,
    global_batch: int,
    embedding_width: int,
    placement: str = "auto",
    microbatches: int | None = None,
    tensor_parallel: tuple[int, ...] = (1,),
    pipeline_parallel: tuple[int, ...] = (1,),
) -> ContrastivePlan:
    """Both towers on every rank (:func:`~vlmcompile.planning.contrastive.plan_towers`), or the
    separate split of the ranks with the fastest predicted step that fits (module docstring),
    whichever is faster, with the comparison as a decision; separate also where both towers do
    not fit one rank together. Separate, each tower gets its own tensor-parallel degree (of
    ``tensor_parallel``) and pipeline stages (of ``pipeline_parallel``; colocated plans have
    none: the two towers are branches, not one chain of layers to cut), activation policy and
    microbatch count: ``microbatches`` if given, else the cheapest that fits its ranks (kept in
    one microbatch, else recomputed in the fewest).

    Raises:
        ArgumentError: an unknown ``placement``, fewer samples than ranks, or nothing fits.
    """
    if placement not in PLACEMENTS:
        raise ArgumentError(f"tower placement {placement!r}; choose one of {PLACEMENTS}")
    ranks, n = cluster.num_gpus, global_batch
    try:
        colocated = contrastive.plan_towers(
            layer_graph,
            cluster,
            loss,
            global_batch=n,
            embedding_width=embedding_width,
            microbatches=microbatches,
            tensor_parallel=tensor_parallel,
        )
    except ArgumentError as refusal:
        if placement == "colocated" or ranks < 2 or n < ranks:
            raise
        colocated, together = None, refusal
    if placement == "colocated" or ranks < 2:
        return colocated
    base = colocated or ContrastivePlan(
        loss,
        SampleSplit.even(n, ranks, 1),
        tile_rows=contrastive.default_tile_rows(cluster, n),
        gpus_per_node=cluster.gpus_per_node,
    )
    best = _best_split(layer_graph, cluster, base, microbatches, (tensor_parallel, pipeline_parallel))
    if best is None:
        if colocated is None:
            raise ArgumentError(f"{together}; nor does any split of the ranks between the towers")
        if placement == "separate":
            raise ArgumentError(
                f"no split of {ranks} ranks between the towers fits {cluster.device.name} at {n} samples a step; "
                "place them colocated or give more devices"
            )
        return colocated
    k0 = len(best.separate[0].ranks)
    ms = {"separate": best.predicted.step_s * 1e3}
    if colocated is None:
        chosen, together_said = best, "both towers on every rank do not fit"
    else:
        ms["colocated"] = colocated.predicted.step_s * 1e3
        faster = placement == "separate" or ms["separate"] < ms["colocated"]
        chosen = best if faster else colocated
        together_said = f"predicted step {ms['colocated']:.3g} ms with both towers on every rank"
    said = "separate" if chosen is best else "colocated"
    detail = (
        f"{said}: {together_said}, {ms['separate']:.3g} ms with tower 0 on {k0} and tower 1 on {ranks - k0} "
        f"of {ranks} ranks (the best split; simulated)"
    )
    decision = Decision("placement", Reason.TOWER_PLACEMENT, detail, {f"{k}_ms": v for k, v in ms.items()})
    kept = tuple(d for d in chosen.decisions if d.reason is not Reason.TOWER_PLACEMENT)
    return dataclasses.replace(chosen, decisions=(*kept, decision))


def _best_split(
    layer_graph: LayerGraph,
    cluster: Cluster,
    base: ContrastivePlan,
    microbatches: int | None,
    degrees: tuple[tuple[int, ...], tuple[int, ...]],
) -> ContrastivePlan | None:
    """The separate plan with the fastest predicted step that fits, over every split of the
    ranks; None if none fits. For each split, each tower's degrees (of ``degrees``: TP, PP) are
    ranked by that tower's own predicted time, and the best ``_KEPT_PER_TOWER`` of each are
    paired (the step is the slower tower's phases, so a tower's own order is what matters)."""
    ranks = cluster.num_gpus
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    best = None
    for k0 in range(1, ranks):
        k = (k0, ranks - k0)
        # Tower 1's tensor-parallel groups start at rank k0: its tp must divide k0 to stay in a node.
        ranked = [
            _tower_options(layer_graph, cluster, base, t, k[t], microbatches, degrees, cap, k0 if t else None)
            for t in (0, 1)
        ]
        for (tp0, pp0, memory0, m0), (tp1, pp1, memory1, m1) in itertools.product(*ranked):
            plan = separate_towers(base, k, (m0, m1), (memory0, memory1), (tp0, tp1), (pp0, pp1))
            predicted = contrastive.predict_step(layer_graph, cluster, plan)
            if predicted.mem_bytes <= cap and (best is None or predicted.step_s < best.predicted.step_s):
                best = dataclasses.replace(plan, predicted=predicted)
    return best


_KEPT_PER_TOWER = 2


def _tower_options(
    layer_graph, cluster, base, tower, ranks, microbatches, degrees, cap, start: int | None
) -> list[tuple]:
    """(tp, pp, policy, microbatches) with which one tower fits ``ranks`` ranks (starting at rank
    ``start``, which its tp must divide), its fastest first (its forward, backward and gradient
    reduction alone), at most ``_KEPT_PER_TOWER``."""
    layers = contrastive.tower_layers(layer_graph, base.loss, tower)
    scored = []
    for tp in contrastive.tp_options(cluster, ranks, degrees[0]):
        if start is not None and start % tp:
            continue
        for pp in (p for p in sorted(set(degrees[1])) if (ranks // tp) % p == 0 and p <= len(layers)):
            fit = _tower_fit(layer_graph, base, tower, ranks, tp, pp, microbatches, cap)
            if fit is None:
                continue
            policy, m = fit
            split = SampleSplit.even(base.global_batch, ranks // (tp * pp), m)
            placement = TowerPlacement(tuple(range(ranks)), split, policy, tp, pp)
            fwd, bwd, _, grad = contrastive.group_phases(
                layer_graph, cluster, base, placement, layers, (), policy
            )
            scored.append((fwd + bwd + grad, (tp, pp, *fit)))
    return [option for _, option in sorted(scored, key=lambda x: x[0])[:_KEPT_PER_TOWER]]


def _tower_fit(
    layer_graph: LayerGraph,
    plan: ContrastivePlan,
    tower: int,
    ranks: int,
    tp: int,
    pp: int,
    microbatches: int | None,
    cap: float,
) -> tuple[MemoryPolicy, int] | None:
    """The cheapest (policy, microbatches a group) with which one tower fits ``ranks`` ranks at
    ``tp`` and ``pp``."""
    n, dp = plan.global_batch, ranks // (tp * pp)
    layers = contrastive.tower_layers(layer_graph, plan.loss, tower)

    def need_of(policy, m):
        split = SampleSplit.even(n, dp, m)
        return split, contrastive.tower_memory(
            layer_graph,
            split,
            policy,
            embedding_width=plan.loss.width,
            tile_rows=plan.tile_rows,
            layers=layers,
            tp=tp,
            pp=pp,
            precision=plan.precision,
            zero_stage=plan.zero_stage,
        )

    fixed, counts = contrastive.memory_options(None, microbatches, n // dp)
    fit = contrastive.cheapest_fit(([(p, m) for p, m in fixed if n >= dp * m], counts), need_of, cap)
    return None if fit is None else (fit[0], len(fit[1].microbatches[0]))
