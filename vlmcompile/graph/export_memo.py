"""A memo of torch.export within one process, for capturing a model of the same code, configuration
and shapes again: the test suite's tiny families are compiled by many test files (an export is
1-2 s of a tiny model's 4-5 s compile), and a notebook may compile one model for several clusters.

Off unless ``VLMCOMPILE_MEMO=1`` (tests/conftest.py sets it): a model whose code was
patched between two captures without its classes, configuration or module attributes changing
(a module-level function of transformers replaced in place) would get the first capture's graph.
The capture pass's numerics check runs on every capture, memoised or not, and compares the graph
with eager on real tensors.

What an export depends on, and so the key (:func:`structure_key`): every module's class and plain
attributes (configurations included, recursively; a module held as an attribute by its path),
its parameters' and buffers' names, kinds, shapes, strides, dtypes, devices, ``requires_grad``
and which of them are one tensor, the values of tensors that are not parameters or buffers
(known values a capture is specialised on, constants the graph lifts), the batch's tensors'
kinds and the values of its integer tensors, the dynamic shapes asked for, and the global state
export reads (grad and inference mode, autocast, default dtype and device, torch's shape and
export settings, the ``torch.export.export`` in use, the functions transformers' attention and
mask names resolve to). Parameter and buffer values are not in it: a non-strict export traces
them as fake tensors. A model the key cannot describe (a module held from outside it, an object
with no state to read, a torch mode active) is exported every time.

A hit is a deep copy of the stored graph whose parameters, buffers and held tensor attributes are
the new model's own (by name), as a fresh export's are, and whose nodes' metadata is its own; a
data-dependent failure (the capture's cue to specialise) is memoised as well and raised again.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import hashlib
import os
import sys
import traceback
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from vlmcompile.graph.fake import named_tensors

MEMO_ENV = "VLMCOMPILE_MEMO"
"""The switch of this memo and of :mod:`vlmcompile.graph.annotate_memo`."""
MAX_ENTRIES = 48
"""Exports kept (least recently used dropped): a tiny family's graph is a few hundred kB."""
_VALUE_BYTES = 1 << 22
"""A tensor attribute larger than this (4 MiB) makes the model unkeyed: hashing it would cost
more than the memo saves, and a model that large is not compiled twice in a test run."""

