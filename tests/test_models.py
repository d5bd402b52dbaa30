"""The reference zoo: every paper model builds at full size on meta, tiny ones train, the demo's
FLOP shares match InternVL-Chat-1.5's."""

import re

import pytest
import torch

from tests.models import ZOO
from vlmcompile import Region, models
from vlmcompile.ir.errors import ModelError
from vlmcompile.models.configs import ENCODERS, LLMS, VLMS, ProjectorConfig, VLMConfig
from vlmcompile.passes.graph.annotate import annotate
from vlmcompile.passes.graph.capture import capture


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(VLMS))
def test_every_named_vlm_builds_on_meta_with_a_matching_batch(name):
    model = models.build(name, device="meta")
    batch = models.sample_batch(name, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert set(batch) <= set(model.forward.__code__.co_varnames)


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("ViT-22B", 21.7),
        ("ViT-3B", 3.06),
        ("InternViT-6B", 5.53),
        ("GPT-175B", 175.0),
        ("LLAMA-70B", 69.0),
        ("Llama3-8B", 8.03),
        ("InternLM2-20B", 19.9),
        ("ViT-22B+GPT-175B", 197.2),
    ],
)
def test_parameter_counts_match_the_published_sizes(name, billions):
    count = _num_params(models.build(name, device="meta"))
    if name in LLMS and not LLMS[name].tie_embeddings:
        count += LLMS[name].vocab * LLMS[name].width  # published sizes include the output head
    assert count / 1e9 == pytest.approx(billions, rel=0.02)


def test_every_paper_tower_is_in_the_zoo():
    for name in ("ViT-3B", "ViT-5B", "ViT-11B", "ViT-22B", "InternViT-6B"):
        assert name in ENCODERS
    for name in (
        "GPT-11B",
        "LLAMA-70B",
        "GPT-175B",
        "InternLM2-20B",
        "Llama3-8B",
        "Yi-34B",
        "Llama3-70B",
        "Qwen1.5-110B",
    ):
        assert name in LLMS
    for family in ("CLIP", "CoCa", "LiT"):
        for size in "SML":
            assert f"{family}-{size}" in VLMS


@pytest.mark.parametrize("name", ZOO + ["demo"])
def test_zoo_models_train_a_step(name):
    model = models.build(name)
    loss = model(**models.sample_batch(name, batch_size=2))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_tied_head_shares_the_embedding():
    model = models.build("tiny-tied")
    assert model.head.proj.weight is model.llm.embed.weight


def _forward_shares(name: str) -> dict[str, float]:
    model = models.build(name, device="meta")
    batch = models.sample_batch(name, device="meta")
    graph = annotate(capture(model, batch).gm, batch).layer_graph
    total = graph.totals()["fwd_flops"]
    return {
        r.value: 100 * graph.totals(graph.in_region(r))["fwd_flops"] / total
        for r in Region
        if graph.in_region(r)
    }


def test_demo_forward_flop_shares_match_internvl_chat_1_5_within_5_points():
    reference = _forward_shares("InternVL-Chat-1.5")
    demo = _forward_shares("demo")
    assert set(demo) == set(reference) == {"vision", "projector", "llm", "head"}
    for region, share in reference.items():
        assert demo[region] == pytest.approx(share, abs=5), (region, demo, reference)


def test_unknown_names_and_bad_batches_raise_model_errors():
    with pytest.raises(ModelError, match="unknown model 'GPT-5'.*InternVL-Chat-1.5"):
        models.build("GPT-5")
    with pytest.raises(ModelError, match="ViT-99B"):
        models.build("ViT-99B+GPT-175B")
    with pytest.raises(ModelError, match="batch_size=0"):
        models.sample_batch("tiny", batch_size=0)
    with pytest.raises(ModelError, match="single tower"):
        models.sample_batch("GPT-175B")


def test_a_tower_takes_another_depth_after_a_colon():
    deep = models.resolve("tiny-vit:5+tiny-llm:7")
    assert deep.encoders[0].depth == 5 and deep.llm.depth == 7
    assert deep.encoders[0].width == ENCODERS["tiny-vit"].width  # only the depth changes
    model = models.build("tiny-vit:5+tiny-llm:7", device="meta")
    names = [n for n, _ in model.named_modules()]
    assert sum(bool(re.fullmatch(r"encoders\.0\.blocks\.\d+", n)) for n in names) == 5
    assert sum(bool(re.fullmatch(r"llm\.blocks\.\d+", n)) for n in names) == 7
    with pytest.raises(ModelError, match="whole number of layers >= 1, e.g. tiny-vit:100"):
        models.build("tiny-vit:0+tiny-llm")
    with pytest.raises(ModelError, match="ViT-99B:100"):
        models.build("ViT-99B:100+GPT-175B")


def test_inconsistent_vlm_configs_say_what_to_change():
    vit, llm = ENCODERS["tiny-vit"], LLMS["tiny-llm"]
    with pytest.raises(ValueError, match="pixel shuffle 3 does not divide the 4x4 patch grid"):
        VLMConfig(
            name="x",
            encoders=(vit,),
            projectors=(ProjectorConfig(pixel_shuffle=3),),
            llm=llm,
            images_per_sample=1,
            llm_tokens=12,
        )
    with pytest.raises(ValueError, match="raise llm_tokens to at least"):
        VLMConfig(
            name="x",
            encoders=(vit,),
            projectors=(ProjectorConfig(),),
            llm=llm,
            images_per_sample=1,
            llm_tokens=16,
        )
