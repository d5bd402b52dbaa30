"""The bubble schedule: CP-SAT's step equals an exhaustive search's on small instances, the
greedy schedule is valid, and every schedule keeps the encoder-LLM dependencies."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmcompile.ir.actions import Action, ActionKind, dependencies
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Stage
from vlmcompile.planning import bubble_schedule as bs
from vlmcompile.planning import encoder_plans as ep
from vlmcompile.planning.bubble_schedule import (
    BubbleProblem,
    StageUnits,
    evaluate_schedule,
    greedy,
    schedule_bound,
    solve_schedule,
)
from vlmcompile.planning.schedules import one_f_one_b

F, B = ActionKind.F, ActionKind.B


def make_problem(
    *,
    ranks: int,
    microbatches: int,
    encoder_pp: int,
    enc_times: list[tuple[int, int]],
    llm_times: list[tuple[int, int]],
    send: int = 0,
    keep: int = 1,
    mem_limit: int = 10**9,
) -> BubbleProblem:
    """``enc_times``: (fwd, bwd) per encoder stage (split evenly over ``encoder_pp`` ranks in
    order); ``llm_times``: per LLM stage, one per rank (1F1B)."""
    assert len(llm_times) == ranks and len(enc_times) % encoder_pp == 0
    pipes = ranks // encoder_pp
    per_part = len(enc_times) // encoder_pp
    stages = []
    for i, (f, b) in enumerate(enc_times):
        part = i // per_part
        holders = tuple(k * encoder_pp + part for k in range(pipes))
        stages.append(StageUnits(holders, f, b, send, send, keep, 0))
    for r, (f, b) in enumerate(llm_times):
        stages.append(StageUnits((r,), f, b, send, send, keep, 0))
    n_enc = len(enc_times)
    llm = tuple(
        tuple(Action(a.stage + n_enc, a.kind, a.microbatch) for a in acts)
        for acts in one_f_one_b(ranks, microbatches)
    )
    return BubbleProblem(tuple(stages), n_enc, microbatches, llm, (mem_limit,) * ranks, 1e-3)


def exhaustive(problem: BubbleProblem) -> int | None:
    """The shortest step over every assignment of microbatches to encoder pipelines and every
    per-rank order that keeps the LLM's order, by exhaustive search (None when nothing fits).

    Every schedule whose actions start as early as their rank and inputs allow is built once:
    actions are committed in (start, rank) order, each at the earliest start the committed ones
    allow; branches that cannot beat the best step found are cut (a rank's end plus its
    remaining LLM work), as are branches over a rank's memory."""
    m, first = problem.num_microbatches, problem.first_llm_stage
    deps = {}
    everything = [a for acts in problem.llm_actions for a in acts] + [
        a for j in range(m) for a in problem.encoder_actions(j)
    ]
    for a in everything:
        deps[a] = dependencies(a, problem.num_stages)
    keep = [s.keep for s in problem.stages]
    transient = [s.transient for s in problem.stages]
    best = [None]
    ends: dict[Action, tuple[int, int]] = {}
    free = [0] * problem.num_ranks
    position = [0] * problem.num_ranks
    live = [0] * problem.num_ranks
    pipeline_of: dict[int, int] = {}
    remaining_llm = [sum(problem.duration(a) for a in acts) for acts in problem.llm_actions]

    def candidates():
        for r, acts in enumerate(problem.llm_actions):
            if position[r] < len(acts):
                yield r, acts[position[r]]
        for j in range(m):
            for a in problem.encoder_actions(j):
                if a in ends:
                    continue
                if j in pipeline_of:
                    yield problem.rank_of(a, pipeline_of[j]), a
                else:
                    for k in range(problem.pipelines):
                        yield problem.rank_of(a, k), a
                break  # only the microbatch's next encoder action

    def start_of(r, a):
        t = free[r]
        for d in deps[a]:
            if d not in ends:
                return None
            end, where = ends[d]
            t = max(t, end + (problem.transfer(d, a) if where != r else 0))
        return t

    def search(last):
        if len(ends) == len(everything):
            step = max(free)
            if best[0] is None or step < best[0]:
                best[0] = step
            return
        for r, a in list(candidates()):
            t = start_of(r, a)
            if t is None or (t, r) < last:
                continue
            d = problem.duration(a)
            bound = max(max(free), t + d, *(free[q] + remaining_llm[q] for q in range(problem.num_ranks)))
            if best[0] is not None and bound >= best[0]:
                continue
            during = live[r] + (keep[a.stage] if a.kind is F else transient[a.stage])
            if during > problem.mem_limit[r]:
                continue
            saved = (free[r], live[r], remaining_llm[r])
            ends[a] = (t + d, r)
            free[r] = t + d
            live[r] += keep[a.stage] if a.kind is F else -keep[a.stage]
            new_pipeline = a.stage < first and a.microbatch not in pipeline_of
            if new_pipeline:
                pipeline_of[a.microbatch] = problem.stages[a.stage].ranks.index(r)
            if a.stage >= first:
                position[r] += 1
                remaining_llm[r] -= d
            search((t, r))
            if a.stage >= first:
                position[r] -= 1
            if new_pipeline:
                del pipeline_of[a.microbatch]
            del ends[a]
            free[r], live[r], remaining_llm[r] = saved

    search((-1, -1))
    return best[0]


