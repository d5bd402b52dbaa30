"""CLIP: an image and a text tower under a contrastive loss."""

from __future__ import annotations

import torch

from vlmcompile.families.spec import FamilySpec
from vlmcompile.families.tiny import (
    VISION,
    VOCAB,
    build_model,
    finish,
    pixels,
    token_ids,
)
from vlmcompile.ir.regions import Region


# --------------------------------------------------------------------------------------------------
# CLIP: contrastive loss (return_loss=True), no labels. Text pooling takes the hidden state at the first
# eos_token_id (value-dependent): eos is 127 at the last position of every sequence.
# (eos_token_id == 2 would switch CLIP to the legacy "argmax of input_ids" pooling.)
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig

    eos = VOCAB - 1
    text = CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        projection_dim=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=eos,
    )
    vision = CLIPVisionConfig(**VISION, image_size=28, patch_size=14, projection_dim=32)
    cfg = CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)
    model = build_model(CLIPModel, cfg, attn_implementation, device)
    tokens = token_ids(batch, 8, 0)
    tokens[:, 0] = 1
    tokens[:, -1] = eos
    b = {
        "input_ids": tokens,
        "pixel_values": pixels(batch, 3, 28, 28),
        "attention_mask": torch.ones_like(tokens),
        "return_loss": True,
    }
    return finish(model, b, device, labels=False)


FAMILY = FamilySpec(
    key="clip",
    title="CLIP",
    tiny=tiny,
    model_types=("clip",),
    regions={"visual_projection": Region.PROJECTOR, "logit_scale": Region.HEAD},
)
