"""The numbers a stage-cut choice is made from, and what a choice costs.

A :class:`PartitionProblem` is per layer its forward and backward time, the extra backward
time if it is recomputed, the activation bytes it keeps per microbatch with and without
recompute, its model-state bytes, its DP gradient reduction and the transfer time of a cut
right after it; plus the pipeline shape (p ranks, v virtual stages per rank, m microbatches)
and, per rank, the activation counts the schedule holds at each step. :func:`partition_problem`
reads them from the cost model; :func:`evaluate` says what one choice of cuts and recompute
flags costs in step time and memory. The CP-SAT model (:mod:`vlmcompile.planning.stage_cuts`)
and the policies that search cuts (ours, OmniBal) all read these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import (
    kept_activation_bytes,
    recompute_transient_bytes,
    usable_memory_bytes,
)
from vlmcompile.cost_models.stage_costs import (
    cut_transfer_s,
    layer_costs,
    layer_state_bytes,
    samples_per_microbatch,
)
from vlmcompile.ir.actions import ActionKind
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Recompute
from vlmcompile.planning.request import PlanRequest
from vlmcompile.planning.schedules import make_schedule

MemoryPattern = tuple[tuple[tuple[int, int], ...], int]
"""((stage, microbatches in flight), ...), and the stage whose backward runs (-1 for none)."""


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
    cut_s: tuple[float, ...]
    """Sending activations forward and gradients back for a cut right after the layer."""
    recomputable: tuple[bool, ...]
    num_ranks: int
    v: int
    num_microbatches: int
    memory_patterns: tuple[tuple[MemoryPattern, ...], ...]
    """Per rank, the distinct in-flight patterns of its action list (see :func:`memory_patterns`)."""
    mem_cap_bytes: float

    def __post_init__(self):
        n = len(self.names)
        for field in ("fwd_s", "bwd_s", "redo_s", "act_bytes", "act_bytes_recompute", "transient_bytes"):
            if len(getattr(self, field)) != n:
                raise ValueError(f"{field} has {len(getattr(self, field))} values for {n} layers")
        if len(self.memory_patterns) != self.num_ranks:
            raise ValueError(f"{len(self.memory_patterns)} memory pattern lists for {self.num_ranks} ranks")

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.v


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The model's figures for one assignment (floats, no rounding)."""

    step_s: float
    peak_bytes: tuple[float, ...]
    """Per rank."""
    fits: bool


def evaluate(problem: PartitionProblem, stage_of: Sequence[int], recompute: Sequence[bool]) -> Evaluation:
    p, v, m = problem.num_ranks, problem.v, problem.num_microbatches
    S = problem.num_stages
    F, B, R = [0.0] * S, [0.0] * S, [0.0] * p
    A, T, static = [0.0] * S, [0.0] * S, [0.0] * p
    for i, k in enumerate(stage_of):
        rc = bool(recompute[i])
        F[k] += problem.fwd_s[i]
        B[k] += problem.bwd_s[i] + (problem.redo_s[i] if rc else 0.0)
        A[k] += problem.act_bytes_recompute[i] if rc else problem.act_bytes[i]
        if rc:
            T[k] = max(T[k], problem.transient_bytes[i])
        R[k % p] += problem.reduce_s[i]
        static[k % p] += problem.state_bytes[i]
    work = [sum(F[k] + B[k] for k in range(r, S, p)) for r in range(p)]
    cuts = sum(problem.cut_s[i] for i in range(len(stage_of) - 1) if stage_of[i + 1] != stage_of[i])
    tail = max(0.0, *(R[r] - sum(B[: r + 1]) for r in range(p)))
    step = ((v * m - 1) * max(work) + sum(F) + sum(B) + cuts) / v + tail
    peaks = []
    for r in range(p):
        peak = 0.0
        for live, busy in problem.memory_patterns[r]:
            peak = max(peak, sum(n * A[k] for k, n in live) + (T[busy] if busy >= 0 else 0.0))
        peaks.append(static[r] + peak)
    return Evaluation(step, tuple(peaks), all(x <= problem.mem_cap_bytes for x in peaks))


