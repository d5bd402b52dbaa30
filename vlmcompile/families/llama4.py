"""Llama 4: a pixel-shuffled vision tower into a mixture-of-experts decoder."""

from __future__ import annotations

from vlmcompile.families.spec import FamilySpec
from vlmcompile.families.tiny import (
    IMAGE_TOKEN,
    SPECIAL,
    VOCAB,
    build_model,
    finish,
    pixels,
    token_ids,
)


# --------------------------------------------------------------------------------------------------
# Llama 4: vision tower (CLS dropped, pixel shuffle 0.5: 16 patches -> 4 tokens; vision
# intermediate_size must be hidden / ratio^2 = 128 because the adapter MLP reuses it as its input width),
# MoE text: layer 0 dense (chunked attention, chunk 8, RoPE), layer 1 MoE with 2 experts top-1 + shared
# expert (full attention, NoPE). Sequence: <|image_start|> <|patch|>x4 <|image_end|>.
# --------------------------------------------------------------------------------------------------
def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import Llama4Config, Llama4ForConditionalGeneration
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig, Llama4VisionConfig

    vision = Llama4VisionConfig(
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=28,
        patch_size=7,
        pixel_shuffle_ratio=0.5,
        projector_input_dim=32,
        projector_output_dim=32,
        vision_output_dim=32,
    )
    text = Llama4TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        num_local_experts=2,
        num_experts_per_tok=1,
        moe_layers=[1],
        no_rope_layers=[1, 0],
        attention_chunk_size=8,
        **SPECIAL,
    )
    cfg = Llama4Config(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE_TOKEN,
        boi_token_id=IMAGE_TOKEN + 1,
        eoi_token_id=IMAGE_TOKEN + 2,
    )
    model = build_model(Llama4ForConditionalGeneration, cfg, attn_implementation, device)
    tokens = token_ids(batch, 8, 4, start=2)
    tokens[:, 1] = IMAGE_TOKEN + 1
    tokens[:, 6] = IMAGE_TOKEN + 2
    b = {"input_ids": tokens, "pixel_values": pixels(batch, 3, 28, 28)}
    return finish(model, b, device)


FAMILY = FamilySpec(
    key="llama4",
    title="Llama 4",
    tiny=tiny,
    model_types=("llama4",),
)
