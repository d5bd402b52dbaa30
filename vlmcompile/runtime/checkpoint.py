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

Layout: ``<dir>/step_000010/`` per save, and ``<dir>/latest`` naming the newest complete one
(written after every rank finished writing).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from vlmcompile.ir.errors import VlmCompileError

LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(VlmCompileError, ValueError):
    """A checkpoint that does not fit this model: the message names the parameters that differ."""


def save(directory: str | Path, step: int, runner, optimizer, scheduler, schedule: dict | None = None) -> str:
    """Save this rank's share at ``step`` (every rank calls it); returns the step's directory."""
    path = Path(directory) / f"step_{step:06d}"
    state = {
        "model": {name: p.detach() for name, p in runner.named_state().items()},
        "optimizer": _optimizer_state(runner, optimizer),
        "trainer": {
            "step": step,
            "scheduler": _scheduler_json(scheduler),
            "schedule": json.dumps(schedule or {}, sort_keys=True),
        },
    }
    # A run resumed from an earlier step writes its later steps again.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), overwrite=True))
    runner._wait(dist.barrier(async_op=True), "the barrier after saving a checkpoint")
    if dist.get_rank() == 0:  # written whole or not at all: a crash never leaves half a name
        pointer = Path(directory) / LATEST
        partial = pointer.with_suffix(".partial")
        partial.write_text(path.name + "\n")
        os.replace(partial, pointer)
    return str(path)


def latest_on_every_rank(directory: str | Path | None) -> str | None:
    """:func:`latest` as rank 0 sees it, on every rank: ranks reading the pointer each on their
    own could disagree (a file system's caches), and then only some would load."""
    found = [latest(directory) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    return found[0]


def latest(directory: str | Path | None) -> str | None:
    """The newest complete checkpoint in ``directory`` (None if there is none)."""
    if directory is None:
        return None
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    path = Path(directory) / pointer.read_text().strip()
    if not _STEP_DIR.match(path.name) or not (path / ".metadata").is_file():
        raise CheckpointError(f"{pointer} names {path}, which is not a complete checkpoint; remove {pointer}")
    return str(path)


def keep_newest(directory: str | Path, keep: int | None) -> list[str]:
    """Remove all but the ``keep`` newest step directories of ``directory`` (call on one rank,
    after :func:`save` moved the pointer); returns what was removed. The one ``latest`` names is
    always kept."""
    if keep is None:
        return []
    root = Path(directory)
    pointer = root / LATEST
    current = pointer.read_text().strip() if pointer.is_file() else None
    steps = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
    )
    removed = []
    for _, path in steps[:-keep]:
        if path.name != current:
            shutil.rmtree(path)
            removed.append(str(path))
    return removed


def resolve(path: str | Path) -> Path:
    """A checkpoint's step directory: ``path`` itself, or the one a run directory's ``latest``
    names."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    found = latest(path)
    if found is not None:
        return Path(found)
    steps = sorted(p.name for p in path.iterdir() if _STEP_DIR.match(p.name)) if path.is_dir() else []
    raise CheckpointError(
        f"{path} is not a checkpoint: it has no .metadata"
        + (f" and no {LATEST} pointer (it holds {', '.join(steps)}: give one of them)" if steps else "")
        + "; give a step_NNNNNN directory or the run's checkpoint directory"
    )


def load(path: str | Path, runner, optimizer, scheduler, schedule: dict | None = None) -> int:
    """Load this rank's share of the checkpoint at ``path`` into the runner's parameters, the
    optimizer and the scheduler (every rank calls it); returns the checkpoint's step."""
    stored, paths = _entries(path)
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
        name = names[id(p)]
        state["optimizer"][name] = {
            key: _placeholder(meta, "cpu" if key == "step" else p.device)
            for key, meta in optimizer_entries.get(name, {}).items()
        }
    state["trainer"] = {"step": 0, "scheduler": "", "schedule": "{}"}
    dcp.load(state, checkpoint_id=str(path))
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
            "param_groups": optimizer.state_dict()["param_groups"],
        }
    )
    if scheduler is not None and state["trainer"]["scheduler"]:
        scheduler.load_state_dict(json.loads(state["trainer"]["scheduler"]))
        # The scheduler sets the groups' LR only when it steps: the next step's LR is its last.
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    return int(state["trainer"]["step"])


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The whole checkpoint in one process (no torch.distributed needed): ``{"model": state dict
    under the original names, "optimizer": {name: {state: tensor}}, "step": int}``. ``path`` is a
    step directory, or a run's checkpoint directory (its ``latest`` is read). The model part loads
    into the original model: ``model.load_state_dict(load_checkpoint(path)["model"])``."""
    path = resolve(path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    nested: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        where = nested
        *parents, leaf = metadata.planner_data[key]
        for part in parents:
            where = where.setdefault(part, {})
        where[leaf] = _placeholder(meta, "cpu")
    with warnings.catch_warnings():  # one process on purpose: DCP warns that it is not distributed
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(nested, checkpoint_id=str(path), no_dist=True)
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
    path = resolve(path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return dict(metadata.state_dict_metadata), dict(metadata.planner_data)


def _placeholder(meta, device) -> torch.Tensor | None:
    """What DCP loads an entry into: a tensor of its shape, or None for a Python value."""
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
    out = {}
    for p in _optimizer_params(optimizer):
        if id(p) not in names:
            raise CheckpointError(
                "the optimizer holds a parameter that is not the pipeline's: build it from runner.parameters()"
            )
        state = optimizer.state.get(p)
        if state:
            out[names[id(p)]] = dict(state)
    return out
