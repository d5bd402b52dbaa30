"""Start N local ranks (one process and one thread each, gloo over 127.0.0.1) and run a function
on each, for demos and tests; ``torchrun`` does the same job on a real cluster. The ranks fork
from this process's rank server (:mod:`~vlmcompile.runtime.rank_server`), which imported torch
once, and start as spawned ranks would; they are spawned where it cannot run. Each is named
``vlmcompile-r<rank>`` in ps.

No hang and no orphan, ever:

* every collective in the ranks has a timeout, and the launcher watches the processes. When a
  rank fails, the others are given ``GRACE_S`` to report what they saw, then killed; a rank
  that hangs is found by the peer that times out waiting for it, and the error blames the hung
  rank, not the one that timed out.
* SIGINT, SIGTERM and SIGUSR1 of the launching process stop every rank before it exits
  (:class:`Interrupted`); the ranks ignore SIGINT (a terminal's Ctrl-C reaches the whole
  process group, and the launcher alone reports it), and a rank whose launcher disappears
  (SIGKILL) exits on its own. A training launch (``forward_stop_requests``) passes SIGTERM and
  SIGUSR1 on to its ranks instead, as a request to finish the step and save
  (:mod:`~vlmcompile.runtime.preemption`); a second signal stops them at once.
* a job paused (Ctrl-Z, SIGSTOP) longer than the timeout makes the ranks time out when it goes
  on: the error says it was a pause, not a hang.
* nothing listens beyond this machine: the rendezvous store and gloo bind 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import math
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import connection as mp_connection
from typing import Any

from vlmcompile.ir.errors import ArgumentError, VlmCompileError, positive_int, positive_number
from vlmcompile.runtime import preemption, rank_server
from vlmcompile.runtime.preemption import Interrupted
from vlmcompile.runtime.rank_server_process import name_process

__all__ = ["GRACE_S", "Interrupted", "LaunchError", "launch"]

GRACE_S = 5.0
"""How long ranks still running after the first failure get to report before they are killed."""
MAX_LOCAL_RANKS = 64
"""More local ranks than this is a plan for a cluster, not for this machine: use torchrun."""
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
LOCAL_RANK_ENV = "VLMCOMPILE_LOCAL_RANK"
"""Set to "1" in the local launcher's ranks: their stop requests come from it, as SIGUSR1."""
_PAUSE_S = 1.0
"""A gap this long in the launcher's 0.1 s watch loop means it was stopped (Ctrl-Z, SIGSTOP)."""
_COLLECTIVE = -1
"""What a rank's report names as the peer it lost when it waited on a whole group."""
_DONE_KEY = "vlmcompile/left"
"""The store key under which each rank signs off, so rank 0 keeps the store until all have."""


class LaunchError(VlmCompileError, RuntimeError):
    """A rank failed; the message says which failed first and what the others reported."""

    def __init__(self, message: str, first_failed: int, exit_codes: dict[int, int | None]):
        super().__init__(message)
        self.first_failed = first_failed
        self.exit_codes = exit_codes


def interrupt_on_stop_signals(signals: Sequence[int] = _STOP_SIGNALS) -> dict[int, Any]:
    """Make ``signals`` (SIGINT, SIGTERM, SIGUSR1) raise :class:`Interrupted` in the main thread;
    returns the previous handlers (give them to :func:`restore_signals`). Installing them again
    also repairs the C-level SIGINT handler, which native libraries may have left at the default."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for signum in signals:
        previous[signum] = signal.getsignal(signum)
        signal.signal(signum, _raise_interrupted)
    return previous


def restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def threads_per_rank(local_ranks: int) -> int:
    """CPU threads each of ``local_ranks`` ranks on this machine runs (its share of the cores):
    the launcher's and the train command's ranks, and the profile pass that times layers for
    them, all use this."""
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


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


def _leave_store(store, rank: int, nprocs: int, timeout_s: float, wait: bool) -> None:
    """Rank 0 hosts the rendezvous store: when it succeeded, it stays until every rank has left.

    A function that makes no collective lets rank 0 finish while a peer is still inside
    ``init_process_group``; the store dying under it then fails that peer. A rank that died
    never signs off: rank 0 then waits until the launcher, which saw the death, stops it. A
    rank 0 that failed leaves at once, as the launcher's account of who failed first expects."""
    if store is None:
        return
    try:
        store.set(f"{_DONE_KEY}/{rank}", b"1")
        if rank == 0 and wait:
            keys = [f"{_DONE_KEY}/{r}" for r in range(nprocs)]
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:  # a lost peer or a timed-out wait: the launcher reports the rank
        pass


