"""OmniBal baseline (Yang et al., ICML; shared/papers/omnibal_method.md, sec. 4.2-4.3).

Balanced model partitioning:

1. an anchor from the layers' forward times: cut k at the layer boundary whose prefix of
   forward time is closest to k / S of the total (a greedy pass, every stage non-empty);
2. candidates: every cut jittered within radius r ((2r + 1)^(S-1) of them; the paper finds the
   optimum within r <= 3); when there are more than ``max_candidates``, a seeded random sample;
3. ranked by VAR(stage forward time) + SUM(comm), the paper's metric. The paper adds a variance
   of times and a count of activations; we put both in milliseconds (variance in ms^2, the
   activations of each cut as their transfer time on the pipeline link) so that the sum means
   the same on every cluster;
4. the top K (paper: 10-15) are run - here simulated - and the fastest that fits is kept.

Balanced adaptive recompute: for each candidate, per rank, start from no recompute and, while
the rank is over its memory, recompute one more layer - the one that frees the most (vision
and LLM layers are priced separately: each by its own saved bytes per microbatch in flight).
The simulator then checks the plan ("training test"); a rank still over gets one more layer.

Costs are the cost model's, like every policy here; the paper profiles them on the GPUs.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np
from tabulate import tabulate

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import ranks_over
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Reason, Recompute
from vlmcompile.planning.build import build_plan
from vlmcompile.planning.chunks import chunks_by_stage, stage_of_counts
from vlmcompile.planning.partition_problem import PartitionProblem, evaluate, partition_problem
from vlmcompile.planning.request import NotApplicable, PlanRequest
from vlmcompile.planning.result import PolicyResult
from vlmcompile.sim.simulator import simulate
from vlmcompile.sim.units import column_decimals, format_ms


def anchor_counts(fwd_s: list[float] | tuple[float, ...], num_stages: int) -> list[int]:
    """Layers per stage of the greedy anchor: cut k where the forward prefix is closest to k/S."""
    n = len(fwd_s)
    if num_stages > n:
        raise NotApplicable(f"{num_stages} stages for {n} layers; every stage needs a layer")
    prefix = np.concatenate([[0.0], np.cumsum(fwd_s)])
    cuts, prev = [], 0
    for k in range(1, num_stages):
        target = prefix[-1] * k / num_stages
        lo, hi = prev + 1, n - (num_stages - k)  # leave a layer for every later stage
        cut = min(range(lo, hi + 1), key=lambda c: abs(prefix[c] - target))
        cuts.append(cut)
        prev = cut
    bounds = [0, *cuts, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def jittered(cuts: tuple[int, ...], n: int, radius: int, limit: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Cut positions within ``radius`` of ``cuts`` (strictly increasing, inside 1..n-1)."""

    def valid(c: tuple[int, ...]) -> bool:
        return all(a < b for a, b in zip((0, *c), (*c, n)))

    offsets = range(-radius, radius + 1)
    total = len(offsets) ** len(cuts)
    if total <= limit:
        out = [tuple(c + d for c, d in zip(cuts, ds)) for ds in itertools.product(offsets, repeat=len(cuts))]
    else:
        rng = random.Random(seed)
        out = {cuts} | {tuple(c + rng.choice(offsets) for c in cuts) for _ in range(limit)}
    return sorted({c for c in out if valid(c)})


@dataclass(frozen=True, slots=True)
class Candidate:
    cuts: tuple[int, ...]
    metric: float
    """VAR(fwd ms) + SUM(comm ms)."""
    step_s: float | None = None
    """Simulated, for the top K."""
    fits: bool | None = None
    recomputed: int = 0


@dataclass(frozen=True, slots=True)
class OmniBalReport:
    anchor: tuple[int, ...]
    num_candidates: int
    evaluated: tuple[Candidate, ...]

    def __str__(self) -> str:
        decimals = column_decimals(c.step_s for c in self.evaluated)
        rows = [
            [
                " ".join(map(str, c.cuts)),
                f"{c.metric:.3f}",
                format_ms(c.step_s, decimals=decimals),
                c.recomputed,
                "yes" if c.fits else "no",
            ]
            for c in self.evaluated
        ]
        table = tabulate(
            rows,
            headers=["cuts (first layer of stages 1..)", "VAR+SUM ms", "simulated ms", "recomputed", "fits"],
            disable_numparse=True,
        )
        return (
            f"OmniBal: anchor cuts {' '.join(map(str, self.anchor))}; {self.num_candidates} candidates; "
            f"top {len(self.evaluated)} simulated:\n{table}"
        )


