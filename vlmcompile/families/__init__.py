"""The model families vlmcompile knows, one file each, every fact of a family in its
:class:`~vlmcompile.families.spec.FamilySpec` (its key, regions, sample layout, image features,
tiny model, released layout). Reads the IR, the data layer and the zoo.

* ``spec`` - :class:`FamilySpec`, what one family is.
* ``tiny`` - what every tiny transformers model shares: sizes, token ids, seeding.
* ``zoo`` - the zoo's VLMs.
* ``llava``, ``llava_next``, ``llava_onevision``, ``internvl``, ``idefics3``, ``smolvlm``,
  ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``, ``paligemma``, ``gemma3``, ``aya_vision``,
  ``mistral3``, ``llama4``, ``mllama``, ``blip2``, ``clip``, ``siglip`` - the transformers
  families, a module each, named after its key.

A family is registered by its module alone: every module here other than ``spec`` and ``tiny``
holds one ``FAMILY``, found when this package is imported. docs/models.md says how to add one.

>>> from vlmcompile import families
>>> model, batch = families.build_tiny("qwen2-vl")
>>> families.layout_of(model).name
'qwen2-vl'
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from torch import nn

from vlmcompile.data.families import Family, PatchStreamFamily
from vlmcompile.families.spec import FamilySpec
from vlmcompile.families.zoo import is_zoo
from vlmcompile.ir.errors import DataError, ModelError

_NOT_FAMILIES = {"spec", "tiny"}

ATTENTION = ("eager", "sdpa")
"""The attention implementations every tiny builder takes (and the tests run)."""


def module_name(key: str) -> str:
    """The module of the family ``key`` (``qwen2.5-vl`` lives in ``qwen2_5_vl``)."""
    return key.replace("-", "_").replace(".", "_")


def discover(path: list[str], package: str) -> dict[str, FamilySpec]:
    """The families of the modules in ``path`` (the package ``package``), by key; a module
    holding no ``FAMILY``, or one under another module's name, is refused."""
    found: dict[str, FamilySpec] = {}
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if info.name in _NOT_FAMILIES:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        spec = getattr(module, "FAMILY", None)
        if not isinstance(spec, FamilySpec):
            raise ModelError(
                f"vlmcompile/families/{info.name}.py holds no FAMILY = FamilySpec(...); every module there "
                "but spec and tiny is a family (docs/models.md, 'Adding a family')"
            )
        if module_name(spec.key) != info.name or spec.key in found:
            raise ModelError(
                f"vlmcompile/families/{info.name}.py registers the family {spec.key!r}: a family lives in the "
                f"module named after its key ({module_name(spec.key)}.py), one family a key"
            )
        found[spec.key] = spec
    return found


SPECS: dict[str, FamilySpec] = discover(__path__, __name__)
"""Every family, by key."""

_BY_MODEL_TYPE = {kind: spec for spec in SPECS.values() for kind in spec.model_types}


def get(key: str) -> FamilySpec:
    """The family ``key``, or a :class:`ModelError` naming the keys there are."""
    if key not in SPECS:
        raise ModelError(f"unknown model family {key!r}; choose one of {', '.join(sorted(SPECS))}")
    return SPECS[key]


def spec_of(model: Any) -> FamilySpec | None:
    """The family of ``model`` (a zoo VLM, or a transformers model by its config's
    ``model_type``), or None for a model of no family vlmcompile knows."""
    if is_zoo(model):
        return SPECS["zoo"]
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return _BY_MODEL_TYPE.get(kind)


def packing_families() -> list[FamilySpec]:
    """The families whose samples of any shape are packed (they have a sample layout)."""
    return [spec for spec in SPECS.values() if spec.layout is not None]


def layout_of(model: nn.Module) -> Family:
    """The sample layout of ``model``'s family, read off its config, or a :class:`DataError`
    saying which families pack samples and what to give instead."""
    spec = spec_of(model)
    has_vision = is_zoo(model) or getattr(getattr(model, "config", None), "vision_config", None) is not None
    if spec is None or spec.layout is None or not has_vision:
        kind = getattr(getattr(model, "config", None), "model_type", None)
        titles = ", ".join(s.title for s in packing_families())
        raise DataError(
            f"vlmcompile has no sample layout for {type(model).__name__} (model_type {kind!r}); the families it "
            f"packs are {titles}. For another model, give one batch dict whose samples share one shape (pad or "
            "crop them) as the sample batch"
        )
    return spec.layout(model)


def packs_dict_batches(model: Any) -> bool:
    """Whether a dict batch of ``model`` is captured as its samples, packed: a Qwen-VL model's
    forward reads its images' grids and token types as values (window index, 3-D positions), so
    a graph of one batch would be specialised on that batch's images and train no other."""
    try:
        family = layout_of(model)
    except DataError:
        return False
    # With eager attention transformers' Qwen decoder does not keep packed samples apart (their
    # losses differ, which capture's check refuses for a list of samples too): a dict batch of
    # such a model stays whole, the one-shape capture it had before.
    if not isinstance(family, PatchStreamFamily):
        return False
    text = getattr(model.config, "text_config", model.config)
    return getattr(text, "_attn_implementation", None) != "eager"


def region_keywords(model: nn.Module) -> dict:
    """The module-path components ``model``'s family names its parts with (none for a model of
    no family)."""
    spec = spec_of(model)
    return dict(spec.regions) if spec else {}


def build_tiny(
    key: str, *, batch: int = 2, attn_implementation: str = "sdpa", device: str = "cpu"
) -> tuple[nn.Module, dict[str, Any]]:
    """The family's tiny model and a sample batch of ``batch`` samples (see :mod:`.tiny`)."""
    spec = get(key)
    if attn_implementation not in ATTENTION:
        raise ModelError(f"attn_implementation={attn_implementation!r}; choose one of {ATTENTION}")
    if spec.model_types:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ModelError(f"{spec.tiny_name} needs transformers: pip install 'vlmcompile[test]'") from None
    return spec.tiny(batch, attn_implementation=attn_implementation, device=device)


def tiny_names() -> list[str]:
    """The tiny transformers models' names on the command line (``hf-llava``, ...)."""
    return [spec.tiny_name for spec in SPECS.values() if spec.model_types]


def build_tiny_by_name(name: str, **kwargs) -> tuple[nn.Module, dict[str, Any]]:
    """:func:`build_tiny` of a command-line name (``hf-qwen2-vl``)."""
    if not name.startswith("hf-") or name.removeprefix("hf-") not in SPECS:
        raise ModelError(f"unknown transformers model {name!r}; choose one of {', '.join(tiny_names())}")
    return build_tiny(name.removeprefix("hf-"), **kwargs)


def released_layouts() -> dict[str, Family]:
    """The sample layouts of released models, by family key (token ids are placeholders)."""
    return {key: spec.released for key, spec in SPECS.items() if spec.released is not None}