Exported = tuple[fx.GraphModule, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class _Entry:
    gm: fx.GraphModule
    """The graph, holding meta stand-ins for the model's own tensors."""
    checks: tuple[str, ...]
    attributes: tuple[str, ...]
    """Tensor attributes of the model (not parameters or buffers) the graph holds as its own
    constants, as a fresh export does: a hit binds the new model's."""
    referents: tuple[Any, ...]
    """The classes and functions the key names by id, kept alive so that no other takes their id."""


class Unkeyed(Exception):
    """Something the export may depend on cannot be put in a key: export without the memo."""


def enabled() -> bool:
    return os.environ.get(MEMO_ENV) == "1"


class Memo:
    """Entries by key, the least recently used dropped past ``max_entries``, with hit and miss
    counts since the process started (the tests that a memo is used read them)."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self.entries: OrderedDict[str, Any] = OrderedDict()
        self.stats = {"hits": 0, "misses": 0}

    def key(self, describe: Callable[[], tuple[str, tuple]]) -> tuple[str, tuple] | None:
        """``describe()``'s key and referents; None when the switch is off or the description
        fails (:class:`Unkeyed`, or a value it could not read): then the work is done without."""
        if not enabled():
            return None
        try:
            return describe()
        except Exception:
            return None

    def get(self, key: str) -> Any | None:
        found = self.entries.get(key)
        if found is None:
            self.stats["misses"] += 1
        else:
            self.entries.move_to_end(key)
            self.stats["hits"] += 1
        return found

    def put(self, key: str, value: Any) -> None:
        self.entries[key] = value
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)


_memo = Memo(MAX_ENTRIES)
stats = _memo.stats


def exported(
    root: nn.Module,
    batch: Mapping[str, Any],
    dynamic_shapes: Mapping[str, Any] | None,
    export: Callable[[], Exported],
    is_cue: Callable[[BaseException], bool],
) -> Exported:
    """``export()``'s result, or a copy of the one memoised under the same key for ``root``.
    ``is_cue``: the failures to memoise (the data-dependent ones a capture retries specialised).
    The memo never makes an export fail: whatever goes wrong in it leaves the export to torch."""
    keyed = _memo.key(lambda: _key(root, batch, dynamic_shapes))
    if keyed is None:
        return export()
    key, referents = keyed
    found = _memo.get(key)
    if isinstance(found, BaseException):
        raise found
    if found is not None:
        return _bind(found, root), found.checks
    try:
        gm, checks = export()
    except Exception as err:
        if is_cue(err):
            # Its frames' locals (the model, the batch, the fake mode) go; their lines stay for
            # the message that names the model's line.
            traceback.clear_frames(err.__traceback__)
            _memo.put(key, err)
        raise
    with contextlib.suppress(Exception):  # a graph that does not copy is simply not memoised
        _memo.put(key, _unbound(gm, root, checks, referents))
    return gm, checks


def clear() -> None:
    _memo.entries.clear()


def _tensor_attributes(module: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors held as plain attributes (not parameters or buffers), by path."""
    return {
        f"{path}.{name}" if path else name: value
        for path, m in module.named_modules(remove_duplicate=False)
        for name, value in vars(m).items()
        if isinstance(value, torch.Tensor)
    }


def _deepcopy(gm: fx.GraphModule, memo: dict[int, Any]) -> fx.GraphModule:
    with warnings.catch_warnings():
        # Copying the graph's pytree specs goes through a deprecated LeafSpec check (torch 2.13).
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
        copied = copy.deepcopy(gm, memo)
    # GraphModule's copy registers a tensor it holds as a plain attribute (a constant export
    # lifted) as a buffer: put each back where a fresh export holds it, out of the state dict.
    for path in _tensor_attributes(gm):
        owner, _, name = path.rpartition(".")
        module = copied.get_submodule(owner)
        if name in module._buffers:
            module._non_persistent_buffers_set.discard(name)
            module.__dict__[name] = module._buffers.pop(name)
    # The graph copy shares each node's meta values (a shallow copy): a pass that changed one in
    # place would change every copy. The fake values are read only, and copying them is costly.
    for old, new in zip(gm.graph.nodes, copied.graph.nodes, strict=True):
        new.meta = {k: v if k in _SHARED_META else copy.deepcopy(v) for k, v in old.meta.items()}
    return copied


_SHARED_META = frozenset({"val", "tensor_meta", "example_value"})


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    stand_in = torch.empty_like(t, device="meta")
    return nn.Parameter(stand_in, t.requires_grad) if isinstance(t, nn.Parameter) else stand_in


def _unbound(gm: fx.GraphModule, root: nn.Module, checks: tuple[str, ...], referents: tuple) -> _Entry:
    """The entry of ``gm``: a copy that holds meta stand-ins of ``root``'s tensors (the memo
    keeps no model alive), tied where they are tied."""
    own, attributes = named_tensors(root), _tensor_attributes(root)
    memo: dict[int, Any] = {}
    for name, t in named_tensors(gm).items():
        if name in own and id(t) not in memo:
            memo[id(t)] = _stand_in(t)
    held = tuple(
        name for name, t in _tensor_attributes(gm).items() if attributes.get(name) is t and id(t) not in memo
    )
    for name in held:
        t = attributes[name]
        memo[id(t)] = _stand_in(t)
    return _Entry(_deepcopy(gm, memo), checks, held, referents)


def _bind(entry: _Entry, root: nn.Module) -> fx.GraphModule:
    """A copy of the entry's graph holding ``root``'s own tensors, by name."""
    own, attributes = named_tensors(root), _tensor_attributes(root)
    memo = {id(t): own[name] for name, t in named_tensors(entry.gm).items() if name in own}
    stored = _tensor_attributes(entry.gm)
    memo |= {id(stored[name]): attributes[name] for name in entry.attributes}
    return _deepcopy(entry.gm, memo)


def structure_key(root: nn.Module, batch: Mapping[str, Any], dynamic_shapes: Mapping[str, Any] | None) -> str:
    """What an export of ``root`` on ``batch`` depends on (the module docstring), hashed;
    :class:`Unkeyed` where part of it cannot be described."""
    return _key(root, batch, dynamic_shapes)[0]


def _key(
    root: nn.Module, batch: Mapping[str, Any], dynamic_shapes: Mapping[str, Any] | None
) -> tuple[str, tuple]:
    """:func:`structure_key`, and the objects it names by id."""
    describe = Describer(root)
    parts: list[Any] = [global_state(describe)]
    for path, module in root.named_modules(remove_duplicate=False):
        parts.append((path, describe.type_of(type(module)), describe.attributes(module)))
    first_name: dict[int, str] = {}
    for name, t in named_tensors(root).items():
        parts.append((name, *tensor_kind(t), isinstance(t, nn.Parameter), first_name.setdefault(id(t), name)))
    for key, value in batch.items():  # integer tensors by value (token ids, grids), images by shape
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        parts.append((key, tensor_kind(value) if floating else describe.value(value)))
    parts.append(describe.value(dynamic_shapes))
    return hashlib.sha256(repr(parts).encode()).hexdigest(), tuple(describe.referents)


def tensor_kind(t: torch.Tensor) -> tuple:
    return (
        type(t).__qualname__,
        tuple(t.shape),
        tuple(t.stride()),
        str(t.dtype),
        str(t.device),
        t.requires_grad,
    )


def global_state(describe: Describer) -> tuple:
    import torch._export.config as export_config
    import torch.fx.experimental._config as shape_config

    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        raise Unkeyed("a torch function or dispatch mode is active")
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        tuple(
            (kind, torch.is_autocast_enabled(kind), str(torch.get_autocast_dtype(kind)))
            for kind in ("cpu", "cuda")
        ),
        str(torch.get_default_dtype()),
        str(torch.get_default_device()),
        torch.are_deterministic_algorithms_enabled(),
        # The attention kernel CPU runs (flash or math; sdpa_kernel sets these) decides FLOPs and saved bytes.
        tuple(
            f()
            for f in (
                torch.backends.cuda.flash_sdp_enabled,
                torch.backends.cuda.math_sdp_enabled,
                torch.backends.cuda.mem_efficient_sdp_enabled,
                torch.backends.cuda.cudnn_sdp_enabled,
            )
        ),
        sorted(shape_config.get_config_copy().items()),
        sorted(export_config.get_config_copy().items()),
        describe.value(torch.export.export),
        _transformers_registries(describe),
    )