def _check_dependencies(problem: BubbleProblem, actions) -> None:
    """Every encoder-LLM and encoder-internal dependency holds in time."""
    from vlmcompile.sim.timeline import run_actions

    timed = {
        t.action: t
        for t in run_actions(
            actions, problem.num_stages, duration=lambda a, _s: problem.duration(a), transfer=problem.transfer
        )
    }
    first = problem.first_llm_stage
    for j in range(problem.num_microbatches):
        llm_f, llm_b = timed[Action(first, F, j)], timed[Action(first, B, j)]
        enc_f, enc_b = timed[Action(first - 1, F, j)], timed[Action(first - 1, B, j)]
        assert enc_f.end_s <= llm_f.start_s
        assert enc_b.start_s >= llm_b.end_s
        for s in range(1, first):
            assert timed[Action(s - 1, F, j)].end_s <= timed[Action(s, F, j)].start_s
            assert timed[Action(s, B, j)].end_s <= timed[Action(s - 1, B, j)].start_s


times = st.tuples(st.integers(1, 9), st.integers(1, 12))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(
        [
            dict(ranks=2, microbatches=2, encoder_pp=1, n_enc=1),
            dict(ranks=2, microbatches=2, encoder_pp=2, n_enc=2),
            dict(ranks=2, microbatches=3, encoder_pp=2, n_enc=2),
            dict(ranks=3, microbatches=2, encoder_pp=1, n_enc=1),
            dict(ranks=2, microbatches=2, encoder_pp=1, n_enc=2),
        ]
    ),
    data=st.data(),
    send=st.integers(0, 2),
    tight=st.booleans(),
)
def test_cp_sat_finds_the_exhaustive_optimum(case, data, send, tight):
    enc = data.draw(st.lists(times, min_size=case["n_enc"], max_size=case["n_enc"]))
    llm = data.draw(st.lists(times, min_size=case["ranks"], max_size=case["ranks"]))
    problem = make_problem(
        ranks=case["ranks"],
        microbatches=case["microbatches"],
        encoder_pp=case["encoder_pp"],
        enc_times=enc,
        llm_times=llm,
        send=send,
        mem_limit=(case["microbatches"] + 1) if tight else 10**9,
    )
    expected = exhaustive(problem)
    if expected is not None:
        assert schedule_bound(problem) <= expected
    if expected is None:
        with pytest.raises(PlanError, match="within memory"):
            solve_schedule(problem, time_limit_s=20, num_workers=2)
        return
    found = solve_schedule(problem, time_limit_s=20, num_workers=2)
    assert found.status == "OPTIMAL"
    assert found.step == expected == found.objective
    assert evaluate_schedule(problem, found.actions).fits
    _check_dependencies(problem, found.actions)


def test_the_greedy_schedule_is_valid_and_no_faster_than_the_optimum():
    problem = make_problem(
        ranks=2, microbatches=3, encoder_pp=1, enc_times=[(3, 5)], llm_times=[(4, 8), (4, 8)], send=1
    )
    best = exhaustive(problem)
    for lookahead in (1, 2, 3):
        for fill_only in (False, True):
            sched = greedy(problem, lookahead=lookahead, fill_only=fill_only)
            assert sorted(a for acts in sched for a in acts) == sorted(
                [a for acts in problem.llm_actions for a in acts]
                + [a for j in range(3) for a in problem.encoder_actions(j)]
            )
            _check_dependencies(problem, sched)
            assert evaluate_schedule(problem, sched).step >= best


def test_encoder_work_in_the_bubbles_beats_the_phased_schedule():
    """Encoder work as long as an LLM stage, 4 microbatches on 2 ranks: the phased schedule (every
    encoder forward first, every backward last: Megatron-core's colocated order) is slower than
    the optimum, which hides encoder work in the warm-up, cool-down and interior bubbles; no
    schedule beats the total work over the ranks."""
    problem = make_problem(
        ranks=2, microbatches=4, encoder_pp=1, enc_times=[(4, 8)], llm_times=[(4, 8), (4, 8)]
    )
    encoder = [Stage(0, 0, ("encoder",), replicas=(1,))]
    phased = ep.phased_actions(encoder, problem.llm_actions, ep.pipeline_of_microbatch(4, 2))
    found = solve_schedule(problem, time_limit_s=20)
    assert found.status == "OPTIMAL"
    assert found.step < evaluate_schedule(problem, phased).step
    assert found.step >= sum(problem.work_per_rank()) / problem.num_ranks
    _check_dependencies(problem, found.actions)


