"""What one image of a given height and width becomes in the VLM families whose released models
size images by rule (each family's ``image_tokens``, :mod:`vlmcompile.families`): how many tiles or
patches its vision encoder runs, and how many LLM tokens stand for it. Each rule is the family's
image processor's, restated (and tested against transformers' own processors where they exist):

* ``llava`` - LLaVA-1.5 (Liu et al. 2023): the image resized to CLIP ViT-L/14's 336 px square,
  one 24 x 24 patch grid, 576 LLM tokens whatever its size.
* ``internvl`` - InternVL 1.5+ dynamic tiling (Chen et al. 2024; transformers' GotOcr2 image
  processor, ``crop_to_patches``): the grid of 448 px tiles (1 to 12 of them) whose aspect ratio
  is closest to the image's, ties going to more tiles while the image covers more than half of
  their area; a thumbnail tile is added when there is more than one; 256 LLM tokens a tile (its
  1024 patches of 14 px, pixel-shuffled by 2 x 2).
* ``qwen2-vl`` - Qwen2-VL native resolution (Wang et al. 2024; transformers' ``smart_resize``):
  each side rounded to a multiple of 28 (14 px patches merged 2 x 2), the area scaled into
  [56^2, 14^2 x 4 x 1280] pixels keeping the aspect ratio; one patch per 14 x 14 pixels, one LLM
  token per 2 x 2 patches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vlmcompile.ir.errors import DataError


@dataclass(frozen=True, slots=True)
class ImageTokens:
    """One image as its family's encoder and LLM see it."""

    tiles: int
    """Encoder inputs of the tile size (InternVL, LLaVA: 1); 0 where the patches vary (Qwen2-VL)."""
    patches: int
    """Vision patches the encoder runs."""
    llm_tokens: int
    """Positions the image takes in the LLM's sequence."""


def _checked(height: int, width: int) -> None:
    if not (isinstance(height, int) and isinstance(width, int)) or height < 1 or width < 1:
        raise DataError(
            f"an image of {height} x {width} pixels; give its height and width as positive integers"
        )


def llava(height: int, width: int, *, side: int = 336, patch: int = 14) -> ImageTokens:
    _checked(height, width)
    patches = (side // patch) ** 2
    return ImageTokens(tiles=1, patches=patches, llm_tokens=patches)


def internvl_grid(
    height: int, width: int, *, tile: int = 448, min_tiles: int = 1, max_tiles: int = 12
) -> tuple[int, int]:
    """(columns, rows) of the tile grid InternVL cuts the image into."""
    _checked(height, width)
    grids = sorted(
        (
            (c, r)
            for c in range(1, max_tiles + 1)
            for r in range(1, max_tiles + 1)
            if min_tiles <= c * r <= max_tiles
        ),
        key=lambda g: g[0] * g[1],
    )
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for columns, rows in grids:
        diff = abs(aspect - columns / rows)
        if diff < best_diff:
            best, best_diff = (columns, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * columns * rows:
            best = (columns, rows)
    return best


def internvl(
    height: int,
    width: int,
    *,
    tile: int = 448,
    max_tiles: int = 12,
    tokens_per_tile: int = 256,
    patch: int = 14,
) -> ImageTokens:
    columns, rows = internvl_grid(height, width, tile=tile, max_tiles=max_tiles)
    tiles = columns * rows + (1 if columns * rows > 1 else 0)  # the thumbnail
    return ImageTokens(tiles=tiles, patches=tiles * (tile // patch) ** 2, llm_tokens=tiles * tokens_per_tile)


def qwen2_vl_size(
    height: int,
    width: int,
    *,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 1280,
) -> tuple[int, int]:
    """The (height, width) Qwen2-VL resizes the image to."""
    _checked(height, width)
    if max(height, width) / min(height, width) > 200:
        raise DataError(
            f"an image of {height} x {width} pixels: Qwen2-VL takes aspect ratios up to 200; crop or pad it"
        )
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = (
            max(factor, math.floor(height / beta / factor) * factor),
            max(factor, math.floor(width / beta / factor) * factor),
        )
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def qwen2_vl(height: int, width: int, *, patch: int = 14, merge: int = 2) -> ImageTokens:
    h, w = qwen2_vl_size(height, width, factor=patch * merge)
    patches = (h // patch) * (w // patch)
    return ImageTokens(tiles=0, patches=patches, llm_tokens=patches // (merge * merge))
