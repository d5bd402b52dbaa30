"""Checkpoints of a pipelined run, in torch.distributed.checkpoint (DCP) format.

Each rank saves what it holds under the *original* model's names: ``model.<name>`` for its
parameters and persistent buffers (a tied parameter under each of its ``state_dict`` names),
``optimizer.<name>.<state>`` for their optimizer state, plus the step and the LR scheduler's
state. DCP writes one file per rank and a metadata file, and keeps one copy of what several
ranks hold under one name (data-parallel replicas). Because the names are the model's, a
checkpoint

* loads into the original, un-pipelined model: ``model.load_state_dict(load_checkpoint(path)["model"])``;
* resumes under any plan of the same model (other cuts, degrees or schedule): each rank reads
  the parameters its stages hold, wherever they were saved.

Layout: ``<dir>/step_000010/`` per save, holding DCP's files and ``manifest.json`` (every file's
size and CRC-32, checked before a load), and ``<dir>/latest`` naming the newest one. A save is
atomic: it is written to ``<dir>/.step_000010.partial/`` and renamed into place only when every
rank's file, the metadata and the manifest are on disk, so a ``step_*`` directory is always a
whole checkpoint (or one damaged after it was written, which its manifest tells).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from vlmcompile.ir.errors import VlmCompileError, user_facing
from vlmcompile.runtime.optimizers import holds_state, local_states, param_groups

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException

# torch.distributed.checkpoint is imported where a checkpoint is written or read: it takes about
# a second to import, and planning (which imports this module through the checkpoint folder's
# checks) never uses it.

LATEST = "latest"
MANIFEST = "manifest.json"
_MANIFEST_SCHEMA = "vlmcompile-checkpoint"
_STEP_DIR = re.compile(r"^step_(\d+)$")
PARTIAL_SUFFIX = ".partial"
"""A save in progress: ``.step_000010.partial``; one left behind is a save that never finished."""


class CheckpointError(VlmCompileError, ValueError):
    """A checkpoint that cannot be saved or used: the message names the file or the parameters at
    fault, and the checkpoint to use instead."""


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}"


def steps_in(directory: str | Path) -> list[tuple[int, Path]]:
    """Every ``step_*`` directory of a run's directory, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = ((_STEP_DIR.match(p.name), p) for p in root.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m and p.is_dir())


