"""Tiny models that join the image otherwise: cross-attention (Mllama), learned queries
(BLIP-2), contrastive pairs (CLIP, SigLIP)."""

from __future__ import annotations

import torch

from vlmcompile.models.hf_tiny._common import (
    IMAGE_TOKEN,
    LLAMA,
    SPECIAL,
    VISION,
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
def mllama(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
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


# --------------------------------------------------------------------------------------------------
# BLIP-2: ViT -> Q-Former (num_query_tokens=4 learned queries, cross-attention in layer 0 only) ->
# OPT decoder. With image_token_index set, the 4 query outputs replace the 4 <image> tokens.
# Q-Former (0.1) and OPT (0.1) dropouts default to non-zero: set to 0 here.
# --------------------------------------------------------------------------------------------------
def blip2(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import Blip2Config, Blip2ForConditionalGeneration, OPTConfig
    from transformers.models.blip_2.configuration_blip_2 import Blip2QFormerConfig, Blip2VisionConfig

    vision = Blip2VisionConfig(**VISION, image_size=28, patch_size=14)
    qformer = Blip2QFormerConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        cross_attention_frequency=2,
        encoder_hidden_size=32,
        max_position_embeddings=64,
    )
    text = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        word_embed_proj_dim=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        dropout=0.0,
        attention_dropout=0.0,
        **SPECIAL,
    )
    cfg = Blip2Config(
        vision_config=vision,
        qformer_config=qformer,
        text_config=text,
        num_query_tokens=4,
        image_text_hidden_size=32,
        image_token_index=IMAGE_TOKEN,
    )
    model = build_model(Blip2ForConditionalGeneration, cfg, attn_implementation, device)
    liven(model, normal=("query_tokens",))  # zero-init queries -> Q-Former self-attention gets no gradient
    tokens = token_ids(batch, 8, 4, start=0)
    tokens[:, 4] = 1  # BOS after the query tokens, as the processor lays it out
    b = {
        "input_ids": tokens,
        "pixel_values": pixels(batch, 3, 28, 28),
        "attention_mask": torch.ones_like(tokens),
    }
    return finish(model, b, device)


# --------------------------------------------------------------------------------------------------
# CLIP: contrastive loss (return_loss=True), no labels. Text pooling takes the hidden state at the first
# eos_token_id (value-dependent): eos is 127 at the last position of every sequence.
# (eos_token_id == 2 would switch CLIP to the legacy "argmax of input_ids" pooling.)
# --------------------------------------------------------------------------------------------------
def clip(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
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


def siglip(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
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
