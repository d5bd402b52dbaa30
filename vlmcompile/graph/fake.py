"""Fake tensors that claim the CPU, standing in for a model's meta or real tensors.

Capture exports a meta model on them and annotate interprets the graph on them: shapes and
dtypes are exact and nothing is allocated, and every op dispatches to the kernel a CPU run
would pick (on plain meta tensors SDPA falls back to the math path, and a graph exported on
meta names the meta device in its constants).

Inputs with values stay real next to them (*known values*): what is computed from those alone
runs for real, so a shape that depends on them can be known.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` under each of its names (a tied one under each)."""
    return {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }


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


class ShapesFromKnownValues(TorchDispatchMode):
    """On fake tensors, an op whose output shape depends on values (``hidden[image_mask]``, the
    ``masked_select`` in ``masked_scatter``'s backward) runs for real when every integer and
    boolean argument is a known value: the float arguments become zeros of their shape, and
    the result becomes a fake tensor again. Only its shape matters here."""

    def __init__(self, fake_mode: FakeTensorMode, limit_bytes: int = 1 << 30):
        super().__init__()
        self.fake_mode = fake_mode
        self.limit_bytes = limit_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            fakes = [t for t in tensors if isinstance(t, FakeTensor)]
            if any(not (t.is_floating_point() or t.is_complex()) for t in fakes):
                raise  # the shape depends on values nobody knows
            if sum(t.numel() * t.element_size() for t in fakes) > self.limit_bytes:
                raise
            with unset_fake_temporarily():
                real_args, real_kwargs = tree_map(_zeros_for_fake, (args, kwargs))
                out = func(*real_args, **real_kwargs)
            return tree_map(
                lambda t: self.fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, out
            )


def _zeros_for_fake(value: Any) -> Any:
    if isinstance(value, FakeTensor):
        return torch.zeros(value.shape, dtype=value.dtype)
    return value


def known_batch(batch: Mapping[str, Any], make: Any) -> tuple[dict[str, Any], list[str]]:
    """The batch for a run on fake tensors, and what it assumes. Inputs with values stay real:
    known values (see the annotate pass), so a shape that depends on them (image tokens among
    the token ids, Idefics3 dropping all-zero images) is what a real run makes. A meta float
    input (pixels) is taken as ones, which no model drops as padding; a meta integer input has
    no stand-in (token ids decide which tokens are image tokens) and stays unknown."""
    out, ones = {}, []
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            out[k] = v
        elif v.device.type != "meta":
            out[k] = v.detach()
        elif v.is_floating_point():
            out[k] = torch.ones(v.shape, dtype=v.dtype)
            ones.append(k)
        else:
            out[k] = make(v)
    assumed = [f"meta batch inputs {ones} are taken as ones where their values decide shapes"] if ones else []
    return out, assumed
