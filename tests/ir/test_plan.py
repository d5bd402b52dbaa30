"""Plan: actions round-trip as text, plans round-trip as JSON, and malformed plans are rejected
with the rank and step named."""

import dataclasses
from pathlib import Path

import pytest

from tests.sim_helpers import make_plan
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.actions import Action, ActionKind, format_grid
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Parallel, Plan, Precision, Stage
from vlmcompile.passes.baselines.megatron import megatron
from vlmcompile.planning.request import GlobalRecompute, PlanRequest
from vlmcompile.planning.schedules import one_f_one_b
from vlmcompile.sim.simulator import simulate

CLUSTER = Cluster.preset("h100x16")


@pytest.fixture(scope="module")
def plan(demo_graph):
    return megatron(
        demo_graph,
        CLUSTER,
        PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=16),
        recompute=GlobalRecompute(granularity="full"),
    ).plan


def test_actions_read_back_from_their_text():
    for text in ("0F0", "12B3", "2I10", "7W0"):
        assert str(Action.from_str(text)) == text
    assert Action.from_str("2F0") == Action(2, ActionKind.F, 0)
    with pytest.raises(ValueError, match="write <stage><F|B|I|W><microbatch>"):
        Action.from_str("F2")


def test_json_round_trip_is_lossless(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    fp32 = dataclasses.replace(plan, precision=Precision(param_bytes=4, optimizer_bytes=8))
    fp32.save(path)
    assert Plan.load(path) == fp32


def test_an_older_plan_schema_is_rejected_with_the_fix(plan):
    data = plan.to_json()
    for version in (0, 1, 2):
        data["version"] = version
        with pytest.raises(
            PlanError,
            match=rf"plan JSON version {version} is not one this vlmcompile reads \(3\); it was written before "
            r"plans could hold encoder plans of their own; re-plan: `vlmcompile plan",
        ):
            Plan.from_json(data)
    data["version"] = 9
    with pytest.raises(PlanError, match=r"version 9 is not one this vlmcompile reads \(3\); re-plan"):
        Plan.from_json(data)
    with pytest.raises(PlanError, match="not a plan JSON"):
        Plan.from_json({"schema": "vlmcompile.layer_graph"})


def test_a_layer_in_no_stage_is_named(plan, demo_graph):
    stages = list(plan.stages)
    stages[1] = dataclasses.replace(stages[1], layers=stages[1].layers[:-1])
    broken = dataclasses.replace(plan, stages=tuple(stages), recompute={})
    with pytest.raises(PlanError, match=r"layers in no stage: \['llm.blocks.3'\]"):
        broken.validate(demo_graph)


def test_a_missing_action_names_the_rank_and_action(plan):
    actions = list(plan.actions)
    actions[2] = tuple(a for a in actions[2] if str(a) != "2B5")
    broken = dataclasses.replace(plan, actions=tuple(actions))
    with pytest.raises(PlanError, match=r"rank 2 is missing 2B5 \(stage 2, microbatch 5\)"):
        broken.validate()


def test_a_deadlock_is_shown_on_the_grid_with_the_stuck_ranks_marked():
    acts = [list(r) for r in one_f_one_b(2, 2)]
    # rank 1 runs the backward of microbatch 1 before its forward: it waits for itself
    acts[1] = [
        Action(1, ActionKind.F, 0),
        Action(1, ActionKind.B, 1),
        Action(1, ActionKind.B, 0),
        Action(1, ActionKind.F, 1),
    ]
    plan = make_plan(tuple(tuple(a) for a in acts), 2)
    with pytest.raises(PlanError) as err:
        plan.validate()
    text = str(err.value)
    assert "deadlock" in text
    assert "rank 1 is stuck at step 1 on 1B1, waiting for 1F1 (rank 1 step 3)" in text
    assert "1B1 <- stuck" in text and "step  rank 0" in text


def test_an_action_on_the_wrong_rank_is_marked():
    acts = [list(r) for r in one_f_one_b(2, 1)]
    acts[0][0] = Action(1, ActionKind.F, 0)
    plan = make_plan(tuple(tuple(a) for a in acts), 2)
    with pytest.raises(PlanError, match=r"rank 0 step 0: 1F0 belongs to stage 1, which is placed on rank 1"):
        plan.validate()


def test_a_plan_over_the_memory_cap_names_the_rank_and_step(demo_graph):
    tiny_memory = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, mem_bytes=2**20))
    plan = megatron(demo_graph, CLUSTER, PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=16)).plan
    sim = simulate(plan, demo_graph, tiny_memory)
    assert not sim.fits
    with pytest.raises(
        PlanError, match=r"rank 0 needs .* GiB at step \d+ \(.*\), over the 0.0 GiB a H100-80GB leaves"
    ) as err:
        sim.check_fits(plan)
    assert "<- peak memory" in str(err.value)
    assert simulate(plan, demo_graph, CLUSTER).fits


