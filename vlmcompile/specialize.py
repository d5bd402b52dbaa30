"""Specialise a capture on the values of the batch inputs that decide shapes.

LLaVA-NeXT picks a patch grid from ``image_sizes``; Qwen2.5-VL and Qwen3-VL split attention
by ``image_grid_thw.tolist()``; Mllama looks up ``aspect_ratio_ids``. Neither capture path can
follow a shape computed from tensor values, but those values are fixed by the sample batch
(they describe the images, not the pixels). So capture runs the model with such inputs as real
tensors and :class:`KnownValues` folds every computation made from them alone into constants:
``torch.split(x, lengths.tolist())`` sees a Python list, ``int(grid_t)`` an int. The captured
graph is then valid for batches with these very values; the runtime checks that every batch
brings them (:func:`vlmcompile.specialize.check_specialized`).

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

_RANDOM = {"bernoulli", "multinomial", "normal", "poisson", "dropout"}
"""Names (beyond ``rand*``) of torch functions that draw random numbers, in- or out-of-place."""


def _is_random(func: Any) -> bool:
    """A random draw is never folded into a constant: the graph would replay it every step."""
    name = getattr(func, "__name__", "").rstrip("_").removesuffix("_like")
    return (
        name.startswith("rand")
        or name in _RANDOM
        or name in {"uniform", "exponential", "cauchy", "log_normal", "geometric", "random"}
    )


_SMALL = 1 << 16
"""Elements of the largest factory result (``torch.arange(n)``) folded into a constant."""


class KnownValues(TorchFunctionMode):
    """Runs every torch function whose tensor arguments all hold known values eagerly, outside
    the tracer's fake and proxy modes, so its result is a constant of the graph (or a Python
    number) instead of a data-dependent symbol. Results are known in turn."""

    def __init__(self, known: Mapping[str, torch.Tensor]):
        super().__init__()
        # By identity: a WeakSet would compare tensors with ==, which is elementwise.
        self._known: dict[int, weakref.ref] = {}
        for t in known.values():
            self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        self._known[id(t)] = weakref.ref(t)

    def _is_known(self, t: torch.Tensor) -> bool:
        ref = self._known.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not all(self._is_known(t) for t in tensors) or _is_random(func):
            return func(*args, **kwargs)
        with _disable_current_modes():
            out = func(*args, **kwargs)
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not tensors and not self._small_values(results):
            # A factory (arange, zeros, full) of no known input: known only when it is small
            # and has values (sizes and positions, not masks of a long sequence or meta tensors).
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
