"""Regions of a VLM and how a module path is assigned to one.

A region is the part of the model a layer belongs to: a vision encoder, the projector that
maps image features into the LLM's width, the LLM, its head (output projection and loss),
a text encoder (the text tower of a contrastive pair), or ``other``.

Assignment order, first match wins:

1. a user override: module-path prefix -> region (longest prefix wins);
2. a ``vlmcompile_region`` attribute on a module's class (the reference zoo sets it);
3. a keyword in the module path, innermost component first: the words of the model's family
   (``vlmcompile.families``: ``visual.merger`` is Qwen2-VL's projector inside its vision tower),
   then the common ones below;
4. the data flow (:func:`vlmcompile.graph.layering.regions_by_flow`): a layer still unplaced that
   reads from an encoder tower and from nothing of the LLM is a projector, whatever its name.
"""

from __future__ import annotations

import difflib
import enum
import re
from collections.abc import Mapping, Sequence

from vlmcompile.ir.errors import RegionError


class Region(str, enum.Enum):
    VISION = "vision"
    PROJECTOR = "projector"
    LLM = "llm"
    TEXT = "text"
    HEAD = "head"
    OTHER = "other"

    def __str__(self) -> str:
        return self.value


ENCODER_REGIONS = frozenset({Region.VISION})
ENCODER_SIDE = frozenset({Region.VISION, Region.PROJECTOR})
"""The encoders and what projects their output: the work that may get a plan of its own."""
LANGUAGE_REGIONS = frozenset({Region.LLM, Region.TEXT})

REGION_ATTR = "vlmcompile_region"
"""Class attribute a plain-PyTorch module sets to declare its region."""

# Path components most VLMs name their parts with, mapped to regions (``mlp1``: InternVL's
# projector in its own code, a model of no family here). Matched against whole
# components, innermost first. A family's own words (Qwen-VL's ``merger``, Idefics3's
# ``connector``, CLIP's ``visual_projection``) live in its spec (``vlmcompile.families``) and are
# matched first.
_KEYWORD_REGIONS: tuple[tuple[re.Pattern[str], Region], ...] = tuple(
    (re.compile(pattern), region)
    for pattern, region in (
        (r"^(multi_modal_projector|mm_projector|projector|mlp1)$", Region.PROJECTOR),
        (r"^(vision_tower|vision_model|vision_encoder|image_encoder|vision)$", Region.VISION),
        (r"^(lm_head|head)$", Region.HEAD),
        (r"^(text_model|text_encoder)$", Region.TEXT),
        (r"^(language_model|llm|decoder)$", Region.LLM),
    )
)


def region_from_keywords(
    path: str, *, generative: bool = False, family: Mapping[str, Region] | None = None
) -> Region | None:
    """The region a module path names by keyword, innermost component first, or None.
    ``family`` maps the components the model's family names its parts with to their regions,
    matched before the common words.

    In a generative model (one with an ``lm_head``) a ``text_model`` is the LLM (Idefics3);
    otherwise it is the text tower of a contrastive pair (CLIP). A ``head`` inside an encoder
    tower is the tower's (SigLIP's pooling head in PaliGemma's ``vision_tower``), not the model's
    output head.
    """
    family = family or {}
    found = [family[c] if c in family else _keyword_region(c, generative) for c in reversed(path.split("."))]
    named = [region for region in found if region is not None]
    if not named:
        return None
    if (
        named[0] is Region.HEAD
        and len(named) > 1
        and (named[1] in ENCODER_REGIONS or named[1] is Region.TEXT)
    ):
        return named[1]  # the nearest enclosing part only: an LLM inside a tower keeps its head
    return named[0]


def _keyword_region(component: str, generative: bool) -> Region | None:
    for pattern, region in _KEYWORD_REGIONS:
        if pattern.match(component):
            return Region.LLM if generative and region is Region.TEXT else region
    return None


def parse_overrides(overrides: Mapping[str, str | Region] | None) -> dict[str, Region]:
    """Validate a user's ``{module-path prefix: region}`` mapping."""
    parsed: dict[str, Region] = {}
    for prefix, region in (overrides or {}).items():
        try:
            parsed[prefix] = Region(region)
        except ValueError:
            choices = ", ".join(r.value for r in Region)
            raise RegionError(
                f"region override {prefix!r} -> {region!r}: unknown region; use one of {choices}"
            ) from None
    return parsed


def check_override_paths(overrides: Mapping[str, Region], module_paths: Sequence[str]) -> None:
    """Every override prefix must name a module of the model (or the start of one's path)."""
    known = set(module_paths)
    for prefix in overrides:
        if prefix not in known:
            close = difflib.get_close_matches(prefix, sorted(p for p in known if p), n=5)
            top = sorted({p.split(".")[0] for p in known if p})
            hint = f"close matches: {close}" if close else f"top-level modules: {top}"
            raise RegionError(
                f"region override names module {prefix!r}, which the model does not have; "
                f"give a module path as in model.named_modules() ({hint})"
            )


def override_region(path: str, overrides: Mapping[str, Region]) -> Region | None:
    """The region of the longest override prefix that covers ``path``, or None."""
    best: tuple[int, Region] | None = None
    for prefix, region in overrides.items():
        if path == prefix or path.startswith(prefix + ".") or prefix == "":
            if best is None or len(prefix) > best[0]:
                best = (len(prefix), region)
    return best[1] if best else None
