"""The numbers a stage-cut choice is made from, and what a choice costs.

A :class:`PartitionProblem` is per layer its forward and backward time, the extra backward
time if it is recomputed, the activation bytes it keeps per microbatch with and without
recompute, its model-state bytes, its DP parameter all-gather and gradient reduction and the
transfer time of a cut right after it; plus the pipeline shape (p ranks, v virtual stages per
rank, m microbatches, the placement) and, per rank, the activation counts the schedule holds at
each step. :func:`partition_problem` reads them from the cost model; :func:`evaluate` says what
one choice of cuts and recompute flags costs in step time and memory, by the simulator's rules;
:func:`model_evaluation_s` what the CP-SAT model says it costs. The CP-SAT model (:mod:`vlmcompile.planning.stage_cuts`)
and the policies that search cuts (ours, OmniBal) all read these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import (
    fits,
    kept_activation_bytes,
    recompute_transient_bytes,
    usable_memory_bytes,
)
from vlmcompile.cost_models.stage_costs import (
    cut_transfer_s,
    layer_costs,
    layer_state_bytes,
    samples_per_microbatch,
    states_per_rank,
)
from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.placement import Placement, PlacementStyle
from vlmcompile.ir.plan import Recompute
from vlmcompile.planning.request import PlanRequest
from vlmcompile.planning.schedules import make_schedule
from vlmcompile.sim import dp
from vlmcompile.sim.in_flight import MemoryPattern, in_flight, pattern_bytes
from vlmcompile.sim.timeline import Timed, run_actions, transfer_between_stages


@dataclass(frozen=True, slots=True)
class PartitionProblem:
    names: tuple[str, ...]
    fwd_s: tuple[float, ...]
    """Forward of one microbatch, TP collectives included."""
    bwd_s: tuple[float, ...]
    """Backward (input and weight gradients, TP collectives) without recompute."""
    redo_s: tuple[float, ...]
    """Extra backward time when the layer is recomputed."""
    act_bytes: tuple[float, ...]
    """Kept per microbatch from forward to backward, without recompute."""
    act_bytes_recompute: tuple[float, ...]
    transient_bytes: tuple[float, ...]
    """Extra bytes during the layer's backward when it is recomputed."""
    state_bytes: tuple[float, ...]
    """Parameters, gradients and optimizer states on one rank."""
    reduce_s: tuple[float, ...]
    """DP gradient reduction of the layer."""
    gather_s: tuple[float, ...]
    """DP all-gather of the layer's parameters (the distributed optimizer's)."""
    send_fwd_s: tuple[tuple[float, ...], ...]
    """[k][layer]: sending the activations of stage k to stage k + 1 when the cut between them is
    right after the layer (0 when both stages are on one rank)."""
    send_bwd_s: tuple[tuple[float, ...], ...]
    """[k][layer]: sending the gradients back across that cut."""
    recomputable: tuple[bool, ...]
    num_ranks: int
    v: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    """The schedule's action list per rank."""
    mem_cap_bytes: float
    placement: PlacementStyle = PlacementStyle.LOOP
    """Which rank holds each stage (:mod:`vlmcompile.ir.placement`)."""
    memory_patterns: tuple[tuple[MemoryPattern, ...], ...] = field(init=False)
    """Per rank, the distinct in-flight patterns of its action list (see :func:`memory_patterns`)."""
    rank_of_stage: tuple[int, ...] = field(init=False)
    """Each stage's rank."""
    stages_on: tuple[tuple[int, ...], ...] = field(init=False)
    """Per rank, the stages it holds."""

    def __post_init__(self):
        n = len(self.names)
        for name in (
            "fwd_s",
            "bwd_s",
            "redo_s",
            "act_bytes",
            "act_bytes_recompute",
            "transient_bytes",
            "state_bytes",
            "reduce_s",
            "gather_s",
            "recomputable",
        ):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} values for {n} layers")
        for name in ("send_fwd_s", "send_bwd_s"):
            rows = getattr(self, name)
            if len(rows) != max(0, self.num_stages - 1) or any(len(row) != n for row in rows):
                raise ValueError(
                    f"{name} needs {self.num_stages - 1} rows of {n} values (one per cut, per layer)"
                )
        if len(self.actions) != self.num_ranks:
            raise ValueError(f"{len(self.actions)} action lists for {self.num_ranks} ranks")
        object.__setattr__(self, "memory_patterns", memory_patterns(self.actions))
        placement = Placement(self.num_ranks, self.v, self.placement)
        object.__setattr__(self, "rank_of_stage", placement.ranks())
        object.__setattr__(self, "stages_on", tuple(placement.stages_on(r) for r in range(self.num_ranks)))

    @property
    def most_in_flight(self) -> tuple[int, ...]:
        """Per stage: the most microbatches it ever holds at once."""
        most = [0] * self.num_stages
        for patterns in self.memory_patterns:
            for live, _ in patterns:
                for k, n in live:
                    most[k] = max(most[k], n)
        return tuple(most)

    @property
    def num_actions(self) -> int:
        return sum(len(acts) for acts in self.actions)

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.v


