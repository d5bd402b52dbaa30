"""Megatron-LM's view of a plan: its ``--pipeline-model-parallel-layout`` (an export any plan
gets, for the user's information), and the result of a Megatron-LM policy (``megatron``,
``megatron_balanced``: the same system with two ways to cut), its layout in the report."""

from __future__ import annotations

from dataclasses import dataclass

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.stage_costs import PlanCosts
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.placement import PlacementStyle
from vlmcompile.ir.plan import Decision, Plan, Recompute
from vlmcompile.ir.regions import Region
from vlmcompile.planning.build import build_plan
from vlmcompile.planning.model_parts import model_parts
from vlmcompile.planning.request import GlobalRecompute, NotApplicable, PlanRequest
from vlmcompile.planning.result import PolicyResult
from vlmcompile.sim.simulator import simulate


@dataclass(frozen=True, slots=True)
class MegatronReport:
    layout: str | None
    """``--pipeline-model-parallel-layout`` for the LLM split, if Megatron can express it."""
    layout_note: str

    def __str__(self) -> str:
        layout = f'--pipeline-model-parallel-layout "{self.layout}"' if self.layout else "not expressible"
        note = f" ({self.layout_note})" if self.layout_note else ""
        return f"Megatron layout: {layout}{note}"


def megatron_plan(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    policy: str,
    chunks: list[list[str]],
    flags: dict[str, Recompute],
    decisions: list[Decision],
) -> Plan:
    """The plan of a Megatron-LM policy (not simulated)."""
    par = request.parallel
    if par.placement is not PlacementStyle.LOOP and par.v > 1:
        raise NotApplicable(
            f"Megatron-LM places virtual stage k on rank k mod pp; it has no {par.placement.value!r} placement "
            "(plan the loop placement: --stage-placement loop)"
        )
    return build_plan(
        layer_graph, cluster, request, policy=policy, chunks=chunks, recompute=flags, decisions=decisions
    )


def megatron_result(
    layer_graph: LayerGraph,
    cluster: Cluster,
    plan: Plan,
    recompute: GlobalRecompute,
    *,
    costs: PlanCosts | None = None,
) -> PolicyResult:
    """A Megatron-LM policy's plan, simulated (with ``costs`` where they are made already), with
    its layout in the report."""
    layout, note = megatron_layout(plan, layer_graph)
    return PolicyResult(
        plan=plan,
        sim=simulate(plan, layer_graph, cluster, costs=costs),
        report=MegatronReport(layout, note),
        recompute=str(recompute),
    )


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
