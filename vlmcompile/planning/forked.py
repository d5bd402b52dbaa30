"""Independent planning calls on every core at once.

Planning is Python: one process uses one core. :func:`forked_map` runs the first call in this
process and the others in forked worker processes, which inherit everything the calls read (the
layer graph, the cluster, caches), so only their answers are pickled back. Where the machine has
one core, or cannot fork, or this is a worker already, the calls run here one after the other.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Answer = TypeVar("Answer")

_CALL: Callable[[Any], Any] | None = None
"""The call of the workers being forked (set before they fork; nothing to pickle)."""
_IN_WORKER = False
"""This process is a worker: its calls run here (the cores are taken already)."""


@dataclass(frozen=True, slots=True)
class Outcome(Generic[Answer]):
    """One call's answer, or the error it raised (of the types the caller catches)."""

    answer: Answer | None = None
    error: BaseException | None = None


def forked_map(
    call: Callable[[Item], Answer],
    items: Sequence[Item],
    cores: int,
    catch: tuple[type[BaseException], ...] = (),
) -> list[Outcome[Answer]]:
    """``call(item)`` for every item, at most ``cores`` at once: the first here, the others in
    forked workers. Errors of the ``catch`` types are returned in their outcome; any other is
    raised (a worker's, once the calls here are done). Outcomes are in the items' order."""
    width = min(cores, len(items))
    if width <= 1 or not can_fork():
        return [_outcome(call, item, catch) for item in items]
    with forked_pool(call, width - 1) as pool:
        elsewhere = [pool.submit(call_in_worker, item) for item in items[1:]]
        here = _outcome(call, items[0], catch)
        there = []
        for future in elsewhere:
            error = future.exception()
            if error is not None and not isinstance(error, catch):
                raise error
            there.append(Outcome(error=error) if error is not None else Outcome(answer=future.result()))
    return [here, *there]


def can_fork() -> bool:
    """Whether calls may go to forked workers: the platform forks and this is no worker already
    (whose cores are taken)."""
    return not _IN_WORKER and "fork" in multiprocessing.get_all_start_methods()


def forked_pool(call: Callable[[Any], Any], width: int) -> ProcessPoolExecutor:
    """``width`` forked workers running ``call``: submit ``(call_in_worker, item)`` to them.
    The call is set before they fork (they inherit it; nothing to pickle but items and answers)."""
    global _CALL
    _CALL = call
    return ProcessPoolExecutor(width, mp_context=multiprocessing.get_context("fork"))


def call_in_worker(item: Any) -> Any:
    global _IN_WORKER
    _IN_WORKER = True
    return _CALL(item)


def _outcome(call: Callable[[Item], Answer], item: Item, catch: tuple[type[BaseException], ...]) -> Outcome:
    try:
        return Outcome(answer=call(item))
    except catch as err:
        return Outcome(error=err)