@dataclass(frozen=True, slots=True)
class StageFigures:
    """One cut and recompute choice summed per stage, rank and cut (each layer's figure passed
    through ``time`` or ``mem`` first: the CP-SAT model's rounding, or none)."""

    fwd: list
    """Per stage: one forward's time."""
    bwd: list
    """Per stage: one backward's time, recompute included."""
    keep: list
    """Per stage: bytes kept per microbatch in flight."""
    transient: list
    """Per stage: the largest recompute transient of its layers."""
    static: list
    """Per rank: model-state bytes."""
    reduce: list
    """Per rank: DP gradient reduction time."""
    send_fwd: list
    """Per cut k (between stage k and k + 1): activations forward."""
    send_bwd: list
    """Per cut k: gradients back."""


def stage_figures(
    problem: PartitionProblem,
    stage_of: Sequence[int],
    recompute: Sequence[bool],
    *,
    time: Callable[[float], Any] = float,
    mem: Callable[[float], Any] = float,
) -> StageFigures:
    p, S = problem.num_ranks, problem.num_stages
    zero_t, zero_m = time(0.0), mem(0.0)
    ranks = problem.rank_of_stage
    fig = StageFigures(
        fwd=[zero_t] * S,
        bwd=[zero_t] * S,
        keep=[zero_m] * S,
        transient=[zero_m] * S,
        static=states_per_rank(
            (((ranks[k],), mem(problem.state_bytes[i])) for i, k in enumerate(stage_of)), p, zero_m
        ),
        reduce=[zero_t] * p,
        send_fwd=[zero_t] * (S - 1),
        send_bwd=[zero_t] * (S - 1),
    )
    for i, k in enumerate(stage_of):
        rc = bool(recompute[i])
        fig.fwd[k] += time(problem.fwd_s[i])
        fig.bwd[k] += time(problem.bwd_s[i]) + (time(problem.redo_s[i]) if rc else zero_t)
        fig.keep[k] += mem(problem.act_bytes_recompute[i]) if rc else mem(problem.act_bytes[i])
        if rc:
            fig.transient[k] = max(fig.transient[k], mem(problem.transient_bytes[i]))
        fig.reduce[ranks[k]] += time(problem.reduce_s[i])
        if k < S - 1 and stage_of[i + 1] != k:  # the cut after stage k is right after layer i
            fig.send_fwd[k] = time(problem.send_fwd_s[k][i])
            fig.send_bwd[k] = time(problem.send_bwd_s[k][i])
    return fig


def stage_timeline(problem: PartitionProblem, fig: StageFigures) -> list[Timed]:
    """Every action of the schedule timed as the simulator times it
    (:func:`~vlmcompile.sim.timeline.run_actions`), with ``fig``'s stage times and transfers."""
    return run_actions(
        problem.actions,
        problem.num_stages,
        duration=lambda a, _: fig.fwd[a.stage] if a.kind is ActionKind.F else fig.bwd[a.stage],
        transfer=transfer_between_stages(fig.send_fwd, [0, *fig.send_bwd]),
    )


