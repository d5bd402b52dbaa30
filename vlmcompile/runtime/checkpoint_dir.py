"""A run's checkpoint directory: checked before any work, held by one run at a time, and the
rule for where a run starts in it.

* **Checked first.** The directory is created if need be and written to (a probe file), the log
  file's folder too, and the free space is compared with one checkpoint's size, all before the
  model is captured: a run never trains for an hour to fail at its first save.
* **One writer.** A run holds an exclusive ``flock`` on ``<dir>/.vlmcompile.lock`` while it
  trains (the launching process on local ranks, rank 0 under torchrun). The kernel drops it when
  the holder dies, however it dies, so a dead run's successor takes it over; a second live run
  is refused naming the holder.
* **Where a run starts.** ``resume``: from the newest checkpoint, checked whole (every file's
  CRC-32), whatever ``latest`` says; a damaged newest one is refused naming the newest intact
  one; no checkpoint means step 0, and the line printed says why. Not resuming, a directory
  holding checkpoints is refused unless ``overwrite`` (which deletes them): a run never writes
  over another run's steps.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vlmcompile.ir.errors import ArgumentError, VlmCompileError
from vlmcompile.runtime import checkpoint
from vlmcompile.runtime.checkpoint import CheckpointError

LOCK = ".vlmcompile.lock"
_ROOM = 1.1
"""Free space asked for over one checkpoint's estimated size (DCP's own metadata, rounding)."""


@dataclass(frozen=True, slots=True)
class Start:
    """Where a run starts: the step, the checkpoint it loads (None: fresh weights) and the line
    rank 0 prints about it (empty when there is nothing to say)."""

    step: int = 0
    checkpoint: str | None = None
    note: str = ""


@dataclass(slots=True)
class _Held:
    fd: int
    start: Start
    count: int = field(default=1)


_HELD: dict[str, _Held] = {}
"""Directories this process holds: a claim inside a claim (the CLI's, then train()'s) shares it."""


def checkpoint_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """About how large one checkpoint of ``tensors`` (a model's parameters and buffers, a tied
    one counted once) is: each in its dtype, and AdamW's two moments of each floating-point
    parameter that requires grad."""
    total = 0
    for t in {id(t): t for t in tensors}.values():
        size = t.numel() * t.element_size()
        total += 3 * size if t.requires_grad and t.is_floating_point() else size
    return total


def check_output_file(path: str | Path, flag: str) -> None:
    """Refuse an output file that cannot be written: a folder, in a missing folder, or where a
    probe file cannot be created (a read-only or full file system; permissions)."""
    target = Path(path)
    folder = target.parent
    problem = None
    if target.is_dir():
        problem = "is a directory; give a file name"
    elif not folder.is_dir():
        problem = f"is in {str(folder)!r}, {_what_is(folder)}"
    else:
        problem = _probe(folder)
        if problem is None and target.exists() and not os.access(target, os.W_OK):
            problem = "cannot be written (permission denied); choose another path"
    if problem:
        raise ArgumentError(f"{flag} {path} {problem}")


def _what_is(folder: Path) -> str:
    """What stands where a folder should be: a file (itself or above it), or nothing."""
    existing = next((p for p in [folder, *folder.parents] if p.exists()), None)
    if existing is None or existing.is_dir():
        return "which does not exist; create it first"
    if existing == folder:
        return "which is a file, not a folder; choose another path"
    return f"which is under {str(existing)!r}, a file, not a folder; choose another path"


def _probe(folder: Path) -> str | None:
    """Why nothing can be written in ``folder`` (None: it can): a file is made and removed."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".vlmcompile-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        return f"cannot be written ({err.strerror or err}); choose another path"
    return None


