"""Separate parallel plans for the encoders and the LLM over the same GPUs (Optimus sec. 3.1,
design decision 1; sec. 4.1, the model planner), laid out as one plan.

An :class:`EncoderPlan` gives the encoders (every vision tower and its projector, scheduled as
one encoder: Optimus sec. 4.4) their own PP and TP; DP is what the GPUs leave. PP_enc divides
the LLM's PP and TP_enc its TP, so every GPU holds both an LLM stage and an encoder stage. Along
one LLM pipeline there are PP_llm / PP_enc encoder pipelines: encoder pipeline k runs its stage
i on pipeline rank k * PP_enc + i (Optimus fig. 5), so an encoder stage is one stage of the plan
replicated over PP_llm / PP_enc ranks (:attr:`vlmcompile.ir.plan.Stage.replicas`), and each
microbatch's encoder work runs on the encoder pipeline it is assigned to. Within one pipeline
rank (TP_llm GPUs) there are TP_llm / TP_enc encoder replicas, each encoding its share of the
microbatch's samples (the cost model's :func:`~vlmcompile.cost_models.stage_costs.group_samples`).

Each encoder stage may be cut into several stages of the chain (``chunks``): the unit the
scheduler places into the LLM's bubbles (layer granularity).

:func:`phased_actions` is the schedule to start from (Optimus's ``InitSchedule``, and the
order of Megatron-core's colocated schedule): every encoder forward before the LLM's work,
every encoder backward after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.placement import replicated_stage_ranks
from vlmcompile.ir.plan import Parallel, Stage
from vlmcompile.ir.regions import (  # the projector runs as the encoder's last layer (Optimus)
    ENCODER_SIDE,
    Region,
)
from vlmcompile.planning.chunks import balanced_split, chunks_of

ENCODER_GROUP = "encoder"
LLM_GROUP = "llm"


@dataclass(frozen=True, slots=True)
class EncoderPlan:
    """The encoders' own degrees beside the LLM's (Optimus's (DP_enc, PP_enc, TP_enc))."""

    pp: int
    tp: int
    chunks: int = 1
    """Stages of the chain per encoder stage: the encoder work is scheduled in these units."""

    def __post_init__(self):
        for name in ("pp", "tp", "chunks"):
            if getattr(self, name) < 1:
                raise PlanError(f"encoder plan {name}={getattr(self, name)} must be >= 1")

    def check_against(self, llm: Parallel, microbatch_size: int) -> None:
        """Refuse an encoder plan that does not spread over the LLM's GPUs."""
        if llm.pp % self.pp:
            raise PlanError(
                f"encoder PP={self.pp} does not divide the LLM's PP={llm.pp}; use a divisor of {llm.pp}"
            )
        if llm.tp % self.tp:
            raise PlanError(
                f"encoder TP={self.tp} does not divide the LLM's TP={llm.tp}; use a divisor of {llm.tp}"
            )
        if microbatch_size % (llm.tp // self.tp):
            raise PlanError(
                f"encoder TP={self.tp} makes {llm.tp // self.tp} encoder replicas per LLM TP group, which cannot "
                f"share a microbatch of {microbatch_size} samples evenly; use an encoder TP whose "
                f"{llm.tp} / TP divides {microbatch_size}"
            )

    def parallel(self, llm: Parallel) -> Parallel:
        """The encoder group's degrees: the same GPUs as ``llm``'s."""
        return Parallel(
            dp=llm.world_size // (self.pp * self.tp),
            tp=self.tp,
            pp=self.pp,
            v=1,
            sequence_parallel=llm.sequence_parallel,
            zero_stage=llm.zero_stage,
        )

    def pipelines(self, llm: Parallel) -> int:
        """Encoder pipelines along one LLM pipeline (Optimus's m, per LLM pipeline)."""
        return llm.pp // self.pp

    def holders(self, part: int, llm: Parallel) -> tuple[int, ...]:
        """Pipeline ranks holding encoder stage ``part``: one per encoder pipeline."""
        return replicated_stage_ranks(part, self.pp, llm.pp)

    def __str__(self) -> str:
        return f"encoder PP={self.pp} TP={self.tp}" + (
            f" ({self.chunks} chunks per stage)" if self.chunks > 1 else ""
        )


def encoder_layer_count(layer_graph: LayerGraph) -> int:
    """How many layers at the start of the layer order are encoder work (vision towers and their
    projectors). 0 for a model without an encoder. A model whose encoder layers are not a prefix
    (some LLM layer runs before an encoder's) cannot be given a plan of its own here.

    A frozen vision tower under a projector that trains (LLaVA's second stage) counts without
    the projector, which joins the LLM's first stage: the tower then has no backward at all, and
    its forwards may run a batch ahead (``Plan.ahead``)."""
    regions = [layer.region for layer in layer_graph.layers]
    count = next((i for i, r in enumerate(regions) if r not in ENCODER_SIDE), len(regions))
    later = [layer_graph.layers[i].name for i in range(count, len(regions)) if regions[i] in ENCODER_SIDE]
    if later:
        raise PlanError(
            f"encoder layers {later[:3]} run after LLM layer {layer_graph.layers[count].name!r}; a separate "
            "encoder plan needs the encoders (and projectors) before every LLM layer in the captured order, so "
            "only one chain of stage cuts plans this model (vlmcompile's partition, megatron_balanced)"
        )
    no_gradient = layer_graph.forward_only()
    frozen = next((i for i in range(count) if layer_graph.layers[i].name not in no_gradient), count)
    if 0 < frozen < count and all(
        layer_graph.layers[i].region == Region.PROJECTOR for i in range(frozen, count)
    ):
        return frozen
    return count


def encoder_chunks(
    layer_graph: LayerGraph, plan: EncoderPlan, times: Sequence[float]
) -> list[list[list[str]]]:
    """The encoder layers cut into ``plan.pp`` stages balanced by ``times`` (one per encoder layer),
    each cut into ``plan.chunks`` pieces: per encoder stage, the layer names of each piece."""
    count = encoder_layer_count(layer_graph)
    names = [layer.name for layer in layer_graph.layers[:count]]
    if len(times) != count:
        raise PlanError(f"{len(times)} encoder layer times for {count} encoder layers")
    if plan.pp * plan.chunks > count:
        raise PlanError(
            f"{plan} needs {plan.pp * plan.chunks} encoder pieces, but the model has {count} encoder layers; "
            "lower the encoder PP or the chunks"
        )
    parts = chunks_of(names, balanced_split(times, plan.pp))
    out = []
    for part in parts:
        part_times = [times[names.index(n)] for n in part]
        pieces = min(plan.chunks, len(part))
        out.append(chunks_of(part, balanced_split(part_times, pieces)))
    return out


def encoder_stages(
    pieces: Sequence[Sequence[Sequence[str]]], plan: EncoderPlan, llm: Parallel
) -> list[Stage]:
    """The chain's first stages: every piece of every encoder stage, held by that stage's ranks."""
    stages = []
    for part, part_pieces in enumerate(pieces):
        first, *rest = plan.holders(part, llm)
        for piece in part_pieces:
            stages.append(Stage(len(stages), first, tuple(piece), group=ENCODER_GROUP, replicas=tuple(rest)))
    return stages


def llm_stages(chunks: Sequence[Sequence[str]], llm: Parallel, offset: int) -> list[Stage]:
    """The LLM's virtual stages after ``offset`` encoder stages, placed by the LLM's placement."""
    placement = llm.stage_placement
    return [
        Stage(offset + k, placement.rank_of(k), tuple(chunk), group=LLM_GROUP)
        for k, chunk in enumerate(chunks)
    ]


def offset_actions(actions: Sequence[Sequence[Action]], offset: int) -> list[list[Action]]:
    """An LLM schedule's action lists with its stages numbered after ``offset`` encoder stages."""
    return [[Action(a.stage + offset, a.kind, a.microbatch) for a in acts] for acts in actions]


def pipeline_of_microbatch(
    num_microbatches: int, pipelines: int, counts: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Which encoder pipeline encodes each microbatch: ``counts[k]`` microbatches to pipeline k
    (Optimus's microbatch partition), in round-robin order so that each pipeline's first
    microbatch comes early; default an even partition."""
    counts = (
        list(counts)
        if counts is not None
        else [num_microbatches // pipelines + (k < num_microbatches % pipelines) for k in range(pipelines)]
    )
    if len(counts) != pipelines or sum(counts) != num_microbatches or min(counts) < 0:
        raise PlanError(
            f"microbatch partition {counts} must give {num_microbatches} microbatches to {pipelines} encoder pipelines"
        )
    left, out, k = list(counts), [], 0
    while len(out) < num_microbatches:
        if left[k]:
            out.append(k)
            left[k] -= 1
        k = (k + 1) % pipelines
    return tuple(out)


def encoder_actions_of(
    enc_stages: Sequence[Stage], assignment: Sequence[int], kind: ActionKind
) -> dict[int, list[Action]]:
    """Per pipeline rank, its encoder actions of ``kind`` in dependency order: forwards stage by
    stage and microbatch by microbatch, backwards the reverse."""
    per_rank: dict[int, list[Action]] = {}
    order = enc_stages if kind is ActionKind.F else list(reversed(enc_stages))
    microbatches = range(len(assignment))
    for stage in order:
        for j in microbatches:
            rank = stage.ranks[assignment[j]]
            per_rank.setdefault(rank, []).append(Action(stage.index, kind, j))
    return per_rank


def phased_actions(
    enc_stages: Sequence[Stage],
    llm_actions: Sequence[Sequence[Action]],
    assignment: Sequence[int],
) -> tuple[tuple[Action, ...], ...]:
    """Every rank runs its encoder forwards, then its LLM actions, then its encoder backwards."""
    fwd = encoder_actions_of(enc_stages, assignment, ActionKind.F)
    bwd = encoder_actions_of(enc_stages, assignment, ActionKind.B)
    return tuple(
        tuple(fwd.get(rank, []) + list(acts) + bwd.get(rank, [])) for rank, acts in enumerate(llm_actions)
    )


def groups(plan: EncoderPlan, llm: Parallel) -> Mapping[str, Parallel]:
    return {ENCODER_GROUP: plan.parallel(llm), LLM_GROUP: llm}
