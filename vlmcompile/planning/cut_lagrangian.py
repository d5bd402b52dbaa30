"""Lower bounds over every contiguous cut of layers into stages, by Lagrangian relaxation.

A plan cuts ``n`` layers, in order, into ``S`` non-empty stages and chooses each layer's
recompute. Its figures per stage k are linear in its layers: forward F_k, backward B_k (with the
recompute it does), DP reduction R_k, model states M_k and kept bytes K_k (recompute keeps less),
and the transfers of its cut. A *term* is a linear function of those per-stage figures, and a
:class:`CutTerms` is a set of terms in groups:

* ``max`` - the objective is at least the largest term of the group (the slowest rank);
* ``max0`` - it is at least the largest, or zero (the DP tail);
* ``within`` - a plan must keep every term at most zero (a rank's bytes under the cap).

For multipliers ``y`` (a ``max`` group's summing to 1, a ``max0`` group's to at most 1, the
``within`` group's any y >= 0) the objective is at least ``sum_j y_j term_j`` for every plan that
keeps its ``within`` terms: the sum is linear per stage, so its least over the cuts and
recompute choices is exact (each layer's recompute alone, then a dynamic program over the
stages), and every ``y`` gives a bound. :meth:`CutTerms.bound` improves ``y`` by subgradient
steps (quick; for the many candidates of a plan search), :meth:`CutTerms.best_bound` by Kelley's
cutting planes (an LP over the cuts seen so far, whose optimum bounds the best ``y`` from above,
so it stops at a known distance from the relaxation's best bound).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np
from ortools.linear_solver import pywraplp

STEPS = 120
"""Subgradient steps of each phase of :meth:`CutTerms.bound` (each gives a valid bound)."""
PATIENCE = 25
"""Steps without a better bound after which a phase of :meth:`CutTerms.bound` stops."""
PRICE_REACH = 0.05
"""How far above its best bound :meth:`CutTerms.bound` aims once the ``within`` prices move."""
KELLEY_STEPS = 150
"""Cutting planes of :meth:`CutTerms.best_bound` at most."""
KELLEY_GAP = 1e-4
""":meth:`CutTerms.best_bound` stops once its bound is within this share of the relaxation's best."""
PRICE_BOX = 100.0
"""The ``within`` multipliers' upper limit in :meth:`CutTerms.best_bound`, in units that make one
byte of a term weigh as much as one second of work (a cap no cut can keep has no finite bound)."""

FEATURES = ("fwd", "bwd", "reduce", "state", "keep")


@dataclass(frozen=True)
class CutLayers:
    """Per layer its figures (any units, one per figure); per cut its transfers."""

    fwd: np.ndarray
    bwd: np.ndarray
    """Without recompute."""
    redo: np.ndarray | None = None
    """The backward's extra time when the layer is recomputed (None: none is)."""
    reduce: np.ndarray | None = None
    state: np.ndarray | None = None
    keep: np.ndarray | None = None
    """Kept per microbatch in flight without recompute."""
    saved: np.ndarray | None = None
    """What recomputing saves of ``keep``."""
    sends: np.ndarray | None = None
    """[k][i]: the transfers of a cut right after layer i between stages k and k + 1."""

    def filled(self) -> CutLayers:
        zeros = np.zeros(len(self.fwd))
        return replace(
            self,
            **{f: zeros for f in ("redo", "reduce", "state", "keep", "saved") if getattr(self, f) is None},
        )


@dataclass(frozen=True)
class Term:
    """One linear term: per feature of :data:`FEATURES` a coefficient per stage, a constant, and
    the coefficient of the cuts' transfers."""

    group: str
    """``max``, ``max0`` or ``within`` (the module docstring)."""
    coefficients: dict[str, np.ndarray]
    constant: float = 0.0
    sends: float | np.ndarray = 0.0
    """The coefficient of the cuts' transfers: one for every cut, or one per cut."""


