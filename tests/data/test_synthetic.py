"""The synthetic datasets: seeded, random-access, and following the figures their docstring cites."""

import statistics

import pytest
import torch

from vlmcompile.data.families import TileFamily
from vlmcompile.data.images import internvl
from vlmcompile.data.packing import sample_length
from vlmcompile.data.synthetic import DISTRIBUTIONS, SyntheticDataset, draw_sizes
from vlmcompile.ir.errors import DataError

TINY = TileFamily("internvl", image_token_id=100, side=28, channels=3, tokens_per_tile=4, max_tiles=12)


def test_internvl_tiles_follows_omnibals_statistics():
    """OmniBal section 5.1: InternVL-Chat-1.2's LLM input tokens, mean 1400 and std 900, images
    in up to 4 tiles and a thumbnail."""
    samples = [draw_sizes("internvl-tiles", i) for i in range(5000)]
    llm = [s.text_tokens + sum(internvl(h, w, max_tiles=4).llm_tokens for h, w in s.images) for s in samples]
    assert statistics.mean(llm) == pytest.approx(1400, rel=0.1)
    assert statistics.pstdev(llm) == pytest.approx(900, rel=0.15)
    assert max(s.text_tokens for s in samples) <= 4096


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_every_dataset_mixes_text_only_samples_at_the_stated_share(name):
    samples = [draw_sizes(name, i, text_only=0.2) for i in range(3000)]
    share = sum(not s.images for s in samples) / len(samples)
    floor = 0.2 + (
        0.8 * 0.08 if name == "interleaved" else 0
    )  # a Poisson(2.5) draws no image 8 % of the time
    assert share == pytest.approx(floor, abs=0.03)


def test_interleaved_documents_average_obelics_images_and_text():
    samples = [draw_sizes("interleaved", i, text_only=0) for i in range(5000)]
    assert statistics.mean(len(s.images) for s in samples) == pytest.approx(2.5, rel=0.06)
    assert statistics.mean(s.text_tokens for s in samples) == pytest.approx(816, rel=0.1)


def test_a_dataset_is_seeded_and_random_access():
    ds = SyntheticDataset("internvl-tiles", TINY, 50, seed=3, text_scale=1 / 50, pixel_scale=28 / 448)
    again = SyntheticDataset("internvl-tiles", TINY, 50, seed=3, text_scale=1 / 50, pixel_scale=28 / 448)
    for i in (0, 17, 49):
        a, b = ds[i], again[i]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        sample_length(a, TINY, i)  # image tokens match its tiles
    other = SyntheticDataset("internvl-tiles", TINY, 50, seed=4, text_scale=1 / 50, pixel_scale=28 / 448)
    assert any(not torch.equal(ds[i]["input_ids"], other[i]["input_ids"]) for i in range(5))
    tiles = {TINY.vision_rows(ds[i]) for i in range(50)}
    assert 0 in tiles and max(tiles) > 1, tiles  # text-only and multi-tile samples alike
    with pytest.raises(IndexError):
        ds.sizes(50)


def test_bad_dataset_arguments_are_named():
    with pytest.raises(DataError, match="unknown synthetic dataset 'coco'"):
        SyntheticDataset("coco", TINY, 4)
    with pytest.raises(DataError, match="text_only=1.5"):
        SyntheticDataset("llava-chat", TINY, 4, text_only=1.5)
    with pytest.raises(DataError, match="pixel_scale=0"):
        SyntheticDataset("llava-chat", TINY, 4, pixel_scale=0)
