"""How the runtime waits on communication: the host waits on gloo, bounded; on NCCL the wait only
orders the CUDA stream (the process group's watchdog keeps the bound)."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist

from vlmcompile.runtime.collectives import Deadline, RankLostError


class RecordedWork:
    """A finished piece of work that records how it was waited on (a torch ``Work`` cannot be
    made on this machine for NCCL, where the difference lies)."""

    def __init__(self, fails: bool = False):
        self.calls: list[tuple] = []
        self.fails = fails

    def wait(self, *args):
        self.calls.append(args)
        if self.fails:
            raise RuntimeError("Connection closed by peer")
        return True


def test_a_stream_ordered_wait_gives_no_host_timeout():
    work = RecordedWork()
    Deadline(0, 5.0, stream_ordered=True).wait(work, "a recv")
    assert work.calls == [()]


def test_a_host_wait_is_bounded_by_the_deadline():
    work = RecordedWork()
    Deadline(0, 5.0, stream_ordered=False).wait(work, "a recv")
    assert work.calls == [(datetime.timedelta(seconds=5.0),)]


def test_a_failed_wait_names_the_rank_and_what_it_waited_for():
    with pytest.raises(RankLostError, match=r"rank 3: the connection failed after .* waiting for a recv"):
        Deadline(3, 5.0, stream_ordered=True).wait(RecordedWork(fails=True), "a recv", peer=1)


def test_gloo_waits_on_the_host():
    assert not Deadline(0, 5.0).stream_ordered  # no process group: nothing stream-ordered
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        deadline = Deadline(0, 30.0)
        assert not deadline.stream_ordered
        t = torch.ones(3)
        deadline.wait(dist.all_reduce(t, async_op=True), "an all-reduce")
        torch.testing.assert_close(t, torch.ones(3))
    finally:
        dist.destroy_process_group()
