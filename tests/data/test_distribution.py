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


def test_a_scan_fits_every_scanned_step_and_finds_the_largest_microbatch():
    data = SyntheticDataset("internvl-tiles", FAMILY, 120, seed=2, text_scale=1 / 50, pixel_scale=28 / 448)
    found = scan(data, FAMILY, global_batch=10, log=None)
    lengths = [sample_length(data[i], FAMILY, i) for i in range(120)]
    assert found.tokens == -(-max(lengths) // 16) * 16 and found.scanned == 120
    for k in range(0, 120, 10):  # no scanned sample is deferred at the planned microbatch count
        assert not assign_rows(lengths[k : k + 10], found.microbatches, found.tokens)[1]
    assert sum(lengths[i] for i in found.largest) <= found.tokens
    assert sum(FAMILY.vision_rows(data[i]) for i in found.largest) == found.image_rows.max
    assert 0 < found.pad_share < 1 and "planned for the dataset" in str(found)


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
    with pytest.raises(DataError, match="take more LLM tokens than tokens_per_microbatch=4"):
        scan(data, FAMILY, global_batch=2, tokens=4, log=None)
    with pytest.raises(DataError, match="the manifest holds no samples"):
        ManifestDataset((), FAMILY)
