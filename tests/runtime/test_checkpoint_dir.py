"""A run's checkpoint directory: refused when it holds another run's checkpoints (unless resumed
or overwritten), held by one live run at a time and taken over from a dead one, checked for
writability and room before any work, and the start it gives says why."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from vlmcompile.ir.errors import ArgumentError
from vlmcompile.runtime.checkpoint import CheckpointError
from vlmcompile.runtime.checkpoint_dir import LOCK, check_output_file, claim, kept_saves


def _fake_step(root, step):
    """A step directory as far as the directory's rules go (they never read its files here)."""
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True)
    return path


def test_a_directory_holding_checkpoints_is_refused_without_resume_or_overwrite(tmp_path):
    for step in (2, 4, 6):
        _fake_step(tmp_path, step)
    with pytest.raises(CheckpointError) as info, claim(str(tmp_path)):
        pass
    message = str(info.value)
    assert "\n" not in message
    assert "holds checkpoints of an earlier run (steps 2, 4, 6)" in message
    assert "--resume" in message and "--overwrite" in message
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000004", "step_000006"]
    with claim(str(tmp_path), overwrite=True) as start:
        assert start.step == 0 and "removed the earlier run's checkpoints (steps 2, 4, 6" in start.note
    assert not list(tmp_path.glob("step_*"))


def test_resuming_where_there_is_nothing_starts_at_step_0_and_says_why(tmp_path):
    typo = tmp_path / "chekpoints"
    with claim(str(typo), resume=True) as start:
        assert start.step == 0 and start.checkpoint is None
        assert (
            start.note == f"starting at step 0: nothing to resume from ({typo} did not exist; it was created)"
        )
    with claim(str(typo), resume=True) as start:  # made by the first claim, and still empty
        assert start.note == f"starting at step 0: nothing to resume from ({typo} holds no checkpoint)"


def test_a_save_that_never_finished_is_cleared_and_named(tmp_path):
    (tmp_path / ".step_000004.partial").mkdir()
    (tmp_path / ".step_000004.partial" / "__0_0.distcp").write_bytes(b"half")
    with claim(str(tmp_path)) as start:
        assert "removed .step_000004.partial (left by a save that never finished)" in start.note
    assert not (tmp_path / ".step_000004.partial").exists()


_HOLD = """
import sys, time
from vlmcompile.runtime.checkpoint_dir import claim
with claim(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_one_live_run_holds_a_directory_and_a_dead_ones_successor_takes_it_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError) as info, claim(str(tmp_path)):
            pass
        message = str(info.value)
        assert f"is in use by another run (pid {holder.pid} on " in message
        assert "wait for it to end, or give another checkpoint directory" in message
        holder.send_signal(signal.SIGKILL)  # no clean-up: the kernel drops its lock
        holder.wait(10)
        with claim(str(tmp_path)) as start:
            assert start.step == 0
            assert f'"pid": {os.getpid()}' in (tmp_path / LOCK).read_text()
    finally:
        holder.kill()
        holder.wait(10)


def test_a_claim_inside_a_claim_shares_it(tmp_path):
    """The CLI claims before capture and train() claims again: one holder, one decision."""
    with claim(str(tmp_path)) as outer, claim(str(tmp_path)) as inner:
        assert inner is outer
    with claim(str(tmp_path)):  # released: claimable again
        pass


def test_a_directory_that_cannot_be_written_or_has_no_room_is_refused_before_any_work(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with (
        pytest.raises(CheckpointError, match=r"ckpt cannot be created \(Not a directory\)"),
        claim(str(a_file / "ckpt")),
    ):
        pass
    with pytest.raises(CheckpointError, match="is a file; give a directory"), claim(str(a_file)):
        pass
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(CheckpointError) as info, claim(str(tmp_path / "big"), checkpoint_bytes=2 * free):
        pass
    assert "free, and one checkpoint of this model takes about" in str(info.value)
    with claim(str(tmp_path / "some"), checkpoint_bytes=free // 4, saves=8) as start:
        assert "less than the 8 checkpoints of about" in start.note and "keep_last" in start.note


def test_a_log_file_that_cannot_be_written_is_refused(tmp_path):
    with pytest.raises(ArgumentError, match=r"is in '.*missing', which does not exist; create it first"):
        check_output_file(tmp_path / "missing" / "log.jsonl", "--log-jsonl")
    with pytest.raises(ArgumentError, match="is a directory"), claim(None, log_jsonl=str(tmp_path)):
        pass


@pytest.mark.parametrize(
    ("steps", "start", "every", "keep", "expected"),
    [(10, 0, 0, None, 1), (10, 0, 2, None, 5), (10, 4, 2, None, 4), (10, 0, 2, 2, 3), (10, 0, 20, None, 1)],
)
def test_the_checkpoints_a_run_keeps_are_counted(steps, start, every, keep, expected):
    assert kept_saves(steps, start, every, keep) == expected
