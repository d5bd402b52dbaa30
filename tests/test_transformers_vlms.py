"""The transformers VLM classes people train, as tiny random-weight models: each compiles for
local CPU ranks with its regions found, trains one step equal to eager with both attention
implementations, and compiles on the meta device for 8 GPUs with the real run's figures.

Every (family, attention) pipeline runs in one launch of 2 ranks: starting ranks costs more
than all the steps together. Eager attention is checked in CI for the families whose masks are
their own (sliding windows and bidirectional image tokens, cross-attention), and the meta
compile for the plain case and those whose shapes come from values (grids, cross-attention) or
whose layers are unusual; for the others the check is marked
``extended`` (the README's test command runs it, ``.ci/run`` leaves it out: CI minutes).
Families built on another's code (``VARIANTS``) are checked whole outside CI only, and a family
is compiled only where one of its tests was selected.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models import needs_transformers
from tests.pipeline_helpers import check_bf16_losses, check_equal_to_eager
from vlmcompile import compile
from vlmcompile.families import ATTENTION, tiny_names
from vlmcompile.families import build_tiny_by_name as build
from vlmcompile.ir.regions import ENCODER_SIDE, Region
from vlmcompile.planning.encoder_plans import encoder_layer_count
from vlmcompile.runtime.checkpoint_dir import Start
from vlmcompile.runtime.launch import launch
from vlmcompile.runtime.timed_steps import one_step
from vlmcompile.runtime.train_loop import TrainConfig, eager_training, train_on_rank

# The first test's setup compiles every selected case (all 36 where nothing is deselected: 300 s
# and more with another worker beside it, 2026-11-28): more than the suite's 300 s a test.
pytestmark = [needs_transformers, pytest.mark.hf, pytest.mark.multiproc, pytest.mark.timeout(900)]

FAMILIES = tiny_names()
CONTRASTIVE = {"hf-clip", "hf-siglip"}
# Where the transformers classes keep each part (their module paths, from their modeling files):
# a layer's region is that of the longest path it sits under.
PARTS = {
    "model.vision_tower": Region.VISION,
    "model.visual": Region.VISION,
    "model.vision_model": Region.VISION,
    "vision_model": Region.VISION,
    "model.multi_modal_projector": Region.PROJECTOR,
    "multi_modal_projector": Region.PROJECTOR,
    "model.connector": Region.PROJECTOR,
    "model.visual.merger": Region.PROJECTOR,
    "qformer": Region.PROJECTOR,
    "language_projection": Region.PROJECTOR,
    "visual_projection": Region.PROJECTOR,
    "text_projection": Region.PROJECTOR,
    "model.language_model": Region.LLM,
    "model.text_model": Region.LLM,
    "language_model.model": Region.LLM,
    "lm_head": Region.HEAD,
    "language_model.lm_head": Region.HEAD,
    "text_model": Region.TEXT,  # CLIP's text tower (a generative model's is model.text_model)
}


def expected_region(layer: str) -> Region | None:
    under = [p for p in PARTS if layer == p or layer.startswith(p + ".")]
    return PARTS[max(under, key=len)] if under else None


OWN_MASKS = {"hf-gemma3", "hf-mllama"}
"""Families whose eager attention CI checks (see the module's docstring); LLaVA's, the plain
case, left CI on 2026-11-27 for its minutes."""
META_IN_CI = {
    "hf-llava",
    "hf-qwen2-vl",
    "hf-qwen3-vl",
    "hf-mllama",
    "hf-llama4",
    "hf-clip",
}
"""Families whose meta compile CI checks (see the module's docstring): the plain case, shapes from
values (grids), cross-attention, unusual layers, two towers. LLaVA and Qwen3-VL came back on
2026-11-27, once ranks forked from the rank server freed CI's minutes (7 s and under 5 s here)."""
VARIANTS = {
    "hf-llava-next": "hf-llava",
    "hf-llava-onevision": "hf-llava",
    "hf-aya-vision": "hf-llava",
    "hf-mistral3": "hf-llava",
    "hf-qwen2.5-vl": "hf-qwen2-vl",
    "hf-smolvlm": "hf-idefics3",
}
"""Family -> the family whose code path it shares (a projector onto a decoder, Qwen2-VL's grids,
Idefics3's image splitting): CI checks the second and leaves the first to the README's test
command, for CI's 15 minutes (2026-11-28: the module's compiles alone took 111 s of one core)."""


def _marks(name: str, in_ci: bool = True) -> list:
    return [pytest.mark.extended] if name in VARIANTS or not in_ci else []


CASES = [
    pytest.param(
        name,
        attn,
        marks=_marks(name, in_ci=attn == "sdpa" or name in OWN_MASKS),
        id=f"{name}-{attn}",
    )
    for name in FAMILIES
    for attn in ATTENTION
]


def _selected_cases(session) -> list[tuple[str, str]]:
    """The sdpa case of every family this run tests (the other tests use it) and the eager cases
    it selected."""
    items = [item for item in session.items if item.module.__name__ == __name__ and hasattr(item, "callspec")]
    families = {item.callspec.params["name"] for item in items}
    eager = {
        (item.callspec.params["name"], item.callspec.params["attn"])
        for item in items
        if item.originalname == "test_one_step_equals_eager"
    }
    return [
        (name, attn)
        for name in FAMILIES
        for attn in ATTENTION
        if (attn == "sdpa" and name in families) or (name, attn) in eager
    ]


@pytest.fixture(scope="module")
def compiled(request):
    """(family, attention) -> (model, batch, pipeline), or the exception compile raised."""
    out = {}
    for name, attn in _selected_cases(request.session):
        model, batch = build(name, attn_implementation=attn)
        try:
            out[(name, attn)] = (model, batch, compile(model, batch, "cpu:2", log=None))
        except Exception as err:  # each case reports its own failure
            out[(name, attn)] = err
    return out


BF16_STEPS = 3


def _bf16_trained(name: str, pipe) -> bool:
    """Whether the family trains 3 AdamW steps in bf16 here: an LLM pipeline on dict batches (the
    packed ones train in bf16 on variable data in tests/runtime/test_packed_pipeline.py)."""
    return name not in CONTRASTIVE and pipe.packed is None


def _bf16_steps(batch: dict) -> list[dict]:
    """The batch, then its images made other for each of the other :data:`BF16_STEPS` - 1 steps
    (its tokens stay: the graph is specialised on where the image tokens sit)."""
    steps = [batch]
    for k in range(1, BF16_STEPS):
        noise = torch.randn(batch["pixel_values"].shape, generator=torch.Generator().manual_seed(k))
        steps.append({**batch, "pixel_values": batch["pixel_values"] + 0.5 * noise})
    return steps


def _every_step(runners: dict, batches: dict, bf16: dict) -> dict:
    """On each rank: one training step of every runner, by case; then, per case in ``bf16``
    ((steps, throughput)), the losses of bf16 autocast training on those steps."""
    out = {case: one_step(runner, batches[case]) for case, runner in runners.items()}
    for case, (steps, throughput) in bf16.items():
        runner = runners[case]
        runner.autocast_dtype = torch.bfloat16
        config = TrainConfig(steps=len(steps), lr=3e-3, max_grad_norm=0.5)
        out[(case, "bf16")] = train_on_rank(runner, steps, config, throughput, start=Start()).losses
    return out


@pytest.fixture(scope="module")
def launched(compiled):
    """(family, attention) -> each rank's loss and gradients, all cases in one launch."""
    ok = {case: c for case, c in compiled.items() if not isinstance(c, Exception)}
    runners = {
        case: pipe.runner(timeout_s=60) if pipe.plan is not None else pipe.contrastive_step(timeout_s=60)
        for case, (_, _, pipe) in ok.items()
    }
    # A Qwen-VL dict batch is captured as its samples (packed): the runner takes it packed.
    batches = {
        case: pipe.pack(batch) if pipe.packed else dict(batch) for case, (_, batch, pipe) in ok.items()
    }
    bf16 = {
        case: (_bf16_steps(batches[case]), pipe.throughput(runners[case]))
        for case, (_, _, pipe) in ok.items()
        if case[1] == "sdpa" and _bf16_trained(case[0], pipe)
    }
    per_rank = launch(_every_step, runners, 2, args=(batches, bf16), timeout_s=60)
    return {key: [rank[key] for rank in per_rank] for key in per_rank[0]}


def _pipeline(compiled, case):
    result = compiled[case]
    if isinstance(result, Exception):
        raise result
    return result


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in FAMILIES])
def test_compiles_for_cpu_ranks_with_its_regions(compiled, name, record_property):
    model, _, pipe = _pipeline(compiled, (name, "sdpa"))
    capture = pipe.report.passes["capture"]
    # For the README's table of supported families (benchmarks/support_table.py reads them).
    record_property("model_class", type(model).__name__)
    specialized = getattr(capture, "specialized", None)  # a packed capture specialises on nothing
    record_property("specialised", ", ".join(specialized.keys) if specialized else "")
    record_property("loss_split", capture.loss_split.verdict.value)
    layers = capture.layers
    # Each layer's region, not only the set: PaliGemma's SigLIP pooling head once counted as the
    # model's output head.
    misplaced = [(lr.layer, lr.region, expected_region(lr.layer)) for lr in layers]
    misplaced = [m for m in misplaced if m[1] is not m[2]]
    assert not misplaced, misplaced
    if name in CONTRASTIVE:  # two towers and a coupled loss: no LLM pipeline to put encoder work into
        assert pipe.plan is None and pipe.tower_plan is not None and pipe.tower_step is not None
    else:
        assert pipe.plan is not None and pipe.plan.pipeline_parallel.tp == 1
        assert pipe.planned.fits
        # The encoders and projectors lead the captured order (transformers embeds the text
        # first), so an encoder-in-bubbles plan applies.
        assert encoder_layer_count(pipe.layer_graph) == sum(lr.region in ENCODER_SIDE for lr in layers), [
            (lr.layer, lr.region.value) for lr in layers
        ]


