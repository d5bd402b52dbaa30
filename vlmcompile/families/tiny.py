"""What every tiny transformers builder shares: sizes, token ids, seeding, the batch's device.

A tiny model has 2 layers a tower, width 32, 28 px images and a vocabulary of 128, seeded
weights and inputs, the model in train mode and a batch whose loss is finite (image placeholder
tokens match the image features the model makes). ``device="meta"`` builds the model without
memory; see :func:`finish` for what a meta batch keeps on the CPU."""

from __future__ import annotations

import torch
from torch import nn

LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
"""The vision tower of every tiny VLM: 2 layers of width 32 (on 28 px images)."""
IMAGE_TOKEN = 100
VOCAB = 128
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
"""Special ids inside the tiny vocabulary (the real configs' defaults are ~100k-250k)."""

Batch = dict[str, torch.Tensor]


def token_ids(batch: int, text: int, image_tokens: int, *, start: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(2, IMAGE_TOKEN - 4, (batch, text + image_tokens), generator=g)
    out[:, start : start + image_tokens] = IMAGE_TOKEN
    return out


def pixels(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def build_model(cls: type, cfg, attn_implementation: str, device: str | torch.device) -> nn.Module:
    """``cls`` from ``cfg`` with random weights (seed 0) on ``device``; the attention
    implementation goes to every sub-config."""
    torch.manual_seed(0)
    with torch.device(device):
        return cls._from_config(cfg, attn_implementation=attn_implementation)


def liven(model: nn.Module, *, normal: tuple[str, ...] = (), gates: tuple[str, ...] = ()) -> None:
    """Re-initialise parameters transformers initialises to zero where that cuts the image off
    from the loss (no gradient into the vision tower): names ending in one of ``normal`` get
    N(0, 0.02) from a seeded generator, those ending in one of ``gates`` 0.5. No-op on meta."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(normal):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif name.endswith(gates):
                p.fill_(0.5)


def finish(
    model: nn.Module, batch: Batch, device: str | torch.device, *, labels: bool = True
) -> tuple[nn.Module, Batch]:
    """Labels (the ids, image tokens ignored), the model in train mode, the batch on ``device``.

    A meta batch holds the images on meta and keeps its integer inputs on the CPU: token ids,
    labels, image sizes and grids, token types and masks are small, and their values decide
    shapes (which tokens are image tokens, how many patches an image has), which meta tensors
    cannot tell."""
    if labels:
        lab = batch["input_ids"].clone()
        lab[lab == IMAGE_TOKEN] = -100
        batch["labels"] = lab
    on_meta = torch.device(device).type == "meta"
    moved = {
        k: v.to(device) if isinstance(v, torch.Tensor) and not (on_meta and _integer(v)) else v
        for k, v in batch.items()
    }
    return model.train(), moved


def _integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())
