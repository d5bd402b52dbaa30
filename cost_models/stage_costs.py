"""What each stage of a plan costs: compute and TP communication per action kind,
point-to-point transfers, activation bytes per microbatch, model states, and the DP
collectives per layer. The simulator reads only this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlmcompile.cost_models import comm
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.compute import is_tensor_parallel, layer_time
from vlmcompile.cost_models.memory import (
    kept_activation_bytes,
    model_state_bytes,
    recompute_transient_bytes,
)
from vlmcompile.ir.actions import ActionKind
from vlmcompile.ir.layer_graph import Layer, LayerGraph
from vlmcompile.ir.plan import Parallel, Plan, Precision, Recompute, Stage


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One layer on one TP rank for one microbatch."""

    name: str
    fwd_s: float
    input_grad_s: float
    """Includes recomputing the forward when the layer is recomputed."""
    weight_grad_s: float
    fwd_tp_comm_s: float
    bwd_tp_comm_s: float
    """Includes the recomputed forward's TP collectives."""
    num_params: float
    """Parameters on one TP rank."""
    dp_all_gather_s: float
    """Gathering the layer's updated parameters over the DP group (distributed optimizer)."""
    dp_reduce_s: float
    """Reduce-scattering (ZeRO >= 1) or all-reducing (ZeRO 0) the layer's gradients over DP."""
    num_trainable_params: float | None = None
    """The part of ``num_params`` that trains (None: all). Frozen parameters have no gradient to
    reduce, no optimizer state and no update to gather."""

    # The durations of the layer's share of each action kind, TP collectives included: every
    # planner and the simulator time actions with these.
    @property
    def f_s(self) -> float:
        return self.fwd_s + self.fwd_tp_comm_s

    @property
    def i_s(self) -> float:
        return self.input_grad_s + self.bwd_tp_comm_s

    @property
    def w_s(self) -> float:
        return self.weight_grad_s

    @property
    def b_s(self) -> float:
        return self.i_s + self.w_s

    def action_s(self, kind: ActionKind) -> float:
        return {
            ActionKind.F: self.f_s,
            ActionKind.B: self.b_s,
            ActionKind.I: self.i_s,
            ActionKind.W: self.w_s,
        }[kind]


@dataclass(frozen=True, slots=True)
class StageCost:
    index: int
    rank: int
    layers: tuple[LayerCost, ...]
    send_fwd_s: float
    """Activations to the next stage (0 when it is on the same rank or there is none)."""
    send_bwd_s: float
    """Gradients to the previous stage."""
    act_bytes: float
    """Kept from a microbatch's forward until its backward."""
    transient_bytes: float
    """Extra bytes during this stage's backward (recomputed saved tensors)."""
    out_bytes: float = 0.0
    """What one microbatch's forward hands the next stage (held across the step boundary when
    the forward runs one batch ahead, ``Plan.ahead``)."""
    _per_kind: dict = field(init=False, repr=False, compare=False)
    """(action time, TP collectives) per action kind, summed once: every simulated action reads them."""

    def __post_init__(self):
        per_kind = {
            kind: (sum(c.action_s(kind) for c in self.layers), tp)
            for kind, tp in (
                (ActionKind.F, self.fwd_tp_comm_s),
                (ActionKind.B, self.bwd_tp_comm_s),
                (ActionKind.I, self.bwd_tp_comm_s),
                (ActionKind.W, 0.0),
            )
        }
        object.__setattr__(self, "_per_kind", per_kind)

    @property
    def fwd_s(self) -> float:
        return sum(c.fwd_s for c in self.layers)

    @property
    def input_grad_s(self) -> float:
        return sum(c.input_grad_s for c in self.layers)

    @property
    def weight_grad_s(self) -> float:
        return sum(c.weight_grad_s for c in self.layers)

    @property
    def fwd_tp_comm_s(self) -> float:
        return sum(c.fwd_tp_comm_s for c in self.layers)

    @property
    def bwd_tp_comm_s(self) -> float:
        return sum(c.bwd_tp_comm_s for c in self.layers)

    def action_s(self, kind: ActionKind) -> float:
        """Duration of one action of this stage, TP collectives included."""
        return self._per_kind[kind][0]

    def tp_comm_s(self, kind: ActionKind) -> float:
        """The TP collectives of one action (the compute stream's gaps; a weight gradient has none)."""
        return self._per_kind[kind][1]

    def compute_s(self, kind: ActionKind) -> float:
        """One action's time less its TP collectives."""
        time, tp = self._per_kind[kind]
        return time - tp