def test_stage_and_rank_mismatch_is_rejected(plan):
    stages = (*plan.stages[:-1], Stage(index=plan.stages[-1].index, rank=9, layers=plan.stages[-1].layers))
    with pytest.raises(PlanError, match="placed on rank 9, but the plan has 4 pipeline ranks"):
        dataclasses.replace(plan, stages=stages).validate()


def test_grid_prints_steps_by_rank(plan):
    grid = plan.grid()
    assert grid.splitlines()[0].split() == ["step", "rank", "0", "rank", "1", "rank", "2", "rank", "3"]
    assert "0F0" in grid.splitlines()[1]
    assert format_grid(plan.actions, steps=range(2)).endswith(f"(steps 0-1 of {len(plan.actions[0])})")
    assert "schedule 1f1b" in str(plan) and "recompute" in str(plan)


DATA = Path(__file__).parents[1] / "data"


def test_a_plan_saved_by_an_earlier_vlmcompile_is_refused_with_the_fix():
    """Saved by 0.1.0 (schema 1): plans now hold encoder plans of their own, and an old file is
    refused with a message that says how to re-plan rather than read under new rules."""
    with pytest.raises(PlanError, match=r"plan_v1_tiny_megatron.json': plan JSON version 1 .* re-plan"):
        Plan.load(DATA / "plan_v1_tiny_megatron.json")


def _acts(text: str) -> tuple[Action, ...]:
    return tuple(Action.from_str(a) for a in text.split())


def _encoder_replicated_plan(**changes) -> Plan:
    """Two pipeline ranks; the encoder (stage 0) is data-parallel over both, the LLM pipelined:
    microbatch 0's encoder work runs on rank 1, microbatch 1's on rank 0."""
    fields = dict(
        model="synthetic",
        policy="test",
        stages=(
            Stage(0, 0, ("encoder",), group="encoder", replicas=(1,)),
            Stage(1, 0, ("llm0",), group="llm"),
            Stage(2, 1, ("llm1",), group="llm"),
        ),
        parallel={"encoder": Parallel(dp=2, tp=1, pp=1), "llm": Parallel(dp=1, tp=1, pp=2)},
        microbatch_size=1,
        num_microbatches=2,
        actions=(_acts("0F1 1F0 1F1 1B0 1B1 0B1"), _acts("0F0 2F0 2B0 2F1 2B1 0B0")),
        schedule="test",
    )
    fields.update(changes)
    return Plan(**fields)


def test_a_replicated_encoder_stage_validates_and_round_trips(tmp_path):
    plan = _encoder_replicated_plan()
    plan.validate()
    assert plan.stages[0].ranks == (0, 1)
    assert [s.index for s in plan.stages_on(1)] == [0, 2]
    assert plan.pipeline_parallel == Parallel(dp=1, tp=1, pp=2)
    assert plan.rank_of_action()[Action.from_str("0F0")] == 1
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


def test_a_backward_away_from_its_forward_is_named():
    plan = _encoder_replicated_plan(
        actions=(_acts("0F1 1F0 1F1 1B0 1B1 0B0"), _acts("0F0 2F0 2B0 2F1 2B1 0B1"))
    )
    with pytest.raises(
        PlanError, match=r"rank 0 step 5: 0B0 runs on another rank than its forward 0F0 \(rank 1 step 0\)"
    ):
        plan.validate()


