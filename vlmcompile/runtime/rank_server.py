"""A server private to this process that local ranks fork from, so that they do not each import
torch: a launch of 2 ranks starts in about a tenth of a second instead of 1.2 s (measured on
idle cores), and CI's tests launch ranks some hundred times.

What a rank forked from it starts with is what a spawned rank would: the launcher's standard
output and error as they are at the launch, its ``sys.path``, working directory and main module
(multiprocessing's ``spawn.prepare``), SIGINT and SIGUSR1 ignored and SIGTERM at its default.
The server starts with torch alone (:mod:`rank_server_process`); before it forks, it imports the
vlmcompile modules (and :data:`~rank_server_process.PRELOAD`'s) the launcher has, from the files
the launcher loaded them from, as they were then: a rank runs the launcher's code. A module the
launcher has since loaded from another file, or whose file changed, retires the server: the
next launch starts a fresh one.

It is this process's own, never multiprocessing's global forkserver (whose state other code
shares): started at the first launch, before the launcher holds any signal, with this process's
interpreter, flags and environment, and started again when the environment has changed since
(what torch and the user's imports read at import time must be the launcher's). It ignores the
signals the job's process group receives and exits when this process closes its control socket,
or dies. Where it cannot start (not Linux, Python before 3.11, a descriptor it cannot pass),
``VLMCOMPILE_RANK_START=spawn`` asks for it, or it dies, ranks are spawned as before.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.process
import multiprocessing.spawn
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from vlmcompile.runtime.rank_server_process import PRELOAD, STATUS

START_ENV = "VLMCOMPILE_RANK_START"
"""``spawn`` spawns every rank (each imports torch itself) instead of forking it from the server."""
START_TIMEOUT_S = 120.0
"""How long the server may take to import torch (seconds on a loaded machine) before ranks are
spawned instead."""
_PID_TIMEOUT_S = 60.0
"""How long the server may take to fork a rank: the first request of a launch imports what its
ranks run (seconds; tens on a loaded machine) before it forks."""
_PROCESS_FILE = Path(__file__).with_name("rank_server_process.py")


class Unavailable(RuntimeError):
    """The server did not start or did not answer: the launcher spawns its ranks instead."""


_NOT_READ_AT_IMPORT = frozenset({"PYTEST_CURRENT_TEST"})
"""Variables that change all the time and that no import reads: a change in them alone does not
start the server again (pytest sets this one for every test). A rank gets them as they are."""


def _key() -> tuple:
    """What the server's imports depend on: the interpreter, its flags and the environment."""
    environ = sorted((k, v) for k, v in os.environ.items() if k not in _NOT_READ_AT_IMPORT)
    return sys.executable, tuple(subprocess._args_from_interpreter_flags()), tuple(environ)


