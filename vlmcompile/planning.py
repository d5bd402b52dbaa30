"""Run a planning policy and simulate its plan.

For the Megatron policies ``recompute="auto"`` does what a Megatron-LM user does - the least
global recompute whose plan fits in memory (none, then selective, then full, then full with the
vision encoder too). ``omnibal`` and ``vlmcompile`` choose per-layer recompute themselves.
``vlmcompile`` first plans every baseline at the same degrees: the fastest that fits is its
warm start, and all of them are rows of its report. Every policy is held to the same memory
cap: device memory less :data:`~vlmcompile.cost_models.memory.MEMORY_RESERVE`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tabulate import tabulate

from vlmcompile.cluster import Cluster
from vlmcompile.cost_models.memory import usable_memory_bytes
from vlmcompile.errors import PlanError
from vlmcompile.layer_graph import LayerGraph
from vlmcompile.passes.megatron import BaselineResult, megatron
from vlmcompile.passes.megatron_balanced import megatron_balanced
from vlmcompile.passes.omnibal import omnibal
from vlmcompile.passes.partition import partition
from vlmcompile.plan import Decision, Plan, Reason
from vlmcompile.simulator import SimResult, simulate

POLICIES: dict[str, Callable[..., BaselineResult]] = {
    "megatron": megatron,
    "megatron_balanced": megatron_balanced,
    "omnibal": omnibal,
    "vlmcompile": partition,
}
BASELINES = ("megatron", "megatron_balanced", "omnibal")
GLOBAL_RECOMPUTE_POLICIES = ("megatron", "megatron_balanced")

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
class PolicyRow:
    """One policy's plan at the same degrees, as the report's comparison shows it."""

    policy: str
    step_s: float | None
    """Simulated; None when the policy could not plan."""
    fits: bool
    recompute: str
    note: str = ""


@dataclass(frozen=True, slots=True)
class PlannedRun:
    plan: Plan
    report: Any
    """The policy's report (``str()`` prints it)."""
    sim: SimResult
    fits: bool
    """Peak memory of every rank within the cap (device memory less the reserve)."""
    recompute: str
    """The recompute used: none, selective, full, full + vision, or "per layer (n)"."""
    baselines: tuple[PolicyRow, ...] = ()
    """For ``vlmcompile``: every baseline at the same degrees."""

    def comparison_table(self) -> str:
        rows = [*self.baselines, PolicyRow(self.plan.policy, self.sim.step_time_s, self.fits, self.recompute)]
        ours = self.sim.step_time_s
        lines = [
            [
                r.policy,
                f"{r.step_s * 1e3:.1f}" if r.step_s is not None else "-",
                f"{r.step_s / ours:.3f}" if r.step_s is not None else "-",
                r.recompute,
                "yes" if r.fits else "no",
                r.note,
            ]
            for r in rows
        ]
        return tabulate(
            lines,
            headers=["policy", "simulated step ms", "vs ours", "recompute", "fits", "note"],
            disable_numparse=True,
        )

    def __str__(self) -> str:
        parts = [str(self.report), "", str(self.sim)]
        if self.baselines:
            parts += [
                "",
                "policies at the same degrees (simulated: predictions of the cost model):",
                self.comparison_table(),
            ]
        return "\n".join(parts)


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
    if policy not in GLOBAL_RECOMPUTE_POLICIES:
        if recompute != "auto" or recompute_vision:
            raise ValueError(
                f"policy {policy!r} chooses recompute per layer; leave recompute at 'auto' (got {recompute!r}"
                f"{', recompute_vision' if recompute_vision else ''})"
            )
        return _per_layer_policy(layer_graph, cluster, policy, **options)
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    ladder = RECOMPUTE_LADDER if recompute == "auto" else ((recompute, recompute_vision),)
    tried = []
    for rc, rc_vision in ladder:
        result = POLICIES[policy](layer_graph, cluster, recompute=rc, recompute_vision=rc_vision, **options)
        sim = simulate(result.plan, layer_graph, cluster)
        peak = max(sim.peak_mem_bytes)
        fits = peak <= cap
        tried.append(f"{rc}{' + vision' if rc_vision else ''}: {peak / 2**30:.1f} GiB")
        if fits:
            break
    plan = result.plan
    if recompute == "auto":
        verdict = "fits" if fits else f"does not fit even with the most recompute (cap {cap / 2**30:.1f} GiB)"
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
    report = dataclasses.replace(result.report, plan=plan)
    return PlannedRun(plan, report, sim, fits, chosen)


def _per_layer_policy(layer_graph: LayerGraph, cluster: Cluster, policy: str, **options: Any) -> PlannedRun:
    baselines: tuple[PolicyRow, ...] = ()
    if policy == "vlmcompile" and "warm_start" not in options:
        runs, baselines = compare_baselines(layer_graph, cluster, **options)
        fitting = [
            r for r in runs if r.fits and r.plan.num_stages == options.get("pp", 1) * options.get("v", 1)
        ]
        if fitting:
            options = {**options, "warm_start": min(fitting, key=lambda r: r.sim.step_time_s).plan}
    result = POLICIES[policy](layer_graph, cluster, **options)
    sim = getattr(result.report, "sim", None) or simulate(result.plan, layer_graph, cluster)
    fits = max(sim.peak_mem_bytes) <= usable_memory_bytes(cluster.device.mem_bytes)
    return PlannedRun(
        result.plan, result.report, sim, fits, f"per layer ({len(result.plan.recompute)})", baselines
    )


def compare_baselines(
    layer_graph: LayerGraph, cluster: Cluster, **options: Any
) -> tuple[list[PlannedRun], tuple[PolicyRow, ...]]:
    """Every baseline at the same degrees; a policy that cannot plan them gets a row saying why."""
    runs, rows = [], []
    # The solver's own options mean nothing to the baselines.
    allowed = {k: v for k, v in options.items() if k not in ("time_limit_s", "workers", "warm_start")}
    for policy in BASELINES:
        try:
            run = plan_and_simulate(layer_graph, cluster, policy, **allowed)
        except PlanError as err:
            rows.append(PolicyRow(policy, None, False, "-", str(err).split(";")[0][:90]))
            continue
        runs.append(run)
        rows.append(PolicyRow(policy, run.sim.step_time_s, run.fits, run.recompute))
    return runs, tuple(rows)


def search_and_compare(
    layer_graph: LayerGraph, cluster: Cluster, *, global_batch: int, **search_options: Any
) -> tuple[PlannedRun, Any]:
    """The plan search's best plan, with every baseline planned at the degrees it chose."""
    from vlmcompile.passes.plan_search import plan_search

    plan, search = plan_search(layer_graph, cluster, global_batch=global_batch, **search_options)
    par = plan.parallel["model"]
    options = dict(
        tp=par.tp, pp=par.pp, v=par.v, microbatch_size=plan.microbatch_size, global_batch=global_batch
    )
    _, rows = compare_baselines(layer_graph, cluster, **options)
    plan = dataclasses.replace(
        plan,
        decisions=(
            *plan.decisions,
            Decision(
                "parallel degrees",
                Reason.PLAN_SEARCH,
                f"{par}, microbatch {plan.microbatch_size}: fastest simulated of {len(search.candidates)} candidates",
            ),
        ),
    )
    sim = dataclasses.replace(search.sim, plan=plan)
    fits = max(sim.peak_mem_bytes) <= usable_memory_bytes(cluster.device.mem_bytes)
    return PlannedRun(plan, plan, sim, fits, f"per layer ({len(plan.recompute)})", rows), search
