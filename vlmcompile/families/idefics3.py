"""Idefics3: a SigLIP-style tower on an image split into tiles (and a global view when it takes
more than one), pixel-shuffled by a connector into a Llama decoder."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from vlmcompile.data.families import SplitTileFamily, tile_and_patch
from vlmcompile.data.packed_step import encoder_output
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
from vlmcompile.ir.regions import Region


# --------------------------------------------------------------------------------------------------
# Idefics3: SigLIP-style tower (28 px / patch 7 -> 16 patches), pixel shuffle (scale 2) -> 4
# tokens, Llama. pixel_values [batch, images, C, H, W].
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    cfg = Idefics3Config(
        vision_config=Idefics3VisionConfig(**VISION, image_size=28, patch_size=7),
        text_config=LlamaConfig(vocab_size=VOCAB, **LLAMA),
        image_token_id=IMAGE_TOKEN,
        scale_factor=2,
    )
    model = build_model(Idefics3ForConditionalGeneration, cfg, attn_implementation, device)
    b = {"input_ids": token_ids(batch, 8, 4), "pixel_values": pixels(batch, 1, 3, 28, 28)}
    return finish(model, b, device)


def layout(model: nn.Module) -> SplitTileFamily:
    """Idefics3's layout, and SmolVLM's (its config says which)."""
    config = model.config
    vision = config.vision_config
    side, patch = tile_and_patch(vision)
    tokens = (side // patch) ** 2 // config.scale_factor**2
    return SplitTileFamily(config.model_type, config.image_token_id, side, vision.num_channels, tokens)


def image_features(model: nn.Module, inputs: Mapping[str, torch.Tensor]):
    """``get_image_features`` on tiles that are all real and whole (the host dropped the
    padding tiles, which the model finds by their values): every patch of every tile attends."""
    inner, pixels = model.model, inputs["pixel_values"]
    side = model.config.vision_config.patch_size
    patches = torch.ones(pixels.shape[0], pixels.shape[2] // side, pixels.shape[3] // side, dtype=torch.bool)
    hidden = inner.vision_model(
        pixel_values=pixels, patch_attention_mask=patches.to(pixels.device)
    ).last_hidden_state
    return encoder_output(inner.connector(hidden).flatten(0, 1), inputs)


REGIONS = {"connector": Region.PROJECTOR}

FAMILY = FamilySpec(
    key="idefics3",
    title="Idefics3",
    tiny=tiny,
    model_types=("idefics3",),
    regions=REGIONS,
    layout=layout,
    image_features=image_features,
    # Idefics3: 364 px tiles, 14 px patches, pixel shuffle 2 -> 169 tokens, longest edge 4 tiles.
    released=SplitTileFamily("idefics3", 1, 364, 3, 169),
)
