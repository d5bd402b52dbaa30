"""Tiny VLMs that feed image tokens through a projector into the LLM's sequence:
LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision, InternVL, PaliGemma, Gemma3, Idefics3, SmolVLM,
Aya Vision, Mistral3, Llama4."""

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
# LLaVA-1.5: CLIP tower (28 px / patch 14 -> 4 patches, CLS dropped), MLP projector, Llama.
# --------------------------------------------------------------------------------------------------
def llava(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
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


# --------------------------------------------------------------------------------------------------
# InternVL: InternViT (28 px / patch 7 -> 4x4), pixel shuffle 0.5 -> 2x2 = 4 tokens, Qwen2.
# --------------------------------------------------------------------------------------------------
def internvl(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
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


# --------------------------------------------------------------------------------------------------
# PaliGemma: SigLIP (28 px / patch 14 -> 4 tokens), linear projector, Gemma; image tokens first,
# token_type_ids mark the prefix.
# --------------------------------------------------------------------------------------------------
def paligemma(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        SiglipVisionConfig,
    )

    cfg = PaliGemmaConfig(
        vision_config=SiglipVisionConfig(**VISION, image_size=28, patch_size=14, projection_dim=32),
        text_config=GemmaConfig(vocab_size=VOCAB, head_dim=8, **LLAMA),
        image_token_id=IMAGE_TOKEN,
        projection_dim=32,
    )
    model = build_model(PaliGemmaForConditionalGeneration, cfg, attn_implementation, device)
    tokens = token_ids(batch, 8, 4, start=0)
    b = {
        "input_ids": tokens,
        "pixel_values": pixels(batch, 3, 28, 28),
        "token_type_ids": (tokens != IMAGE_TOKEN).long(),
    }
    return finish(model, b, device)


# --------------------------------------------------------------------------------------------------
# Idefics3: SigLIP-style tower (28 px / patch 7 -> 16 patches), pixel shuffle (scale 2) -> 4
# tokens, Llama. pixel_values [batch, images, C, H, W].
# --------------------------------------------------------------------------------------------------
def idefics3(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    cfg = Idefics3Config(
        vision_config=Idefics3VisionConfig(**VISION, image_size=28, patch_size=7),
        text_config=LlamaConfig(vocab_size=VOCAB, **LLAMA),
        image_token_id=IMAGE_TOKEN,
        scale_factor=2,
    )
    model = build_model(Idefics3ForConditionalGeneration, cfg, attn_implementation, device)
    b = {"input_ids": token_ids(batch, 8, 4), "pixel_values": pixels(batch, 1, 3, 28, 28)}
    return finish(model, b, device)


# --------------------------------------------------------------------------------------------------
# LLaVA-NeXT: CLIP tower, "anyres" tiling. One image of 28x56 (H x W) -> best pinpoint [28, 56]
# -> 1x2 tiles of 28 px + 1 base image = 3 crops; each crop gives (28/14)^2 = 4 tokens (CLS dropped).
# Tokens = 4 (base) + 2 rows x (4 cols + 1 newline) = 14.  image_sizes decides the crop count
# (pixel_values[:, :num_patches]), the tile grid, the unpadding and hence the token count.
# --------------------------------------------------------------------------------------------------
def llava_next(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
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


# --------------------------------------------------------------------------------------------------
# LLaVA-OneVision: SigLIP tower ("full" strategy, no CLS), same anyres packing as LLaVA-NeXT
# (+ anyres_max_9 down-interpolation, inactive at this size). 14 tokens per image as above.
# --------------------------------------------------------------------------------------------------
def llava_onevision(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )

    cfg = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**VISION, image_size=28, patch_size=14, vision_use_head=False),
        text_config=Qwen2Config(vocab_size=VOCAB, **LLAMA, **SPECIAL),
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN + 1,
        vision_feature_layer=-1,
        image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]],
    )
    model = build_model(LlavaOnevisionForConditionalGeneration, cfg, attn_implementation, device)
    image_tokens = 4 + 2 * (4 + 1)
    b = {
        "input_ids": token_ids(batch, 8, image_tokens),
        "pixel_values": pixels(batch, 3, 3, 28, 28),
        "image_sizes": torch.tensor([[28, 56]] * batch),
        "batch_num_images": torch.ones(batch, dtype=torch.long),  # 1 image per sample -> anyres patching
    }
    return finish(model, b, device)


