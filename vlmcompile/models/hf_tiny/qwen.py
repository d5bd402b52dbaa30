"""Tiny Qwen-VL models: flat patches, image grids and 3D positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""

from __future__ import annotations

import torch

from vlmcompile.models.hf_tiny._common import (
    IMAGE_TOKEN,
    LLAMA,
    SPECIAL,
    VOCAB,
    build_model,
    finish,
    pixels,
    token_ids,
)

_VISION = dict(
    depth=2, hidden_size=32, num_heads=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3
)
"""What the three Qwen vision towers share (each adds its own patch size and extras)."""
_TOKEN_IDS = dict(
    image_token_id=IMAGE_TOKEN,
    video_token_id=IMAGE_TOKEN + 1,
    vision_start_token_id=IMAGE_TOKEN + 2,
    vision_end_token_id=IMAGE_TOKEN + 3,
)
_MROPE = {"type": "mrope", "mrope_section": [1, 1, 2]}


def _qwen_batch(batch: int, patch: int) -> dict[str, torch.Tensor]:
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
def qwen2_vl(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        vision_config=dict(**_VISION, embed_dim=32, mlp_ratio=2, patch_size=14),
        text_config=dict(vocab_size=VOCAB, rope_scaling=_MROPE, **LLAMA, **SPECIAL),
        **_TOKEN_IDS,
    )
    model = build_model(Qwen2VLForConditionalGeneration, cfg, attn_implementation, device)
    return finish(model, _qwen_batch(batch, 14), device)


# --------------------------------------------------------------------------------------------------
# Qwen2.5-VL: patch 7 on 28 px; window_size 14 -> each 2x2 merge unit is its own window in layer 0;
# layer 1 is full attention (fullatt_block_indexes=[1]). ``patch_size=14, window_size=56`` is the
# released models' layout: windows of 2 x 2 merge units, which the window index reorders.
# --------------------------------------------------------------------------------------------------
def qwen2_5_vl(
    batch: int = 2,
    *,
    attn_implementation: str = "sdpa",
    device="cpu",
    patch_size: int = 7,
    window_size: int = 14,
):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = dict(
        **_VISION,
        intermediate_size=64,
        out_hidden_size=32,
        patch_size=patch_size,
        window_size=window_size,
        fullatt_block_indexes=[1],
    )
    cfg = Qwen2_5_VLConfig(
        vision_config=vision,
        text_config=dict(vocab_size=VOCAB, rope_scaling=_MROPE, **LLAMA, **SPECIAL),
        **_TOKEN_IDS,
    )
    model = build_model(Qwen2_5_VLForConditionalGeneration, cfg, attn_implementation, device)
    return finish(model, _qwen_batch(batch, patch_size), device)


# --------------------------------------------------------------------------------------------------
# Qwen3-VL: as Qwen2.5-VL but learned 2D position embeddings (num_position_embeddings=16 -> 4x4 grid,
# bilinearly interpolated to grid_thw), deepstack features from vision layer 0 added to the first text
# layer's hidden states, and interleaved M-RoPE (mrope_section [2, 1, 1] for head_dim 8).
# --------------------------------------------------------------------------------------------------
def qwen3_vl(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    vision = dict(
        **_VISION,
        intermediate_size=64,
        out_hidden_size=32,
        patch_size=7,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )
    rope = {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    cfg = Qwen3VLConfig(
        vision_config=vision,
        text_config=dict(vocab_size=VOCAB, head_dim=8, rope_parameters=rope, **LLAMA, **SPECIAL),
        **_TOKEN_IDS,
    )
    model = build_model(Qwen3VLForConditionalGeneration, cfg, attn_implementation, device)
    return finish(model, _qwen_batch(batch, 7), device)
