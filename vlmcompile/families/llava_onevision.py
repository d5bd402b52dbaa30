"""LLaVA-OneVision: a SigLIP tower on LLaVA-NeXT's "anyres" crops, into a Qwen2 decoder."""

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
# LLaVA-OneVision: SigLIP tower ("full" strategy, no CLS), same anyres packing as LLaVA-NeXT
# (+ anyres_max_9 down-interpolation, inactive at this size). 14 tokens per image as above.
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )

    cfg = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**VISION, image_size=28, patch_size=14, vision_use_head=False),
        text_config=Qwen2Config(vocab_size=VOCAB, **LLAMA, **SPECIAL),
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN + 1,
        vision_feature_layer=-1,
        image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]],
    )
    model = build_model(LlavaOnevisionForConditionalGeneration, cfg, attn_implementation, device)
    image_tokens = 4 + 2 * (4 + 1)
    b = {
        "input_ids": token_ids(batch, 8, image_tokens),
        "pixel_values": pixels(batch, 3, 3, 28, 28),
        "image_sizes": torch.tensor([[28, 56]] * batch),
        "batch_num_images": torch.ones(batch, dtype=torch.long),  # 1 image per sample -> anyres patching
    }
    return finish(model, b, device)


FAMILY = FamilySpec(
    key="llava-onevision",
    title="LLaVA-OneVision",
    tiny=tiny,
    model_types=("llava_onevision",),
)
