"""Lower bounds on the step of every plan a plan-search candidate (its degrees) can reach.

A candidate is a pipeline of ``p`` ranks, ``v`` virtual stages per rank and ``m`` microbatches.
Whatever its cuts, recompute flags and (for an encoder-in-bubbles plan) encoder schedule, the
step the simulator gives it (:mod:`vlmcompile.sim.timeline` and :mod:`vlmcompile.sim.dp`'s rules)
is at least each of these terms, so it is at least their largest:

* **work over ranks** - a rank computes one action at a time, so some rank runs at least the
  mean: ``m x sum(F + B) / p`` over the layers;
* **pipeline** - rank r's first action is a forward of its first stage (stage r), which waits for
  microbatch 0's forwards through stages 0..r-1 (and stage 0's first forward waits for layer 0's
  parameters, ``g0``); rank r then computes ``m x W_r``; its last action is a backward, after which
  that microbatch's backwards of stages r-1..0 still run (schedules with the whole backward in
  one action; zero-bubble's split backward may run them earlier, so there the drain is left out).
  Rank 0's last backward is of stage 0, the step's last compute: layer 0's gradient reduction
  (``r0``) comes after it. So for every rank ``T >= g0 + F_<r + m W_r + B_<r (+ r0 for rank 0)``;
  with one stage per rank the least such ``T`` over all contiguous cuts is found exactly (a rank
  takes as many layers as fit, which is optimal: moving a layer up to an earlier rank lowers
  the later rank's term, ``m >= 1``); with v > 1 stages 0..r-1 hold at least layers 0..r-1
  and the ranks' loads are relaxed to any split of the work (water-filling);
* **heaviest layer** - the rank holding it computes it m times (v > 1; the exact cut covers it
  at v = 1);
* **recompute to fit** - for the plans that fit a memory cap: the work over ranks with the least
  recompute that brings the layers' kept bytes within what the cap leaves
  (:func:`least_recompute_s`).

For encoder-in-bubbles plans (the encoders on a plan of their own, their work in the LLM's
idle time) the same terms hold for the LLM's layers alone, and the work term counts the
encoder's compute at its cheapest TP (every rank's compute, wherever it is scheduled, is
compute: it cannot hide in another action's compute, only in the LLM's TP collectives).

Transfers, recompute and the collectives' queueing only add, so they are left out.

:func:`least_peak_bytes` bounds the other way a candidate fails: the least memory its fullest
rank needs over every cut, with every layer kept as small as recompute makes it. With one stage
per rank, rank r holds its stage's model states and, at its fullest, the most microbatches the
schedule keeps in flight on it times the bytes each keeps; the least such maximum over
contiguous cuts is found exactly as the pipeline term is. With v > 1 rank r holds, at one
moment of its schedule, k_r microbatches on every one of its stages (1F1B interleaved: p on the
first ranks, 1 on the last), so its peak is at least its states plus k_r times its layers' keep
bytes; the fullest rank is at least the mean of those weighted by 1 / k_r, which no cut moves
below (states / max k + keep) / sum(1 / k). The same inequality, with the cap in place of the
peak, says how much recompute a plan that fits must save.

The property tests check every term against exhaustive search on small problems.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vlmcompile.planning.cut_lagrangian import CutLayers, CutTerms, Term

BISECTION_STEPS = 40
"""Halvings of the bisected terms' intervals: the width ends near 1e-12 of the value."""


@dataclass(frozen=True, slots=True)
class BoundLayer:
    """One layer's figures on one rank for one microbatch (seconds)."""

    fwd_s: float
    """Forward, TP collectives included."""
    bwd_s: float
    """Whole backward without recompute, TP collectives included."""
    gather_s: float = 0.0
    """DP all-gather of its parameters before its first forward."""
    reduce_s: float = 0.0
    """DP reduction of its gradients after its last backward (0: frozen)."""

    @property
    def work_s(self) -> float:
        return self.fwd_s + self.bwd_s


@dataclass(frozen=True, slots=True)
class MemoryLayer:
    """One layer's bytes on one rank."""

    state_bytes: float
    """Parameters, gradients and optimizer states."""
    keep_bytes: float
    """Kept per microbatch in flight, at its least (recomputed where that keeps less)."""
    whole_keep_bytes: float | None = None
    """Kept per microbatch in flight without recompute (None: ``keep_bytes``, nothing to save)."""
    recompute_s: float = 0.0
    """The compute one microbatch's backward adds to keep ``keep_bytes`` instead."""

    @property
    def saved_bytes(self) -> float:
        """What recomputing the layer saves per microbatch in flight."""
        return 0.0 if self.whole_keep_bytes is None else max(0.0, self.whole_keep_bytes - self.keep_bytes)