def _rank_main(rank, nprocs, store_socket, port, parent_pid, work, report, timeout_s) -> None:
    # Armed first: a rank's imports (torch alone takes seconds) come after, so a launcher killed
    # while its ranks start up takes them with it at once. Hence torch is imported here and the
    # function to run arrives with the work, not as an argument the child unpickles on start.
    if parent_pid is not None:  # spawned; a forked rank watches its launcher's pipe instead
        _die_with_parent(parent_pid)
    name_process(f"vlmcompile-r{rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, preemption.note)  # the launcher's stop request (born ignored)
    if hasattr(signal, "pthread_sigmask"):  # born with the launcher's mask, which held them back
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    try:
        work_bytes = work.recv_bytes()
    except (EOFError, OSError):
        os._exit(1)  # the launcher stopped before it sent the work
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads_per_rank(nprocs))
    env = dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        **{LOCAL_RANK_ENV: "1"},
    )
    lo = loopback_interface()
    if lo is not None:
        env["GLOO_SOCKET_IFNAME"] = lo  # gloo's own listening sockets on 127.0.0.1 too
    os.environ.update(env)
    code = 0
    store = None
    try:
        fn, payload, args = pickle.loads(work_bytes)
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            store = dist.TCPStore(
                "127.0.0.1", port, nprocs, True, timeout, master_listen_fd=store_socket.detach()
            )
        else:
            store = dist.TCPStore("127.0.0.1", port, nprocs, False, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=nprocs, timeout=timeout)
        # Plain pickles: torch's reductions would share tensors by file descriptor, which dies
        # with the process that made them.
        message = pickle.dumps((True, pickle.dumps(fn(payload, *args)), None, None, None))
    except BaseException as err:  # report anything, then exit non-zero
        raised_at = time.monotonic()  # the machine's clock, the launcher's too: who failed first
        frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
        where = f" (at {frame.filename}:{frame.lineno})" if frame else ""
        # The peer a RankLostError gave up on; _COLLECTIVE when it waited on a group.
        lost = None
        if hasattr(err, "peer"):  # a RankLostError
            lost = _COLLECTIVE if err.peer is None else err.peer
        message = pickle.dumps(
            (False, f"{type(err).__name__}: {err}{where}", lost, _as_bytes(err), raised_at)
        )
        code = 1
    try:
        report.send_bytes(message)
    except OSError:
        code = code or 1  # the launcher is gone
    _leave_store(store, rank, nprocs, timeout_s, wait=code == 0)
    # Skip interpreter teardown: a process group whose peer died can block in its destructor.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _served_rank_main(passed: list[int], rank, nprocs, port, timeout_s) -> None:
    """A rank forked from the rank server: its descriptors arrive as numbers (``passed``)."""
    alive, work, report, *store = passed
    _die_with_launcher(alive)
    store_socket = socket.socket(fileno=store[0]) if store else None
    work_conn = mp_connection.Connection(work, writable=False)
    report_conn = mp_connection.Connection(report, readable=False)
    _rank_main(rank, nprocs, store_socket, port, None, work_conn, report_conn, timeout_s)


def _die_with_launcher(alive: int) -> None:
    """Exit when the launcher disappears: ``alive`` is the read end of a pipe whose write end it
    alone holds, which reads end-of-file the moment it dies (its parent is the rank server, so
    the parent-death signal would not tell)."""

    def watch():
        with contextlib.suppress(OSError):
            os.read(alive, 1)
        os._exit(70)

    threading.Thread(target=watch, name="vlmcompile-launcher-watch", daemon=True).start()


def _as_bytes(err: BaseException) -> bytes | None:
    """A user error itself, for the launcher to raise when every rank raised the same; None for
    anything else (a bug keeps its rank and line) or what does not pickle."""
    if not isinstance(err, VlmCompileError) or hasattr(err, "peer"):
        return None
    try:
        return pickle.dumps(err)
    except Exception:  # noqa: BLE001 - the text report still goes
        return None


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
    'with `if __name__ == "__main__":` (each local rank imports the script, as a spawned process does)'
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
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(_NO_GUARD)


