"""Gemma 3: SigLIP patches average-pooled into a fixed count of image tokens, attended both ways."""

from __future__ import annotations

from vlmcompile.families.spec import FamilySpec
from vlmcompile.families.tiny import (
    IMAGE_TOKEN,
    LLAMA,
    SPECIAL,
    VISION,
    VOCAB,
    build_model,
    finish,
    liven,
    pixels,
    token_ids,
)


# --------------------------------------------------------------------------------------------------
# Gemma 3: SigLIP 28 px / patch 7 -> 4x4 patches, avg-pooled to mm_tokens_per_image=4.
# token_type_ids (1 = image) make the image block bidirectional. Layer 0 sliding (window 8), layer 1 full.
# Sequence: <boi> <image>x4 <eoi> text.
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    text = Gemma3TextConfig(
        vocab_size=VOCAB,
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        **LLAMA,
        **SPECIAL,
    )
    cfg = Gemma3Config(
        vision_config=SiglipVisionConfig(**VISION, image_size=28, patch_size=7, vision_use_head=False),
        text_config=text,
        mm_tokens_per_image=4,
        image_token_id=IMAGE_TOKEN,
        boi_token_id=IMAGE_TOKEN + 1,
        eoi_token_id=IMAGE_TOKEN + 2,
    )
    model = build_model(Gemma3ForConditionalGeneration, cfg, attn_implementation, device)
    liven(model, normal=("mm_input_projection_weight",))  # zero-init -> vision tower would get no gradient
    tokens = token_ids(batch, 8, 4, start=2)
    tokens[:, 1] = IMAGE_TOKEN + 1
    tokens[:, 6] = IMAGE_TOKEN + 2
    b = {
        "input_ids": tokens,
        "pixel_values": pixels(batch, 3, 28, 28),
        "token_type_ids": (tokens == IMAGE_TOKEN).long(),
    }
    return finish(model, b, device)


FAMILY = FamilySpec(
    key="gemma3",
    title="Gemma 3",
    tiny=tiny,
    model_types=("gemma3",),
)
