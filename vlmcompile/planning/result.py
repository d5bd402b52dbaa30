"""What every planning policy returns: :class:`PolicyResult`, its plan simulated, with the
policy's report and, for ours, every baseline planned at the same request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tabulate import tabulate

from vlmcompile.ir.plan import Plan
from vlmcompile.sim.simulator import SimResult


@dataclass(frozen=True, slots=True)
class PolicyRow:
    """One policy's plan for the same request, as a comparison shows it."""

    policy: str
    step_s: float | None
    """Simulated; None when the policy could not plan."""
    fits: bool
    recompute: str
    note: str = ""


@dataclass(frozen=True, slots=True)
class Reports:
    """Several passes' reports behind one plan (the stage-cut search, then the encoder-in-bubbles
    pass that beat it), printed in order."""

    parts: tuple[Any, ...]

    def __str__(self) -> str:
        return "\n\n".join(str(p) for p in self.parts)


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyResult:
    """A policy's plan for one request, simulated."""

    plan: Plan
    sim: SimResult
    """The simulated step of :attr:`plan` (a prediction of the cost model)."""
    report: Any
    """The policy's own report (``str()`` prints it)."""
    recompute: str
    """The recompute used, in words: none, selective, full, full + vision, or "per layer (n)"."""
    baselines: tuple[PolicyRow, ...] = ()
    """Every baseline planned for the same request (our policy's comparison)."""

    @property
    def fits(self) -> bool:
        """Every rank's peak memory within the cap (device memory less the reserve)."""
        return self.sim.fits

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