@dataclass(frozen=True, slots=True)
class PlanCosts:
    stages: tuple[StageCost, ...]
    static_bytes: tuple[float, ...]
    """Model states per pipeline rank."""
    model_flops: float
    """FLOPs of one step of one pipeline (forward + backward, no recompute), for MFU."""
    recompute_flops: float
    """FLOPs of the forwards recomputed in one step of one pipeline (full: the layer's forward;
    selective: its attention), which HFU counts (Narayanan et al. 2021's formula, the MFU the
    Optimus paper quotes); Megatron-LM's own throughput formula does not."""
    samples: float
    """Microbatch size over the annotated batch size: the factor every per-sample figure takes."""


def _tp_collectives(layer: Layer) -> int:
    """Collectives per pass (Megatron-LM): an attention block all-reduces after attention and
    after the MLP (with sequence parallelism: an all-gather and a reduce-scatter each, the same
    bytes); other sharded layers (embedding, projector MLP, output layer) once."""
    if not is_tensor_parallel(layer):
        return 0
    return 2 if layer.block else 1


def _hidden_bytes(layer_graph: LayerGraph, layer: Layer) -> int:
    largest_out = max((o.nbytes for o in layer.outputs), default=0)
    incoming = layer_graph.layers[layer.index - 1].boundary_fwd_bytes if layer.index > 0 else 0
    return max(largest_out, incoming)


def layer_cost(
    layer: Layer,
    layer_graph: LayerGraph,
    cluster: Cluster,
    par: Parallel,
    *,
    samples: float,
    recompute: Recompute = Recompute.NONE,
    precision: Precision | None = None,
    trains_before: bool | None = None,
) -> LayerCost:
    """One layer on one TP rank for one microbatch of ``samples`` annotated batches.

    Frozen parameters take no weight gradient (autograd skips their GEMM): a partly frozen
    layer's weight gradient is its trainable share (:attr:`Layer.weight_grad_flops`; the layer's
    ``bwd_flops`` are what annotate measured under the model's ``requires_grad`` flags, or what
    :meth:`LayerGraph.with_frozen` makes of them). A layer's input gradient is computed only
    where a layer before it trains (``trains_before``, from :meth:`LayerGraph.trains_before` when None: the
    runtime asks no gradient of a stage's inputs when nothing before it trains), so a frozen
    layer with nothing trainable before it has no backward at all, and nothing to recompute."""
    precision = precision or Precision()
    if trains_before is None:
        trains_before = layer_graph.trains_before()[layer.name]
    device = cluster.device
    tp_bw, tp_lat = cluster.group_link(par.tp, 1)
    dp_bw, dp_lat = cluster.group_link(par.dp, par.tp)
    t = layer_time(layer, device, samples=samples, tp=par.tp, sequence_parallel=par.sequence_parallel)
    coll = _tp_collectives(layer) if par.tp > 1 else 0
    fwd_comm = coll * comm.all_reduce_s(samples * _hidden_bytes(layer_graph, layer), par.tp, tp_bw, tp_lat)
    sharded = is_tensor_parallel(layer)
    params = layer.num_params / (par.tp if sharded else 1)
    trainable = (layer.num_params - layer.num_frozen_params) / (par.tp if sharded else 1)
    weight_grad = t.weight_grad_s
    input_grad, bwd_comm = (t.input_grad_s, fwd_comm) if trains_before else (0.0, 0.0)
    redo = redo_comm = 0.0
    if trainable == 0 and not trains_before:
        pass  # no backward: nothing to recompute
    elif recompute is Recompute.FULL:
        redo, redo_comm = t.fwd_s, fwd_comm
    elif recompute is Recompute.SELECTIVE:
        redo = t.fwd_attention_s
    grads_wire = trainable * precision.dp_grad_bytes
    if par.zero_stage >= 1:
        reduce = comm.reduce_scatter_s(grads_wire, par.dp, dp_bw, dp_lat)
        gather = comm.all_gather_s(trainable * precision.param_bytes, par.dp, dp_bw, dp_lat)
    else:
        reduce, gather = comm.all_reduce_s(grads_wire, par.dp, dp_bw, dp_lat), 0.0
    return LayerCost(
        name=layer.name,
        fwd_s=t.fwd_s,
        input_grad_s=input_grad + redo,
        weight_grad_s=weight_grad,
        fwd_tp_comm_s=fwd_comm,
        bwd_tp_comm_s=bwd_comm + redo_comm,
        num_params=params,
        num_trainable_params=trainable,
        dp_all_gather_s=gather,
        dp_reduce_s=reduce,
    )


