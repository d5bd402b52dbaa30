"""The reference model zoo: plain-PyTorch VLMs, their towers, and every model the papers use.

* ``blocks`` - the transformer blocks (encoder and decoder kinds) every zoo model is made of.
* ``components`` - the towers a VLM is assembled from: ViT encoder, projector, decoder LLM, heads.
* ``vlm`` - whole models: the generative VLM (one or more encoders) and the contrastive pair.
* ``configs`` - the zoo's configurations and every model of the papers' setups.
* ``synthetic_batches`` - a fresh random global batch per step, with the sample batch's shapes.
* ``hf_scale`` - transformers LLaVA at the sizes people plan, on the meta device.

>>> from vlmcompile import models
>>> model = models.build("InternVL-Chat-1.5", device="meta")   # 26B parameters, no memory
>>> batch = models.sample_batch("InternVL-Chat-1.5", device="meta")

Names: the VLMs in ``models.VLMS`` (``tiny``, ``tiny-two-encoder``, ``tiny-contrastive``,
``demo``, ``InternVL-Chat-1.5``, ``Optimus-Model-A`` .. ``-D``, ``CLIP-S`` .. ``LiT-L``),
compositions ``ENCODER[+ENCODER]+LLM`` of the towers in ``ENCODERS`` and ``LLMS``
(``ViT-22B+GPT-175B``, ``InternViT-6B+Yi-34B``, ``ViT-22B+ViT-5B+GPT-175B``), or a tower alone.

The ``demo`` VLM's forward FLOPs split by region like InternVL-Chat-1.5's (InternViT-6B +
InternLM2-20B, 9 tiles x 1024 ViT tokens, 4096 LLM tokens per sample), as measured by the
annotate pass on both (checked, 5 points of tolerance, by
``tests/test_models.py::test_demo_forward_flop_shares_match_internvl_chat_1_5_within_5_points``)::

    region      InternVL-Chat-1.5   demo
    vision            37.9 %        39.6 %
    projector          0.2 %         1.4 %
    llm               61.2 %        58.0 %
    head               0.7 %         1.0 %

The demo (18 M parameters: a 4-block ViT of width 256 on 4 images of 224 px, pixel shuffle 2,
an 8-block GQA LLM of width 384 over 384 tokens) trains one step in about 0.4 s on a 2-core
CPU, for 19.8 GFLOP of forward work (InternVL-Chat-1.5: 283 TFLOP per sample).
"""

from __future__ import annotations

import torch
from torch import nn

from vlmcompile.ir.errors import ModelError
from vlmcompile.models.components import DecoderLM, TextEncoder, ViTEncoder
from vlmcompile.models.configs import (
    ENCODERS,
    LLMS,
    VLMS,
    ContrastiveConfig,
    LLMConfig,
    ModelConfig,
    ProjectorConfig,
    TextEncoderConfig,
    ViTConfig,
    VLMConfig,
    compose,
    narrowed,
    resolve,
)
from vlmcompile.models.vlm import VLM, ContrastivePair

__all__ = [
    "ENCODERS",
    "LLMS",
    "VLMS",
    "VLM",
    "ContrastiveConfig",
    "ContrastivePair",
    "LLMConfig",
    "ProjectorConfig",
    "TextEncoderConfig",
    "VLMConfig",
    "ViTConfig",
    "build",
    "compose",
    "config",
    "narrowed",
    "sample_batch",
]


def config(name_or_config: str | ModelConfig) -> ModelConfig:
    """The configuration behind a zoo name (a configuration passes through)."""
    if not isinstance(name_or_config, str):
        return name_or_config
    try:
        return resolve(name_or_config)
    except KeyError as err:
        raise ModelError(err.args[0]) from None


def build(
    name_or_config: str | ModelConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> nn.Module:
    """Build a zoo model with random weights. ``device="meta"`` allocates nothing, at any size."""
    cfg = config(name_or_config)
    torch.manual_seed(seed)
    with torch.device(device):
        if isinstance(cfg, VLMConfig):
            model: nn.Module = VLM(cfg)
        elif isinstance(cfg, ContrastiveConfig):
            model = ContrastivePair(cfg)
        elif isinstance(cfg, ViTConfig):
            model = ViTEncoder(cfg)
        elif isinstance(cfg, LLMConfig):
            model = DecoderLM(cfg)
        else:
            model = TextEncoder(cfg)
    return model.to(dtype) if dtype is not None else model


def sample_batch(
    name_or_config: str | ModelConfig,
    *,
    batch_size: int = 1,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A random batch shaped for a zoo VLM or contrastive pair, keyed by its forward's arguments."""
    cfg = config(name_or_config)
    if batch_size < 1:
        raise ModelError(f"batch_size={batch_size}; give a positive number of samples")
    generator = torch.Generator().manual_seed(seed)

    def images(*shape: int) -> torch.Tensor:
        if torch.device(device).type == "meta":
            return torch.empty(shape, device="meta", dtype=dtype)
        return torch.randn(shape, generator=generator, dtype=dtype).to(device)

    def tokens(vocab: int, length: int) -> torch.Tensor:
        if torch.device(device).type == "meta":
            return torch.empty(batch_size, length, device="meta", dtype=torch.long)
        return torch.randint(0, vocab, (batch_size, length), generator=generator).to(device)

    if isinstance(cfg, VLMConfig):
        enc = cfg.encoders[0]
        ids = tokens(cfg.llm.vocab, cfg.text_tokens)
        return {
            "pixel_values": images(
                batch_size, cfg.images_per_sample, enc.channels, enc.image_px, enc.image_px
            ),
            "input_ids": ids,
            "labels": ids.clone(),
        }
    if isinstance(cfg, ContrastiveConfig):
        enc = cfg.vision
        return {
            "pixel_values": images(batch_size, enc.channels, enc.image_px, enc.image_px),
            "input_ids": tokens(cfg.text.vocab, cfg.text.tokens),
        }
    raise ModelError(
        f"{cfg.name} is a single tower; sample batches exist for VLMs and contrastive pairs "
        f"(e.g. {next(iter(VLMS))!r} or 'ViT-22B+GPT-175B')"
    )
