"""Mistral 3: a Pixtral tower over all images as one sequence, merged 2 x 2 by image size."""

from __future__ import annotations

import torch

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
# Mistral 3: Pixtral tower (2D RoPE, block-diagonal attention over all images packed in one sequence),
# patch merger (spatial merge 2) driven by image_sizes. Image 28x28 / patch 7 -> 4x4 -> 2x2 = 4 tokens.
# Sequence: [IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END] as the processor lays it out (break=101, end=102).
# image_sizes crops the padded pixel_values and decides the token count per image (value-dependent).
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    cfg = Mistral3Config(
        vision_config=PixtralVisionConfig(**VISION, image_size=28, patch_size=7),
        text_config=MistralConfig(vocab_size=VOCAB, sliding_window=None, **LLAMA, **SPECIAL),
        image_token_id=IMAGE_TOKEN,
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    model = build_model(Mistral3ForConditionalGeneration, cfg, attn_implementation, device)
    tokens = token_ids(batch, 8, 6)
    tokens[:, 3] = IMAGE_TOKEN + 1  # [IMG_BREAK]
    tokens[:, 6] = IMAGE_TOKEN + 2  # [IMG_END]
    b = {
        "input_ids": tokens,
        "pixel_values": pixels(batch, 3, 28, 28),
        "image_sizes": torch.tensor([[28, 28]] * batch),
    }
    return finish(model, b, device)


FAMILY = FamilySpec(
    key="mistral3",
    title="Mistral 3",
    tiny=tiny,
    model_types=("mistral3",),
)
