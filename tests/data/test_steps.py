"""Training steps of packed samples (:mod:`vlmcompile.data.steps`): every sample of the stream
trained once, epoch after epoch, a resumed run going on where its checkpoint left the stream (with
any global batch), the backlog bounded and checked before a run, every sample named by its dataset
index and manifest line."""

import json
import re

import pytest

from vlmcompile.data.families import TileFamily
from vlmcompile.data.manifest import read_manifest
from vlmcompile.data.steps import DeferralError, PackedSteps, check_run
from vlmcompile.data.synthetic import ManifestDataset
from vlmcompile.ir.errors import DataError
from vlmcompile.runtime.global_batches import GlobalBatches

FAMILY = TileFamily(
    "zoo", image_token_id=63, side=16, channels=3, tokens_per_tile=4, max_tiles=1, empty_images=True
)


def _manifest(tmp_path, count=40, long_line=None, seed=0):
    """A manifest of ``count`` samples of 12-50 text tokens and 0-2 images (one of 400 text tokens
    at line ``long_line``)."""
    import random

    rng = random.Random(seed)
    lines = []
    for n in range(1, count + 1):
        text = 400 if n == long_line else rng.randint(12, 50)
        lines.append(json.dumps({"text_tokens": text, "images": [[336, 336]] * rng.randint(0, 2)}))
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return ManifestDataset(tuple(read_manifest(path)), FAMILY)


def _steps(dataset, global_batch, microbatches=7, tokens=64, seed=0):
    batches = GlobalBatches(dataset, global_batch, seed=seed, collate=list)
    return PackedSteps(batches, FAMILY, tokens, microbatches)


def _trained(steps, step):
    """Dataset indices step ``step`` trains (its batch made), in the order its microbatches hold them."""
    steps(step)
    todo, rows, _ = steps._plan(step)
    return [todo[i] for row in rows for i in row]


def test_every_sample_of_the_stream_trains_once_epoch_after_epoch(tmp_path):
    """40 samples, 12 a step: an epoch's last 4 open step 4 with the next epoch's first 8; what a
    step defers trains in the next; at the run's end only the last step's deferred are left."""
    steps = _steps(_manifest(tmp_path), 12, microbatches=9)
    trained, left = [], []
    for k in range(10):
        trained += _trained(steps, k)
        assert steps(k).num_samples == len(_trained(steps, k))
        left = list(steps._carried[k + 1])
    stream = [i for k in range(10) for i in steps.samples.indices(k)]
    assert sorted(trained + left) == sorted(stream), (
        "every sample of the stream trains, or waits in the last step's"
    )
    assert len(stream) == 120 and all(stream.count(i) == 3 for i in range(40)), "three whole epochs"


def test_a_global_batch_the_plan_cannot_hold_is_refused_before_the_run_with_the_largest_it_can(tmp_path):
    """The issue's case: a plan of 7 microbatches of 64 tokens, made for 8 samples a step, given 32."""
    data = _manifest(tmp_path)
    with pytest.raises(DeferralError) as info:
        check_run(_steps(data, 32), 0, 8, log=None)
    message = str(info.value)
    assert "cannot hold 32 samples a step of this data" in message and "the backlog grows" in message
    fits = int(re.search(r"The most they hold is (\d+) a step", message).group(1))
    assert 8 <= fits < 32
    found = check_run(_steps(data, fits), 0, 8, log=None)  # the one it names runs
    assert found.most_deferred <= fits and "40 samples, the longest" in str(found)


def test_a_run_that_outgrows_its_microbatches_stops_before_the_step(tmp_path):
    """Data given as a function of the step cannot be replayed before the run: the step whose
    backlog would pass a whole step's is refused before it trains."""
    data = _manifest(tmp_path)
    batches = GlobalBatches(data, 32, collate=list)
    steps = PackedSteps(lambda k: batches(k), FAMILY, 64, 7)
    steps(0)
    with pytest.raises(DeferralError, match=r"step 2 would leave \d+ samples for the next, more than the 32"):
        steps(1)


def test_a_resumed_run_goes_on_where_its_checkpoint_left_the_stream_with_another_global_batch(tmp_path):
    """Saved after step 3 at 10 samples a step (with samples carried into step 4), resumed at 8:
    the samples trained before and after are the stream's, each once."""
    data = _manifest(tmp_path)
    before = _steps(data, 10)
    done = [i for k in range(3) for i in _trained(before, k)]
    state = json.loads(json.dumps(before.state(2)))  # as a checkpoint keeps it
    assert state["position"] == 30 and state["carried"] == list(before._carried[3])
    after = _steps(data, 8).resumed(3, state)
    done += [i for k in range(3, 8) for i in _trained(after, k)]
    left = list(after._carried[8])
    assert after.samples.position(8) == 30 + 5 * 8
    stream = before.samples.indices(0) + before.samples.indices(1) + before.samples.indices(2)
    stream += [i for k in range(3, 8) for i in after.samples.indices(k)]
    assert sorted(done + left) == sorted(stream)
    with pytest.raises(DataError, match=r"another stream: samples 40 \(now 39\)"):
        _steps(ManifestDataset(data.samples[:39], FAMILY), 8).resumed(3, state)


def test_a_long_sample_anywhere_in_the_data_is_named_by_its_line_before_the_run(tmp_path):
    data = _manifest(tmp_path, count=60, long_line=57)
    with pytest.raises(
        DataError,
        match=r"dataset sample 56 \(.*data.jsonl:57\) takes 4\d\d LLM tokens, more than a microbatch's 64",
    ):
        check_run(_steps(data, 8), 0, 2, log=None)


def test_a_backlog_carried_into_a_resumed_run_with_fewer_samples_a_step_shrinks_and_goes_on(tmp_path):
    """16 a step leave a backlog; resumed at 4 a step, each step leaves fewer than it was given:
    not refused as a backlog that grows."""
    data = _manifest(tmp_path)
    before = _steps(data, 16)
    for k in range(3):
        before(k)
    state = before.state(2)
    assert len(state["carried"]) > 4, "the case needs a backlog larger than the new global batch"
    after = _steps(data, 4).resumed(3, state)
    found = check_run(after, 3, 12, log=None)
    assert found.most_deferred >= 4  # the backlog, shrinking step by step