def adaptive_recompute(problem: PartitionProblem, stage_of: tuple[int, ...]) -> list[bool] | None:
    """Fewest recomputed layers per rank that bring every rank within memory (None: impossible)."""
    in_flight = problem.most_in_flight
    saving = [
        in_flight[k] * (problem.act_bytes[i] - problem.act_bytes_recompute[i])
        if problem.recomputable[i]
        else 0.0
        for i, k in enumerate(stage_of)
    ]
    flags = [False] * problem.num_layers
    while True:
        peaks = evaluate(problem, stage_of, flags).peak_bytes
        over = ranks_over(peaks, problem.mem_cap_bytes)
        if not over:
            return flags
        for r in over:
            options = [
                i
                for i, k in enumerate(stage_of)
                if problem.rank_of_stage[k] == r and not flags[i] and saving[i] > 0
            ]
            if not options:
                return None
            flags[max(options, key=lambda i: (saving[i], -i))] = True


def omnibal(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    radius: int = 1,
    top_k: int = 10,
    max_candidates: int = 5000,
) -> PolicyResult:
    """OmniBal's partition and adaptive recompute for ``request`` (see the module docstring).

    Args:
        radius: how far each anchor cut is jittered (the paper finds the optimum within 3).
        top_k: candidates simulated, best VAR + SUM metric first (the paper: 10-15).
        max_candidates: above this many jittered cuts, a seeded random sample of them.
    """
    request.check_on(cluster)
    problem = partition_problem(layer_graph, cluster, request)
    S, n = problem.num_stages, problem.num_layers
    counts = anchor_counts(problem.fwd_s, S)
    anchor = tuple(int(x) for x in np.cumsum(counts)[:-1])
    candidates = jittered(anchor, n, radius, max_candidates)
    prefix = np.concatenate([[0.0], np.cumsum(problem.fwd_s)])

    def metric(cuts: tuple[int, ...]) -> float:
        bounds = np.array([0, *cuts, n])
        stage_ms = (prefix[bounds[1:]] - prefix[bounds[:-1]]) * 1e3
        comm = sum(problem.send_fwd_s[k][c - 1] + problem.send_bwd_s[k][c - 1] for k, c in enumerate(cuts))
        return float(((stage_ms - stage_ms.mean()) ** 2).sum() + comm * 1e3)

    ranked = sorted(candidates, key=metric)[:top_k]
    evaluated, best, best_plan = [], None, None
    for cuts in ranked:
        stage_of = stage_of_counts(np.diff([0, *cuts, n]))
        flags = adaptive_recompute(problem, stage_of)
        if flags is None:
            evaluated.append(Candidate(cuts, metric(cuts), fits=False))
            continue
        while True:  # the "training test": add a layer on any rank the simulator finds over
            recompute = {n: Recompute.FULL for n, f in zip(problem.names, flags) if f}
            plan = build_plan(
                layer_graph,
                cluster,
                request,
                policy="omnibal",
                chunks=chunks_by_stage(problem.names, stage_of, S),
                recompute=recompute,
                decisions=_decisions(layer_graph, anchor, len(candidates), cuts, metric(cuts), recompute),
            )
            sim = simulate(plan, layer_graph, cluster)
            over = ranks_over(sim.peak_mem_bytes, sim.mem_cap_bytes)
            extra = [
                i
                for i, k in enumerate(stage_of)
                if problem.rank_of_stage[k] in over and not flags[i] and problem.recomputable[i]
            ]
            if not over or not extra:
                break
            flags[extra[0]] = True
        evaluated.append(Candidate(cuts, metric(cuts), sim.step_time_s, sim.fits, sum(flags)))
        if sim.fits and (best is None or sim.step_time_s < best.step_time_s):
            best, best_plan = sim, plan
    if best is None:
        raise PlanError(
            f"none of OmniBal's top {len(ranked)} partitions fits in {problem.mem_cap_bytes / 2**30:.1f} "
            f"GiB per rank even with recompute on every layer; use more PP or TP or a smaller microbatch"
        )
    return PolicyResult(
        plan=best_plan,
        sim=best,
        report=OmniBalReport(anchor, len(candidates), tuple(evaluated)),
        recompute=f"per layer ({len(best_plan.recompute)})",
    )


def _decisions(layer_graph, anchor, num_candidates, cuts, metric, recompute) -> list[Decision]:
    regions: dict[str, int] = {}
    for n in recompute:
        region = str(layer_graph[n].region)
        regions[region] = regions.get(region, 0) + 1
    return [
        Decision(
            "stage cuts",
            Reason.GREEDY_ANCHOR,
            f"anchor from forward times: first layers of stages 1.. at {list(anchor)}",
        ),
        Decision(
            "stage cuts",
            Reason.JITTERED_CUTS,
            f"{num_candidates} candidates within the radius, ranked by VAR(fwd ms) + SUM(comm ms); this one "
            f"{list(cuts)} (metric {metric:.3f}) simulates fastest of the top K that fit",
            {"metric": metric},
        ),
        Decision(
            "recompute",
            Reason.ADAPTIVE_RECOMPUTE,
            f"{len(recompute)} layers recomputed ({', '.join(f'{k} {v}' for k, v in regions.items()) or 'none'}): "
            "the fewest per rank that fit, largest saving first",
        ),
    ]
