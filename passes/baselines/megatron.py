"""Megatron-LM baseline: the plans Megatron-LM users get for a VLM today.

Where the encoder goes is a named placement (:class:`EncoderPlacement`), each the way one
kind of Megatron user builds the pipeline:

* ``llava`` - Megatron-core's LLaVA model: the vision encoder, projector and LLM embedding on
  the first (virtual) pipeline stage, with that stage's share of the LLM decoder layers; L
  decoder layers split evenly over pp x v virtual stages (L must divide);
* ``chain`` - one pipeline over the encoder and decoder layers as a single chain, encoder
  first, split evenly by layer count over the pp x v virtual stages (where the count does not
  divide, the first stages take one layer more); the layers between blocks (patch embedding,
  projector, LLM embedding) go with the next block, the final norm, output layer and loss with
  the last;
* ``uneven`` - ``llava`` with ``first_stage_layers`` / ``last_stage_layers`` decoder layers on
  the first and last pipeline stage and the rest evenly over the others
  (``--decoder-first/last-pipeline-num-layers``).

:data:`PLACEMENT_SOURCES` cites where each comes from. Everything else is the same for all
three:

* the final norm, output layer and loss run on the last stage;
* one recompute setting for every decoder layer (``--recompute-granularity``: none, selective
  or full with ``--recompute-method uniform --recompute-num-layers 1``) and one on/off switch
  for the vision encoder;
* 1F1B, or interleaved 1F1B when v > 1, virtual stage k on rank k mod pp (the ``loop``
  placement of :mod:`vlmcompile.ir.placement`).

The plan's ``--pipeline-model-parallel-layout`` is in its report
(:mod:`vlmcompile.planning.megatron_layout`).
"""

from __future__ import annotations

import enum

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.errors import PlanError, choice
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.placement import stage_to_rank
from vlmcompile.ir.plan import Decision, Plan, Reason
from vlmcompile.ir.regions import ENCODER_REGIONS, LANGUAGE_REGIONS, Region
from vlmcompile.planning.megatron_layout import megatron_plan, megatron_result
from vlmcompile.planning.model_parts import (
    ModelParts,
    independent_branches,
    linearised_decision,
    model_parts,
    recompute_decision,
    recompute_flags,
    with_ends,
)
from vlmcompile.planning.request import GlobalRecompute, NotApplicable, PlanRequest
from vlmcompile.planning.result import PolicyResult


class EncoderPlacement(str, enum.Enum):
    """Where Megatron-LM puts a VLM's encoder layers (see the module docstring)."""

    LLAVA = "llava"
    CHAIN = "chain"
    UNEVEN = "uneven"

    @classmethod
    def parse(cls, value: EncoderPlacement | str) -> EncoderPlacement:
        return choice(cls, value, "Megatron encoder placement")


PLACEMENT_SOURCES = {
    EncoderPlacement.LLAVA: (
        "Megatron-LM megatron/core/models/multimodal/llava_model.py: the vision model and projector are "
        "built only where add_encoder is set, the first pipeline stage; the language model's layers are "
        "split evenly (megatron/core/transformer/transformer_block.py, get_num_layers_to_build)"
    ),
    EncoderPlacement.CHAIN: (
        "one Megatron pipeline over the whole VLM: encoder and decoder layers in one chain, as a "
        "--pipeline-model-parallel-layout of equal stages (megatron/core/transformer/"
        "pipeline_parallel_layer_layout.py) or a model whose encoder blocks are transformer layers; "
        "the Optimus appendix B balances exactly this chain"
    ),
    EncoderPlacement.UNEVEN: (
        "Megatron-LM --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers "
        "(megatron/core/transformer/transformer_config.py; get_num_layers_to_build)"
    ),
}
"""Where each placement comes from, for reports and the setups."""


def megatron(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    recompute: GlobalRecompute = GlobalRecompute(),
    **placement_options,
) -> PolicyResult:
    """Megatron-LM's plan for ``request`` (:func:`megatron_layout_plan`, whose placement options
    it takes), simulated."""
    plan = megatron_layout_plan(layer_graph, cluster, request, recompute=recompute, **placement_options)
    return megatron_result(layer_graph, cluster, plan, recompute)


