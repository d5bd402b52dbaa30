"""Layers into stages: consecutive runs of a layer order, written as counts per stage, as each
layer's stage, or as the names per stage; and the balanced split of the Optimus appendix B."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vlmcompile.ir.errors import PlanError
from vlmcompile.planning.request import NotApplicable


def chunks_of(names: Sequence[str], counts: Sequence[int]) -> list[list[str]]:
    """``names`` cut into consecutive runs of ``counts[k]`` names."""
    if sum(counts) != len(names):
        raise PlanError(f"{sum(counts)} layers counted per stage for {len(names)} layers")
    bounds = np.cumsum([0, *counts])
    return [list(names[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def stage_of_counts(counts: Sequence[int]) -> tuple[int, ...]:
    """Each layer's stage, for consecutive runs of ``counts[k]`` layers."""
    return tuple(k for k, c in enumerate(counts) for _ in range(c))


def chunks_by_stage(names: Sequence[str], stage_of: Sequence[int], num_stages: int) -> list[list[str]]:
    """Names per stage, in order, from each name's stage index."""
    chunks: list[list[str]] = [[] for _ in range(num_stages)]
    for name, k in zip(names, stage_of):
        chunks[k].append(name)
    return chunks


def balanced_split(times: Sequence[float], num_stages: int) -> list[int]:
    """Layers per stage minimising the largest stage sum, and among the splits that do, the most
    even one (least sum of squared stage sums); every stage gets at least one layer.

    The dynamic program of the Optimus appendix B (after Alpa): with prefix sums T of the
    times, F(l, 1) = T(l) and F(l, k) = min_{j < l} max(F(j, k - 1), T(l) - T(j)). Its optimum
    is often shared by many splits (a ViT-22B + GPT-175B chain on 96 virtual stages: every
    optimum has two GPT-175B layers on its slowest stage), and the paper does not say which it
    takes. Whichever argmin a program records can leave the other stages, and with them the
    pipeline ranks' sums, far apart; a second program over the splits whose stages all fit
    under that optimum, G(l, k) = min_j G(j, k - 1) + (T(l) - T(j))^2, takes the most even.
    """
    n = len(times)
    if num_stages > n:
        raise NotApplicable(
            f"{num_stages} virtual stages for {n} layers; every stage needs a layer, so lower pp x v"
        )
    prefix = np.concatenate([[0.0], np.cumsum(times)])
    best = prefix[1:].copy()  # F(l, 1) for l = 1..n, indexed l - 1
    # [j, end]: the last stage is layers j + 1..end (the first stages end at layer j); only j < end
    last = np.where(_earlier(n), prefix[None, 1:] - prefix[1:, None], np.inf)
    for _ in range(1, num_stages):
        # F(j, k - 1) is infinite for j < k - 1 (too few layers), so every end < k stays infinite
        best = np.maximum(best[:, None], last).min(axis=0)
    # Relative slack: stage sums are float sums whose order of addition differs between splits.
    limit = best[n - 1] * (1 + 1e-9)
    return _most_even_split(prefix, num_stages, limit)


def _most_even_split(prefix: np.ndarray, num_stages: int, limit: float) -> list[int]:
    """Stage counts with every stage sum <= ``limit`` and the least sum of squared stage sums;
    ``prefix`` is the layers' prefix sums (layer l ends at prefix[l + 1])."""
    n = len(prefix) - 1
    cost = np.full((num_stages + 1, n + 1), np.inf)
    cost[0, 0] = 0.0
    choice = np.zeros((num_stages + 1, n + 1), dtype=np.int64)
    # [j, end]: a stage of layers j..end - 1, within the limit
    stage = prefix[None, :] - prefix[:, None]
    allowed = _earlier(n + 1) & (stage <= limit)
    squared = np.where(allowed, stage**2, np.inf)
    for k in range(1, num_stages + 1):  # the first end layers in k stages; too few stay infinite
        total = cost[k - 1][:, None] + squared
        choice[k] = total.argmin(axis=0)
        cost[k] = total.min(axis=0)
    counts = []
    end = n
    for k in range(num_stages, 0, -1):
        j = int(choice[k, end])
        counts.append(end - j)
        end = j
    return counts[::-1]


def _earlier(n: int) -> np.ndarray:
    """[j, end]: j < end."""
    return np.arange(n)[:, None] < np.arange(n)[None, :]
