"""Stop requests. Job schedulers send SIGTERM (or SIGUSR1, ahead of a kill) to preempt a job: a
training run then finishes the step in flight, saves a checkpoint and exits, instead of losing
every step since its last save. A second signal stops at once.

On local ranks the launching process receives the signal and passes it on to every rank as
SIGUSR1 (the ranks are born ignoring it, and listen from their first line); under torchrun each
rank receives it from torchrun. The ranks agree on the step to stop after through the step's own
gradient-norm all-reduce, so they all stop after the same step.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator, Sequence

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_requested = 0
"""The first stop signal this process received (0: none)."""
_requested_at = 0.0
SAME_REQUEST_S = 1.0
"""A second signal this soon after the first is the same request delivered twice (a scheduler
signals every process of the job, and torchrun passes its own on to its ranks as well)."""


class Interrupted(KeyboardInterrupt):
    """A stop signal that ends the work at once; every rank was stopped before this was raised
    in a launching process."""

    def __init__(self, signum: int):
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.signal_name}")


def requested() -> int:
    """The stop signal received so far (0: none)."""
    return _requested


def note(signum: int, frame=None) -> None:
    """A signal handler that records the first stop request and leaves the rest alone."""
    global _requested, _requested_at
    if not _requested:
        _requested, _requested_at = signum, time.monotonic()


def _note_or_stop(signum: int, frame=None) -> None:
    if _requested and time.monotonic() - _requested_at > SAME_REQUEST_S:
        raise Interrupted(signum)
    note(signum)


STOP_REQUEST_HANDLERS = (note, _note_or_stop)
"""The handlers that take a signal as a stop request (what a launcher must not discard)."""


@contextlib.contextmanager
def stop_requests(
    signals: Sequence[int] = PREEMPTION_SIGNALS, *, second_stops: bool = True
) -> Iterator[None]:
    """Inside, the first of ``signals`` is a stop request (:func:`requested`), and a second one
    (more than :data:`SAME_REQUEST_S` later) raises :class:`Interrupted` (``second_stops``) or is
    ignored. Main thread only (elsewhere
    signals cannot be handled and this does nothing); the request is forgotten on leaving."""
    global _requested
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = _note_or_stop if second_stops else note
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        _requested = 0
