"""Fake tensors that claim the CPU, standing in for a model's meta or real tensors.

Capture exports a meta model on them and annotate interprets the graph on them: shapes and
dtypes are exact and nothing is allocated, and every op dispatches to the kernel a CPU run
would pick (on plain meta tensors SDPA falls back to the math path, and a graph exported on
meta names the meta device in its constants).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


@contextlib.contextmanager
def swapped_tensors(module: nn.Module, make: Any) -> Iterator[None]:
    """Swap every parameter and buffer of ``module`` for ``make(t)``; the same object maps to the
    same replacement (tied weights stay tied). Restores the originals on exit."""
    memo: dict[int, torch.Tensor] = {}
    undo: list[tuple[dict, str, Any]] = []
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    memo[id(t)] = make(t)
                undo.append((table, name, t))
                table[name] = memo[id(t)]
    try:
        yield
    finally:
        for table, name, t in undo:
            table[name] = t


def fake_factory(mode: FakeTensorMode):
    def make(t: torch.Tensor) -> torch.Tensor:
        with mode:
            fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
        if isinstance(t, nn.Parameter):
            return nn.Parameter(fake, requires_grad=t.requires_grad)
        return fake

    return make
