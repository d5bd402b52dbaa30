"""What an image becomes in each family, against transformers' own image processors (code we did
not write) on images of many sizes."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models import needs_transformers
from vlmcompile import families
from vlmcompile.data.images import internvl, internvl_grid, llava, qwen2_vl, qwen2_vl_size
from vlmcompile.ir.errors import DataError, ModelError

sides = st.integers(28, 4000)


def _transformers_functions(module: str, *names: str) -> dict:
    """Module-level functions of a transformers image processor, read from its source: the module
    itself imports torchvision, which this project does not install."""
    import ast
    import functools
    import importlib.util
    import math

    spec = importlib.util.find_spec("transformers")
    path = Path(spec.submodule_search_locations[0], *module.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in found} == set(names), f"transformers {module} has no {names}"
    namespace = {"math": math, "lru_cache": functools.lru_cache}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


@needs_transformers
@settings(max_examples=200, deadline=None)
@given(height=sides, width=sides)
def test_qwen2_vl_patches_are_transformers(height, width):
    smart_resize = _transformers_functions("models.qwen2_vl.image_processing_qwen2_vl", "smart_resize")[
        "smart_resize"
    ]

    if max(height, width) / min(height, width) > 200:
        return
    assert qwen2_vl_size(height, width) == smart_resize(height, width)
    h, w = smart_resize(height, width)
    ours = qwen2_vl(height, width)
    assert ours.patches == (h // 14) * (w // 14) and ours.llm_tokens == ours.patches // 4


@needs_transformers
@settings(max_examples=200, deadline=None)
@given(height=st.integers(1, 5000), width=st.integers(1, 5000))
def test_internvl_tiles_are_transformers(height, width):
    canvas = _transformers_functions(
        "models.got_ocr2.image_processing_got_ocr2",
        "get_all_supported_aspect_ratios",
        "get_optimal_tiled_canvas",
    )["get_optimal_tiled_canvas"]
    columns, rows = canvas((height, width), (448, 448), 1, 12)
    assert internvl_grid(height, width) == (columns, rows)
    # GotOcr2ImageProcessor.get_number_of_image_patches: the thumbnail, plus the grid when it has
    # more than one tile.
    assert internvl(height, width).tiles == 1 + (columns * rows if columns * rows > 1 else 0)


def test_internvl_known_grids_and_tokens():
    assert internvl_grid(448, 448) == (1, 1) and internvl(448, 448).llm_tokens == 256  # no thumbnail
    assert internvl_grid(448, 896) == (2, 1)  # (columns, rows) for a wide image
    wide = internvl(448, 896)
    assert (wide.tiles, wide.llm_tokens, wide.patches) == (3, 768, 3 * 1024)
    assert internvl(10000, 100).tiles <= 13


def test_llava_is_576_tokens_whatever_the_size():
    assert llava(100, 2000) == llava(336, 336) and llava(20, 30).llm_tokens == 576


@pytest.mark.parametrize(
    ("family", "size"), [("qwen2-vl", (0, 10)), ("internvl", (10, -1)), ("llava", (1.5, 2))]
)
def test_bad_images_and_families_are_refused(family, size):
    with pytest.raises(DataError, match="give its height and width as positive integers"):
        families.get(family).image_tokens(*size)
    with pytest.raises(ModelError, match="unknown model family 'gpt4v'; choose one of aya-vision, blip2, "):
        families.get("gpt4v")
    with pytest.raises(DataError, match="aspect ratios up to 200"):
        qwen2_vl(28, 28 * 300)