@contextlib.contextmanager
def claim(
    checkpoint_dir: str | None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    log_jsonl: str | None = None,
    checkpoint_bytes: int | None = None,
    saves: int = 1,
) -> Iterator[Start]:
    """Check the run's output paths, hold its checkpoint directory and decide where it starts;
    the directory is released on leaving. Under torch.distributed every rank calls it: rank 0
    checks and holds, and every rank gets its :class:`Start` (or raises its error).

    ``checkpoint_bytes``: one checkpoint's estimated size (None: not checked against the free
    space); ``saves``: how many the run keeps at most (a line warns when they will not fit)."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    with contextlib.ExitStack() as held:
        outcome: Start | VlmCompileError
        if not distributed or dist.get_rank() == 0:
            try:
                if log_jsonl:
                    check_output_file(log_jsonl, "log_jsonl")
                outcome = held.enter_context(
                    _claim_here(checkpoint_dir, resume, overwrite, checkpoint_bytes, saves)
                )
            except (VlmCompileError, OSError) as err:
                if not distributed:
                    raise
                # Every rank must hear of it: one that raised alone would leave the others waiting.
                outcome = (
                    err if isinstance(err, VlmCompileError) else CheckpointError(f"{checkpoint_dir}: {err}")
                )
        if distributed:
            box: list[Any] = [outcome if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)  # every rank acts on rank 0's decision
            outcome = box[0]
        if isinstance(outcome, VlmCompileError):
            raise outcome
        yield outcome


@contextlib.contextmanager
def _claim_here(
    checkpoint_dir: str | None, resume: bool, overwrite: bool, size: int | None, saves: int
) -> Iterator[Start]:
    if not checkpoint_dir:
        yield Start()
        return
    root = Path(checkpoint_dir)
    key = os.path.realpath(root)
    if key in _HELD:
        _HELD[key].count += 1
        try:
            yield _HELD[key].start
        finally:
            _HELD[key].count -= 1
        return
    existed = root.exists()
    _make_writable(root)
    fd = _lock(root)
    try:
        start = _start(root, resume, overwrite, existed)
        room = _room_note(root, size, saves)
        if room:
            start = Start(start.step, start.checkpoint, "; ".join(x for x in (start.note, room) if x))
        _HELD[key] = _Held(fd, start)
        try:
            yield start
        finally:
            del _HELD[key]
    finally:
        os.close(fd)  # releases the flock


def _make_writable(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} is a file; give a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(
            f"checkpoint directory {root} cannot be created ({err.strerror or err}); choose another"
        ) from None
    problem = _probe(root)
    if problem:
        raise CheckpointError(f"checkpoint directory {root} {problem}")


def _lock(root: Path) -> int:
    path = root / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(
            f"checkpoint directory {root} is in use by another run ({_holder(path)}); wait for it to end, "
            "or give another checkpoint directory"
        ) from None
    except OSError as err:  # a file system without locks (some network mounts)
        os.close(fd)
        raise CheckpointError(
            f"checkpoint directory {root} cannot be locked ({err.strerror or err}), so two runs could write it "
            "at once; give a directory on a local or lock-capable file system"
        ) from None
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    return fd


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        return f"pid {h['pid']} on {h['host']}, since {h['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its lock file names no holder"


def check_start(checkpoint_dir: str | None, *, resume: bool, overwrite: bool) -> None:
    """Refuse at once, changing nothing, what :func:`claim` would refuse for where a run starts: a
    file where the directory goes, or an earlier run's checkpoints with neither ``resume`` nor
    ``overwrite`` (``TrainConfig`` checks it when made, so a script learns it before compiling)."""
    if not checkpoint_dir:
        return
    root = Path(checkpoint_dir)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} is a file; give a directory")
    if root.is_dir() and not (resume or overwrite):
        steps = checkpoint.steps_in(root)
        if steps:
            raise _earlier_run(root, steps)


def _earlier_run(root: Path, steps) -> CheckpointError:
    return CheckpointError(
        f"checkpoint directory {root} holds checkpoints of an earlier run (steps {_ranges([s for s, _ in steps])}): "
        "continue it with --resume (resume=True), or start again with --overwrite (overwrite=True, "
        "which deletes them)"
    )


def _start(root: Path, resume: bool, overwrite: bool, existed: bool = True) -> Start:
    notes = []
    partial = sorted(p for p in root.iterdir() if p.name.endswith(checkpoint.PARTIAL_SUFFIX))
    for p in partial:  # saves a dead run never finished: the lock says no live run writes them
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    if partial:
        notes.append(f"removed {', '.join(p.name for p in partial)} (left by a save that never finished)")
    steps = checkpoint.steps_in(root)
    if resume:
        found, why = checkpoint.newest(root) if existed else (None, f"{root} did not exist; it was created")
        if found is None:
            notes.insert(0, f"starting at step 0: nothing to resume from ({why})")
            return Start(0, None, "; ".join(notes))
        step = int(found.name.split("_")[1])
        notes.insert(0, f"resuming from step {step}: {found} is {why}")
        return Start(step, str(found), "; ".join(notes))
    if steps and not overwrite:
        raise _earlier_run(root, steps)
    if steps:
        for _, path in steps:
            shutil.rmtree(path)
        (root / checkpoint.LATEST).unlink(missing_ok=True)
        notes.append(
            f"removed the earlier run's checkpoints (steps {_ranges([s for s, _ in steps])}; overwrite)"
        )
    return Start(0, None, "; ".join(notes))


def _room_note(root: Path, size: int | None, saves: int) -> str:
    """Refuse a directory without room for one checkpoint; a line when the run's saves will not
    all fit."""
    if not size:
        return ""
    free = shutil.disk_usage(root).free
    if free < _ROOM * size:
        raise CheckpointError(
            f"checkpoint directory {root} has {_mib(free)} free, and one checkpoint of this model takes about "
            f"{_mib(size)}; free some space or give another checkpoint directory"
        )
    if free < _ROOM * size * saves:
        return (
            f"warning: {root} has {_mib(free)} free, less than the {saves} checkpoints of about {_mib(size)} "
            "this run keeps: later saves will fail unless space is freed (keep_last keeps fewer)"
        )
    return ""


def _mib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _ranges(numbers: list[int]) -> str:
    return (
        ", ".join(map(str, numbers))
        if len(numbers) <= 4
        else f"{numbers[0]}-{numbers[-1]}, {len(numbers)} saves"
    )


def kept_saves(steps: int, start: int, every: int, keep_last: int | None) -> int:
    """How many checkpoints a run has on disk at most: its saves (every ``every`` steps and at
    the end), the one it resumed from, and one more than ``keep_last`` while a save is written."""
    saved_at = set(range(start + every, steps + 1, every)) if every else set()
    saves = len(saved_at | {steps}) + (1 if start else 0)
    return min(saves, keep_last + 1) if keep_last else saves
