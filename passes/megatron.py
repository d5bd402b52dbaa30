"""Megatron-LM baseline: the plan Megatron-core makes for a LLaVA-style model today.

* the vision encoder, projector and LLM embedding run on the first (virtual) pipeline stage,
  with that stage's share of the LLM decoder layers;
* L decoder layers are split evenly over pp x v virtual stages (L must divide), or with
  ``first_stage_layers`` / ``last_stage_layers`` on the first and last pipeline stage and the
  rest evenly over the others (``--decoder-first/last-pipeline-num-layers``);
* the final norm, output layer and loss run on the last stage;
* one recompute setting for every decoder layer (``--recompute-granularity``: none, selective
  or full with ``--recompute-method uniform --recompute-num-layers 1``) and one on/off switch
  for the vision encoder;
* 1F1B, or interleaved 1F1B when v > 1.

:func:`megatron_layout` writes a plan's LLM split as ``--pipeline-model-parallel-layout``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Plan, Reason, Recompute
from vlmcompile.ir.regions import Region
from vlmcompile.planning.build import build_plan
from vlmcompile.planning.chunks import chunks_of
from vlmcompile.planning.request import GlobalRecompute, PlanRequest
from vlmcompile.planning.result import PolicyResult
from vlmcompile.sim.simulator import simulate


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
        raise PlanError(
            "the model has no LLM decoder layers (transformer blocks in the llm or text region); Megatron's "
            "pipeline splits decoder layers, so plan it with pp=1 or another policy"
        )
    first, last = decoder_idx[0], decoder_idx[-1]
    names = [layer.name for layer in layer_graph.layers]
    between = [n for i, n in enumerate(names[first : last + 1], first) if i not in set(decoder_idx)]
    if between:
        raise PlanError(
            f"layers {between[:3]} sit between LLM decoder layers; Megatron's split cannot place them"
        )
    return ModelParts(tuple(names[:first]), tuple(names[first : last + 1]), tuple(names[last + 1 :]))


@dataclass(frozen=True, slots=True)
class MegatronReport:
    plan: Plan
    layout: str | None
    """``--pipeline-model-parallel-layout`` for the LLM split, if Megatron can express it."""
    layout_note: str

    def __str__(self) -> str:
        layout = f'--pipeline-model-parallel-layout "{self.layout}"' if self.layout else "not expressible"
        note = f" ({self.layout_note})" if self.layout_note else ""
        return f"{self.plan}\n\nMegatron layout: {layout}{note}"


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


def megatron_result(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    policy: str,
    chunks: list[list[str]],
    recompute: GlobalRecompute,
    flags: dict[str, Recompute],
    decisions: list[Decision],
) -> PolicyResult:
    """The plan of a Megatron-LM policy, simulated, with its layout in the report."""
    plan = build_plan(
        layer_graph, cluster, request, policy=policy, chunks=chunks, recompute=flags, decisions=decisions
    )
    layout, note = megatron_layout(plan, layer_graph)
    return PolicyResult(
        plan=plan,
        sim=simulate(plan, layer_graph, cluster),
        report=MegatronReport(plan, layout, note),
        recompute=str(recompute),
    )


def megatron(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    recompute: GlobalRecompute = GlobalRecompute(),
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> PolicyResult:
    """Megatron-LM's plan for ``request`` (see the module docstring)."""
    pp, v = request.parallel.pp, request.parallel.v
    parts = model_parts(layer_graph)
    counts, decisions = _decoder_split(len(parts.decoder), pp, v, first_stage_layers, last_stage_layers)
    chunks = chunks_of(parts.decoder, counts)
    chunks[0] = list(parts.pre) + chunks[0]
    chunks[-1] = chunks[-1] + list(parts.post)
    if not all(chunks):
        empty = [k for k, c in enumerate(chunks) if not c]
        raise PlanError(
            f"virtual stages {empty} get no layers; lower pp x v ({pp} x {v}) or the first/last counts"
        )
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
    decisions.append(
        Decision(
            f"stage {len(chunks) - 1}",
            Reason.HEAD_ON_LAST_STAGE,
            f"{', '.join(parts.post)} on the last stage",
        )
    )
    decisions.append(recompute_decision(parts, recompute))
    return megatron_result(
        layer_graph,
        cluster,
        request,
        policy="megatron",
        chunks=chunks,
        recompute=recompute,
        flags=recompute_flags(layer_graph, parts, recompute),
        decisions=decisions,
    )


def _decoder_split(
    num_layers: int, pp: int, v: int, first: int | None, last: int | None
) -> tuple[list[int], list[Decision]]:
    """Decoder layers per virtual stage, in stage order (virtual stage c * pp + r)."""
    stages = pp * v
    if first is None and last is None:
        if num_layers % stages:
            divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
            raise PlanError(
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
    counts = [per_rank[k % pp] // v for k in range(stages)]
    return counts, decisions


def megatron_layout(plan: Plan, layer_graph: LayerGraph) -> tuple[str | None, str]:
    """``--pipeline-model-parallel-layout`` (E embedding, t decoder layer, L final norm, output
    layer and loss; virtual stages in order, ``|`` between them), or None and why not: the
    layout describes the LLM only, so everything else must sit where Megatron's LLaVA puts it.
    The layout is an export for the user's information: it never fails a plan."""
    try:
        parts = model_parts(layer_graph)
    except PlanError as err:
        return None, str(err)
    stage_of = plan.stage_of()
    pre_llm = [n for n in parts.pre if layer_graph[n].region in (Region.LLM, Region.TEXT)]
    encoder = [n for n in parts.pre if n not in pre_llm]
    off_first = [n for n in encoder if stage_of[n] != 0]
    if off_first:
        return None, (
            f"Megatron's LLaVA builds the vision encoder on the first pipeline stage only; this plan puts "
            f"{off_first[0]} on stage {stage_of[off_first[0]]}"
        )
    if any(stage_of[n] != 0 for n in pre_llm):
        return None, "the LLM embedding is not on the first stage"
    last = plan.num_stages - 1
    if any(stage_of[n] != last for n in parts.post):
        return None, f"the final norm / output layer ({', '.join(parts.post)}) must share the last stage"
    decoder = set(parts.decoder)
    symbols = []
    for stage in plan.stages:
        s = "E" if any(n in stage.layers for n in pre_llm) else ""
        s += "t" * sum(n in decoder for n in stage.layers)
        if stage.index == last:
            s += "L"
        symbols.append(s)
    return "|".join(symbols), ""
