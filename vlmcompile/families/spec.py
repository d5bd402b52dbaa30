"""What one VLM family is, in one object: :class:`FamilySpec`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from vlmcompile.data.families import Family
from vlmcompile.data.images import ImageTokens
from vlmcompile.ir.errors import ModelError
from vlmcompile.ir.regions import Region

TinyBuilder = Callable[..., tuple[nn.Module, dict[str, Any]]]
"""``builder(batch=2, *, attn_implementation="sdpa", device="cpu") -> (model, sample_batch)``."""


@dataclass(frozen=True)
class FamilySpec:
    """A model family (the zoo's VLMs, or one transformers architecture) with everything
    vlmcompile knows of it. ``key`` is its one spelling: the registry's key, its sample layout's
    ``name``, and (after ``hf-``) its tiny model's name on the command line.

    Only ``key``, ``title`` and ``tiny`` are required. A family with a ``layout`` packs samples
    of any shape (and must then say how its images become features, ``image_features``); one
    without takes a sample batch whose samples share one shape."""

    key: str
    title: str
    """How people write its name (``Qwen2-VL``): in messages and docs."""
    tiny: TinyBuilder
    """Builds the tiny model the tests and ``--model hf-<key>`` train: random seeded weights,
    2 layers a tower, width 32, 28 px images (see :mod:`vlmcompile.families.tiny`)."""
    model_types: tuple[str, ...] = ()
    """transformers' ``config.model_type`` values of the family (none for the zoo)."""
    regions: Mapping[str, Region] = field(default_factory=dict)
    """Module-path components the family names its parts with, beyond the common ones
    :mod:`vlmcompile.ir.regions` knows (``merger`` is Qwen-VL's projector)."""
    layout: Callable[[nn.Module], Family] | None = None
    """The family's sample layout, read off a model's config: how a sample's images are laid
    out and how many LLM tokens each becomes (:mod:`vlmcompile.data.families`)."""
    image_features: Callable[[nn.Module, Mapping[str, Any]], Any] | None = None
    """``(model, packed inputs) -> features``: the model's image features for a packed step, one
    row an image token (:class:`~vlmcompile.data.packed_step.PackedStep`)."""
    released: Family | None = None
    """The layout of its released models (token ids are placeholders): sizes for data without a
    model at hand (``benchmarks/data_balance.py --family``)."""
    image_tokens: Callable[[int, int], ImageTokens] | None = None
    """What one image of (height, width) pixels becomes in its released models: for a dataset
    described by a manifest (:func:`vlmcompile.data.manifest.sample_size`)."""

    def __post_init__(self) -> None:
        where = f"FamilySpec {self.key!r}"
        if self.model_types and (self.layout is None) != (self.image_features is None):
            have, lack = ("layout", "image_features") if self.layout else ("image_features", "layout")
            raise ModelError(
                f"{where} has a {have} but no {lack}: a transformers family packs samples of any shape with "
                "both (its layout says where the image tokens go, its image_features what fills them), or neither"
            )
        if self.released is not None and self.released.name != self.key:
            raise ModelError(
                f"{where}: its released layout is named {self.released.name!r}; name it {self.key!r}"
            )
        if self.image_tokens is not None and self.released is None:
            raise ModelError(f"{where} sizes a released model's images but gives no released layout")
        bad = {k: v for k, v in self.regions.items() if not isinstance(v, Region) or "." in k}
        if bad:
            raise ModelError(f"{where}: regions {bad}; map one path component (no dots) to a Region")

    @property
    def tiny_name(self) -> str:
        """Its tiny model's name on the command line (``hf-<key>``; the zoo's models go by their own
        names there, ``tiny`` and the rest)."""
        return f"hf-{self.key}" if self.model_types else self.key
