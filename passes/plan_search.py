"""Plan search: the parallel degrees (TP, PP, DP, microbatch size, v) for a cluster.

Every combination the cluster allows is a candidate (TP a power of two within a node, PP
dividing what TP leaves, DP the rest, a microbatch size dividing the per-replica batch, v > 1
only where interleaving applies). Candidates are visited in order of a lower bound on their
step time - every layer's forward and backward spread over the PP ranks with no bubble,
m x sum(F + B) / pp - and

* rejected without solving when their model states alone, split evenly over the PP ranks,
  exceed the memory cap, or when the lower bound is no better than the best plan found;
* otherwise partitioned by CP-SAT (:func:`~vlmcompile.passes.partition.partition`) and
  simulated; the fastest simulated plan that fits wins.

Work is reused: layer costs per (TP, DP, microbatch size) are computed once for the bounds,
and the plan of a solved candidate warm-starts the next one with the same PP x v.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tabulate import tabulate
from vlmcompile.cost_models.memory import model_state_bytes, usable_memory_bytes
from vlmcompile.cost_models.stage_costs import layer_costs
from vlmcompile.passes.partition import partition

from vlmcompile.cluster import Cluster
from vlmcompile.errors import ClusterError, PlanError, positive_int
from vlmcompile.layer_graph import LayerGraph
from vlmcompile.plan import Parallel, Plan, Training
from vlmcompile.simulator import SimResult


@dataclass(frozen=True, slots=True)
class Degrees:
    tp: int
    pp: int
    dp: int
    v: int
    microbatch_size: int
    num_microbatches: int

    def __str__(self) -> str:
        return f"DP={self.dp} TP={self.tp} PP={self.pp} V={self.v} mb={self.microbatch_size}x{self.num_microbatches}"


@dataclass(frozen=True, slots=True)
class CandidateRow:
    degrees: Degrees
    outcome: str
    """chosen, planned (slower than the chosen), pruned, or failed."""
    reason: str
    lower_bound_s: float
    step_s: float | None = None
    peak_bytes: float | None = None


@dataclass(frozen=True, slots=True)
class SearchReport:
    cluster: str
    candidates: tuple[CandidateRow, ...]
    wall_s: float
    chosen: Plan | None = None
    sim: SimResult | None = field(default=None, repr=False)

    def table(self, limit: int | None = 40) -> str:
        order = {"chosen": 0, "planned": 1, "failed": 2, "pruned": 3}
        rows = sorted(self.candidates, key=lambda c: (order[c.outcome], c.step_s or c.lower_bound_s))
        shown = rows if limit is None else rows[:limit]
        lines = [
            [
                str(c.degrees),
                c.outcome,
                f"{c.step_s * 1e3:.1f}" if c.step_s is not None else "-",
                f"{c.lower_bound_s * 1e3:.1f}",
                f"{c.peak_bytes / 2**30:.1f}" if c.peak_bytes is not None else "-",
                c.reason,
            ]
            for c in shown
        ]
        table = tabulate(
            lines,
            headers=["degrees", "outcome", "simulated ms", "lower bound ms", "peak GiB", "why"],
            disable_numparse=True,
        )
        more = f"\n... and {len(rows) - len(shown)} more" if len(shown) < len(rows) else ""
        return table + more

    def __str__(self) -> str:
        counts = {k: sum(c.outcome == k for c in self.candidates) for k in ("planned", "pruned", "failed")}
        head = (
            f"plan search on {self.cluster}: {len(self.candidates)} candidates in {self.wall_s:.1f} s "
            f"({counts['planned'] + 1 if self.chosen else counts['planned']} planned, {counts['pruned']} pruned, "
            f"{counts['failed']} failed)"
        )
        return f"{head}\n{self.table()}"


def candidates(
    layer_graph: LayerGraph,
    cluster: Cluster,
    *,
    global_batch: int,
    tp_choices: Sequence[int] | None = None,
    pp_choices: Sequence[int] | None = None,
    dp_choices: Sequence[int] | None = None,
    microbatch_sizes: Sequence[int] = (1, 2, 4),
    v_choices: Sequence[int] = (1, 2, 4),
) -> list[Degrees]:
    num_layers = len(layer_graph.layers)
    tps = tp_choices or [
        t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node and cluster.num_gpus % t == 0
    ]
    out = []
    for tp in tps:
        for pp in range(1, min(num_layers, cluster.num_gpus // tp) + 1):
            if (cluster.num_gpus // tp) % pp or (pp_choices is not None and pp not in pp_choices):
                continue
            dp = cluster.num_gpus // (tp * pp)
            if dp_choices is not None and dp not in dp_choices:
                continue
            for mbs in microbatch_sizes:
                if global_batch % (dp * mbs):
                    continue
                m = global_batch // (dp * mbs)
                for v in v_choices:
                    if v > 1 and (pp == 1 or m % pp or pp * v > num_layers):
                        continue
                    out.append(Degrees(tp, pp, dp, v, mbs, m))
    return out


def plan_search(
    layer_graph: LayerGraph,
    cluster: Cluster,
    *,
    global_batch: int,
    tp_choices: Sequence[int] | None = None,
    pp_choices: Sequence[int] | None = None,
    dp_choices: Sequence[int] | None = None,
    microbatch_sizes: Sequence[int] = (1, 2, 4),
    v_choices: Sequence[int] = (1, 2, 4),
    include: Iterable[Degrees] = (),
    warm_starts: Mapping[Degrees, Plan] | None = None,
    time_limit_s: float = 3.0,
    progress: bool = True,
) -> tuple[Plan, SearchReport]:
    """The fastest plan (simulated) over the degrees the cluster allows; see the module docstring.

    Args:
        include: degrees to consider on top of the enumerated ones (e.g. a paper's).
        warm_starts: plans already made at some degrees (e.g. our partition at a paper's, with a
            longer time limit): the partition of those candidates starts from them, so the search
            never returns a slower plan than one it was given.
        time_limit_s: CP-SAT's limit per candidate.
        progress: a progress bar on stderr.

    Raises:
        PlanError: no candidate fits; the message names the least memory any needs and the knobs.
    """
    positive_int("global_batch", global_batch, "the samples per training step")
    start = time.perf_counter()
    todo = list(
        dict.fromkeys(
            [
                *include,
                *candidates(
                    layer_graph,
                    cluster,
                    global_batch=global_batch,
                    tp_choices=tp_choices,
                    pp_choices=pp_choices,
                    dp_choices=dp_choices,
                    microbatch_sizes=microbatch_sizes,
                    v_choices=v_choices,
                ),
            ]
        )
    )
    if not todo:
        only_dp = f" and DP in {list(dp_choices)}" if dp_choices is not None else ""
        raise PlanError(
            f"no parallel degrees divide global batch {global_batch} over {cluster.num_gpus} GPUs with microbatch sizes "
            f"{list(microbatch_sizes)}{only_dp}; use a global batch that is a multiple of the GPU count"
        )
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    costs_cache: dict = {}
    bounds = {d: _bounds(layer_graph, cluster, d, costs_cache) for d in todo}
    todo.sort(key=lambda d: bounds[d][0])
    rows: list[CandidateRow] = []
    best: tuple[float, Plan, SimResult, Degrees] | None = None
    hints: dict[tuple[int, int], Plan] = {}
    least_states = min(b[1] for b in bounds.values())
    bar = _progress(len(todo), progress)
    for d in todo:
        bar.update(1)
        lower, states = bounds[d]
        if states > cap:
            rows.append(
                CandidateRow(d, "pruned", f"model states alone need {states / 2**30:.1f} GiB per rank", lower)
            )
            continue
        if best is not None and lower >= best[0]:
            rows.append(
                CandidateRow(d, "pruned", f"lower bound >= best found ({best[0] * 1e3:.1f} ms)", lower)
            )
            continue
        try:
            result = partition(
                layer_graph,
                cluster,
                tp=d.tp,
                pp=d.pp,
                v=d.v,
                microbatch_size=d.microbatch_size,
                global_batch=global_batch,
                time_limit_s=time_limit_s,
                warm_start=(warm_starts or {}).get(d) or hints.get((d.pp, d.v)),
            )
        except (PlanError, ClusterError) as err:
            rows.append(CandidateRow(d, "failed", str(err).split(": ", 1)[-1][:120], lower))
            continue
        sim = result.report.sim
        hints[(d.pp, d.v)] = result.plan
        peak = max(sim.peak_mem_bytes)
        rows.append(
            CandidateRow(d, "planned", result.report.solution.summary(), lower, sim.step_time_s, peak)
        )
        if peak <= cap and (best is None or sim.step_time_s < best[0]):
            best = (sim.step_time_s, result.plan, sim, d)
        bar.set_postfix_str(f"best {best[0] * 1e3:.0f} ms" if best else "none fits yet")
    bar.close()
    if best is None:
        raise PlanError(_no_plan_message(rows, cap, cluster.name, least_states))
    rows = [
        CandidateRow(
            r.degrees, "chosen", "fastest simulated plan that fits", r.lower_bound_s, r.step_s, r.peak_bytes
        )
        if r.degrees == best[3] and r.outcome == "planned"
        else r
        for r in rows
    ]
    report = SearchReport(cluster.name, tuple(rows), time.perf_counter() - start, best[1], best[2])
    return best[1], report


def _no_plan_message(rows: Sequence[CandidateRow], cap: float, cluster: str, least_states: float) -> str:
    """Why every candidate lost, by cause: planning errors (grouped by message), plans over the
    memory cap (the least peak), candidates pruned by their model states."""
    gib = 2**30
    parts = []
    failed: dict[str, list[Degrees]] = {}
    for r in rows:
        if r.outcome == "failed":
            failed.setdefault(r.reason, []).append(r.degrees)
    for reason, degrees in sorted(failed.items(), key=lambda kv: -len(kv[1])):
        parts.append(f"{len(degrees)} could not be planned ({reason}; e.g. {degrees[0]})")
    over = [r for r in rows if r.outcome == "planned" and r.peak_bytes is not None]
    if over:
        least = min(over, key=lambda r: r.peak_bytes)
        parts.append(
            f"{len(over)} planned but over the cap (least peak {least.peak_bytes / gib:.1f} GiB at {least.degrees})"
        )
    pruned = sum(r.outcome == "pruned" for r in rows)
    if pruned:
        parts.append(
            f"{pruned} pruned: their model states alone exceed the cap (least {least_states / gib:.1f} GiB per rank)"
        )
    return (
        f"no parallel plan fits in {cap / gib:.1f} GiB per rank on {cluster}, of {len(rows)} candidates: "
        + "; ".join(parts)
        + ". Fix the planning errors above, or for memory: more GPUs (more PP / TP), ZeRO-2/3, smaller microbatches"
    )


def _bounds(layer_graph: LayerGraph, cluster: Cluster, d: Degrees, cache: dict) -> tuple[float, float]:
    """(step-time lower bound, model states per rank if split evenly over the PP ranks); layer
    costs depend on TP, DP and the microbatch only, so ``cache`` holds them per that key."""
    par = Parallel(dp=d.dp, tp=d.tp, pp=d.pp, v=d.v)
    key = (d.tp, d.dp, d.microbatch_size)
    try:
        if key not in cache:
            cache[key] = layer_costs(layer_graph, cluster, par, microbatch_size=d.microbatch_size)
    except ClusterError:
        return float("inf"), float("inf")
    costs = cache[key]
    work = sum(c.fwd_s + c.fwd_tp_comm_s + c.input_grad_s + c.weight_grad_s + c.bwd_tp_comm_s for c in costs)
    states = sum(
        model_state_bytes(c.num_params, Training(), dp=d.dp, zero_stage=par.zero_stage).total for c in costs
    )
    return d.num_microbatches * work / d.pp, states / d.pp


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total, desc="plan search", unit="candidate", disable=not enabled, file=sys.stderr, leave=False
    )
