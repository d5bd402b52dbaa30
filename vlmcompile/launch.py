"""Start N local ranks (one process and one thread each, gloo over 127.0.0.1) and run a function
on each, for demos and tests; ``torchrun`` does the same job on a real cluster.

No hang and no orphan, ever:

* every collective in the ranks has a timeout, and the launcher watches the processes. When a
  rank fails, the others are given ``GRACE_S`` to report what they saw, then killed; a rank
  that hangs is found by the peer that times out waiting for it, and the error blames the hung
  rank, not the one that timed out.
* SIGINT and SIGTERM of the launching process stop every rank before it exits
  (:class:`Interrupted`); the ranks ignore SIGINT (a terminal's Ctrl-C reaches the whole
  process group, and the launcher alone reports it), and a rank whose launcher disappears
  (SIGKILL) exits on its own.
* nothing listens beyond this machine: the rendezvous store and gloo bind 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import pickle
import queue as queue_mod
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlmcompile.errors import ArgumentError, VlmCompileError, positive_int, positive_number

GRACE_S = 5.0
"""How long ranks still running after the first failure get to report before they are killed."""
MAX_LOCAL_RANKS = 64
"""More local ranks than this is a plan for a cluster, not for this machine: use torchrun."""
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class LaunchError(VlmCompileError, RuntimeError):
    """A rank failed; the message says which failed first and what the others reported."""

    def __init__(self, message: str, first_failed: int, exit_codes: dict[int, int | None]):
        super().__init__(message)
        self.first_failed = first_failed
        self.exit_codes = exit_codes


class Interrupted(KeyboardInterrupt):
    """The launching process got SIGINT or SIGTERM; every rank was stopped before this was raised."""

    def __init__(self, signum: int):
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.signal_name}")


def interrupt_on_stop_signals() -> dict[int, Any]:
    """Make SIGINT and SIGTERM raise :class:`Interrupted` in the main thread; returns the previous
    handlers (give them to :func:`restore_signals`). Installing them again also repairs the C-level
    SIGINT handler, which native libraries may have left at the default."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for signum in _STOP_SIGNALS:
        previous[signum] = signal.getsignal(signum)
        signal.signal(signum, _raise_interrupted)
    return previous


def restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n in ("lo", "lo0")), None)


