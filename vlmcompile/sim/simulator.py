"""Discrete-event simulation of a plan's per-rank action lists under the cost model.

One pipeline group (its pp ranks, each standing for its TP group) is executed action by
action: an action starts when its rank is free and its inputs have arrived (the producer's
finish plus the point-to-point transfer, which overlaps compute). Data-parallel collectives
are analytic, per layer, on one DP stream per rank: at the start of the step every layer's
parameters are all-gathered (distributed optimizer) in the order the rank first runs them, and
a layer's first forward waits for its bucket; a layer's gradients are reduce-scattered when
its last backward has produced them (on local CPU ranks, when the rank's last action ends: that
is when our runtime reduces them). TP collectives are inside each action and block compute
(Megatron runs them on the critical path: the TP bubbles of Optimus sec. 2.2).

Idle time on each rank is attributed to one cause:

* ``dp_all_gather``: before anyone can compute (waiting for the first parameters) and inside a
  first forward waiting for a later layer's bucket;
* ``pp_warmup``: the rest of the wait before the rank's first action (the forward dependency
  of its first forward);
* ``pp_cooldown``: the wait after its last action until the pipeline's last compute ends (the
  backward dependency of the final backward);
* ``pp_other``: every gap between two of its actions (waiting for an activation or a
  gradient, imbalanced stages);
* ``tp_comm``: TP collectives inside actions;
* ``dp_reduce_scatter``: from the pipeline's last compute until the last gradient reduction ends.

These are the bubble types of Optimus sec. 2.2 (Table 1).

Busy time plus the idle causes equals the step time on every rank (the tests check it).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from tabulate import tabulate

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import MEMORY_RESERVE, fits, ranks_over, usable_memory_bytes
from vlmcompile.cost_models.stage_costs import LayerCost, PlanCosts, StageCost, plan_costs
from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Plan, Precision
from vlmcompile.ir.regions import ENCODER_SIDE
from vlmcompile.sim import dp
from vlmcompile.sim.in_flight import MemoryPattern, held_across_steps, in_flight, pattern_bytes
from vlmcompile.sim.kernel_stream import HostFill, host_fills
from vlmcompile.sim.timeline import Timed, complete_order, run_actions, transfer_of
from vlmcompile.sim.units import format_ms, ms_decimals

CAUSES = ("dp_all_gather", "pp_warmup", "pp_other", "pp_cooldown", "tp_comm", "dp_reduce_scatter")


@dataclass(frozen=True, slots=True)
class ActionRun:
    """One executed action: when it ran and what its time was spent on."""

    rank: int
    step: int
    action: Action
    start_s: float
    end_s: float
    compute_s: float
    tp_comm_s: float
    dp_wait_s: float = 0.0
    """Waiting inside a first forward for a later layer's parameters."""
    inside: Action | None = None
    """For a kernel-level encoder action: the first LLM action it ran inside (it ends with the
    last)."""
    rider_compute_s: float = 0.0
    """For an LLM action that hosts kernel-level encoder work: the riders' compute run in it."""


@dataclass(frozen=True, slots=True)
class Bubble:
    rank: int
    start_s: float
    end_s: float
    cause: str


@dataclass(frozen=True, slots=True)
class RankStats:
    rank: int
    busy_s: float
    idle_s: dict[str, float]
    peak_mem_bytes: float
    peak_step: int
    static_bytes: float


