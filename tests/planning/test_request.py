"""What a policy is asked for: the degrees Megatron-LM's flags make, the schedule a placement
runs by default, and every bad value refused naming it."""

import pytest

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.errors import ClusterError, PlanError
from vlmcompile.ir.plan import Parallel
from vlmcompile.planning.request import GlobalRecompute, PlanRequest, SearchSpace, SolverOptions
from vlmcompile.planning.schedules import Schedule

CLUSTER = Cluster.preset("h100x16")


def test_on_a_cluster_dp_is_what_tp_and_pp_leave():
    request = PlanRequest.on(CLUSTER, tp=2, pp=4, v=2, global_batch=32, microbatch_size=2)
    assert request.parallel.dp == 2 and request.num_microbatches == 8
    assert request.schedule_name is Schedule.INTERLEAVED_1F1B
    assert str(request) == "DP=2 TP=2 PP=4 V=2 mb=2x8"
    request.check_on(CLUSTER)
    assert request.with_degrees(v=1).parallel.v == 1 and request.with_degrees(v=1).parallel.dp == 2


def test_the_default_schedule_follows_the_placement():
    assert PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=8).schedule_name is Schedule.ONE_F_ONE_B
    v = PlanRequest.on(CLUSTER, tp=2, pp=4, v=2, global_batch=8, placement="v")
    assert v.schedule_name is Schedule.V_1F1B and v.parallel.stage_placement.ranks() == (
        0,
        1,
        2,
        3,
        3,
        2,
        1,
        0,
    )


def test_bad_requests_are_refused_with_the_fix():
    with pytest.raises(
        PlanError,
        match="global batch 15 is not a multiple of dp x microbatch size = 2 x 1; use a global batch of 16",
    ):
        PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=15)
    with pytest.raises(ClusterError, match="DP x TP x PP = 1 x 1 x 2 = 2 GPUs, but h100x16 has 16"):
        PlanRequest(parallel=Parallel(dp=1, tp=1, pp=2), global_batch=4).check_on(CLUSTER)
    with pytest.raises(PlanError, match="schedule 'zb' is unknown; choose one of gpipe"):
        PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=8, schedule="zb")
    with pytest.raises(PlanError, match="stage placement 'diagonal' is unknown"):
        PlanRequest.on(CLUSTER, tp=2, pp=4, global_batch=8, placement="diagonal")


def test_solver_options_and_search_spaces_refuse_what_cannot_run():
    with pytest.raises(PlanError, match="timeline_share=1.5"):
        SolverOptions(timeline_share=1.5)
    with pytest.raises(PlanError, match="leaves no model to solve"):
        SolverOptions(closed_form=False, timeline_share=0)
    assert SolverOptions(workers=3).num_workers == 3
    with pytest.raises(PlanError, match="pp_choices=4; give a non-empty tuple"):
        SearchSpace(pp_choices=4)
    assert SearchSpace(pp_choices=[2, 4]).pp_choices == (2, 4)


def test_a_global_recompute_names_its_setting():
    assert str(GlobalRecompute(granularity="full", vision=True)) == "full + vision"
    with pytest.raises(PlanError, match="recompute='most'; use one of none, selective, full"):
        GlobalRecompute(granularity="most")