# --------------------------------------------------------------------------------------------------
# Gemma 3: SigLIP 28 px / patch 7 -> 4x4 patches, avg-pooled to mm_tokens_per_image=4.
# token_type_ids (1 = image) make the image block bidirectional. Layer 0 sliding (window 8), layer 1 full.
# Sequence: <boi> <image>x4 <eoi> text.
# --------------------------------------------------------------------------------------------------
def gemma3(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    text = Gemma3TextConfig(
        vocab_size=VOCAB,
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        **LLAMA,
        **SPECIAL,
    )
    cfg = Gemma3Config(
        vision_config=SiglipVisionConfig(**VISION, image_size=28, patch_size=7, vision_use_head=False),
        text_config=text,
        mm_tokens_per_image=4,
        image_token_id=IMAGE_TOKEN,
        boi_token_id=IMAGE_TOKEN + 1,
        eoi_token_id=IMAGE_TOKEN + 2,
    )
    model = build_model(Gemma3ForConditionalGeneration, cfg, attn_implementation, device)
    liven(model, normal=("mm_input_projection_weight",))  # zero-init -> vision tower would get no gradient
    tokens = token_ids(batch, 8, 4, start=2)
    tokens[:, 1] = IMAGE_TOKEN + 1
    tokens[:, 6] = IMAGE_TOKEN + 2
    b = {
        "input_ids": tokens,
        "pixel_values": pixels(batch, 3, 28, 28),
        "token_type_ids": (tokens == IMAGE_TOKEN).long(),
    }
    return finish(model, b, device)


# --------------------------------------------------------------------------------------------------
# SmolVLM: Idefics3-style. pixel_values [batch, images, C, H, W]; all-zero images are treated as padding
# and dropped (value-dependent). 28 px / patch 7 -> 16 patches, pixel shuffle (scale 2) -> 4 tokens.
# --------------------------------------------------------------------------------------------------
def smolvlm(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import LlamaConfig, SmolVLMConfig, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig

    cfg = SmolVLMConfig(
        vision_config=SmolVLMVisionConfig(**VISION, image_size=28, patch_size=7),
        text_config=LlamaConfig(vocab_size=VOCAB, **LLAMA, **SPECIAL),
        image_token_id=IMAGE_TOKEN,
        scale_factor=2,
    )
    model = build_model(SmolVLMForConditionalGeneration, cfg, attn_implementation, device)
    b = {
        "input_ids": token_ids(batch, 8, 4),
        "pixel_values": pixels(batch, 1, 3, 28, 28),
        "pixel_attention_mask": torch.ones(batch, 1, 28, 28, dtype=torch.bool),
    }
    return finish(model, b, device)


# --------------------------------------------------------------------------------------------------
# Aya Vision: SigLIP + pixel-shuffle (downsample 2) SwiGLU projector + Cohere2 text
# (layer 0 sliding window 8, layer 1 full). 28 px / patch 7 -> 16 patches -> 4 tokens.
# --------------------------------------------------------------------------------------------------
def aya_vision(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import (
        AyaVisionConfig,
        AyaVisionForConditionalGeneration,
        Cohere2Config,
        SiglipVisionConfig,
    )

    text = Cohere2Config(
        vocab_size=VOCAB,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        **LLAMA,
        **SPECIAL,
    )
    cfg = AyaVisionConfig(
        vision_config=SiglipVisionConfig(**VISION, image_size=28, patch_size=7, vision_use_head=False),
        text_config=text,
        image_token_id=IMAGE_TOKEN,
        downsample_factor=2,
    )
    model = build_model(AyaVisionForConditionalGeneration, cfg, attn_implementation, device)
    b = {"input_ids": token_ids(batch, 8, 4), "pixel_values": pixels(batch, 3, 28, 28)}
    return finish(model, b, device)


# --------------------------------------------------------------------------------------------------
# Mistral 3: Pixtral tower (2D RoPE, block-diagonal attention over all images packed in one sequence),
# patch merger (spatial merge 2) driven by image_sizes. Image 28x28 / patch 7 -> 4x4 -> 2x2 = 4 tokens.
# Sequence: [IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END] as the processor lays it out (break=101, end=102).
# image_sizes crops the padded pixel_values and decides the token count per image (value-dependent).
# --------------------------------------------------------------------------------------------------
def mistral3(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    cfg = Mistral3Config(
        vision_config=PixtralVisionConfig(**VISION, image_size=28, patch_size=7),
        text_config=MistralConfig(vocab_size=VOCAB, sliding_window=None, **LLAMA, **SPECIAL),
        image_token_id=IMAGE_TOKEN,
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    model = build_model(Mistral3ForConditionalGeneration, cfg, attn_implementation, device)
    tokens = token_ids(batch, 8, 6)
    tokens[:, 3] = IMAGE_TOKEN + 1  # [IMG_BREAK]
    tokens[:, 6] = IMAGE_TOKEN + 2  # [IMG_END]
    b = {
        "input_ids": tokens,
        "pixel_values": pixels(batch, 3, 28, 28),
        "image_sizes": torch.tensor([[28, 28]] * batch),
    }
    return finish(model, b, device)


# --------------------------------------------------------------------------------------------------
# Llama 4: vision tower (CLS dropped, pixel shuffle 0.5: 16 patches -> 4 tokens; vision
# intermediate_size must be hidden / ratio^2 = 128 because the adapter MLP reuses it as its input width),
# MoE text: layer 0 dense (chunked attention, chunk 8, RoPE), layer 1 MoE with 2 experts top-1 + shared
# expert (full attention, NoPE). Sequence: <|image_start|> <|patch|>x4 <|image_end|>.
# --------------------------------------------------------------------------------------------------
def llama4(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
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