def _transformers_registries(describe: Describer) -> Any:
    """The functions transformers' attention and mask names resolve to (a capture registers its
    own under a name: the name alone does not say what runs)."""
    utils = sys.modules.get("transformers.modeling_utils")
    masks = sys.modules.get("transformers.masking_utils")
    registries = [
        getattr(utils, "ALL_ATTENTION_FUNCTIONS", None),
        getattr(masks, "ALL_MASK_ATTENTION_FUNCTIONS", None),
    ]
    return tuple(
        describe.value({**getattr(r, "_global_mapping", {}), **getattr(r, "_local_mapping", {})})
        for r in registries
        if r is not None
    )


_SKIPPED = frozenset({"_parameters", "_buffers", "_modules"})
"""Held by the key otherwise: parameters and buffers by name, submodules by path."""


class Describer:
    """Plain values of what a module holds, for the key; an object (not a container) met twice is
    named by its first place (configurations are shared by many modules)."""

    def __init__(self, root: nn.Module):
        self.paths = {id(m): path for path, m in root.named_modules()}
        self.seen: dict[int, int] = {}
        self.referents: list[Any] = []
        """Classes and code named by id: the memo keeps them alive with the entry."""

    def type_of(self, cls: type) -> tuple:
        self.referents.append(cls)
        return cls.__module__, cls.__qualname__, id(cls)

    def attributes(self, module: nn.Module) -> tuple:
        return tuple(
            # Hooks are keyed by their handles' ids, a count over the process: their order and
            # functions are what a forward runs.
            (k, self.value(tuple(v.values()) if "hooks" in k and isinstance(v, Mapping) else v))
            for k, v in sorted(vars(module).items())
            if k not in _SKIPPED
        )

    def value(self, v: Any, depth: int = 0) -> Any:
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
            return repr(v)
        if isinstance(v, enum.Enum):
            return (self.type_of(type(v)), v.name)
        if isinstance(v, torch.Tensor):
            return self._tensor(v)
        if depth > 12:
            raise Unkeyed("nested too deep")
        if isinstance(v, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type)):
            return self._callable(v, depth)
        # Containers are described by value (a cycle ends at the depth limit): by identity, one
        # shared with an earlier attribute would make two equal models' keys differ.
        if isinstance(v, (list, tuple, set, frozenset)):
            items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
            return (type(v).__name__, tuple(self.value(x, depth + 1) for x in items))
        if isinstance(v, Mapping):
            return (self.type_of(type(v)), tuple((repr(k), self.value(x, depth + 1)) for k, x in v.items()))
        if isinstance(v, functools.partial):
            return (
                "partial",
                self.value(v.func, depth + 1),
                self.value(v.args, depth + 1),
                self.value(v.keywords, depth + 1),
            )
        if isinstance(v, nn.Module):
            if id(v) not in self.paths:  # its state would go undescribed
                raise Unkeyed(f"a {type(v).__name__} held outside the model's modules")
            return ("module", self.paths[id(v)])  # described under its own path
        if isinstance(v, np.ndarray):
            return (
                "ndarray",
                v.shape,
                str(v.dtype),
                hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest(),
            )
        if id(v) in self.seen:  # a configuration many modules hold: described where first met
            return ("seen", self.seen[id(v)])
        self.seen[id(v)] = len(self.seen)
        state = getattr(v, "__dict__", None)
        if state is None:
            text = repr(v)
            if " at 0x" in text or "..." in text:  # an address, or a value cut short
                raise Unkeyed(f"a {type(v).__name__} with no state to describe")
            return (self.type_of(type(v)), text)
        return (self.type_of(type(v)), tuple((k, self.value(x, depth + 1)) for k, x in sorted(state.items())))

    def _callable(self, f: Any, depth: int) -> tuple:
        if isinstance(f, type):
            return self.type_of(f)
        if isinstance(f, types.MethodType):
            return ("method", self._callable(f.__func__, depth), self.value(f.__self__, depth + 1))
        code = getattr(f, "__code__", None)
        self.referents.append(code if code is not None else f)
        # A closure's cells and a function's defaults are part of what it does.
        cells = tuple(self.value(c.cell_contents, depth + 1) for c in getattr(f, "__closure__", None) or ())
        defaults = self.value(getattr(f, "__defaults__", None), depth + 1)
        name = (getattr(f, "__module__", None), getattr(f, "__qualname__", repr(f)))
        return (*name, id(code) if code else id(f), cells, defaults)

    def _tensor(self, t: torch.Tensor) -> tuple:
        kind = tensor_kind(t)
        if t.device.type == "meta" or isinstance(t, FakeTensor):
            return kind
        if t.numel() * t.element_size() > _VALUE_BYTES:
            raise Unkeyed(f"a tensor of {t.numel()} elements")
        data = t.detach().reshape(-1).cpu()
        return (
            *kind,
            hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest() if data.numel() else "",
        )
