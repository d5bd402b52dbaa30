"""SmolVLM: Idefics3's layout and connector; all-zero images in a batch are padding it drops."""

from __future__ import annotations

import torch

from vlmcompile.families.idefics3 import REGIONS, image_features, layout
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
# SmolVLM: Idefics3-style. pixel_values [batch, images, C, H, W]; all-zero images are treated as padding
# and dropped (value-dependent). 28 px / patch 7 -> 16 patches, pixel shuffle (scale 2) -> 4 tokens.
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import LlamaConfig, SmolVLMConfig, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig

    cfg = SmolVLMConfig(
        vision_config=SmolVLMVisionConfig(**VISION, image_size=28, patch_size=7),
        text_config=LlamaConfig(vocab_size=VOCAB, **LLAMA, **SPECIAL),
        image_token_id=IMAGE_TOKEN,
        scale_factor=2,
    )
    model = build_model(SmolVLMForConditionalGeneration, cfg, attn_implementation, device)
    b = {
        "input_ids": token_ids(batch, 8, 4),
        "pixel_values": pixels(batch, 1, 3, 28, 28),
        "pixel_attention_mask": torch.ones(batch, 1, 28, 28, dtype=torch.bool),
    }
    return finish(model, b, device)


FAMILY = FamilySpec(
    key="smolvlm",
    title="SmolVLM",
    tiny=tiny,
    model_types=("smolvlm",),
    regions=REGIONS,
    layout=layout,
    image_features=image_features,
)
