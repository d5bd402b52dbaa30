"""Lower bounds on the objectives of the partition's CP-SAT models (:mod:`vlmcompile.planning.stage_cuts`),
in the models' own rounded units, so that each solve is given its bound as a constraint.

On paper-scale problems (150 layers in 32 stages) CP-SAT's own bound stays at zero for seconds:
its first seconds go to presolve, and its relaxation spreads a layer over stages. The bounds
here keep layers whole. Both are :class:`~vlmcompile.planning.cut_lagrangian.CutTerms`
relaxations over every contiguous cut and every recompute choice that keeps each rank within the
cap at every moment the model checks (each in-flight pattern of its action list; the recompute
transient, at least zero, left out), solved by Kelley's cutting planes:

* **closed form** (``v T = (v m - 1) max_r W_r + sum_k (F_k + B_k) + v tail``, the cut transfers
  left to the timeline model, as the CP-SAT model states it): rank r's ``max`` term is
  ``(v m - 1) W_r`` plus the work every rank shares; the DP tail is the ``max0`` group
  ``v (R_r - sum_{k <= r} B_k)``;
* **timeline**: a rank runs its actions one at a time; its first action, a forward of stage k,
  waits for that microbatch's forwards of stages 0..k-1, and when its last is a backward of
  stage k the backwards of stages k-1..0 still follow. So the step is at least, for every rank,
  those forwards, its own actions and those backwards, with the transfers of the cuts both
  chains cross; and, as the model starts a rank's DP reduction with its last backward, at least
  those forwards, the actions before that backward and the reduction (other transfers only add).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vlmcompile.ir.actions import ActionKind
from vlmcompile.planning.cut_lagrangian import CutLayers, CutTerms, Term
from vlmcompile.planning.partition_problem import PartitionProblem


@dataclass(frozen=True)
class Units:
    """The rounding of a CP-SAT model: its times, its bytes (rounded up) and its cap (rounded down)."""

    time: Callable[[float], int]
    mem: Callable[[float], int]
    cap: int


def closed_form_bound(problem: PartitionProblem, units: Units, seconds: float = math.inf) -> int:
    """The least closed-form objective (``v T`` in time units) of any cut and recompute that fits."""
    p, S, v = problem.num_ranks, problem.num_stages, problem.v
    ranks = np.asarray(problem.rank_of_stage)
    slowest = v * problem.num_microbatches - 1
    work = [slowest * (ranks == r) + 1.0 for r in range(p)]
    terms = [Term("max", {"fwd": w, "bwd": w}) for w in work]
    if any(problem.reduce_s):
        terms += [
            Term("max0", {"reduce": v * (ranks == r), "bwd": -v * (np.arange(S) <= r)}) for r in range(p)
        ]
    return _solved(problem, units, terms, seconds=seconds)


def timeline_bound(problem: PartitionProblem, units: Units, seconds: float = math.inf) -> int:
    """The least step of the timeline model (time units) of any cut and recompute that fits."""
    S = problem.num_stages
    terms = []
    for acts in problem.actions:
        counts = {"fwd": np.zeros(S), "bwd": np.zeros(S)}
        for a in acts:
            counts["fwd" if a.kind is ActionKind.F else "bwd"][a.stage] += 1
        if acts and acts[0].kind is ActionKind.F:
            counts["fwd"][: acts[0].stage] += 1
        if acts and acts[-1].kind is ActionKind.B:
            counts["bwd"][: acts[-1].stage] += 1
        # A cut both chains cross sends both ways in this rank's term (before its first forward
        # and after its last backward); each cut's figure is its two transfers together.
        first = acts[0].stage if acts and acts[0].kind is ActionKind.F else 0
        crossed = min(first, acts[-1].stage if acts and acts[-1].kind is ActionKind.B else 0)
        terms.append(Term("max", counts, sends=1.0 * (np.arange(S - 1) < crossed)))
        backwards = [i for i, a in enumerate(acts) if a.kind is ActionKind.B]
        if backwards and any(problem.reduce_s):
            # The model's DP reduction starts with the rank's last backward: after the forwards it
            # waits for and every action before that backward in its list.
            head = {"fwd": np.zeros(S), "bwd": np.zeros(S)}
            for a in acts[: backwards[-1]]:
                head["fwd" if a.kind is ActionKind.F else "bwd"][a.stage] += 1
            head["fwd"][:first] += 1
            ranks = np.asarray(problem.rank_of_stage)
            head["reduce"] = 1.0 * (ranks == ranks[acts[backwards[-1]].stage])
            terms.append(Term("max", head))
    sends = np.array(
        [
            [units.time(f) + units.time(b) for f, b in zip(*rows)]
            for rows in zip(problem.send_fwd_s, problem.send_bwd_s)
        ],
        dtype=float,
    ).reshape(S - 1, problem.num_layers)
    return _solved(problem, units, terms, sends, seconds=seconds)


def _solved(
    problem: PartitionProblem,
    units: Units,
    terms: list[Term],
    sends: np.ndarray | None = None,
    *,
    seconds: float = math.inf,
) -> int:
    time, mem = units.time, units.mem
    can = np.array(problem.recomputable, dtype=bool)
    keep = np.array([mem(x) for x in problem.act_bytes], dtype=float)
    least_keep = np.array([mem(x) for x in problem.act_bytes_recompute], dtype=float)
    layers = CutLayers(
        fwd=np.array([time(x) for x in problem.fwd_s], dtype=float),
        bwd=np.array([time(x) for x in problem.bwd_s], dtype=float),
        redo=np.where(can, [time(x) for x in problem.redo_s], 0.0),
        reduce=np.array([time(x) for x in problem.reduce_s], dtype=float),
        state=np.array([mem(x) for x in problem.state_bytes], dtype=float),
        keep=keep,
        saved=np.where(can, np.maximum(keep - least_keep, 0.0), 0.0),
        sends=sends,
    )
    ranks = np.asarray(problem.rank_of_stage)
    for r, patterns in enumerate(problem.memory_patterns):
        for live, _ in patterns:
            held = np.zeros(problem.num_stages)
            for k, n in live:
                held[k] = n
            terms.append(Term("within", {"state": 1.0 * (ranks == r), "keep": held}, constant=-units.cap))
    cut = CutTerms(layers, tuple(terms), problem.num_stages)
    # bytes weighed against one microbatch's work (the LP's scaling)
    value = cut.best_bound(
        scale=cut.scale(float(layers.fwd.sum() + layers.bwd.sum()), problem.num_microbatches), seconds=seconds
    )
    # The objective is an integer; the float sums behind the value may overshoot it by a rounding error.
    return max(0, int(np.floor(value - 1e-9 * abs(value))))