@pytest.mark.parametrize(("name", "attn"), CASES)
def test_one_step_equals_eager(compiled, launched, name, attn):
    model, batch, _ = _pipeline(compiled, (name, attn))
    assert model.config._attn_implementation == attn
    check_equal_to_eager(model, batch, launched[(name, attn)])


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in FAMILIES if n not in CONTRASTIVE])
def test_three_bf16_adamw_steps_equal_eager_under_autocast(compiled, launched, name):
    """bf16 autocast on 2 CPU ranks (PP = 2): fp32 weights, gradients and AdamW states, the
    forwards in bf16, the losses of 3 steps on other images each equal eager training's under
    ``torch.autocast("cpu", torch.bfloat16)`` (within :data:`~tests.pipeline_helpers.BF16_RTOL`)."""
    model, batch, pipe = _pipeline(compiled, (name, "sdpa"))
    if not _bf16_trained(name, pipe):
        pytest.skip("a packed pipeline: its bf16 training is tests/runtime/test_packed_pipeline.py's")
    assert pipe.plan.pipeline_parallel.pp == 2
    got = launched[((name, "sdpa"), "bf16")]
    assert got[0] == got[1]
    config = TrainConfig(steps=BF16_STEPS, lr=3e-3, max_grad_norm=0.5)
    expected = eager_training(
        copy.deepcopy(model), _bf16_steps(dict(batch)), config, autocast_dtype=torch.bfloat16
    )
    fp32_first = float(launched[(name, "sdpa")][0]["loss"])  # the same pipeline's fp32 step on the batch
    check_bf16_losses(got[0], expected, fp32_first, name)


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n, in_ci=n in META_IN_CI)) for n in FAMILIES])
def test_compiles_on_meta_for_8_gpus_with_the_real_runs_figures(compiled, name):
    _, _, real = _pipeline(compiled, (name, "sdpa"))
    model, batch = build(name, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    pipe = compile(model, batch, "h100x8", log=None)
    assert pipe.plan is not None and pipe.planned.fits
    meta_layers = [
        (x.name, x.region, x.fwd_flops, x.bwd_flops, x.saved_bytes) for x in pipe.layer_graph.layers
    ]
    real_layers = [
        (x.name, x.region, x.fwd_flops, x.bwd_flops, x.saved_bytes) for x in real.layer_graph.layers
    ]
    assert meta_layers == real_layers


@pytest.mark.parametrize(("name", "kind"), [("hf-clip", "infonce"), ("hf-siglip", "sigmoid")])
def test_a_contrastive_loss_is_planned_as_towers_and_a_whole_batch_loss(compiled, name, kind):
    _, batch, pipe = _pipeline(compiled, (name, "sdpa"))
    capture = pipe.report.passes["capture"]
    assert capture.loss_split.verdict.value == "batch-coupled"
    assert capture.coupling.loss is not None and capture.coupling.loss.kind.value == kind
    plan = pipe.tower_plan
    assert plan.num_ranks == 2 and plan.global_batch == len(batch["input_ids"])
    assert [d.reason.value for d in plan.decisions] == [
        "coupled_loss_sharded",
        "tower_memory",
        "tower_placement",
    ]
    assert torch.is_tensor(batch["input_ids"]) and batch["return_loss"] is True
