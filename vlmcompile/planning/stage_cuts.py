"""Stage cuts and per-layer recompute flags as one integer program (OR-Tools CP-SAT).

The numbers are a :class:`~vlmcompile.planning.problem.PartitionProblem`.

Layers go, in order, into S = p x v consecutive stages; stage k runs on rank k mod p
(Megatron's interleaved placement). The step time modelled is

    T = [(v m - 1) max_r W_r + sum_k (F_k + B_k) + sum_cuts (send + receive)] / v + tail

with F_k, B_k the forward and backward (recompute included) of stage k for one microbatch and
W_r the work of rank r per microbatch. For v = 1 this is 1F1B's (m - 1) x slowest stage + the
fill and drain of every stage (Narayanan et al. 2021); for uniform stages it is interleaved
1F1B's m v t + (p - 1) t. ``tail`` is the DP gradient reduction left after the pipeline
drains: rank r starts reducing once its last backward begins, sum_{k <= r} B_k before the
end, so tail = max(0, max_r R_r - sum_{k<=r} B_k).

Memory is exact for the schedule: at every step of rank r the activations in flight (per
stage, counted from its action list) times the bytes each stage keeps, plus the recompute
transient of the stage whose backward runs, plus the rank's model states, stay within the cap.
This is the same accounting as the simulator's peak memory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from vlmcompile.planning.problem import Evaluation, PartitionProblem, evaluate
from vlmcompile.planning.request import SolverOptions


@dataclass(frozen=True, slots=True)
class Solution:
    stage_of: tuple[int, ...]
    recompute: tuple[bool, ...]
    evaluation: Evaluation
    status: str
    """CP-SAT's: OPTIMAL, FEASIBLE (stopped at the time limit with a plan), ..."""
    objective_s: float
    """The solver's objective in seconds (times rounded to its quantum)."""
    bound_s: float
    """Best proven lower bound on the objective."""
    wall_s: float
    timed_out: bool

    @property
    def gap(self) -> float:
        return (
            0.0 if self.objective_s <= 0 else max(0.0, (self.objective_s - self.bound_s) / self.objective_s)
        )

    def summary(self) -> str:
        state = "timed out; best plan found" if self.timed_out else "finished"
        return (
            f"CP-SAT {self.status} ({state}) in {self.wall_s:.2f} s: objective {self.objective_s * 1e3:.3f} ms, "
            f"bound {self.bound_s * 1e3:.3f} ms, gap {100 * self.gap:.2f} %"
        )


def _fewest_flags(problem: PartitionProblem, stage_of: Sequence[int], flags: list[bool]) -> tuple[bool, ...]:
    """Drop every recompute flag whose removal keeps the plan within memory and no slower.

    Recomputing a layer whose redo time rounds to nothing, or one off the slowest rank, can
    cost the objective nothing; such flags are dropped here rather than by a tie-break term in
    the objective, which made optimality much slower to prove.
    """
    best = evaluate(problem, stage_of, flags).step_s
    for i in range(len(flags)):
        if flags[i]:
            flags[i] = False
            trial = evaluate(problem, stage_of, flags)
            if trial.fits and trial.step_s <= best * (1 + 1e-12):
                best = trial.step_s
            else:
                flags[i] = True
    return tuple(flags)


def _same_layer(problem: PartitionProblem, i: int, j: int, t, mem) -> bool:
    """Same costs after rounding (the cut after a layer may differ: it is not a layer's own cost)."""
    return (
        t(problem.fwd_s[i]) == t(problem.fwd_s[j])
        and t(problem.bwd_s[i]) == t(problem.bwd_s[j])
        and t(problem.redo_s[i]) == t(problem.redo_s[j])
        and t(problem.reduce_s[i]) == t(problem.reduce_s[j])
        and all(
            mem(getattr(problem, f)[i]) == mem(getattr(problem, f)[j])
            for f in ("act_bytes", "act_bytes_recompute", "transient_bytes", "state_bytes")
        )
    )


class Infeasible(Exception):
    def __init__(self, status: str, wall_s: float):
        super().__init__(status)
        self.status, self.wall_s = status, wall_s


