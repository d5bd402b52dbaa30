"""LLaVA-1.5: a CLIP tower whose patch features (the class token dropped) go through an MLP
projector into a Llama decoder, one 336 px tile an image (576 LLM tokens)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from vlmcompile.data.families import TileFamily, tile_and_patch
from vlmcompile.data.images import llava as llava_image
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
# LLaVA-1.5: CLIP tower (28 px / patch 14 -> 4 patches, CLS dropped), MLP projector, Llama.
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION, image_size=28, patch_size=14, projection_dim=32),
        text_config=LlamaConfig(vocab_size=VOCAB, **LLAMA),
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-1,
    )
    model = build_model(LlavaForConditionalGeneration, cfg, attn_implementation, device)
    image_tokens = (28 // 14) ** 2  # the "default" strategy drops the CLS token
    b = {"input_ids": token_ids(batch, 8, image_tokens), "pixel_values": pixels(batch, 3, 28, 28)}
    return finish(model, b, device)


def layout(model: nn.Module) -> TileFamily:
    config = model.config
    vision = config.vision_config
    side, patch = tile_and_patch(vision)
    extra = 1 if getattr(config, "vision_feature_select_strategy", "default") == "full" else 0
    return TileFamily(
        "llava", config.image_token_id, side, vision.num_channels, (side // patch) ** 2 + extra, 1
    )


def projected_patches(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """LLaVA's ``get_image_features`` without its split into a list of images (a Python list
    as long as a dynamic size cannot be captured): the selected hidden states, projected, one
    row a feature. LLaVA-NeXT's crops are the same."""
    config, inner = model.config, model.model
    out = inner.vision_tower(inputs["pixel_values"], output_hidden_states=True)
    layers = config.vision_feature_layer
    chosen = [out.hidden_states[k] for k in (layers if isinstance(layers, list) else [layers])]
    if config.vision_feature_select_strategy == "default":
        chosen = [h[:, 1:] for h in chosen]
    return inner.multi_modal_projector(torch.cat(chosen, dim=-1)).flatten(0, 1)


def image_features(model: nn.Module, inputs: Mapping[str, torch.Tensor]):
    return encoder_output(projected_patches(model, inputs), inputs)


FAMILY = FamilySpec(
    key="llava",
    title="LLaVA",
    tiny=tiny,
    model_types=("llava",),
    layout=layout,
    image_features=image_features,
    # LLaVA-1.5: CLIP ViT-L/14 at 336 px, the class token dropped -> 576 tokens an image.
    released=TileFamily("llava", 1, 336, 3, 576, 1),
    image_tokens=llava_image,
)
