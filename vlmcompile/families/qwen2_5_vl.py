"""Qwen2.5-VL: Qwen2-VL's layout, with windowed attention in most vision layers."""

from __future__ import annotations

from vlmcompile.families.qwen2_vl import (
    MROPE,
    QWEN_TOKEN_IDS,
    QWEN_VISION,
    REGIONS,
    image_features,
    layout,
    qwen_batch,
)
from vlmcompile.families.spec import FamilySpec
from vlmcompile.families.tiny import (
    LLAMA,
    SPECIAL,
    VOCAB,
    build_model,
    finish,
)


# --------------------------------------------------------------------------------------------------
# Qwen2.5-VL: patch 7 on 28 px; window_size 14 -> each 2x2 merge unit is its own window in layer 0;
# layer 1 is full attention (fullatt_block_indexes=[1]). ``patch_size=14, window_size=56`` is the
# released models' layout: windows of 2 x 2 merge units, which the window index reorders.
# --------------------------------------------------------------------------------------------------
def tiny(
    batch: int = 2,
    *,
    attn_implementation: str = "sdpa",
    device="cpu",
    patch_size: int = 7,
    window_size: int = 14,
):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = dict(
        **QWEN_VISION,
        intermediate_size=64,
        out_hidden_size=32,
        patch_size=patch_size,
        window_size=window_size,
        fullatt_block_indexes=[1],
    )
    cfg = Qwen2_5_VLConfig(
        vision_config=vision,
        text_config=dict(vocab_size=VOCAB, rope_scaling=MROPE, **LLAMA, **SPECIAL),
        **QWEN_TOKEN_IDS,
    )
    model = build_model(Qwen2_5_VLForConditionalGeneration, cfg, attn_implementation, device)
    return finish(model, qwen_batch(batch, patch_size), device)


FAMILY = FamilySpec(
    key="qwen2.5-vl",
    title="Qwen2.5-VL",
    tiny=tiny,
    model_types=("qwen2_5_vl",),
    regions=REGIONS,
    layout=layout,
    image_features=image_features,
)