def save(
    directory: str | Path,
    step: int,
    runner,
    optimizer,
    scheduler,
    schedule: dict | None = None,
    data: dict | None = None,
) -> str:
    """Save this rank's share at ``step`` (every rank calls it); returns the step's directory.
    ``data``: where the run's data goes on from (:func:`saved_data` reads it back).

    Refuses (:class:`CheckpointError`, on every rank) to save non-finite weights, or over a step
    directory that exists. A failed write (a full disk, an I/O error) leaves nothing behind: the
    partial directory is removed and ``latest`` stays where it was."""
    import torch.distributed.checkpoint as dcp

    root = Path(directory)
    final = step_dir(root, step)
    staging = root / f".{final.name}{PARTIAL_SUFFIX}"
    rank, world = dist.get_rank(), dist.get_world_size()
    _refuse_non_finite(runner, step)
    problem = None
    if rank == 0:
        try:
            if final.exists():
                problem = f"{final} exists already; a save never replaces a checkpoint"
            elif staging.exists():  # a save that never finished: the directory's lock rules out a live one
                shutil.rmtree(staging)
        except OSError as err:
            problem = f"saving step {step}: {staging} cannot be cleared ({err})"
    problem = _from_rank0(runner, problem, f"the check before saving step {step}")
    if problem:
        raise CheckpointError(problem)
    state = {
        "model": {name: p.detach() for name, p in runner.named_state().items()},
        "optimizer": _optimizer_state(runner, optimizer),
        "trainer": {
            "step": step,
            "scheduler": _scheduler_json(scheduler),
            "schedule": json.dumps(schedule or {}, sort_keys=True),
            "data": json.dumps(data or {}, sort_keys=True),
        },
    }
    try:
        with _peers_blamed(runner, f"saving the checkpoint of step {step}"):
            metadata = dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging), overwrite=False))
    except dcp.CheckpointException as err:  # every rank gets it, whichever rank's write failed
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        _interrupted(err)
        raise CheckpointError(
            f"saving step {step} failed{_failures(err)} ({_free(root)}); nothing of it was kept, and "
            f"{_newest_line(root)}"
        ) from None
    # Each rank sums a share of the files (the rank that wrote a file may not be the one that
    # reads it back, so the share is by index: the work is spread, the result the same).
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    try:
        mine: dict[str, Any] = {n: _file_sum(staging / n) for i, n in enumerate(files) if i % world == rank}
    except OSError as err:  # reading back what was just written: every rank must hear of it
        mine = {"": f"rank {rank} could not read it back: {err}"}
    shares = _gather(runner, mine, f"the checksums of step {step}")
    sums = {k: v for share in shares for k, v in share.items()}
    problem = sums.pop("", None)
    warning = None
    if rank == 0 and problem is None:
        try:
            warning = _commit(root, staging, final, step, sums)
        except OSError as err:
            problem = str(err)
    if rank == 0 and problem is not None:
        shutil.rmtree(staging, ignore_errors=True)
        problem = f"saving step {step} failed: {problem} ({_free(root)}); nothing of it was kept, and {_newest_line(root)}"
    problem = _from_rank0(runner, problem, f"the renaming of step {step} into place")
    if problem:
        raise CheckpointError(problem)
    if warning:
        print(f"vlmcompile: warning: {warning}", file=sys.stderr, flush=True)
    return str(final)


