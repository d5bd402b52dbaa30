"""Mllama (Llama 3.2 Vision): the text attends to the image through cross-attention layers."""

from __future__ import annotations

import torch

from vlmcompile.families.spec import FamilySpec
from vlmcompile.families.tiny import (
    IMAGE_TOKEN,
    LLAMA,
    SPECIAL,
    VOCAB,
    build_model,
    finish,
    liven,
    pixels,
    token_ids,
)


# --------------------------------------------------------------------------------------------------
# Mllama (Llama 3.2 Vision): no placeholder expansion; one <|image|> token per image and the text attends
# to the image through cross-attention layers. Text layer 0 = self-attention, layer 1 = cross-attention.
# Vision: 2 local layers + 1 global (gated) layer, max_num_tiles=2, tiles of 28 px / patch 14
# -> 4 patches + CLS = 5 tokens per tile (padded to 8 inside the encoder).
# vision_output_dim = hidden * (1 + len(intermediate_layers_indices)) = 64.
# Sample i uses aspect ratio [1, 2] (id 2, both tiles) if i is even, else [1, 1] (id 1, tile 2 padded).
# cross_attention_mask[b, t, image, tile] = 1 from the <|image|> token onwards for the real tiles;
# the BOS row before it is fully masked (handled by full_text_row_masked_out_mask).
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import MllamaConfig, MllamaForConditionalGeneration
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig, MllamaVisionConfig

    vision = MllamaVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_global_layers=1,
        attention_heads=2,
        image_size=28,
        patch_size=14,
        max_num_tiles=2,
        supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
        intermediate_layers_indices=[0],
        vision_output_dim=64,
    )
    text = MllamaTextConfig(vocab_size=VOCAB, cross_attention_layers=[1], **LLAMA, **SPECIAL)
    cfg = MllamaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN)
    model = build_model(MllamaForConditionalGeneration, cfg, attn_implementation, device)
    # zero-init tanh gates (cross-attention, tile/position embeddings) -> the image would not affect the loss
    liven(model, gates=("gate", "cross_attn_attn_gate", "cross_attn_mlp_gate"))
    seq = 10
    tokens = token_ids(batch, seq - 1, 1, start=1)
    tokens[:, 0] = 1  # BOS
    two_tiles = torch.tensor([i % 2 == 0 for i in range(batch)])
    aspect_ratio_ids = torch.where(two_tiles, 2, 1).view(batch, 1)
    aspect_ratio_mask = torch.stack([torch.ones(batch, dtype=torch.long), two_tiles.long()], dim=-1).view(
        batch, 1, 2
    )
    cross = torch.zeros(batch, seq, 1, 2, dtype=torch.long)
    cross[:, 1:] = aspect_ratio_mask[:, None]  # tokens from <|image|> on see the image's real tiles
    b = {
        "input_ids": tokens,
        "pixel_values": pixels(batch, 1, 2, 3, 28, 28),  # [batch, images, tiles, C, H, W]
        "aspect_ratio_ids": aspect_ratio_ids,
        "aspect_ratio_mask": aspect_ratio_mask,
        "cross_attention_mask": cross,
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
    }
    return finish(model, b, device)


FAMILY = FamilySpec(
    key="mllama",
    title="Mllama",
    tiny=tiny,
    model_types=("mllama",),
)
