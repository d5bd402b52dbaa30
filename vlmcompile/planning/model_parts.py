"""A LayerGraph read the way the baselines build a VLM: the layers before the first LLM decoder
layer (encoders, projectors, the embedding), the decoder layers, and the layers after them
(final norm, output layer, loss); one global recompute setting as flags per layer; and chunks
of decoder layers with the rest attached to the first and last stage. Every policy that splits
decoder layers reads the model through this module (Megatron-LM's, torchtitan's, MIMO's, the
encoder-in-bubbles pass's LLM), so none of them imports another's file."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Reason, Recompute
from vlmcompile.ir.regions import Region
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
