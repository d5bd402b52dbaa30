"""PaliGemma: SigLIP image tokens first, through a linear projector, into a Gemma decoder."""

from __future__ import annotations

from vlmcompile.families.spec import FamilySpec
from vlmcompile.families.tiny import (
    IMAGE_TOKEN,
    LLAMA,
    VISION,
    VOCAB,
    build_model,
    finish,
    pixels,
    token_ids,
)


# --------------------------------------------------------------------------------------------------
# PaliGemma: SigLIP (28 px / patch 14 -> 4 tokens), linear projector, Gemma; image tokens first,
# token_type_ids mark the prefix.
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        SiglipVisionConfig,
    )

    cfg = PaliGemmaConfig(
        vision_config=SiglipVisionConfig(**VISION, image_size=28, patch_size=14, projection_dim=32),
        text_config=GemmaConfig(vocab_size=VOCAB, head_dim=8, **LLAMA),
        image_token_id=IMAGE_TOKEN,
        projection_dim=32,
    )
    model = build_model(PaliGemmaForConditionalGeneration, cfg, attn_implementation, device)
    tokens = token_ids(batch, 8, 4, start=0)
    b = {
        "input_ids": tokens,
        "pixel_values": pixels(batch, 3, 28, 28),
        "token_type_ids": (tokens != IMAGE_TOKEN).long(),
    }
    return finish(model, b, device)


FAMILY = FamilySpec(
    key="paligemma",
    title="PaliGemma",
    tiny=tiny,
    model_types=("paligemma",),
)