@dataclass(frozen=True, slots=True)
class SimResult:
    """The simulated step of one plan. The plan is its caller's (a policy's result owns it);
    what needs both takes both (:meth:`check_fits`, :mod:`vlmcompile.sim.trace`)."""

    cluster: Cluster
    step_time_s: float
    runs: tuple[ActionRun, ...]
    ranks: tuple[RankStats, ...]
    mfu: float
    """MFU (model FLOPs): forward and backward FLOPs of the model per second, over the peak of
    the pipeline's GPUs; recomputation does not count. Megatron-LM's own throughput log counts
    the same (``num_floating_point_operations`` in megatron/training/training.py: 3 GEMMs per
    weight, no recompute term)."""
    hfu: float
    """HFU: the recomputed forwards count too (Narayanan et al. 2021, eq. 3, whose factor
    96 = 72 + 24 for the recomputed forward); what the Optimus paper's MFU column matches."""
    dp_collectives: tuple[tuple[int, str, float, float], ...] = field(default=())
    """(rank, "all_gather" | "reduce_scatter", start, end) per layer bucket."""
    bubbles: tuple[Bubble, ...] = field(default=())
    """Idle intervals between actions, with their causes."""

    @property
    def peak_mem_bytes(self) -> list[float]:
        return [r.peak_mem_bytes for r in self.ranks]

    @property
    def peak_step(self) -> list[int]:
        return [r.peak_step for r in self.ranks]

    @property
    def mem_cap_bytes(self) -> float:
        """The memory a rank may use: the device's less the reserve, the cap every policy plans to."""
        return usable_memory_bytes(self.cluster.device.mem_bytes)

    @property
    def fits(self) -> bool:
        """Every rank's peak memory within :attr:`mem_cap_bytes`."""
        return fits(self.peak_mem_bytes, self.mem_cap_bytes)

    def fits_within(self, cap_bytes: float) -> bool:
        """Every rank's peak memory within ``cap_bytes`` (a budget below the device's cap)."""
        return fits(self.peak_mem_bytes, cap_bytes)

    def check_fits(self, plan: Plan) -> None:
        """Raise :class:`PlanError` naming the first rank over the cap, its step and action in
        ``plan`` (the plan simulated)."""
        cap = self.mem_cap_bytes
        over = ranks_over(self.peak_mem_bytes, cap)
        if not over:
            return
        rank = over[0]
        peak, step = self.peak_mem_bytes[rank], self.peak_step[rank]
        raise PlanError(
            f"rank {rank} needs {peak / 2**30:.1f} GiB at step {step} ({plan.actions[rank][step]}), "
            f"over the {cap / 2**30:.1f} GiB a {self.cluster.device.name} leaves (device memory less "
            f"the {100 * MEMORY_RESERVE:.0f} % reserve); recompute more layers, use more pipeline or "
            "tensor parallelism, or fewer microbatches in flight\n"
            + plan.grid_around(rank, step, "<- peak memory")
        )

    def idle_share(self) -> dict[str, float]:
        """Idle time by cause as a share of (step time x ranks)."""
        total = self.step_time_s * len(self.ranks)
        return {c: sum(r.idle_s[c] for r in self.ranks) / total for c in CAUSES}

    @property
    def bubble_share(self) -> float:
        return sum(self.idle_share().values())

    def to_json(self) -> dict:
        return {
            "note": "simulated by the cost model: a prediction, not a measurement",
            "cluster": self.cluster.name,
            "step_time_s": self.step_time_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "bubble_share": self.bubble_share,
            "bubble_share_by_cause": self.idle_share(),
            "ranks": [
                {
                    "rank": r.rank,
                    "busy_s": r.busy_s,
                    "idle_s": r.idle_s,
                    "peak_mem_bytes": r.peak_mem_bytes,
                    "peak_step": r.peak_step,
                    "model_state_bytes": r.static_bytes,
                }
                for r in self.ranks
            ],
        }

    def rank_table(self) -> str:
        rows = []
        # Busy and idle times add up to the step on each rank: print them at the step's precision.
        decimals = ms_decimals(self.step_time_s)
        for r in self.ranks:
            rows.append(
                [r.rank, format_ms(r.busy_s, decimals=decimals)]
                + [format_ms(r.idle_s[c], decimals=decimals) for c in CAUSES]
                + [f"{r.peak_mem_bytes / 2**30:.2f}"]
            )
        headers = ["rank", "busy ms", *[f"{c} ms" for c in CAUSES], "peak GiB"]
        return tabulate(rows, headers=headers, disable_numparse=True)

    def __str__(self) -> str:
        share = self.idle_share()
        lines = [
            f"simulated step: {format_ms(self.step_time_s)} ms on {self.cluster.name} "
            f"(prediction of the cost model), MFU (model FLOPs) {100 * self.mfu:.1f} %, "
            f"HFU (recompute counted) {100 * self.hfu:.1f} %, "
            f"bubbles {100 * self.bubble_share:.1f} % of rank time",
            "bubbles by cause: " + ", ".join(f"{c} {100 * share[c]:.1f} %" for c in CAUSES),
            f"peak memory: {max(self.peak_mem_bytes) / 2**30:.2f} GiB of {self.cluster.device.mem_bytes / 2**30:.1f} "
            f"GiB (rank {max(range(len(self.ranks)), key=lambda r: self.ranks[r].peak_mem_bytes)})",
            "",
            self.rank_table(),
        ]
        return "\n".join(lines)


