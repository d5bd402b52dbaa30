"""Aya Vision: SigLIP, a pixel-shuffle SwiGLU projector and a Cohere2 decoder."""

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
    pixels,
    token_ids,
)


# --------------------------------------------------------------------------------------------------
# Aya Vision: SigLIP + pixel-shuffle (downsample 2) SwiGLU projector + Cohere2 text
# (layer 0 sliding window 8, layer 1 full). 28 px / patch 7 -> 16 patches -> 4 tokens.
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import (
        AyaVisionConfig,
        AyaVisionForConditionalGeneration,
        Cohere2Config,
        SiglipVisionConfig,
    )

    text = Cohere2Config(
        vocab_size=VOCAB,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        **LLAMA,
        **SPECIAL,
    )
    cfg = AyaVisionConfig(
        vision_config=SiglipVisionConfig(**VISION, image_size=28, patch_size=7, vision_use_head=False),
        text_config=text,
        image_token_id=IMAGE_TOKEN,
        downsample_factor=2,
    )
    model = build_model(AyaVisionForConditionalGeneration, cfg, attn_implementation, device)
    b = {"input_ids": token_ids(batch, 8, 4), "pixel_values": pixels(batch, 3, 28, 28)}
    return finish(model, b, device)


FAMILY = FamilySpec(
    key="aya-vision",
    title="Aya Vision",
    tiny=tiny,
    model_types=("aya_vision",),
)
