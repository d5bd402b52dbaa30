"""A user's own LLaVA and one batch of it, as ``vlmcompile demo --model my_llava:build_model_and_batch``
imports them: a transformers LLaVA built from its config with random weights (nothing of
vlmcompile's), and 8 samples of one shape (a 28 px image and 12 tokens each)."""

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

IMAGE = 100  # the token id LLaVA replaces with image features


def build_model_and_batch(samples: int = 8):
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**tiny, num_attention_heads=2, image_size=28, patch_size=14),
        text_config=LlamaConfig(**tiny, num_attention_heads=4, num_key_value_heads=2, vocab_size=128),
        image_token_id=IMAGE,
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).train()
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(2, IMAGE, (samples, 12), generator=g)
    input_ids[:, 1:5] = IMAGE  # a 28 px image in 14 px patches: 4 image tokens
    batch = {
        "input_ids": input_ids,
        "pixel_values": torch.randn(samples, 3, 28, 28, generator=g),
        "labels": input_ids.masked_fill(input_ids == IMAGE, -100),
    }
    return model, batch