def launch(
    fn: Callable[..., Any],
    payload: Any,
    nprocs: int,
    *,
    args: Sequence[Any] = (),
    arg_names: Sequence[str] = (),
    timeout_s: float = 60.0,
    limit_s: float | None = None,
    grace_s: float = GRACE_S,
    forward_stop_requests: bool = False,
) -> list[Any]:
    """Run ``fn(payload, *args)`` on ``nprocs`` local ranks with torch.distributed initialised
    (gloo); return each rank's result, in rank order.

    Args:
        fn: a module-level function (it is pickled into each process).
        payload: what every rank gets first (e.g. a :class:`~vlmcompile.runtime.executor.PipelineRunner`).
        arg_names: the names of ``args``, for the error that refuses one that does not pickle.
        timeout_s: the timeout of every collective in the ranks.
        limit_s: wall-clock bound on the whole run (None: no bound while every rank is healthy).
        grace_s: how long ranks still running after the first failure get to report before they
            are killed.
        forward_stop_requests: SIGTERM and SIGUSR1 are the caller's stop requests (it handles
            them, with :func:`~vlmcompile.runtime.preemption.stop_requests`): each is passed on to
            every rank as SIGUSR1, and the ranks are left to finish. SIGINT stops them at once.

    Raises:
        LaunchError: a rank raised, died or had to be killed.
        Interrupted: SIGINT, SIGTERM or SIGUSR1 arrived (SIGINT only, or a second stop request,
            with ``forward_stop_requests``); every rank has been stopped.
        VlmCompileError: every rank raised the same error (a user error, not a lost peer): that
            error, once.
    """
    check_launchable(nprocs, timeout_s)
    positive_number("grace_s", grace_s, "the seconds ranks get to report after the first failure")
    # The payload and args reach the ranks through a pipe after they start, not as Process
    # arguments: multiprocessing writes those while it still holds the child's end of the pipe, so
    # a child that dies before reading them (a script without a main guard) would block that
    # write forever.
    work = _work(fn, payload, args, arg_names)
    # Started (or found running) before any signal is held: it takes seconds the first time.
    with rank_server.in_use() as server:
        return _run(server, work, nprocs, timeout_s, limit_s, grace_s, forward_stop_requests)


def _run(server, work: bytes, nprocs, timeout_s, limit_s, grace_s, forward_stop_requests) -> list[Any]:
    procs: list[Any] = []
    reports: list[Any] = []
    alive_r, alive_w = _alive_pipe()
    previous = interrupt_on_stop_signals((signal.SIGINT,) if forward_stop_requests else _STOP_SIGNALS)
    try:
        senders = _start_ranks(server, nprocs, timeout_s, alive_r, procs, reports)
        _send_work(senders, work)
        return _watch(procs, reports, limit_s, grace_s, timeout_s, forward_stop_requests)
    finally:
        with _signals_held():  # a second Ctrl-C must not cut the clean-up short
            try:
                _close_alive_pipe(alive_r, alive_w)  # first: whatever fails below, forked ranks end
                _stop(procs)
                for r in reports:
                    r.close()
            finally:
                restore_signals(previous)  # a signal held meanwhile goes to the caller's handler


_ALIVE_PIPES: set[int] = set()
"""The write ends of the launches' pipes that forked ranks watch: a process forked from this
one (a data loader's worker) closes them, or the ranks would outlive a launcher killed while it
runs."""


def _alive_pipe() -> tuple[int, int]:
    """A pipe whose write end this process alone holds: forked ranks read end-of-file from it
    when the launch ends or this process dies."""
    alive_r, alive_w = os.pipe()
    _ALIVE_PIPES.add(alive_w)
    return alive_r, alive_w


def _close_alive_pipe(alive_r: int, alive_w: int) -> None:
    _ALIVE_PIPES.discard(alive_w)
    os.close(alive_w)
    os.close(alive_r)


def _close_alive_pipes_after_fork() -> None:
    for fd in _ALIVE_PIPES:
        with contextlib.suppress(OSError):
            os.close(fd)
    _ALIVE_PIPES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_alive_pipes_after_fork)