@dataclass(frozen=True)
class CutTerms:
    layers: CutLayers
    terms: tuple[Term, ...]
    num_stages: int
    rows: dict[str, np.ndarray] = field(init=False)
    """Per feature, the (terms x stages) coefficients."""

    def __post_init__(self):
        object.__setattr__(self, "layers", self.layers.filled())
        rows = {
            f: np.array([t.coefficients.get(f, np.zeros(self.num_stages)) for t in self.terms], dtype=float)
            for f in FEATURES
        }
        rows["sends"] = np.array(
            [
                np.broadcast_to(np.asarray(t.sends, dtype=float), (max(0, self.num_stages - 1),))
                for t in self.terms
            ]
        ).reshape(len(self.terms), max(0, self.num_stages - 1))
        object.__setattr__(self, "rows", rows)
        if len(self.layers.fwd) < self.num_stages:
            raise ValueError(f"{len(self.layers.fwd)} layers cannot fill {self.num_stages} stages")
        if not any(t.group == "max" for t in self.terms):
            raise ValueError("a bound needs at least one term of group 'max'")

    def scale(self, typical: float, held: float) -> np.ndarray:
        """Per term, what makes its units comparable to the others' in the multiplier steps: a
        ``within`` term's bytes weigh as much as ``typical`` of a ``max`` term's time when they
        are every layer's states and ``held`` microbatches of its kept bytes."""
        x = self.layers
        total_bytes = float(x.state.sum() + held * x.keep.sum())
        price = typical / total_bytes if total_bytes > 0 else 1.0
        return np.array([price if t.group == "within" else 1.0 for t in self.terms])

    @property
    def constants(self) -> np.ndarray:
        return np.array([t.constant for t in self.terms])

    def _group(self, name: str) -> np.ndarray:
        return np.array([t.group == name for t in self.terms])

    def start(self) -> np.ndarray:
        """The ``max`` group's multipliers even, the others zero."""
        top = self._group("max")
        return np.where(top, 1.0 / top.sum(), 0.0)

    # ---- the least over the cuts for given multipliers -----------------------------------
    def least(self, y: np.ndarray) -> tuple[float, np.ndarray]:
        """The least over cuts and recompute choices of ``sum_j y_j term_j``, and every term's
        value at that choice (a subgradient)."""
        x, n, num_stages = self.layers, len(self.layers.fwd), self.num_stages
        at = {f: y @ self.rows[f] for f in FEATURES}
        send_at = y @ self.rows["sends"]
        index = np.arange(n + 1)
        least = np.full(n + 1, np.inf)
        least[0] = 0.0  # least[i]: stages 0..k-1 over layers 0..i-1
        came_from = np.empty((num_stages, n + 1), dtype=np.int64)
        redone = []
        for k in range(num_stages):
            # recompute where the backward's extra time costs less than the bytes it saves
            again = at["bwd"][k] * x.redo - at["keep"][k] * x.saved < 0
            redone.append(again)
            each = (
                at["fwd"][k] * x.fwd
                + at["bwd"][k] * (x.bwd + np.where(again, x.redo, 0.0))
                + at["reduce"][k] * x.reduce
                + at["state"][k] * x.state
                + at["keep"][k] * (x.keep - np.where(again, x.saved, 0.0))
            )
            stage = np.concatenate(([0.0], np.cumsum(each)))
            h = least - stage
            running = np.minimum.accumulate(h)
            where = np.maximum.accumulate(np.where(h == running, index, 0))
            least = np.empty(n + 1)
            least[0] = np.inf
            least[1:] = running[:-1] + stage[1:]
            if x.sends is not None and k < num_stages - 1:
                least[1:] += send_at[k] * x.sends[k]
            came_from[k, 0] = 0
            came_from[k, 1:] = where[:-1]
        figures = {f: np.zeros(num_stages) for f in FEATURES}
        sends, end = np.zeros(max(0, num_stages - 1)), n
        for k in range(num_stages - 1, -1, -1):
            start = came_from[k, end]
            part, again = slice(start, end), redone[k][start:end]
            figures["fwd"][k] = x.fwd[part].sum()
            figures["bwd"][k] = x.bwd[part].sum() + x.redo[part][again].sum()
            figures["reduce"][k] = x.reduce[part].sum()
            figures["state"][k] = x.state[part].sum()
            figures["keep"][k] = x.keep[part].sum() - x.saved[part][again].sum()
            if x.sends is not None and k < num_stages - 1:
                sends[k] = x.sends[k][end - 1]
            end = start
        values = self.constants + self.rows["sends"] @ sends
        for f in FEATURES:
            values = values + self.rows[f] @ figures[f]
        return float(least[-1] + y @ self.constants), values

    # ---- the multipliers --------------------------------------------------------------------
    def bound(
        self, *, weights: bool = True, prices: bool, enough: float = math.inf, scale: np.ndarray | None = None
    ) -> float:
        """Subgradient steps: first (``weights``) the ``max`` and ``max0`` multipliers, then (``prices``) the
        ``within`` ones beside them; every step's value is a bound and the best is returned, early
        once it reaches ``enough``. ``scale`` (per term) makes the terms' units comparable."""
        scale = np.ones(len(self.terms)) if scale is None else scale
        within = self._group("within")
        y = self.start()
        phases = ("weights",) * (weights and bool((~within).sum() > 1)) + ("prices",) * (
            prices and bool(within.any())
        )
        if not phases:
            return self.least(y)[0]
        best = -math.inf
        for phase in phases:
            since = 0
            for step in range(STEPS):
                value, values = self.least(y)
                if value > best * (1 + 1e-9):
                    best, since = value, 0
                else:
                    since += 1
                if best >= enough or since >= PATIENCE:
                    break
                moving = ~within if phase == "weights" else np.ones(len(y), dtype=bool)
                direction = np.where(moving, values * scale, 0.0)
                top = self._group("max")
                direction[top] -= direction[top].mean()
                norm = float(direction @ direction)
                if norm <= 0:
                    break  # the best cut loads every term alike (and keeps the cap): nothing to move
                # Polyak's step towards a value above the best: the cut's largest term while only
                # the weights move (no weighting of this cut's terms exceeds it), a few percent
                # above the best once prices move (a cut over the cap may have smaller terms)
                largest = values[top].max()
                target = largest if phase == "weights" else max(largest, best * (1 + PRICE_REACH))
                size = max(target - value, 0.0) / norm / math.sqrt(step + 1)
                y = self._project(y + size * scale * direction)
            if best >= enough:
                break
        return best

    def _project(self, y: np.ndarray) -> np.ndarray:
        out = np.maximum(y, 0.0)
        top, zero_or = self._group("max"), self._group("max0")
        out[top] = _onto_simplex(y[top])
        if zero_or.any() and out[zero_or].sum() > 1:
            out[zero_or] = _onto_simplex(y[zero_or])
        return out

    def best_bound(
        self, *, scale: np.ndarray | None = None, enough: float = math.inf, seconds: float = math.inf
    ) -> float:
        """Kelley's cutting planes: the multipliers that maximise the least of ``sum_j y_j
        term_j`` over the cuts found so far (an LP, GLOP), then the cut those multipliers make
        cheapest; the LP's optimum never falls below the relaxation's best bound, so the loop stops
        within :data:`KELLEY_GAP` of it (or after :data:`KELLEY_STEPS` cuts, at ``enough``, or
        after ``seconds``: every step's value is a bound, the best so far is returned)."""
        started = time.perf_counter()
        scale = np.ones(len(self.terms)) if scale is None else scale
        lp = pywraplp.Solver.CreateSolver("GLOP")
        box = [PRICE_BOX if t.group == "within" else 1.0 for t in self.terms]
        mult = [lp.NumVar(0.0, b, f"y{j}") for j, b in enumerate(box)]  # y_j / scale_j
        level = lp.NumVar(-lp.infinity(), lp.infinity(), "level")
        for group, high in (("max", 1.0), ("max0", 1.0)):
            members = [mult[j] for j, t in enumerate(self.terms) if t.group == group]
            if members:
                total = lp.Constraint(1.0 if group == "max" else 0.0, high)
                for m in members:
                    total.SetCoefficient(m, 1.0)
        lp.Maximize(level)
        y, best, ref = self.start(), -math.inf, None
        for _ in range(KELLEY_STEPS):
            value, values = self.least(y)
            best = max(best, value)
            ref = ref or max(abs(value), 1e-30)
            if best >= enough or time.perf_counter() - started > seconds:
                break
            # level <= sum_j values_j y_j, in the LP's scaled units (built coefficient by
            # coefficient: the expression API takes seconds on thousands of memory terms)
            cut = lp.Constraint(-lp.infinity(), 0.0)
            cut.SetCoefficient(level, 1.0)
            for m, c in zip(mult, values * scale / ref):
                if c:
                    cut.SetCoefficient(m, -float(c))
            if lp.Solve() != pywraplp.Solver.OPTIMAL:
                break
            if level.solution_value() * ref <= best + KELLEY_GAP * abs(best):
                break
            y = np.array([m.solution_value() for m in mult]) * scale
        return best


def _onto_simplex(y: np.ndarray) -> np.ndarray:
    """The nearest point of {w >= 0, sum w = 1} to ``y`` (Euclidean projection)."""
    u = np.sort(y)[::-1]
    cumulative = np.cumsum(u) - 1.0
    k = np.nonzero(u * np.arange(1, len(y) + 1) > cumulative)[0][-1]
    return np.maximum(y - cumulative[k] / (k + 1), 0.0)
