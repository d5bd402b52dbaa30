"""Qwen3-VL: Qwen2.5-VL's layout, learned 2-D position embeddings resampled to each image's grid,
and deepstack features from vision layers added to the first text layers."""

from __future__ import annotations

from vlmcompile.families.qwen2_vl import (
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
# Qwen3-VL: as Qwen2.5-VL but learned 2D position embeddings (num_position_embeddings=16 -> 4x4 grid,
# bilinearly interpolated to grid_thw), deepstack features from vision layer 0 added to the first text
# layer's hidden states, and interleaved M-RoPE (mrope_section [2, 1, 1] for head_dim 8).
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    vision = dict(
        **QWEN_VISION,
        intermediate_size=64,
        out_hidden_size=32,
        patch_size=7,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )
    rope = {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    cfg = Qwen3VLConfig(
        vision_config=vision,
        text_config=dict(vocab_size=VOCAB, head_dim=8, rope_parameters=rope, **LLAMA, **SPECIAL),
        **QWEN_TOKEN_IDS,
    )
    model = build_model(Qwen3VLForConditionalGeneration, cfg, attn_implementation, device)
    return finish(model, qwen_batch(batch, 7), device)


FAMILY = FamilySpec(
    key="qwen3-vl",
    title="Qwen3-VL",
    tiny=tiny,
    model_types=("qwen3_vl",),
    regions=REGIONS,
    layout=layout,
    image_features=image_features,
)
