"""LLaVA-NeXT: LLaVA's CLIP tower and projector on "anyres" images, a base tile and a grid of
crops each, with a learned newline embedding after each row of crop features."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from vlmcompile.data.families import AnyresFamily, tile_and_patch
from vlmcompile.data.packed_step import encoder_output
from vlmcompile.families.llava import projected_patches
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
# LLaVA-NeXT: CLIP tower, "anyres" tiling. One image of 28x56 (H x W) -> best pinpoint [28, 56]
# -> 1x2 tiles of 28 px + 1 base image = 3 crops; each crop gives (28/14)^2 = 4 tokens (CLS dropped).
# Tokens = 4 (base) + 2 rows x (4 cols + 1 newline) = 14.  image_sizes decides the crop count
# (pixel_values[:, :num_patches]), the tile grid, the unpadding and hence the token count.
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    cfg = LlavaNextConfig(
        vision_config=CLIPVisionConfig(**VISION, image_size=28, patch_size=14, projection_dim=32),
        text_config=LlamaConfig(vocab_size=VOCAB, **LLAMA, **SPECIAL),
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-1,
        image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]],
        image_seq_length=4,
    )
    model = build_model(LlavaNextForConditionalGeneration, cfg, attn_implementation, device)
    image_tokens = 4 + 2 * (4 + 1)
    b = {
        "input_ids": token_ids(batch, 8, image_tokens),
        "pixel_values": pixels(batch, 3, 3, 28, 28),  # [batch, crops, C, H, W]
        "image_sizes": torch.tensor([[28, 56]] * batch),  # original (H, W) per image
    }
    return finish(model, b, device)


def layout(model: nn.Module) -> AnyresFamily:
    config = model.config
    vision = config.vision_config
    side, patch = tile_and_patch(vision)
    strategy = config.vision_feature_select_strategy
    tokens = (side // patch) ** 2 + (1 if strategy == "full" else 0)
    return AnyresFamily(
        "llava-next", config.image_token_id, side, vision.num_channels, tokens, strategy, config
    )


def image_features(model: nn.Module, inputs: Mapping[str, torch.Tensor]):
    """The crop features and the newline embedding as the last row: the table
    ``image_token_index`` gathers the image tokens from (the unpadding and row ends of
    ``pack_image_features``, done on the host)."""
    features = projected_patches(model, inputs)
    return encoder_output(torch.cat([features, model.model.image_newline[None].to(features.dtype)]), inputs)


FAMILY = FamilySpec(
    key="llava-next",
    title="LLaVA-NeXT",
    tiny=tiny,
    model_types=("llava_next",),
    layout=layout,
    image_features=image_features,
)
