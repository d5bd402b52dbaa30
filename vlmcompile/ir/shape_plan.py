"""Shapes known before a step: every value a stage sends, as a formula over the sizes of the
microbatch's inputs.

A graph captured with dynamic dimensions (packed microbatches whose image count varies) records
each value's shape over size symbols (``4*s44``, ``((16*s98)//s44)``). Reading the symbols off a
microbatch's inputs (:meth:`InputSizes.bind`) and putting them into a formula
(:meth:`ShapeFormula.evaluate`) gives the shape that value will have, on every rank, before any
rank runs: a receive never waits for a shape header of its own microbatch (the handshake per
message is where pipelines with variable shapes deadlock).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vlmcompile.ir.errors import PlanError


@functools.lru_cache(maxsize=4096)
def _parsed(expr: str):
    import sympy

    return sympy.sympify(expr)


@dataclass(frozen=True, slots=True)
class ShapeFormula:
    dims: tuple[int | str, ...]
    """Each dimension: a size, or a formula over size symbols (sympy syntax)."""

    @staticmethod
    def of(value: Any) -> ShapeFormula:
        """The formula of a captured value (a fake tensor, or a size: shape ``()``)."""
        if not isinstance(value, torch.Tensor):
            return ShapeFormula(())
        return ShapeFormula(tuple(_dim(d) for d in value.shape))

    @property
    def symbols(self) -> frozenset[str]:
        return frozenset(str(s) for d in self.dims if isinstance(d, str) for s in _parsed(d).free_symbols)

    def evaluate(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return _evaluated(self.dims, tuple(sorted(sizes.items())))


@functools.lru_cache(maxsize=4096)
def _evaluated(dims: tuple[int | str, ...], sizes: tuple[tuple[str, int], ...]) -> tuple[int, ...]:
    # Cached: every transfer of a step evaluates its formulas, at sizes a step repeats.
    out = []
    for d in dims:
        if isinstance(d, int):
            out.append(d)
            continue
        value = _parsed(d).subs(dict(sizes))
        if not value.is_Integer:
            raise PlanError(f"the shape formula {d} gives {value} for sizes {dict(sizes)}; report this")
        out.append(int(value))
    return tuple(out)


def _dim(d: Any) -> int | str:
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        return int(expr) if expr.is_number else str(expr)
    return int(d)


@dataclass(frozen=True, slots=True)
class InputSizes:
    """How the size symbols are read off a microbatch: each batch input's shape formula."""

    inputs: Mapping[str, ShapeFormula]

    @property
    def symbols(self) -> frozenset[str]:
        return frozenset().union(*(f.symbols for f in self.inputs.values()))

    def bind(self, microbatch: Mapping[str, Any]) -> dict[str, int]:
        """Symbol -> its size in ``microbatch``; a :class:`PlanError` names an input whose fixed
        dimensions differ from the compiled ones, or whose sizes contradict each other."""
        formulas = tuple((key, f.dims) for key, f in self.inputs.items())
        return dict(_bound(formulas, tuple(tuple(microbatch[key].shape) for key in self.inputs)))


@functools.lru_cache(maxsize=4096)
def _bound(
    formulas: tuple[tuple[str, tuple[int | str, ...]], ...], shapes: tuple[tuple[int, ...], ...]
) -> tuple[tuple[str, int], ...]:
    # Cached: sympy's solve takes milliseconds, and the training loop's batch check
    # (PipelineRunner.check_batch) and the step read the same microbatches' sizes.
    import sympy

    sizes: dict[str, int] = {}
    for (key, dims), shape in zip(formulas, shapes):
        if len(shape) != len(dims):
            raise PlanError(f"microbatch input {key!r} is {list(shape)}; the pipeline takes {len(dims)} dims")
        for k, (dim, size) in enumerate(zip(dims, shape)):
            if isinstance(dim, int):
                if dim != size:
                    raise PlanError(
                        f"microbatch input {key!r} is {list(shape)}: dimension {k} is fixed at {dim} in the "
                        "compiled pipeline (the token budget and the image size are fixed; images and patches vary)"
                    )
                continue
            expr = _parsed(dim).subs(sizes)
            free = sorted(expr.free_symbols, key=str)
            if not free:
                if int(expr) != size:
                    raise PlanError(
                        f"microbatch input {key!r} is {list(shape)}: dimension {k} should be {int(expr)} "
                        "from the other inputs' sizes (they describe the same images)"
                    )
                continue
            solved = sympy.solve(sympy.Eq(expr, size), free[0])
            if len(solved) != 1 or not solved[0].is_Integer or solved[0] < 0:
                raise PlanError(
                    f"microbatch input {key!r} is {list(shape)}: dimension {k} must be {dim} (a whole "
                    "number of the family's units), which no size gives"
                )
            sizes[str(free[0])] = int(solved[0])
    return tuple(sizes.items())