def _work_scale(stages, layer_graph: LayerGraph, work) -> Callable[[Action], float]:
    """Action -> its duration over its stage's as costed, for microbatches of ``work``."""
    if not work:
        return lambda a: 1.0
    encoder_share = {}
    for stage in stages:
        for kind in ActionKind:
            total = sum(c.action_s(kind) for c in stage.layers)
            enc = sum(c.action_s(kind) for c in stage.layers if layer_graph[c.name].region in ENCODER_SIDE)
            encoder_share[stage.index, kind] = enc / total if total > 0 else 0.0

    def scale(a: Action) -> float:
        share = encoder_share[a.stage, a.kind]
        encoder, llm = work[a.microbatch]
        return share * encoder + (1 - share) * llm

    return scale


@dataclass(frozen=True)
class _Layout:
    """What a plan's action lists fix whatever the data: who runs what, in which order, and each
    rank's activation memory (kept per cost model: re-planning times one plan on many batches)."""

    rank_of: dict[Action, int]
    hosts: dict[Action, tuple[Action, ...]]
    order: list[tuple[int, int, Action]]
    peaks: dict[int, tuple[PlanCosts, list[tuple[float, int]]]] = field(default_factory=dict)
    """id(costs) -> (those costs, per rank (activation peak, its step)); the costs are held so
    their id is not reused while the entry lives."""
    patterns: list[dict[MemoryPattern, int]] = field(default_factory=list)
    """Per rank, each distinct in-flight pattern and the step it first holds at (plans that carry
    nothing across steps): a recompute setting changes the bytes, not the patterns."""

    def peak_memory(self, plan: Plan, costs: PlanCosts) -> list[tuple[float, int]]:
        held = self.peaks.get(id(costs))
        if held is None or held[0] is not costs:
            carried = plan.carried()
            if carried:
                steps = self._steps(len(plan.actions))
                held = (costs, [_peak_memory(mine, costs, self.hosts, carried) for mine in steps])
            else:
                held = (costs, [_peak_of(patterns, costs) for patterns in self._patterns(len(plan.actions))])
            _keep(self.peaks, id(costs), held)
        return held[1]

    def _steps(self, num_ranks: int) -> list[list[tuple[int, Action]]]:
        steps: list[list[tuple[int, Action]]] = [[] for _ in range(num_ranks)]
        for rank, step, a in self.order:
            steps[rank].append((step, a))
        return steps

    def _patterns(self, num_ranks: int) -> list[dict[MemoryPattern, int]]:
        if not self.patterns:
            for mine in self._steps(num_ranks):
                ordered = _held_order(mine, self.hosts)
                first: dict[MemoryPattern, int] = {}
                for (s, _), pattern in zip(ordered, in_flight([a for _, a in ordered])):
                    first.setdefault(pattern, s)
                self.patterns.append(first)
        return self.patterns


_LAYOUTS: dict[tuple, _Layout] = {}
_LAYOUTS_KEPT = 16
_CACHE_LOCK = threading.Lock()
"""Re-planning times schedules on a thread of its own (one batch ahead of the step)."""


def _keep(cache: dict, key, value) -> None:
    """``cache[key] = value``, the oldest entry dropped past :data:`_LAYOUTS_KEPT`."""
    with _CACHE_LOCK:
        if len(cache) >= _LAYOUTS_KEPT:
            cache.pop(next(iter(cache)), None)
        cache[key] = value