def _start_ranks(
    server: rank_server.RankServer | None,
    nprocs: int,
    timeout_s: float,
    alive: int,
    procs: list[Any],
    reports: list[Any],
) -> list[Any]:
    """Start the ranks (appended to ``procs``, their report pipes to ``reports``, so that the
    caller reaps them whatever happens); return the pipes their work goes down. They fork from
    ``server``; spawned where it is None or fails (then every rank is, the forked ones stopped).
    A stop signal while a rank is being started would cut its start-up data short: it waits
    until every rank has started. The ranks are born ignoring SIGINT, so a terminal's Ctrl-C
    during their start-up reaches the launcher alone."""
    with _listening_socket() as store_socket, _signals_held():
        port = store_socket.getsockname()[1]
        if server is not None:
            try:
                return _fork_ranks(server, nprocs, timeout_s, port, store_socket, alive, procs, reports)
            except rank_server.Unavailable as err:
                # Stale code: a fresh server next launch; anything else: spawn from now on.
                (rank_server.retire if isinstance(err, rank_server.Stale) else rank_server.forget)(server)
                _stop(procs)
                for r in reports:
                    r.close()
                procs.clear()
                reports.clear()
        with _children_ignore_sigint():
            return _spawn_ranks(nprocs, timeout_s, port, store_socket, procs, reports)


def _fork_ranks(server, nprocs, timeout_s, port, store_socket, alive, procs, reports) -> list[Any]:
    senders: list[Any] = []
    try:
        for rank in range(nprocs):
            work_r, work_w = mp_connection.Pipe(duplex=False)
            report_r, report_w = mp_connection.Pipe(duplex=False)
            senders.append(work_w)
            reports.append(report_r)
            fds = [alive, work_r.fileno(), report_w.fileno()]
            if rank == 0:
                fds.append(store_socket.fileno())
            try:
                call = pickle.dumps((_served_rank_main, (rank, nprocs, port, timeout_s)))
                procs.append(server.start(f"vlmcompile-r{rank}", call, fds))
            finally:
                # The rank's ends close here, or a dead rank's pipes would never break.
                work_r.close()
                report_w.close()
    except rank_server.Unavailable:
        for sender in senders:  # the caller spawns every rank afresh, with pipes of their own
            sender.close()
        raise
    return senders


def _spawn_ranks(nprocs, timeout_s, port, store_socket, procs, reports) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    senders = []
    for rank in range(nprocs):
        work_r, work_w = ctx.Pipe(duplex=False)
        report_r, report_w = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_rank_main,
            args=(
                rank,
                nprocs,
                store_socket if rank == 0 else None,
                port,
                os.getpid(),
                work_r,
                report_w,
                timeout_s,
            ),
            name=f"vlmcompile-rank{rank}",
        )
        p.start()
        work_r.close()
        report_w.close()
        procs.append(p)
        senders.append(work_w)
        reports.append(report_r)
    return senders


def _send_work(senders: list[Any], work: bytes) -> None:
    for rank, sender in enumerate(senders):
        try:
            sender.send_bytes(work)
        except (BrokenPipeError, ConnectionResetError):
            raise LaunchError(
                f"rank {rank} exited before it received its work: {_NO_GUARD}", rank, {}
            ) from None
        finally:
            sender.close()


def _work(fn: Callable[..., Any], payload: Any, args: Sequence[Any], arg_names: Sequence[str]) -> bytes:
    """What every rank receives, pickled once: the ranks are other processes. A value that does
    not pickle is refused naming it (``arg_names``: the args' names) and the fix."""
    unpicklable = (pickle.PicklingError, TypeError, AttributeError)
    try:
        return pickle.dumps((fn, payload, tuple(args)))
    except unpicklable:
        named = [("the function to run", fn), ("the payload", payload)]
        named += [
            (arg_names[i] if i < len(arg_names) else f"argument {i + 1}", v) for i, v in enumerate(args)
        ]
        for what, value in named:
            try:
                pickle.dumps(value)
            except unpicklable as err:
                name = getattr(value, "__qualname__", type(value).__name__)
                raise ArgumentError(
                    f"{what} ({name}) cannot be sent to the local ranks, which are separate processes: {err}. "
                    "Use a module-level function or class instance, or functools.partial of one (not a "
                    "lambda or a function defined inside another)"
                ) from None
        raise


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


