"""Frozen parameters (``requires_grad=False``) train as in eager: no gradient (None, not zeros)
on any rank, no optimizer state, no part in the clip norm or the reductions, and the same bits
after AdamW with weight decay, whatever the plan (PP = 2, data parallel, and encoder-in-bubbles
plans whose encoder stages are replicated over the ranks) and whatever the recipe freezes: the
vision tower, everything but the projector (LLaVA's first stage), the vision tower but its last
two blocks. A stage no gradient reaches runs forwards only."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

from tests.models import build, needs_transformers
from tests.pipeline_helpers import check_equal_to_eager, encoder_on_rank_1, even_plan, separate_plan
from vlmcompile import compile
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.models.synthetic_batches import SyntheticBatches
from vlmcompile.passes.planning.bubbles import bubbles
from vlmcompile.planning.request import PlanRequest, SolverOptions
from vlmcompile.runtime.checkpoint import load_checkpoint
from vlmcompile.runtime.train_loop import TrainConfig, eager_training

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

# Weight decay is what moved frozen weights: every step must apply it to anything stepped.
CONFIG = dict(lr=3e-3, weight_decay=0.1, max_grad_norm=0.5)
GLOBAL_BATCH = 4


def _bubbles_plan(layer_graph, pp: int = 2):
    cluster = Cluster.preset(f"cpu:{pp}")
    request = PlanRequest.on(
        cluster, tp=1, pp=pp, global_batch=GLOBAL_BATCH, sequence_parallel=False, zero_stage=0
    )
    plan = bubbles(layer_graph, cluster, request, solver=SolverOptions(time_limit_s=4, workers=2)).plan
    assert len(plan.parallel) > 1, "an encoder-in-bubbles plan gives the encoder a plan of its own"
    return plan


PLANS = {
    "pp2": functools.partial(even_plan, pp=2, global_batch=GLOBAL_BATCH),
    "pp2-dp2": functools.partial(even_plan, pp=2, dp=2, global_batch=GLOBAL_BATCH),
    # The vision encoder a stage of its own on rank 1: frozen, a stage no gradient reaches.
    "encoder-alone": functools.partial(encoder_on_rank_1, global_batch=GLOBAL_BATCH),
    "encoder-replicated": functools.partial(separate_plan, pp=2, encoder_pp=1, global_batch=GLOBAL_BATCH),
    "bubbles": _bubbles_plan,
}


@dataclasses.dataclass(frozen=True)
class Parts:
    vision: torch.nn.Module
    vision_blocks: torch.nn.ModuleList
    llm: torch.nn.Module
    head: torch.nn.Module


def _parts(model) -> Parts:
    if hasattr(model, "encoders"):  # the zoo
        return Parts(model.encoders, model.encoders[0].blocks, model.llm, model.head)
    tower = model.model.vision_tower  # transformers' LLaVA
    return Parts(tower, tower.encoder.layers, model.model.language_model, model.lm_head)


def _freeze_vision(parts: Parts) -> None:
    parts.vision.requires_grad_(False)


def _llava_stage_1(parts: Parts) -> None:
    """LLaVA's pre-training stage: the projector trains alone."""
    for module in (parts.vision, parts.llm, parts.head):
        module.requires_grad_(False)


def _last_two_vit_layers(parts: Parts) -> None:
    """InternVL's recipe: the vision tower frozen but for its last two blocks."""
    parts.vision.requires_grad_(False)
    parts.vision_blocks[-2:].requires_grad_(True)


RECIPES = {
    "vision": _freeze_vision,
    "llava-stage-1": _llava_stage_1,
    "last-two-vit-layers": _last_two_vit_layers,
}


def _frozen(name: str, recipe: str):
    """(model, batch, data, names of the frozen parameters) for a training recipe's freezing."""
    if name.startswith("hf-"):
        from vlmcompile import families

        model, batch = families.build_tiny_by_name(name, batch=GLOBAL_BATCH)
        data = [batch] * 3
    else:
        model, batch = build(name, batch_size=GLOBAL_BATCH)
        data = SyntheticBatches(name, GLOBAL_BATCH)
    RECIPES[recipe](_parts(model))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and len(frozen) < len(list(model.parameters()))
    return model, batch, data, frozen