def _commit(root: Path, staging: Path, final: Path, step: int, sums: dict[str, dict[str, int]]) -> str | None:
    """Make ``staging`` the checkpoint of ``step``: its manifest, then the rename, then
    ``latest``; each durable before the next (a crash between leaves the previous state).
    Raises before the rename (nothing saved); after it the step is saved, and a ``latest`` that
    could not be moved is a warning (returned): a resume does not read it."""
    sums[".metadata"] = _file_sum(staging / ".metadata")
    manifest = {"schema": _MANIFEST_SCHEMA, "version": 1, "step": step, "files": dict(sorted(sums.items()))}
    write_durably(staging / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    _fsync_dir(staging)
    os.rename(staging, final)
    try:
        _fsync_dir(root)
        write_durably(root / LATEST, final.name + "\n")
    except OSError as err:
        return (
            f"saved {final}, but {root / LATEST} could not be moved to it ({err}); a resume finds it anyway"
        )
    return None


def write_durably(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file, flushed to disk, renamed over it."""
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    with open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_sum(path: Path) -> dict[str, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, "crc32": crc}


def problems(path: str | Path, *, checksums: bool = True) -> list[str]:
    """What is wrong with the checkpoint at ``path`` (nothing: an empty list): a missing or
    unreadable manifest, a file missing, of another size or (``checksums``) with other bytes
    than when it was saved."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("schema") != _MANIFEST_SCHEMA or not isinstance(files, dict):
            raise ValueError(manifest.get("schema"))
    except FileNotFoundError:
        return [
            f"it has no {MANIFEST} (an unfinished save, or one by a vlmcompile older than checksummed "
            "checkpoints, which cannot be checked)"
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"its {MANIFEST} is not one vlmcompile wrote"]
    out = []
    for name, saved in files.items():
        file = path / name
        if not file.is_file():
            out.append(f"{name} is missing")
            continue
        size = file.stat().st_size
        if size != saved["bytes"]:
            out.append(f"{name} has {size} bytes, not the {saved['bytes']} saved")
        elif checksums and _file_sum(file)["crc32"] != saved["crc32"]:
            out.append(f"{name} has other bytes than were saved (its CRC-32 differs)")
    return out


def newest(directory: str | Path, *, intact: bool = False) -> tuple[Path | None, str]:
    """The newest checkpoint of a run's directory, checked whole (every file's checksum), and a
    line saying why it is the one or why there is none. ``latest`` is not trusted for this: a
    newer step may have been saved after it was last written. A newest checkpoint that is damaged
    is refused, naming what is wrong and the newest intact one (``intact``: the newest intact one
    is the answer, its line naming the damaged ones passed over)."""
    root = Path(directory)
    if not root.exists():
        return None, f"{root} does not exist"
    steps = steps_in(root)
    if not steps:
        return None, f"{root} holds no checkpoint"
    step, path = steps[-1]
    bad = problems(path)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        good = next((p for _, p in reversed(steps[:-1]) if not problems(p)), None)
        then = (
            f"the newest intact checkpoint is {good}: move {path.name} out of {root} and resume again"
            if good
            else f"{root} holds no intact checkpoint before it: start again without resuming (overwrite)"
        )
        if intact and good is not None:
            return good, f"the newest intact checkpoint in {root} ({path} is damaged: {bad[0]}{more})"
        raise CheckpointError(f"the newest checkpoint {path} is damaged: {bad[0]}{more}; {then}")
    why = f"the newest checkpoint in {root}"
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else None
    if named is None:
        why += f" (it has no {LATEST} pointer)"
    elif named != path.name:
        missing = "" if (root / named).is_dir() else ", which is not there"
        why += f" ({LATEST} names {named}{missing})"
    return path, why


def _free(root: Path) -> str:
    """The free space where a save failed: a full disk shows in torch's writer as a bare
    "unexpected pos" error."""
    try:
        return f"{root} has {shutil.disk_usage(root).free / 2**20:.1f} MiB free"
    except OSError:
        return f"{root} cannot be read"


def _newest_line(root: Path) -> str:
    """The checkpoint a run would go on from, for an error's last words (its files' sizes
    checked, not their checksums: an error path reads no checkpoint whole)."""
    path = next((p for _, p in reversed(steps_in(root)) if not problems(p, checksums=False)), None)
    return f"the newest checkpoint is {path}" if path else f"{root} holds no checkpoint"


def keep_newest(directory: str | Path, keep: int | None) -> list[str]:
    """Remove all but the ``keep`` newest step directories of ``directory`` (call on one rank,
    after :func:`save`); returns what was removed."""
    if keep is None:
        return []
    removed = []
    for _, path in steps_in(directory)[:-keep]:
        shutil.rmtree(path)
        removed.append(str(path))
    return removed


def resolve(path: str | Path) -> Path:
    """A checkpoint's step directory: ``path`` itself, or a run directory's newest intact one
    (a warning names any newer one passed over as damaged); checked whole either way."""
    path = Path(path)
    if _STEP_DIR.match(path.name) or (path / MANIFEST).exists() or (path / ".metadata").exists():
        bad = problems(path)
        if bad:
            raise CheckpointError(f"{path} is not a usable checkpoint: {'; '.join(bad[:3])}")
        return path
    found, why = newest(path, intact=True)
    if found is None:
        raise CheckpointError(f"{why}; give a step_NNNNNN directory or a run's checkpoint directory")
    if found != steps_in(path)[-1][1]:  # newer ones are damaged
        warnings.warn(f"reading {found}, {why}", stacklevel=3)
    return found


@contextmanager
def _peers_blamed(runner, what: str) -> Iterator[None]:
    """DCP's collectives wait on the default group with its timeout: one that times out is a peer
    lost, reported as the runner's own waits report it (so a rank hung in a save is named)."""
    try:
        yield
    except RuntimeError as err:
        raise runner._lost(f"waiting for the other ranks while {what}", err, None) from None


def _gather(runner, value: Any, what: str) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    with _peers_blamed(runner, f"gathering {what}"):
        dist.all_gather_object(out, value)
    return out


def _from_rank0(runner, value: Any, what: str) -> Any:
    """Rank 0's ``value`` on every rank: a decision all must act on alike."""
    box = [value]
    with _peers_blamed(runner, f"receiving {what} from rank 0"):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _interrupted(err: CheckpointException) -> None:
    """A stop signal DCP caught inside a rank's own step (it wraps any BaseException) stops the
    run at once, as it would anywhere else."""
    for exc, _ in err.failures.values():
        if isinstance(exc, KeyboardInterrupt):
            raise exc from None


def _failures(err: CheckpointException) -> str:
    """DCP's per-rank failures in one line (its own message is every rank's traceback)."""
    parts = [
        f"rank {rank}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        for rank, (exc, _) in sorted(err.failures.items())
    ]
    return f" on {'; '.join(parts)}" if parts else ""


def _refuse_non_finite(runner, step: int) -> None:
    """No checkpoint holds a NaN or an infinity: they would be resumed from."""
    bad = sorted(
        name
        for name, p in runner.named_state().items()
        if p.is_floating_point() and not torch.isfinite(p).all()
    )
    found = [name for share in _gather(runner, bad[:3], f"the finite check of step {step}") for name in share]
    if found:
        raise CheckpointError(
            f"not saving step {step}: parameters hold NaN or infinite values ({', '.join(sorted(set(found))[:5])}); "
            "the checkpoints saved before stay as they are"
        )


def load(path: str | Path, runner, optimizer, scheduler, schedule: dict | None = None) -> int:
    """Load this rank's share of the checkpoint at ``path`` into the runner's parameters, the
    optimizer and the scheduler (every rank calls it); returns the checkpoint's step. ``path``
    was checked whole before (:func:`newest` or :func:`resolve`, on one process): here each rank
    checks only that its files are all there, at their sizes."""
    import torch.distributed.checkpoint as dcp

    # Agreed before DCP's collectives: a rank that refused alone would leave the others waiting.
    try:
        bad = problems(path, checksums=False)
        mine = f"rank {dist.get_rank()}: {bad[0]}" if bad else None
    except OSError as err:
        mine = f"rank {dist.get_rank()}: {err}"
    found = [x for x in _gather(runner, mine, f"the check of {path}") if x]
    if found:
        raise CheckpointError(f"the checkpoint {path} changed since it was checked: {found[0]}")
    stored, paths = _entries(path)
    # Outputs a frozen encoder made a batch ahead were made with the weights being replaced.
    runner.drop_carried()
    params = runner.named_state()
    model_names = (
        {alias for aliases in runner.state_names.values() for alias in aliases}
        if runner.state_names is not None
        else None
    )
    check_fits(
        stored, {f"model.{n}": (tuple(p.shape), p.dtype) for n, p in params.items()}, path, model_names
    )
    state: dict[str, Any] = {"model": {n: p.detach() for n, p in params.items()}, "optimizer": {}}
    names = _canonical_names(runner)
    optimizer_entries: dict[str, dict[str, Any]] = {}
    for key, meta in stored.items():
        if paths[key][0] == "optimizer" and len(paths[key]) == 3:
            optimizer_entries.setdefault(paths[key][1], {})[paths[key][2]] = meta
    for p in _optimizer_params(optimizer):
        if not holds_state(optimizer, p):
            continue  # ZeRO-1: another rank of the group loads it
        name = names[id(p)]
        state["optimizer"][name] = {
            key: _placeholder(meta, "cpu" if key == "step" else p.device)
            for key, meta in optimizer_entries.get(name, {}).items()
        }
    # Checkpoints saved before the data's place was kept have no "data".
    state["trainer"] = {k: v for k, v in _TRAINER.items() if f"trainer.{k}" in stored}
    try:
        with _peers_blamed(runner, f"loading the checkpoint {path}"):
            dcp.load(state, checkpoint_id=str(path))
    except dcp.CheckpointException as err:
        _interrupted(err)
        raise CheckpointError(f"loading the checkpoint {path} failed{_failures(err)}") from None
    saved_schedule = json.loads(state["trainer"]["schedule"])
    if schedule is not None and saved_schedule and saved_schedule != schedule:
        differ = ", ".join(
            f"{k} {saved_schedule.get(k)!r} (now {schedule.get(k)!r})"
            for k in sorted(set(saved_schedule) | set(schedule))
            if saved_schedule.get(k) != schedule.get(k)
        )
        raise CheckpointError(
            f"the checkpoint {path} was trained with another LR schedule: {differ}. Resume with the same "
            "(to run past the planned steps, keep --decay-steps at the first run's)"
        )
    index = {id(p): i for i, p in enumerate(_optimizer_params(optimizer))}
    optimizer.load_state_dict(
        {
            "state": {
                index[id(p)]: state["optimizer"][names[id(p)]]
                for p in _optimizer_params(optimizer)
                if state["optimizer"].get(names[id(p)])
            },
            "param_groups": param_groups(optimizer),
        }
    )
    if scheduler is not None and state["trainer"]["scheduler"]:
        scheduler.load_state_dict(
            _per_group(json.loads(state["trainer"]["scheduler"]), len(optimizer.param_groups), path)
        )
        # The scheduler sets the groups' LR only when it steps: the next step's LR is its last.
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    return int(state["trainer"]["step"])


_TRAINER = {"step": 0, "scheduler": "", "schedule": "{}", "data": "{}"}
"""What a checkpoint keeps of the training loop, with the value of a checkpoint that lacks it."""


def saved_data(path: str | Path) -> dict[str, Any]:
    """Where the run saved at ``path`` (a step directory checked before) left its data: what
    :func:`save` was given (empty for data that keeps no place, or an older checkpoint). Read
    in one process, before any rank starts."""
    stored, _ = _entries(path)
    if "trainer.data" not in stored:
        return {}
    state = {"trainer": {"data": ""}}
    _load_here(state, path)
    return json.loads(state["trainer"]["data"] or "{}")


def _load_here(state: dict[str, Any], path: str | Path) -> None:
    """DCP's load of ``state`` (what it names, in place) from ``path``, in this process alone."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process on purpose: DCP warns that it is not distributed
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
        except dcp.CheckpointException as err:
            raise CheckpointError(f"loading the checkpoint {path} failed{_failures(err)}") from None


@user_facing
def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The whole checkpoint in one process (no torch.distributed needed): ``{"model": state dict
    under the original names, "optimizer": {name: {state: tensor}}, "step": int}``. ``path`` is a
    step directory, or a run's checkpoint directory (its newest intact checkpoint is read); every
    file is checked against the manifest first. The model part loads into the original model:
    ``model.load_state_dict(load_checkpoint(path)["model"])``."""
    path = resolve(path)
    metadata = _read_metadata(path)
    nested: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        where = nested
        *parents, leaf = metadata.planner_data[key]
        for part in parents:
            where = where.setdefault(part, {})
        where[leaf] = _placeholder(meta, "cpu")
    _load_here(nested, path)
    return {
        "model": nested.get("model", {}),
        "optimizer": nested.get("optimizer", {}),
        "step": int(nested.get("trainer", {}).get("step", 0)),
    }


def check_fits(
    stored: dict[str, Any], expected: dict[str, tuple], path, model_names: set[str] | None = None
) -> None:
    """Refuse a checkpoint that lacks a tensor this rank holds, has it in another shape, or holds
    tensors the model (all of ``model_names``, when known) does not have."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    missing = sorted(k[len("model.") :] for k in expected if k not in stored)
    shapes = sorted(
        f"{k[len('model.') :]} (checkpoint {list(stored[k].size)}, model {list(shape)})"
        for k, (shape, _) in expected.items()
        if isinstance(stored.get(k), TensorStorageMetadata) and tuple(stored[k].size) != shape
    )
    extra = []
    if model_names is not None:
        extra = sorted(
            k[len("model.") :]
            for k in stored
            if k.startswith("model.") and k[len("model.") :] not in model_names
        )
    problems = [
        f"{len(names)} {what} ({sep.join(names[:5])}{sep + '...' if len(names) > 5 else ''})"
        for names, what, sep in (
            (missing, "parameters missing from it", ", "),
            (shapes, "of other shapes", "; "),
            (extra, "tensors the model does not have", ", "),
        )
        if names
    ]
    if problems:
        raise CheckpointError(
            f"the checkpoint {path} is not of this model: {' and '.join(problems)}. Resume from a checkpoint of "
            "the same model (any plan of it), or start without --resume"
        )


def _per_group(saved: dict[str, Any], groups: int, path) -> dict[str, Any]:
    """A scheduler's state with one entry a parameter group, for ``groups`` groups. A rank's
    optimizer has one group per set of ranks its states are sharded over, so the saving rank's
    count may differ from this one's; entries that are one value for every group stand for any
    count of groups."""
    out = dict(saved)
    for key, value in saved.items():
        if not isinstance(value, list) or len(value) in (0, groups):
            continue
        if any(v != value[0] for v in value):
            raise CheckpointError(
                f"the checkpoint {path} holds an LR schedule of {len(value)} parameter groups with different "
                f"{key}; this rank's optimizer has {groups}: resume with the plan it was saved under"
            )
        out[key] = value[:1] * groups
    return out


def _scheduler_json(scheduler) -> str:
    # A JSON string: DCP would flatten a nested dict into keys a later load must name one by one.
    if scheduler is None:
        return ""
    try:
        return json.dumps(scheduler.state_dict())
    except TypeError as err:
        raise CheckpointError(
            f"the LR scheduler's state ({type(scheduler).__name__}) is not JSON ({err}); use a scheduler "
            "whose state_dict() holds numbers, lists and dicts (LambdaLR, CosineAnnealingLR, ...)"
        ) from None


def _entries(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple]]:
    """Every stored entry's metadata (tensors, and the Python values an optimizer may keep) and
    its path in the saved state (``("optimizer", name, key)``)."""
    metadata = _read_metadata(path)
    return dict(metadata.state_dict_metadata), dict(metadata.planner_data)


def _read_metadata(path: str | Path):
    import torch.distributed.checkpoint as dcp

    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - unpickling a damaged file raises anything
        raise CheckpointError(
            f"the checkpoint {path} has unreadable metadata: {type(err).__name__}: {err}"
        ) from None


def _placeholder(meta, device) -> torch.Tensor | None:
    """What DCP loads an entry into: a tensor of its shape, or None for a Python value."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if isinstance(meta, TensorStorageMetadata):
        return torch.empty(meta.size, dtype=meta.properties.dtype, device=device)
    return None


def _canonical_names(runner) -> dict[int, str]:
    """id(parameter) -> the one original name its optimizer state is saved under (a tied
    parameter has several: the first in sorted order, the same on every rank that holds it)."""
    out: dict[int, str] = {}
    for name, p in sorted(runner.named_state().items()):
        if isinstance(p, torch.nn.Parameter):
            out.setdefault(id(p), name)
    return out


def _optimizer_params(optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _optimizer_state(runner, optimizer) -> dict[str, dict[str, Any]]:
    names = _canonical_names(runner)
    held = local_states(optimizer)  # under ZeRO-1, each rank saves the states it owns
    out = {}
    for p in _optimizer_params(optimizer):
        if id(p) not in names:
            raise CheckpointError(
                "the optimizer holds a parameter that is not the pipeline's: build it from runner.parameters()"
            )
        state = held.get(p)
        if state:
            out[names[id(p)]] = dict(state)
    return out