@contextlib.contextmanager
def _children_ignore_sigint():
    """Processes started inside ignore SIGINT and SIGUSR1 from birth (the disposition survives
    exec, and Python keeps an ignored signal ignored; a rank listens to SIGUSR1 from its first
    line). Call with the signals held: one that comes meanwhile stays pending for the handler
    restored on leaving (Linux never discards a blocked signal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    born_ignoring = (signal.SIGINT, signal.SIGUSR1)
    pending = signal.sigpending() if hasattr(signal, "sigpending") else set()
    for signum in born_ignoring:
        if signum in pending:  # setting SIG_IGN would discard it
            if signum == signal.SIGUSR1 and signal.getsignal(signum) in preemption.STOP_REQUEST_HANDLERS:
                preemption.note(signum)  # a training launch's stop request: kept as one
            else:
                raise Interrupted(signum)
    handlers = {signum: signal.signal(signum, signal.SIG_IGN) for signum in born_ignoring}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def _stop(procs: list[Any]) -> None:
    """Kill every rank still running and reap them all. SIGKILL, not SIGTERM: a training rank
    takes SIGTERM as a request to finish its step, and a rank has nothing to flush (its report is
    sent or lost)."""
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join(5)
        if isinstance(p, rank_server.ServedRank):
            p.close()


def _watch(
    procs, reports, limit_s: float | None, grace_s: float, timeout_s: float, forward_stop: bool = False
) -> list[Any]:
    """Every rank's result, once all have ended; else the :class:`LaunchError` naming them."""
    watch = _Watch(procs, reports, limit_s, grace_s, forward_stop)
    watch.run()
    # A rank that reported its result has finished, whatever ended its process afterwards (rank 0
    # waiting on the store for a peer, a rank server that died before it reported the exit).
    if len(watch.values) == len(procs):
        return [watch.values[r] for r in range(len(procs))]
    same = {_strip_where(e) for e in watch.errors.values()}
    if len(watch.errors) == len(procs) and len(same) == 1 and all(watch.raised.values()):
        raise pickle.loads(watch.raised[0])  # every rank refused alike: the user's error, once
    raise watch.failure(timeout_s)


