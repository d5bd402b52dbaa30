"""Layers into stages: counts, stage indices and names per stage say the same cut; the balanced
split is the brute force's optimum, and the most even of its ties."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmcompile.ir.errors import PlanError
from vlmcompile.planning.chunks import balanced_split, chunks_by_stage, chunks_of, stage_of_counts
from vlmcompile.planning.request import NotApplicable


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_counts_stage_indices_and_names_per_stage_say_the_same_cut(counts):
    names = [f"l{i}" for i in range(sum(counts))]
    chunks = chunks_of(names, counts)
    assert [len(c) for c in chunks] == counts and [n for c in chunks for n in c] == names
    assert chunks_by_stage(names, stage_of_counts(counts), len(counts)) == chunks


def test_counts_that_do_not_add_up_are_refused():
    with pytest.raises(PlanError, match="5 layers counted per stage for 4 layers"):
        chunks_of(["a", "b", "c", "d"], [2, 3])
    with pytest.raises(NotApplicable, match="3 virtual stages for 2 layers"):
        balanced_split([1.0, 1.0], 3)


def _stage_sums(times, counts):
    bounds = [0, *itertools.accumulate(counts)]
    return [sum(times[a:b]) for a, b in zip(bounds, bounds[1:])]


def _brute_force(times, k):
    """(least slowest stage, least sum of squares among the splits within 1e-9 of it)."""
    splits = []
    for cuts in itertools.combinations(range(1, len(times)), k - 1):
        bounds = (0, *cuts, len(times))
        splits.append([sum(times[a:b]) for a, b in zip(bounds, bounds[1:])])
    best = min(max(s) for s in splits)
    return best, min(sum(x * x for x in s) for s in splits if max(s) <= best * (1 + 1e-9))


@settings(max_examples=80, deadline=None)
@given(
    times=st.lists(st.floats(0.01, 10.0, allow_nan=False), min_size=1, max_size=9)
    | st.lists(st.sampled_from([1.0, 0.25]), min_size=1, max_size=10),
    data=st.data(),
)
def test_balanced_split_matches_brute_force(times, data):
    # Times drawn from {1, 0.25} (decoder and encoder layers) make many splits share the optimum.
    k = data.draw(st.integers(1, len(times)))
    counts = balanced_split(times, k)
    assert len(counts) == k and sum(counts) == len(times) and min(counts) >= 1
    sums = _stage_sums(times, counts)
    worst, squares = _brute_force(times, k)
    assert max(sums) == pytest.approx(worst)
    assert sum(x * x for x in sums) == pytest.approx(squares)
