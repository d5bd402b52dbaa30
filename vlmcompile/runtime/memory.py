"""Each rank's peak tensor memory over a training step, measured, to hold against the plan's
prediction (not the process's resident set, which counts the libraries and only grows).

On a GPU it is torch's allocator statistics (``max_memory_allocated``), free to read every step.
On a CPU torch keeps no statistics; its CPU allocator reports each allocation and free to the
profiler while one records memory. :class:`StepMemory` records over the step and takes the
largest total that allocator accounted for, above what it held when recording began, plus the
bytes of the tensors held before the step (parameters, buffers, gradients, optimizer states):
the allocator accounts only for blocks it saw allocated while recording. Recording costs time
(a step of a tiny model took 1.6x), so a run measures its CPU steps where asked
(:attr:`~vlmcompile.runtime.train_loop.TrainConfig.measure_memory`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator

import torch


class StepMemory:
    """The peak tensor bytes of one window of a step on ``device``, or None where not measured."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes: int | None = None

    @contextlib.contextmanager
    def window(self, measure: bool, held: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Measure the code within (``held``: the tensors alive before it, on a CPU)."""
        self.peak_bytes = None
        if not measure:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        before = held_bytes(held)
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        with _profiler_lines_dropped():
            profiler.start()
            try:
                yield
            finally:
                profiler.stop()
        self.peak_bytes = before + allocated_peak(profiler)


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each storage once (views and tied parameters share one)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def allocated_peak(profiler: torch.profiler.profile) -> int:
    """The most CPU bytes allocated while ``profiler`` recorded, above what the allocator
    accounted for when it began (from its memory events, in time order)."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            events.append(event)
    if not events:
        return 0
    events.sort(key=lambda e: e.start_time_ns)
    first = events[0].extra_fields
    base = first.total_allocated - first.alloc_size
    return max(0, max(e.extra_fields.total_allocated for e in events) - base)


NOISE = (
    "SyncActivityProfilerHandler.cpp",  # Kineto's "profiler_start" and "profiler_stop" lines
    "Memory block of unknown size was allocated before the profiling started",  # a free the profiler did not see allocated
)
"""What the profiler writes to stderr on every step it records, which says nothing to a user."""


@contextlib.contextmanager
def _profiler_lines_dropped() -> Iterator[None]:
    """Within, what is written to file descriptor 2 (C++ logging writes there directly) goes to
    a file; after, its lines go on to stderr, but for the profiler's own (:data:`NOISE`)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                line
                for line in held.read().decode(errors="replace").splitlines(True)
                if not any(n in line for n in NOISE)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