def _layout(plan: Plan) -> _Layout:
    key = (
        tuple(tuple(acts) for acts in plan.actions),  # a plan built with lists is timed too
        frozenset((plan.kernel_level or {}).items()),
        tuple(s.group for s in plan.stages),
        plan.num_stages,
        plan.ahead,
    )
    layout = _LAYOUTS.get(key)
    if layout is None:
        hosts = plan.hosts_of()
        order = complete_order(plan.actions, plan.num_stages, plan.split_backward(), hosts, plan.ahead)
        layout = _Layout(plan.rank_of_action(), hosts, order)
        _keep(_LAYOUTS, key, layout)
    return layout


@dataclass(frozen=True)
class _Timed:
    """One step's actions timed, and the DP collectives around them."""

    layout: _Layout
    timed: list[Timed]
    waited: dict[Action, float]
    fills: dict[Action, HostFill]
    scale: Callable[[Action], float]
    """An action's time over its stage's as costed (its microbatch's work)."""
    gathers: list[dp.Collective]
    reductions: list[dp.Collective]
    compute_end: float
    step_s: float


def _time_step(plan, layer_graph, cluster, costs: PlanCosts, work) -> _Timed:
    """The one timing of a step both :func:`simulate` and :func:`simulate_step` report."""
    stages = costs.stages
    scale = _work_scale(stages, layer_graph, work)
    layout = _layout(plan)
    num_ranks = plan.num_ranks
    stage_layers = [tuple(dp_layer(c) for c in stage.layers) for stage in stages]
    gathered, gathers = dp.gather_times(plan.actions, stage_layers)

    rank_of = layout.rank_of
    first_fwd_done: set[tuple[int, int]] = set()
    waited: dict[Action, float] = {}

    def duration(a: Action, start: float) -> float:
        stage = stages[a.stage]
        rank = rank_of[a]
        if a.kind is ActionKind.F and (rank, a.stage) not in first_fwd_done:
            first_fwd_done.add((rank, a.stage))
            waited[a] = dp.parameter_wait(stage_layers[a.stage], start, gathered[rank])
        return stage.action_s(a.kind) * scale(a) + waited.get(a, 0.0)

    hosts = layout.hosts

    def work_of(a: Action) -> tuple[float, float]:  # (compute, TP collectives)
        return stages[a.stage].compute_s(a.kind) * scale(a), stages[a.stage].tp_comm_s(a.kind) * scale(a)

    fills = host_fills(hosts, plan.actions, work=work_of, capacity=lambda a: work_of(a)[::-1])

    def fused(host: Action, start: float) -> float:
        # its compute, TP collectives and any wait for parameters, with the riders' kernels
        return fills[host].duration(duration(host, start))

    timed = run_actions(
        plan.actions,
        plan.num_stages,
        duration=duration,
        transfer=transfer_of(stages),
        hosts=hosts,
        fused_duration=fused,
        order=layout.order,
        ahead=plan.ahead,
    )
    backwards = [(t.rank, t.action, t.start_s, t.end_s) for t in timed if t.action.kind in _BACKWARD]
    reduced_end, reductions = dp.reduction(backwards, stage_layers, num_ranks)
    compute_end = max(t.end_s for t in timed)
    step = dp.step_end(compute_end, reduced_end)
    return _Timed(layout, timed, waited, fills, scale, gathers, reductions, compute_end, step)


_BACKWARD = (ActionKind.B, ActionKind.W)


def simulate(
    plan: Plan,
    layer_graph: LayerGraph,
    cluster: Cluster,
    *,
    costs: PlanCosts | None = None,
    work: Sequence[tuple[float, float]] | None = None,
) -> SimResult:
    """Execute ``plan`` on ``cluster`` under the cost model; see the module docstring.
    ``work``: per microbatch, its (encoder, LLM) work over the microbatch the graph is annotated
    at (variable data: each action's encoder-side and LLM-side layers scaled apart); None: every
    microbatch as annotated."""
    costs = costs or plan_costs(plan, layer_graph, cluster)
    stages = costs.stages
    t = _time_step(plan, layer_graph, cluster, costs, work)
    hosts = t.layout.hosts
    runs = [_run(x, stages[x.action.stage], t.waited.get(x.action, 0.0), t.scale(x.action)) for x in t.timed]
    if hosts:
        runs = _kernel_level_runs(runs, hosts, t.fills)
    step = t.step_s
    bubbles = _bubbles(runs, plan.num_ranks, step, t.compute_end)
    ranks = _rank_stats(plan, runs, bubbles, costs, t.layout.peak_memory(plan, costs))
    peak = cluster.device.peak_flops_per_s
    group_gpus = plan.num_ranks * max(p.tp for p in plan.parallel.values())
    capacity = step * group_gpus * peak
    mfu = costs.model_flops / capacity if step > 0 else 0.0
    hfu = (costs.model_flops + costs.recompute_flops) / capacity if step > 0 else 0.0
    return SimResult(cluster, step, tuple(runs), ranks, mfu, hfu, (*t.gathers, *t.reductions), tuple(bubbles))


