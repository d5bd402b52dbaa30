"""The zoo's VLMs (:mod:`vlmcompile.models`): plain PyTorch, each module's region set on its class,
images as tiles of one size."""

from __future__ import annotations

from torch import nn

from vlmcompile.data.families import TileFamily
from vlmcompile.families.spec import FamilySpec


def tiny(batch: int = 2, *, attn_implementation: str = "sdpa", device="cpu"):
    """The zoo's ``tiny`` VLM and a batch of it (its attention is always SDPA)."""
    from vlmcompile import models

    return models.build("tiny", device=device), models.sample_batch("tiny", batch_size=batch, device=device)


def is_zoo(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "cfg", None), "encoders", None)) and hasattr(model, "image_features")


def layout(model: nn.Module) -> TileFamily:
    zoo = model.cfg
    first = zoo.encoders[0]
    tokens = sum((e.grid // p.pixel_shuffle) ** 2 for e, p in zip(zoo.encoders, zoo.projectors))
    # OmniBal's InternViT models tile images as InternVL does, up to 4 tiles and a thumbnail
    # (its max_patch_num, paper_setups.json); the others take one image a tile.
    tiles = 4 if first.family == "omnibal" else 1
    return TileFamily(
        "zoo", model.image_token_id, first.image_px, first.channels, tokens, tiles, empty_images=True
    )


FAMILY = FamilySpec(key="zoo", title="the zoo's VLMs", tiny=tiny, layout=layout)
