"""A batch split by sample: rows per sample read off the batch (Qwen-VL's patches), slices of
samples, and each slice's share of the label tokens."""

import pytest
import torch

from vlmcompile.ir.errors import SampleBatchError
from vlmcompile.ir.microbatch import IGNORE_INDEX, label_weights, num_samples, rows_per_sample, take


def _batch():
    return {
        "input_ids": torch.arange(12).reshape(4, 3),
        "pixel_values": torch.arange(16 * 2).reshape(16, 2),  # 4 patches a sample
        "scale": torch.tensor(2.0),
        "mode": "train",
    }


def test_rows_per_sample_and_slices_of_samples():
    batch = _batch()
    assert num_samples(batch) == 4
    rows = rows_per_sample(batch)
    assert rows == {"input_ids": 1, "pixel_values": 4, "scale": 0, "mode": 0}
    part = take(batch, 1, 2, rows)
    assert torch.equal(part["input_ids"], batch["input_ids"][1:3])
    assert torch.equal(part["pixel_values"], batch["pixel_values"][4:12])
    assert part["scale"] is batch["scale"] and part["mode"] == "train"


def test_a_batch_that_cannot_be_split_by_sample_is_refused_naming_the_key():
    with pytest.raises(
        SampleBatchError, match=r"batch\['pixel_values'\] has 6 rows, not a multiple of the batch's 4"
    ):
        rows_per_sample({"input_ids": torch.zeros(4, 3), "pixel_values": torch.zeros(6, 2)})
    with pytest.raises(SampleBatchError, match="tensors lead with \\[2, 3\\]"):
        num_samples({"a": torch.zeros(2), "b": torch.zeros(3)})


def test_each_slice_weighs_by_its_label_tokens():
    labels = torch.full((4, 5), IGNORE_INDEX)
    labels[0, 1:] = 1  # 4 label tokens (the first position never counts: it predicts nothing)
    labels[3, 1:3] = 1  # 2
    assert label_weights({"labels": labels}, 2) == pytest.approx([4 / 6, 2 / 6])
    assert label_weights({"labels": torch.full((4, 5), IGNORE_INDEX)}, 2) == [0.5, 0.5]
    assert label_weights({}, 4) == [0.25] * 4
