"""The rank server's own process (see :mod:`vlmcompile.runtime.rank_server`): it imports torch
once, then forks a local rank for each request that arrives on its control socket, and reports
each rank's pid and, when it has reaped it, its exit code.

It is run by path (``python -P rank_server_process.py FD``) and starts with the standard library
and torch alone: a rank takes the launcher's ``sys.path``, working directory and main module first
(multiprocessing's ``spawn.prepare``, as a spawned process does), so the vlmcompile and the user
code it imports are the launcher's, whichever checkout the server started in. What a request
names to import before the fork (``preload``: the launcher's vlmcompile modules and
:data:`PRELOAD`'s) the server imports on the launcher's ``sys.path``, each only where it finds the
file the launcher has, unchanged: the same code, imported once for every launch instead of in
every rank. A user's or test module is never imported here: its top-level code runs in the rank.

A request is one ``SOCK_SEQPACKET`` message: a pickle of builtins (``preparation``, multiprocessing's
preparation data; ``environ``, the launcher's environment; ``call``, the pickled ``(fn, args)`` the rank runs as ``fn(passed_fds, *args)``;
``name``, the rank's process name; ``preload``, module name -> the launcher's file and its mtime) with descriptors attached: the launcher's standard output and
error as they are at the request, the pipe the server reports on, then the call's own.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.process
import multiprocessing.spawn
import os
import pickle
import select
import signal
import socket
import struct
import sys
import traceback
import types

STATUS = struct.Struct("q")
"""What goes down a rank's status pipe: its pid at the fork, then its exit code (the negative signal
number if a signal ended it)."""
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
"""The server ignores what the job's process group receives (a terminal's Ctrl-C, a scheduler's
SIGTERM): the launcher decides what its ranks do with those, and the server must outlive them to
report the ranks' exit codes."""
_MAX_FDS = 16
_MAX_REQUEST = 1 << 20
PRELOAD = ("torch._dynamo", "torch.optim", "sympy", "transformers")
"""Modules a rank imports after its fork when the launcher has them (torch.optim's AdamW imports
torch._dynamo, 2-3 s; shape formulas sympy; a transformers model transformers). With the
launcher's vlmcompile modules, the server imports them before it forks, once, instead of every
rank of every launch: in CI's multi-process lane ranks spent a third of their time importing
(2026-11-28)."""
_tried: set[tuple[str, str, int]] = set()
"""(module, file, mtime) imports tried, done or failed: never tried again."""


def main(control_fd: int) -> None:
    for signum in _IGNORED:
        signal.signal(signum, signal.SIG_IGN)
    # Born with the mask of the launcher's thread, which may block SIGCHLD or a stop signal.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    control = socket.socket(fileno=control_fd)
    import torch
    import torch.distributed  # noqa: F401 - imported once here, not in every rank

    control.sendall(pickle.dumps({"torch": torch.__file__, "pid": os.getpid()}))
    _serve(control)


