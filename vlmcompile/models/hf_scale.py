"""transformers LLaVA at the sizes people plan: built on the meta device from configs (no weights).

* ``llava-7b``: CLIP ViT-L/14 at 336 px (24 layers, width 1024, 576 image tokens) and Llama-2-7B
  (32 layers, width 4096, MLP 11008, vocabulary 32000), LLaVA-1.5's pairing.
* ``llava-vit22b-gpt175b``: the Optimus Model D pairing as a transformers LLaVA: ViT-22B
  (48 layers, width 6144, 48 heads, MLP 24576, patch 14 at 224 px: 256 image tokens) and
  GPT-175B's dimensions in a Llama decoder (96 layers, width 12288, 96 heads; a SwiGLU MLP of
  32768, GPT-3's 4 x 12288 at the same parameters): 197 B parameters.

The batch keeps token ids and labels on the CPU and the images on meta (see
:func:`vlmcompile.families.tiny.finish`). Needs transformers.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmcompile.ir.errors import ModelError

IMAGE_TOKEN = 32000

_SIZES = {
    "llava-7b": dict(
        vision=dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            image_size=336,
            patch_size=14,
        ),
        text=dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32064,
        ),
    ),
    "llava-vit22b-gpt175b": dict(
        vision=dict(
            hidden_size=6144,
            intermediate_size=24576,
            num_hidden_layers=48,
            num_attention_heads=48,
            image_size=224,
            patch_size=14,
        ),
        text=dict(
            hidden_size=12288,
            intermediate_size=32768,  # SwiGLU at 2/3 of GPT-3's 4 x 12288: the same parameters
            num_hidden_layers=96,
            num_attention_heads=96,
            num_key_value_heads=96,
            vocab_size=51200,
        ),
    ),
}
NAMES = tuple(_SIZES)


def build(
    name: str, *, batch: int = 1, seq_len: int = 2048, dtype: torch.dtype = torch.bfloat16
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``(model on meta, batch)``: ``seq_len`` tokens per sample, the image's tokens among them."""
    if name not in _SIZES:
        raise ModelError(f"unknown model {name!r}; choose one of {list(_SIZES)}")
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    sizes = _SIZES[name]
    vision = CLIPVisionConfig(**sizes["vision"])
    text = LlamaConfig(**sizes["text"], max_position_embeddings=max(4096, seq_len))
    cfg = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN, vision_feature_layer=-2
    )
    with torch.device("meta"):
        model = LlavaForConditionalGeneration._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    image_tokens = (vision.image_size // vision.patch_size) ** 2
    if seq_len <= image_tokens:
        raise ModelError(
            f"seq_len={seq_len} leaves no text after {image_tokens} image tokens; give a longer one"
        )
    ids = torch.randint(0, 32000, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    ids[:, 1 : 1 + image_tokens] = IMAGE_TOKEN
    labels = ids.clone()
    labels[labels == IMAGE_TOKEN] = -100
    pixels = torch.empty(batch, 3, vision.image_size, vision.image_size, dtype=dtype, device="meta")
    return model.train(), {"input_ids": ids, "pixel_values": pixels, "labels": labels}
