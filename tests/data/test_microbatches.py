"""Microbatches balanced per step: every kept sample once, within the token budget, the same
samples deferred as token packing defers, image rows evened over microbatches and replicas, and
the same answer on every rank (each assigns its step itself)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmcompile.data.microbatches import assign
from vlmcompile.data.packing import assign_rows
from vlmcompile.ir.errors import DataError

samples = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 12)), min_size=1, max_size=24)


@settings(max_examples=150, deadline=None)
@given(samples=samples, microbatches=st.sampled_from([2, 4, 6]), method=st.sampled_from(["greedy", "cp-sat"]))
def test_every_kept_sample_lands_once_within_the_budget(samples, microbatches, method):
    lengths, vision = [s[0] for s in samples], [s[1] for s in samples]
    made = assign(lengths, vision, microbatches, 48, replicas=2, method=method, time_limit_s=0.05)
    _, deferred = assign_rows(lengths, microbatches, 48)
    assert list(made.deferred) == deferred  # what is deferred does not change
    placed = sorted(i for row in made.rows for i in row)
    assert placed == sorted(set(range(len(samples))) - set(deferred))
    assert len(made.rows) == microbatches
    assert all(sum(lengths[i] for i in row) <= 48 for row in made.rows)
    if made.method == "cp-sat (optimal)":  # no assignment of the kept ones has a lighter heaviest
        by_tokens = assign(lengths, vision, microbatches, 48, method="tokens")
        assert max(made.image_rows(vision)) <= max(by_tokens.image_rows(vision))


def _step(seed: int, n: int = 48):
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(50, 600) for _ in range(n)]
    vision = [rng.choice([0, 0, 1, 2, 4, 9, 13]) for _ in range(n)]
    return lengths, vision


def test_image_rows_come_out_even_where_token_packing_leaves_them_where_they_fall():
    for seed in range(5):
        lengths, vision = _step(seed)
        budget, m = 2048, 12
        by_tokens = assign(lengths, vision, m, budget, replicas=2, method="tokens")
        greedy = assign(lengths, vision, m, budget, replicas=2, method="greedy")
        solved = assign(lengths, vision, m, budget, replicas=2, method="cp-sat", time_limit_s=0.2)
        mean = sum(vision) / m
        assert max(greedy.image_rows(vision)) < max(by_tokens.image_rows(vision))
        assert max(solved.image_rows(vision)) <= max(greedy.image_rows(vision))
        assert max(greedy.image_rows(vision)) <= 1.25 * mean + max(vision)
        halves = [sum(greedy.image_rows(vision)[d * 6 : (d + 1) * 6]) for d in range(2)]
        assert abs(halves[0] - halves[1]) <= max(vision)  # the replicas' encoders even too


def test_every_rank_gets_the_same_assignment():
    lengths, vision = _step(7, 64)
    runs = {
        assign(lengths, vision, 16, 2048, replicas=2, method="cp-sat", time_limit_s=0.1).rows
        for _ in range(3)
    }
    assert len(runs) == 1


def test_carried_samples_are_kept_before_the_step_s_own():
    lengths, vision = [30, 30, 30, 30], [5, 0, 5, 0]
    made = assign(lengths, vision, 2, 60, first=2, method="greedy")
    assert set(made.deferred) == set() and sorted(i for r in made.rows for i in r) == [0, 1, 2, 3]
    made = assign([50, 50, 50], [1, 1, 1], 2, 60, first=1, method="greedy")
    assert 0 not in made.deferred and len(made.deferred) == 1


def test_bad_requests_are_refused():
    with pytest.raises(DataError, match="unknown microbatch assignment 'lpt'"):
        assign([1], [1], 1, 8, method="lpt")
    with pytest.raises(DataError, match="2 sample lengths but 1 image row counts"):
        assign([1, 2], [1], 1, 8)
    with pytest.raises(DataError, match="3 microbatches do not split over 2 replicas"):
        assign([1], [1], 3, 8, replicas=2)