@pytest.mark.parametrize(("dp", "zero_stage"), [(1, 1), (4, 1), (4, 0), (8, 3)])
def test_evaluate_times_the_dp_collectives_as_the_simulator(demo_graph, dp, zero_stage):
    from dataclasses import replace

    from vlmcompile.cost_models.cluster import Cluster
    from vlmcompile.cost_models.stage_costs import layer_costs, plan_costs
    from vlmcompile.planning.bubble_schedule import problem_from
    from vlmcompile.planning.build import build_separate_plan
    from vlmcompile.planning.request import PlanRequest
    from vlmcompile.sim.simulator import simulate

    cluster = Cluster.preset(f"h100x{2 * dp}")
    request = PlanRequest.on(cluster, tp=1, pp=2, global_batch=4 * dp, zero_stage=zero_stage)
    encoder = ep.EncoderPlan(pp=1, tp=1, chunks=2)
    count = ep.encoder_layer_count(demo_graph)
    names = [layer.name for layer in demo_graph.layers]
    times = [c.f_s + c.b_s for c in layer_costs(demo_graph, cluster, request.parallel, microbatch_size=1)]
    plan = build_separate_plan(
        demo_graph,
        cluster,
        request,
        encoder,
        policy="test",
        encoder_pieces=ep.encoder_chunks(demo_graph, encoder, times[:count]),
        llm_chunks=[names[count:12], names[12:]],
        recompute={},
        decisions=[],
    )
    costs = plan_costs(plan, demo_graph, cluster)
    problem = problem_from(plan, costs, 1e15)
    for actions in (plan.actions, greedy(problem, lookahead=2)):
        sim = simulate(replace(plan, actions=actions), demo_graph, cluster, costs=costs)
        if dp > 1:
            assert sim.idle_share()["dp_reduce_scatter"] + sim.idle_share()["dp_all_gather"] > 0
        # Action times are rounded to a millionth of the busiest rank's work.
        assert evaluate_schedule(problem, actions).step * problem.unit_s == pytest.approx(
            sim.step_time_s, rel=1e-4
        )


def test_a_frozen_encoder_stage_gets_forwards_only_from_every_scheduler(demo_graph):
    """A per-batch re-plan (greedy, kernel level, CP-SAT, any work factors) of a plan whose first
    encoder stage no gradient reaches never gives that stage a backward: the plan stays valid."""
    import dataclasses

    from tests.pipeline_helpers import separate_plan
    from vlmcompile.cost_models.cluster import Cluster
    from vlmcompile.cost_models.stage_costs import plan_costs
    from vlmcompile.planning.bubble_schedule import greedy, problem_from, solve_schedule

    frozen = demo_graph.with_frozen(["encoders.0.embed", "encoders.0.blocks.0", "encoders.0.blocks.1"])
    plan = separate_plan(frozen, pp=2, encoder_pp=2, global_batch=4)
    assert plan.forward_only_stages() == {0}, "the first encoder stage holds only frozen layers"
    problem = problem_from(plan, plan_costs(plan, frozen, Cluster.preset("cpu:2")), 2**40)
    assert problem.forward_only == {0}
    varied = problem.with_work([(0.5, 1.0), (2.0, 1.0), (1.0, 0.7), (1.5, 1.2)])
    riders: dict = {}
    schedules = [
        (greedy(problem), {}),
        (greedy(varied, lookahead=2), {}),
        (greedy(problem, riders=riders), riders),
        (solve_schedule(varied, time_limit_s=2, num_workers=2).actions, {}),
    ]
    for actions, kernel_level in schedules:
        assert not [a for acts in actions for a in acts if a.stage == 0 and a.kind is not ActionKind.F]
        scheduled = dataclasses.replace(plan, actions=actions, kernel_level=kernel_level)
        scheduled.validate(frozen)
        assert scheduled.forward_only_stages() == {0}


