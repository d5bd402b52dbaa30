"""A loss that couples the samples of a batch is found on the sample batch, planned as one
microbatch on one data-parallel rank, and refused by the runtime when a plan splits it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models import TWO_TOWER_REGIONS, TwoTowers, build, two_tower_batch
from tests.pipeline_helpers import check_equal_to_eager, even_plan
from vlmcompile import compile
from vlmcompile.graph.loss_split import LossSplit, check_loss_split
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Reason


def _verdict(name, batch_size=4):
    model, batch = build(name, batch_size=batch_size)
    return compile(model, batch, log=None).report.passes["capture"].loss_split


def test_a_contrastive_loss_is_batch_coupled_and_a_token_mean_is_not():
    coupled = _verdict("tiny-contrastive")
    assert coupled.verdict is LossSplit.BATCH_COUPLED and "couples the samples" in coupled.detail
    assert _verdict("tiny").verdict is LossSplit.PER_SAMPLE


def test_a_one_sample_batch_is_checked_on_that_sample_twice():
    # A plan may split a bigger global batch than the sample batch: one sample is no excuse.
    assert _verdict("tiny", batch_size=1).verdict is LossSplit.PER_SAMPLE
    assert _verdict("tiny-contrastive", batch_size=1).verdict is LossSplit.BATCH_COUPLED


def test_nothing_to_compare_is_said_not_guessed():
    one_with_list = check_loss_split(lambda b: b["x"].sum(), {"x": torch.ones(1, 2), "sizes": [3]})
    assert one_with_list.verdict is LossSplit.UNCHECKED and "Python values" in one_with_list.detail
    per_row = check_loss_split(lambda b: b["x"] * 2, {"x": torch.ones(3, 2)})
    assert per_row.verdict is LossSplit.UNCHECKED and "not a scalar loss" in per_row.detail


def test_a_model_that_cannot_run_on_one_sample_is_treated_as_coupled():
    def loss_of(b):
        if len(b["x"]) < 2:
            raise RuntimeError("batch norm needs more than one sample")
        return b["x"].mean()

    check = check_loss_split(loss_of, {"x": torch.randn(4, 3)})
    assert check.verdict is LossSplit.BATCH_COUPLED and "batch norm" in check.detail


def test_the_runtime_refuses_a_plan_that_splits_a_coupled_batch():
    model, batch = build("tiny-contrastive", batch_size=4)
    pipe = compile(model, batch, log=None)
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)  # 4 microbatches
    with pytest.raises(
        PlanError, match=r"splits each batch into 4 parts .* does not split over microbatches"
    ):
        pipe.runner(plan)


def _batchnorm_towers():
    """A coupled loss that cannot be sharded (BatchNorm mixes the samples inside a tower)."""
    model, batch = TwoTowers(batchnorm=True), two_tower_batch()
    return model, batch, compile(model, batch, "cpu:2", region_overrides=TWO_TOWER_REGIONS, log=None)


def test_the_coupled_loss_decision_is_in_the_plan_its_report_and_its_json(tmp_path):
    # One owner for the plan: the decision added after the search reaches every view of it.
    _, _, pipe = _batchnorm_towers()
    assert pipe.tower_plan is None and "meet inside a tower" in str(pipe.report)
    said = [d for d in pipe.plan.decisions if d.reason is Reason.LOSS_COUPLED]
    assert len(said) == 1
    assert f"[loss_coupled] {said[0].subject}: {said[0].detail}" in str(pipe.report)
    pipe.plan.save(tmp_path / "plan.json")
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert [d["detail"] for d in saved["decisions"] if d["reason"] == "loss_coupled"] == [said[0].detail]


@pytest.mark.multiproc
def test_compile_plans_a_coupled_loss_it_cannot_shard_as_one_microbatch_that_trains_like_eager():
    model, batch, pipe = _batchnorm_towers()
    assert pipe.plan.num_microbatches == 1 and pipe.plan.pipeline_parallel.dp == 1
    check_equal_to_eager(model, batch, pipe.launch(timeout_s=30))


def _token_values(b):
    return b["x"][:, 1:] * (b["labels"][:, 1:] != -100)


def test_a_mean_over_samples_is_told_from_a_mean_over_tokens_on_uneven_labels():
    batch = {"x": torch.randn(3, 6), "labels": torch.ones(3, 6, dtype=torch.long)}  # even counts

    def token_mean(b):
        return _token_values(b).sum() / (b["labels"][:, 1:] != -100).sum()

    def sample_mean(b):
        per_sample = _token_values(b).sum(1) / (b["labels"][:, 1:] != -100).sum(1)
        return per_sample.mean()

    assert check_loss_split(token_mean, batch).verdict is LossSplit.PER_SAMPLE
    # Equal on even counts; the runtime weights microbatches by tokens, so this is refused.
    check = check_loss_split(sample_mean, batch)
    assert check.verdict is LossSplit.BATCH_COUPLED and "not a mean over label tokens" in check.detail


def test_a_sample_without_label_tokens_weighs_nothing_in_the_check():
    labels = torch.ones(3, 6, dtype=torch.long)
    labels[1] = -100  # its own loss is a mean over nothing

    def token_mean(b):
        return _token_values(b).sum() / (b["labels"][:, 1:] != -100).sum()

    check = check_loss_split(token_mean, {"x": torch.randn(3, 6), "labels": labels})
    assert check.verdict is LossSplit.PER_SAMPLE
