"""Plan a contrastive two-tower step: samples per rank, microbatches and what a rank keeps.

Both towers sit on every rank here (data parallelism over the cluster); towers on ranks of their
own are :mod:`.tower_placement`'s. The global batch is split as evenly as the counts allow. A
rank's memory is its model states plus, between its tower forwards and the loss, either every
microbatch's activations (``keep``) or one microbatch's for the forward run again before its
backward (``recompute``), plus the loss phase's gathered embeddings and one tile of
similarities. The plan keeps activations in one microbatch when that fits (nothing runs twice),
else recomputes with the fewest microbatches that fit; a microbatch count or memory policy the
caller gives is kept, and refused if it does not fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.comm import all_gather_s, all_reduce_s, reduce_scatter_s
from vlmcompile.cost_models.compute import Work, layer_time
from vlmcompile.cost_models.memory import kept_activation_bytes, model_state_bytes, usable_memory_bytes
from vlmcompile.cost_models.stage_costs import samples_per_microbatch
from vlmcompile.ir.coupled_loss import CoupledLoss
from vlmcompile.ir.errors import ArgumentError
from vlmcompile.ir.layer_graph import Layer, LayerGraph, format_bytes
from vlmcompile.ir.plan import Decision, Precision, Reason, Recompute
from vlmcompile.ir.tower_plan import MemoryPolicy, SampleSplit, TowerPlan, TowerStepCost

LOSS_TILE_SHARE = 0.05
"""Share of a device's usable memory one tile of the loss's similarities may take."""
_TILE_TENSORS = 3
"""Tensors of a tile's size alive at once in its backward: logits, softmax (or sigmoid), gradient."""


@dataclass(frozen=True, slots=True)
class TowerMemory:
    """Bytes on the busiest rank of a contrastive step."""

    states: float
    activations: float
    loss_phase: float

    @property
    def total(self) -> float:
        return self.states + self.activations + self.loss_phase


def tower_memory(
    layer_graph: LayerGraph,
    split: SampleSplit,
    memory: MemoryPolicy,
    *,
    embedding_width: int,
    tile_rows: int,
    precision: Precision | None = None,
    layers: Sequence[Layer] | None = None,
) -> TowerMemory:
    """The busiest rank's bytes (module docstring) when it holds ``layers`` (default: every layer,
    both towers); activations are annotate's saved bytes."""
    precision = precision or Precision()
    layers = list(layer_graph.layers if layers is None else layers)
    totals = layer_graph.totals(layers)
    states = model_state_bytes(
        totals["num_params"],
        precision,
        dp=split.num_ranks,
        zero_stage=1,
        num_trainable=totals["num_params"] - totals["num_frozen_params"],
    ).total
    per_sample = sum(
        kept_activation_bytes(
            layer,
            Recompute.NONE,
            samples=samples_per_microbatch(layer_graph, 1),
            tp=1,
            sequence_parallel=False,
        )
        for layer in layers
    )
    busiest = max(range(split.num_ranks), key=split.count)
    held = split.count(busiest) if memory is MemoryPolicy.KEEP else max(split.microbatches[busiest])
    gathered = 2 * split.num_samples * embedding_width * 4  # both embeddings of the batch, fp32
    tile = _TILE_TENSORS * min(tile_rows, split.count(busiest)) * split.num_samples * 4
    return TowerMemory(states, held * per_sample, gathered + tile)


