"""Scanning a dataset: the token budget, the microbatches a step needs, the largest microbatch."""

import json

import pytest

from vlmcompile.data.distribution import Spread, scan
from vlmcompile.data.families import TileFamily
from vlmcompile.data.manifest import read_manifest
from vlmcompile.data.packing import assign_rows, sample_length
from vlmcompile.data.synthetic import ManifestDataset, SyntheticDataset
from vlmcompile.ir.errors import DataError

FAMILY = TileFamily("internvl", image_token_id=100, side=28, channels=3, tokens_per_tile=4, max_tiles=12)


def test_spread_is_mean_p95_and_max():
    assert Spread.of(list(range(1, 101))) == Spread(50.5, 95, 100)
    assert str(Spread.of([3])) == "3.0 / 3 / 3"


def _carried_over(lengths, global_batch, microbatches, tokens):
    """Samples deferred by each step, packing steps in order with leftovers carried (as PackedSteps does)."""
    carried, deferred = [], []
    for k in range(0, len(lengths) - global_batch + 1, global_batch):
        todo = [*carried, *lengths[k : k + global_batch]]
        carried = [todo[i] for i in assign_rows(todo, microbatches, tokens, first=len(carried))[1]]
        deferred.append(len(carried))
    return deferred


def test_a_scan_plans_the_fewest_microbatches_that_keep_deferral_bounded():
    data = SyntheticDataset("internvl-tiles", FAMILY, 160, seed=2, text_scale=1 / 50, pixel_scale=28 / 448)
    found = scan(data, FAMILY, global_batch=16, log=None)
    lengths = [sample_length(data[i], FAMILY, i) for i in range(160)]
    assert found.tokens == -(-max(lengths) // 16) * 16 and found.scanned == 160
    # At the planned count no step defers more than 2 samples (16 / 8); one microbatch fewer would.
    deferred = _carried_over(lengths, 16, found.microbatches, found.tokens)
    assert max(deferred) == found.deferred.max <= 2 and sum(deferred) > 0
    assert max(_carried_over(lengths, 16, found.microbatches - 1, found.tokens)) > 2
    # Fewer than the busiest step alone needs: planning for it would pad every other step.
    assert found.microbatches < found.most_needed
    assert sum(lengths[i] for i in found.largest) <= found.tokens
    assert sum(FAMILY.vision_rows(data[i]) for i in found.largest) == found.image_rows.max
    trained = found.llm_tokens.mean * 10 * found.microbatches  # every microbatch of the 10 steps
    assert found.pad_share == pytest.approx(1 - trained / (10 * found.microbatches * found.tokens), rel=0.05)
    assert "deferred to the next step" in str(found) and "busiest step needs" in str(found)
    assert found.images is None  # InternVL's tiles do not say which image they belong to


def test_a_backlog_that_grows_step_after_step_is_not_planned_for():
    """One scanned step: deferring under the limit once is not enough; the step replayed must
    not build a backlog either."""
    data = SyntheticDataset("internvl-tiles", FAMILY, 64, seed=4, text_scale=1 / 50, pixel_scale=28 / 448)
    found = scan(data, FAMILY, global_batch=64, log=None)
    lengths = [sample_length(data[i], FAMILY, i) for i in range(64)]
    replayed = lengths * 16
    assert max(_carried_over(replayed, 64, found.microbatches, found.tokens)) <= 8
    assert max(_carried_over(replayed, 64, found.microbatches - 1, found.tokens)) > 8


def test_a_scan_counts_images_where_the_layout_tells():
    llava = TileFamily("llava", image_token_id=100, side=28, channels=3, tokens_per_tile=4, max_tiles=1)
    data = SyntheticDataset("interleaved", llava, 64, seed=1, text_scale=1 / 50, pixel_scale=28 / 640)
    found = scan(data, llava, global_batch=8, log=None)
    per_sample = [len(data.sizes(i).images) for i in range(64)]
    assert found.images.max <= found.image_rows.max and found.images.mean > 0
    assert (
        found.images.mean * found.microbatches * 8 >= sum(per_sample) * 0.9
    )  # most samples' images, counted
    assert f"images {found.images}" in str(found)


def test_a_manifest_is_a_dataset_of_its_sizes(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        "\n".join(json.dumps({"text_tokens": 5 + i, "images": [[448, 896]] * (i % 3)}) for i in range(9))
    )
    data = ManifestDataset(tuple(read_manifest(path)), FAMILY, pixel_scale=28 / 448)
    assert len(data) == 9 and FAMILY.vision_rows(data[2]) == 2 * 3  # 1 x 2 tiles and a thumbnail, twice
    assert sample_length(data[2], FAMILY, 2) == 7 + 2 * 3 * 4
    found = scan(data, FAMILY, global_batch=3, log=None)
    assert found.largest and found.of == 9


def test_bad_datasets_are_refused():
    with pytest.raises(DataError, match="the dataset is empty"):
        scan([], FAMILY, global_batch=2, log=None)
    with pytest.raises(DataError, match="give one with len"):
        scan(iter([]), FAMILY, global_batch=2, log=None)
    data = SyntheticDataset("llava-chat", FAMILY, 10, text_scale=1 / 10, pixel_scale=28 / 640)
    with pytest.raises(
        DataError,
        match=r"dataset sample \d+ takes \d+ LLM tokens, more than a microbatch.s 4 \(10 of 10 samples are\)",
    ):
        scan(data, FAMILY, global_batch=2, tokens=4, log=None)
    with pytest.raises(DataError, match="the manifest holds no samples"):
        ManifestDataset((), FAMILY)


@pytest.mark.parametrize(
    ("samples", "warned"),
    [(40, "one whole step of 32, 8 more in no whole step, left out"), (64, None), (72, None)],
)
def test_a_plan_resting_on_one_step_or_leaving_samples_out_warns(samples, warned):
    data = SyntheticDataset(
        "internvl-tiles", FAMILY, samples, seed=2, text_scale=1 / 50, pixel_scale=28 / 448
    )
    found = scan(data, FAMILY, global_batch=32, log=None)
    if warned is None:
        assert found.warning == "" and "warning" not in str(found)
    else:
        assert warned in found.warning and f"holds {samples} samples" in found.warning
        assert str(found).endswith(f"warning: {found.warning}")
