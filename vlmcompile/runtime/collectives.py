"""Waiting on torch.distributed work with a deadline, and the summed gradient all-reduce: shared by
the pipeline executor and the contrastive step, so a lost peer reads the same everywhere."""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from vlmcompile.ir.errors import VlmCompileError


class RankLostError(VlmCompileError, RuntimeError):
    """A peer rank died, hung or failed while this rank waited for it (``peer``: its global rank,
    None for a collective over a group)."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


class Deadline:
    """Waits on a rank's communication, each wait bounded by ``timeout_s``."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank = rank
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def wait(self, work, what: str, peer: int | None = None) -> None:
        start = time.monotonic()
        try:
            work.wait(self.timeout)
        except RuntimeError as err:
            waited = time.monotonic() - start
            cause = "timed out" if waited >= 0.9 * self.timeout_s else "the connection failed"
            raise self.lost(f"{cause} after {waited:.1f} s waiting for {what}", err, peer) from None

    def lost(self, what: str, err: BaseException, peer: int | None) -> RankLostError:
        return RankLostError(
            f"rank {self.rank}: {what}; that rank died, hung or failed (see its own error). "
            f"{dist.get_backend()} said: {(str(err).splitlines() or [''])[0][:200]}",
            peer,
        )


def sum_gradients(
    params: Sequence[torch.nn.Parameter],
    group: Any,
    deadline: Deadline,
    what: str,
    buffers: dict[int, torch.Tensor],
    device: torch.device | None = None,
) -> None:
    """Sum the gradients of ``params`` over ``group`` in one collective (one per tensor would
    pay the collective's latency per tensor). Every member reduces the same list: a parameter
    without a gradient here (its stage ran no microbatch, or only ones without label tokens)
    may have one on another member, so it takes zeros, and one count per parameter rides
    along: a parameter no member has a gradient for keeps ``grad = None``, as in eager (where
    AdamW then skips it: no weight decay, no state). ``buffers`` keeps one flat buffer per group
    across steps: a fresh one costs page faults every step."""
    params = [p for p in params if p.requires_grad]  # frozen: no gradient, as in eager
    if not params:
        return
    present = [p.grad is not None for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    numel = sum(g.numel() for g in grads)
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
    flat = buffers.get(id(group))
    if flat is None or flat.numel() != numel + len(grads) or flat.dtype != dtype:
        flat = buffers[id(group)] = torch.empty(numel + len(grads), dtype=dtype, device=device)
    torch.cat([g.reshape(-1) for g in grads], out=flat[:numel])
    flat[numel:].copy_(torch.tensor(present, dtype=dtype))
    deadline.wait(dist.all_reduce(flat, group=group, async_op=True), what)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    for p, holders in zip(params, flat[numel:].tolist()):
        if holders == 0:
            p.grad = None
