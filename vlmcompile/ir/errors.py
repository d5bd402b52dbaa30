"""Errors raised for bad user input. Each message names the value at fault and what to do."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


class VlmCompileError(Exception):
    """Base class of every error vlmcompile raises for bad input."""


class CaptureError(VlmCompileError):
    """The model could not be captured as an FX graph."""


class SampleBatchError(VlmCompileError):
    """The sample batch does not fit the model's forward signature."""


class DataError(VlmCompileError, ValueError):
    """A sample, dataset or manifest that cannot be planned for or trained on (its message names
    the sample and what to do)."""


class RegionError(VlmCompileError):
    """Regions (vision, projector, llm, head) could not be assigned to the model's layers."""


class ModelError(VlmCompileError):
    """The model itself cannot be compiled (no parameters, unknown zoo name, ...)."""


class PassError(VlmCompileError):
    """A compiler pass failed; the message names the pass and the passes that ran before it."""

    def __init__(self, pass_name: str, index: int, passes_run: list[str], cause: BaseException):
        self.pass_name = pass_name
        self.index = index
        self.passes_run = list(passes_run)
        self.cause = cause
        ran = ", ".join(passes_run) if passes_run else "none"
        super().__init__(
            f"pass {index} '{pass_name}' failed ({type(cause).__name__}: {cause}); passes already run: {ran}"
        )


class ClusterError(VlmCompileError, ValueError):
    """A cluster description or preset is unknown or inconsistent."""


class PlanError(VlmCompileError, ValueError):
    """A plan is malformed: a layer in no stage, a missing action, a deadlock, memory over the limit."""


class ArgumentError(VlmCompileError, ValueError):
    """An argument of the API or the CLI is out of its range or of the wrong type."""


def positive_int(name: str, value: object, what: str) -> int:
    """``value`` if it is an integer >= 1; else an :class:`ArgumentError` naming ``name`` and saying
    what the number is (``what``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(f"{name}={value!r}; give {what} (an integer >= 1)")
    return value


def positive_number(name: str, value: object, what: str) -> float:
    """``value`` if it is a number > 0 (seconds, rates)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ArgumentError(f"{name}={value!r}; give {what} (a finite number > 0)")
    return float(value)


def choice(kind: type, value: Any, what: str) -> Any:
    """``value`` as a member of the str enum ``kind``, or a :class:`PlanError` naming it as ``what``
    and every member to choose from."""
    try:
        return kind(value)
    except ValueError:
        raise PlanError(
            f"{what} {value!r} is unknown; choose one of {', '.join(m.value for m in kind)}"
        ) from None


def enough_samples(count: int, global_batch: int) -> None:
    """Refuse a dataset of fewer samples than one global batch (planning and training alike: a
    step would hold some sample twice)."""
    if count < global_batch:
        raise DataError(
            f"the dataset holds {count} samples, fewer than global_batch={global_batch}; give at least "
            f"{global_batch} samples, or a global batch of at most {count}"
        )


TRACEBACK_ENV = "VLMCOMPILE_TRACEBACK"
"""Set (to anything) to see the internal frames behind an error, to report a bug."""


def user_facing(function: _F) -> _F:
    """For the API's entry points: an error about the input (a :class:`VlmCompileError`) reaches
    the caller as one exception, without the internal frames it passed through or the
    exceptions it was raised from, since its message says what to fix. A :class:`PassError`
    (something unexpected inside a pass) and a :class:`CaptureError` (the model's own code could
    not be captured) keep them, as does any error with ``VLMCOMPILE_TRACEBACK`` set."""

    @functools.wraps(function)
    def entry(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except VlmCompileError as err:
            # Something unexpected in a pass, or a capture that failed inside the model's own code:
            # the frames behind those are what fixes them.
            if isinstance(err, (PassError, CaptureError)) or os.environ.get(TRACEBACK_ENV):
                raise
            raise err.with_traceback(None) from None

    return entry  # type: ignore[return-value]
