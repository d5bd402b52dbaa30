"""Lagrangian bounds over contiguous cuts against exhaustive search on small problems."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmcompile.planning.cut_lagrangian import KELLEY_GAP, CutLayers, CutTerms, Term


def _value(term: Term, figures: dict, sends) -> float:
    return (
        term.constant
        + float(np.sum(np.asarray(term.sends) * sends))
        + sum(term.coefficients[f] @ x for f, x in figures.items() if f in term.coefficients)
    )


def exhaustive(cut: CutTerms) -> float:
    """The least, over every cut and recompute choice whose ``within`` terms are <= 0, of the
    largest ``max`` term (and the ``max0`` terms and zero)."""
    x, S = cut.layers, cut.num_stages
    n = len(x.fwd)
    best = math.inf
    for bounds in itertools.combinations(range(1, n), S - 1):
        edges = (0, *bounds, n)
        for again in itertools.product([False, True], repeat=n):
            again = np.array(again)
            parts = [slice(edges[k], edges[k + 1]) for k in range(S)]
            figures = {
                "fwd": np.array([x.fwd[p].sum() for p in parts]),
                "bwd": np.array([x.bwd[p].sum() + x.redo[p][again[p]].sum() for p in parts]),
                "reduce": np.array([x.reduce[p].sum() for p in parts]),
                "state": np.array([x.state[p].sum() for p in parts]),
                "keep": np.array([x.keep[p].sum() - x.saved[p][again[p]].sum() for p in parts]),
            }
            sends = (
                np.array([x.sends[k][edges[k + 1] - 1] for k in range(S - 1)]) if x.sends is not None else 0.0
            )
            values = [(t.group, _value(t, figures, sends)) for t in cut.terms]
            if any(v > 1e-9 for group, v in values if group == "within"):
                continue
            top = max(v for group, v in values if group == "max")
            tail = max([0.0, *(v for group, v in values if group == "max0")])
            best = min(best, top + tail)
    return best


@st.composite
def cut_problems(draw):
    p = draw(st.sampled_from([1, 2, 3]))
    v = draw(st.sampled_from([1, 2])) if p < 3 else 1
    S = p * v
    n = draw(st.integers(S, min(S + 4, 7)))
    ints = st.integers(1, 20)
    fwd = np.array([draw(ints) for _ in range(n)], dtype=float)
    keep = np.array([draw(st.integers(5, 50)) for _ in range(n)], dtype=float)
    layers = CutLayers(
        fwd=fwd,
        bwd=2 * fwd,
        redo=fwd,
        reduce=np.array([draw(st.integers(0, 10)) for _ in range(n)], dtype=float),
        state=np.array([draw(st.integers(0, 30)) for _ in range(n)], dtype=float),
        keep=keep,
        saved=np.floor(keep * draw(st.floats(0, 0.9))),
        sends=np.array([[draw(st.integers(0, 3)) for _ in range(n)] for _ in range(S - 1)], dtype=float)
        if S > 1
        else None,
    )
    ranks = np.arange(S) % p
    m = draw(st.integers(1, 4))
    # the cuts' transfers in every rank's term, or (as the timeline's) in the terms of the ranks after them
    per_cut = draw(st.booleans())
    terms = [
        Term(
            "max",
            {"fwd": m * (ranks == r) + 1.0, "bwd": m * (ranks == r) + 1.0},
            sends=1.0 * (np.arange(S - 1) < r) if per_cut else 1.0,
        )
        for r in range(p)
    ]
    if draw(st.booleans()):  # a DP tail: a rank's reduction less the backwards before it
        terms += [
            Term("max0", {"reduce": 1.0 * (ranks == r), "bwd": -1.0 * (np.arange(S) <= r)}) for r in range(p)
        ]
    if draw(st.booleans()):  # a cap on every rank's states and m microbatches' kept bytes
        whole = layers.state.sum() + m * keep.sum()
        cap = whole / p * draw(st.floats(0.5, 1.5))
        terms += [
            Term("within", {"state": 1.0 * (ranks == r), "keep": m * (ranks == r)}, constant=-cap)
            for r in range(p)
        ]
    return CutTerms(layers, tuple(terms), S)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut_problems())
def test_both_bounds_hold_and_the_cutting_planes_reach_the_subgradient_steps(cut):
    least = exhaustive(cut)
    within = any(t.group == "within" for t in cut.terms)
    quick = cut.bound(prices=within)
    best = cut.best_bound()
    if math.isinf(least):
        return  # nothing keeps the cap: any bound holds
    assert quick <= least * (1 + 1e-9) + 1e-9
    assert best <= least * (1 + 1e-9) + 1e-9
    assert best >= quick - KELLEY_GAP * abs(quick) - 1e-6


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut_problems())
def test_cutting_planes_out_of_time_return_the_best_bound_so_far(cut):
    """With no time, the loop stops after its first point, whose least is a bound already."""
    hurried = cut.best_bound(seconds=0.0)
    assert hurried == cut.least(cut.start())[0]
    assert hurried <= cut.best_bound() + 1e-9 * abs(hurried)
    least = exhaustive(cut)
    if not math.isinf(least):
        assert hurried <= least * (1 + 1e-9) + 1e-9