class _Watch:
    """The launcher's view of its ranks while they run: their reports (results, errors, which
    peer a rank lost), when each ended, which it killed and why, and the pauses it saw."""

    def __init__(self, procs, reports, limit_s: float | None, grace_s: float, forward_stop: bool):
        self.procs, self.limit_s, self.grace_s, self.forward_stop = procs, limit_s, grace_s, forward_stop
        self.start = time.monotonic()
        self.values: dict[int, Any] = {}
        self.errors: dict[int, str] = {}
        self.raised: dict[int, bytes | None] = {}
        self.lost: dict[int, int] = {}
        self.ended: dict[int, float] = {}
        self.raised_at: dict[int, float] = {}
        """When each rank that reported an error raised it: two ranks that end between two polls
        of the launcher end at once to it, but the one whose error made the other's came first."""
        self.killed: set[int] = set()
        self.open_reports = dict(enumerate(reports))
        self.first_failure: float | None = None
        self.over_limit = False
        self.pauses = _Pauses()
        self.gave_up: list[float] = []
        """When each report of a lost peer arrived."""
        self.forwarded = 0.0
        self.codes: dict[int, int | None] = {}

    def run(self) -> None:
        """Poll until every rank has ended (killing them all at the limit, or a grace period
        after the first failure), then read the reports sent just before exiting."""
        while len(self.ended) < len(self.procs):
            self.collect(0.1)
            now = time.monotonic()
            self.pauses.watch(now, self.procs)
            self.pass_on_stop_requests(now)
            self.note_ended(now)
            self.over_limit = self.limit_s is not None and now - self.start > self.limit_s
            if self.over_limit or (
                self.first_failure is not None and now - self.first_failure > self.grace_s
            ):
                self.kill_the_rest()
        while self.open_reports and mp_connection.wait(list(self.open_reports.values()), timeout=0.2):
            self.collect(0)
        self.codes = {rank: p.exitcode for rank, p in enumerate(self.procs)}

    def collect(self, wait_s: float) -> None:
        ready = mp_connection.wait(list(self.open_reports.values()), timeout=wait_s)
        for rank, conn in list(self.open_reports.items()):
            if conn not in ready:
                continue
            del self.open_reports[rank]
            try:
                ok, value, peer, error, raised_at = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                continue  # the rank died before or while reporting
            if ok:
                self.values[rank] = pickle.loads(value)
            else:
                self.errors[rank] = value
                self.raised[rank] = error
                self.raised_at[rank] = raised_at - self.start
                if peer is not None:
                    self.lost[rank] = peer
                    self.gave_up.append(time.monotonic())

    def pass_on_stop_requests(self, now: float) -> None:
        if not (self.forward_stop and preemption.requested() and now - self.forwarded >= 1.0):
            return
        if not self.forwarded:
            name = signal.Signals(preemption.requested()).name
            print(
                f"vlmcompile: {name}: every rank finishes its step, saves and stops; a second signal stops "
                "them at once",
                file=sys.stderr,
                flush=True,
            )
        self.forwarded = now  # again every second: a rank still starting up ignores it
        for p in self.procs:
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGUSR1)

    def note_ended(self, now: float) -> None:
        for rank, p in enumerate(self.procs):
            if rank not in self.ended and p.exitcode is not None:
                self.ended[rank] = now - self.start
                if p.exitcode != 0 and self.first_failure is None:
                    self.first_failure = now
        if self.first_failure is None and self.errors:
            self.first_failure = now  # a report arrives just before its process ends

    def kill_the_rest(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.exitcode is None:
                p.kill()
                self.killed.add(rank)
        for rank, p in enumerate(self.procs):
            p.join(5)
            self.ended.setdefault(rank, time.monotonic() - self.start)

    def failure(self, timeout_s: float) -> LaunchError:
        """The error naming every rank's fate, the one to blame first."""
        nprocs, codes, errors, killed, ended = (
            len(self.procs),
            self.codes,
            self.errors,
            self.killed,
            self.ended,
        )
        # A rank that reported its result has finished, even if it was killed afterwards (rank
        # 0 keeps the store for a peer that then died without signing off).
        failed = [r for r in range(nprocs) if r not in self.values]
        failed_at = {r: min(ended.get(r, math.inf), self.raised_at.get(r, math.inf)) for r in failed}
        first, header = _blame(failed, errors, self.lost, killed, failed_at, codes)
        died_silently = any(r not in errors and r not in killed for r in failed)
        paused = (
            self.pauses.explain(min(self.gave_up), timeout_s) if self.gave_up and not died_silently else None
        )
        lines = [paused or header]
        if self.over_limit and not errors:
            lines.insert(0, f"the ranks ran past the {self.limit_s:.0f} s limit")
        orphaned = [r for r, p in enumerate(self.procs) if getattr(p, "lost_server", False)]
        if orphaned:
            lines.insert(
                0,
                f"the rank server died while ranks {orphaned} ran, so the launcher killed them (launch again)",
            )
        why_killed = (
            "at the run's time limit"
            if self.over_limit
            else f"still running {self.grace_s:g} s after the first failure"
        )
        for r in range(nprocs):
            if r in self.values:
                lines.append(f"  rank {r}: finished")
            elif r in errors:
                then = f" (then killed by the launcher, {why_killed})" if r in killed else ""
                said = "the error above" if r == first and not paused else errors[r].strip()
                lines.append(f"  rank {r}: {_how(codes[r])} after {ended[r]:.1f} s: {said}{then}")
            elif r in killed:
                lines.append(f"  rank {r}: killed by the launcher, {why_killed}")
            elif codes[r] != 0:
                lines.append(f"  rank {r}: {_how(codes[r])} after {ended.get(r, 0):.1f} s without a report")
            else:
                lines.append(f"  rank {r}: ended without a report")
        if first in errors and not paused:  # the cause first: what the user acts on
            lines.insert(0, f"rank {first}: {errors[first].strip()}")
        if all(r not in errors and codes[r] == 1 for r in range(nprocs)) and max(ended.values()) < 60:
            lines.append(
                f"(no rank reported an error; if each printed a RuntimeError about bootstrapping: {_NO_GUARD})"
            )
        return LaunchError("\n".join(lines), first, codes)


def _strip_where(error: str) -> str:
    return error.rsplit(" (at ", 1)[0]


class _Pauses:
    """What the launcher saw of stopped processes, with when: itself not scheduled for a while
    (the whole job stopped: Ctrl-Z, SIGSTOP to the process group) and ranks in the stopped
    state. Only pauses in the timeout before a rank gave up can explain its giving up."""

    def __init__(self):
        self.last: float | None = None
        self.job: list[tuple[float, float]] = []
        self.stopped_since: dict[int, float] = {}
        self.ranks: dict[int, list[tuple[float, float]]] = {}

    def watch(self, now: float, procs) -> None:
        if self.last is not None and now - self.last > _PAUSE_S:
            self.job.append((self.last, now))
        self.last = now
        for rank, p in enumerate(procs):
            if p.exitcode is None and _is_stopped(p.pid):
                self.stopped_since.setdefault(rank, now)
            elif rank in self.stopped_since:
                self.ranks.setdefault(rank, []).append((self.stopped_since.pop(rank), now))

    def explain(self, gave_up_at: float, timeout_s: float) -> str | None:
        """The header for ranks that gave up waiting at ``gave_up_at`` because of a pause (None:
        no pause within the timeout before it explains that)."""
        since = gave_up_at - timeout_s

        def within(spans):
            return sum(max(0.0, min(end, gave_up_at) - max(start, since)) for start, end in spans)

        def length(spans):
            return sum(end - start for start, end in spans if end > since)

        if within(self.job) >= 0.5 * timeout_s:
            return (
                f"the job was paused for {length(self.job):.0f} s (stopped: Ctrl-Z or SIGSTOP), longer than the "
                f"{timeout_s:g} s the ranks wait for each other, so they timed out when it went on; no rank "
                "failed. Resume from the newest checkpoint, and give a timeout longer than any pause"
            )
        spans = {r: list(v) for r, v in self.ranks.items()}
        for rank, began in self.stopped_since.items():  # still stopped when it was killed
            spans.setdefault(rank, []).append((began, gave_up_at))
        stopped = sorted(r for r, v in spans.items() if within(v) >= 0.5 * timeout_s)
        if stopped:
            return (
                f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} stopped (SIGSTOP or Ctrl-Z) "
                f"for {max(length(spans[r]) for r in stopped):.0f} s, longer than the {timeout_s:g} s timeout: the "
                "other ranks gave up waiting for it; resume it with SIGCONT sooner, or give a longer timeout"
            )
        return None


