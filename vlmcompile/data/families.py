"""How one model family lays out a sample's images, as its transformers processor returns them
for one example, and the per-sample facts the packer needs from it.

Four layouts cover the families that pack samples (each family's own module in
:mod:`vlmcompile.families` picks its layout and reads it off a model's config):
* :class:`TileFamily` - ``pixel_values`` of shape (tiles, channels, side, side), every tile the
  same number of image tokens in ``input_ids`` (LLaVA-1.5 and the zoo's VLMs: one tile an image;
  InternVL: 1-12 tiles and a thumbnail). The tiles of several samples are joined along the
  first dimension in token order, as a padded batch of them would hold them.
* :class:`PatchStreamFamily` - ``pixel_values`` of shape (patches, patch_dim) with one
  ``image_grid_thw`` row (frames, height, width in patches) per image, one image token per
  ``merge x merge`` patches, each image between a vision-start and a vision-end token, and 3-D
  M-RoPE positions (:func:`mrope_positions`) (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).
* :class:`AnyresFamily` - LLaVA-NeXT's "anyres" images: a base tile and a grid of crops each,
  ``pixel_values`` of shape (images, crops, channels, side, side) with crops padded to the most
  of any image, and ``image_sizes`` (height, width) per image.
* :class:`SplitTileFamily` - Idefics3 and SmolVLM: an image split into tiles (and a global view
  of the whole when it takes more than one), ``pixel_values`` of shape (1, tiles, channels,
  side, side) a sample, every tile the same number of image tokens.

A sample is a dict of tensors with a leading batch dimension of one for the per-token keys
(``input_ids``, ``labels``: shape (1, length)), as a processor returns it; a text-only sample
has no image keys, or image keys with no rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmcompile.data.images import internvl_grid, qwen2_vl_size
from vlmcompile.ir.errors import DataError
from vlmcompile.ir.microbatch import IGNORE_INDEX

Sample = Mapping[str, Any]


def _raw_ids(sample: Sample, where: str) -> torch.Tensor:
    """The sample's token ids as one row, padding included."""
    ids = sample.get("input_ids") if isinstance(sample, Mapping) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() not in (1, 2) or (ids.dim() == 2 and ids.shape[0] != 1):
        got = list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise DataError(
            f"{where}: input_ids is {got}; a sample holds one example's token ids, shape (1, length) as a "
            "processor returns them"
        )
    if ids.numel() == 0:
        raise DataError(f"{where} has no tokens; drop it from the dataset")
    return ids.reshape(-1)


def attended(sample: Sample, where: str) -> slice:
    """The tokens of the sample its ``attention_mask`` keeps (all of them without one). Padding
    (0 in the mask) at its start or end is dropped when packing: eager's attention never lets a
    token see it, and each token keeps its position (:func:`sequential_positions`). A mask with
    0s between its tokens is refused: packing cannot hide them."""
    ids = _raw_ids(sample, where)
    mask = sample.get("attention_mask")
    if mask is None:
        return slice(0, ids.numel())
    if not isinstance(mask, torch.Tensor) or mask.numel() != ids.numel() or mask.dim() > 2:
        got = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise DataError(
            f"{where}: attention_mask is {got} for {ids.numel()} tokens; give a 0/1 mask of shape (1, length), as "
            "a processor returns it, or none"
        )
    flat = mask.reshape(-1)
    if not bool(((flat == 0) | (flat == 1)).all()):
        raise DataError(f"{where}: attention_mask holds values other than 0 and 1; give a 0/1 padding mask")
    kept = flat.bool().nonzero().flatten()
    if not kept.numel():
        raise DataError(
            f"{where}: its attention_mask is 0 everywhere (nothing attended); drop it from the dataset"
        )
    first, last = int(kept[0]), int(kept[-1]) + 1
    if last - first != kept.numel():
        raise DataError(
            f"{where}: its attention_mask has 0s between its tokens ({last - first - kept.numel()} of them); only "
            "padding at the start or end of a sample can be dropped when packing: remove the masked tokens"
        )
    return slice(first, last)


