"""Qwen2-VL: flat patches with an image grid each, merged 2 x 2 into the LLM's tokens between a
vision-start and a vision-end token, and 3-D M-RoPE positions. What the Qwen-VL line shares
(the tiny models' vision tower and token ids, the layout, the packed step's features) is here;
Qwen2.5-VL and Qwen3-VL import it."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from vlmcompile.data.families import PatchStreamFamily
from vlmcompile.data.images import qwen2_vl as qwen2_vl_image
from vlmcompile.data.packed_step import encoder_output
from vlmcompile.families.spec import FamilySpec
from vlmcompile.families.tiny import (
    IMAGE_TOKEN,
    LLAMA,
    SPECIAL,
    VOCAB,
    build_model,
    finish,
    pixels,
    token_ids,
)
from vlmcompile.ir.regions import Region

QWEN_VISION = dict(
    depth=2, hidden_size=32, num_heads=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3
)
QWEN_TOKEN_IDS = dict(
    image_token_id=IMAGE_TOKEN,
    video_token_id=IMAGE_TOKEN + 1,
    vision_start_token_id=IMAGE_TOKEN + 2,
    vision_end_token_id=IMAGE_TOKEN + 3,
)
MROPE = {"type": "mrope", "mrope_section": [1, 1, 2]}


def qwen_batch(batch: int, patch: int) -> dict[str, torch.Tensor]:
    """One 28 px image per sample: a (1, 4, 4) grid of flattened patches (2 frames of
    ``patch`` px), merged 2 x 2 into 4 tokens between <|vision_start|> and <|vision_end|>."""
    tokens = token_ids(batch, 8, 4, start=2)
    tokens[:, 1] = IMAGE_TOKEN + 2
    tokens[:, 6] = IMAGE_TOKEN + 3
    return {
        "input_ids": tokens,
        "pixel_values": pixels(16 * batch, 3 * 2 * patch * patch),
        "image_grid_thw": torch.tensor([[1, 4, 4]] * batch),
        "mm_token_type_ids": (tokens == IMAGE_TOKEN).long(),
    }


# --------------------------------------------------------------------------------------------------
# Qwen2-VL: patch 14 on a 56 px grid (4 x 4 patches), spatial merge 2 -> 4 tokens; 3D M-RoPE
# positions from mm_token_type_ids and image_grid_thw.
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        vision_config=dict(**QWEN_VISION, embed_dim=32, mlp_ratio=2, patch_size=14),
        text_config=dict(vocab_size=VOCAB, rope_scaling=MROPE, **LLAMA, **SPECIAL),
        **QWEN_TOKEN_IDS,
    )
    model = build_model(Qwen2VLForConditionalGeneration, cfg, attn_implementation, device)
    return finish(model, qwen_batch(batch, 14), device)


def layout(model: nn.Module) -> PatchStreamFamily:
    """The layout of a Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; the family's key from its
    config's model type)."""
    config = model.config
    vision = config.vision_config
    factor = vision.patch_size * vision.spatial_merge_size
    table = getattr(vision, "num_position_embeddings", None)
    return PatchStreamFamily(
        {"qwen2_vl": "qwen2-vl", "qwen2_5_vl": "qwen2.5-vl", "qwen3_vl": "qwen3-vl"}[config.model_type],
        config.image_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
        vision.patch_size,
        vision.spatial_merge_size,
        vision.temporal_patch_size,
        vision.in_channels,
        min_pixels=factor * factor,
        max_pixels=vision.patch_size**2 * vision.spatial_merge_size**2 * 1280,
        window_size=getattr(vision, "window_size", None),
        position_grid=int(table**0.5) if table else None,
    )


def image_features(model: nn.Module, inputs: Mapping[str, torch.Tensor]):
    """The merged patch features of Qwen's vision tower, given what the host computed from the
    grids; Qwen3-VL's with its deepstack layers' features."""
    given = {}
    if "window_index" in inputs:
        given = {
            "window_index": inputs["window_index"],
            "cu_window_seqlens": inputs["cu_window_seqlens"],
            "max_window_seqlen": 1,  # read by flash kernels only; segment_attention needs none
        }
    if "interp_indices" in inputs:
        given |= {"interp_indices": inputs["interp_indices"], "interp_weights": inputs["interp_weights"]}
    out = model.model.visual(
        inputs["pixel_values"],
        grid_thw=inputs["image_grid_thw"],
        cu_seqlens=inputs["cu_seqlens"],
        position_ids=inputs["vision_position_ids"],
        max_seqlen=1,
        **given,
    )
    return encoder_output(out.pooler_output, inputs, deepstack=getattr(out, "deepstack_features", None))


REGIONS = {"visual": Region.VISION, "merger": Region.PROJECTOR}
"""The vision tower is ``visual``; its ``merger`` (inside it) projects into the LLM's width."""

FAMILY = FamilySpec(
    key="qwen2-vl",
    title="Qwen2-VL",
    tiny=tiny,
    model_types=("qwen2_vl",),
    regions=REGIONS,
    layout=layout,
    image_features=image_features,
    # Qwen2-VL: 14 px patches, 2 x 2 merge, 2 frames; its processor's min and max pixels.
    released=PatchStreamFamily(
        "qwen2-vl", 1, 2, 3, 14, 2, 2, 3, min_pixels=56 * 56, max_pixels=28 * 28 * 1280
    ),
    image_tokens=qwen2_vl_image,
)
