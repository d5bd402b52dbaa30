"""The one placement rule: torch's stage-to-rank mappings, and every builder following it."""

import pytest
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from tests.sim_helpers import make_plan
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.placement import Placement, PlacementStyle, replicated_stage_ranks, stage_to_rank


@pytest.mark.parametrize("style", ["loop", "v"])
@pytest.mark.parametrize(("pp", "v"), [(1, 1), (2, 2), (3, 2), (4, 2), (4, 4), (3, 3)])
def test_stage_to_rank_is_torchs_mapping(style, pp, v):
    theirs = generate_stage_to_rank_mapping(pp, pp * v, style=style)
    assert Placement(pp, v, style).ranks() == tuple(theirs[k] for k in range(pp * v))


def test_a_v_placement_turns_at_the_last_rank_and_comes_back_to_rank_0():
    placement = Placement(4, 2, PlacementStyle.V)
    assert placement.ranks() == (0, 1, 2, 3, 3, 2, 1, 0)
    assert placement.stages_on(0) == (0, 7)
    assert placement.stage_at(3, 1) == 4
    assert Placement(4, 1, "v").ranks() == Placement(4, 1, "loop").ranks()


def test_every_rank_holds_v_stages_and_every_stage_one_rank():
    for style in PlacementStyle:
        placement = Placement(3, 4, style)
        held = [k for r in range(3) for k in placement.stages_on(r)]
        assert sorted(held) == list(range(12))
        assert all(len(placement.stages_on(r)) == 4 for r in range(3))


def test_bad_placements_are_refused_naming_the_value():
    with pytest.raises(PlanError, match="stage placement 'zigzag' is unknown; choose one of loop, v"):
        Placement(2, 2, "zigzag")
    with pytest.raises(PlanError, match="stage 4 is outside the 4 stages"):
        Placement(2, 2).rank_of(4)
    with pytest.raises(PlanError, match="pp >= 1"):
        stage_to_rank(0, 0)


def test_a_plans_stages_sit_where_its_placement_says():
    from vlmcompile.planning.schedules import make_schedule

    plan = make_plan(make_schedule("v_1f1b", Placement(2, 2, "v"), 4), 4, v=2, placement="v")
    plan.validate()  # every action on the rank holding its stage, no deadlock
    assert [s.rank for s in plan.stages] == [0, 1, 1, 0]
    assert str(plan.pipeline_parallel).startswith("DP=1 TP=1 PP=2 V=2, V-shaped")


def test_an_encoder_pipeline_replicated_along_the_llms_ranks():
    assert replicated_stage_ranks(1, 2, 8) == (1, 3, 5, 7)
    assert replicated_stage_ranks(0, 1, 4) == (0, 1, 2, 3)
    with pytest.raises(PlanError, match="3 must divide 4"):
        replicated_stage_ranks(0, 3, 4)