class RankServer:
    """The running server, its control socket, what it was started with, and how many launches
    use it now (a server the launcher no longer starts ranks from is closed when none does)."""

    def __init__(self, key: tuple):
        self.key = key
        self.lock = threading.Lock()
        self.users = 0
        self.retired = False
        self.preloaded: dict[str, tuple[str, int]] = {}
        """Module -> (file, mtime) of every module sent to the server to import."""
        try:
            launcher_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as err:  # no SOCK_SEQPACKET here, or out of descriptors
            raise Unavailable(f"the rank server has no control socket: {err}") from None
        self.control = launcher_end
        try:
            self.process = subprocess.Popen(
                [sys.executable, *key[1], "-P", str(_PROCESS_FILE), str(server_end.fileno())],
                pass_fds=[server_end.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except OSError as err:
            launcher_end.close()
            raise Unavailable(f"the rank server did not start: {err}") from None
        finally:
            server_end.close()
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        message = self.control.recv(1 << 16) if _readable(self.control.fileno(), START_TIMEOUT_S) else b""
        if not message:
            raise Unavailable("the rank server did not start (torch failed to import, or it was killed)")
        started = pickle.loads(message)
        ours = sys.modules.get("torch")
        if ours is not None and getattr(ours, "__file__", None) != started["torch"]:
            raise Unavailable(f"the rank server imported another torch ({started['torch']})")

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """End the server (it exits when its control socket closes and its ranks have ended)
        and reap it."""
        self.control.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def start(self, name: str, call: bytes, fds: list[int]) -> ServedRank:
        """Fork a rank that runs ``fn(passed, *args)`` (``call`` pickles ``(fn, args)``), where
        ``passed`` are its own copies of ``fds``; the server first imports what this process has of
        :func:`_preload`'s modules (once for every launch after)."""
        preload = _preload()
        changed = sorted(n for n, seen in preload.items() if self.preloaded.get(n, seen) != seen)
        if changed:
            raise Stale(f"the rank server holds older copies of {', '.join(changed[:3])}")
        self.preloaded.update(preload)
        preparation = multiprocessing.spawn.get_preparation_data(name)
        preparation["authkey"] = bytes(multiprocessing.process.current_process().authkey)
        request = pickle.dumps(
            {
                "preparation": preparation,
                "call": call,
                "name": name,
                "environ": dict(os.environ),
                "preload": preload,
            }
        )
        status_r, status_w = os.pipe()
        try:
            with self.lock, _outputs() as outputs:
                socket.send_fds(self.control, [request], [*outputs, status_w, *fds], socket.MSG_NOSIGNAL)
        except OSError as err:
            os.close(status_r)
            raise Unavailable(f"the rank server did not take the request: {err}") from None
        finally:
            os.close(status_w)
        pid = _read_status(status_r, _PID_TIMEOUT_S)
        if pid is None:
            os.close(status_r)
            raise Unavailable("the rank server did not fork the rank")
        return ServedRank(pid, status_r)


def _preload() -> dict[str, tuple[str, int]]:
    """The modules the server is to import before it forks -> (their file here, its mtime): the
    vlmcompile modules this process has imported (the launch module and the rank's function's
    among them), and those of the server's own list (:data:`PRELOAD`) it has. Never a user's or test module: its top-level code must run in
    the rank (its environment, folder and outputs), as it would in a spawned one."""
    found = {}
    for name in [*(n for n in list(sys.modules) if n.startswith("vlmcompile.")), *PRELOAD]:
        file = getattr(sys.modules.get(name), "__file__", None)
        if not file:
            continue
        try:
            found[name] = (file, os.stat(file).st_mtime_ns)
        except OSError:  # gone since: the rank imports whatever it finds, as a spawned one would
            continue
    return found


class Stale(Unavailable):
    """A module the server imported has changed here since (another file, or the file edited)."""


@contextlib.contextmanager
def _outputs() -> Iterator[tuple[int, int]]:
    """This process's standard output and error for a rank, as a spawned rank would inherit them:
    /dev/null in place of one that is closed or not inheritable (a descriptor of this process's
    own that took the number 1 or 2 after it was closed)."""
    null = None
    outputs = []
    for fd in (1, 2):
        try:
            usable = os.get_inheritable(fd)
        except OSError:
            usable = False
        if not usable and null is None:
            null = os.open(os.devnull, os.O_WRONLY)
        outputs.append(fd if usable else null)
    try:
        yield outputs[0], outputs[1]
    finally:
        if null is not None:
            os.close(null)


def _readable(fd: int, timeout_s: float | None) -> bool:
    """Whether ``fd`` can be read (or has reached end-of-file) within ``timeout_s``; poll, not
    select, which refuses descriptors past 1023."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else int(timeout_s * 1000)))


def _read_status(fd: int, timeout_s: float | None) -> int | None:
    """The next number on a status pipe; None if it closed first (or nothing came in time)."""
    if not _readable(fd, timeout_s):
        return None
    data = b""
    while len(data) < STATUS.size:
        chunk = os.read(fd, STATUS.size - len(data))
        if not chunk:
            return None
        data += chunk
    return STATUS.unpack(data)[0]


class ServedRank:
    """A rank forked from the server, with the parts of :class:`multiprocessing.Process` the
    launcher uses: ``pid``, ``exitcode``, ``kill()``, ``join(timeout)``; ``lost_server`` says its
    server died before it reported the rank's exit (the launcher then killed the rank)."""

    def __init__(self, pid: int, status_fd: int):
        self.pid = pid
        self.lost_server = False
        self._status: int | None = status_fd
        self._code: int | None = None
        # Signals go through a descriptor of the process, not its number: a rank whose server
        # died is reaped by init, and its number may be another process's by then.
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    @property
    def exitcode(self) -> int | None:
        if self._status is not None:
            self._poll(0)
        return self._code

    def _poll(self, timeout_s: float | None) -> None:
        if not _readable(self._status, timeout_s):
            return
        code = _read_status(self._status, 0)
        os.close(self._status)
        self._status = None
        if code is None:  # the server died before it reported the rank, which may run on: end it
            self.lost_server = True
            self._signal(signal.SIGKILL)
            code = -signal.SIGKILL
        self._code = code
        self._close_pidfd()

    def join(self, timeout: float | None = None) -> None:
        if self._status is not None:
            self._poll(timeout)

    def kill(self) -> None:
        if self.exitcode is None:
            self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signum)
            else:
                os.kill(self.pid, signum)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def close(self) -> None:
        if self._status is not None:
            os.close(self._status)
            self._status = None
        self._close_pidfd()


_server: RankServer | None = None
_server_lock = threading.Lock()
_failed_key: tuple | None = None
"""The environment in which the server last failed: not tried again in it."""


@contextlib.contextmanager
def in_use() -> Iterator[RankServer | None]:
    """This process's server for one launch, started (or started again, in a changed environment
    or after it died) as needed; None where ranks are to be spawned. A server replaced meanwhile
    lives on until the launches that use it have ended."""
    server = _acquire()
    try:
        yield server
    finally:
        if server is not None:
            with _server_lock:
                server.users -= 1
                _close_if_unused(server)


def _acquire() -> RankServer | None:
    global _server, _failed_key
    if os.environ.get(START_ENV) == "spawn" or not _supported():
        return None
    key = _key()
    with _server_lock:
        if _server is not None and (_server.key != key or not _server.alive()):
            _retire(_server)
            _server = None
        if _server is None and key != _failed_key:
            try:
                _server = RankServer(key)
            except Unavailable:
                _failed_key = key
        if _server is not None:
            _server.users += 1
        return _server


def retire(server: RankServer) -> None:
    """Start no more ranks from ``server`` (it holds stale modules); the next launch starts a new
    one."""
    global _server
    with _server_lock:
        if _server is server:
            _server = None
        _retire(server)


def forget(server: RankServer) -> None:
    """Stop starting ranks from ``server``, which failed a request: not tried again in this
    environment (a request too large for its socket would fail again)."""
    global _server, _failed_key
    with _server_lock:
        if _server is server:
            _server = None
            _failed_key = server.key
        _retire(server)


def _retire(server: RankServer) -> None:
    server.retired = True
    _close_if_unused(server)


def _close_if_unused(server: RankServer) -> None:
    if server.retired and server.users == 0:
        server.close()


def _supported() -> bool:
    return sys.platform == "linux" and sys.version_info >= (3, 11) and hasattr(socket, "send_fds")


def _drop_after_fork() -> None:
    """A forked child of the launcher starts its own server: sharing the parent's would keep it
    alive after the parent exits."""
    global _server, _server_lock
    _server_lock = threading.Lock()
    if _server is not None:
        with contextlib.suppress(OSError):
            _server.control.close()
        _server = None


def _close_at_exit() -> None:
    if _server is not None:
        _server.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_after_fork)
atexit.register(_close_at_exit)