def tokens_of(sample: Sample, where: str) -> torch.Tensor:
    """The sample's token ids as one row, its padding (:func:`attended`) dropped, or a
    :class:`DataError` naming ``where``."""
    return _raw_ids(sample, where)[attended(sample, where)]


def sequential_positions(sample: Sample) -> torch.Tensor:
    """Positions over a sample's tokens (every family but Qwen's): 0, 1, ... from its first
    token, padding counted, as eager gives them (transformers' decoders number a left-padded
    sample's tokens from its padding on; rotary attention sees only their differences)."""
    kept = attended(sample, "sample")
    return torch.arange(kept.start, kept.stop)


def sized_in_tiles(family, sizes) -> tuple[int, int]:
    """LLM tokens and tiles of a tile family's sample of ``sizes`` (a
    :class:`~vlmcompile.data.manifest.ManifestSample`), as its ``synthesize`` makes it, without
    making it."""
    tiles = sum(family.tiles(h, w) for h, w in sizes.images)
    return sizes.text_tokens + tiles * family.tokens_per_tile, tiles


def raw_labels(sample: Sample, where: str) -> torch.Tensor:
    """The sample's labels as one row, padding included."""
    ids = _raw_ids(sample, where)
    labels = sample.get("labels")
    if labels is None:
        raise DataError(f"{where} has no labels; give each sample labels (-100 where the loss skips a token)")
    if not isinstance(labels, torch.Tensor) or labels.numel() != ids.numel():
        got = list(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise DataError(f"{where}: labels are {got} for {ids.numel()} tokens; give one label a token")
    return labels.reshape(-1)


def labels_of(sample: Sample, where: str) -> torch.Tensor:
    """The sample's labels as one row, its padding dropped. A label on padding, or (left
    padding) on the first token, is refused: eager trains the padding's hidden states to predict
    it (an attention that sees no token), which packing cannot reproduce."""
    labels = raw_labels(sample, where)
    kept = attended(sample, where)
    padding = torch.cat([labels[: kept.start], labels[kept.stop :]])
    on_padding = int((padding != IGNORE_INDEX).sum())
    if on_padding:
        raise DataError(
            f"{where}: {on_padding} labels on its padding (attention_mask 0); set labels to -100 where the mask is 0, "
            "as transformers' collators do"
        )
    if kept.start and int(labels[kept.start]) != IGNORE_INDEX:
        raise DataError(
            f"{where}: left-padded, and its first token has label {int(labels[kept.start])}, which eager predicts "
            "from padding alone; set that label to -100, or pad on the right"
        )
    return labels[kept]


@dataclass(frozen=True, slots=True)
class TileFamily:
    """Images as fixed-size tiles, ``tokens_per_tile`` image tokens each."""

    name: str
    image_token_id: int
    side: int
    """Tile side in pixels."""
    channels: int
    tokens_per_tile: int
    max_tiles: int
    """Tiles of one image (1 for LLaVA; InternVL: up to 12, and a thumbnail when more than one)."""
    empty_images: bool = False
    """The model takes ``pixel_values`` with no rows for a batch without images (the zoo's VLM,
    whose forward requires the argument), rather than no ``pixel_values``."""

    image_keys = ("pixel_values",)
    token_keys: tuple[str, ...] = ()

    def tiles(self, height: int, width: int) -> int:
        """Tiles an image of ``height`` x ``width`` pixels becomes."""
        if self.max_tiles == 1:
            return 1
        columns, rows = internvl_grid(height, width, tile=self.side, max_tiles=self.max_tiles)
        return columns * rows + (1 if columns * rows > 1 else 0)

    def images(self, sample: Sample) -> int | None:
        """Images of the sample, where its layout tells (one tile an image); None for InternVL's
        tiles, which do not say which image they belong to."""
        return self.vision_rows(sample) if self.max_tiles == 1 else None

    def images_of(self, sizes) -> int | None:
        """:meth:`images` of a sample of ``sizes`` (a manifest's), without making it."""
        return len(sizes.images) if self.max_tiles == 1 else None

    def vision_rows(self, sample: Sample) -> int:
        pixels = sample.get("pixel_values")
        return 0 if pixels is None else int(pixels.shape[0])

    def expected_image_tokens(self, sample: Sample, where: str) -> int:
        pixels = sample.get("pixel_values")
        if pixels is None:
            return 0
        shape = (self.channels, self.side, self.side)
        if not isinstance(pixels, torch.Tensor) or pixels.dim() != 4 or tuple(pixels.shape[1:]) != shape:
            got = list(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
            raise DataError(
                f"{where}: pixel_values is {got}; {self.name} takes tiles of shape (tiles, {', '.join(map(str, shape))})"
            )
        return int(pixels.shape[0]) * self.tokens_per_tile

    def join_images(self, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
        tiles = [s["pixel_values"] for s in samples if self.vision_rows(s)]
        if not tiles and self.empty_images:
            return {"pixel_values": torch.zeros(0, self.channels, self.side, self.side)}
        return {"pixel_values": torch.cat(tiles)} if tiles else {}

    def step_images(self, joined: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A packed microbatch's images as its step takes them: the tiles as they are."""
        return {"pixel_values": joined["pixel_values"]}

    positions = staticmethod(sequential_positions)

    def synthesize(self, text_tokens: int, images: Sequence[tuple[int, int]], generator) -> dict:
        tiles = [self.tiles(h, w) for h, w in images]
        blocks = [torch.full((n * self.tokens_per_tile,), self.image_token_id) for n in tiles]
        sample = _chat(blocks, text_tokens, self.image_token_id, generator)
        if tiles:
            sample["pixel_values"] = torch.randn(
                sum(tiles), self.channels, self.side, self.side, generator=generator
            )
        return sample

    sized = sized_in_tiles


@dataclass(frozen=True, slots=True)
class PatchStreamFamily:
    """Images as a stream of flattened patches with a (frames, height, width) grid each."""

    name: str
    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    patch: int
    merge: int
    temporal_patch: int
    channels: int
    min_pixels: int
    max_pixels: int
    window_size: int | None = None
    """Qwen2.5-VL: the side in pixels of its windowed vision attention (None: every layer full)."""
    position_grid: int | None = None
    """Qwen3-VL: the side of its learned position-embedding table, resampled to each image's
    grid (None: rotary positions only)."""

    image_keys = ("pixel_values", "image_grid_thw")
    token_keys = ("mm_token_type_ids",)

    @property
    def patch_dim(self) -> int:
        return self.channels * self.temporal_patch * self.patch * self.patch

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        h, w = qwen2_vl_size(
            height,
            width,
            factor=self.patch * self.merge,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )
        return 1, h // self.patch, w // self.patch

    def images(self, sample: Sample) -> int | None:
        """Images of the sample: one grid row each."""
        grids = sample.get("image_grid_thw")
        return 0 if grids is None else int(grids.shape[0])

    def images_of(self, sizes) -> int | None:
        """:meth:`images` of a sample of ``sizes`` (a manifest's), without making it."""
        return len(sizes.images)

    def vision_rows(self, sample: Sample) -> int:
        pixels = sample.get("pixel_values")
        return 0 if pixels is None else int(pixels.shape[0])

    def expected_image_tokens(self, sample: Sample, where: str) -> int:
        pixels, grids = sample.get("pixel_values"), sample.get("image_grid_thw")
        if pixels is None and grids is None:
            return 0
        if not isinstance(grids, torch.Tensor) or grids.dim() != 2 or grids.shape[1] != 3:
            got = list(grids.shape) if isinstance(grids, torch.Tensor) else type(grids).__name__
            raise DataError(f"{where}: image_grid_thw is {got}; {self.name} takes one (t, h, w) row an image")
        patches = int(grids.prod(-1).sum())
        if not isinstance(pixels, torch.Tensor) or tuple(pixels.shape) != (patches, self.patch_dim):
            got = list(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
            raise DataError(
                f"{where}: pixel_values is {got}, its image_grid_thw {grids.tolist()} asks for "
                f"[{patches}, {self.patch_dim}] (one row of {self.patch_dim} values a patch)"
            )
        return patches // (self.merge * self.merge)

    def join_images(self, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
        having = [s for s in samples if self.vision_rows(s)]
        if not having:
            return {}
        return {
            "pixel_values": torch.cat([s["pixel_values"] for s in having]),
            "image_grid_thw": torch.cat([s["image_grid_thw"] for s in having]),
        }

    def step_images(self, joined: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The patch stream and its grids, and what Qwen's vision tower computes from the grids
        with ``tolist()`` and loops (positions, attention segments, window index, position-table
        resampling), computed here by the transformers functions it calls."""
        from transformers import vision_utils

        grids = joined["image_grid_thw"]
        out = {
            "pixel_values": joined["pixel_values"],
            "image_grid_thw": grids,
            "cu_seqlens": vision_utils.get_vision_cu_seqlens(grids),
            "vision_position_ids": vision_utils.get_vision_position_ids(grids, self.merge),
        }
        if self.window_size:
            out["window_index"], out["cu_window_seqlens"] = vision_utils.get_vision_window_index(
                grids, self.merge, self.window_size, self.patch
            )
        if self.position_grid:  # Qwen3-VL's own settings (Qwen3VLVisionModel.__init__)
            out["interp_indices"], out["interp_weights"] = (
                vision_utils.get_vision_interpolation_indices_and_weights(
                    grids,
                    self.position_grid,
                    mode="bilinear",
                    align_corners=True,
                    spatial_merge_size=self.merge,
                )
            )
        return out

    def positions(self, sample: Sample) -> torch.Tensor:
        ids = tokens_of(sample, "sample")
        grids = sample.get("image_grid_thw")
        rows = [] if grids is None else [tuple(int(v) for v in g) for g in grids.tolist()]
        return mrope_positions(ids == self.image_token_id, rows, self.merge)

    def synthesize(self, text_tokens: int, images: Sequence[tuple[int, int]], generator) -> dict:
        grids = [self.grid(h, w) for h, w in images]
        blocks = [
            torch.cat(
                [
                    torch.tensor([self.vision_start_id]),
                    torch.full((t * h * w // self.merge**2,), self.image_token_id),
                    torch.tensor([self.vision_end_id]),
                ]
            )
            for t, h, w in grids
        ]
        sample = _chat(blocks, text_tokens, self.image_token_id, generator)
        ids = sample["input_ids"]
        sample["mm_token_type_ids"] = (ids == self.image_token_id).long()
        if grids:
            patches = sum(t * h * w for t, h, w in grids)
            sample["pixel_values"] = torch.randn(patches, self.patch_dim, generator=generator)
            sample["image_grid_thw"] = torch.tensor(grids)
        return sample

    def sized(self, sizes) -> tuple[int, int]:
        """LLM tokens and patches of a sample of ``sizes`` (a :class:`~vlmcompile.data.manifest.ManifestSample`),
        as :meth:`synthesize` makes it, without making it."""
        patches = [t * h * w for t, h, w in (self.grid(*size) for size in sizes.images)]
        return sizes.text_tokens + sum(n // self.merge**2 + 2 for n in patches), sum(patches)


@dataclass(frozen=True, slots=True)
class AnyresFamily:
    """LLaVA-NeXT's "anyres" images: each image a base tile and a grid of crops (its count from
    the image size and the model's ``image_grid_pinpoints``), ``pixel_values`` of shape (images,
    crops, channels, side, side) with crops padded to the most of any image, and ``image_sizes``
    (height, width) per image. Its LLM tokens are the base tile's and the unpadded crop grid's
    with a newline embedding after each row: where each comes from is read off the model's own
    ``pack_image_features`` run on feature *indices* (:meth:`feature_index`)."""

    name: str
    image_token_id: int
    side: int
    channels: int
    tokens_per_crop: int
    """Features the vision tower gives a crop after the feature selection strategy."""
    strategy: str
    config: Any = field(compare=False, repr=False)
    """The model's config, which ``pack_image_features`` reads."""

    image_keys = ("pixel_values", "image_sizes")
    token_keys: tuple[str, ...] = ()

    def crops(self, height: int, width: int) -> int:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        return image_size_to_num_patches((height, width), self.config.image_grid_pinpoints, self.side)

    def feature_index(self, sizes: Sequence[tuple[int, int]], newline: int) -> torch.Tensor:
        """For images of ``sizes``, whose crops' features are rows ``0, 1, ...`` of a table in
        order, the table row of each of their image tokens (``newline`` for a newline)."""
        import types

        from transformers.models.llava_next.modeling_llava_next import LlavaNextModel

        owner = types.SimpleNamespace(config=self.config)
        out, first = [], 0
        for h, w in sizes:
            count = self.crops(h, w) * self.tokens_per_crop
            rows = torch.arange(first, first + count, dtype=torch.float64).view(-1, self.tokens_per_crop, 1)
            packed, _ = LlavaNextModel.pack_image_features(
                owner,
                [rows],
                torch.tensor([[h, w]]),
                self.strategy,
                torch.tensor([-1.0], dtype=torch.float64),
            )
            index = packed[0].view(-1).long()
            out.append(torch.where(index < 0, newline, index))
            first += count
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    def _sizes(self, sample: Sample) -> list[tuple[int, int]]:
        sizes = sample.get("image_sizes")
        return [] if sizes is None else [(int(h), int(w)) for h, w in sizes.tolist()]

    def images(self, sample: Sample) -> int | None:
        """Images of the sample: one size row each."""
        return len(self._sizes(sample))

    def vision_rows(self, sample: Sample) -> int:
        return sum(self.crops(h, w) for h, w in self._sizes(sample))

    def expected_image_tokens(self, sample: Sample, where: str) -> int:
        pixels, sizes = sample.get("pixel_values"), sample.get("image_sizes")
        if pixels is None and sizes is None:
            return 0
        if not isinstance(sizes, torch.Tensor) or sizes.dim() != 2 or sizes.shape[1] != 2:
            got = list(sizes.shape) if isinstance(sizes, torch.Tensor) else type(sizes).__name__
            raise DataError(
                f"{where}: image_sizes is {got}; {self.name} takes one (height, width) row an image"
            )
        crops = [self.crops(h, w) for h, w in self._sizes(sample)]
        tile = (self.channels, self.side, self.side)
        if (
            not isinstance(pixels, torch.Tensor)
            or pixels.dim() != 5
            or pixels.shape[0] != len(crops)
            or pixels.shape[1] < max(crops)
            or tuple(pixels.shape[2:]) != tile
        ):
            got = list(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
            raise DataError(
                f"{where}: pixel_values is {got}; its image_sizes ask for [{len(crops)}, >= {max(crops)}, "
                f"{', '.join(map(str, tile))}] (images, crops, channels, height, width)"
            )
        return int(self.feature_index(self._sizes(sample), -1).numel())

    def crop_rows(self, sample: Sample) -> torch.Tensor:
        """The sample's real crops, one row each (the padding crops dropped)."""
        pixels = sample["pixel_values"]
        return torch.cat([pixels[i, : self.crops(h, w)] for i, (h, w) in enumerate(self._sizes(sample))])

    def join_images(self, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
        having = [s for s in samples if self._sizes(s)]
        if not having:
            return {}
        most = max(s["pixel_values"].shape[1] for s in having)
        padded = [
            torch.nn.functional.pad(
                s["pixel_values"], (0, 0, 0, 0, 0, 0, 0, most - s["pixel_values"].shape[1])
            )
            for s in having
        ]
        return {
            "pixel_values": torch.cat(padded),
            "image_sizes": torch.cat([s["image_sizes"] for s in having]),
        }

    def step_images(self, joined: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A packed microbatch's images as its step takes them: the real crops, one row each,
        and the feature table row of each image token (the table is the crops' features, then
        the newline embedding)."""
        sizes = self._sizes(joined)
        rows = self.crop_rows(joined)
        return {
            "pixel_values": rows,
            "image_token_index": self.feature_index(sizes, newline=rows.shape[0] * self.tokens_per_crop),
        }

    positions = staticmethod(sequential_positions)

    def synthesize(self, text_tokens: int, images: Sequence[tuple[int, int]], generator) -> dict:
        blocks = [
            torch.full((int(self.feature_index([size], -1).numel()),), self.image_token_id) for size in images
        ]
        sample = _chat(blocks, text_tokens, self.image_token_id, generator)
        if images:
            crops = [self.crops(h, w) for h, w in images]
            pixels = torch.zeros(len(images), max(crops), self.channels, self.side, self.side)
            for i, n in enumerate(crops):
                pixels[i, :n] = torch.randn(n, self.channels, self.side, self.side, generator=generator)
            sample["pixel_values"] = pixels
            sample["image_sizes"] = torch.tensor(list(images))
        return sample


@dataclass(frozen=True, slots=True)
class SplitTileFamily:
    """Idefics3 and SmolVLM: an image split into tiles of ``side`` pixels (and a global view of
    the whole when it takes more than one), ``pixel_values`` of shape (1, tiles, channels, side,
    side) a sample (a batch pads with all-zero tiles, which the model drops), ``tokens_per_tile``
    image tokens a tile after the connector's pixel shuffle."""

    name: str
    image_token_id: int
    side: int
    channels: int
    tokens_per_tile: int
    max_split: int = 4
    """Tiles a side at most (the processor's longest edge over the tile side: 1456 / 364)."""

    image_keys = ("pixel_values", "pixel_attention_mask")
    token_keys: tuple[str, ...] = ()

    def tiles(self, height: int, width: int) -> int:
        """Tiles of an image of ``height`` x ``width`` pixels: its longest edge brought to at most
        ``max_split`` tiles, each side cut into whole tiles, a global view when more than one
        (our statement of the processor's splitting, for synthetic sizes; the model takes any)."""
        scale = min(1.0, self.max_split * self.side / max(height, width))
        rows = max(1, math.ceil(height * scale / self.side))
        columns = max(1, math.ceil(width * scale / self.side))
        return rows * columns + (1 if rows * columns > 1 else 0)

    def images(self, sample: Sample) -> int | None:
        """None: the tiles of a sample do not say which image they belong to."""
        return None

    def images_of(self, sizes) -> int | None:
        """:meth:`images` of a sample of ``sizes``: None likewise."""
        return None

    def vision_rows(self, sample: Sample) -> int:
        pixels = sample.get("pixel_values")
        return 0 if pixels is None else int(pixels.shape[1])

    def expected_image_tokens(self, sample: Sample, where: str) -> int:
        pixels = sample.get("pixel_values")
        if pixels is None:
            return 0
        tile = (self.channels, self.side, self.side)
        if (
            not isinstance(pixels, torch.Tensor)
            or pixels.dim() != 5
            or pixels.shape[0] != 1
            or tuple(pixels.shape[2:]) != tile
        ):
            got = list(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
            raise DataError(
                f"{where}: pixel_values is {got}; {self.name} takes one example's tiles as (1, tiles, "
                f"{', '.join(map(str, tile))})"
            )
        return int(pixels.shape[1]) * self.tokens_per_tile

    def join_images(self, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
        having = [s for s in samples if self.vision_rows(s)]
        if not having:
            return {}
        most = max(self.vision_rows(s) for s in having)
        pad = [(0, 0, 0, 0, 0, 0, 0, most - self.vision_rows(s)) for s in having]
        return {
            "pixel_values": torch.cat(
                [torch.nn.functional.pad(s["pixel_values"], p) for s, p in zip(having, pad)]
            )
        }

    def step_images(self, joined: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The real tiles of a packed microbatch, one row each (the all-zero padding dropped)."""
        pixels = joined["pixel_values"].flatten(0, 1)
        real = pixels.flatten(1).ne(0).any(1)
        return {"pixel_values": pixels[real]}

    positions = staticmethod(sequential_positions)

    def synthesize(self, text_tokens: int, images: Sequence[tuple[int, int]], generator) -> dict:
        tiles = [self.tiles(h, w) for h, w in images]
        blocks = [torch.full((n * self.tokens_per_tile,), self.image_token_id) for n in tiles]
        sample = _chat(blocks, text_tokens, self.image_token_id, generator)
        if tiles:
            sample["pixel_values"] = torch.randn(
                1, sum(tiles), self.channels, self.side, self.side, generator=generator
            )
        return sample

    sized = sized_in_tiles


Family = TileFamily | PatchStreamFamily | AnyresFamily | SplitTileFamily


def mrope_positions(
    image_token: torch.Tensor, grids: Sequence[tuple[int, int, int]], merge: int
) -> torch.Tensor:
    """Qwen2-VL's 3-D rotary positions (temporal, height, width) of one sample, shape (3, length):
    a text token advances all three by one; an image's tokens take ``start + (t, h, w)`` over its
    merged grid, and the text after it starts at ``start + max(h, w) / merge`` (transformers'
    ``Qwen2VLModel.get_rope_index`` for images, restated so the data path needs no model)."""
    length = image_token.numel()
    out = torch.empty(3, length, dtype=torch.long)
    kinds = image_token.tolist()
    position, i, image = 0, 0, 0
    while i < length:
        j = i
        while j < length and kinds[j] == kinds[i]:
            j += 1
        if not kinds[i]:
            out[:, i:j] = torch.arange(position, position + j - i)
            position += j - i
        else:
            if image >= len(grids):
                raise DataError(f"a sample has more image-token runs than its {len(grids)} image grids")
            t, h, w = grids[image]
            h, w = h // merge, w // merge
            if t * h * w != j - i:
                raise DataError(
                    f"image {image} of a sample has {j - i} image tokens where its grid {grids[image]} makes {t * h * w}"
                )
            out[0, i:j] = position + torch.arange(t).repeat_interleave(h * w)
            out[1, i:j] = position + torch.arange(h).repeat_interleave(w).repeat(t)
            out[2, i:j] = position + torch.arange(w).repeat(t * h)
            position += max(h, w)
            image += 1
        i = j
    return out


def _chat(blocks: list[torch.Tensor], text_tokens: int, image_token_id: int, generator) -> dict:
    """A sample of ``text_tokens`` random text tokens with the image ``blocks`` spread among
    them (after a first text token); the labels are its text tokens, nothing else."""
    text = torch.randint(3, max(4, image_token_id - 4), (text_tokens,), generator=generator)
    cuts = [1 + k * (text_tokens - 1) // max(1, len(blocks)) for k in range(len(blocks))] + [text_tokens]
    pieces = [(text[: cuts[0]], True)]
    for k, block in enumerate(blocks):
        pieces += [(block, False), (text[cuts[k] : cuts[k + 1]], True)]
    ids = torch.cat([p for p, _ in pieces])
    labels = torch.cat([p if is_text else torch.full_like(p, IGNORE_INDEX) for p, is_text in pieces])
    return {"input_ids": ids[None], "labels": labels[None]}


def tile_and_patch(vision: Any) -> tuple[int, int]:
    """A vision config's image side and patch side in pixels (transformers gives some sizes as a
    pair: ``[28, 28]``)."""
    whole = lambda value: int(value[0] if isinstance(value, (list, tuple)) else value)  # noqa: E731
    return whole(vision.image_size), whole(vision.patch_size)
