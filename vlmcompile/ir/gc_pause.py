"""Python's automatic garbage collection paused over work that must not stall.

A collection of the whole heap takes tens to hundreds of milliseconds in a process that holds a
model, its stage modules and their autograd graphs, and it lands wherever the allocation count
happens to cross its threshold: inside a per-batch re-planning with a time limit, or inside one
rank's training step, which then holds every other rank up. Megatron-LM's ``--manual-gc`` pauses
it for the same reason and collects between steps instead."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collection_deferred():
    """Automatic collection paused for the block; the garbage is collected when it resumes. A
    caller that had paused it keeps it paused."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