def simulate_step(
    plan: Plan,
    layer_graph: LayerGraph,
    cluster: Cluster,
    *,
    costs: PlanCosts,
    work: Sequence[tuple[float, float]] | None = None,
) -> tuple[float, list[float]]:
    """(step time, per rank peak memory) of :func:`simulate` without the rest of its report:
    what re-planning a schedule for every batch times its candidates with."""
    t = _time_step(plan, layer_graph, cluster, costs, work)
    peaks = t.layout.peak_memory(plan, costs)
    return t.step_s, [costs.static_bytes[r] + peaks[r][0] for r in range(plan.num_ranks)]


def peak_memory_bytes(
    plan: Plan,
    layer_graph: LayerGraph,
    cluster: Cluster,
    *,
    costs: PlanCosts | None = None,
    precision: Precision | None = None,
) -> list[float]:
    """Per rank, the peak memory :func:`simulate` reports, without timing the step: what choosing
    the least recompute that fits needs of the settings that do not fit. ``precision``: the
    model-state bytes to count in place of the plan's (what a runtime holds training it)."""
    if precision is not None:
        plan = replace(plan, precision=precision)
    costs = costs or plan_costs(plan, layer_graph, cluster)
    peaks = _layout(plan).peak_memory(plan, costs)
    return [costs.static_bytes[r] + peaks[r][0] for r in range(plan.num_ranks)]


def dp_layer(c: LayerCost) -> dp.DPLayer:
    """A layer's figures for the DP stream (:mod:`vlmcompile.sim.dp`)."""
    return dp.DPLayer(
        c.name,
        fwd=c.f_s,
        bwd=c.input_grad_s + c.weight_grad_s + c.bwd_tp_comm_s,
        weight_grad=c.weight_grad_s,
        gather=c.dp_all_gather_s,
        reduce=c.dp_reduce_s,
    )


def _run(timed: Timed, stage: StageCost, dp_wait_s: float, scale: float) -> ActionRun:
    """What the action's time was spent on: compute, TP collectives, waiting for parameters."""
    kind = timed.action.kind
    return ActionRun(
        timed.rank,
        timed.step,
        timed.action,
        timed.start_s,
        timed.end_s,
        stage.compute_s(kind) * scale,
        stage.tp_comm_s(kind) * scale,
        dp_wait_s=dp_wait_s,
    )


def _kernel_level_runs(
    runs: list[ActionRun], hosts: dict[Action, tuple[Action, ...]], fills: dict[Action, HostFill]
) -> list[ActionRun]:
    """Riders run inside their hosts' intervals: a host's compute stream runs its own compute
    and the riders' share, and idles for the rest of it (counted as the host's TP collectives),
    so busy time plus idle causes still add up to the step on every rank."""
    out = []
    for run in runs:
        if run.action in hosts:
            out.append(replace(run, tp_comm_s=0.0, inside=hosts[run.action][0]))
        elif run.action in fills:
            riders = fills[run.action].rider_compute
            idle = (run.end_s - run.start_s) - run.compute_s - riders - run.dp_wait_s
            out.append(replace(run, tp_comm_s=max(0.0, idle), rider_compute_s=riders))
        else:
            out.append(run)
    return out


