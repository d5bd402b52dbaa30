"""Plan: actions round-trip as text, plans round-trip as JSON, and malformed plans are rejected
with the rank and step named."""

import dataclasses
import json
from pathlib import Path

import pytest

import vlmcompile
from tests.models import build
from tests.sim_helpers import make_plan
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.actions import Action, ActionKind, format_grid
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Plan, Precision, Stage
from vlmcompile.passes.megatron import megatron
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


def test_a_version_1_plan_has_its_precision_under_the_old_name(plan):
    data = json.loads(json.dumps(dataclasses.replace(plan, precision=Precision(param_bytes=4)).to_json()))
    data["version"] = 1
    data["training"] = data.pop("precision")
    assert Plan.from_json(data).precision == Precision(param_bytes=4)


def test_an_older_plan_schema_is_rejected_with_the_fix(plan):
    data = plan.to_json()
    data["version"] = 0
    with pytest.raises(
        PlanError,
        match=r"plan JSON version 0 is not one this vlmcompile reads \(1, 2\); re-plan: `vlmcompile plan",
    ):
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
        sim.check_fits()
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


def test_a_plan_saved_by_an_earlier_vlmcompile_still_loads_and_splits_the_model():
    """Saved by 0.1.0 before the planning core moved (``vlmcompile plan --json``): the format
    and the model's fingerprint are unchanged, so it runs as it did."""
    plan = Plan.load(DATA / "plan_v1_tiny_megatron.json")
    model, batch = build("tiny", batch_size=4)
    pipe = vlmcompile.compile(model, batch, log=None)
    runner = pipe.runner(plan)
    assert plan.fingerprint == pipe.layer_graph.fingerprint()
    assert [len(s.wiring) for s in runner.stages_all] == [len(s.layers) for s in plan.stages]
