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
    """Waits on a rank's communication, each wait bounded by ``timeout_s``.

    On NCCL a wait does not block the host: ``work.wait()`` without a timeout only orders the
    current CUDA stream after the collective, so the host goes on queueing kernels (a wait given
    a timeout spins the host until the GPU is done, and no backward overlaps the gradient
    reduction). The bound there is the process group's own, which NCCL's watchdog thread keeps
    (``init_process_group(timeout=)``, and each ``new_group(timeout=)``): it aborts a collective
    that overruns it and the rank with it, which the launcher or torchrun reports. On gloo the
    host waits, at most ``timeout_s``."""

    def __init__(self, rank: int, timeout_s: float, *, stream_ordered: bool | None = None):
        self.rank = rank
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.stream_ordered = _nccl() if stream_ordered is None else stream_ordered

    def wait(self, work, what: str, peer: int | None = None) -> None:
        start = time.monotonic()
        try:
            if self.stream_ordered:
                work.wait()
            else:
                work.wait(self.timeout)
        except RuntimeError as err:
            waited = time.monotonic() - start
            cause = "timed out" if waited >= 0.9 * self.timeout_s else "the connection failed"
            raise self.lost(f"{cause} after {waited:.1f} s waiting for {what}", err, peer) from None

    def lost(self, what: str, err: BaseException, peer: int | None) -> RankLostError:
        return RankLostError(
            f"rank {self.rank}: {what}; that rank died, hung or failed (see its own error). "
            f"{dist.get_backend() if dist.is_initialized() else 'the backend'} said: "
            f"{(str(err).splitlines() or [''])[0][:200]}",
            peer,
        )


def _nccl() -> bool:
    """Whether this process's default group runs on NCCL (its waits are stream-ordered)."""
    return dist.is_initialized() and dist.get_backend() == "nccl"


def sum_gradients(
    params: Sequence[torch.nn.Parameter],
    group: Any,
    deadline: Deadline,
    what: str,
    buffers: dict[Any, torch.Tensor],
    device: torch.device | None = None,
) -> None:
    """Sum the gradients of ``params`` over ``group`` in one collective (one per tensor would
    pay the collective's latency per tensor). Every member reduces the same list: a parameter
    without a gradient here (its stage ran no microbatch, or only ones without label tokens)
    may have one on another member (:func:`flat_gradients`, :func:`write_sums`)."""
    params = [p for p in params if p.requires_grad]  # frozen: no gradient, as in eager
    if not params:
        return
    flat = flat_gradients(params, buffers, id(group), device)
    deadline.wait(dist.all_reduce(flat, group=group, async_op=True), what)
    write_sums(params, flat)


def flat_gradients(
    params: Sequence[torch.nn.Parameter], buffers: dict[Any, torch.Tensor], key: Any, device=None
) -> torch.Tensor:
    """The gradients of ``params`` in one flat buffer (zeros for a parameter without one), then
    one count per parameter: 1 where it has a gradient. ``buffers`` keeps the buffer under
    ``key`` across steps: a fresh one costs page faults every step."""
    present = [p.grad is not None for p in params]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    numel = sum(g.numel() for g in grads)
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
    flat = buffers.get(key)
    if flat is None or flat.numel() != numel + len(grads) or flat.dtype != dtype:
        flat = buffers[key] = torch.empty(numel + len(grads), dtype=dtype, device=device or grads[0].device)
    torch.cat([g.reshape(-1) for g in grads], out=flat[:numel])
    flat[numel:].copy_(torch.tensor(present, dtype=dtype))
    return flat


def write_sums(params: Sequence[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """The sums in ``flat`` (:func:`flat_gradients`'s layout, reduced) into the gradients; a
    parameter no member had a gradient for keeps ``grad = None``, as in eager (where AdamW then
    skips it: no weight decay, no state)."""
    offset = 0
    for p, holders in zip(params, flat[flat.numel() - len(params) :].tolist()):
        if holders == 0:
            p.grad = None
        else:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
