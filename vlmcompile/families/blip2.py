"""BLIP-2: learned queries through a Q-Former (projectors by the data flow) into an OPT decoder."""

from __future__ import annotations

import torch

from vlmcompile.families.spec import FamilySpec
from vlmcompile.families.tiny import (
    IMAGE_TOKEN,
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
# BLIP-2: ViT -> Q-Former (num_query_tokens=4 learned queries, cross-attention in layer 0 only) ->
# OPT decoder. With image_token_index set, the 4 query outputs replace the 4 <image> tokens.
# Q-Former (0.1) and OPT (0.1) dropouts default to non-zero: set to 0 here.
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
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


FAMILY = FamilySpec(
    key="blip2",
    title="BLIP-2",
    tiny=tiny,
    model_types=("blip-2",),
)
