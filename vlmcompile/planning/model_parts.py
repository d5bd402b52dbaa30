"""A LayerGraph read the way the baselines build a VLM: the layers before the first LLM decoder
layer (encoders, projectors, the embedding), the decoder layers, and the layers after them
(final norm, output layer, loss); one global recompute setting as flags per layer; and chunks
of decoder layers with the rest attached to the first and last stage; and the one ladder of
recompute settings policies climb until a plan fits (:data:`RECOMPUTE_LADDER`). Every policy
that splits decoder layers reads the model through this module (Megatron-LM's, torchtitan's,
MIMO's, the encoder-in-bubbles pass's LLM), so none of them imports another's file."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Parallel, Reason, Recompute
from vlmcompile.ir.regions import Region
from vlmcompile.planning import encoder_plans as ep
from vlmcompile.planning.chunks import chunks_of
from vlmcompile.planning.request import GlobalRecompute, NotApplicable


@dataclass(frozen=True, slots=True)
class ModelParts:
    """A LayerGraph read the way Megatron's LLaVA model is built."""

    pre: tuple[str, ...]
    """Encoders, projectors and the LLM embedding: all before the first decoder layer."""
    decoder: tuple[str, ...]
    post: tuple[str, ...]
    """Final norm, output layer and loss."""


def model_parts(layer_graph: LayerGraph) -> ModelParts:
    # A decoder layer is an LLM block by structure, not by its attention kernel: eager
    # attention (matmul + softmax) counts no attention FLOPs.
    decoder_idx = [
        layer.index
        for layer in layer_graph.layers
        if layer.region in (Region.LLM, Region.TEXT) and layer.block
    ]
    if not decoder_idx:
        raise NotApplicable(
            "the model has no LLM decoder layers (transformer blocks in the llm or text region); Megatron's "
            "pipeline splits decoder layers, so plan it with pp=1 or another policy"
        )
    first, last = decoder_idx[0], decoder_idx[-1]
    names = [layer.name for layer in layer_graph.layers]
    between = [n for i, n in enumerate(names[first : last + 1], first) if i not in set(decoder_idx)]
    if between:
        raise NotApplicable(
            f"layers {between[:3]} sit between LLM decoder layers; Megatron's split cannot place them"
        )
    return ModelParts(tuple(names[:first]), tuple(names[first : last + 1]), tuple(names[last + 1 :]))


def recompute_flags(
    layer_graph: LayerGraph, parts: ModelParts, recompute: GlobalRecompute
) -> dict[str, Recompute]:
    rc = recompute.granularity
    flags = {n: rc for n in parts.decoder if rc is not Recompute.NONE}
    if recompute.vision:
        for layer in layer_graph.in_region(Region.VISION):
            if layer.block:
                flags[layer.name] = Recompute.FULL
    return flags


def recompute_decision(parts: ModelParts, recompute: GlobalRecompute) -> Decision:
    return Decision(
        "recompute",
        Reason.GLOBAL_RECOMPUTE,
        f"{recompute.granularity.value} for all {len(parts.decoder)} decoder layers; vision encoder "
        f"{'fully recomputed' if recompute.vision else 'not recomputed'}",
    )


def independent_branches(layer_graph: LayerGraph) -> int:
    """Encoder entry layers: vision-region layers that read no other layer."""
    g = layer_graph.graph
    return sum(1 for layer in layer_graph.in_region(Region.VISION) if g.in_degree(layer.name) == 0)


def linearised_decision(branches: int, what: str) -> Decision:
    return Decision(
        "layer order",
        Reason.LINEARISED_BRANCHES,
        f"{branches} encoder branches do not depend on each other; {what} assumes one chain, so they are "
        "taken in their captured order",
    )