def layer_state_bytes(cost: LayerCost, par: Parallel, precision: Precision | None = None) -> float:
    """Model states (parameters, gradients, optimizer) of the layer on one rank."""
    return model_state_bytes(
        cost.num_params,
        precision or Precision(),
        dp=par.dp,
        zero_stage=par.zero_stage,
        num_trainable=cost.num_trainable_params,
    ).total


def states_per_rank(held: Iterable[tuple[Iterable[int], Any]], num_ranks: int, zero: Any = 0.0) -> list:
    """Per rank, the model states it holds: ``held`` gives (the ranks holding them, their bytes on
    each) for every stage or layer. The one sum of model states per rank (the simulator's plans
    and the stage-cut model's candidate cuts, in bytes or in the solver's units)."""
    out = [zero] * num_ranks
    for ranks, state in held:
        for rank in ranks:
            out[rank] += state
    return out


def chunk_action_times(
    costs: Mapping[str, LayerCost], chunks: Sequence[Sequence[str]]
) -> dict[ActionKind, tuple[float, ...]]:
    """Per action kind, one duration per stage of ``chunks`` (the schedules that place work by
    time read these)."""
    return {
        kind: tuple(sum(costs[n].action_s(kind) for n in chunk) for chunk in chunks)
        for kind in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)
    }


def samples_per_microbatch(layer_graph: LayerGraph, microbatch_size: int) -> float:
    return microbatch_size / (layer_graph.meta.get("batch_size", 1) or 1)


def layer_costs(
    layer_graph: LayerGraph,
    cluster: Cluster,
    par: Parallel,
    *,
    microbatch_size: int,
    recompute: Mapping[str, Recompute] | None = None,
    precision: Precision | None = None,
) -> list[LayerCost]:
    """Every layer's cost under one parallel setting (planning passes compare cuts with these)."""
    cluster.check_tensor_parallel(par.tp)
    samples = samples_per_microbatch(layer_graph, microbatch_size)
    flags = recompute or {}
    costed = LayerCoster(layer_graph, cluster, precision)
    return [
        costed(layer, par, samples=samples, recompute=flags.get(layer.name, Recompute.NONE))
        for layer in layer_graph.layers
    ]


class LayerCoster:
    """:func:`layer_cost` for one graph, each distinct layer costed once: a model's repeated
    blocks cost the same (a cost reads the layer's own figures, the boundary before it, whether a
    layer before it trains, the degrees, samples and recompute flag; not its name or position)."""

    def __init__(self, layer_graph: LayerGraph, cluster: Cluster, precision: Precision | None = None):
        self.layer_graph, self.cluster, self.precision = layer_graph, cluster, precision
        self.before = layer_graph.trains_before()
        self.made: dict[tuple, LayerCost] = {}
        self.kinds: dict[tuple, int] = {}
        """A number per distinct (layer figures, boundary before it, trains before): hashing the
        layer's figures once per layer, not once per cost asked."""
        self.kind_of: dict[int, tuple[Layer, int]] = {}

    def _kind(self, layer: Layer) -> int:
        known = self.kind_of.get(layer.index)
        if known is not None and known[0] is layer:
            return known[1]
        graph = self.layer_graph
        previous = graph.layers[layer.index - 1].boundary_fwd_bytes if layer.index > 0 else None
        identity = (dataclasses.replace(layer, index=0, name=""), previous, self.before[layer.name])
        kind = self.kinds.setdefault(identity, len(self.kinds))
        self.kind_of[layer.index] = (layer, kind)
        return kind

    def __call__(
        self, layer: Layer, par: Parallel, *, samples: float, recompute: Recompute = Recompute.NONE
    ) -> LayerCost:
        return dataclasses.replace(
            self.figures(layer, par, samples=samples, recompute=recompute), name=layer.name
        )

    def figures(
        self, layer: Layer, par: Parallel, *, samples: float, recompute: Recompute = Recompute.NONE
    ) -> LayerCost:
        """The cost, under the name of the first layer costed alike (for what reads its figures
        only: the bounds)."""
        key = (self._kind(layer), par, samples, recompute)
        if key not in self.made:
            self.made[key] = layer_cost(
                layer,
                self.layer_graph,
                self.cluster,
                par,
                samples=samples,
                recompute=recompute,
                precision=self.precision,
                trains_before=self.before[layer.name],
            )
        return self.made[key]


def group_samples(plan: Plan, group: str, samples: float) -> float:
    """Samples one GPU's TP group of ``group`` takes per microbatch. An encoder group with a
    smaller TP than the pipeline's splits each pipeline rank's GPUs into pipeline-TP / group-TP
    replicas, each encoding its share of the microbatch (Optimus's TP_enc, a divisor of TP_llm)."""
    return samples * plan.parallel[group].tp / plan.pipeline_parallel.tp


