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


# --------------------------------------------------------------------------------------------------
# Qwen2.5-VL: flat patches [sum(t*h*w), C*tp*p*p]; grid_thw (1, 4, 4) per image with patch 7 on 28 px,
# spatial merge 2 -> 4 tokens. window_size 14 -> each 2x2 merge unit is its own window in layer 0;
# layer 1 is full attention (fullatt_block_indexes=[1]). 3D M-RoPE positions come from
# mm_token_type_ids + image_grid_thw.
# --------------------------------------------------------------------------------------------------
def _qwen_ids(batch: int, image_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = token_ids(batch, 8, image_tokens, start=2)
    tokens[:, 1] = IMAGE_TOKEN + 2  # <|vision_start|>
    tokens[:, 2 + image_tokens] = IMAGE_TOKEN + 3  # <|vision_end|>
    return tokens, (tokens == IMAGE_TOKEN).long()


def qwen2_5_vl(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            patch_size=7,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            window_size=14,
            fullatt_block_indexes=[1],
        ),
        text_config=dict(
            vocab_size=VOCAB,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
            **LLAMA,
            **SPECIAL,
        ),
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN + 1,
        vision_start_token_id=IMAGE_TOKEN + 2,
        vision_end_token_id=IMAGE_TOKEN + 3,
    )
    model = build_model(Qwen2_5_VLForConditionalGeneration, cfg, attn_implementation, device)
    tokens, mm = _qwen_ids(batch, 4)
    b = {
        "input_ids": tokens,
        "pixel_values": pixels(16 * batch, 3 * 2 * 7 * 7),
        "image_grid_thw": torch.tensor([[1, 4, 4]] * batch),
        "mm_token_type_ids": mm,
    }
    return finish(model, b, device)


# --------------------------------------------------------------------------------------------------
# Qwen3-VL: as Qwen2.5-VL but learned 2D position embeddings (num_position_embeddings=16 -> 4x4 grid,
# bilinearly interpolated to grid_thw), deepstack features from vision layer 0 added to the first text
# layer's hidden states, and interleaved M-RoPE (mrope_section [2, 1, 1] for head_dim 8).
# --------------------------------------------------------------------------------------------------
def qwen3_vl(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            patch_size=7,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        ),
        text_config=dict(
            vocab_size=VOCAB,
            head_dim=8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            **LLAMA,
            **SPECIAL,
        ),
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN + 1,
        vision_start_token_id=IMAGE_TOKEN + 2,
        vision_end_token_id=IMAGE_TOKEN + 3,
    )
    model = build_model(Qwen3VLForConditionalGeneration, cfg, attn_implementation, device)
    tokens, mm = _qwen_ids(batch, 4)
    b = {
        "input_ids": tokens,
        "pixel_values": pixels(16 * batch, 3 * 2 * 7 * 7),
        "image_grid_thw": torch.tensor([[1, 4, 4]] * batch),
        "mm_token_type_ids": mm,
    }
    return finish(model, b, device)


# --------------------------------------------------------------------------------------------------
# Qwen2-VL: flat patches [sum(t*h*w), C*tp*p*p]; grid_thw (1, 4, 4) per image with patch 14,
# spatial merge 2 -> 4 tokens between vision_start and vision_end.
# --------------------------------------------------------------------------------------------------
def qwen2_vl(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=32,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        text_config=dict(
            vocab_size=VOCAB, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, **LLAMA, **SPECIAL
        ),
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN + 1,
        vision_start_token_id=IMAGE_TOKEN + 2,
        vision_end_token_id=IMAGE_TOKEN + 3,
    )
    model = build_model(Qwen2VLForConditionalGeneration, cfg, attn_implementation, device)
    tokens, mm = _qwen_ids(batch, 4)
    b = {
        "input_ids": tokens,
        "pixel_values": pixels(16 * batch, 3 * 2 * 14 * 14),
        "image_grid_thw": torch.tensor([[1, 4, 4]] * batch),
        "mm_token_type_ids": mm,
    }
    return finish(model, b, device)