def megatron_layout_plan(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    placement: EncoderPlacement | str | None = None,
    recompute: GlobalRecompute = GlobalRecompute(),
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> Plan:
    """Megatron-LM's plan for ``request`` with the encoder placed by ``placement`` (see the
    module docstring; None: ``uneven`` when first/last stage counts are given, else ``llava``);
    ``first_stage_layers`` / ``last_stage_layers`` are the ``uneven`` placement's and only its.
    Not simulated (:func:`megatron` simulates it)."""
    uneven_counts = first_stage_layers is not None or last_stage_layers is not None
    if placement is None:
        placement = EncoderPlacement.UNEVEN if uneven_counts else EncoderPlacement.LLAVA
    placement = EncoderPlacement.parse(placement)
    if placement is EncoderPlacement.UNEVEN and not uneven_counts:
        raise PlanError(
            "placement 'uneven' needs first_stage_layers and/or last_stage_layers (the decoder layers of the "
            "first and last pipeline stage); without them use placement 'llava'"
        )
    if placement is not EncoderPlacement.UNEVEN and uneven_counts:
        raise PlanError(
            f"first_stage_layers / last_stage_layers are the 'uneven' placement's; placement "
            f"{placement.value!r} splits evenly, so give placement='uneven' or drop them"
        )
    parts = model_parts(layer_graph)
    if placement is EncoderPlacement.CHAIN:
        chunks, decisions = _chain_chunks(layer_graph, request.parallel.pp, request.parallel.v)
    else:
        chunks, decisions = _llava_chunks(
            layer_graph, parts, request.parallel.pp, request.parallel.v, first_stage_layers, last_stage_layers
        )
    decisions.append(
        Decision(
            f"stage {len(chunks) - 1}",
            Reason.HEAD_ON_LAST_STAGE,
            f"{', '.join(parts.post)} on the last stage",
        )
    )
    branches = independent_branches(layer_graph)
    if branches > 1 and placement is EncoderPlacement.CHAIN:
        decisions.append(linearised_decision(branches, "the chain"))
    decisions.append(recompute_decision(parts, recompute))
    return megatron_plan(
        layer_graph,
        cluster,
        request,
        policy="megatron",
        chunks=chunks,
        flags=recompute_flags(layer_graph, parts, recompute),
        decisions=decisions,
    )


def _llava_chunks(
    layer_graph: LayerGraph, parts: ModelParts, pp: int, v: int, first: int | None, last: int | None
) -> tuple[list[list[str]], list[Decision]]:
    counts, decisions = _decoder_split(len(parts.decoder), pp, v, first, last)
    chunks = with_ends(parts, counts, why_empty=f"lower pp x v ({pp} x {v}) or the first/last counts")
    encoder = [n for n in parts.pre if layer_graph[n].region is not Region.LLM]
    decisions.insert(
        0,
        Decision(
            "stage 0",
            Reason.ENCODER_ON_FIRST_STAGE,
            f"{len(encoder)} encoder/projector layers and the LLM embedding join {counts[0]} decoder layers",
            {"encoder_layers": len(encoder), "decoder_layers": counts[0]},
        ),
    )
    return chunks, decisions


def _chain_chunks(layer_graph: LayerGraph, pp: int, v: int) -> tuple[list[list[str]], list[Decision]]:
    """Encoder and decoder transformer layers in captured order, split evenly by count over
    pp x v virtual stages; every other layer (projectors too: Megatron counts transformer
    layers) joins the stage of the next transformer layer, or the last stage after the last."""
    names = [layer.name for layer in layer_graph.layers]
    chained = ENCODER_REGIONS | LANGUAGE_REGIONS
    blocks = [layer.index for layer in layer_graph.layers if layer.block and layer.region in chained]
    stages = pp * v
    if stages > len(blocks):
        raise NotApplicable(
            f"placement 'chain' splits {len(blocks)} encoder and decoder layers over pp x v = {pp} x {v} = "
            f"{stages} virtual stages; every stage needs a layer, so lower pp x v to at most {len(blocks)}, "
            "or use placement 'llava'"
        )
    base, extra = divmod(len(blocks), stages)
    block_counts = [base + (k < extra) for k in range(stages)]
    stage_of_block = [k for k, c in enumerate(block_counts) for _ in range(c)]
    chunks: list[list[str]] = [[] for _ in range(stages)]
    b = 0
    for i, name in enumerate(names):
        while b < len(blocks) and blocks[b] < i:
            b += 1
        chunks[stage_of_block[b] if b < len(blocks) else stages - 1].append(name)
    per = (
        f"{base} each"
        if not extra
        else f"{base + 1} on the first {extra} and {base} on the other {stages - extra}"
    )
    return chunks, [
        Decision(
            "layer split",
            Reason.CHAIN_SPLIT,
            f"{len(blocks)} encoder and decoder layers in one chain over {stages} virtual stages, {per}; "
            "embeddings and projectors join the stage of the next layer",
            {"layers": len(blocks), "stages": stages},
        )
    ]


def _decoder_split(
    num_layers: int, pp: int, v: int, first: int | None, last: int | None
) -> tuple[list[int], list[Decision]]:
    """Decoder layers per virtual stage, in stage order (virtual stage c * pp + r)."""
    stages = pp * v
    if first is None and last is None:
        if num_layers % stages:
            divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
            raise NotApplicable(
                f"{num_layers} decoder layers do not split evenly over pp x v = {pp} x {v} = {stages} virtual "
                f"stages; choose pp x v in {divisors}, or set first_stage_layers / last_stage_layers"
            )
        per = num_layers // stages
        return [per] * stages, [
            Decision(
                "decoder split", Reason.EVEN_SPLIT, f"{per} decoder layers on each of {stages} virtual stages"
            )
        ]
    if pp < 2 and first is not None and last is not None:
        raise PlanError("first_stage_layers and last_stage_layers together need pp >= 2")
    per_rank = [None] * pp
    decisions = []
    if first is not None:
        per_rank[0] = first
        decisions.append(
            Decision(
                "stage 0", Reason.FIRST_STAGE_LAYERS, f"{first} decoder layers on the first pipeline stage"
            )
        )
    if last is not None:
        per_rank[-1] = last
        decisions.append(
            Decision(
                f"rank {pp - 1}",
                Reason.LAST_STAGE_LAYERS,
                f"{last} decoder layers on the last pipeline stage",
            )
        )
    fixed = sum(c for c in per_rank if c is not None)
    middle = [r for r in range(pp) if per_rank[r] is None]
    rest = num_layers - fixed
    if rest < 0 or (middle and rest % len(middle)) or (not middle and rest):
        raise PlanError(
            f"{num_layers} decoder layers minus first/last stage counts ({first}, {last}) leave {rest} for the "
            f"{len(middle)} other pipeline stages, which must divide evenly"
        )
    for r in middle:
        per_rank[r] = rest // len(middle)
    for r, count in enumerate(per_rank):
        if count % v:
            raise PlanError(
                f"pipeline stage {r} gets {count} decoder layers, not divisible by v={v} model chunks"
            )
    counts = [per_rank[stage_to_rank(k, pp)] // v for k in range(stages)]
    return counts, decisions
