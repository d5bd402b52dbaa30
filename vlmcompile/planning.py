"""Run a planning policy and simulate its plan; ``recompute="auto"`` does what a Megatron-LM
user does - the least recompute whose plan fits in device memory (none, then selective, then
full, then full with the vision encoder too)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlmcompile.cluster import Cluster
from vlmcompile.layer_graph import LayerGraph
from vlmcompile.passes.megatron import BaselineReport, BaselineResult, megatron
from vlmcompile.passes.megatron_balanced import megatron_balanced
from vlmcompile.plan import Decision, Plan, Reason
from vlmcompile.simulator import SimResult, simulate

POLICIES: dict[str, Callable[..., BaselineResult]] = {
    "megatron": megatron,
    "megatron_balanced": megatron_balanced,
}

RECOMPUTE_LADDER = (("none", False), ("selective", False), ("full", False), ("full", True))


def zoo_layer_graph(model_name: str, *, dtype: Any = None) -> LayerGraph:
    """A zoo model's LayerGraph for one sample, annotated on meta tensors (any size, no memory)."""
    import torch

    import vlmcompile
    from vlmcompile import models

    dtype = dtype or torch.bfloat16
    model = models.build(model_name, device="meta", dtype=dtype)
    batch = models.sample_batch(model_name, batch_size=1, device="meta", dtype=dtype)
    return vlmcompile.compile(model, batch, model_name=model_name, log=None).layer_graph


@dataclass(frozen=True, slots=True)
class PlannedRun:
    plan: Plan
    report: BaselineReport
    sim: SimResult
    fits: bool
    """Peak memory of every rank within the device's."""
    recompute: str
    """The recompute setting used: none, selective, full, or full + vision."""


def plan_and_simulate(
    layer_graph: LayerGraph,
    cluster: Cluster,
    policy: str,
    *,
    recompute: str = "auto",
    recompute_vision: bool = False,
    **options: Any,
) -> PlannedRun:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    ladder = RECOMPUTE_LADDER if recompute == "auto" else ((recompute, recompute_vision),)
    tried = []
    for rc, rc_vision in ladder:
        result = POLICIES[policy](layer_graph, cluster, recompute=rc, recompute_vision=rc_vision, **options)
        sim = simulate(result.plan, layer_graph, cluster)
        peak = max(sim.peak_mem_bytes)
        fits = peak <= cluster.device.mem_bytes
        tried.append(f"{rc}{' + vision' if rc_vision else ''}: {peak / 2**30:.1f} GiB")
        if fits:
            break
    plan = result.plan
    if recompute == "auto":
        verdict = (
            "fits"
            if fits
            else f"does not fit even with the most recompute (limit {cluster.device.mem_bytes / 2**30:.1f} GiB)"
        )
        plan = dataclasses.replace(
            plan,
            decisions=(
                *plan.decisions,
                Decision(
                    "recompute",
                    Reason.GLOBAL_RECOMPUTE,
                    f"auto: least recompute that fits; tried {'; '.join(tried)}; {verdict}",
                ),
            ),
        )
        sim = dataclasses.replace(sim, plan=plan)
    chosen = f"{rc}{' + vision' if rc_vision else ''}"
    report = BaselineReport(plan, result.report.layout, result.report.layout_note)
    return PlannedRun(plan, report, sim, fits, chosen)
