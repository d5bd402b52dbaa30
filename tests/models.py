"""The tiny models the tests run on, as (model, sample batch) builders for parametrize."""

from __future__ import annotations

import importlib.util

import pytest

from vlmcompile import models

ZOO = ["tiny", "tiny-two-encoder", "tiny-contrastive", "tiny-tied"]
HF = ["hf-llava", "hf-internvl", "hf-idefics3", "hf-paligemma"]

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers (pip install '.[test]')"
)


def build(name: str, batch_size: int = 2):
    """(model with real CPU weights, sample batch)."""
    if name.startswith("hf-"):
        from vlmcompile.models import hf_tiny

        return hf_tiny.build(name)
    return models.build(name), models.sample_batch(name, batch_size=batch_size)


ALL = ZOO + [pytest.param(n, marks=[needs_transformers, pytest.mark.hf]) for n in HF]
