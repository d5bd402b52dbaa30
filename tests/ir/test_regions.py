"""Regions from module paths: the innermost keyword names a layer's region, except that a head
inside an encoder tower belongs to the tower."""

import pytest

from vlmcompile.ir.regions import Region, region_from_keywords


@pytest.mark.parametrize(
    ("path", "generative", "region"),
    [
        ("model.vision_tower.encoder.layers.0", True, Region.VISION),
        ("model.vision_tower.head", True, Region.VISION),  # SigLIP's pooling head in PaliGemma
        ("text_model.head", False, Region.TEXT),
        ("lm_head", True, Region.HEAD),
        ("language_model.lm_head", True, Region.HEAD),  # the LLM's output head stays the model's
        ("model.visual.merger", True, None),  # Qwen-VL's words are its family's (below)
        ("model.text_model.layers.0", True, Region.LLM),
        ("text_model.encoder.layers.0", False, Region.TEXT),
        ("blocks.0", True, None),
    ],
)
def test_a_paths_keywords_name_its_region(path, generative, region):
    assert region_from_keywords(path, generative=generative) is region


def test_a_familys_own_words_are_matched_before_the_common_ones():
    qwen = {"visual": Region.VISION, "merger": Region.PROJECTOR}
    assert region_from_keywords("model.visual.merger.mlp", generative=True, family=qwen) is Region.PROJECTOR
    assert region_from_keywords("model.visual.blocks.0", generative=True, family=qwen) is Region.VISION
    renamed = {"vision_tower": Region.PROJECTOR}  # a family's word overrides the common one
    assert region_from_keywords("model.vision_tower", generative=True, family=renamed) is Region.PROJECTOR
