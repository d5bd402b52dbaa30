"""A memo of the annotate pass within one process: a graph of the same code, tags, tensors and batch
is measured once. The test suite annotates the same captures of its tiny families again and again
(298 annotations, 97 s of their 240 repeating one already made in the same process, 2026-11-29).
Asked for by the switch of :mod:`vlmcompile.graph.export_memo` (``VLMCOMPILE_MEMO=1``), and off
for users for the same reason: a function patched in place between two compiles goes unseen.

What a measurement depends on, and so the key: the graph's code; every module it calls (class and
plain attributes, described as the export memo describes them) or, for a graph, its code; the
kinds of its parameters and buffers (name, shape, stride, dtype, device, ``requires_grad``, which
are one tensor) and the values of the tensors it holds as attributes; the batch (tensors by value,
meta and fake ones by kind); what the pass reads besides (its options, the nodes' tags: the
caller's ``reads()``); and the global state the export memo keys on. Parameter and buffer values are
not in it: on fake tensors the figures are of shapes alone, so only such measurements are kept
(``storable``), never one on real tensors.

A hit writes what the measurement wrote onto the new graph (its nodes' metadata by node name, the
graph's) and returns the stored result, which must be immutable: frozen dataclasses are shared. The
attention kernel CPU would run is in the global state (flash or math: other FLOPs and saved bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch import nn

from vlmcompile.graph.export_memo import Describer, Memo, global_state, tensor_kind
from vlmcompile.graph.fake import named_tensors

MAX_ENTRIES = 64
"""Measurements kept (least recently used dropped): a tiny family's is a few kB of figures."""

Result = TypeVar("Result")


@dataclass(frozen=True, slots=True)
class _Entry:
    result: Any
    node_meta: dict[str, dict[str, Any]]
    """Node name -> the metadata the measurement wrote on it."""
    graph_meta: dict[str, Any]
    referents: tuple[Any, ...]
    """The classes and functions the key names by id, kept alive so that no other takes their id."""


_memo = Memo(MAX_ENTRIES)
stats = _memo.stats


@dataclass(frozen=True, slots=True)
class Writes:
    """The metadata keys a measurement writes: on nodes, and on the graph."""

    node: tuple[str, ...]
    graph: tuple[str, ...]


def measured(
    gm: fx.GraphModule,
    batch: Mapping[str, Any],
    reads: Callable[[], Any],
    measure: Callable[[], Result],
    *,
    writes: Writes,
    storable: Callable[[Result], bool],
) -> tuple[Result, bool]:
    """``measure()``'s result, or the one memoised under the same key with its metadata written
    onto ``gm``; and whether it was memoised. ``reads()``: plain values of what else the
    measurement depends on (called only when the memo is on). A result is kept only where ``storable`` says it depends on nothing the key leaves
    out. The memo never fails a measurement: whatever goes wrong in it leaves the work to
    ``measure``."""
    keyed = _memo.key(lambda: _key(gm, batch, reads))
    if keyed is None:
        return measure(), False
    key, referents = keyed
    found = _memo.get(key)
    if found is not None and _written(found, gm):
        return found.result, True
    result = measure()
    with contextlib.suppress(Exception):  # a result that cannot be kept is simply not kept
        if storable(result):
            node_meta = {
                n.name: written
                for n in gm.graph.nodes
                if (written := {k: n.meta[k] for k in writes.node if k in n.meta})
            }
            graph_meta = {k: gm.meta[k] for k in writes.graph if k in gm.meta}
            _memo.put(key, _Entry(result, node_meta, graph_meta, referents))
    return result, False


def _written(entry: _Entry, gm: fx.GraphModule) -> bool:
    """Write the entry's metadata onto ``gm``; False (nothing written) where a node it names is
    missing."""
    nodes = {n.name: n for n in gm.graph.nodes}
    if not all(name in nodes for name in entry.node_meta):
        return False
    for name, meta in entry.node_meta.items():
        nodes[name].meta.update(meta)
    gm.meta.update(entry.graph_meta)
    return True


def clear() -> None:
    _memo.entries.clear()


def _key(gm: fx.GraphModule, batch: Mapping[str, Any], reads: Callable[[], Any]) -> tuple[str, tuple]:
    describe = Describer(gm)
    parts: list[Any] = [global_state(describe), describe.value(reads())]
    for path, module in gm.named_modules(remove_duplicate=False):
        if isinstance(module, fx.GraphModule):
            # A graph's class is made for it alone: its code and held tensors say what it runs.
            held = {k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}
            parts.append((path, "graph", module.code, describe.value(held)))
        else:
            parts.append((path, describe.type_of(type(module)), describe.attributes(module)))
    first_name: dict[int, str] = {}
    for name, t in named_tensors(gm).items():
        parts.append((name, *tensor_kind(t), isinstance(t, nn.Parameter), first_name.setdefault(id(t), name)))
    parts.extend((k, describe.value(v)) for k, v in batch.items())
    return hashlib.sha256(repr(parts).encode()).hexdigest(), tuple(describe.referents)
