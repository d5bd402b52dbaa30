"""Seeded synthetic datasets whose sample sizes follow stated distributions.

A distribution draws a sample's *sizes* at real scale (text tokens, each image's height and
width in pixels: a :class:`~vlmcompile.data.manifest.ManifestSample`); a model family turns them
into tensors at its model's own resolution (:mod:`vlmcompile.data.families`). The figures and
where they come from:

* ``llava-chat`` - LLaVA-1.5's instruction mix (Liu et al. 2023, "Improved Baselines with Visual
  Instruction Tuning", the 665K mixture): one image a sample; 40K of the 665K samples are
  ShareGPT text-only conversations, so a 6 % text-only share. Images are COCO-like photographs
  (COCO's are at most 640 px on the long side, mostly 4:3). The text length is *not* published
  per sample: a log-normal with median 180 tokens and sigma 0.8, cut at 2048, is our assumption.
* ``internvl-tiles`` - InternVL-Chat-1.2's 1.2M samples as OmniBal measured them (OmniBal
  section 5.1 and Table 1; ``tests/reference/paper_setups.json``): LLM input tokens mean 1400,
  std 900, up to 4 tiles of 448 px and a thumbnail an image (max_patch_num 4), at most 4096
  text tokens (its Q_t). The LLM tokens are drawn as a gamma with that mean and std; the image
  aspect ratio (log-uniform in 1:3..3:1) and the 6 % text-only share are our assumptions.
* ``qwen-native`` - native-resolution images for Qwen2-VL: one image a sample (two in 10 %),
  each side log-uniform in 224..1792 px, text as ``llava-chat``. No source publishes the image
  size distribution of Qwen2-VL's data: the range is chosen to cross the resize bounds (56^2 to
  1280 x 28^2 pixels) from both sides, not measured.
* ``interleaved`` - OBELICS-like web documents (Laurencon et al. 2023: 141M documents, 353M
  images, 115B text tokens, so 2.5 images and 816 text tokens a document on average): a
  Poisson number of images with mean 2.5 (0 included: text-only documents), text log-normal
  with mean 816 tokens and sigma 0.9, cut at 4096; images COCO-like.

Every dataset mixes text-only samples in; ``text_only`` sets their share.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlmcompile.data.families import Family
from vlmcompile.data.images import internvl
from vlmcompile.data.manifest import ManifestSample
from vlmcompile.ir.errors import DataError, positive_int


def _lognormal_text(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(median * math.exp(rng.gauss(0, sigma)))))


def _photo(rng: random.Random) -> tuple[int, int]:
    """A COCO-like photograph: 640 px on the long side, 4:3 or 3:4 mostly."""
    long_side, ratio = 640, rng.choice([4 / 3, 4 / 3, 4 / 3, 1.0, 16 / 9])
    short = round(long_side / ratio)
    return (short, long_side) if rng.random() < 0.7 else (long_side, short)


def _llava_chat(rng: random.Random) -> ManifestSample:
    return ManifestSample(_lognormal_text(rng, 180, 0.8, 2048), (_photo(rng),))


def _internvl_tiles(rng: random.Random) -> ManifestSample:
    mean, std = 1400.0, 900.0
    shape = (mean / std) ** 2
    llm_tokens = rng.gammavariate(shape, mean / shape)
    aspect = math.exp(rng.uniform(math.log(1 / 3), math.log(3)))
    side = 448 * math.sqrt(rng.uniform(1, 4))  # up to a 2 x 2 tile grid's area
    image = (max(1, round(side / math.sqrt(aspect))), max(1, round(side * math.sqrt(aspect))))
    text = round(llm_tokens) - internvl(*image, max_tiles=4).llm_tokens
    return ManifestSample(max(1, min(4096, text)), (image,))


def _qwen_native(rng: random.Random) -> ManifestSample:
    def side() -> int:
        return round(math.exp(rng.uniform(math.log(224), math.log(1792))))

    images = tuple((side(), side()) for _ in range(2 if rng.random() < 0.1 else 1))
    return ManifestSample(_lognormal_text(rng, 180, 0.8, 2048), images)


def _poisson(rng: random.Random, mean: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-mean)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _interleaved(rng: random.Random) -> ManifestSample:
    sigma = 0.9
    median = 816 / math.exp(sigma**2 / 2)  # a log-normal of mean 816
    images = tuple(_photo(rng) for _ in range(_poisson(rng, 2.5)))
    return ManifestSample(_lognormal_text(rng, median, sigma, 4096), images)


DISTRIBUTIONS: dict[str, Callable[[random.Random], ManifestSample]] = {
    "llava-chat": _llava_chat,
    "internvl-tiles": _internvl_tiles,
    "qwen-native": _qwen_native,
    "interleaved": _interleaved,
}
"""Name -> a draw of one sample's sizes (see the module docstring for each one's sources)."""


def draw_sizes(name: str, index: int, *, seed: int = 0, text_only: float = 0.06) -> ManifestSample:
    """Sample ``index``'s sizes in dataset ``name``: a function of (seed, index) alone, so any
    sample can be drawn without the ones before it."""
    if name not in DISTRIBUTIONS:
        raise DataError(f"unknown synthetic dataset {name!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    if not 0 <= text_only <= 1:
        raise DataError(f"text_only={text_only}; give the share of text-only samples in [0, 1]")
    rng = random.Random(seed * 1_000_003 + index)
    sizes = DISTRIBUTIONS[name](rng)
    return ManifestSample(sizes.text_tokens) if rng.random() < text_only else sizes


def _scaled(sizes: ManifestSample, text_scale: float, pixel_scale: float) -> ManifestSample:
    px = [(max(1, round(h * pixel_scale)), max(1, round(w * pixel_scale))) for h, w in sizes.images]
    return ManifestSample(max(1, round(sizes.text_tokens * text_scale)), tuple(px))


def _check_scales(text_scale: float, pixel_scale: float) -> None:
    for name, value in (("text_scale", text_scale), ("pixel_scale", pixel_scale)):
        if not value > 0:
            raise DataError(f"{name}={value}; give a positive factor")


@dataclass(frozen=True)
class SyntheticDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of distribution ``name`` for ``family``'s model. ``text_scale`` and
    ``pixel_scale`` shrink every size (a tiny test model at 28 px tiles takes ``pixel_scale =
    28 / 448`` to keep InternVL's tile grids); sample ``i`` is the same on every call and rank."""

    name: str
    family: Family
    num_samples: int
    seed: int = 0
    text_only: float = 0.06
    text_scale: float = 1.0
    pixel_scale: float = 1.0

    def __post_init__(self):
        positive_int("num_samples", self.num_samples, "the samples of the dataset")
        draw_sizes(self.name, 0, seed=self.seed, text_only=self.text_only)  # checks name and share
        _check_scales(self.text_scale, self.pixel_scale)

    def __len__(self) -> int:
        return self.num_samples

    def sizes(self, index: int) -> ManifestSample:
        """Sample ``index``'s sizes after scaling."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of a dataset of {self.num_samples}")
        real = draw_sizes(self.name, index, seed=self.seed, text_only=self.text_only)
        return _scaled(real, self.text_scale, self.pixel_scale)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return synthesized(self.family, self.sizes(index), self.seed, index)


@dataclass(frozen=True)
class ManifestDataset(torch.utils.data.Dataset):
    """A manifest's samples (:func:`~vlmcompile.data.manifest.read_manifest`) as ``family``'s
    samples of those sizes with random content: a dataset to plan and rehearse on before the
    data is at hand. ``text_scale`` and ``pixel_scale`` as in :class:`SyntheticDataset`."""

    samples: tuple[ManifestSample, ...]
    family: Family
    seed: int = 0
    text_scale: float = 1.0
    pixel_scale: float = 1.0

    def __post_init__(self):
        if not self.samples:
            raise DataError("the manifest holds no samples; give one JSON object a line")
        _check_scales(self.text_scale, self.pixel_scale)

    def __len__(self) -> int:
        return len(self.samples)

    def sizes(self, index: int) -> ManifestSample:
        return _scaled(self.samples[index], self.text_scale, self.pixel_scale)

    def where(self, index: int) -> str:
        """The manifest line sample ``index`` comes from."""
        return self.samples[index].where

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return synthesized(self.family, self.sizes(index), self.seed, index)


def synthesized(family: Family, sizes: ManifestSample, seed: int, index: int) -> dict[str, torch.Tensor]:
    """Sample ``index`` of a dataset seeded ``seed``, of ``sizes``, with random content."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return family.synthesize(sizes.text_tokens, sizes.images, generator)


def dataset_from_spec(
    spec: str,
    family: Family,
    *,
    num_samples: int,
    seed: int = 0,
    text_scale: float = 1.0,
    pixel_scale: float = 1.0,
) -> SyntheticDataset | ManifestDataset:
    """``synthetic:<name>`` (one of :data:`DISTRIBUTIONS`, ``num_samples`` of them) or the path of
    a JSONL manifest, as ``family``'s samples (the CLI's ``--data``)."""
    from vlmcompile.data.manifest import read_manifest

    if spec.startswith("synthetic:"):
        name = spec.removeprefix("synthetic:")
        return SyntheticDataset(
            name, family, num_samples, seed=seed, text_scale=text_scale, pixel_scale=pixel_scale
        )
    if ":" in spec.split("/")[0] and not spec.endswith(".jsonl"):
        raise DataError(
            f"--data {spec!r}; give synthetic:<name> ({', '.join(DISTRIBUTIONS)}) or a manifest.jsonl"
        )
    return ManifestDataset(
        tuple(read_manifest(spec)), family, seed=seed, text_scale=text_scale, pixel_scale=pixel_scale
    )
