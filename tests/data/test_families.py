"""Each family's sample layout against the transformers model it describes: the positions our
data path computes are the model's own, and a synthesized sample is one the model trains on."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models import needs_transformers
from vlmcompile import families
from vlmcompile.data.families import PatchStreamFamily, TileFamily, mrope_positions
from vlmcompile.data.packing import sample_length
from vlmcompile.ir.errors import DataError

FAMILIES = [
    "hf-llava",
    "hf-llava-next",
    "hf-internvl",
    "hf-idefics3",
    "hf-smolvlm",
    "hf-qwen2-vl",
    "hf-qwen2.5-vl",
    "hf-qwen3-vl",
]


def _model(name):
    return families.build_tiny_by_name(name, batch=1)[0]


@needs_transformers
@pytest.mark.parametrize("name", FAMILIES)
def test_a_synthesized_sample_is_one_the_model_trains_on(name):
    model = _model(name)
    family = families.layout_of(model)
    g = torch.Generator().manual_seed(0)
    sample = family.synthesize(9, [(40, 60), (28, 28)], g)
    assert sample_length(sample, family, 0) == sample["input_ids"].numel()
    loss = model(**sample).loss
    assert torch.isfinite(loss)
    text_only = family.synthesize(5, [], g)
    assert family.vision_rows(text_only) == 0 and sample_length(text_only, family, 1) == 5


@needs_transformers
def test_families_read_from_the_models():
    llava, internvl, qwen = (
        families.layout_of(_model(n)) for n in ("hf-llava", "hf-internvl", "hf-qwen2-vl")
    )
    assert isinstance(llava, TileFamily) and (llava.side, llava.tokens_per_tile, llava.max_tiles) == (
        28,
        4,
        1,
    )
    assert isinstance(internvl, TileFamily) and (internvl.side, internvl.tokens_per_tile) == (28, 4)
    assert isinstance(qwen, PatchStreamFamily) and (qwen.patch, qwen.merge, qwen.patch_dim) == (14, 2, 1176)
    with pytest.raises(DataError, match="no sample layout for Linear"):
        families.layout_of(torch.nn.Linear(2, 2))


grids = st.lists(st.tuples(st.just(1), st.integers(1, 4), st.integers(1, 4)), max_size=3)


@needs_transformers
@pytest.mark.parametrize("name", ["hf-qwen2-vl", "hf-qwen2.5-vl", "hf-qwen3-vl"])
@settings(max_examples=25, deadline=None)
@given(merged=grids, text=st.integers(1, 12), seed=st.integers(0, 1000))
def test_mrope_positions_are_the_models_own(name, merged, text, seed):
    model = _model(name) if name not in _CACHE else _CACHE[name]
    _CACHE[name] = model
    family = families.layout_of(model)
    g = torch.Generator().manual_seed(seed)
    # An image of (2h, 2w) patches: h x w tokens after the 2 x 2 merge.
    sizes = [(2 * h * family.patch, 2 * w * family.patch) for _, h, w in merged]
    sample = family.synthesize(text, sizes, g)
    ours = family.positions(sample)
    if "image_grid_thw" in sample:
        theirs, _ = model.model.get_rope_index(
            sample["input_ids"], sample["mm_token_type_ids"], image_grid_thw=sample["image_grid_thw"]
        )
        torch.testing.assert_close(ours, theirs[:, 0])
    else:
        torch.testing.assert_close(ours, torch.arange(text).expand(3, -1))


_CACHE: dict = {}


def test_mrope_positions_refuse_image_tokens_that_do_not_match_the_grid():
    image = torch.tensor([False, True, True, True, False])
    with pytest.raises(DataError, match="has 3 image tokens where its grid"):
        mrope_positions(image, [(1, 4, 4)], 2)
    with pytest.raises(DataError, match="more image-token runs than its 0 image grids"):
        mrope_positions(image, [], 2)
