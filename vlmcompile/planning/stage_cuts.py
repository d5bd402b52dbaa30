"""Stage cuts and per-layer recompute flags as one integer program (OR-Tools CP-SAT).

The numbers are a :class:`~vlmcompile.planning.partition_problem.PartitionProblem`. Layers go, in
order, into S = p x v consecutive stages; stage k runs on the rank its placement gives it
(:mod:`vlmcompile.ir.placement`; Megatron's interleaved placement by default). Per stage its forward F_k and backward B_k (recompute included) are sums of its
layers'; per cut the transfer of the layer it follows.

The step time is modelled twice, and :func:`solve` runs the two models in turn:

* the closed form

      T = [(v m - 1) max_r W_r + sum_k (F_k + B_k)] / v + tail

  (W_r the work of rank r per microbatch: 1F1B's (m - 1) x slowest stage plus the fill and
  drain, Narayanan et al. 2021; ``tail`` the DP gradient reduction left after the drain; the
  cut transfers are the timeline's). It is quick to solve and to bound, but off the simulator's
  step by up to 24 % on random unbalanced stages;
* the timeline: every action of every rank's action list gets a start time, after the previous
  action of its rank and after the actions it depends on plus their transfer, and the step
  ends with the last action (or the DP gradient reduction a rank starts with its last
  backward). These are the rules :func:`~vlmcompile.sim.timeline.run_actions` times plans
  with, so for a given cut the model's step is the simulator's, less the overlap of the DP
  collectives (which the simulator models per layer). It starts from the closed form's plan
  and gets the time the closed form leaves, for action lists of at most
  :data:`TIMELINE_ACTIONS` actions.

Memory is exact for the schedule: at every step of rank r the activations in flight (per
stage, counted from its action list) times the bytes each stage keeps, plus the recompute
transient of the stage whose backward runs, plus the rank's model states, stay within the cap
(the simulator's accounting: :func:`~vlmcompile.planning.partition_problem.evaluate` and the property
tests hold them equal).

Each model is given a lower bound on its objective over whole layers
(:mod:`vlmcompile.planning.partition_bound`) as a constraint, computed within its time limit: on
paper-scale problems CP-SAT's own bound stayed at zero until the limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from vlmcompile.ir.actions import ActionKind, dependencies
from vlmcompile.planning.partition_bound import Units, closed_form_bound, timeline_bound
from vlmcompile.planning.partition_problem import (
    Evaluation,
    PartitionProblem,
    evaluate,
    model_step,
    stage_figures,
    stage_timeline,
)
from vlmcompile.planning.request import GAP_GOAL, SolverOptions
from vlmcompile.sim.in_flight import pattern_bytes
from vlmcompile.sim.units import format_ms

TIMELINE_ACTIONS = 6000
"""Above this many actions in the action lists, the objective is the closed form."""
BOUND_SHARE = 0.25
"""At most this share of a solve's time limit goes to its whole-layer bound (Kelley's cutting
planes stop there with the best bound so far); the rest is CP-SAT's."""


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
    objective: str = "timeline"
    """The model behind ``status``, ``objective_s`` and ``bound_s``: "timeline" (the schedule's
    actions), "closed form", or "memory"."""
    phases: tuple[str, ...] = ()
    """What each model solved, in order (closed form, then timeline)."""

    @property
    def gap(self) -> float:
        return (
            0.0 if self.objective_s <= 0 else max(0.0, (self.objective_s - self.bound_s) / self.objective_s)
        )

    def summary(self) -> str:
        """One state: optimal, or stopped at the time limit with the gap it left (never both)."""
        figures = f"objective {format_ms(self.objective_s)} ms ({self.objective}), bound {format_ms(self.bound_s)} ms"
        if self.status == "OPTIMAL" and not self.timed_out:
            head = f"CP-SAT optimal in {self.wall_s:.2f} s: {figures}"
        elif self.timed_out:
            head = (
                f"CP-SAT timed out after {self.wall_s:.2f} s with the best plan found ({self.status}): {figures}, "
                f"gap {100 * self.gap:.2f} %"
            )
        else:
            head = f"CP-SAT {self.status} in {self.wall_s:.2f} s: {figures}, gap {100 * self.gap:.2f} %"
        return head + (f" [{'; '.join(self.phases)}]" if len(self.phases) > 1 else "") + self.why_gap()

    def why_gap(self) -> str:
        """Why the gap is above :data:`~vlmcompile.planning.request.GAP_GOAL` ("" where it is not)."""
        if self.gap <= GAP_GOAL:
            return ""
        if self.status.startswith("UNKNOWN"):
            return "; the gap is the warm start's: CP-SAT found no plan of its own within its time limit"
        return (
            "; CP-SAT stopped at its time limit before closing the gap, and the bound relaxes the "
            "slowest rank and memory (cuts and recompute exact), so part of it may be the bound's"
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


class _Model:
    """The CP-SAT model of one problem, built in parts; the variables are kept for the hint and
    for reading the solution."""

    def __init__(self, problem: PartitionProblem, qt: float, qm: float):
        self.problem, self.qt, self.qm = problem, qt, qm
        self.cp = cp_model.CpModel()
        L, S = problem.num_layers, problem.num_stages
        self.lo = [max(0, S - L + i) for i in range(L)]
        self.hi = [min(S - 1, i) for i in range(L)]
        self.members = [[i for i in range(L) if self.lo[i] <= k <= self.hi[i]] for k in range(S)]
        self.plain_work = sum(self.t(problem.fwd_s[i]) + self.t(problem.bwd_s[i]) for i in range(L))
        """Every layer's forward and backward without recompute, in time units."""
        self.horizon = self.plain_work + sum(self.t(x) for x in problem.redo_s)
        self.mem_horizon = sum(self.mem(x) for x in problem.act_bytes) + sum(
            self.mem(x) for x in problem.state_bytes
        )
        self.start: dict = {}
        self.send_fwd: list = []
        self.send_bwd: list = []
        self.last: dict = {}
        self.step = None
        self.objective = "memory"
        self.objective_expr = None
        self.lower = 0
        """The bound :meth:`add_bound` gave the objective (model units; 0: none)."""
        self.hinted = None
        """The hint's objective (model units), once :meth:`add_hint` has run."""

    def t(self, x: float) -> int:
        return round(x / self.qt)

    def mem(self, x: float) -> int:
        return math.ceil(x / self.qm - 1e-9)

    @property
    def units(self) -> Units:
        return Units(self.t, self.mem, math.floor(self.problem.mem_cap_bytes / self.qm + 1e-9))

    # ---- which layer goes where ------------------------------------------------------------
    def add_assignment(self, *, break_symmetry: bool = True) -> None:
        problem, cp = self.problem, self.cp
        L, S = problem.num_layers, problem.num_stages
        self.b = {
            (i, k): cp.new_bool_var(f"b{i}_{k}") for i in range(L) for k in range(self.lo[i], self.hi[i] + 1)
        }
        self.rec = [i for i in range(L) if problem.recomputable[i]]
        self.z = {
            (i, k): cp.new_bool_var(f"z{i}_{k}") for i in self.rec for k in range(self.lo[i], self.hi[i] + 1)
        }
        self.st = [cp.new_int_var(self.lo[i], self.hi[i], f"st{i}") for i in range(L)]
        for i in range(L):
            ks = range(self.lo[i], self.hi[i] + 1)
            cp.add_exactly_one(self.b[i, k] for k in ks)
            cp.add(self.st[i] == sum(k * self.b[i, k] for k in ks))
        for (i, k), var in self.z.items():
            cp.add_implication(var, self.b[i, k])
        cp.add(self.st[0] == 0)
        cp.add(self.st[L - 1] == S - 1)
        self.cut = []
        for i in range(L - 1):
            c = cp.new_bool_var(f"c{i}")
            cp.add(self.st[i + 1] == self.st[i] + c)
            self.cut.append(c)
        # Identical neighbours in one stage are interchangeable: recompute the earlier one first.
        self.recomputed = {}
        for i in self.rec:
            self.recomputed[i] = cp.new_bool_var(f"r{i}")
            cp.add(self.recomputed[i] == sum(self.z[i, k] for k in range(self.lo[i], self.hi[i] + 1)))
        for i in self.rec if break_symmetry else ():
            if i + 1 in self.recomputed and _same_layer(problem, i, i + 1, self.t, self.mem):
                cp.add(self.recomputed[i + 1] <= self.recomputed[i] + self.cut[i])

    # ---- per stage, per rank, per cut: the sums every constraint refers to -----------------
    def add_stage_sums(self) -> None:
        problem, cp, t, mem, b, z = self.problem, self.cp, self.t, self.mem, self.b, self.z
        p, S = problem.num_ranks, problem.num_stages
        self.fwd, self.bwd, self.keep = [], [], []
        for k in range(S):
            ids = self.members[k]
            self.fwd.append(cp.new_int_var(0, self.horizon, f"F{k}"))
            cp.add(self.fwd[k] == sum(t(problem.fwd_s[i]) * b[i, k] for i in ids))
            self.bwd.append(cp.new_int_var(0, self.horizon, f"B{k}"))
            cp.add(
                self.bwd[k]
                == sum(t(problem.bwd_s[i]) * b[i, k] for i in ids)
                + sum(t(problem.redo_s[i]) * z[i, k] for i in ids if (i, k) in z)
            )
            self.keep.append(cp.new_int_var(0, self.mem_horizon, f"A{k}"))
            cp.add(
                self.keep[k]
                == sum(mem(problem.act_bytes[i]) * b[i, k] for i in ids)
                - sum(
                    (mem(problem.act_bytes[i]) - mem(problem.act_bytes_recompute[i])) * z[i, k]
                    for i in ids
                    if (i, k) in z
                )
            )
        self.static = []
        for r in range(p):
            self.static.append(cp.new_int_var(0, self.mem_horizon, f"M{r}"))
            cp.add(
                self.static[r]
                == sum(
                    mem(problem.state_bytes[i]) * b[i, k]
                    for k in problem.stages_on[r]
                    for i in self.members[k]
                )
            )
        self.reduce = [
            sum(t(problem.reduce_s[i]) * b[i, k] for k in problem.stages_on[r] for i in self.members[k])
            for r in range(p)
        ]

    # ---- memory ----------------------------------------------------------------------------
    def add_memory(self, *, minimize: bool) -> None:
        problem, cp = self.problem, self.cp
        top = self.mem(max(problem.transient_bytes, default=0))
        self.transient = [cp.new_int_var(0, top, f"tr{k}") for k in range(problem.num_stages)]
        for (i, k), var in self.z.items():
            if problem.transient_bytes[i] > 0:
                cp.add(self.transient[k] >= self.mem(problem.transient_bytes[i])).only_enforce_if(var)
        self.peak = cp.new_int_var(0, 2**50, "peak") if minimize else None
        cap = self.units.cap
        for r in range(problem.num_ranks):
            for pattern in problem.memory_patterns[r]:
                used = self.static[r] + pattern_bytes(pattern, self.keep, self.transient)
                cp.add((self.peak if minimize else cap) >= used)
        if minimize:
            cp.minimize(self.peak)

    # ---- step time -------------------------------------------------------------------------
    def add_sends(self) -> None:
        """Per cut, its transfers: those of the layer it follows (which depends on the cut)."""
        problem, cp, t, b = self.problem, self.cp, self.t, self.b
        # Cut k (between stage k and k + 1) is right after layer i when i is in stage k and i + 1 is not.
        for k in range(problem.num_stages - 1):
            fwd_terms, bwd_terms = [], []
            for i in self.members[k]:
                if i + 1 >= problem.num_layers:
                    continue
                sf, sb = t(problem.send_fwd_s[k][i]), t(problem.send_bwd_s[k][i])
                if not (sf or sb):
                    continue
                last = cp.new_bool_var(f"last{i}_{k}")
                cp.add_bool_and([b[i, k], self.cut[i]]).only_enforce_if(last)
                cp.add_bool_or([b[i, k].Not(), self.cut[i].Not(), last])
                self.last[i, k] = last
                fwd_terms.append(sf * last)
                bwd_terms.append(sb * last)
            bound = max((t(x) for x in (*problem.send_fwd_s[k], *problem.send_bwd_s[k])), default=0)
            self.send_fwd.append(cp.new_int_var(0, bound, f"sendF{k}"))
            self.send_bwd.append(cp.new_int_var(0, bound, f"sendB{k}"))
            cp.add(self.send_fwd[k] == sum(fwd_terms))
            cp.add(self.send_bwd[k] == sum(bwd_terms))

    def add_timeline(self) -> None:
        """A start time per action: the rules of :func:`vlmcompile.sim.timeline.run_actions`."""
        self.add_sends()
        problem, cp = self.problem, self.cp
        m, S = problem.num_microbatches, problem.num_stages
        sends = sum(
            max((self.t(x) for x in row), default=0) for row in (*problem.send_fwd_s, *problem.send_bwd_s)
        )
        top = m * (self.horizon + sends) + sum(self.t(x) for x in problem.reduce_s) + 1
        self.step = cp.new_int_var(0, top, "step")

        def duration(a):
            return self.fwd[a.stage] if a.kind is ActionKind.F else self.bwd[a.stage]

        for acts in problem.actions:
            for a in acts:
                self.start[a] = cp.new_int_var(0, top, f"s{a}")
        for r, acts in enumerate(problem.actions):
            for prev, nxt in zip(acts, acts[1:]):
                cp.add(self.start[nxt] >= self.start[prev] + duration(prev))
            if acts:
                cp.add(self.step >= self.start[acts[-1]] + duration(acts[-1]))
                backwards = [a for a in acts if a.kind is ActionKind.B]
                if backwards and any(problem.reduce_s):
                    cp.add(self.step >= self.start[backwards[-1]] + self.reduce[r])
        # Redundant, for the bound: a rank does all its work between its first action's inputs
        # (the forwards of the stages before it) and its last action's consumers (the backwards
        # of the stages before it).
        for acts in problem.actions:
            if not acts:
                continue
            first, last = acts[0], acts[-1]
            before = sum(self.fwd[k] for k in range(first.stage)) if first.kind is ActionKind.F else 0
            after = sum(self.bwd[k] for k in range(last.stage)) if last.kind is ActionKind.B else 0
            cp.add(self.step >= before + sum(duration(a) for a in acts) + after)
        for acts in problem.actions:
            for a in acts:
                for d in dependencies(a, S, frozenset()):
                    if d.stage == a.stage:
                        continue  # the same rank, earlier in its list
                    send = self.send_fwd[d.stage] if d.kind is ActionKind.F else self.send_bwd[a.stage]
                    cp.add(self.start[a] >= self.start[d] + duration(d) + send)
        cp.minimize(self.step)
        self.objective, self.objective_expr = "timeline", self.step

    def add_closed_form(self) -> None:
        """The closed form of the module docstring, for action lists too long to time."""
        problem, cp = self.problem, self.cp
        p, v, m = problem.num_ranks, problem.v, problem.num_microbatches
        self.slowest = cp.new_int_var(0, self.horizon, "slowest_rank")
        plain_work = self.plain_work
        cp.add(self.slowest * p >= plain_work)  # redundant: the mean rank's work, for the bound
        for r in range(p):
            cp.add(self.slowest >= sum(self.fwd[k] + self.bwd[k] for k in problem.stages_on[r]))
        reduce_total = sum(self.t(x) for x in problem.reduce_s)
        self.tail = cp.new_int_var(0, reduce_total, "dp_tail")
        if reduce_total:
            for r in range(p):
                cp.add(self.tail >= self.reduce[r] - sum(self.bwd[k] for k in range(r + 1)))
        redo = sum(self.t(problem.redo_s[i]) * var for (i, _), var in self.z.items())
        # The cut transfers are left to the timeline model: each needs a literal per layer and stage.
        self.objective_expr = (v * m - 1) * self.slowest + plain_work + redo + v * self.tail
        cp.minimize(self.objective_expr)
        self.objective = "closed form"

    def add_bound(self, lower: int) -> None:
        """``lower`` as a constraint on the objective: CP-SAT's relaxation alone proves little on
        paper-scale problems."""
        self.lower = lower
        if lower > 0:
            self.cp.add(self.objective_expr >= lower)

    def bound(self, seconds: float) -> int:
        """The objective's lower bound over whole layers (:mod:`vlmcompile.planning.partition_bound`),
        the best found within ``seconds``."""
        return (closed_form_bound if self.objective == "closed form" else timeline_bound)(
            self.problem, self.units, seconds
        )

    def objective_scale(self) -> float:
        """Seconds (bytes for memory) per unit of the objective."""
        if self.objective == "memory":
            return self.qm
        return self.qt / (self.problem.v if self.objective == "closed form" else 1)

    # ---- the hint ---------------------------------------------------------------------------
    def add_hint(self, stage_of: Sequence[int], flags: Sequence[bool]) -> None:
        """Every variable gets a value, so that CP-SAT can take the hint as its first solution."""
        problem, cp = self.problem, self.cp
        p, S = problem.num_ranks, problem.num_stages
        for (i, k), var in self.b.items():
            cp.add_hint(var, int(stage_of[i] == k))
        for (i, k), var in self.z.items():
            cp.add_hint(var, int(stage_of[i] == k and flags[i]))
        for i, var in self.recomputed.items():
            cp.add_hint(var, int(flags[i]))
        for i in range(problem.num_layers):
            cp.add_hint(self.st[i], stage_of[i])
        for i in range(problem.num_layers - 1):
            cp.add_hint(self.cut[i], stage_of[i + 1] - stage_of[i])
        for (i, k), var in self.last.items():
            cp.add_hint(var, int(stage_of[i] == k and stage_of[i + 1] == k + 1))
        fig = stage_figures(problem, stage_of, flags, time=self.t, mem=self.mem)
        for k in range(S):
            cp.add_hint(self.fwd[k], fig.fwd[k])
            cp.add_hint(self.bwd[k], fig.bwd[k])
            cp.add_hint(self.keep[k], fig.keep[k])
            cp.add_hint(self.transient[k], fig.transient[k])
        for k, var in enumerate(self.send_fwd):
            cp.add_hint(var, fig.send_fwd[k])
        for k, var in enumerate(self.send_bwd):
            cp.add_hint(var, fig.send_bwd[k])
        for r in range(p):
            cp.add_hint(self.static[r], fig.static[r])
        if self.objective == "timeline":
            timed = stage_timeline(problem, fig)
            for x in timed:
                cp.add_hint(self.start[x.action], int(x.start_s))
            self.hinted = int(model_step(fig, timed))
            cp.add_hint(self.step, self.hinted)
        elif self.objective == "closed form":
            work = [sum(fig.fwd[k] + fig.bwd[k] for k in problem.stages_on[r]) for r in range(p)]
            slowest = max(max(work), -(-self.plain_work // p))
            tail = max(0, *(fig.reduce[r] - sum(fig.bwd[: r + 1]) for r in range(p)))
            cp.add_hint(self.slowest, slowest)
            cp.add_hint(self.tail, tail)
            v, m = problem.v, problem.num_microbatches
            self.hinted = (v * m - 1) * slowest + sum(work) + v * tail  # add_closed_form's objective

    def fix(self, stage_of: Sequence[int], flags: Sequence[bool]) -> None:
        """Allow this one assignment only: the model then evaluates it."""
        for (i, k), var in self.b.items():
            self.cp.add(var == int(stage_of[i] == k))
        for (i, k), var in self.z.items():
            self.cp.add(var == int(stage_of[i] == k and bool(flags[i])))

    def read(self, solver: cp_model.CpSolver) -> tuple[tuple[int, ...], tuple[bool, ...]]:
        stage_of = tuple(int(solver.value(s)) for s in self.st)
        flags = tuple(
            any(solver.value(self.z[i, k]) for k in range(self.lo[i], self.hi[i] + 1) if (i, k) in self.z)
            for i in range(self.problem.num_layers)
        )
        return stage_of, flags


def solve(
    problem: PartitionProblem,
    options: SolverOptions = SolverOptions(),
    *,
    hint: tuple[Sequence[int], Sequence[bool]] | None = None,
    time_quantum_s: float | None = None,
    mem_quantum_bytes: float | None = None,
    minimize_memory: bool = False,
    fixed: tuple[Sequence[int], Sequence[bool]] | None = None,
) -> Solution:
    """Solve ``problem`` with CP-SAT; raise :class:`Infeasible` when no assignment fits.

    Two models in turn share the time limit: the closed form (quick, and with a good bound)
    from ``hint``, then, with the time it leaves (at most ``options.timeline_share`` of the
    limit), the timeline from the closed form's plan (when the action lists have at most
    :data:`TIMELINE_ACTIONS` actions). The timeline's answer is
    returned if it is faster or proven optimal, else the closed form's; both phases are in
    ``phases``.

    Times are rounded to ``time_quantum_s`` (default: a millionth of one microbatch's total
    work) and memory to ``mem_quantum_bytes`` (default: a millionth of the cap; demands round
    up, the cap down, so a solution that fits here fits in bytes). With ``minimize_memory`` the
    cap is dropped and the objective is the largest rank peak instead (for error messages).
    With ``fixed`` (each layer's stage, recompute flags) only that assignment is allowed, and
    the timeline model gives its own figures for that one plan. With ``options.closed_form``
    False and a ``hint``, only the timeline runs, from the hint, for its share of the limit
    (the closed form still runs where the timeline model would be too large).
    """
    L, S = problem.num_layers, problem.num_stages
    if S > L:
        raise ValueError(
            f"{S} stages (pp x v = {problem.num_ranks} x {problem.v}) for {L} layers; every stage needs a layer"
        )
    sends = sum(max(row, default=0.0) for row in (*problem.send_fwd_s, *problem.send_bwd_s))
    total = sum(problem.fwd_s) + sum(problem.bwd_s) + sum(problem.redo_s) + sends
    quanta = (
        time_quantum_s or max(total, 1e-30) / 1e6,
        mem_quantum_bytes or max(problem.mem_cap_bytes, 1.0) / 1e6,
    )
    if minimize_memory:
        return _solve_one(problem, "memory", options.time_limit_s, options, quanta, hint=hint)
    if fixed is not None:
        return _solve_one(problem, "timeline", options.time_limit_s, options, quanta, fixed=fixed)
    timeline_s = options.timeline_share * options.time_limit_s
    timeline_fits = problem.num_actions <= TIMELINE_ACTIONS
    if not options.closed_form and hint is not None and timeline_fits:
        return _solve_one(problem, "timeline", timeline_s, options, quanta, hint=hint)
    started = time.perf_counter()
    first = _solve_one(problem, "closed form", options.time_limit_s, options, quanta, hint=hint)
    left = min(options.time_limit_s - (time.perf_counter() - started), timeline_s)
    if not timeline_fits or left < 0.05 * options.time_limit_s:
        return first
    polished = _solve_one(problem, "timeline", left, options, quanta, hint=(first.stage_of, first.recompute))
    both = {"wall_s": first.wall_s + polished.wall_s, "phases": (*first.phases, *polished.phases)}
    if polished.status == "OPTIMAL" or polished.evaluation.step_s < first.evaluation.step_s * (1 - 1e-12):
        return replace(polished, **both)
    # The closed form's plan stays; the state reported is the timeline's, the model that ran out
    # of time, with its own objective, bound and gap.
    return replace(
        first,
        status=polished.status,
        objective_s=polished.objective_s,
        bound_s=polished.bound_s,
        objective=polished.objective,
        timed_out=True,
        wall_s=both["wall_s"],
        phases=(*both["phases"], "the closed form's plan kept: the timeline found none faster in its time"),
    )


def _built(
    problem: PartitionProblem, objective: str, quanta, *, hint, fixed, bounded: bool, time_limit_s: float
):
    """The model of ``objective`` with its bound (found within :data:`BOUND_SHARE` of
    ``time_limit_s``) and hint; the hint's recompute flags (where it has one) and the seconds the
    bound took."""
    model = _Model(problem, *quanta)
    model.add_assignment(break_symmetry=fixed is None)
    model.add_stage_sums()
    model.add_memory(minimize=objective == "memory")
    if objective == "timeline":
        model.add_timeline()
    elif objective == "closed form":
        model.add_closed_form()
    if fixed is not None:
        model.fix(*fixed)
    started = time.perf_counter()
    lower = (
        model.bound(BOUND_SHARE * time_limit_s) if bounded and fixed is None and objective != "memory" else 0
    )
    bound_wall = time.perf_counter() - started
    flags = None
    if hint is not None:
        stage_of, flags = hint
        flags = [bool(f) and problem.recomputable[i] for i, f in enumerate(flags)]
        model.add_hint(stage_of, flags)
        if lower and lower > model.hinted and evaluate(problem, stage_of, flags).fits:
            lower = 0  # above a plan that fits: a wrong bound is never trusted over the plan
    model.add_bound(lower)
    return model, flags, bound_wall


def _solve_one(
    problem: PartitionProblem,
    objective: str,
    time_limit_s: float,
    options: SolverOptions,
    quanta: tuple[float, float],
    *,
    hint: tuple[Sequence[int], Sequence[bool]] | None = None,
    fixed: tuple[Sequence[int], Sequence[bool]] | None = None,
    bounded: bool = True,
) -> Solution:
    model, flags, bound_wall = _built(
        problem, objective, quanta, hint=hint, fixed=fixed, bounded=bounded, time_limit_s=time_limit_s
    )
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05 * time_limit_s, time_limit_s - bound_wall)
    solver.parameters.num_workers = options.num_workers
    # CP-SAT's own SIGINT handler leaves the process's C-level handler at the default when it is
    # done, so a later Ctrl-C would kill the process without cleaning up (local ranks orphaned).
    # Python's handler stays; a Ctrl-C during a solve takes effect when the solve returns.
    solver.parameters.catch_sigint_signal = False
    # Probing fills presolve for seconds on paper-scale models (150 layers in 32 stages: 6 s,
    # then no solution and no bound within the limit); the bound constraint does its work better.
    solver.parameters.cp_model_probing_level = 0
    start = time.perf_counter()
    status = solver.solve(model.cp)
    wall = time.perf_counter() - start + bound_wall
    if status == cp_model.INFEASIBLE and model.lower > 0:
        # Only CP-SAT's own proof refuses a problem, never the bound it was given: solve again without.
        again = max(0.05 * time_limit_s, time_limit_s - wall)
        return _solve_one(problem, objective, again, options, quanta, hint=hint, fixed=fixed, bounded=False)
    name = solver.status_name(status)
    scale = model.objective_scale()
    # CP-SAT's bound, or the one it was given where it has not read its constraint yet
    bound = max(solver.best_objective_bound, model.lower)
    if status == cp_model.UNKNOWN and hint is not None and objective != "memory":
        # Out of time before any solution of its own: the hint is the best plan known.
        start_plan = evaluate(problem, hint[0], flags)
        if start_plan.fits:
            said = (
                f"{objective}: {name}, no better plan than the start in {wall:.2f} s, objective "
                f"{format_ms(model.hinted * scale)} ms, bound {format_ms(bound * scale)} ms"
            )
            return Solution(
                stage_of=tuple(hint[0]),
                recompute=tuple(flags),
                evaluation=start_plan,
                status="UNKNOWN (warm start returned)",
                objective_s=model.hinted * scale,
                bound_s=min(bound, model.hinted) * scale,
                wall_s=wall,
                timed_out=True,
                objective=objective,
                phases=(said,),
            )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise Infeasible(name, wall)
    stage_of, flags = model.read(solver)
    if objective != "memory" and fixed is None:
        flags = _fewest_flags(problem, stage_of, list(flags))
    objective_s, bound_s = solver.objective_value * scale, min(bound, solver.objective_value) * scale
    unit = (lambda x: f"{x / 2**30:.2f} GiB") if objective == "memory" else (lambda x: f"{format_ms(x)} ms")
    return Solution(
        stage_of=stage_of,
        recompute=flags,
        evaluation=evaluate(problem, stage_of, flags),
        status=name,
        objective_s=objective_s,
        bound_s=bound_s,
        wall_s=wall,
        timed_out=status == cp_model.FEASIBLE,  # stopped by the limit, not by proving optimality
        objective=objective,
        phases=(
            f"{objective}: {name} in {wall:.2f} s, objective {unit(objective_s)}, bound {unit(bound_s)}",
        ),
    )