def _serve(control: socket.socket) -> None:
    """Fork a rank per request until the launcher closes the control socket (it exited, or has
    no more use for this server), then report the ranks still running as they end (they end
    soon: a launcher that has gone closed their pipe)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the select through wake_w
    statuses: dict[int, int] = {}
    serving = True
    while serving or statuses:
        # Not only on SIGCHLD: a second's timeout reaps whatever a lost wake-up left behind.
        ready, _, _ = select.select([control, wake_r] if serving else [wake_r], [], [], 1.0)
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
        _reap(statuses)
        if control in ready:
            serving = _take_request(control, statuses, (control.fileno(), wake_r, wake_w))


def _take_request(control: socket.socket, statuses: dict[int, int], server_fds: tuple[int, ...]) -> bool:
    """Fork the rank a request asks for; False once the launcher has closed the control socket."""
    message, fds, _, _ = socket.recv_fds(control, _MAX_REQUEST, _MAX_FDS)
    if not message:
        return False
    try:
        request = pickle.loads(message)
        if len(fds) < 3:
            raise ValueError(f"{len(fds)} descriptors")
    except Exception:  # noqa: BLE001 - not a request: dropped; the launcher reads no pid and spawns
        for fd in fds:
            os.close(fd)
        return True
    _preload(request.get("preload", {}), request["preparation"].get("sys_path"), server_fds[-1])
    _fork_rank(request, fds, statuses, server_fds)
    return True


def _preload(modules: dict[str, tuple[str, int]], sys_path: list[str] | None, wake_w: int) -> None:
    """Import the modules the launcher named (name -> its file there and the file's mtime), each
    where this process finds the same file, unchanged, on the launcher's ``sys.path``: a rank must
    run the launcher's code, never another copy (the launcher retires this server when a module
    it named changes). The server's own signal set-up is put back after: an import may change it."""
    import importlib
    import importlib.util

    if sys_path is not None:
        sys.path[:] = sys_path
    importlib.invalidate_caches()
    handlers = {signum: signal.getsignal(signum) for signum in (*_IGNORED, signal.SIGCHLD)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    try:
        for name, (file, mtime) in modules.items():
            if name in sys.modules or (name, file, mtime) in _tried:
                continue
            _tried.add((name, file, mtime))
            try:
                spec = importlib.util.find_spec(name)
                if spec is not None and spec.origin == file and os.stat(file).st_mtime_ns == mtime:
                    importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - the rank imports it itself, and meets the error there
                pass
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(wake_w)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _fork_rank(request: dict, fds: list[int], statuses: dict[int, int], server_fds: tuple[int, ...]) -> None:
    status = fds[2]
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd in (*server_fds, *statuses.values()):
                os.close(fd)
            _become_rank(request, fds)
            code = 0
        except SystemExit as stop:
            code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        except BaseException:  # noqa: BLE001 - the rank's failure, printed as a spawned rank's would be
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    for fd in fds:
        if fd != status:
            os.close(fd)
    try:
        os.write(status, STATUS.pack(pid))
    except OSError:  # the launcher gave up on this rank already; it is reaped all the same
        pass
    statuses[pid] = status


def _reap(statuses: dict[int, int]) -> None:
    while statuses:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status = statuses.pop(pid, None)
        if status is None:
            continue
        with contextlib.suppress(OSError):
            os.write(status, STATUS.pack(os.waitstatus_to_exitcode(wait_status)))
        os.close(status)


def _become_rank(request: dict, fds: list[int]) -> None:
    """In the forked child: the state a spawned rank starts in (default SIGTERM, SIGINT and SIGUSR1
    ignored, the launcher's outputs, path, directory and main module), then the call."""
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    stdout, stderr, status, *passed = fds
    os.close(status)
    for fd, target in ((stdout, 1), (stderr, 2)):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    # The server's stdout was /dev/null, so block-buffered: a spawned rank's is line-buffered on a
    # terminal, and its lines must not wait in a buffer that a kill throws away.
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stdout.reconfigure(line_buffering=os.isatty(1))
    name_process(request["name"])
    os.environ.clear()  # the launcher's of now (the server restarts when what imports read changed)
    os.environ.update(request["environ"])
    # The launcher's main module replaces this one (``prepare``); where it has none (``python -c``,
    # a notebook), an empty one, as a spawned rank has: never the server's own.
    sys.modules["__main__"] = types.ModuleType("__main__")
    current = multiprocessing.process.current_process()
    current._inheriting = True  # what the launcher checks to tell an unguarded script's re-run
    try:
        multiprocessing.spawn.prepare(request["preparation"])
        fn, args = pickle.loads(request["call"])
    finally:
        del current._inheriting
    fn(passed, *args)


def name_process(name: str) -> None:
    """The process's name in ps and top, and in /proc/PID/comm (15 bytes at most)."""
    with contextlib.suppress(OSError, AttributeError):
        pr_set_name = 15
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