def with_ends(parts: ModelParts, decoder_counts: Sequence[int], *, why_empty: str) -> list[list[str]]:
    """Decoder layers cut into runs of ``decoder_counts``, the layers before them joining the first
    run and the layers after them the last; a stage left without layers is refused
    (:class:`NotApplicable`, naming the stages and ``why_empty``: what the user can change)."""
    chunks = chunks_of(parts.decoder, decoder_counts)
    chunks[0] = list(parts.pre) + chunks[0]
    chunks[-1] = chunks[-1] + list(parts.post)
    empty = [k for k, c in enumerate(chunks) if not c]
    if empty:
        raise NotApplicable(f"virtual stages {empty} get no layers; {why_empty}")
    return chunks


@dataclass(frozen=True, slots=True)
class RecomputeRung:
    """A recompute setting the pass tries: a global one (Megatron-LM's flags), and where
    ``full_share`` > 0 the first ``full_share`` of every rank's LLM layers (in model order, the
    rank's first virtual stage first) recomputed fully on top of it: Megatron-LM's
    ``--recompute-method block`` per rank, so that every rank pays about the same extra time and
    the stage balance holds."""

    base: GlobalRecompute
    full_share: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.full_share < 1.0:
            raise PlanError(f"full_share={self.full_share!r}; give a share of a rank's LLM layers in [0, 1)")

    def __str__(self) -> str:
        if not self.full_share:
            return str(self.base)
        return f"{self.base} + full on the first {self.full_share:.1%} of each rank's LLM layers"

    def flags(self, layer_graph: LayerGraph, parts, llm_chunks, llm: Parallel) -> dict[str, Recompute]:
        """Per-layer flags for an LLM cut into ``llm_chunks`` (placed as :func:`ep.llm_stages` does)."""
        flags = recompute_flags(layer_graph, parts, self.base)
        if self.full_share:
            per_rank: dict[int, list[str]] = {}
            for stage in ep.llm_stages(llm_chunks, llm, 0):
                per_rank.setdefault(stage.rank, []).extend(stage.layers)
            for layers in per_rank.values():
                for name in layers[: math.ceil(self.full_share * len(layers))]:
                    flags[name] = Recompute.FULL
        return flags


PARTIAL_BASE = GlobalRecompute(granularity=Recompute.SELECTIVE, vision=True)
PARTIAL_SHARES = tuple(k / 8 for k in range(1, 8))
"""Shares of each rank's LLM layers fully recomputed on top of :data:`PARTIAL_BASE`, between
the global settings that recompute less and those that recompute more; the least share that
fits is found by bisection (memory falls as the share grows)."""
LIGHTER_RUNGS = tuple(
    RecomputeRung(GlobalRecompute(granularity=g, vision=v))
    for g in (Recompute.NONE, Recompute.SELECTIVE)
    for v in (False, True)
)
HEAVIER_RUNGS = tuple(
    RecomputeRung(GlobalRecompute(granularity=Recompute.FULL, vision=v)) for v in (False, True)
)
RECOMPUTE_LADDER = (
    *LIGHTER_RUNGS,
    *(RecomputeRung(PARTIAL_BASE, share) for share in PARTIAL_SHARES),
    *HEAVIER_RUNGS,
)
"""Every recompute setting a policy tries, the least first: the encoder alone recomputed comes
before the LLM's selective (the encoder-in-bubbles pass keeps its activations longer, forwards
early in the step and backwards late, and its recompute can run in the LLM's bubbles); between
selective and full, a share of every rank's LLM layers fully recomputed (a memory budget
between the two need not pay for full recompute everywhere)."""
GLOBAL_LADDER = tuple(
    rung.base
    for rung in RECOMPUTE_LADDER
    if not rung.full_share and (not rung.base.vision or rung.base.granularity is Recompute.FULL)
)
"""The rungs of :data:`RECOMPUTE_LADDER` a Megatron-LM user tries, in order, until the plan
fits: its ``--recompute-granularity`` settings, the vision encoder recomputed only on top of
full (none, selective, full, full + vision). The baselines' ``recompute="auto"``."""
