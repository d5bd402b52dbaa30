"""Ranks forked from the rank server start as spawned ranks would: the launcher's environment,
outputs, path and main module as they are at the launch; the server outlives the job's stop
signals, is started again when it died or the environment changed, and a server that dies under
running ranks fails the launch instead of hanging it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from vlmcompile.runtime import rank_server
from vlmcompile.runtime.launch import LaunchError, launch

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]


@pytest.mark.skipif(not rank_server._supported(), reason="no rank server on this platform or Python")
def test_forked_ranks_get_the_launchers_environment_outputs_and_path_of_now(tmp_path):
    # The first launch starts the server with standard output and error sent to /dev/null; a
    # variable set after it, a path added after it and the outputs as they are now must still
    # reach the next launch's ranks, as they would a spawned rank. The last launch spawns.
    (tmp_path / "late_module.py").write_text("WHERE = 'on the path added after the first launch'\n")
    script = tmp_path / "launch_thrice.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            from pathlib import Path
            from vlmcompile.runtime.launch import launch

            def rank_fn(key):
                import torch.distributed as dist
                print(f"rank {{dist.get_rank()}} to stdout", flush=True)
                print(f"rank {{dist.get_rank()}} to stderr", file=sys.stderr, flush=True)
                import late_module
                comm = Path("/proc/self/comm").read_text().strip()
                return os.environ.get(key), late_module.WHERE, comm, os.getppid() == int(os.environ["LAUNCHER"])

            if __name__ == "__main__":
                os.environ["LAUNCHER"] = str(os.getpid())
                saved = os.dup(1), os.dup(2)
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
                launch(print, "started", 2, timeout_s=30)
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.environ["VLMCOMPILE_SET_LATE"] = "set after the first launch"
                sys.path.insert(0, {str(tmp_path)!r})
                print("forked", launch(rank_fn, "VLMCOMPILE_SET_LATE", 2, timeout_s=30))
                os.environ["VLMCOMPILE_RANK_START"] = "spawn"
                print("spawned", launch(rank_fn, "VLMCOMPILE_SET_LATE", 2, timeout_s=30))
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != rank_server.START_ENV}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("rank 0 to stdout") == 2 and done.stdout.count("rank 1 to stdout") == 2, (
        done.stdout
    )
    assert done.stderr.count("rank 0 to stderr") == 2 and done.stderr.count("rank 1 to stderr") == 2, (
        done.stderr
    )
    where = "on the path added after the first launch"
    forked = [("set after the first launch", where, f"vlmcompile-r{rank}", False) for rank in range(2)]
    spawned = [("set after the first launch", where, f"vlmcompile-r{rank}", True) for rank in range(2)]
    assert f"forked {forked}" in done.stdout, done.stdout
    assert f"spawned {spawned}" in done.stdout, done.stdout


def _pid_and_parent(_payload):
    return os.getpid(), os.getppid()


def _server() -> rank_server.RankServer:
    """The server the next launch forks its ranks from (started if need be)."""
    with rank_server.in_use() as server:
        pass
    if server is None:
        pytest.skip(f"no rank server here ({rank_server.START_ENV} or the platform)")
    return server


def test_the_server_outlives_the_jobs_stop_signals_and_is_started_again_when_it_died():
    server = _server()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        os.kill(server.process.pid, signum)
    time.sleep(0.3)
    assert server.alive()
    assert {parent for _, parent in launch(_pid_and_parent, None, 2, timeout_s=30)} == {server.process.pid}
    server.process.kill()
    server.process.wait(10)
    parents = {parent for _, parent in launch(_pid_and_parent, None, 2, timeout_s=30)}
    again = _server()
    assert again is not None and again is not server and parents == {again.process.pid}


def _sleep_then_report(folder):
    (Path(folder) / str(os.getpid())).touch()
    time.sleep(20)
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_once_both_ranks_run(server: rank_server.RankServer, folder: Path) -> None:
    deadline = time.monotonic() + 60
    while len(list(folder.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.process.kill()


def test_a_server_killed_under_running_ranks_fails_the_launch_and_leaves_no_rank(tmp_path):
    server = _server()
    killer = threading.Thread(target=_kill_once_both_ranks_run, args=(server, tmp_path), daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_sleep_then_report, str(tmp_path), 2, timeout_s=30, grace_s=1)
    assert time.monotonic() - start < 15, info.value
    assert str(info.value).startswith("the rank server died while ranks [0, 1] ran"), info.value
    ranks = [int(p.name) for p in tmp_path.iterdir()]
    assert len(ranks) == 2
    time.sleep(0.5)
    assert not [pid for pid in ranks if _alive(pid)]


def _environ_and_parent(key):
    return os.environ.get(key), os.getppid()


def test_a_changed_environment_starts_the_server_again_unless_no_import_reads_it(monkeypatch):
    server = _server()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "changed after the server started")
    seen = launch(_environ_and_parent, "PYTEST_CURRENT_TEST", 2, timeout_s=30)
    assert seen == [("changed after the server started", server.process.pid)] * 2
    monkeypatch.setenv("VLMCOMPILE_TEST_IMPORT_SETTING", "set after the server started")
    seen = launch(_environ_and_parent, "VLMCOMPILE_TEST_IMPORT_SETTING", 2, timeout_s=30)
    again = _server()
    assert again is not server and not server.alive()
    assert seen == [("set after the server started", again.process.pid)] * 2


def _sleep_and_name_parent(seconds):
    time.sleep(seconds)
    return os.getppid()


def test_a_launch_keeps_its_server_while_another_thread_starts_a_new_one(monkeypatch):
    # The second launch's environment differs, so it starts another server: the first launch's
    # ranks, forked from the old one, must still finish and report.
    old = _server()
    results: dict[str, object] = {}

    def first():
        try:
            results["first"] = launch(_sleep_and_name_parent, 4.0, 2, timeout_s=30)
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            results["first"] = err

    thread = threading.Thread(target=first)
    thread.start()
    time.sleep(1.0)
    monkeypatch.setenv("VLMCOMPILE_TEST_IMPORT_SETTING", "a second server")
    second = launch(_sleep_and_name_parent, 0.0, 2, timeout_s=30)
    thread.join(60)
    new = _server()
    assert new is not old and second == [new.process.pid] * 2
    assert results["first"] == [old.process.pid] * 2, results["first"]
    assert not old.alive()  # closed once the first launch no longer used it


def test_a_server_that_cannot_start_leaves_the_ranks_spawned_and_is_not_tried_again(monkeypatch, tmp_path):
    _server()  # this process's running server, put back when the test ends
    monkeypatch.setattr(rank_server, "_server", None)
    monkeypatch.setattr(rank_server, "_failed_key", None)
    real = rank_server._PROCESS_FILE
    monkeypatch.setattr(rank_server, "_PROCESS_FILE", tmp_path / "no_such_server.py")
    for _ in range(2):
        parents = {parent for _, parent in launch(_pid_and_parent, None, 2, timeout_s=30)}
        assert parents == {os.getpid()}  # spawned by this process
        # A server that could start now is not tried again in the environment it failed in.
        monkeypatch.setattr(rank_server, "_PROCESS_FILE", real)
    assert rank_server._server is None and rank_server._failed_key is not None


def _seen_at_start(payload):
    import sys

    import torch.distributed as dist

    return dist.get_rank(), "transformers" in sys.modules, os.environ.get("RANK_AT_IMPORT")


@pytest.mark.skipif(not rank_server._supported(), reason="no rank server on this platform or Python")
def test_the_server_imports_the_launchers_libraries_once_and_retires_when_one_changed(tmp_path):
    """A library the launcher has imported (transformers here) is already there when a forked rank
    starts; a user's module is imported by each rank itself, in its own environment (RANK set);
    a module the server imported that has changed since retires it: that launch spawns its
    ranks, the next forks from a fresh server."""
    (tmp_path / "users_module.py").write_text(
        "import os\nos.environ['RANK_AT_IMPORT'] = os.environ.get('RANK', 'unset')\n"
        "from tests.runtime.test_rank_server import _seen_at_start\n"
    )
    script = tmp_path / "launch_thrice.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(tmp_path)!r})
            sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
            from vlmcompile.runtime import rank_server
            from vlmcompile.runtime.launch import launch

            def rank_fn(payload):
                import users_module
                return users_module._seen_at_start(payload)

            if __name__ == "__main__":
                import transformers  # here, not at the top: the ranks run this file's top (as __mp_main__)
                print(launch(rank_fn, None, 2, timeout_s=30))
                first = rank_server._server
                name = next(iter(first.preloaded))
                first.preloaded[name] = ("another copy", 0)  # as if the launcher's file had changed
                print(launch(rank_fn, None, 2, timeout_s=30), rank_server._server is None)
                print(launch(rank_fn, None, 2, timeout_s=30), rank_server._server not in (None, first))
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "[(0, True, '0'), (1, True, '1')]", lines
    assert lines[1].endswith("True") and "(0, " in lines[1], "the stale server is retired; the ranks spawn"
    assert lines[2] == "[(0, True, '0'), (1, True, '1')] True", "a fresh server forks the next launch"