def _is_stopped(pid: int) -> bool:
    """Whether the process is in the stopped state (Linux's /proc; elsewhere never)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"T", b"t")


def _blame(failed, errors, lost, killed, failed_at, codes) -> tuple[int, str]:
    """The rank the failure started at, and the header line that says so. A rank that died
    without a report went first; otherwise the earliest to fail (``failed_at``: when it raised
    or, sooner, ended) - unless it timed out waiting for a peer that never failed on its own
    (the launcher had to kill it): that peer hung."""
    silent = [r for r in failed if r not in errors and r not in killed]
    first = min(silent or failed, key=lambda r: failed_at.get(r, float("inf")))
    if first in silent:
        return first, f"rank {first} failed first: {_how(codes[first])} after {failed_at.get(first, 0):.1f} s"
    seen = {first}
    waiter = first
    while waiter in lost and lost[waiter] not in seen:
        peer = lost[waiter]
        if peer == _COLLECTIVE:  # it waited on a group: a rank the launcher had to kill hung
            hung = sorted(killed)
            if hung:
                return hung[0], (
                    f"rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} hung: rank {waiter} gave up "
                    f"waiting for a collective after {failed_at.get(waiter, 0):.1f} s and the launcher killed "
                    f"{'them' if len(hung) > 1 else 'it'}"
                )
            break
        seen.add(peer)
        if peer in killed:
            return peer, (
                f"rank {peer} hung: rank {waiter} gave up waiting for it after {failed_at.get(waiter, 0):.1f} s "
                "and the launcher killed it"
            )
        if peer not in lost:
            break
        waiter = peer
    return first, f"rank {first} failed first: {_how(codes[first])} after {failed_at.get(first, 0):.1f} s"
