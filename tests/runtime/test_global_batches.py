"""Data checked before the ranks start: samples that do not collate and data the local ranks
cannot receive are refused naming the key, the samples and the fix (a batch of other shapes:
tests/runtime/test_train_loop.py)."""

from __future__ import annotations

import pytest
import torch

from tests.models import build
from tests.pipeline_helpers import even_plan
from vlmcompile import compile
from vlmcompile.ir.errors import ArgumentError
from vlmcompile.models.synthetic_batches import SyntheticBatches
from vlmcompile.runtime.global_batches import GlobalBatches, concat_samples
from vlmcompile.runtime.train_loop import TrainConfig


@pytest.fixture(scope="module")
def tiny():
    model, batch = build("tiny", batch_size=4)
    pipe = compile(model, batch, log=None)
    return pipe, even_plan(pipe.layer_graph, pp=2, global_batch=4)


def _samples(lengths):
    """Samples of the tiny model whose text has the given lengths."""
    out = []
    for k, n in enumerate(lengths):
        sample = SyntheticBatches("tiny", 1, seed=k)(0)
        out.append({key: (v[:, :n] if key in ("input_ids", "labels") else v) for key, v in sample.items()})
    return out


def test_samples_of_other_lengths_are_refused_naming_the_key_and_the_fix():
    full = _samples([1])[0]["input_ids"].shape[1]
    with pytest.raises(
        ArgumentError, match=rf"differ in 'input_ids': sample 0 is \[1, {full}\], sample 2 \[1, 5\]"
    ):
        concat_samples(_samples([full, full, 5]))
    data = GlobalBatches(_samples([full, full, 5, full]), 4, shuffle=False)
    with pytest.raises(ArgumentError, match=r"pad or crop .*\(dataset indices \[0, 1, 2, 3\]\)"):
        data(0)


def test_a_failing_collate_function_is_named_with_the_samples_it_failed_on():
    def stack(samples):
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}

    data = GlobalBatches(_samples([8, 8, 5, 8]), 4, shuffle=False, collate=stack)
    with pytest.raises(
        ArgumentError, match=r"collate function .*stack failed on dataset indices \[0, 1, 2, 3\]"
    ):
        data(0)


def test_data_the_local_ranks_cannot_receive_is_refused_with_the_fix(tiny):
    pipe, plan = tiny
    good = SyntheticBatches("tiny", 4)
    with pytest.raises(ArgumentError, match=r"data \(.*<lambda>\) cannot be sent .*functools.partial"):
        pipe.train(lambda step: good(step), TrainConfig(steps=1), plan=plan, timeout_s=30)
