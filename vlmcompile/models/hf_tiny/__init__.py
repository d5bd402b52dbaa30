"""Tiny transformers VLMs built offline from configs (random weights; nothing is downloaded).

Needs the ``test`` extra (transformers 5.x). Every builder is
``builder(batch=2, *, attn_implementation="sdpa", device="cpu") -> (model, sample_batch)``:
2 layers per tower, width 32, 28 px images, a vocabulary of 128, seeded weights and inputs, the
model in train mode and a batch whose loss is finite (image placeholder tokens match the image
features the model makes). ``device="meta"`` builds the model without memory; see
:func:`._common.finish` for what a meta batch keeps on the CPU.

* ``projector_vlms`` - image tokens through a projector into the LLM's sequence (LLaVA, InternVL, Gemma3, ...).
* ``qwen`` - Qwen-VL: flat patches, image grids and 3-D positions.
* ``other_vlms`` - cross-attention (Mllama), learned queries (BLIP-2), contrastive pairs (CLIP, SigLIP).
* ``_common`` - what every builder shares: sizes, token ids, seeding, the batch's device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vlmcompile.ir.errors import ModelError
from vlmcompile.models.hf_tiny import other_vlms, projector_vlms, qwen

BUILDERS: dict[str, Callable[..., tuple[nn.Module, dict[str, torch.Tensor]]]] = {
    "hf-llava": projector_vlms.llava,
    "hf-llava-next": projector_vlms.llava_next,
    "hf-llava-onevision": projector_vlms.llava_onevision,
    "hf-qwen2-vl": qwen.qwen2_vl,
    "hf-qwen2.5-vl": qwen.qwen2_5_vl,
    "hf-qwen3-vl": qwen.qwen3_vl,
    "hf-gemma3": projector_vlms.gemma3,
    "hf-mllama": other_vlms.mllama,
    "hf-idefics3": projector_vlms.idefics3,
    "hf-smolvlm": projector_vlms.smolvlm,
    "hf-paligemma": projector_vlms.paligemma,
    "hf-internvl": projector_vlms.internvl,
    "hf-aya-vision": projector_vlms.aya_vision,
    "hf-mistral3": projector_vlms.mistral3,
    "hf-llama4": projector_vlms.llama4,
    "hf-blip2": other_vlms.blip2,
    "hf-clip": other_vlms.clip,
    "hf-siglip": other_vlms.siglip,
}
"""Zoo name -> builder; the transformers class of each is the model's type."""

ATTENTION = ("eager", "sdpa")
"""The attention implementations every builder takes (and the tests run)."""


def build(
    name: str, *, batch: int = 2, attn_implementation: str = "sdpa", device: str = "cpu"
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    if name not in BUILDERS:
        raise ModelError(f"unknown transformers model {name!r}; choose one of {sorted(BUILDERS)}")
    if attn_implementation not in ATTENTION:
        raise ModelError(f"attn_implementation={attn_implementation!r}; choose one of {ATTENTION}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ModelError(f"{name} needs transformers: pip install 'vlmcompile[test]'") from None
    return BUILDERS[name](batch, attn_implementation=attn_implementation, device=device)
