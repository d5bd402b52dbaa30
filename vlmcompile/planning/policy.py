"""A planning policy as data: :class:`Policy`, the record the registry
(:data:`vlmcompile.passes.planning.policies.POLICIES`) holds for every policy, and what the comparison,
the plan search, the CLI and the benchmarks read instead of lists of names of their own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vlmcompile.ir.plan import Plan
from vlmcompile.planning.result import PolicyResult

OPTIONS = ("recompute", "placement", "first_stage_layers", "last_stage_layers", "solver")
"""Every option a policy may take (besides the request): see
:func:`vlmcompile.passes.planning.policies.plan_and_simulate`."""


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    run: Callable[..., PolicyResult]
    """``run(layer_graph, cluster, request, **options) -> PolicyResult``."""
    summary: str
    """What it plans, in one line (the CLI's help)."""
    options: tuple[str, ...] = ()
    """The options of :data:`OPTIONS` it takes; any other is refused by name."""
    baseline: bool = False
    """A plan users get today from another system: planned beside ours at the same request."""
    global_recompute: bool = False
    """One recompute setting for the whole model; ``recompute="auto"`` takes the least that fits
    (what its users do). Otherwise the policy chooses recompute itself (per layer)."""
    variants: tuple[Mapping[str, Any], ...] = ({},)
    """Settings its users choose between (Megatron's encoder placements): a comparison plans each
    and keeps the fastest that fits."""
    plan_only: Callable[..., Plan] | None = None
    """``run`` without the simulation, for a global recompute policy: the least recompute that
    fits is then found by memory alone, and only the setting chosen is timed (by ``finish``)."""
    finish: Callable[..., PolicyResult] | None = None
    """``finish(layer_graph, cluster, plan, recompute, costs=None) -> PolicyResult``: a
    ``plan_only`` plan simulated (``costs``: its plan costs, made already), what ``run`` returns
    for the same arguments."""

    def __post_init__(self):
        unknown = [o for o in self.options if o not in OPTIONS]
        if unknown:
            raise ValueError(
                f"policy {self.name!r}: unknown options {unknown}; options are {', '.join(OPTIONS)}"
            )
        if self.plan_only is not None and not self.global_recompute:
            raise ValueError(
                f"policy {self.name!r}: plan_only serves a global recompute setting, which it has not"
            )
        if self.global_recompute and "recompute" not in self.options:
            raise ValueError(
                f"policy {self.name!r} has a global recompute setting but takes no recompute option"
            )