def plan_costs(plan: Plan, layer_graph: LayerGraph, cluster: Cluster) -> PlanCosts:
    samples = samples_per_microbatch(layer_graph, plan.microbatch_size)
    costed = LayerCoster(layer_graph, cluster, plan.precision)
    stage_costs = []
    for stage in plan.stages:
        par = plan.parallel[stage.group]
        cluster.check_tensor_parallel(par.tp)
        share = group_samples(plan, stage.group, samples)
        layers = []
        act = transient = 0.0
        kw = {"samples": share, "tp": par.tp, "sequence_parallel": par.sequence_parallel}
        for name in stage.layers:
            layer = layer_graph[name]
            rc = plan.recompute_of(name)
            layers.append(costed(layer, par, samples=share, recompute=rc))
            act += kept_activation_bytes(layer, rc, **kw)
            transient = max(transient, recompute_transient_bytes(layer, rc, **kw))
        stage_costs.append((stage, par, share, layers, act, transient))

    result = []
    for i, (stage, par, share, layers, act, transient) in enumerate(stage_costs):
        last = layer_graph[stage.layers[-1]]
        first = layer_graph[stage.layers[0]]
        send_fwd = send_bwd = 0.0
        # A transfer is costed whenever the neighbour may run elsewhere; the timeline charges it
        # only when the two actions do run on different ranks (a replicated stage's holders).
        if i + 1 < len(stage_costs) and _may_differ(stage, stage_costs[i + 1][0]):
            nxt = stage_costs[i + 1][0]
            send_fwd, _ = cut_transfer_s(last, cluster, par, share, stage.rank, _other(nxt, stage.rank))
        # No gradient goes back to a stage with nothing trainable in or before it.
        if i > 0 and costed.before[first.name] and _may_differ(stage, stage_costs[i - 1][0]):
            prev_last = layer_graph.layers[first.index - 1]
            prev = stage_costs[i - 1][0]
            _, send_bwd = cut_transfer_s(prev_last, cluster, par, share, stage.rank, _other(prev, stage.rank))
        shard = 1 / par.tp if par.sequence_parallel else 1.0
        out = share * last.boundary_fwd_bytes * shard if i + 1 < len(stage_costs) else 0.0
        result.append(
            StageCost(stage.index, stage.rank, tuple(layers), send_fwd, send_bwd, act, transient, out)
        )

    static = states_per_rank(
        (
            (stage.ranks, sum(layer_state_bytes(c, par, plan.precision) for c in layers))
            for stage, par, _, layers, _, _ in stage_costs
        ),
        plan.num_ranks,
    )
    per_microbatch = samples * plan.num_microbatches
    names = [n for s in plan.stages for n in s.layers]
    model_flops = per_microbatch * sum(layer_graph[n].fwd_flops + layer_graph[n].bwd_flops for n in names)
    recompute_flops = per_microbatch * sum(
        _recomputed_flops(layer_graph[n], plan.recompute_of(n)) for n in names
    )
    return PlanCosts(tuple(result), tuple(static), model_flops, recompute_flops, samples)


def _may_differ(a: Stage, b: Stage) -> bool:
    return a.ranks != b.ranks or len(a.ranks) > 1


def _other(stage: Stage, rank: int) -> int:
    """The nearest holder of ``stage`` other than ``rank`` (``rank`` itself if it is the only one)."""
    others = [r for r in stage.ranks if r != rank]
    return min(others, key=lambda r: abs(r - rank)) if others else rank


def _recomputed_flops(layer: Layer, recompute: Recompute) -> float:
    if recompute is Recompute.FULL:
        return layer.fwd_flops
    if recompute is Recompute.SELECTIVE:
        return layer.fwd_attn_flops
    return 0.0


def cut_transfer_s(
    layer: Layer, cluster: Cluster, par: Parallel, samples: float, rank_a: int, rank_b: int
) -> tuple[float, float]:
    """Seconds to send a cut's activations forward and their gradients back, for a stage cut right
    after ``layer`` between pipeline ranks ``rank_a`` and ``rank_b`` (sequence-parallel: sharded)."""
    # Pipeline ranks sit tp * dp global ranks apart in Megatron's layout.
    bw, lat = cluster.group_link(2, par.tp * par.dp * abs(rank_a - rank_b))
    shard = 1 / par.tp if par.sequence_parallel else 1.0
    return (
        comm.p2p_s(samples * layer.boundary_fwd_bytes * shard, bw, lat),
        comm.p2p_s(samples * layer.boundary_bwd_bytes * shard, bw, lat),
    )
