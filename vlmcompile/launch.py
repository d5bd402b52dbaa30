"""Start N local ranks (one process and one thread each, gloo over 127.0.0.1) and run a function
on each, for demos and tests; ``torchrun`` does the same job on a real cluster.

No hang, ever: every collective in the ranks has a timeout, and the launcher watches the
processes. When a rank dies, the others fail their next wait on it and exit; a rank still
alive ``timeout_s`` + 10 s after the first failure is killed. The error names the rank that
died first, how (exit code or signal), and what every other rank said.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlmcompile.errors import VlmCompileError

GRACE_S = 10.0


class LaunchError(VlmCompileError, RuntimeError):
    """A rank failed; the message says which died first and what the others reported."""

    def __init__(self, message: str, first_failed: int, exit_codes: dict[int, int | None]):
        super().__init__(message)
        self.first_failed = first_failed
        self.exit_codes = exit_codes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, nprocs, port, fn, payload, args, results, timeout_s) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
    )
    code = 0
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=nprocs, timeout=datetime.timedelta(seconds=timeout_s)
        )
        # Plain pickles: torch's queue would share tensors by file descriptor, which dies with
        # the process that made them.
        results.put((rank, True, pickle.dumps(fn(pickle.loads(payload), *args))))
    except BaseException as err:  # report anything, then exit non-zero
        frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
        where = f" (at {frame.filename}:{frame.lineno})" if frame else ""
        results.put((rank, False, f"{type(err).__name__}: {err}{where}"))
        code = 1
    results.close()
    results.join_thread()
    # Skip interpreter teardown: a process group whose peer died can block in its destructor.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _how(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited {code}"


def launch(
    fn: Callable[..., Any],
    payload: Any,
    nprocs: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 60.0,
    limit_s: float | None = None,
) -> list[Any]:
    """Run ``fn(payload, *args)`` on ``nprocs`` local ranks with torch.distributed initialised
    (gloo); return each rank's result, in rank order.

    Args:
        fn: a module-level function (it is pickled into each process).
        payload: what every rank gets first (e.g. a :class:`~vlmcompile.runtime.PipelineRunner`).
        timeout_s: the timeout of every collective in the ranks.
        limit_s: wall-clock bound on the whole run (None: no bound while every rank is healthy).

    Raises:
        LaunchError: a rank raised, died or had to be killed.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs}; start at least one rank")
    ctx = mp.get_context("spawn")
    blob = pickle.dumps(payload)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, nprocs, port, fn, blob, tuple(args), results, timeout_s),
            name=f"vlmcompile-rank{rank}",
        )
        for rank in range(nprocs)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    ended: dict[int, float] = {}
    killed: set[int] = set()
    first_failure: float | None = None
    while len(ended) < nprocs:
        try:
            rank, ok, value = results.get(timeout=0.1)
            (values if ok else errors)[rank] = pickle.loads(value) if ok else value
        except queue_mod.Empty:
            pass
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if rank not in ended and p.exitcode is not None:
                ended[rank] = now - start
                if p.exitcode != 0 and first_failure is None:
                    first_failure = now
        over_limit = limit_s is not None and now - start > limit_s
        stuck = first_failure is not None and now - first_failure > timeout_s + GRACE_S
        if over_limit or stuck:
            for rank, p in enumerate(procs):
                if p.exitcode is None:
                    p.kill()
                    killed.add(rank)
            for p in procs:
                p.join(5)
    while True:  # results put just before exiting
        try:
            rank, ok, value = results.get(timeout=0.2)
            (values if ok else errors)[rank] = pickle.loads(value) if ok else value
        except queue_mod.Empty:
            break
    codes = {rank: p.exitcode for rank, p in enumerate(procs)}
    if all(c == 0 for c in codes.values()) and len(values) == nprocs:
        return [values[r] for r in range(nprocs)]

    failed = [r for r in range(nprocs) if codes[r] != 0 or r not in values]
    # The rank that went first: one that died without reporting an error, else the earliest to end.
    silent = [r for r in failed if r not in errors and r not in killed]
    first = min(silent or failed, key=lambda r: ended.get(r, float("inf")))
    lines = [f"rank {first} failed first: {_how(codes[first])} after {ended.get(first, 0):.1f} s"]
    for r in range(nprocs):
        if r in killed:
            lines.append(
                f"  rank {r}: killed by the launcher, {timeout_s + GRACE_S:.0f} s after the first failure"
            )
        elif r in errors:
            lines.append(f"  rank {r}: {_how(codes[r])} after {ended[r]:.1f} s: {errors[r].strip()}")
        elif codes[r] != 0:
            lines.append(f"  rank {r}: {_how(codes[r])} after {ended.get(r, 0):.1f} s without a report")
        else:
            lines.append(f"  rank {r}: finished")
    if limit_s is not None and time.monotonic() - start > limit_s and not errors:
        lines.insert(0, f"the ranks ran past the {limit_s:.0f} s limit")
    raise LaunchError("\n".join(lines), first, codes)
