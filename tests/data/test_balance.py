"""OmniBal's ISF: groups near both targets, every sample once an epoch, leftovers leading the next
epoch, the measures as the paper defines them, and sizes read without building samples."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmcompile.data.balance import (
    IsfBatchSampler,
    IsfTargets,
    IsfWarning,
    SampleSizes,
    isf_epoch,
    measure,
)
from vlmcompile.data.families import PatchStreamFamily, TileFamily
from vlmcompile.data.packing import sample_length
from vlmcompile.data.synthetic import SyntheticDataset
from vlmcompile.ir.errors import ArgumentError, DataError

INTERNVL = TileFamily("internvl", image_token_id=100, side=28, channels=3, tokens_per_tile=4, max_tiles=12)
QWEN = PatchStreamFamily("qwen2-vl", 100, 102, 103, 14, 2, 2, 3, min_pixels=784, max_pixels=1003520)


def _sizes(seed=0, count=2000):
    data = SyntheticDataset(
        "internvl-tiles", INTERNVL, count, seed=seed, text_scale=1 / 8, pixel_scale=28 / 448
    )
    return SampleSizes.of(data, INTERNVL, log=None)


def test_targets_follow_the_datasets_statistics():
    sizes = _sizes()
    targets = IsfTargets.from_statistics(sizes)
    assert targets.text == sizes.llm_tokens.max()
    ratio = sizes.vision_rows.sum() / sizes.llm_tokens.sum()
    assert targets.vision == round(targets.text * ratio) == targets.vision_floor
    assert targets.text - targets.text_floor == -(-targets.text // 32)  # OmniBal's 128 of 4K
    with pytest.raises(DataError, match="the dataset is empty"):
        IsfTargets.from_statistics(SampleSizes(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)))


def test_an_epoch_holds_every_sample_once_and_balanced_groups_meet_the_targets():
    sizes = _sizes()
    targets = IsfTargets.from_statistics(sizes)
    epoch = isf_epoch(sizes, targets, seed=3)
    seen = sorted(i for b in epoch.batches for i in b)
    assert seen == list(range(len(sizes)))
    for batch in epoch.batches[: epoch.balanced]:
        tokens, rows = sizes.llm_tokens[list(batch)].sum(), sizes.vision_rows[list(batch)].sum()
        assert rows >= targets.vision_floor or tokens >= targets.text_floor
        assert len(batch) == 1 or (rows <= targets.vision and tokens <= targets.text)
    assert epoch.balanced_share > 0.6  # measured: 77 % of the samples in 8 rounds


def test_isf_balances_better_than_random_batches_of_the_same_mean_size():
    sizes = _sizes()
    epoch = isf_epoch(sizes, IsfTargets.from_statistics(sizes), seed=3)
    balanced = measure(epoch.batches[: epoch.balanced], sizes, dp=8)
    size = max(1, round(balanced.samples_per_batch))
    order = np.random.default_rng(0).permutation(len(sizes))
    random = measure([order[k : k + size] for k in range(0, len(order), size)], sizes, dp=8)
    assert balanced.dist_ratio_llm < random.dist_ratio_llm
    assert balanced.dist_ratio_vision < random.dist_ratio_vision


def test_the_measures_are_omnibals():
    sizes = SampleSizes(np.array([4, 2, 3, 3]), np.array([1, 0, 2, 2]))
    got = measure([[0, 1], [2, 3]], sizes, dp=2)
    assert got.pad_ratio_llm == pytest.approx((2 / 8 + 0) / 2)  # (4-2) / (4 * 2), then nothing
    assert got.pad_ratio_vision == pytest.approx((1 / 2 + 0) / 2)
    assert got.dist_ratio_llm == pytest.approx((8 - 6) / (8 * 2))  # padded 2 x 4 against 2 x 3
    assert got.dist_ratio_vision == pytest.approx((4 - 1) / (4 * 2))
    assert got.samples_per_batch == 2
    assert got.dist_ratio_llm_packed == pytest.approx(0)  # 4 + 2 against 3 + 3 tokens
    with pytest.raises(ArgumentError, match="dp=0"):
        measure([[0]], sizes, dp=0)


def test_the_sampler_carries_an_epochs_leftovers_to_the_front_of_the_next():
    sizes = _sizes(count=600)
    sampler = IsfBatchSampler(sizes, seed=1)
    first = sampler.plan(0)
    assert sorted(i for b in sampler for i in b) == list(range(600))
    sampler.set_epoch(1)
    assert len(sampler) == len(sampler.plan(1).batches) and sampler.plan(1) != first
    leftovers = {i for b in first.batches[first.balanced :] for i in b}
    if leftovers:  # they led the next epoch's first round: most land in its balanced groups
        second = sampler.plan(1)
        placed = {i for b in second.batches[: second.balanced] for i in b}
        assert len(leftovers & placed) >= len(leftovers) // 2


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 50), st.integers(0, 20)), min_size=1, max_size=60), st.integers(0, 99)
)
def test_no_sample_is_lost_or_repeated_whatever_the_sizes(pairs, seed):
    sizes = SampleSizes(np.array([t for t, _ in pairs]), np.array([v for _, v in pairs]))
    epoch = isf_epoch(sizes, IsfTargets.from_statistics(sizes), seed=seed)
    assert sorted(i for b in epoch.batches for i in b) == list(range(len(pairs)))
    assert all(b for b in epoch.batches)


@pytest.mark.parametrize("family", [INTERNVL, QWEN], ids=["tiles", "patches"])
def test_sizes_without_building_samples_are_the_samples_sizes(family):
    data = SyntheticDataset("interleaved", family, 30, seed=2, text_scale=1 / 30, pixel_scale=1 / 8)
    sizes = SampleSizes.of(data, family, log=None)
    for i in range(30):
        sample = data[i]
        assert (sizes.llm_tokens[i], sizes.vision_rows[i]) == (
            sample_length(sample, family, i),
            family.vision_rows(sample),
        )


def test_the_benchmark_measures_a_manifest_as_the_issue_asks(tmp_path):
    """``benchmarks/data_balance.py --manifest FILE --family internvl --dp 4 --json OUT``: one row
    per method with the named fields, the three methods at the same mean mini-batch size."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from vlmcompile.data.synthetic import draw_sizes

    manifest = tmp_path / "m.jsonl"
    lines = []
    for i in range(400):
        s = draw_sizes("internvl-tiles", i)
        lines.append(json.dumps({"text_tokens": s.text_tokens, "images": [list(x) for x in s.images]}))
    manifest.write_text("\n".join(lines))
    out = tmp_path / "out.json"
    script = Path(__file__).parents[2] / "benchmarks" / "data_balance.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--manifest",
            str(manifest),
            "--family",
            "internvl",
            "--dp",
            "4",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["random", "length grouping", "ISF"]
    for r in rows:
        assert {"pad_ratio", "dist_ratio_vision", "dist_ratio_llm", "samples_per_batch"} <= set(r)
    assert abs(rows[0]["samples_per_batch"] - rows[2]["samples_per_batch"]) < 1
    assert rows[2]["dist_ratio_vision"] < rows[0]["dist_ratio_vision"]
    bad = subprocess.run(
        [sys.executable, str(script), "--manifest", str(manifest)], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--manifest needs --family" in bad.stderr


def test_a_dataset_too_small_for_one_balanced_batch_is_said_and_trains_unbalanced():
    sizes = SampleSizes(np.asarray([100, 200, 150]), np.asarray([1, 0, 2]))
    targets = IsfTargets(vision=40, text=4096, vision_floor=40, text_floor=3968)
    with pytest.warns(IsfWarning, match="less than one balanced mini-batch needs .* sampling stage alone"):
        sampler = IsfBatchSampler(sizes, targets=targets)
    epoch = sampler.plan(0)
    assert epoch.balanced == 0 and sorted(i for b in epoch.batches for i in b) == [0, 1, 2]


def test_targets_no_group_can_meet_are_refused_or_said():
    with pytest.raises(DataError, match="text_floor=5000 must lie in 0..text=4096"):
        IsfTargets(vision=10, text=4096, vision_floor=10, text_floor=5000)
    with pytest.raises(ArgumentError, match="vision=0"):
        IsfTargets(vision=0, text=4096, vision_floor=0, text_floor=10)
    sizes = SampleSizes(np.asarray([5000, 300, 300] * 20), np.asarray([1, 2, 3] * 20))
    targets = IsfTargets(vision=8, text=4096, vision_floor=4, text_floor=3968)
    with pytest.warns(
        IsfWarning, match="20 of 60 samples alone exceed the targets .* a mini-batch of its own"
    ):
        sampler = IsfBatchSampler(sizes, targets=targets)
    assert sorted(i for b in sampler.plan(0).batches for i in b) == list(range(60))


def test_bad_sizes_are_refused_and_the_default_targets_warning_says_what_to_give():
    with pytest.raises(DataError, match=r"llm_tokens\[1\] is -3: a sample's sizes are counts, 0 or more"):
        SampleSizes(np.asarray([5, -3]), np.asarray([1, 1]))
    with pytest.raises(DataError, match=r"vision_rows\[0\] is -1"):
        SampleSizes(np.asarray([5, 3]), np.asarray([-1, 1]))
    # One sample with far more image rows per token than the rest: over the default Q_v.
    sizes = SampleSizes(np.asarray([400] * 20 + [300]), np.asarray([1] * 20 + [40]))
    with pytest.warns(IsfWarning) as said:
        IsfBatchSampler(sizes)
    note = str(said[0].message)
    assert "1 of 21 samples alone exceed the targets" in note
    assert "give IsfTargets with the largest sample's sizes (Q_t 400, Q_v 40)" in note
    assert "from_statistics does" not in note  # the function that made these targets
