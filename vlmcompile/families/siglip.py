"""SigLIP: CLIP's two towers under a sigmoid loss with a learnable bias."""

from __future__ import annotations

from vlmcompile.families.spec import FamilySpec
from vlmcompile.families.tiny import (
    SPECIAL,
    VISION,
    VOCAB,
    build_model,
    finish,
    pixels,
    token_ids,
)
from vlmcompile.ir.regions import Region


def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    """SigLIP: CLIP's two towers under a sigmoid loss with a learnable bias; its text tower pools
    the last token and its vision tower an attention-pooling head."""
    from transformers import SiglipConfig, SiglipModel, SiglipTextConfig, SiglipVisionConfig

    text = SiglipTextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=8,
        projection_size=32,
        **SPECIAL,
    )
    vision = SiglipVisionConfig(**VISION, image_size=28, patch_size=14)
    cfg = SiglipConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
    model = build_model(SiglipModel, cfg, attn_implementation, device)
    b = {"input_ids": token_ids(batch, 8, 0), "pixel_values": pixels(batch, 3, 28, 28), "return_loss": True}
    return finish(model, b, device, labels=False)


FAMILY = FamilySpec(
    key="siglip",
    title="SigLIP",
    tiny=tiny,
    model_types=("siglip",),
    regions={"logit_scale": Region.HEAD},
)