def _bubbles(runs: list[ActionRun], num_ranks: int, step: float, compute_end: float) -> list[Bubble]:
    """Idle intervals between actions, each with its cause (see the module docstring)."""
    by_rank: dict[int, list[ActionRun]] = defaultdict(list)
    for run in runs:
        if run.inside is None:  # a rider runs within its hosts' intervals
            by_rank[run.rank].append(run)
    first_start = min(r.start_s for r in runs)
    out = []
    for rank in range(num_ranks):
        mine = sorted(by_rank[rank], key=lambda r: r.start_s)
        if first_start > 0:
            out.append(Bubble(rank, 0.0, first_start, "dp_all_gather"))
        if mine[0].start_s > first_start:
            out.append(Bubble(rank, first_start, mine[0].start_s, "pp_warmup"))
        for prev, nxt in zip(mine, mine[1:]):
            if nxt.start_s > prev.end_s:
                out.append(Bubble(rank, prev.end_s, nxt.start_s, "pp_other"))
        if compute_end > mine[-1].end_s:
            out.append(Bubble(rank, mine[-1].end_s, compute_end, "pp_cooldown"))
        if step > compute_end:
            out.append(Bubble(rank, compute_end, step, "dp_reduce_scatter"))
    return out


def _rank_stats(
    plan: Plan,
    runs: list[ActionRun],
    bubbles: list[Bubble],
    costs: PlanCosts,
    peaks: list[tuple[float, int]],
) -> tuple[RankStats, ...]:
    by_rank: list[list[ActionRun]] = [[] for _ in range(plan.num_ranks)]
    for r in runs:
        by_rank[r.rank].append(r)
    idle = [dict.fromkeys(CAUSES, 0.0) for _ in range(plan.num_ranks)]
    for b in bubbles:
        idle[b.rank][b.cause] += b.end_s - b.start_s
    stats = []
    for rank, mine in enumerate(by_rank):
        idle[rank]["dp_all_gather"] += sum(r.dp_wait_s for r in mine)
        idle[rank]["tp_comm"] += sum(r.tp_comm_s for r in mine)
        busy = sum(r.compute_s for r in mine)
        peak, peak_step = peaks[rank]
        static = costs.static_bytes[rank]
        stats.append(RankStats(rank, busy, idle[rank], static + peak, peak_step, static))
    return tuple(stats)


def _held_order(
    mine: list[tuple[int, Action]], hosts: dict[Action, tuple[Action, ...]]
) -> list[tuple[int, Action]]:
    """A rank's (step, action)s in the order their activations are held and freed: a
    kernel-level backward frees its microbatch's when its last host ends."""
    step = dict((a, s) for s, a in mine)

    def held_until(run: tuple[int, Action]) -> float:
        s, a = run
        if a.kind is not ActionKind.F and a in hosts:
            return step[hosts[a][-1]] + 0.5
        return s

    return sorted(mine, key=held_until)


def _peak_of(first: dict[MemoryPattern, int], costs: PlanCosts) -> tuple[float, int]:
    """:func:`_peak_memory` from a rank's distinct patterns, each at the step it first holds at
    (in that order, so the first step at the peak is the same)."""
    keep = [s.act_bytes for s in costs.stages]
    transient = [s.transient_bytes for s in costs.stages]
    peak, peak_step = 0.0, next(iter(first.values()), 0)
    for pattern, s in first.items():
        here = pattern_bytes(pattern, keep, transient) + 0.0
        if here > peak:
            peak, peak_step = here, s
    return peak, peak_step


def _peak_memory(
    mine: list[tuple[int, Action]],
    costs: PlanCosts,
    hosts: dict[Action, tuple[Action, ...]],
    carried: dict[Action, Action],
) -> tuple[float, int]:
    """The most activation bytes a rank holds while any of its actions (step, action) runs
    (:mod:`vlmcompile.sim.in_flight`, run-ahead outputs included), and that action's step. A
    kernel-level backward frees its microbatch's activations when its last host ends, not where
    it is listed."""
    ordered = _held_order(mine, hosts)
    keep = [s.act_bytes for s in costs.stages]
    transient = [s.transient_bytes for s in costs.stages]
    peak, peak_step = 0.0, ordered[0][0] if ordered else 0
    acts = [a for _, a in ordered]
    across = held_across_steps(acts, carried, [s.out_bytes for s in costs.stages])
    for (s, _), pattern, held in zip(ordered, in_flight(acts), across):
        here = pattern_bytes(pattern, keep, transient) + held
        if here > peak:
            peak, peak_step = here, s
    return peak, peak_step
