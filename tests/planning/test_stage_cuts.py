"""The CP-SAT partition against a hand-written enumerator on instances small enough to enumerate."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.placement import Placement
from vlmcompile.planning.partition_problem import PartitionProblem, evaluate, memory_patterns
from vlmcompile.planning.request import GAP_GOAL, SolverOptions
from vlmcompile.planning.schedules import make_schedule
from vlmcompile.planning.stage_cuts import Infeasible, solve


def replay_step(problem: PartitionProblem, F, B, send_fwd, send_bwd, R) -> float:
    """The step of per-stage times, replayed here apart from the library's timeline: sweep the
    ranks until every action has run, each starting after its rank's previous action and after
    its producer's end plus the transfer; a rank's DP reduction starts with its last backward."""
    acts = problem.actions
    S = problem.num_stages
    end: dict = {}
    pos = [0] * len(acts)
    free = [0.0] * len(acts)
    last_b = [None] * len(acts)
    while any(pos[r] < len(acts[r]) for r in range(len(acts))):
        moved = False
        for r, mine in enumerate(acts):
            while pos[r] < len(mine):
                a = mine[pos[r]]
                k, i = a.stage, a.microbatch
                if a.kind.value == "F":
                    need = [] if k == 0 else [(("F", k - 1, i), send_fwd[k - 1])]
                else:
                    need = [(("F", k, i), 0.0)] + ([] if k == S - 1 else [(("B", k + 1, i), send_bwd[k])])
                if any(key not in end for key, _ in need):
                    break
                start = max([free[r], *(end[key] + s for key, s in need)])
                free[r] = end[(a.kind.value, k, i)] = start + (F[k] if a.kind.value == "F" else B[k])
                if a.kind.value == "B":
                    last_b[r] = start
                pos[r] += 1
                moved = True
        assert moved, "the schedule deadlocks"
    return max([max(end.values()), *(s + R[r] for r, s in enumerate(last_b) if s is not None)])


def enumerate_plans(problem: PartitionProblem):
    """Every contiguous cut x every recompute subset: per cut, the stage of each layer, the
    recompute masks, and per mask the step time (replayed here by :func:`replay_step`) and the
    largest memory of any rank at any step of its action list (replayed here, not taken from
    ``memory_patterns``)."""
    L, p, v = problem.num_layers, problem.num_ranks, problem.v
    S = p * v
    fwd, bwd, redo = map(np.array, (problem.fwd_s, problem.bwd_s, problem.redo_s))
    act, act_rc, trans = map(
        np.array, (problem.act_bytes, problem.act_bytes_recompute, problem.transient_bytes)
    )
    state, red = map(np.array, (problem.state_bytes, problem.reduce_s))
    rec = [i for i in range(L) if problem.recomputable[i]]
    masks = np.zeros((2 ** len(rec), L), dtype=bool)
    for row, bits in enumerate(itertools.product([False, True], repeat=len(rec))):
        masks[row, rec] = bits
    actions = problem.actions
    for cuts in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *cuts, L)
        stage_of = np.repeat(np.arange(S), np.diff(bounds))
        member = np.stack([stage_of == k for k in range(S)])  # S x L
        F = member @ fwd
        B = (member * bwd).sum(1)[None, :] + (masks * redo) @ member.T  # masks x S
        A = (~masks * act + masks * act_rc) @ member.T
        T = np.stack([(masks * trans * member[k]).max(1) for k in range(S)], 1)
        R = [sum(red[member[k]].sum() for k in range(r, S, p)) for r in range(p)]
        send_fwd = [problem.send_fwd_s[k][c - 1] for k, c in enumerate(cuts)]
        send_bwd = [problem.send_bwd_s[k][c - 1] for k, c in enumerate(cuts)]
        step = np.array([replay_step(problem, F, B[row], send_fwd, send_bwd, R) for row in range(len(masks))])
        peak = np.zeros(len(masks))
        for r in range(p):
            static = sum(state[member[k]].sum() for k in range(r, S, p))
            live = np.zeros(S, dtype=int)
            for a in actions[r]:
                if a.kind.value == "F":
                    live[a.stage] += 1
                used = static + A @ live + (T[:, a.stage] if a.kind.value == "B" else 0)
                peak = np.maximum(peak, used)
                if a.kind.value == "B":
                    live[a.stage] -= 1
        yield stage_of, masks, step, peak


def brute_force(problem: PartitionProblem) -> float | None:
    """The least step time of any plan within the memory cap (None: nothing fits)."""
    best = None
    for _, _, step, peak in enumerate_plans(problem):
        fits = peak <= problem.mem_cap_bytes
        if fits.any():
            here = float(step[fits].min())
            best = here if best is None else min(best, here)
    return best


@st.composite
def problems(draw):
    p, v = draw(st.sampled_from([(1, 1), (2, 1), (3, 1), (4, 1), (2, 2)]))
    L = draw(st.integers(p * v, 12 if p * v <= 3 else 9))
    m = draw(st.sampled_from([p, 2 * p] if v > 1 else [1, 2, 3, 5, 8]))
    ints = st.integers(1, 40)
    fwd = [float(draw(ints)) for _ in range(L)]
    bwd = [float(2 * f + draw(st.integers(0, 10))) for f in fwd]
    recomputable = [draw(st.booleans()) for _ in range(L)]
    with_dp = draw(st.booleans())
    act = [draw(st.integers(10, 100)) for _ in range(L)]
    act_rc = [draw(st.integers(1, a)) for a in act]
    state = [draw(st.integers(0, 100)) for _ in range(L)]
    problem = dict(
        names=tuple(f"l{i}" for i in range(L)),
        fwd_s=tuple(fwd),
        bwd_s=tuple(bwd),
        redo_s=tuple(fwd),
        act_bytes=tuple(map(float, act)),
        act_bytes_recompute=tuple(map(float, act_rc)),
        transient_bytes=tuple(float(a) for a in act),
        state_bytes=tuple(map(float, state)),
        # Half the instances without DP traffic: there the simulator's DP stream (what evaluate
        # applies) and the model's linear reading of it coincide.
        reduce_s=tuple(float(draw(st.integers(0, 30))) if with_dp else 0.0 for _ in range(L)),
        gather_s=(0.0,) * L,
        send_fwd_s=tuple(tuple(float(draw(st.integers(0, 8))) for _ in range(L)) for _ in range(p * v - 1)),
        send_bwd_s=tuple(tuple(float(draw(st.integers(0, 8))) for _ in range(L)) for _ in range(p * v - 1)),
        recomputable=tuple(recomputable),
        num_ranks=p,
        v=v,
        num_microbatches=m,
        actions=make_schedule("interleaved_1f1b" if v > 1 else "1f1b", Placement(p, v), m),
    )
    # Tight: between the least memory any plan needs and the least without recompute (so that
    # most instances must recompute), sometimes below it (nothing fits).
    draft = PartitionProblem(**problem, mem_cap_bytes=0.0)
    least = least_plain = np.inf
    for _, masks, _, peak in enumerate_plans(draft):
        least = min(least, peak.min())
        least_plain = min(least_plain, peak[~masks.any(1)].min())
    cap = least + (least_plain - least) * draw(st.floats(-0.05, 1.0))
    return PartitionProblem(**problem, mem_cap_bytes=float(int(cap)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_solver_finds_the_brute_force_optimum(problem):
    reference = brute_force(problem)
    if reference is None:
        with pytest.raises(Infeasible):
            solve(
                problem,
                SolverOptions(time_limit_s=20, workers=1, timeline_share=1.0),
                time_quantum_s=1.0,
                mem_quantum_bytes=1.0,
            )
        return
    solution = solve(
        problem,
        SolverOptions(time_limit_s=20, workers=1, timeline_share=1.0),
        time_quantum_s=1.0,
        mem_quantum_bytes=1.0,
    )
    assert solution.status == "OPTIMAL"
    assert solution.evaluation.fits
    assert solution.objective_s == pytest.approx(reference, rel=1e-9)
    if not any(problem.reduce_s):
        assert solution.evaluation.step_s == pytest.approx(reference, rel=1e-9)


def _large_problem(num_layers: int, p: int, m: int) -> PartitionProblem:
    rng = np.random.default_rng(0)
    fwd = rng.uniform(1, 3, num_layers)
    act = rng.uniform(10, 50, num_layers)
    base = dict(
        names=tuple(f"l{i}" for i in range(num_layers)),
        fwd_s=tuple(fwd),
        bwd_s=tuple(2 * fwd),
        redo_s=tuple(fwd),
        act_bytes=tuple(act),
        act_bytes_recompute=tuple(act / 8),
        transient_bytes=tuple(act),
        state_bytes=tuple(rng.uniform(5, 10, num_layers)),
        reduce_s=(0.0,) * num_layers,
        gather_s=(0.0,) * num_layers,
        send_fwd_s=(tuple(rng.uniform(0, 0.5, num_layers)),) * (p - 1),
        send_bwd_s=(tuple(rng.uniform(0, 0.5, num_layers)),) * (p - 1),
        recomputable=(True,) * num_layers,
        num_ranks=p,
        v=1,
        num_microbatches=m,
        actions=make_schedule("1f1b", Placement(p), m),
    )
    plain = (sum(base["state_bytes"]) + p * sum(act)) / p
    return PartitionProblem(**base, mem_cap_bytes=0.6 * plain)


def test_a_timeout_returns_the_best_plan_and_says_so():
    problem = _large_problem(300, 8, 32)
    # A feasible start (even cuts, everything recomputed) so that the solver has a plan to return.
    hint = (tuple(i * 8 // 300 for i in range(300)), (True,) * 300)
    solution = solve(problem, SolverOptions(time_limit_s=1.0, workers=1), hint=hint)
    assert solution.timed_out == (solution.status != "OPTIMAL")
    assert ("timed out" in solution.summary()) == solution.timed_out
    assert solution.evaluation.fits
    assert solution.bound_s <= solution.objective_s * (1 + 1e-9)
    if solution.timed_out:
        assert solution.gap >= 0
    # the bound it was given over whole layers: never zero, as CP-SAT's own was on such problems
    assert solution.bound_s > 0
    assert (solution.why_gap() != "") == (solution.gap > GAP_GOAL)
    assert solution.why_gap() in solution.summary()


def test_without_the_closed_form_only_the_timeline_runs_from_the_hint():
    problem = _large_problem(24, 4, 8)
    hint = (tuple(i * 4 // 24 for i in range(24)), (True,) * 24)
    options = SolverOptions(time_limit_s=4.0, workers=1, timeline_share=0.5, closed_form=False)
    solution = solve(problem, options, hint=hint)
    assert len(solution.phases) == 1 and solution.phases[0].startswith("timeline")
    assert solution.objective == "timeline"
    assert solution.wall_s <= 0.5 * 4.0 + 0.5  # its share of the limit, not the whole limit
    assert solution.evaluation.fits
    assert solution.evaluation.step_s <= evaluate(problem, *hint).step_s * (1 + 1e-9)


def test_a_timeline_only_solve_needs_a_timeline_share():
    with pytest.raises(PlanError, match="timeline_share"):
        SolverOptions(closed_form=False, timeline_share=0.0)


def test_memory_patterns_of_1f1b_hold_min_p_minus_s_m():
    p, m = 4, 6
    patterns = memory_patterns(make_schedule("1f1b", Placement(p), m))
    for rank, rank_patterns in enumerate(patterns):
        peak = max(dict(live).get(rank, 0) for live, _ in rank_patterns)
        assert peak == min(p - rank, m)


def test_minimize_memory_finds_the_enumerated_least_peak():
    problem = _large_problem(7, 3, 4)
    least = min(peak.min() for _, _, _, peak in enumerate_plans(problem))
    solution = solve(problem, SolverOptions(workers=1), minimize_memory=True, mem_quantum_bytes=1e-3)
    assert max(solution.evaluation.peak_bytes) == pytest.approx(least, rel=1e-3)


def test_a_wrong_bound_never_refuses_a_problem(monkeypatch):
    """The bound given to CP-SAT is a constraint: were it ever above the optimum, a hint that fits
    must overrule it, and without a hint CP-SAT's infeasibility is checked again without it."""
    import vlmcompile.planning.stage_cuts as stage_cuts

    monkeypatch.setattr(stage_cuts, "closed_form_bound", lambda problem, units, seconds: 10**12)
    monkeypatch.setattr(stage_cuts, "timeline_bound", lambda problem, units, seconds: 10**12)
    problem = _large_problem(12, 3, 6)
    hint = (tuple(i * 3 // 12 for i in range(12)), (True,) * 12)
    for start in (hint, None):
        solution = solve(problem, SolverOptions(time_limit_s=4.0, workers=1), hint=start)
        assert solution.evaluation.fits
        assert solution.bound_s <= solution.objective_s * (1 + 1e-9)


def test_the_summary_reads_as_one_state_optimal_or_timed_out_with_its_gap():
    import dataclasses

    problem = _large_problem(24, 4, 8)
    hint = (tuple(i * 4 // 24 for i in range(24)), (True,) * 24)
    solution = solve(problem, SolverOptions(time_limit_s=4.0, workers=1), hint=hint)
    optimal = dataclasses.replace(solution, status="OPTIMAL", timed_out=False)
    assert optimal.summary().startswith("CP-SAT optimal in ") and "timed out" not in optimal.summary()
    late = dataclasses.replace(
        solution, status="FEASIBLE", timed_out=True, bound_s=0.5 * solution.objective_s
    )
    said = late.summary()
    assert said.startswith("CP-SAT timed out after ") and "(FEASIBLE)" in said and "gap 50.00 %" in said
    assert "optimal" not in said.split("[")[0].lower()