def test_encoder_work_on_a_rank_that_does_not_hold_the_stage_is_named():
    stages = list(_encoder_replicated_plan().stages)
    stages[0] = dataclasses.replace(stages[0], replicas=())
    plan = _encoder_replicated_plan(
        stages=tuple(stages),
        parallel={"encoder": Parallel(dp=1, tp=1, pp=2), "llm": Parallel(dp=1, tp=1, pp=2)},
    )
    with pytest.raises(PlanError, match=r"rank 1 step 0: 0F0 belongs to stage 0, which is placed on rank 0"):
        plan.validate()


def test_an_encoder_group_that_does_not_cover_the_gpus_is_named():
    wrong = {"encoder": Parallel(dp=1, tp=1, pp=1), "llm": Parallel(dp=1, tp=1, pp=2)}
    with pytest.raises(PlanError, match=r"parallel group 'encoder' .* DP x TP x PP equal 2"):
        _encoder_replicated_plan(parallel=wrong).validate()
    stages = list(_encoder_replicated_plan().stages)
    stages[0] = dataclasses.replace(stages[0], replicas=())
    with pytest.raises(
        PlanError,
        match=r"stage 0 \(group 'encoder', PP=1 over 2 pipeline ranks\) is held by ranks \[0\]; "
        r"it must be held by 2 rank\(s\)",
    ):
        _encoder_replicated_plan(stages=tuple(stages)).validate()


@pytest.fixture(scope="module")
def run_ahead(demo_graph):
    """The demo with its vision tower frozen: the encoder's forwards of microbatches 0 and 1 run
    one global batch ahead."""
    from tests.pipeline_helpers import run_ahead_plan

    frozen = demo_graph.with_frozen(["vision"])
    return frozen, run_ahead_plan(frozen, global_batch=4, ahead=2)


def test_a_run_ahead_plan_validates_round_trips_and_says_what_it_carries(run_ahead, tmp_path):
    frozen, plan = run_ahead
    assert plan.run_ahead == 1 and {str(a) for a in plan.ahead} == {"0F0", "0F1"}
    assert {str(a): str(c) for a, c in plan.carried().items()} == {"0F0": "1F0", "0F1": "1F1"}
    plan.save(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json")
    assert back == plan and back.ahead == plan.ahead
    back.validate(frozen)
    assert "2 forwards run one global batch ahead" in str(plan)


def test_without_its_run_ahead_the_same_lists_are_another_plan(run_ahead):
    """The LLM's first forwards of microbatches 0 and 1 take the outputs of the step before; read
    as this step's, they wait for encoder forwards that come after them in their rank's list."""
    frozen, plan = run_ahead
    timed = dataclasses.replace(plan, run_ahead=0, ahead=frozenset())
    with pytest.raises(PlanError, match="deadlock: rank 0 is stuck at step 1 on 1F1, waiting for 0F1"):
        timed.validate(frozen)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(run_ahead=2), "at most one global batch ahead"),
        (dict(ahead=frozenset()), "run_ahead=1 with 0 forwards ahead"),
        (dict(ahead=frozenset({Action(1, ActionKind.F, 0)})), "only forwards of stages no gradient reaches"),
        (dict(ahead=frozenset({Action(0, ActionKind.F, 9)})), "is in no rank's action list"),
    ],
)
def test_a_malformed_run_ahead_is_named(run_ahead, change, message):
    _, plan = run_ahead
    with pytest.raises(PlanError, match=message):
        dataclasses.replace(plan, **change).validate()


def test_a_schedule_that_passed_is_checked_again_where_a_stage_moved(plan):
    # The action and deadlock checks run once per schedule and stage placement: a plan with the
    # same action lists but a stage on another rank is a new schedule, and is refused.
    plan.validate()
    plan.validate()
    stages = list(plan.stages)
    stages[1] = dataclasses.replace(stages[1], rank=0)
    with pytest.raises(PlanError, match="belongs to stage 1, which is placed on rank 0"):
        dataclasses.replace(plan, stages=tuple(stages)).validate()
