"""A user's dataset described without the data: a JSONL manifest, one sample a line,

    {"text_tokens": 412, "images": [[768, 1024], [448, 448]]}

(text tokens of the sample, each image's height and width in pixels; ``images`` may be empty
or left out for a text-only sample). A model family (:mod:`vlmcompile.data.images`) turns the
images into tiles, patches and LLM tokens, so a plan can be made for the dataset before it is
downloaded. Every fault is refused naming the line and the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vlmcompile.data.images import ImageTokens
from vlmcompile.ir.errors import DataError


@dataclass(frozen=True, slots=True)
class ManifestSample:
    text_tokens: int
    images: tuple[tuple[int, int], ...] = ()
    """(height, width) in pixels per image."""
    where: str = field(default="", compare=False)
    """The manifest line it was read from (``data.jsonl:2091``; empty for a drawn sample)."""


@dataclass(frozen=True, slots=True)
class SampleSize:
    """One sample as a model family sees it."""

    text_tokens: int
    images: tuple[ImageTokens, ...]

    @property
    def llm_tokens(self) -> int:
        """Its length in the LLM's sequence: the text and every image's tokens."""
        return self.text_tokens + sum(i.llm_tokens for i in self.images)

    @property
    def patches(self) -> int:
        return sum(i.patches for i in self.images)


def read_manifest(path: str | Path) -> list[ManifestSample]:
    """The samples of a JSONL manifest (blank lines skipped); a :class:`DataError` names the line
    and the field of the first fault, and an empty manifest is refused."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise DataError(f"cannot read manifest {str(path)!r}: {err.strerror or err}") from None
    samples = [_sample(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not samples:
        raise DataError(f"manifest {str(path)!r} holds no samples; give one JSON object a line")
    return samples


def _sample(line: str, where: str) -> ManifestSample:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not JSON ({err.msg}); give one object a line") from None
    if not isinstance(row, dict):
        raise DataError(
            f'{where}: a {type(row).__name__}; give an object like {{"text_tokens": 412, "images": [[768, 1024]]}}'
        )
    text = row.get("text_tokens")
    if isinstance(text, bool) or not isinstance(text, int) or text < 1:
        raise DataError(f"{where}: text_tokens={text!r}; give the sample's text tokens as a positive integer")
    images = row.get("images", [])
    if not isinstance(images, list):
        raise DataError(f"{where}: images={images!r}; give a list of [height, width] pairs in pixels")
    for i, image in enumerate(images):
        if (
            not isinstance(image, list)
            or len(image) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in image)
        ):
            raise DataError(
                f"{where}: images[{i}]={image!r}; give [height, width] in pixels, positive integers"
            )
    unknown = sorted(set(row) - {"text_tokens", "images"})
    if unknown:
        raise DataError(f"{where}: unknown fields {unknown}; a sample has text_tokens and images")
    return ManifestSample(text, tuple((h, w) for h, w in images), where)


def sample_size(sample: ManifestSample, image_tokens: Callable[[int, int], ImageTokens]) -> SampleSize:
    """The sample in a family's tokens and patches, given what one image of (height, width)
    pixels becomes in it (a family's ``image_tokens``, :mod:`vlmcompile.families`)."""
    return SampleSize(sample.text_tokens, tuple(image_tokens(h, w) for h, w in sample.images))
