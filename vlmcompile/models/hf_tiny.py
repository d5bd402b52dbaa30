"""Tiny transformers VLMs built offline from configs (random weights; nothing is downloaded).

Needs the ``test`` extra (transformers). Each builder returns ``(model, sample_batch)`` with a
batch that produces a loss: image placeholder tokens in ``input_ids`` match the number of
image features the model makes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vlmcompile.errors import ModelError

_LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# The vision tower of every tiny VLM: 2 layers of width 32 on 28 px images.
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
_IMAGE_TOKEN = 100
_VOCAB = 128


def _ids(batch: int, text: int, image_tokens: int, *, start: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, _IMAGE_TOKEN - 4, (batch, text + image_tokens), generator=g)
    ids[:, start : start + image_tokens] = _IMAGE_TOKEN
    return ids


def _finish(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    labels = batch["input_ids"].clone()
    labels[labels == _IMAGE_TOKEN] = -100
    batch["labels"] = labels
    return model.train(), batch


def llava(batch: int = 2) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        **_VISION,
        image_size=28,
        patch_size=14,
        projection_dim=32,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=LlamaConfig(vocab_size=_VOCAB, **_LLAMA),
        image_token_id=_IMAGE_TOKEN,
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg)
    image_tokens = (28 // 14) ** 2  # the "default" strategy drops the CLS token
    pixels = torch.randn(batch, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    return _finish(model, {"input_ids": _ids(batch, 8, image_tokens), "pixel_values": pixels})


def internvl(batch: int = 2) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import InternVLConfig, InternVLForConditionalGeneration, Qwen2Config
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

    vision = InternVLVisionConfig(
        **_VISION,
        image_size=[28, 28],
        patch_size=[7, 7],
    )
    text = Qwen2Config(vocab_size=_VOCAB, **_LLAMA)
    cfg = InternVLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=_IMAGE_TOKEN,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(cfg)
    image_tokens = ((28 // 7) // 2) ** 2  # 4x4 patches, pixel shuffle 0.5 -> 2x2
    pixels = torch.randn(batch, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    return _finish(model, {"input_ids": _ids(batch, 8, image_tokens), "pixel_values": pixels})


def idefics3(batch: int = 2) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    vision = Idefics3VisionConfig(
        **_VISION,
        image_size=28,
        patch_size=7,
    )
    cfg = Idefics3Config(
        vision_config=vision,
        text_config=LlamaConfig(vocab_size=_VOCAB, **_LLAMA),
        image_token_id=_IMAGE_TOKEN,
        scale_factor=2,
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(cfg)
    image_tokens = ((28 // 7) // 2) ** 2
    pixels = torch.randn(batch, 1, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    return _finish(model, {"input_ids": _ids(batch, 8, image_tokens), "pixel_values": pixels})


def paligemma(batch: int = 2) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        SiglipVisionConfig,
    )

    vision = SiglipVisionConfig(
        **_VISION,
        image_size=28,
        patch_size=14,
        projection_dim=32,
    )
    text = GemmaConfig(vocab_size=_VOCAB, head_dim=8, **_LLAMA)
    cfg = PaliGemmaConfig(
        vision_config=vision, text_config=text, image_token_id=_IMAGE_TOKEN, projection_dim=32
    )
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(cfg)
    image_tokens = (28 // 14) ** 2
    ids = _ids(batch, 8, image_tokens, start=0)
    pixels = torch.randn(batch, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    model_batch = {"input_ids": ids, "pixel_values": pixels, "token_type_ids": (ids != _IMAGE_TOKEN).long()}
    return _finish(model, model_batch)


def qwen2_vl(batch: int = 1) -> tuple[nn.Module, dict[str, torch.Tensor]]:
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
            vocab_size=160, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, **_LLAMA
        ),
        image_token_id=_IMAGE_TOKEN,
        video_token_id=_IMAGE_TOKEN + 1,
        vision_start_token_id=_IMAGE_TOKEN + 2,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg)
    grid = torch.tensor([[1, 4, 4]] * batch)  # 16 patches per image, merged 2x2 -> 4 tokens
    ids = _ids(batch, 8, 4, start=2)
    ids[:, 1] = _IMAGE_TOKEN + 2
    pixels = torch.randn(16 * batch, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    return _finish(
        model,
        {
            "input_ids": ids,
            "pixel_values": pixels,
            "image_grid_thw": grid,
            "mm_token_type_ids": (ids == _IMAGE_TOKEN).long(),
        },
    )


BUILDERS: dict[str, Callable[..., tuple[nn.Module, dict[str, torch.Tensor]]]] = {
    "hf-llava": llava,
    "hf-internvl": internvl,
    "hf-idefics3": idefics3,
    "hf-paligemma": paligemma,
    "hf-qwen2-vl": qwen2_vl,
}


def build(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    if name not in BUILDERS:
        raise ModelError(f"unknown transformers model {name!r}; choose one of {sorted(BUILDERS)}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ModelError(f"{name} needs transformers: pip install 'vlmcompile[test]'") from None
    return BUILDERS[name]()
