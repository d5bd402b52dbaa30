"""The CLI's ``--model`` and ``--data`` when they name a user's function: ``pkg.module:function``.

``--model pkg.module:function``: the function builds the model, or the model and a sample batch
(a dict keyed by the forward's argument names, or a list of samples of different shapes, one
dict each). It is called with no arguments, or with ``device="meta"`` where it takes a
``device`` parameter and only the model's sizes are needed (``vlmcompile plan``); the seed is set
before the call, so every rank builds the same weights. Zoo names (``demo``, ``InternVL-Chat-1.5``,
``ViT-22B+GPT-175B``) and the tiny transformers models (``hf-llava``, ...) are built here too,
so the commands take any of the three alike.

``--data pkg.module:function``: the function returns a dataset of samples (anything with ``len``
and indexing, each item a dict as a transformers processor returns it).

The folder the command runs in is searched first, as ``python script.py`` would.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import os
import random
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch
from torch import nn

from vlmcompile.ir.errors import DataError, ModelError

_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
FUNCTION_FORM = "pkg.module:function"


def is_function(spec: str) -> bool:
    """Whether ``spec`` names a function (``pkg.module:function``) rather than a zoo name, a
    ``synthetic:<name>`` distribution or a file."""
    return bool(_FUNCTION.match(spec)) and not spec.startswith("synthetic:") and not os.path.exists(spec)


@dataclass(frozen=True)
class BuiltModel:
    """A model as a command builds it, with the sample batch its source gave (None: none)."""

    name: str
    model: nn.Module
    batch: Mapping[str, Any] | list | None

    @functools.cached_property
    def samples(self) -> list | None:
        """The samples the model trains packed: a list the source gave, or a dict batch of a
        model whose dict batches are captured as their samples (a Qwen-VL family); else None."""
        from vlmcompile import families
        from vlmcompile.data.packing import split_batch

        if isinstance(self.batch, list):
            return self.batch
        if isinstance(self.batch, Mapping) and families.packs_dict_batches(self.model):
            return split_batch(self.batch, families.layout_of(self.model))
        return None


def build(
    spec: str, *, device: str = "cpu", dtype: torch.dtype | None = None, seed: int = 0, batch_size: int = 1
) -> BuiltModel:
    """The model ``spec`` names and its sample batch: a zoo name (a batch of ``batch_size``), a
    tiny transformers model (``hf-...``) or a user's function (its own batch, if it returns one).

    Raises:
        ModelError: an unknown name, a function that cannot be imported or returns no model.
    """
    if is_function(spec):
        return _from_function(spec, device=device, dtype=dtype, seed=seed)
    if spec.startswith("hf-"):
        from vlmcompile import families

        torch.manual_seed(seed)
        model, batch = families.build_tiny_by_name(spec, batch=batch_size, device=device)
        return BuiltModel(spec, _cast(model, dtype), _cast_batch(batch, dtype))
    from vlmcompile import models

    model = models.build(spec, device=device, dtype=dtype, seed=seed)
    batch = models.sample_batch(spec, batch_size=batch_size, device=device, dtype=dtype or torch.float32)
    return BuiltModel(spec, model, batch)


def load_function(spec: str, flag: str):
    """The function ``spec`` (``pkg.module:function``) names, imported with the working folder
    first on the path.

    Raises:
        ModelError: the module does not import, or holds no such function.
    """
    module_name, _, function_name = spec.partition(":")
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name or module_name.startswith(f"{err.name}."):
            raise ModelError(
                f"{flag} {spec}: no module {err.name!r} in {here} or on the Python path; run from the folder "
                f"that holds {module_name.replace('.', '/')}.py, or add its folder to PYTHONPATH"
            ) from None
        raise ModelError(f"{flag} {spec}: importing {module_name} failed: {err}") from err
    except Exception as err:  # the user's module itself: its message, and its frames behind it
        raise ModelError(
            f"{flag} {spec}: importing {module_name} failed: {type(err).__name__}: {err}"
        ) from err
    function = getattr(module, function_name, None)
    if not callable(function):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(function_name, names, n=1)
        hint = (
            f"did you mean {module_name}:{close[0]}?"
            if close
            else f"its functions: {', '.join(sorted(names))}"
        )
        raise ModelError(f"{flag} {spec}: {module_name} has no function {function_name!r}; {hint}")
    return function


def seeded(seed: int) -> None:
    """Every generator a user's code may draw from, seeded alike on every rank (torchrun's
    processes each build the model and the data themselves: they must build the same)."""
    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def call(spec: str, flag: str, seed: int, error: type[Exception] = ModelError, **kwargs: Any) -> Any:
    """What the function ``spec`` returns, called after :func:`seeded` (its module imported after it
    too); an exception it raises becomes ``error`` naming it, the user's frames behind it."""
    seeded(seed)
    try:
        function = load_function(spec, flag)
    except ModelError as err:
        raise error(str(err)) from err.__cause__
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        parameters = {}
    try:
        return function(**{k: v for k, v in kwargs.items() if k in parameters})
    except Exception as err:
        raise error(f"{flag} {spec} raised {type(err).__name__}: {err}") from err


def _from_function(spec: str, *, device: str, dtype, seed: int) -> BuiltModel:
    made = call(spec, "--model", seed, device=device)
    model, batch = (made, None) if isinstance(made, nn.Module) else _pair(spec, made)
    return BuiltModel(spec, _cast(model.train(), dtype), _cast_batch(batch, dtype))


def _pair(spec: str, made: Any) -> tuple[nn.Module, Any]:
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        model, batch = made
        if batch is None or isinstance(batch, (Mapping, list)):
            return model, batch
        what = f"a {type(batch).__name__} as its sample batch"
    else:
        what = f"a {type(made).__name__}"
    raise ModelError(
        f"--model {spec} returned {what}; return the model (an nn.Module), or (model, sample_batch) with the "
        "batch a dict keyed by the forward's argument names or a list of samples (one dict each)"
    )


def _cast(model: nn.Module, dtype) -> nn.Module:
    return model.to(dtype) if dtype is not None else model


def _cast_batch(batch, dtype):
    """The batch's floating tensors in ``dtype`` (the model's, so that its layers take them)."""
    if dtype is None or batch is None:
        return batch
    if isinstance(batch, list):
        return [_cast_batch(sample, dtype) for sample in batch]
    return {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in batch.items()
    }


def dataset(spec: str, seed: int = 0) -> Sequence:
    """The dataset a ``--data pkg.module:function`` returns.

    Raises:
        DataError: it returns something without ``len`` and indexing.
    """
    data = call(spec, "--data", seed, DataError)
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise DataError(
            f"--data {spec} returned a {type(data).__name__}; return a dataset of samples (a list, or anything "
            "with len() and [i]), each a dict as the processor gives it"
        )
    return data


def data(
    spec: str, model: nn.Module, *, num_samples: int, seed: int = 0, text_scale: float = 1.0
) -> Sequence:
    """``--data``'s dataset: a user's function's, a ``synthetic:<name>`` distribution of
    ``num_samples`` or a JSONL manifest of sample sizes (those two as ``model``'s samples)."""
    if is_function(spec):
        if text_scale != 1.0:
            raise DataError(
                f"--text-scale {text_scale:g} scales synthetic or manifest samples; --data {spec} gives its own "
                "samples: drop --text-scale"
            )
        return dataset(spec, seed)
    from vlmcompile import families
    from vlmcompile.data.synthetic import dataset_from_spec

    return dataset_from_spec(
        spec, families.layout_of(model), num_samples=num_samples, seed=seed, text_scale=text_scale
    )