def model_step(fig: StageFigures, timed: Sequence[Timed]) -> Any:
    """The step as the CP-SAT timeline model states it: its last action, or a rank's DP gradient
    reduction started when its last backward starts (a linear reading of the DP stream of
    :mod:`vlmcompile.sim.dp`, which :func:`evaluate` applies)."""
    step = max(t.end_s for t in timed)
    last_bwd = {t.rank: t.start_s for t in timed if t.action.kind is ActionKind.B}
    return max([step, *(last_bwd[r] + fig.reduce[r] for r in last_bwd)])


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One assignment's step and memory by the simulator's rules (floats, no rounding)."""

    step_s: float
    peak_bytes: tuple[float, ...]
    """Per rank."""
    fits: bool


def evaluate(problem: PartitionProblem, stage_of: Sequence[int], recompute: Sequence[bool]) -> Evaluation:
    """Step time and per-rank peak memory of one cut (each layer's stage) and recompute choice:
    the schedule timed by the simulator's rules (:func:`~vlmcompile.sim.timeline.run_actions`),
    its data-parallel collectives by the simulator's too (:mod:`vlmcompile.sim.dp`)."""
    fig = stage_figures(problem, stage_of, recompute)
    peaks = tuple(
        fig.static[r] + peak_in_flight(problem.memory_patterns[r], fig.keep, fig.transient)
        for r in range(problem.num_ranks)
    )
    return Evaluation(
        step_with_dp(problem, fig, stage_of, recompute), peaks, fits(peaks, problem.mem_cap_bytes)
    )


def model_evaluation_s(
    problem: PartitionProblem, stage_of: Sequence[int], recompute: Sequence[bool]
) -> float:
    """The step the CP-SAT timeline model gives one choice (:func:`model_step`), in seconds: what
    the partition report compares with the simulator's."""
    fig = stage_figures(problem, stage_of, recompute)
    return model_step(fig, stage_timeline(problem, fig))


def step_with_dp(
    problem: PartitionProblem, fig: StageFigures, stage_of: Sequence[int], recompute: Sequence[bool]
) -> float:
    """The step of one choice: the schedule timed with each stage's first forward waiting for its
    parameters and each rank's gradient reductions after its backwards (:mod:`vlmcompile.sim.dp`)."""
    stage_layers: list[list[dp.DPLayer]] = [[] for _ in range(problem.num_stages)]
    for i, k in enumerate(stage_of):
        bwd = problem.bwd_s[i] + (problem.redo_s[i] if recompute[i] else 0.0)
        stage_layers[k].append(
            dp.DPLayer(problem.names[i], problem.fwd_s[i], bwd, 0.0, problem.gather_s[i], problem.reduce_s[i])
        )
    gathered, _ = dp.gather_times(problem.actions, stage_layers)
    ranks = problem.rank_of_stage
    waited: set[int] = set()

    def duration(a: Action, start: float) -> float:
        if a.kind is ActionKind.B:
            return fig.bwd[a.stage]
        if a.stage in waited:  # one holder per stage: its first forward is the stage's first
            return fig.fwd[a.stage]
        waited.add(a.stage)
        return fig.fwd[a.stage] + dp.parameter_wait(stage_layers[a.stage], start, gathered[ranks[a.stage]])

    timed = run_actions(
        problem.actions,
        problem.num_stages,
        duration=duration,
        transfer=transfer_between_stages(fig.send_fwd, [0, *fig.send_bwd]),
    )
    last_end = [0.0] * problem.num_ranks
    for t in timed:
        last_end[t.rank] = max(last_end[t.rank], t.end_s)
    reduced, _ = dp.reduction(
        [(t.rank, t.action, t.start_s, t.end_s) for t in timed if t.action.kind is ActionKind.B],
        stage_layers,
        problem.num_ranks,
    )
    return dp.step_end(max(last_end), reduced)


def peak_in_flight(patterns: Sequence[MemoryPattern], keep: Sequence, transient: Sequence) -> Any:
    """The most bytes any pattern of a rank holds (:func:`~vlmcompile.sim.in_flight.pattern_bytes`)."""
    return max((pattern_bytes(x, keep, transient) for x in patterns), default=0)


def memory_patterns(actions: Sequence[Sequence[Action]]) -> tuple[tuple[MemoryPattern, ...], ...]:
    """Per rank, every distinct in-flight pattern of its action list
    (:func:`~vlmcompile.sim.in_flight.in_flight`), without the ones another pattern dominates."""
    return tuple(tuple(sorted(_undominated(set(in_flight(acts))))) for acts in actions)


def _undominated(patterns: set[MemoryPattern]) -> list[MemoryPattern]:
    """The patterns no other pattern covers: one covers another where it holds at least as many
    microbatches of every stage, with the same transient stage or the other with none (-1)."""
    items = sorted(patterns)
    stages = sorted({k for live, _ in items for k, _ in live})
    column = {k: j for j, k in enumerate(stages)}
    held = np.zeros((len(items), len(stages)))
    for i, (live, _) in enumerate(items):
        for k, n in live:
            held[i, column[k]] = n
    transient = np.array([t for _, t in items])
    kept = []
    for i, x in enumerate(items):
        covers = (held >= held[i]).all(axis=1) & ((transient[i] == -1) | (transient == transient[i]))
        covers[i] = False
        if not covers.any():
            kept.append(x)
    return kept


def partition_problem(layer_graph: LayerGraph, cluster: Cluster, request: PlanRequest) -> PartitionProblem:
    """The numbers of ``request``'s stage-cut choice, from the cost model (one TP rank, one
    microbatch)."""
    parallel, microbatch_size = request.parallel, request.microbatch_size
    precision = request.precision
    plain = layer_costs(layer_graph, cluster, parallel, microbatch_size=microbatch_size, precision=precision)
    every = {layer.name: Recompute.FULL for layer in layer_graph.layers}
    full = layer_costs(
        layer_graph, cluster, parallel, microbatch_size=microbatch_size, recompute=every, precision=precision
    )
    samples = samples_per_microbatch(layer_graph, microbatch_size)
    shard = {"samples": samples, "tp": parallel.tp, "sequence_parallel": parallel.sequence_parallel}
    p, v = parallel.pp, parallel.v
    layers = layer_graph.layers
    sends = _cut_sends(layer_graph, cluster, parallel, samples)
    act = [kept_activation_bytes(x, Recompute.NONE, **shard) for x in layers]
    act_rc = [kept_activation_bytes(x, Recompute.FULL, **shard) for x in layers]
    actions = make_schedule(request.schedule_name, parallel.stage_placement, request.num_microbatches)
    return PartitionProblem(
        names=tuple(x.name for x in layers),
        fwd_s=tuple(c.f_s for c in plain),
        bwd_s=tuple(c.b_s for c in plain),
        redo_s=tuple(f.i_s - c.i_s for c, f in zip(plain, full)),
        act_bytes=tuple(act),
        act_bytes_recompute=tuple(act_rc),
        transient_bytes=tuple(recompute_transient_bytes(x, Recompute.FULL, **shard) for x in layers),
        state_bytes=tuple(layer_state_bytes(c, parallel, precision) for c in plain),
        reduce_s=tuple(c.dp_reduce_s for c in plain),
        gather_s=tuple(c.dp_all_gather_s for c in plain),
        send_fwd_s=tuple(tuple(f for f, _ in row) for row in sends),
        send_bwd_s=tuple(tuple(b for _, b in row) for row in sends),
        recomputable=tuple(rc < a for a, rc in zip(act, act_rc)),
        num_ranks=p,
        v=v,
        num_microbatches=request.num_microbatches,
        actions=actions,
        mem_cap_bytes=usable_memory_bytes(cluster.device.mem_bytes),
        placement=parallel.placement,
    )


def _cut_sends(
    layer_graph: LayerGraph, cluster: Cluster, parallel, samples: float
) -> list[list[tuple[float, float]]]:
    """Per cut k between stage k and k + 1 (on the ranks the placement gives them), per layer:
    (forward, backward) transfer when the cut is right after that layer."""
    placement = parallel.stage_placement
    by_distance: dict[int, list[tuple[float, float]]] = {}
    out = []
    for k in range(placement.num_stages - 1):
        a, b = placement.rank_of(k), placement.rank_of(k + 1)
        distance = abs(a - b)
        if distance not in by_distance:
            by_distance[distance] = [
                cut_transfer_s(x, cluster, parallel, samples, a, b) if distance else (0.0, 0.0)
                for x in layer_graph.layers
            ]
        out.append(by_distance[distance])
    return out
