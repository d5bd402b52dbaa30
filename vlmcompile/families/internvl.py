"""InternVL: InternViT on 1-12 dynamic tiles of an image (and a thumbnail when more than one),
pixel-shuffled 2 x 2 into a Qwen2 decoder."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from vlmcompile.data.families import TileFamily, tile_and_patch
from vlmcompile.data.images import internvl as internvl_image
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


# --------------------------------------------------------------------------------------------------
# InternVL: InternViT (28 px / patch 7 -> 4x4), pixel shuffle 0.5 -> 2x2 = 4 tokens, Qwen2.
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import InternVLConfig, InternVLForConditionalGeneration, Qwen2Config
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

    cfg = InternVLConfig(
        vision_config=InternVLVisionConfig(**VISION, image_size=[28, 28], patch_size=[7, 7]),
        text_config=Qwen2Config(vocab_size=VOCAB, **LLAMA),
        image_token_id=IMAGE_TOKEN,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
    )
    model = build_model(InternVLForConditionalGeneration, cfg, attn_implementation, device)
    b = {"input_ids": token_ids(batch, 8, 4), "pixel_values": pixels(batch, 3, 28, 28)}
    return finish(model, b, device)


def layout(model: nn.Module) -> TileFamily:
    config = model.config
    vision = config.vision_config
    side, patch = tile_and_patch(vision)
    tokens = int((side // patch) ** 2 * config.downsample_ratio**2)
    return TileFamily("internvl", config.image_token_id, side, vision.num_channels, tokens, 12)


def image_features(model: nn.Module, inputs: Mapping[str, torch.Tensor]):
    config = model.config
    out = model.model.get_image_features(
        inputs["pixel_values"],
        vision_feature_layer=config.vision_feature_layer,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
    )
    # InternVL's forward takes its image features as one tensor, not one per image.
    return encoder_output(out.pooler_output.flatten(0, 1), inputs, joined=True)


FAMILY = FamilySpec(
    key="internvl",
    title="InternVL",
    tiny=tiny,
    model_types=("internvl",),
    layout=layout,
    image_features=image_features,
    # InternVL2/2.5: 448 px tiles, 14 px patches, pixel shuffle 0.5 -> 256 tokens, 1-12 tiles.
    released=TileFamily("internvl", 1, 448, 3, 256, 12),
    image_tokens=internvl_image,
)
