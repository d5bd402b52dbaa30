"""What every planning policy returns: :class:`PolicyResult`, its plan simulated, with the
policy's report and, for ours, every baseline planned at the same request.

The result owns the plan: the simulation and the reports hold no copy of it (a report says what
its pass did; ``str(result)`` prints the plan with it), and a decision is added to a result with
:meth:`PolicyResult.with_decisions`, never to a plan held elsewhere."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from tabulate import tabulate

from vlmcompile.ir.plan import Decision, Plan
from vlmcompile.sim.simulator import SimResult
from vlmcompile.sim.units import column_decimals, format_ms

ReportT = TypeVar("ReportT")

NOTE_WIDTH = 80
"""Characters per line of a comparison's note column: a longer note wraps, it is never cut."""


@dataclass(frozen=True, slots=True)
class PolicyRow:
    """One policy's plan for the same request, as a comparison shows it."""

    policy: str
    step_s: float | None
    """Simulated; None when the policy could not plan."""
    fits: bool
    recompute: str
    note: str = ""
    """Which variant ran (Megatron's placement), or, where it has no plan, why (in full)."""
    applies: bool = True
    """False: the policy cannot express the request at all (e.g. MIMO's colocated layout at PP > 1;
    :class:`~vlmcompile.planning.request.NotApplicable`); its row says "n/a", not "does not fit"."""
    same_as_ours: bool = False
    """The policy's plan is ours (:meth:`Plan.same_layout`): our policy found nothing better."""

    def __post_init__(self):
        if not self.applies and (self.step_s is not None or self.fits):
            raise ValueError(
                f"policy {self.policy!r} does not apply to the request, yet has step_s={self.step_s!r} and "
                f"fits={self.fits!r}; a policy that does not apply has no plan"
            )

    @property
    def fits_text(self) -> str:
        return "n/a" if not self.applies else "yes" if self.fits else "no"


@dataclass(frozen=True, slots=True)
class Reports:
    """Several passes' reports behind one plan (the stage-cut search, then the encoder-in-bubbles
    pass that beat it), printed in order. Each says what its pass did; the plan is the result's."""

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
    """The policy's own report (``str()`` prints it), or :class:`Reports`; none holds the plan."""
    recompute: str
    """The recompute used, in words: none, selective, full, full + vision, or "per layer (n)"."""
    baselines: tuple[PolicyRow, ...] = ()
    """Every baseline planned for the same request (our policy's comparison)."""

    @property
    def fits(self) -> bool:
        """Every rank's peak memory within the cap (device memory less the reserve)."""
        return self.sim.fits

    def with_decisions(self, *decisions: Decision, report: Any = None) -> PolicyResult:
        """This result with ``decisions`` added to its plan (and ``report`` in place of its report,
        if given): the one way a decision joins a plan after a policy made it."""
        plan = dataclasses.replace(self.plan, decisions=(*self.plan.decisions, *decisions))
        return dataclasses.replace(self, plan=plan, report=self.report if report is None else report)

    def report_part(self, kind: type[ReportT]) -> ReportT | None:
        """The report of type ``kind`` behind this plan (the report itself, or one of its
        :class:`Reports`' parts), or None."""
        parts = self.report.parts if isinstance(self.report, Reports) else (self.report,)
        return next((p for p in parts if isinstance(p, kind)), None)

    def comparison_table(self) -> str:
        rows = [*self.baselines, PolicyRow(self.plan.policy, self.sim.step_time_s, self.fits, self.recompute)]
        ours = self.sim.step_time_s
        decimals = column_decimals(r.step_s for r in rows)
        lines = [
            [
                r.policy,
                format_ms(r.step_s, decimals=decimals),
                f"{r.step_s / ours:.3f}" if r.step_s is not None else "-",
                r.recompute,
                r.fits_text,
                "; ".join(x for x in ("the same plan as ours" if r.same_as_ours else "", r.note) if x),
            ]
            for r in rows
        ]
        return tabulate(
            lines,
            headers=["policy", "simulated step ms", "vs ours", "recompute", "fits", "note"],
            disable_numparse=True,
            maxcolwidths=[None, None, None, None, None, NOTE_WIDTH],
        )

    def __str__(self) -> str:
        parts = [str(self.report), "", str(self.plan), "", str(self.sim)]
        if self.baselines:
            parts += [
                "",
                "policies at the same degrees (simulated: predictions of the cost model):",
                self.comparison_table(),
            ]
            same = [r.policy for r in self.baselines if r.same_as_ours]
            if same:
                parts.append(
                    f"our plan is {' and '.join(same)}'s plan: the same stages, layers, recompute and degrees "
                    "(our search found none faster)"
                )
        return "\n".join(parts)
