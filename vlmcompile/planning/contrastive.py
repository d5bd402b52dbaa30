"""Plan a contrastive two-tower step: samples per rank, microbatches and what a rank keeps.

Both towers sit on every rank here (data parallelism over the cluster, tensor parallelism inside
a node where asked); towers on ranks of their own are :mod:`.contrastive_placement`'s. The global batch
is split as evenly as the counts allow. A rank's memory is its model states plus, between its
tower forwards and the loss, either every microbatch's activations (``keep``) or one
microbatch's for the forward run again before its backward (``recompute``), plus the loss
phase's gathered embeddings and one tile of similarities. At each tensor-parallel degree the plan
keeps activations in one microbatch when that fits (nothing runs twice), else recomputes with the
fewest microbatches that fit; the fastest predicted degree is kept. A microbatch count or memory
policy the caller gives is kept, and refused if it does not fit. The baselines' rule,
``checkpoint`` (every layer's input kept), is planned only when asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.comm import all_gather_s, p2p_s, reduce_scatter_s
from vlmcompile.cost_models.compute import Work, is_tensor_parallel
from vlmcompile.cost_models.memory import (
    kept_activation_bytes,
    model_state_bytes,
    recompute_transient_bytes,
    usable_memory_bytes,
)
from vlmcompile.cost_models.stage_costs import layer_cost, samples_per_microbatch
from vlmcompile.ir.contrastive_loss import ContrastiveLoss
from vlmcompile.ir.contrastive_plan import ContrastivePlan, MemoryPolicy, SampleSplit, TowerStepCost
from vlmcompile.ir.errors import ArgumentError
from vlmcompile.ir.layer_graph import Layer, LayerGraph, format_bytes
from vlmcompile.ir.plan import Decision, Parallel, Precision, Reason, Recompute
from vlmcompile.planning.chunks import balanced_split

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
    tp: int = 1,
    pp: int = 1,
    zero_stage: int = 1,
) -> TowerMemory:
    """The busiest rank's bytes (module docstring) when it holds ``layers`` (default: every layer,
    both towers) at tensor-parallel degree ``tp`` in ``pp`` pipeline stages
    (:func:`pipeline_stages`; the fullest counts) over ``split``'s data-parallel groups;
    activations are annotate's saved bytes, sharded as Megatron-LM with sequence parallelism."""
    precision = precision or Precision()
    layers = list(layer_graph.layers if layers is None else layers)
    busiest = max(range(split.num_ranks), key=split.count)
    count = split.count(busiest)
    held = count if memory is not MemoryPolicy.RECOMPUTE else max(split.microbatches[busiest])
    rule = Recompute.FULL if memory is MemoryPolicy.CHECKPOINT else Recompute.NONE
    sample = samples_per_microbatch(layer_graph, 1)
    fullest = (0.0, 0.0)
    for stage in pipeline_stages(layers, pp):
        states = sum(
            model_state_bytes(
                layer.num_params / (tp if is_tensor_parallel(layer) else 1),
                precision,
                dp=split.num_ranks,
                zero_stage=zero_stage,
                num_trainable=(layer.num_params - layer.num_frozen_params)
                / (tp if is_tensor_parallel(layer) else 1),
            ).total
            for layer in stage
        )
        kept = sum(
            kept_activation_bytes(layer, rule, samples=sample, tp=tp, sequence_parallel=True)
            for layer in stage
        )
        # Checkpointed, the layer whose backward runs holds its rebuilt activations on top.
        rebuilt = max(
            recompute_transient_bytes(layer, rule, samples=sample, tp=tp, sequence_parallel=True)
            for layer in stage
        )
        activations = held * (kept + rebuilt)
        if pp > 1 and memory is MemoryPolicy.RECOMPUTE:  # a later stage keeps every microbatch's input
            activations += count * sample * _stage_input_bytes(layer_graph, stage[0]) / tp
        fullest = max(fullest, (states, activations), key=sum)
    gathered = 2 * split.num_samples * embedding_width * 4  # both embeddings of the batch, fp32
    rows = -(-count // (tp * pp))
    tile = _TILE_TENSORS * min(tile_rows, rows) * split.num_samples * 4
    return TowerMemory(*fullest, gathered + tile)


def pipeline_stages(layers: Sequence[Layer], pp: int) -> list[list[Layer]]:
    """``layers`` in ``pp`` consecutive stages balanced by their FLOPs (forward and backward; the
    balanced split of :mod:`~vlmcompile.planning.chunks`)."""
    if pp == 1:
        return [list(layers)]
    counts = _balanced_counts(tuple(layer.fwd_flops + layer.bwd_flops for layer in layers), pp)
    bounds = [sum(counts[:k]) for k in range(pp + 1)]
    return [list(layers[a:b]) for a, b in zip(bounds, bounds[1:])]


@functools.lru_cache(maxsize=1024)
def _balanced_counts(work: tuple[float, ...], pp: int) -> tuple[int, ...]:
    # The plan search asks for the same tower's stages thousands of times.
    return tuple(balanced_split(work, pp))


def _stage_input_bytes(layer_graph: LayerGraph, first: Layer) -> float:
    return layer_graph.layers[first.index - 1].boundary_fwd_bytes if first.index > 0 else 0.0


def plan_towers(
    layer_graph: LayerGraph,
    cluster: Cluster,
    loss: ContrastiveLoss,
    *,
    global_batch: int,
    embedding_width: int,
    microbatches: int | None = None,
    memory: MemoryPolicy | str | None = None,
    tile_rows: int | None = None,
    tensor_parallel: Sequence[int] = (1,),
    precision: Precision | None = None,
    zero_stage: int = 1,
) -> ContrastivePlan:
    """The contrastive step's plan on ``cluster`` with both towers on every rank (module
    docstring) at the fastest predicted of the ``tensor_parallel`` degrees that fits;
    :func:`~vlmcompile.planning.contrastive_placement.place_towers` may give each tower ranks
    of its own.

    Raises:
        ArgumentError: fewer samples than ranks, or no degree and microbatch count fits the devices.
    """
    ranks = cluster.num_gpus
    if global_batch < ranks:
        raise ArgumentError(
            f"a global batch of {global_batch} samples cannot give each of {ranks} ranks a sample; "
            f"give at least {ranks} samples a step or a smaller cluster"
        )
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    tile_rows = tile_rows or default_tile_rows(cluster, global_batch)
    tried, plans = [], []
    for tp in tp_options(cluster, ranks, tensor_parallel):
        dp = ranks // tp

        def need_of(policy, count, tp=tp, dp=dp):
            split = SampleSplit.even(global_batch, dp, count)
            need = tower_memory(
                layer_graph,
                split,
                policy,
                embedding_width=embedding_width,
                tile_rows=tile_rows,
                tp=tp,
                precision=precision,
                zero_stage=zero_stage,
            )
            tried.append(f"tp {tp} {policy} x{count}: {need.total / 2**30:.2f} GiB")
            return split, need

        fit = cheapest_fit(memory_options(memory, microbatches, global_batch // dp), need_of, cap)
        if fit is None:
            continue
        policy, split, need = fit
        plan = ContrastivePlan(
            loss,
            split,
            policy,
            tile_rows,
            _decisions(loss, split, policy, need, cap, tile_rows, tp),
            gpus_per_node=cluster.gpus_per_node,
            tp=tp,
            precision=precision or Precision(),
            zero_stage=zero_stage,
        )
        plans.append(dataclasses.replace(plan, predicted=predict_step(layer_graph, cluster, plan)))
    if not plans:
        raise ArgumentError(
            f"the towers do not fit {cluster.device.name} ({cap / 2**30:.1f} GiB usable) at {global_batch} samples "
            f"on {ranks} ranks ({'; '.join(tried[:4])}); give more devices or fewer samples a step"
        )
    return min(plans, key=lambda p: p.predicted.step_s)


def default_tile_rows(cluster: Cluster, global_batch: int) -> int:
    """Rows of similarities a tile has: a rank's rows when every rank has the same, but at most
    ``LOSS_TILE_SHARE`` of a device's usable memory."""
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    most = int(LOSS_TILE_SHARE * cap / (_TILE_TENSORS * global_batch * 4))
    return max(1, min(-(-global_batch // cluster.num_gpus), most))


def tp_options(cluster: Cluster, ranks: int, allowed: Sequence[int]) -> list[int]:
    """The ``allowed`` tensor-parallel degrees that divide ``ranks`` and stay inside a node."""
    return [tp for tp in sorted(set(allowed)) if tp >= 1 and ranks % tp == 0 and tp <= cluster.gpus_per_node]


def tower_layers(layer_graph: LayerGraph, loss: ContrastiveLoss, tower: int) -> list[Layer]:
    """The layers of one tower (every layer if capture recorded none)."""
    names = set(loss.tower_layers[tower])
    return [layer for layer in layer_graph.layers if layer.name in names] or list(layer_graph.layers)


def predict_step(layer_graph: LayerGraph, cluster: Cluster, plan: ContrastivePlan) -> TowerStepCost:
    """The step by phase on its busiest ranks: roofline compute and Megatron-LM's tensor-parallel
    collectives per layer, ring collectives over every rank (the runtime gathers and
    reduce-scatters over the world), each tower's gradient reduction over its own data-parallel
    ranks. Colocated, a rank runs both towers on its samples and every direction of the loss for
    its rows; separate, a tower's ranks run that tower and the directions whose rows are its
    embedding, and the slower tower sets each phase."""
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
    phases = [group_phases(layer_graph, cluster, plan, *g) for g in groups]
    bw, latency = cluster.group_link(world, 1)
    gather_bytes = 2 * n * width * 4
    scatter_bytes = len({c for _, c in loss.directions()}) * n * width * 4
    need = max(
        tower_memory(
            layer_graph,
            p.split,
            memory,
            embedding_width=width,
            tile_rows=plan.tile_rows,
            layers=layers,
            tp=p.tp,
            pp=p.pp,
            precision=plan.precision,
            zero_stage=plan.zero_stage,
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


def group_phases(
    layer_graph, cluster, plan, placement, layers, directions, memory
) -> tuple[float, float, float, float]:
    """(forward, backward, loss compute, gradient reduction) seconds of a group's busiest rank. In
    ``pp`` stages, m microbatches take m + pp - 1 steps of the slowest stage each way (GPipe's
    fill and drain), each step with its stage-to-stage transfer."""
    split, tp, pp = placement.split, placement.tp, placement.pp
    group_rows = max(split.count(i) for i in range(split.num_ranks))
    par = Parallel(dp=split.num_ranks, tp=tp, pp=pp, zero_stage=plan.zero_stage)
    again = memory is not MemoryPolicy.KEEP  # the forward runs again, whole or layer by layer
    before = layer_graph.trains_before()
    if pp == 1:
        costs = [_cost(layer_graph, cluster, par, plan, layer, group_rows, before) for layer in layers]
        fwd_s = sum(c.fwd_s + c.fwd_tp_comm_s for c in costs)
        bwd_s = sum(c.input_grad_s + c.weight_grad_s + c.bwd_tp_comm_s for c in costs) + again * fwd_s
        grad_s = sum(c.dp_reduce_s + c.dp_all_gather_s for c in costs)
    else:
        steps = max(len(m) for m in split.microbatches) + pp - 1
        largest = max(s for m in split.microbatches for s in m)
        stage_fwd, stage_bwd, stage_grad = [], [], []
        for stage in pipeline_stages(layers, pp):
            costs = [_cost(layer_graph, cluster, par, plan, layer, largest, before) for layer in stage]
            f = sum(c.fwd_s + c.fwd_tp_comm_s for c in costs)
            stage_fwd.append(f)
            stage_bwd.append(
                sum(c.input_grad_s + c.weight_grad_s + c.bwd_tp_comm_s for c in costs) + again * f
            )
            stage_grad.append(sum(c.dp_reduce_s + c.dp_all_gather_s for c in costs))
        bw, latency = cluster.group_link(pp, tp * split.num_ranks)
        hop = p2p_s(
            samples_per_microbatch(layer_graph, largest) * max(x.boundary_fwd_bytes for x in layers) / tp,
            bw,
            latency,
        )
        fwd_s, bwd_s = steps * (max(stage_fwd) + hop), steps * (max(stage_bwd) + hop)
        grad_s = max(stage_grad)
    # Per direction: rows x N similarities forward (2 flops a multiply-add), their gradient to the
    # rows and to the columns backward; elementwise work over the rows x N tile a few times. A
    # data-parallel group's rows are shared out over its tensor- and pipeline-parallel ranks.
    n, width, rows = plan.global_batch, plan.loss.width, -(-group_rows // (tp * pp))
    flops = len(directions) * 3 * 2 * rows * n * width
    loss_s = Work(flops, 0.0, len(directions) * 4 * rows * n * 4).seconds(cluster.device)
    return fwd_s, bwd_s, loss_s, grad_s


def _cost(layer_graph, cluster, par, plan, layer, samples: int, before: dict[str, bool]):
    return layer_cost(
        layer,
        layer_graph,
        cluster,
        par,
        samples=samples_per_microbatch(layer_graph, samples),
        precision=plan.precision,
        trains_before=before[layer.name],
    )


def memory_options(
    memory: MemoryPolicy | str | None, microbatches: int | None, most: int
) -> tuple[list[tuple[MemoryPolicy, int]], range]:
    """(policy, microbatches a rank) to try, cheapest first: keeping one microbatch runs nothing
    twice; recomputing runs every tower forward twice, the fewer microbatches the better (at most
    ``most``, so that every rank fills each of its microbatches). Checkpointing every layer is
    tried only when asked for (the baselines' rule). Returned as the fixed options, then the run
    of ``recompute`` counts (a range: it may be thousands long)."""
    policies = [MemoryPolicy(memory)] if memory is not None else [MemoryPolicy.KEEP, MemoryPolicy.RECOMPUTE]
    if microbatches is not None:
        return [(p, microbatches) for p in policies], range(0)
    fixed = [(p, 1) for p in policies if p is not MemoryPolicy.RECOMPUTE]
    if MemoryPolicy.RECOMPUTE not in policies:
        return fixed, range(0)
    return fixed, range(1 if memory is not None else 2, most + 1)


def cheapest_fit(
    options: tuple[list[tuple[MemoryPolicy, int]], range],
    need_of: Callable[[MemoryPolicy, int], tuple[SampleSplit, TowerMemory]],
    cap: float,
) -> tuple[MemoryPolicy, SampleSplit, TowerMemory] | None:
    """The first of ``options`` (:func:`memory_options`' fixed options, then its ``recompute``
    counts) whose need fits ``cap``. The counts are bisected: the need falls as the count grows (a
    rank holds its largest microbatch), so a run thousands long costs a dozen evaluations."""
    fixed, counts = options
    for policy, m in fixed:
        split, need = need_of(policy, m)
        if need.total <= cap:
            return policy, split, need
    found = None
    lo, hi = 0, len(counts) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        split, need = need_of(MemoryPolicy.RECOMPUTE, counts[mid])
        if need.total <= cap:
            found, hi = (MemoryPolicy.RECOMPUTE, split, need), mid - 1
        else:
            lo = mid + 1
    return found


def _decisions(
    loss: ContrastiveLoss,
    split: SampleSplit,
    policy: MemoryPolicy,
    need: TowerMemory,
    cap: float,
    tile_rows: int,
    tp: int,
) -> tuple[Decision, ...]:
    degrees = "" if tp == 1 else f"tp {tp}, "
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
            f"{degrees}{policy} activations in {len(split.microbatches[0])} microbatch(es) a rank: "
            f"{format_bytes(need.total)} of {format_bytes(cap)} (states {format_bytes(need.states)}, "
            f"activations {format_bytes(need.activations)}, loss phase {format_bytes(need.loss_phase)})",
            {"mem_bytes": need.total, "cap_bytes": cap},
        ),
    )