def plan_towers(
    layer_graph: LayerGraph,
    cluster: Cluster,
    loss: CoupledLoss,
    *,
    global_batch: int,
    embedding_width: int,
    microbatches: int | None = None,
    memory: MemoryPolicy | str | None = None,
    tile_rows: int | None = None,
) -> TowerPlan:
    """The contrastive step's plan on ``cluster`` with both towers on every rank (module
    docstring); :func:`~vlmcompile.planning.tower_placement.choose_placement` may then give each
    tower ranks of its own.

    Raises:
        ArgumentError: fewer samples than ranks, or no microbatch count fits the devices.
    """
    ranks = cluster.num_gpus
    if global_batch < ranks:
        raise ArgumentError(
            f"a global batch of {global_batch} samples cannot give each of {ranks} ranks a sample; "
            f"give at least {ranks} samples a step or a smaller cluster"
        )
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    local = -(-global_batch // ranks)
    if tile_rows is None:
        tile_rows = max(1, min(local, int(LOSS_TILE_SHARE * cap / (_TILE_TENSORS * global_batch * 4))))
    tried = []
    for policy, count in memory_options(memory, microbatches, global_batch // ranks):
        split = SampleSplit.even(global_batch, ranks, count)
        need = tower_memory(layer_graph, split, policy, embedding_width=embedding_width, tile_rows=tile_rows)
        tried.append(f"{policy} x{count}: {need.total / 2**30:.2f} GiB")
        if need.total <= cap:
            plan = TowerPlan(
                loss,
                split,
                policy,
                tile_rows,
                _decisions(loss, split, policy, need, cap, tile_rows),
                gpus_per_node=cluster.gpus_per_node,
            )
            return dataclasses.replace(plan, predicted=predict_step(layer_graph, cluster, plan))
    raise ArgumentError(
        f"the towers do not fit {cluster.device.name} ({cap / 2**30:.1f} GiB usable) at {global_batch} samples on "
        f"{ranks} ranks ({'; '.join(tried[:4])}); give more devices or fewer samples a step"
    )


def tower_layers(layer_graph: LayerGraph, loss: CoupledLoss, tower: int) -> list[Layer]:
    """The layers of one tower (every layer if capture recorded none)."""
    names = set(loss.tower_layers[tower])
    return [layer for layer in layer_graph.layers if layer.name in names] or list(layer_graph.layers)


def predict_step(layer_graph: LayerGraph, cluster: Cluster, plan: TowerPlan) -> TowerStepCost:
    """The step by phase on its busiest ranks: roofline compute, ring collectives over every rank
    (the runtime gathers and reduce-scatters over the world), each tower's gradient all-reduce
    over its own ranks. Colocated, a rank runs both towers on its samples and every direction of
    the loss for its rows; separate, a tower's ranks run that tower and the directions whose rows
    are its embedding, and the slower tower sets each phase."""
    loss, n, width, world = plan.loss, plan.global_batch, plan.loss.width, plan.num_ranks
    if plan.separate is None:
        groups = [(plan.placement(0), list(layer_graph.layers), loss.directions(), plan.memory)]
    else:
        groups = [
            (
                plan.placement(t),
                tower_layers(layer_graph, loss, t),
                [d for d in loss.directions() if d[0] == t],
                plan.memory_of(t),
            )
            for t in (0, 1)
        ]
    phases = [_group_phases(layer_graph, cluster, plan, *g) for g in groups]
    bw, latency = cluster.group_link(world, 1)
    gather_bytes = 2 * n * width * 4
    scatter_bytes = len({c for _, c in loss.directions()}) * n * width * 4
    need = max(
        tower_memory(
            layer_graph, p.split, memory, embedding_width=width, tile_rows=plan.tile_rows, layers=layers
        ).total
        for p, layers, _, memory in groups
    )
    return TowerStepCost(
        towers_fwd_s=max(ph[0] for ph in phases),
        towers_bwd_s=max(ph[1] for ph in phases),
        loss_s=max(ph[2] for ph in phases),
        gather_s=all_gather_s(gather_bytes, world, bw, latency),
        scatter_s=reduce_scatter_s(scatter_bytes, world, bw, latency),
        grad_reduce_s=max(ph[3] for ph in phases),
        gather_bytes=gather_bytes,
        scatter_bytes=scatter_bytes,
        loss_mem_bytes=2 * n * width * 4 + _TILE_TENSORS * plan.tile_rows * n * 4,
        mem_bytes=need,
    )


def _group_phases(
    layer_graph, cluster, plan, placement, layers, directions, memory
) -> tuple[float, float, float, float]:
    """(forward, backward, loss compute, gradient all-reduce) seconds of a group's busiest rank."""
    split = placement.split
    rows = max(split.count(i) for i in range(split.num_ranks))
    times = [
        layer_time(layer, cluster.device, samples=samples_per_microbatch(layer_graph, rows))
        for layer in layers
    ]
    fwd_s = sum(t.fwd_s for t in times)
    bwd_s = sum(t.bwd_s for t in times) + (fwd_s if memory is MemoryPolicy.RECOMPUTE else 0.0)
    n, width = plan.global_batch, plan.loss.width
    # Per direction: rows x N similarities forward (2 flops a multiply-add), their gradient to the
    # rows and to the columns backward; elementwise work over the rows x N tile a few times.
    flops = len(directions) * 3 * 2 * rows * n * width
    loss_s = Work(flops, 0.0, len(directions) * 4 * rows * n * 4).seconds(cluster.device)
    trainable = sum(layer.num_params - layer.num_frozen_params for layer in layers)
    bw, latency = cluster.group_link(len(placement.ranks), 1)
    grad_s = all_reduce_s(trainable * Precision().dp_grad_bytes, len(placement.ranks), bw, latency)
    return fwd_s, bwd_s, loss_s, grad_s


def memory_options(
    memory: MemoryPolicy | str | None, microbatches: int | None, most: int
) -> list[tuple[MemoryPolicy, int]]:
    """(policy, microbatches a rank) to try, cheapest first: keeping one microbatch runs nothing
    twice; recomputing runs every tower forward twice, the fewer microbatches the better (at most
    ``most``, so that every rank fills each of its microbatches)."""
    policies = [MemoryPolicy(memory)] if memory is not None else [MemoryPolicy.KEEP, MemoryPolicy.RECOMPUTE]
    if microbatches is not None:
        return [(p, microbatches) for p in policies]
    out = [(MemoryPolicy.KEEP, 1)] if MemoryPolicy.KEEP in policies else []
    if MemoryPolicy.RECOMPUTE in policies:
        first = 1 if memory is not None else 2
        out += [(MemoryPolicy.RECOMPUTE, c) for c in range(first, most + 1)]
    return out


def _decisions(
    loss: CoupledLoss, split: SampleSplit, policy: MemoryPolicy, need: TowerMemory, cap: float, tile_rows: int
) -> tuple[Decision, ...]:
    return (
        Decision(
            "loss",
            Reason.COUPLED_LOSS_SHARDED,
            f"{loss.kind} loss of all {split.num_samples} samples, rows sharded over {split.num_ranks} ranks, "
            f"tiles of {tile_rows} rows ({loss.detail})",
            {"tile_rows": tile_rows},
        ),
        Decision(
            "microbatches",
            Reason.TOWER_MEMORY,
            f"{policy} activations in {len(split.microbatches[0])} microbatch(es) a rank: "
            f"{format_bytes(need.total)} of {format_bytes(cap)} (states {format_bytes(need.states)}, "
            f"activations {format_bytes(need.activations)}, loss phase {format_bytes(need.loss_phase)})",
            {"mem_bytes": need.total, "cap_bytes": cap},
        ),
    )
