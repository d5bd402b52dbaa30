"""From a policy's choices to a plan: stages from chunks of layers (each virtual stage on the
rank the request's placement gives it, :mod:`vlmcompile.ir.placement`), the request's schedule as action lists, and
the plan validated. Every policy ends here, so their plans differ only in what they chose.
:func:`build_separate_plan` does the same for a plan whose encoders have degrees of their own
(:mod:`vlmcompile.planning.encoder_plans`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.stage_costs import chunk_action_times, layer_costs
from vlmcompile.ir.actions import Action, without_backward
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Plan, Reason, Recompute, Stage, frozen_layers
from vlmcompile.planning import encoder_plans as ep
from vlmcompile.planning.request import PlanRequest
from vlmcompile.planning.schedules import make_schedule


def build_plan(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    policy: str,
    chunks: Sequence[Sequence[str]],
    recompute: Mapping[str, Recompute],
    decisions: Sequence[Decision],
) -> Plan:
    """The validated plan of ``chunks`` (layer names per virtual stage, in stage order)."""
    request.check_on(cluster)
    par, m = request.parallel, request.num_microbatches
    schedule = request.schedule_name
    costs = {
        c.name: c
        for c in layer_costs(
            layer_graph,
            cluster,
            par,
            microbatch_size=request.microbatch_size,
            recompute=recompute,
            precision=request.precision,
        )
    }
    actions = make_schedule(schedule, par.stage_placement, m, stage_times=chunk_action_times(costs, chunks))
    actions = without_backward(actions, forward_only_stages(chunks, layer_graph))
    said = Decision(
        "schedule", Reason.SCHEDULE, f"{schedule} over {par.pp} ranks, {m} microbatches", {"microbatches": m}
    )
    plan = Plan(
        model=str(layer_graph.meta.get("model", "?")),
        fingerprint=layer_graph.fingerprint(),
        frozen=frozen_layers(layer_graph),
        policy=policy,
        cluster=cluster.name,
        stages=tuple(
            Stage(index=k, rank=par.stage_placement.rank_of(k), layers=tuple(chunk))
            for k, chunk in enumerate(chunks)
        ),
        parallel={"model": par},
        microbatch_size=request.microbatch_size,
        num_microbatches=m,
        actions=actions,
        schedule=schedule.value,
        recompute=dict(recompute),
        decisions=(*decisions, said),
        precision=request.precision,
    )
    plan.validate(layer_graph)
    return plan


def build_separate_plan(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    encoder: ep.EncoderPlan,
    *,
    policy: str,
    encoder_pieces: Sequence[Sequence[Sequence[str]]],
    llm_chunks: Sequence[Sequence[str]],
    recompute: Mapping[str, Recompute],
    decisions: Sequence[Decision],
    assignment: Sequence[int] | None = None,
    actions: Sequence[Sequence[Action]] | None = None,
) -> Plan:
    """The validated plan of an encoder plan beside the request's LLM degrees: the encoder
    pieces (per encoder stage, the layers of each piece) replicated over their holders, the LLM
    chunks as its virtual stages, and ``actions`` (default: the request's LLM schedule with the
    encoder work in phases before and after it, microbatches given to the encoder pipelines by
    ``assignment``)."""
    request.check_on(cluster)
    llm, m = request.parallel, request.num_microbatches
    encoder.check_against(llm, request.microbatch_size)
    enc_stages = ep.encoder_stages(encoder_pieces, encoder, llm)
    stages = enc_stages + ep.llm_stages(llm_chunks, llm, len(enc_stages))
    schedule = request.schedule_name
    if actions is None:
        llm_costs = {
            c.name: c
            for c in layer_costs(
                layer_graph,
                cluster,
                llm,
                microbatch_size=request.microbatch_size,
                recompute=recompute,
                precision=request.precision,
            )
        }
        llm_actions = make_schedule(
            schedule, llm.stage_placement, m, stage_times=chunk_action_times(llm_costs, llm_chunks)
        )
        assignment = assignment or ep.pipeline_of_microbatch(m, encoder.pipelines(llm))
        actions = ep.phased_actions(enc_stages, ep.offset_actions(llm_actions, len(enc_stages)), assignment)
    actions = without_backward(actions, forward_only_stages([s.layers for s in stages], layer_graph))
    said = Decision(
        "schedule",
        Reason.SCHEDULE,
        f"{schedule} over {llm.pp} ranks for the LLM, {m} microbatches; {encoder} beside it",
        {"microbatches": m},
    )
    plan = Plan(
        model=str(layer_graph.meta.get("model", "?")),
        fingerprint=layer_graph.fingerprint(),
        frozen=frozen_layers(layer_graph),
        policy=policy,
        cluster=cluster.name,
        stages=tuple(stages),
        parallel=ep.groups(encoder, llm),
        microbatch_size=request.microbatch_size,
        num_microbatches=m,
        actions=actions,
        schedule=schedule.value,
        recompute=dict(recompute),
        decisions=(*decisions, said),
        precision=request.precision,
    )
    plan.validate(layer_graph)
    return plan


def forward_only_stages(chunks: Sequence[Sequence[str]], layer_graph: LayerGraph) -> frozenset[int]:
    """The stages (by their layers) that no gradient reaches: they run no backward actions."""
    no_gradient = layer_graph.forward_only()
    return frozenset(k for k, chunk in enumerate(chunks) if all(n in no_gradient for n in chunk))