def memory_patterns(actions: Sequence[Sequence], num_stages: int) -> tuple[tuple[MemoryPattern, ...], ...]:
    """Per rank, every distinct (activations in flight per stage, stage in backward) of its
    action list, without the ones another pattern dominates. A microbatch is in flight on a
    stage from its forward until its backward (B, or W when the backward is split)."""
    split = {a.stage for acts in actions for a in acts if a.kind is ActionKind.W}
    out = []
    for acts in actions:
        live = [0] * num_stages
        seen: set[MemoryPattern] = set()
        for a in acts:
            if a.kind is ActionKind.F:
                live[a.stage] += 1
                busy = -1
            elif a.kind in (ActionKind.B, ActionKind.I):
                busy = a.stage
            else:
                busy = -1
            seen.add((tuple((k, n) for k, n in enumerate(live) if n), busy))
            if a.kind is ActionKind.B or (a.kind is ActionKind.W and a.stage in split):
                live[a.stage] -= 1
        out.append(tuple(sorted(_undominated(seen))))
    return tuple(out)


def _undominated(patterns: set[MemoryPattern]) -> list[MemoryPattern]:
    def covers(big: MemoryPattern, small: MemoryPattern) -> bool:
        b, s = dict(big[0]), dict(small[0])
        return (small[1] in (-1, big[1])) and all(b.get(k, 0) >= n for k, n in s.items())

    items = list(patterns)
    return [x for x in items if not any(y != x and covers(y, x) for y in items)]


def partition_problem(layer_graph: LayerGraph, cluster: Cluster, request: PlanRequest) -> PartitionProblem:
    """The numbers of ``request``'s stage-cut choice, from the cost model (one TP rank, one
    microbatch)."""
    parallel, microbatch_size = request.parallel, request.microbatch_size
    plain = layer_costs(layer_graph, cluster, parallel, microbatch_size=microbatch_size)
    every = {layer.name: Recompute.FULL for layer in layer_graph.layers}
    full = layer_costs(layer_graph, cluster, parallel, microbatch_size=microbatch_size, recompute=every)
    samples = samples_per_microbatch(layer_graph, microbatch_size)
    shard = {"samples": samples, "tp": parallel.tp, "sequence_parallel": parallel.sequence_parallel}
    p, v = parallel.pp, parallel.v
    # Cuts sit between neighbouring ranks, and with v > 1 also from the last rank back to the first.
    pairs = [(0, 1)] + ([(p - 1, 0)] if v > 1 and p > 2 else []) if p > 1 else []
    layers = layer_graph.layers
    act = [kept_activation_bytes(x, Recompute.NONE, **shard) for x in layers]
    act_rc = [kept_activation_bytes(x, Recompute.FULL, **shard) for x in layers]
    actions = make_schedule(request.schedule_name, p, request.num_microbatches, v=v)
    return PartitionProblem(
        names=tuple(x.name for x in layers),
        fwd_s=tuple(c.f_s for c in plain),
        bwd_s=tuple(c.b_s for c in plain),
        redo_s=tuple(f.i_s - c.i_s for c, f in zip(plain, full)),
        act_bytes=tuple(act),
        act_bytes_recompute=tuple(act_rc),
        transient_bytes=tuple(recompute_transient_bytes(x, Recompute.FULL, **shard) for x in layers),
        state_bytes=tuple(layer_state_bytes(c, parallel) for c in plain),
        reduce_s=tuple(c.dp_reduce_s for c in plain),
        cut_s=tuple(
            max((sum(cut_transfer_s(x, cluster, parallel, samples, a, b)) for a, b in pairs), default=0.0)
            for x in layers
        ),
        recomputable=tuple(rc < a for a, rc in zip(act, act_rc)),
        num_ranks=p,
        v=v,
        num_microbatches=request.num_microbatches,
        memory_patterns=memory_patterns(actions, p * v),
        mem_cap_bytes=usable_memory_bytes(cluster.device.mem_bytes),
    )
