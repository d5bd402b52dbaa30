"""What a training run keeps of itself in its checkpoints besides the weights: saving them (and
the steps done before a step that fails alike on every rank), and the place its data has reached,
to go on from after a resume."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vlmcompile.ir.errors import VlmCompileError
from vlmcompile.runtime import checkpoint
from vlmcompile.runtime.checkpoint_dir import Start

if TYPE_CHECKING:
    from vlmcompile.runtime.executor import PipelineRunner


@dataclass(slots=True)
class RunSaves:
    """A run's checkpoints: saving one (every rank alike), and saving the steps done before a
    step that fails alike on every rank."""

    config: Any
    """The run's :class:`~vlmcompile.runtime.train_loop.TrainConfig`."""
    runner: PipelineRunner
    opt: torch.optim.Optimizer
    sched: Any
    data: Any
    """The run's data (its place is kept in each checkpoint, where it has one)."""
    log: Any
    """The run's step log (says each save)."""
    start: Start
    alike: tuple[type[BaseException], ...]
    """Errors every rank raises alike at the same step (computed from the same data): the ones
    after which every rank can take part in a save. Any other error is raised as it is: a rank
    that failed alone must not start a collective the others never join."""
    saved: list[str] = field(default_factory=list)
    """Every checkpoint of the run, the one it resumed from first."""
    kept: list[str] = field(default_factory=list)
    """The ones this run saved that ``keep_last`` left."""
    newest_step: int = 0
    """The steps the newest checkpoint holds (the run's first step: nothing newer saved yet)."""

    def __post_init__(self):
        self.saved = [self.start.checkpoint] if self.start.checkpoint else []
        self.newest_step = self.start.step

    def save(self, done: int) -> str:
        """Checkpoint the state after ``done`` steps."""
        config, began = self.config, time.perf_counter()
        path = checkpoint.save(
            config.checkpoint_dir,
            done,
            self.runner,
            self.opt,
            self.sched,
            config.schedule,
            data_state(self.data, done - 1),
        )
        removed = (
            checkpoint.keep_newest(config.checkpoint_dir, config.keep_last) if self.runner.rank == 0 else []
        )
        self.saved.append(path)
        self.newest_step = done
        self.kept = [*self.kept, path][-(config.keep_last or 0) :]  # the ones still there
        self.log.saved(path, time.perf_counter() - began, removed)
        return path

    @contextlib.contextmanager
    def on_failure(self, step: int) -> Iterator[None]:
        """Where step ``step`` (0-based) fails alike on every rank (its data, a non-finite loss),
        the steps done before it are saved first (unless they were), and the error says so."""
        try:
            yield
        except self.alike as err:
            if not self.config.checkpoint_dir:
                note = "no checkpoint was saved (no checkpoint directory)"
            elif step == self.newest_step:  # the steps before it are saved already (or none ran)
                note = (
                    f"the newest checkpoint is {self.saved[-1]}, which holds the steps before it"
                    if self.saved
                    else "no step was trained, none saved"
                )
            else:
                try:
                    note = f"the steps before it were saved first: the newest checkpoint is {self.save(step)}"
                except VlmCompileError as failed:
                    note = f"saving the steps before it failed too: {failed}"
            raise type(err)(f"{err}; {note}") from None


def data_state(data: Any, step: int) -> dict[str, Any] | None:
    """Where the data goes on after step ``step`` (0-based), for a checkpoint (None: data that
    keeps no place, a function of the step)."""
    state = getattr(data, "state", None)
    return state(step) if callable(state) else None


def epochs_of(data: Any, steps: int) -> float | None:
    """Epochs of the dataset the first ``steps`` steps' stream reached (None: not a dataset's)."""
    epochs = getattr(data, "epochs", None)
    return epochs(steps) if callable(epochs) else None


def resumed_data(data: Any, start: Start) -> Any:
    """``data`` going on where the checkpoint ``start`` loads left it (its place in the dataset's
    stream, the samples it carried into the next step), with any global batch; data that keeps no
    place (a function of the step) as it is."""
    if start.checkpoint is None or not callable(getattr(data, "resumed", None)):
        return data
    state = checkpoint.saved_data(start.checkpoint)
    return data.resumed(start.step, state) if state else data