@dataclass(frozen=True, slots=True)
class StepBound:
    """A lower bound on a candidate's step and the terms it is the largest of."""

    terms: tuple[tuple[str, float], ...]
    """(name, seconds) of every term, in the module docstring's words."""

    @property
    def step_s(self) -> float:
        return max(s for _, s in self.terms)

    @property
    def binding(self) -> str:
        """The term the bound is."""
        return max(self.terms, key=lambda t: t[1])[0]

    def __str__(self) -> str:
        return ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in self.terms)


def chain_bound(
    layers: Sequence[BoundLayer],
    *,
    p: int,
    v: int,
    m: int,
    split_backward: bool = False,
    recompute_s: float = 0.0,
) -> StepBound:
    """The bound on every plan that cuts ``layers`` (in order) into ``p x v`` stages, one chain.

    Args:
        recompute_s: the least recompute per microbatch a plan must do to fit its memory
            (:func:`least_recompute_s`): with it, the bound holds for the plans that fit.
    """
    _check(layers, p, v, m)
    work = sum(x.work_s for x in layers)
    terms = [("work over ranks", m * work / p), ("pipeline", _pipeline_s(layers, p, v, m, split_backward))]
    if recompute_s > 0:
        terms.append(("recompute to fit", m * (work + recompute_s) / p))
    if v > 1:
        terms.append(("heaviest layer", layers[0].gather_s + m * max(x.work_s for x in layers)))
    return StepBound(tuple(terms))


def bubbles_bound(
    llm_layers: Sequence[BoundLayer],
    llm_compute_s: float,
    encoder_compute_s: float,
    *,
    p: int,
    v: int,
    m: int,
    split_backward: bool = False,
) -> StepBound:
    """The bound on every encoder-in-bubbles plan: the LLM's own chain (:func:`chain_bound` of its
    layers), and its compute with the encoders' over the ranks.

    Args:
        llm_compute_s: one microbatch's LLM forward and backward on one rank, without TP collectives.
        encoder_compute_s: the least one microbatch's encoder compute takes per rank over the
            encoder plans (forward, and backward where it trains), without TP collectives.
    """
    llm = chain_bound(llm_layers, p=p, v=v, m=m, split_backward=split_backward)
    with_encoders = ("compute with the encoders", m * (llm_compute_s + encoder_compute_s) / p)
    return StepBound(tuple((f"LLM {name}", s) for name, s in llm.terms) + (with_encoders,))