def test_encoder_forwards_a_batch_ahead_wait_for_nothing_and_fill_the_cool_down():
    """A frozen encoder (forwards only) whose work fits the LLM's cool-down bubbles: run a batch
    ahead, the step is the LLM's alone (4 ranks, 8 microbatches of 4 + 8 units: 8 x 12 + 3 x 12);
    run in the step, the LLM's first forward waits for the first encoder forward."""
    import dataclasses

    base = make_problem(ranks=4, microbatches=8, encoder_pp=1, enc_times=[(3, 6)], llm_times=[(4, 8)] * 4)
    base = dataclasses.replace(base, forward_only=frozenset({0}))
    llm_alone = 8 * 12 + 3 * 12
    in_step = solve_schedule(base, time_limit_s=5, num_workers=2)
    ahead = dataclasses.replace(base, ahead=frozenset(range(8)))
    solved = solve_schedule(ahead, time_limit_s=5, num_workers=2)
    assert solved.status == "OPTIMAL" and solved.step == llm_alone
    assert in_step.step >= llm_alone + 3
    # the bound given to CP-SAT: the LLM alone, after the first encoder forward unless it ran ahead
    assert schedule_bound(ahead) == llm_alone and schedule_bound(base) == llm_alone + 3
    for actions in (greedy(ahead), solved.actions):
        listed = [a for acts in actions for a in acts]
        assert sorted(a for a in listed if a.stage == 0) == sorted(ahead.ahead_actions)
        assert evaluate_schedule(ahead, actions).step <= in_step.step
    with pytest.raises(PlanError, match="only when no gradient reaches the encoder"):
        dataclasses.replace(base, forward_only=frozenset(), ahead=frozenset({0}))


def _last_host_overruns(problem: BubbleProblem, actions, riders) -> dict[int, float]:
    """Per rank, the rider compute its last LLM action runs beyond its TP gaps (the simulator's
    rule for kernel-level work, :func:`~vlmcompile.sim.kernel_stream.host_fills`)."""
    from vlmcompile.ir.actions import hosts_of
    from vlmcompile.planning.bubble_schedule import _split
    from vlmcompile.sim.kernel_stream import host_fills

    hosts = hosts_of(actions, riders, lambda a: a.stage >= problem.encoder_stages)
    fills = host_fills(
        hosts,
        actions,
        work=lambda a: _split(problem, a)[::-1],
        capacity=lambda a: _split(problem, a),
    )
    out = {}
    for rank, acts in enumerate(actions):
        last = [a for a in acts if a.stage >= problem.encoder_stages][-1]
        fill = fills.get(last)
        out[rank] = max(0.0, fill.rider_compute - fill.gap) if fill else 0.0
    return out


def test_end_room_keeps_riders_off_the_final_backward_wave():
    """With ``end_room`` the list scheduler opens a rider only where the rank's TP gaps from there
    on can take it: on the ranks whose last LLM action passes the final backward wave on (every
    rank but the first LLM stage's), that action runs no rider compute beyond its gap. Without
    it a rider left open runs there (on this instance), lengthening the wave."""
    import dataclasses

    problem = make_problem(
        ranks=4, microbatches=8, encoder_pp=2, enc_times=[(6, 12), (6, 12)], llm_times=[(8, 16)] * 4
    )
    stages = tuple(
        dataclasses.replace(s, fwd_tp=3, bwd_tp=6) if i >= problem.encoder_stages else s
        for i, s in enumerate(problem.stages)
    )
    problem = dataclasses.replace(problem, stages=stages)
    first_llm_rank = problem.stages[problem.first_llm_stage].ranks[0]
    overruns = {}
    for end_room in (False, True):
        riders: dict = {}
        actions = greedy(problem, lookahead=8, fill_only=True, riders=riders, end_room=end_room)
        assert riders, "the instance runs encoder work inside the LLM's TP gaps"
        overruns[end_room] = _last_host_overruns(problem, actions, riders)
    assert all(v <= 1e-9 for rank, v in overruns[True].items() if rank != first_llm_rank)
    assert any(v > 1e-9 for rank, v in overruns[False].items() if rank != first_llm_rank)


def test_a_wrong_bound_never_refuses_a_schedule(monkeypatch):
    """The bound given to CP-SAT is a constraint: were it ever above the optimum, a start that
    fits must overrule it, and an infeasibility it alone caused is checked again without it."""
    import vlmcompile.planning.bubble_schedule as bubble_schedule

    problem = make_problem(ranks=2, microbatches=3, encoder_pp=1, enc_times=[(3, 5)], llm_times=[(4, 8)] * 2)
    expected = exhaustive(problem)
    monkeypatch.setattr(bubble_schedule, "schedule_bound", lambda problem: 10**9)
    found = solve_schedule(problem, time_limit_s=5, num_workers=1)
    assert found.step == expected and found.bound <= found.objective


def test_a_batchs_re_planning_tries_the_screens_setting_first_and_only_settings_the_pass_tries():
    assert bs.PER_BATCH_SETTINGS[: len(bs.SCREEN_LAYER)] == bs.SCREEN_LAYER
    assert set(bs.PER_BATCH_SETTINGS) <= set(bs.GREEDY_SETTINGS)