def _case(name, plan, recipe, *marks):
    hf = [needs_transformers, pytest.mark.hf] if name.startswith("hf-") else []
    return pytest.param(name, plan, recipe, marks=[*hf, *marks], id=f"{name}-{plan}-{recipe}")


# CI runs one case of each plan kind and recipe (CI minutes are counted); the rest are extended.
IN_CI = [
    ("tiny", "encoder-replicated", "vision"),
    ("tiny", "encoder-alone", "llava-stage-1"),
    ("tiny", "bubbles", "last-two-vit-layers"),
    ("hf-llava", "bubbles", "llava-stage-1"),
]
EXTENDED = [
    (name, plan, recipe)
    for name in ("tiny", "demo", "hf-llava")
    for plan in ("pp2", "bubbles")
    for recipe in RECIPES
    if (name, plan, recipe) not in IN_CI
] + [("tiny", "pp2-dp2", "vision"), ("hf-llava", "pp2-dp2", "vision")]
CASES = [_case(*c) for c in IN_CI] + [_case(*c, pytest.mark.extended) for c in EXTENDED]


@pytest.mark.parametrize(("name", "plan_name", "recipe"), CASES)
def test_frozen_parameters_get_no_gradient_and_stay_bitwise_unchanged(name, plan_name, recipe, tmp_path):
    model, batch, data, frozen = _frozen(name, recipe)
    pipe = compile(model, batch, log=None)
    totals = pipe.layer_graph.totals()
    assert totals["num_frozen_params"] == sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert "frozen" in pipe.layer_graph.region_table()
    plan = PLANS[plan_name](pipe.layer_graph)
    # Stages no gradient reaches run forwards only (validate checks them against the layer graph).
    no_gradient = pipe.layer_graph.forward_only()
    expected = {s.index for s in plan.stages if set(s.layers) <= no_gradient}
    assert plan.forward_only_stages() == expected
    if plan_name == "encoder-alone":
        assert expected == {0}, "the frozen encoder's stage must run forwards only"

    # One step: every rank's gradients are eager's, and a frozen parameter's is None everywhere.
    results = pipe.launch(plan=plan, timeout_s=60)
    check_equal_to_eager(model, batch, results)
    assert any(n in frozen for r in results for n in r["grads"]), "the plan must hold frozen parameters"
    assert all(r["grads"][n] is None for r in results for n in r["grads"] if n in frozen)

    # Three AdamW steps with weight decay: eager's losses, frozen weights bit for bit unchanged.
    config = TrainConfig(steps=3, checkpoint_dir=str(tmp_path / "ckpt"), **CONFIG)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = pipe.train(data, config, plan=plan, timeout_s=60)
    eager = copy.deepcopy(model)
    expected_losses = eager_training(eager, data, config)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(expected_losses))
    saved = load_checkpoint(tmp_path / "ckpt")  # the run's directory: its latest checkpoint
    trained = dict(eager.named_parameters())
    for n in before:
        if n in frozen:
            assert torch.equal(saved["model"][n], before[n]), f"frozen {n} changed"
        else:
            torch.testing.assert_close(saved["model"][n], trained[n].detach(), atol=2e-4, rtol=1e-3)
    assert not set(saved["optimizer"]) & frozen, "a frozen parameter has optimizer state"
    assert any(not torch.equal(saved["model"][n], before[n]) for n in before if n not in frozen)


def test_a_model_with_nothing_trainable_is_refused_before_training(tmp_path):
    model, batch = build("tiny", batch_size=GLOBAL_BATCH)
    model.requires_grad_(False)
    pipe = compile(model, batch, log=None)
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=GLOBAL_BATCH)
    with pytest.raises(Exception, match="requires_grad=False: there is nothing to train"):
        pipe.train(SyntheticBatches("tiny", GLOBAL_BATCH), TrainConfig(steps=1), plan=plan, timeout_s=60)
