"""Every family is registered whole: one key, its tiny model of its own model type, its layout
and image features together, its region words found in its model, its module named after it."""

import sys
import textwrap

import pytest
import torch

from tests.models import needs_transformers
from vlmcompile import families
from vlmcompile.data.families import TileFamily
from vlmcompile.families.spec import FamilySpec
from vlmcompile.ir.errors import DataError, ModelError
from vlmcompile.ir.regions import Region

pytestmark = needs_transformers


def _tiny(*args, **kwargs):
    raise AssertionError("not built")


@pytest.mark.parametrize("key", sorted(families.SPECS))
def test_every_family_is_registered_whole(key):
    spec = families.get(key)
    model, batch = families.build_tiny(key, batch=1, device="meta")
    assert families.spec_of(model) is spec, "the family's own tiny model is found as the family"
    assert spec.model_types == () or model.config.model_type in spec.model_types
    names = {c for path, _ in [*model.named_modules(), *model.named_parameters()] for c in path.split(".")}
    assert set(spec.regions) <= names, f"region words its model does not use: {set(spec.regions) - names}"
    if spec.layout is None:
        with pytest.raises(DataError, match="the families it packs are"):
            families.layout_of(model)
    else:
        assert families.layout_of(model).name == key
    if spec.model_types:
        assert families.build_tiny_by_name(spec.tiny_name, batch=1, device="meta")[0].config.model_type in (
            spec.model_types
        )


def test_a_half_registered_family_is_refused():
    layout = TileFamily("toy", 1, 28, 3, 4, 1)
    with pytest.raises(ModelError, match="has a layout but no image_features"):
        FamilySpec("toy", "Toy", _tiny, model_types=("toy",), layout=lambda m: layout)
    with pytest.raises(ModelError, match="has a image_features but no layout"):
        FamilySpec("toy", "Toy", _tiny, model_types=("toy",), image_features=lambda m, i: None)
    with pytest.raises(ModelError, match="released layout is named 'toy'; name it 'other'"):
        FamilySpec("other", "Other", _tiny, released=layout)
    with pytest.raises(ModelError, match="gives no released layout"):
        FamilySpec("toy", "Toy", _tiny, image_tokens=lambda h, w: None)
    with pytest.raises(ModelError, match="map one path component"):
        FamilySpec("toy", "Toy", _tiny, regions={"model.merger": Region.PROJECTOR})


def test_a_family_module_without_its_spec_or_under_another_name_is_refused(tmp_path, monkeypatch):
    package = tmp_path / "made_families"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "spec.py").write_text("")
    (package / "toy.py").write_text(
        textwrap.dedent(
            """
            from vlmcompile.families.spec import FamilySpec
            FAMILY = FamilySpec("toy", "Toy", print)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert list(families.discover([str(package)], "made_families")) == ["toy"]
    (package / "half.py").write_text("TILE = 28\n")
    with pytest.raises(ModelError, match="half.py holds no FAMILY"):
        families.discover([str(package)], "made_families")
    (package / "half.py").write_text("from made_families.toy import FAMILY\n")
    sys.modules.pop("made_families.half", None)
    with pytest.raises(ModelError, match="registers the family 'toy': a family lives in the module named"):
        families.discover([str(package)], "made_families")


def test_a_model_of_no_family_is_told_what_to_give():
    assert families.spec_of(torch.nn.Linear(2, 2)) is None
    with pytest.raises(DataError, match="no sample layout for Linear .* give one batch dict"):
        families.layout_of(torch.nn.Linear(2, 2))
    with pytest.raises(
        ModelError, match="unknown transformers model 'hf-gpt4v'; choose one of hf-aya-vision"
    ):
        families.build_tiny_by_name("hf-gpt4v")


DEFAULT_CONFIGS = {
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration"),
    "llava-next": ("LlavaNextConfig", "LlavaNextForConditionalGeneration"),
    "internvl": ("InternVLConfig", "InternVLForConditionalGeneration"),
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration"),
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration"),
    "qwen2-vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2.5-vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3-vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
}
"""transformers' own default configuration of each family that packs samples (their released
sizes, not ours), built on the meta device."""


@pytest.mark.parametrize("key", sorted(DEFAULT_CONFIGS))
def test_a_models_own_default_config_is_found_and_laid_out_as_its_released_models(key):
    import transformers

    config, model_class = (getattr(transformers, name) for name in DEFAULT_CONFIGS[key])
    with torch.device("meta"):
        model = model_class._from_config(config())
    assert families.spec_of(model) is families.get(key)
    layout = families.layout_of(model)
    assert layout.name == key
    if key in ("llava", "internvl"):  # transformers' defaults are the released sizes there
        released = families.get(key).released
        assert (layout.side, layout.tokens_per_tile, layout.max_tiles) == (
            released.side,
            released.tokens_per_tile,
            released.max_tiles,
        )