def _listening_socket() -> socket.socket:
    """The rendezvous store's socket, bound to 127.0.0.1 on a free port and kept open until rank 0
    owns it, so no other process can take the port in between."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def _die_with_parent(parent_pid: int) -> None:
    """Exit when the launcher disappears: the kernel's parent-death signal on Linux, and a watchdog
    thread everywhere (it also covers a parent that died before the signal was armed)."""
    try:
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(70)
            time.sleep(0.5)

    threading.Thread(target=watch, name="vlmcompile-parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:
        os._exit(70)


def _rank_main(rank, nprocs, store_socket, port, parent_pid, fn, work, results, timeout_s) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        payload, args = pickle.loads(work.recv_bytes())
    except (EOFError, OSError):
        os._exit(1)  # the launcher stopped before it sent the work
    torch.set_num_threads(1)
    env = dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
    )
    lo = loopback_interface()
    if lo is not None:
        env["GLOO_SOCKET_IFNAME"] = lo  # gloo's own listening sockets on 127.0.0.1 too
    os.environ.update(env)
    code = 0
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            store = dist.TCPStore(
                "127.0.0.1", port, nprocs, True, timeout, master_listen_fd=store_socket.detach()
            )
        else:
            store = dist.TCPStore("127.0.0.1", port, nprocs, False, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=nprocs, timeout=timeout)
        # Plain pickles: torch's queue would share tensors by file descriptor, which dies with
        # the process that made them.
        results.put((rank, True, pickle.dumps(fn(payload, *args)), None))
    except BaseException as err:  # report anything, then exit non-zero
        frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
        where = f" (at {frame.filename}:{frame.lineno})" if frame else ""
        results.put((rank, False, f"{type(err).__name__}: {err}{where}", getattr(err, "peer", None)))
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


_NO_GUARD = (
    "a rank process ran the launching script's top-level code again: guard the script's entry point "
    'with `if __name__ == "__main__":` (local ranks are spawned, and spawning imports the script)'
)


def check_launchable(nprocs: int, timeout_s: float) -> None:
    """Refuse a rank count or timeout no local run can use, before any process starts."""
    positive_int("nprocs", nprocs, "the number of local ranks")
    if nprocs > MAX_LOCAL_RANKS:
        raise ArgumentError(
            f"nprocs={nprocs} local ranks is more than this launcher starts ({MAX_LOCAL_RANKS}); "
            "run a plan that large with torchrun on its cluster"
        )
    positive_number("timeout_s", timeout_s, "the seconds a rank may wait for another")
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(_NO_GUARD)


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
        Interrupted: SIGINT or SIGTERM arrived; every rank has been stopped.
    """
    check_launchable(nprocs, timeout_s)
    ctx = mp.get_context("spawn")
    # The payload and args reach the ranks through a pipe after they start, not as Process
    # arguments: multiprocessing writes those while it still holds the child's end of the pipe, so
    # a child that dies before reading them (a script without a main guard) would block that
    # write forever.
    work = pickle.dumps((payload, tuple(args)))
    previous = interrupt_on_stop_signals()
    results = ctx.Queue()
    procs: list[Any] = []
    try:
        senders = []
        # A stop signal while a rank is being started would cut its start-up data short (and the
        # rank would print a traceback): it waits until every rank has started.
        with _listening_socket() as store_socket, _signals_held():
            port = store_socket.getsockname()[1]
            for rank in range(nprocs):
                receiver, sender = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=_rank_main,
                    args=(
                        rank,
                        nprocs,
                        store_socket if rank == 0 else None,
                        port,
                        os.getpid(),
                        fn,
                        receiver,
                        results,
                        timeout_s,
                    ),
                    name=f"vlmcompile-rank{rank}",
                )
                p.start()
                receiver.close()  # else a dead rank's pipe never breaks
                procs.append(p)
                senders.append(sender)
        for rank, sender in enumerate(senders):
            try:
                sender.send_bytes(work)
            except (BrokenPipeError, ConnectionResetError):
                raise LaunchError(
                    f"rank {rank} exited before it received its work: {_NO_GUARD}", rank, {}
                ) from None
            finally:
                sender.close()
        return _watch(procs, results, nprocs, timeout_s, limit_s)
    finally:
        with _signals_held():
            _stop(procs)
        restore_signals(previous)


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT and SIGTERM back (they are delivered on leaving)."""
    held = hasattr(signal, "pthread_sigmask")
    if held:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        if held:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def _stop(procs: list[Any]) -> None:
    """Terminate, then kill, every rank still running, and reap them all."""
    alive = [p for p in procs if p.exitcode is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + 2.0
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.exitcode is None:
            p.kill()
            p.join(5)


def _watch(procs, results, nprocs: int, timeout_s: float, limit_s: float | None) -> list[Any]:
    start = time.monotonic()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    lost: dict[int, int] = {}
    ended: dict[int, float] = {}
    killed: set[int] = set()
    first_failure: float | None = None

    def collect(wait_s: float) -> bool:
        try:
            rank, ok, value, peer = results.get(timeout=wait_s)
        except queue_mod.Empty:
            return False
        if ok:
            values[rank] = pickle.loads(value)
        else:
            errors[rank] = value
            if peer is not None:
                lost[rank] = peer
        return True

    while len(ended) < nprocs:
        collect(0.1)
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if rank not in ended and p.exitcode is not None:
                ended[rank] = now - start
                if p.exitcode != 0 and first_failure is None:
                    first_failure = now
        if first_failure is None and errors:
            first_failure = now  # a report arrives just before its process ends
        over_limit = limit_s is not None and now - start > limit_s
        given_up = first_failure is not None and now - first_failure > GRACE_S
        if over_limit or given_up:
            for rank, p in enumerate(procs):
                if p.exitcode is None:
                    p.kill()
                    killed.add(rank)
            for rank, p in enumerate(procs):
                p.join(5)
                ended.setdefault(rank, time.monotonic() - start)
    while collect(0.2):  # results put just before exiting
        pass
    codes = {rank: p.exitcode for rank, p in enumerate(procs)}
    if all(c == 0 for c in codes.values()) and len(values) == nprocs:
        return [values[r] for r in range(nprocs)]
    failed = [r for r in range(nprocs) if codes[r] != 0 or r not in values]
    first, header = _blame(failed, errors, lost, killed, ended, codes)
    lines = [header]
    if limit_s is not None and time.monotonic() - start > limit_s and not errors:
        lines.insert(0, f"the ranks ran past the {limit_s:.0f} s limit")
    for r in range(nprocs):
        if r in killed:
            lines.append(
                f"  rank {r}: killed by the launcher, still running {GRACE_S:.0f} s after the first failure"
            )
        elif r in errors:
            lines.append(f"  rank {r}: {_how(codes[r])} after {ended[r]:.1f} s: {errors[r].strip()}")
        elif codes[r] != 0:
            lines.append(f"  rank {r}: {_how(codes[r])} after {ended.get(r, 0):.1f} s without a report")
        else:
            lines.append(f"  rank {r}: finished")
    if all(r not in errors and codes[r] == 1 for r in range(nprocs)) and max(ended.values()) < 60:
        lines.append(
            f"(no rank reported an error; if each printed a RuntimeError about bootstrapping: {_NO_GUARD})"
        )
    raise LaunchError("\n".join(lines), first, codes)


def _blame(failed, errors, lost, killed, ended, codes) -> tuple[int, str]:
    """The rank the failure started at, and the header line that says so. A rank that died
    without a report went first; otherwise the earliest to end - unless it timed out waiting for
    a peer that never failed on its own (the launcher had to kill it): that peer hung."""
    silent = [r for r in failed if r not in errors and r not in killed]
    first = min(silent or failed, key=lambda r: ended.get(r, float("inf")))
    if first in silent:
        return first, f"rank {first} failed first: {_how(codes[first])} after {ended.get(first, 0):.1f} s"
    seen = {first}
    waiter = first
    while waiter in lost and lost[waiter] not in seen:
        peer = lost[waiter]
        seen.add(peer)
        if peer in killed:
            return peer, (
                f"rank {peer} hung: rank {waiter} gave up waiting for it after {ended.get(waiter, 0):.1f} s "
                "and the launcher killed it"
            )
        if peer not in lost:
            break
        waiter = peer
    return first, f"rank {first} failed first: {_how(codes[first])} after {ended.get(first, 0):.1f} s"