def solve(
    problem: PartitionProblem,
    options: SolverOptions = SolverOptions(),
    *,
    hint: tuple[Sequence[int], Sequence[bool]] | None = None,
    time_quantum_s: float | None = None,
    mem_quantum_bytes: float | None = None,
    minimize_memory: bool = False,
) -> Solution:
    """Solve ``problem`` with CP-SAT; raise :class:`Infeasible` when no assignment fits.

    Times are rounded to ``time_quantum_s`` (default: a millionth of one microbatch's total
    work) and memory to ``mem_quantum_bytes`` (default: a millionth of the cap; demands round
    up, the cap down, so a solution that fits here fits in bytes). With ``minimize_memory`` the
    cap is dropped and the objective is the largest rank peak instead (for error messages).
    """
    L, p, v, m, S = (
        problem.num_layers,
        problem.num_ranks,
        problem.v,
        problem.num_microbatches,
        problem.num_stages,
    )
    if S > L:
        raise ValueError(f"{S} stages (pp x v = {p} x {v}) for {L} layers; every stage needs a layer")
    total = sum(problem.fwd_s) + sum(problem.bwd_s) + sum(problem.redo_s) + sum(problem.cut_s[: L - 1])
    qt = time_quantum_s or max(total, 1e-30) / 1e6
    qm = mem_quantum_bytes or max(problem.mem_cap_bytes, 1.0) / 1e6

    def t(x: float) -> int:
        return round(x / qt)

    def mem(x: float) -> int:
        return math.ceil(x / qm - 1e-9)

    model = cp_model.CpModel()
    lo = [max(0, S - L + i) for i in range(L)]
    hi = [min(S - 1, i) for i in range(L)]
    b = {(i, k): model.new_bool_var(f"b{i}_{k}") for i in range(L) for k in range(lo[i], hi[i] + 1)}
    rec = [i for i in range(L) if problem.recomputable[i]]
    z = {(i, k): model.new_bool_var(f"z{i}_{k}") for i in rec for k in range(lo[i], hi[i] + 1)}
    st = [model.new_int_var(lo[i], hi[i], f"st{i}") for i in range(L)]
    for i in range(L):
        ks = range(lo[i], hi[i] + 1)
        model.add_exactly_one(b[i, k] for k in ks)
        model.add(st[i] == sum(k * b[i, k] for k in ks))
    for (i, k), var in z.items():
        model.add_implication(var, b[i, k])
    model.add(st[0] == 0)
    model.add(st[L - 1] == S - 1)
    cut = []
    for i in range(L - 1):
        c = model.new_bool_var(f"c{i}")
        model.add(st[i + 1] == st[i] + c)
        cut.append(c)

    members = [[i for i in range(L) if lo[i] <= k <= hi[i]] for k in range(S)]
    horizon = sum(t(problem.fwd_s[i]) + t(problem.bwd_s[i]) + t(problem.redo_s[i]) for i in range(L))
    mem_horizon = sum(mem(x) for x in problem.act_bytes) + sum(mem(x) for x in problem.state_bytes)

    # Per stage once, as variables: constraints below refer to them instead of repeating the sums.
    fwd, bwd, keep = [], [], []
    for k in range(S):
        fwd.append(model.new_int_var(0, horizon, f"F{k}"))
        model.add(fwd[k] == sum(t(problem.fwd_s[i]) * b[i, k] for i in members[k]))
        bwd.append(model.new_int_var(0, horizon, f"B{k}"))
        model.add(
            bwd[k]
            == sum(t(problem.bwd_s[i]) * b[i, k] for i in members[k])
            + sum(t(problem.redo_s[i]) * z[i, k] for i in members[k] if (i, k) in z)
        )
        keep.append(model.new_int_var(0, mem_horizon, f"A{k}"))
        model.add(
            keep[k]
            == sum(mem(problem.act_bytes[i]) * b[i, k] for i in members[k])
            - sum(
                (mem(problem.act_bytes[i]) - mem(problem.act_bytes_recompute[i])) * z[i, k]
                for i in members[k]
                if (i, k) in z
            )
        )
    static = []
    for r in range(p):
        static.append(model.new_int_var(0, mem_horizon, f"M{r}"))
        model.add(
            static[r]
            == sum(mem(problem.state_bytes[i]) * b[i, k] for k in range(r, S, p) for i in members[k])
        )
    slowest = model.new_int_var(0, horizon, "slowest_rank")
    plain_work = sum(t(problem.fwd_s[i]) + t(problem.bwd_s[i]) for i in range(L))
    model.add(slowest * p >= plain_work)  # redundant: the mean rank's work, for the bound
    for r in range(p):
        model.add(slowest >= sum(fwd[k] + bwd[k] for k in range(r, S, p)))
    reduce_total = sum(t(x) for x in problem.reduce_s)
    tail = model.new_int_var(0, reduce_total, "dp_tail")
    if reduce_total:
        for r in range(p):
            reduce_r = sum(t(problem.reduce_s[i]) * b[i, k] for k in range(r, S, p) for i in members[k])
            model.add(tail >= reduce_r - sum(bwd[k] for k in range(r + 1)))

    # Identical neighbours in one stage are interchangeable: recompute the earlier one first.
    recomputed = {}
    for i in rec:
        recomputed[i] = model.new_bool_var(f"r{i}")
        model.add(recomputed[i] == sum(z[i, k] for k in range(lo[i], hi[i] + 1)))
    for i in rec:
        if i + 1 in recomputed and _same_layer(problem, i, i + 1, t, mem):
            model.add(recomputed[i + 1] <= recomputed[i] + cut[i])

    # Memory per rank and pattern.
    transient = [
        model.new_int_var(0, mem(max(problem.transient_bytes, default=0)), f"tr{k}") for k in range(S)
    ]
    for (i, k), var in z.items():
        if problem.transient_bytes[i] > 0:
            model.add(transient[k] >= mem(problem.transient_bytes[i])).only_enforce_if(var)
    peak = model.new_int_var(0, 2**50, "peak") if minimize_memory else None
    cap = math.floor(problem.mem_cap_bytes / qm + 1e-9)
    for r in range(p):
        for live, busy in problem.memory_patterns[r]:
            used = static[r] + sum(n * keep[k] for k, n in live) + (transient[busy] if busy >= 0 else 0)
            model.add((peak if minimize_memory else cap) >= used)

    cut_cost = sum(t(problem.cut_s[i]) * cut[i] for i in range(L - 1))
    redo_cost = sum(t(problem.redo_s[i]) * var for (i, _), var in z.items())
    objective = (v * m - 1) * slowest + plain_work + redo_cost + cut_cost + v * tail
    model.minimize(peak if minimize_memory else objective)

    if hint is not None:
        # Every variable gets a value, so that CP-SAT can take the hint as its first solution.
        stage_of, flags = hint
        flags = [bool(f) and problem.recomputable[i] for i, f in enumerate(flags)]
        for (i, k), var in b.items():
            model.add_hint(var, int(stage_of[i] == k))
        for (i, k), var in z.items():
            model.add_hint(var, int(stage_of[i] == k and flags[i]))
        for i, var in recomputed.items():
            model.add_hint(var, int(flags[i]))
        for i in range(L):
            model.add_hint(st[i], stage_of[i])
        for i in range(L - 1):
            model.add_hint(cut[i], stage_of[i + 1] - stage_of[i])
        f_of, b_of, a_of, tr_of = [0] * S, [0] * S, [0] * S, [0] * S
        m_of, reduce_of = [0] * p, [0] * p
        for i, k in enumerate(stage_of):
            f_of[k] += t(problem.fwd_s[i])
            b_of[k] += t(problem.bwd_s[i]) + (t(problem.redo_s[i]) if flags[i] else 0)
            a_of[k] += mem(problem.act_bytes_recompute[i]) if flags[i] else mem(problem.act_bytes[i])
            m_of[k % p] += mem(problem.state_bytes[i])
            reduce_of[k % p] += t(problem.reduce_s[i])
            if flags[i]:
                tr_of[k] = max(tr_of[k], mem(problem.transient_bytes[i]))
        for k in range(S):
            model.add_hint(fwd[k], f_of[k])
            model.add_hint(bwd[k], b_of[k])
            model.add_hint(keep[k], a_of[k])
            model.add_hint(transient[k], tr_of[k])
        for r in range(p):
            model.add_hint(static[r], m_of[r])
        work_of = [sum(f_of[k] + b_of[k] for k in range(r, S, p)) for r in range(p)]
        model.add_hint(slowest, max(max(work_of), -(-plain_work // p)))
        model.add_hint(tail, max(0, *(reduce_of[r] - sum(b_of[: r + 1]) for r in range(p))))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = options.time_limit_s
    solver.parameters.num_workers = options.num_workers
    # CP-SAT's own SIGINT handler leaves the process's C-level handler at the default when it is
    # done, so a later Ctrl-C would kill the process without cleaning up (local ranks orphaned).
    # Python's handler stays; a Ctrl-C during a solve takes effect when the solve returns.
    solver.parameters.catch_sigint_signal = False
    start = time.perf_counter()
    status = solver.solve(model)
    wall = time.perf_counter() - start
    name = solver.status_name(status)
    if status == cp_model.UNKNOWN and hint is not None and not minimize_memory:
        # Out of time before any solution of its own: the hint is the best plan known.
        start_plan = evaluate(problem, hint[0], flags)
        if start_plan.fits:
            return Solution(
                stage_of=tuple(hint[0]),
                recompute=tuple(flags),
                evaluation=start_plan,
                status="UNKNOWN (warm start returned)",
                objective_s=start_plan.step_s,
                bound_s=min(solver.best_objective_bound * qt / v, start_plan.step_s),
                wall_s=wall,
                timed_out=True,
            )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise Infeasible(name, wall)
    stage_of = tuple(int(solver.value(s)) for s in st)
    flags = tuple(
        any(solver.value(z[i, k]) for k in range(lo[i], hi[i] + 1) if (i, k) in z) for i in range(L)
    )
    scale = qm if minimize_memory else qt / v
    if not minimize_memory:
        flags = _fewest_flags(problem, stage_of, list(flags))
    return Solution(
        stage_of=stage_of,
        recompute=flags,
        evaluation=evaluate(problem, stage_of, flags),
        status=name,
        objective_s=solver.objective_value * scale,
        bound_s=solver.best_objective_bound * scale,
        wall_s=wall,
        timed_out=status == cp_model.FEASIBLE,  # stopped by the limit, not by proving optimality
    )