def _check(layers: Sequence[BoundLayer], p: int, v: int, m: int) -> None:
    if not layers:
        raise ValueError("a step bound needs at least one layer")
    for name, value in (("p", p), ("v", v), ("m", m)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; give an integer >= 1")


def _rank_offsets(layers: Sequence[BoundLayer], p: int, split_backward: bool) -> list[float]:
    """Per rank, the least time before its work and after it that no cut avoids (v > 1: the first
    r layers stand for stages 0..r-1)."""
    head = layers[0].gather_s
    out, before = [], 0.0
    for r in range(p):
        tail = layers[0].reduce_s if r == 0 and not split_backward else 0.0
        out.append(head + before + tail)
        if r < len(layers):
            x = layers[r]
            before += x.fwd_s if split_backward else x.work_s
    return out


def _pipeline_s(layers: Sequence[BoundLayer], p: int, v: int, m: int, split_backward: bool) -> float:
    if v > 1:
        return _water_level(_rank_offsets(layers, p, split_backward), m * sum(x.work_s for x in layers))
    work = list(itertools.accumulate((x.work_s for x in layers), initial=0.0))
    before = list(
        itertools.accumulate((x.fwd_s if split_backward else x.work_s for x in layers), initial=0.0)
    )
    head, tail = layers[0].gather_s, 0.0 if split_backward else layers[0].reduce_s
    low = max(m * work[-1] / p, head)
    high = head + tail + m * work[-1]
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (low + high)
        if _cut_fits(work, before, head, tail, p, m, mid):
            high = mid
        else:
            low = mid
    return low  # the least feasible T is above it (or it is the start, itself a bound)


def _cut_fits(
    work: Sequence[float], before: Sequence[float], head: float, tail: float, p: int, m: int, step_s: float
) -> bool:
    """Whether some cut into at most ``p`` consecutive stages keeps every rank's pipeline term
    within ``step_s``, each rank taking as many layers as fit (``work`` and ``before``: prefix
    sums of the layers' work and of what a later rank waits for)."""
    num_layers, i = len(work) - 1, 0
    for r in range(p):
        room = (step_s - head - before[i] - (tail if r == 0 else 0.0)) / m
        # the last layer j with work[j] - work[i] <= room
        j = bisect.bisect_right(work, work[i] + room, lo=i) - 1
        if j >= num_layers:
            return True
        if j <= i:
            return False  # not even one layer fits this rank; later ranks have no more room
        i = j
    return False


def _water_level(offsets: Sequence[float], total: float) -> float:
    """The least T with sum over ranks of max(0, T - offset) >= total: the ranks' loads relaxed to
    any split of ``total`` (already times m), each rank's term its offset plus its load."""
    ordered = sorted(offsets)
    below = 0.0
    for k, offset in enumerate(ordered):
        below += offset
        level = (total + below) / (k + 1)
        if k + 1 == len(ordered) or level <= ordered[k + 1]:
            return level
    raise AssertionError("unreachable: the last rank returns")


def least_peak_bytes(layers: Sequence[MemoryLayer], in_flight: Sequence[int], *, p: int, v: int) -> float:
    """A lower bound on the fullest rank's peak over every cut of ``layers`` into ``p x v`` stages
    and every recompute choice (the module docstring).

    Args:
        in_flight: per rank, the most microbatches every one of its stages holds at one moment of
            the schedule (:func:`~vlmcompile.sim.in_flight.held_together`; one stage per rank: the
            most it keeps in flight).
    """
    if len(in_flight) != p:
        raise ValueError(f"{len(in_flight)} in-flight counts for p = {p} ranks")
    if v > 1:
        return _weighted_peak_bytes(
            sum(x.state_bytes for x in layers), sum(x.keep_bytes for x in layers), in_flight
        )
    states = sum(x.state_bytes for x in layers)
    state = list(itertools.accumulate((x.state_bytes for x in layers), initial=0.0))
    keep = list(itertools.accumulate((x.keep_bytes for x in layers), initial=0.0))
    low, high = states / p, states + max(in_flight) * keep[-1]
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (low + high)
        if _fits_under(state, keep, in_flight, mid):
            high = mid
        else:
            low = mid
    return low


def _fits_under(state: Sequence[float], keep: Sequence[float], in_flight: Sequence[int], cap: float) -> bool:
    """Whether consecutive layers fill the stages (one per rank, in order) with no rank over
    ``cap``, each taking as many as fit (``state``, ``keep``: prefix sums of the layers' bytes)."""
    num_layers, i = len(state) - 1, 0
    for held in in_flight:
        base = state[i] + held * keep[i]
        # the last layer j whose bytes from i on fit: monotone in j, so bisected
        i += (
            bisect.bisect_right(range(i, num_layers + 1), cap, key=lambda j: state[j] + held * keep[j] - base)
            - 1
        )
        if i >= num_layers:
            return True
    return False


def _weighted_peak_bytes(states: float, keep: float, in_flight: Sequence[int]) -> float:
    """A lower bound on the fullest rank's peak, whatever the cut: rank r holds its states and
    k_r x its layers' keep bytes at once, and the largest of those is at least their mean
    weighted by 1 / k_r, which is at least (states / max k + keep) / sum(1 / k)."""
    held = [max(1, k) for k in in_flight]
    return (states / max(held) + keep) / sum(1.0 / k for k in held)


def least_recompute_s(layers: Sequence[MemoryLayer], in_flight: Sequence[int], cap_bytes: float) -> float:
    """The least recompute compute per microbatch (summed over the layers) any plan must add to
    keep its fullest rank within ``cap_bytes`` (``in_flight`` as :func:`least_peak_bytes` takes it;
    inf: no recompute fits).

    A plan fits only if its layers' keep bytes K satisfy (states / max k + K) / sum(1 / k) <=
    cap (:func:`_weighted_peak_bytes`), so recompute must save what keeping every layer whole
    puts over that; the cheapest compute per byte saved first, fractionally (a relaxation of
    choosing whole layers, so a lower bound).
    """
    held = [max(1, k) for k in in_flight]
    room = cap_bytes * sum(1.0 / k for k in held) - sum(x.state_bytes for x in layers) / max(held)
    whole = sum(x.keep_bytes + x.saved_bytes for x in layers)
    short = whole - room
    if short <= 0:
        return 0.0
    extra = 0.0
    savers = sorted((x for x in layers if x.saved_bytes > 0), key=lambda x: x.recompute_s / x.saved_bytes)
    for x in savers:
        take = min(1.0, short / x.saved_bytes)
        extra += take * x.recompute_s
        short -= take * x.saved_bytes
        if short <= 0:
            return extra
    return math.inf


def stage_cut_s(
    layers: Sequence[BoundLayer],
    *,
    p: int,
    v: int,
    m: int,
    split_backward: bool = False,
    memory: StageMemory | None = None,
    enough_s: float = math.inf,
) -> float:
    """The pipeline term over whole layers, and with ``memory`` over the plans that fit: a lower
    bound on every plan that cuts ``layers`` into ``p x v`` non-empty stages, stage k on rank
    k mod p, with any recompute. Tighter than :func:`chain_bound` where few layers fall to a stage
    (the cut cannot even the ranks out) or the cap forces recompute on the fullest ranks.

    Every rank r has ``T >= a_r + m x load_r`` (``a_r``: :func:`_rank_offsets`; its load with the
    recompute it does) and, for a plan that fits, ``mem_r <= cap`` at the moment
    :class:`StageMemory` counts; :class:`~vlmcompile.planning.cut_lagrangian.CutTerms` relaxes
    those terms. Returns early once
    the bound reaches ``enough_s`` (the incumbent: the candidate is pruned).
    """
    _check(layers, p, v, m)
    num_stages = p * v
    if num_stages > len(layers):
        raise ValueError(f"{len(layers)} layers cannot fill p x v = {num_stages} stages")
    layers_, offsets = _cut_layers(layers, memory), _rank_offsets(layers, p, split_backward)
    ranks = np.arange(num_stages) % p
    terms = [
        Term("max", {"fwd": m * (ranks == r), "bwd": m * (ranks == r)}, constant=offsets[r]) for r in range(p)
    ]
    if memory is not None:
        held = np.asarray(memory.held, dtype=float)
        if len(held) != num_stages:
            raise ValueError(
                f"memory: {len(held)} in-flight counts for {num_stages} stages; give one per stage"
            )
        terms += [
            Term(
                "within",
                {"state": 1.0 * (ranks == r), "keep": held * (ranks == r)},
                constant=-memory.cap_bytes,
            )
            for r in range(p)
        ]
    cut = CutTerms(layers_, tuple(terms), num_stages)
    # With one stage per rank the weights alone cannot beat chain_bound's exact pipeline term.
    if memory is None:
        return cut.bound(weights=v > 1, prices=False, enough=enough_s)
    # a rank's bytes weighed as much as its share of the work (the subgradient steps)
    scale = cut.scale(m * float(layers_.fwd.sum() + layers_.bwd.sum()) / p, max(memory.held))
    return cut.bound(weights=v > 1, prices=True, enough=enough_s, scale=scale)


@dataclass(frozen=True, slots=True)
class StageMemory:
    """What :func:`stage_cut_s` needs of the layers' memory: their bytes, the cap, and per stage
    the microbatches it holds at one moment of its rank's schedule (the same moment for every
    stage of a rank)."""

    layers: tuple[MemoryLayer, ...]
    held: tuple[int, ...]
    cap_bytes: float


def _cut_layers(layers: Sequence[BoundLayer], memory: StageMemory | None) -> CutLayers:
    fwd, bwd = np.array([x.fwd_s for x in layers]), np.array([x.bwd_s for x in layers])
    if memory is None:
        return CutLayers(fwd, bwd)
    if len(memory.layers) != len(layers):
        raise ValueError("memory: one MemoryLayer per layer")
    saved = np.array([x.saved_bytes for x in memory.layers])
    return CutLayers(
        fwd,
        bwd,
        redo=np.array([x.recompute_s for x in memory.layers]),
        state=np.array([x.state_bytes for x in memory.layers]),
        keep=np.array([x.keep_bytes for x in memory.layers]) + saved,
        saved=saved,
    )
