"""Specialise a capture on the values of the batch inputs that decide shapes.

LLaVA-NeXT picks a patch grid from ``image_sizes``; Qwen2.5-VL and Qwen3-VL split attention
by ``image_grid_thw.tolist()``; Mllama looks up ``aspect_ratio_ids``. Neither capture path can
follow a shape computed from tensor values, but those values are fixed by the sample batch
(they describe the images, not the pixels). So capture runs the model with such inputs as real
tensors and :class:`KnownValues` folds every computation made from them alone into constants:
``torch.split(x, lengths.tolist())`` sees a Python list, ``int(grid_t)`` an int. The captured
graph is then valid for batches with these very values; the runtime checks that every
microbatch brings them (``PipelineRunner.check_batch``).

Which inputs, no more than a capture needs: none while the model captures without; then the
integer tensors not laid out per token (``image_sizes``, ``image_grid_thw``: per-token tensors
share ``input_ids``' leading two sizes); then also the per-token integer tensors other than the
tokens themselves (``mm_token_type_ids``, ``attention_mask``: where the image tokens sit).
``input_ids`` and ``labels`` are content and never specialised.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from vlmcompile.ir.errors import CaptureError
from vlmcompile.ir.microbatch import num_samples

_RANDOM = {"bernoulli", "multinomial", "normal", "poisson", "rrelu", "gumbel_softmax"}
"""Names (beyond ``rand*`` and ``*dropout*``) of torch functions that draw random numbers."""


def _name(func: Any) -> str:
    return getattr(func, "__name__", "")


def _is_random(func: Any) -> bool:
    """A random draw is never folded into a constant: the graph would replay it every step."""
    name = _name(func).rstrip("_").removesuffix("_like")
    return (
        name.startswith("rand")
        or "dropout" in name
        or name in _RANDOM
        or name in {"uniform", "exponential", "cauchy", "log_normal", "geometric", "random"}
    )


_FACTORIES = {"arange", "zeros", "ones", "full", "tensor", "as_tensor", "scalar_tensor", "linspace", "eye"}
"""Functions of no tensor that make values worth knowing (sizes and positions)."""

_IN_PLACE_DUNDERS = {
    "__setitem__",
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__ifloordiv__",
    "__imod__",
    "__ipow__",
    "__iand__",
    "__ior__",
    "__ixor__",
    "__ilshift__",
    "__irshift__",
    "__imatmul__",
}


def _mutated(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor ``func`` writes into (``x.add_(y)``, ``x[i] = y``, ``out=x``), or None."""
    if isinstance(kwargs.get("out"), torch.Tensor):
        return kwargs["out"]
    name = _name(func)
    writes = name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))
    return args[0] if writes and args and isinstance(args[0], torch.Tensor) else None


_SMALL = 1 << 16
"""Elements of the largest factory result (``torch.arange(n)``) folded into a constant."""


class KnownValues(TorchFunctionMode):
    """Runs every torch function whose tensor arguments all hold known values eagerly, outside
    the tracer's fake and proxy modes, so its result is a constant of the graph (or a Python
    number) instead of a data-dependent symbol. Results are known in turn.

    Writes are where folding could go wrong, so they are refused (a :class:`CaptureError`
    that names the function): a write into a known value from unknown ones (the graph would
    write into its own constant, step after step), and a write into a known value that the
    graph already holds as a constant (the earlier use would see the later value)."""

    def __init__(self, known: Mapping[str, torch.Tensor]):
        super().__init__()
        # By identity: a WeakSet would compare tensors with ==, which is elementwise.
        self._known: dict[int, weakref.ref] = {}
        self._in_graph: dict[int, weakref.ref] = {}
        """Known tensors an op of the graph has read: constants of the graph."""
        for t in known.values():
            self._add(t)

    def _add(self, t: torch.Tensor, table: dict | None = None) -> None:
        (self._known if table is None else table)[id(t)] = weakref.ref(t)

    def _is_known(self, t: torch.Tensor, table: dict | None = None) -> bool:
        ref = (self._known if table is None else table).get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        known = [self._is_known(t) for t in tensors]
        target = _mutated(func, args, kwargs)
        if target is not None and self._is_known(target):
            if not all(known) or self._is_known(target, self._in_graph):
                raise CaptureError(
                    f"capture specialised on batch values, and the model then writes into a value computed "
                    f"from them ({_name(func)}) that the graph holds as a constant; such a graph would be "
                    "wrong. Compute that value without writing into it in place"
                )
        if not all(known) or _is_random(func) or (not tensors and _name(func) not in _FACTORIES):
            for t, k in zip(tensors, known):
                if k:
                    self._add(t, self._in_graph)
            return func(*args, **kwargs)
        with _disable_current_modes():
            out = func(*args, **kwargs)
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not tensors and not self._small_values(results):
            # A factory of no known input is known only when it is small and has values
            # (sizes and positions, not masks of a long sequence or meta tensors).
            return func(*args, **kwargs)
        for t in results:
            self._add(t)
        return out

    @staticmethod
    def _small_values(results: list[torch.Tensor]) -> bool:
        return bool(results) and all(t.device.type != "meta" and t.numel() <= _SMALL for t in results)


CONTENT_KEYS = ("input_ids", "labels")


def value_input_tiers(batch: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The sets of batch keys capture tries to specialise on, smallest first (see the module
    docstring); empty sets left out."""
    ids = batch.get("input_ids")
    token_layout = tuple(ids.shape[:2]) if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None
    layout, per_token = [], []
    for key, value in batch.items():
        if key in CONTENT_KEYS or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if value.is_floating_point() or value.is_complex():
            continue
        if token_layout is not None and tuple(value.shape[:2]) == token_layout:
            per_token.append(key)
        else:
            layout.append(key)
    tiers = [tuple(layout), tuple(layout + per_token)]
    return [t for i, t in enumerate(tiers) if t and t not in tiers[:i]]


def differs_between_samples(batch: Mapping[str, Any], keys: tuple[str, ...]) -> list[str]:
    """The keys among ``keys`` whose values are not the same for every sample of ``batch``."""
    samples = num_samples(batch)
    out = []
    for key in keys:
        parts = (
            batch[key].split(batch[key].shape[0] // samples)
            if batch[key].shape[0] >= samples
            else [batch[key]]
        )
        if any(p.shape != parts[0].shape or not torch.equal(p, parts[0]) for p in parts[1:]):
            out.append(key)
    return out
