"""Annotate pass: FLOPs, saved bytes, parameter and boundary bytes per node and per layer.

The captured graph is interpreted node by node on fake tensors that claim the CPU device
(``tensor_mode="fake"``, the default): shapes and dtypes are exact, nothing is allocated, so
a 200B-parameter model annotates in seconds, and every op dispatches to the kernel a real
CPU run would use (on plain ``meta`` tensors SDPA falls back to the math path, which saves
the full attention matrix; CPU runs the flash kernel). ``tensor_mode="real"`` runs the same
interpretation on real CPU tensors - the tests compare the two.

How each figure is measured:

* forward FLOPs: ``FlopCounterMode`` around each node, with the CPU SDPA kernels added
  (``cost_models.flops.cpu_sdpa_flop_mapping``); the attention kernels' share is kept apart,
  as the cost model rates attention and matrix products differently;
* memory traffic: the bytes every FLOP-free op (norms, activations, softmax, adds, copies;
  views excluded) reads and writes, counted by a dispatch mode - the memory-bound share of a
  layer's time in the roofline;
* backward FLOPs and traffic: one ``torch.autograd.backward`` over all layers after the forward, each
  autograd node tagged with the FX node that created it (a pre-hook marks which node's
  backward is running). A layer whose forward repeated an earlier layer's exactly (the same
  nodes, modules and parameter shapes, the same ops on the same shapes, the same figures: a
  transformer's blocks after the first) is left out of it and takes that layer's figures, as
  its backward runs the same ops. A block known to repeat one before it runs (:class:`_Replays`:
  the same module class, parameters, buffers and plain attributes, inputs of the same shapes
  saved before or not alike) does not run its forward either; ``every_layer=True`` runs them all;
* saved bytes: a ``saved_tensors_hooks`` pack hook keyed by ``untyped_storage()._cdata``, so
  a storage saved twice (or through a view) is counted once, by the first node that saves it;
  parameters are excluded (they are counted as parameter bytes);
* saved bytes with recompute: the bytes of the distinct storages a layer reads from outside
  itself (graph inputs and other layers' outputs) - what a non-reentrant checkpoint of the
  layer holds until its backward;
* boundary bytes: the tensors a cut after each layer would send forward, and their gradients.

Each layer's inputs enter as detached leaves, so its autograd graph stands alone: backward
FLOPs and saved bytes cannot leak from one layer into the next.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
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
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from vlmcompile.cost_models.flops import cpu_sdpa_flop_mapping
from vlmcompile.graph import annotate_memo
from vlmcompile.graph.fake import ShapesFromKnownValues, fake_factory, known_batch, swapped_tensors
from vlmcompile.ir.errors import ModelError
from vlmcompile.ir.layer_graph import Layer, LayerGraph, NodeCost, TensorSpec, format_count
from vlmcompile.ir.meta_keys import (
    BLOCK_LAYERS_META,
    LAYER_META,
    LAYER_ORDER_META,
    LOSS_SPLIT_META,
    NODE_COST_META,
    OUTPUT_META,
    REGION_META,
    RUNTIME_CHECK_META,
)
from vlmcompile.ir.microbatch import num_samples
from vlmcompile.passes.graph.capture import layer_nodes

TensorMode = Literal["fake", "real"]


@dataclass(frozen=True, slots=True)
class AnnotateReport:
    layer_graph: LayerGraph
    tensor_mode: TensorMode
    """The mode the figures were measured in."""
    fwd_time_s: float
    bwd_time_s: float
    fallback: str | None = None
    """Why fake tensors were abandoned for real ones, if they were."""
    assumptions: tuple[str, ...] = ()
    """Values the figures assume because the batch holds none (meta inputs)."""
    repeated_backwards: int = 0
    """Layers whose forward repeated an earlier layer's exactly: their backward was not run
    again, they take that layer's figures."""
    replayed_forwards: int = 0
    """Of those, the blocks known to repeat one before they ran: their forward was not run either."""
    memoised: bool = False
    """The figures and times are an earlier measurement's of the same graph and batch in this
    process (:mod:`vlmcompile.graph.annotate_memo`): nothing ran this time. The printed report
    reads the same either way, so that a test comparing it with the docs passes in any order."""

    def __str__(self) -> str:
        t = self.layer_graph.totals()
        n = len(self.layer_graph)
        head = (
            f"annotate: {n} layers on {self.tensor_mode} CPU tensors "
            f"(forward {self.fwd_time_s:.2f} s"
            + (f" on {n - self.replayed_forwards} layers" if self.replayed_forwards else "")
            + f", backward {self.bwd_time_s:.2f} s"
            + (f" on {n - self.repeated_backwards} layers" if self.repeated_backwards else "")
            + (
                "; the other layers repeat one of them exactly, their figures taken from it"
                if self.repeated_backwards
                else ""
            )
            + "); "
            f"{format_count(t['num_params'])} parameters"
            + (
                f", {format_count(t['num_frozen_params'])} of them frozen (no gradient, no optimizer state)"
                if t["num_frozen_params"]
                else ""
            )
        )
        lines = [head] + ([f"  fell back to real tensors: {self.fallback}"] if self.fallback else [])
        lines += [f"  assumed: {a}" for a in self.assumptions]
        return "\n".join(
            [
                *lines,
                "",
                "per region:",
                self.layer_graph.region_table(),
                "",
                "per layer:",
                self.layer_graph.layer_table(max_rows=40),
            ]
        )


@dataclass(frozen=True, slots=True)
class AnnotateResult:
    gm: fx.GraphModule
    layer_graph: LayerGraph
    report: AnnotateReport


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."))


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. nested)
        return None
    return s._cdata, s.nbytes()


_NO_COPY_OPS = {torch.ops.aten._unsafe_view, torch.ops.aten.lift_fresh}


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _op_argument(a: Any) -> Any:
    """What of one op argument its cost depends on: a tensor's shape, dtype and whether it
    takes a gradient; a plain value itself."""
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), a.dtype, a.requires_grad)
    return a if isinstance(a, _PLAIN) else type(a)


def _op_key(func: Any, args: tuple, kwargs: dict | None) -> tuple:
    """An op and what of its arguments its cost depends on (one level of lists: aten's
    arguments nest no deeper)."""
    key = [func]
    for a in (*args, *(kwargs or {}), *(kwargs or {}).values()):
        if type(a) in (list, tuple):
            key.append(tuple(map(_op_argument, a)))
        else:
            key.append(_op_argument(a))
    return tuple(key)


class _MemoryTraffic(TorchDispatchMode):
    """Adds up the bytes that FLOP-free ops read and write (their tensor arguments and results)."""

    def __init__(self, flop_ops: set[Any]):
        super().__init__()
        self.flop_ops = flop_ops
        self.bytes = 0
        self.trace: list[tuple] | None = None
        """While a list: every op's kind and argument shapes, appended (a node's forward, to tell
        whether two layers run the same ops)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.trace is not None:
            self.trace.append(_op_key(func, args, kwargs))
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        # Ops that return no tensor (prim.device, size queries) move nothing.
        results = _tensors(out)
        if results and packet not in self.flop_ops and packet not in _NO_COPY_OPS and not func.is_view:
            self.bytes += sum(t.numel() * t.element_size() for t in [*_tensors((args, kwargs)), *results])
        return out


class _Counters:
    """Running totals (FLOPs, attention FLOPs, memory-traffic bytes) that nodes take deltas of."""

    def __init__(self, flops: FlopCounterMode, traffic: _MemoryTraffic, attention_ops: set[Any]):
        self.flops, self.traffic, self.attention_ops = flops, traffic, attention_ops

    def snapshot(self) -> tuple[int, int, int]:
        per_op = self.flops.flop_counts.get("Global", {})
        attn = sum(v for op, v in per_op.items() if op in self.attention_ops)
        return self.flops.get_total_flops(), attn, self.traffic.bytes


def _delta(after: tuple[int, ...], before: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a - b for a, b in zip(after, before))


def _add(total: tuple[int, ...], more: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a + b for a, b in zip(total, more))


class _Annotator(fx.Interpreter):
    def __init__(
        self,
        gm: fx.GraphModule,
        counters: _Counters,
        param_storages: set[int],
        fake_mode: FakeTensorMode | None = None,
        *,
        replay: bool = False,
        trace_ops: bool = True,
    ):
        super().__init__(gm, garbage_collect_values=False)
        self.fake_mode = fake_mode
        self.counters = counters
        self.param_storages = param_storages
        self.seen_storages: set[int] = set()
        self.current: fx.Node | None = None
        # (FLOPs, attention FLOPs, memory-traffic bytes) per node
        self.fwd_cost: dict[fx.Node, tuple[int, int, int]] = defaultdict(lambda: (0, 0, 0))
        self.bwd_cost: dict[fx.Node, tuple[int, int, int]] = defaultdict(lambda: (0, 0, 0))
        self.saved: dict[fx.Node, int] = defaultdict(int)
        self.layer_inputs: dict[str, dict[int, int]] = defaultdict(dict)
        self.leaves: dict[tuple[fx.Node, str], Any] = {}
        self.grad_owner: dict[Any, fx.Node] = {}
        self.op_trace: dict[fx.Node, tuple] = {}
        self.replays = _Replays(gm, param_storages) if replay else None
        self.trace_ops = trace_ops
        """Whether each node's ops are traced (to tell repeated layers; not when every layer is run)."""
        self.replayed: dict[str, str] = {}
        """Layers whose forward was :meth:`_replay`ed: the layer measured."""
        self._bwd_node: fx.Node | None = None
        self._bwd_mark = (0, 0, 0)

    # ---- forward -------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = _storage(t)
        if st and st[0] not in self.param_storages and st[0] not in self.seen_storages:
            self.seen_storages.add(st[0])
            self.saved[self.current] += st[1]
        return t

    def _input_for(self, arg: fx.Node, layer: str) -> Any:
        value = self.env[arg]
        if arg.op == "get_attr" or arg.meta.get(LAYER_META) == layer:
            return value
        key = (arg, layer)
        if key not in self.leaves:

            def leaf(t: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                st = _storage(t)
                if st and st[0] not in self.param_storages:
                    self.layer_inputs[layer][st[0]] = st[1]
                if arg.op != "placeholder" and t.requires_grad:
                    return t.detach().requires_grad_(True)
                if not isinstance(t, FakeTensor):  # a known value stays real (see _call)
                    with unset_fake_temporarily():
                        return t.detach()
                return t.detach()

            self.leaves[key] = tree_map(leaf, value)
        return self.leaves[key]

    def run_node(self, n: fx.Node) -> Any:
        layer = n.meta.get(LAYER_META)
        if n.op in ("placeholder", "output") or layer is None:
            return super().run_node(n)
        if n.meta.get(RUNTIME_CHECK_META):
            return None  # a check of values fake tensors do not hold; the run checks them
        self.current = n
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: self._input_for(a, layer))
        key = self.replays.key(n, (args, kwargs), self.seen_storages) if self.replays else None
        if key is not None and key in self.replays.first:
            return self._replay(n, self.replays.first[key], (args, kwargs))
        inputs_seen = {st[0] for t in _tensors((args, kwargs)) if (st := _storage(t))} & self.seen_storages
        before = self.counters.snapshot()
        traffic = self.counters.traffic
        traffic.trace = [] if self.trace_ops else None
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            out = self._call(n, args, kwargs)
        self.op_trace[n], traffic.trace = tuple(traffic.trace or ()), None
        self.fwd_cost[n] = _add(self.fwd_cost[n], _delta(self.counters.snapshot(), before))
        self._own_grad_fns(n, out)
        if key is not None:
            self.replays.record(key, n, out, (args, kwargs), inputs_seen, self.seen_storages)
        return out

    def _replay(self, n: fx.Node, same: fx.Node, inputs: Any) -> Any:
        """``n`` runs what ``same`` ran (:class:`_Replays`): its figures, and outputs of the same
        shapes (leaves: its backward is ``same``'s, never run); the storages ``same`` left saved
        are this one's too."""
        self.fwd_cost[n], self.op_trace[n] = self.fwd_cost[same], self.op_trace[same]
        if self.saved.get(same):
            self.saved[n] = self.saved[same]
        self.replayed[n.meta[LAYER_META]] = same.meta[LAYER_META]
        mine = _tensors(inputs)
        for i in self.replays.inputs_saved[same]:
            if st := _storage(mine[i]):
                self.seen_storages.add(st[0])
        out = tree_map(
            lambda t: (
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).requires_grad_(
                    t.requires_grad
                )
                if isinstance(t, torch.Tensor)
                else t
            ),
            self.env[same],
        )
        made = _tensors(out)
        for i in self.replays.outputs_saved[same]:
            self.seen_storages.add(_storage(made[i])[0])
        return out

    def _call(self, n: fx.Node, args: Any, kwargs: Any) -> Any:
        """Run one node. On fake tensors, a node that reads only known values (the real CPU
        inputs of the batch: token ids, sizes, and what is computed from them alone) runs on
        real tensors, so a later shape that depends on them can be known
        (:class:`vlmcompile.graph.fake.ShapesFromKnownValues`)."""
        run = getattr(self, n.op)
        if self.fake_mode is not None and n.op == "call_function":
            tensors = _tensors((args, kwargs))
            if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
                with unset_fake_temporarily():
                    return run(n.target, args, kwargs)
        return run(n.target, args, kwargs)

    def _own_grad_fns(self, n: fx.Node, out: Any) -> None:
        stack = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in self.grad_owner:
                continue
            self.grad_owner[fn] = n
            fn.register_prehook(lambda grads, n=n: self._enter_backward_of(n))
            stack.extend(next_fn for next_fn, _ in fn.next_functions)

    # ---- backward ------------------------------------------------------------------------
    def _enter_backward_of(self, n: fx.Node) -> None:
        now = self.counters.snapshot()
        if self._bwd_node is not None:
            self.bwd_cost[self._bwd_node] = _add(self.bwd_cost[self._bwd_node], _delta(now, self._bwd_mark))
        self._bwd_node, self._bwd_mark = n, now
        return None

    def run_backward(self, gm: fx.GraphModule, repeats: Mapping[str, str]) -> None:
        """Backpropagate ones from every value that leaves its layer into every leaf; a layer of
        ``repeats`` (layer: the earlier layer it repeats) takes that layer's backward figures."""
        outputs = []
        for n in gm.graph.nodes:
            layer = n.meta.get(LAYER_META)
            if layer is None or n.op == "get_attr" or layer in repeats:
                continue
            if any(u.op == "output" or u.meta.get(LAYER_META) != layer for u in n.users):
                outputs += [t for t in _tensors(self.env[n]) if t.requires_grad and t.grad_fn is not None]
        inputs = [
            t for v in self.leaves.values() for t in _tensors(v) if t.requires_grad and t.grad_fn is None
        ]
        inputs += [p for p in gm.parameters() if p.requires_grad]
        unique_out = list({id(t): t for t in outputs}.values())
        unique_in = list({id(t): t for t in inputs}.values())
        if not unique_out or not unique_in:
            return
        # The seeds are made before the mark, so their bytes are nobody's backward.
        seeds = [torch.ones_like(t) for t in unique_out]
        self._bwd_node, self._bwd_mark = None, self.counters.snapshot()
        # backward(), not autograd.grad(): FlopCounterMode's module tracker hooks reject grad().
        # Gradients accumulate into the swapped-in leaves, never into the user's parameters.
        torch.autograd.backward(unique_out, seeds, inputs=unique_in)
        if self._bwd_node is not None:
            last = _delta(self.counters.snapshot(), self._bwd_mark)
            self.bwd_cost[self._bwd_node] = _add(self.bwd_cost[self._bwd_node], last)
        members = layer_nodes(gm)
        for layer, first in repeats.items():
            for n, same in zip(members[layer], members[first], strict=True):
                self.bwd_cost[n] = self.bwd_cost[same]

    def repeated_layers(self, gm: fx.GraphModule) -> dict[str, str]:
        """Layers whose forward repeated an earlier layer's exactly, each with that layer: the
        same nodes wired alike, the same modules and parameter shapes, inputs of the same shapes
        (known values from the same nodes), the same ops on the same shapes, and the same
        figures. Their backwards are alike, so one is run (a 150-layer model runs a few).
        A layer that reads a parameter another layer reads too is its own: its gradient
        accumulates there, which costs what a first gradient does not."""
        members = layer_nodes(gm)
        shared = _sharing_parameters(gm, members)
        first: dict[tuple, str] = {}
        repeats = {}
        for layer, nodes in members.items():
            if layer in shared or layer in self.replayed:
                continue
            key = self._layer_key(gm, layer, nodes)
            if key is not None and first.setdefault(key, layer) != layer:
                repeats[layer] = first[key]
        # A replayed layer's backward was never built: it takes the figures of the one it replayed.
        return repeats | {layer: repeats.get(same, same) for layer, same in self.replayed.items()}

    def _layer_key(self, gm: fx.GraphModule, layer: str, nodes: list[fx.Node]) -> tuple | None:
        index = {n: i for i, n in enumerate(nodes)}

        def arg(a: Any) -> Any:
            if isinstance(a, fx.Node):
                if a in index:
                    return ("node", index[a])
                value = self.env[a] if a.op == "get_attr" else self.leaves.get((a, layer))
                leaves = _tensors(value)
                if any(not isinstance(t, FakeTensor) for t in leaves) or not leaves:
                    return ("from", a)  # known values (or none): the same node gives the same
                return ("in", tuple(_op_argument(t) for t in leaves), str(tree_flatten(value)[1]))
            if isinstance(a, (tuple, list)):
                return (type(a), tuple(map(arg, a)))
            if isinstance(a, dict):
                return (dict, tuple((k, arg(v)) for k, v in a.items()))
            if isinstance(a, slice):
                return (slice, arg(a.start), arg(a.stop), arg(a.step))
            return a if isinstance(a, _PLAIN) else ("object", id(a))

        key = []
        for n in nodes:
            if n.meta.get(RUNTIME_CHECK_META):
                key.append((n.op, n.target, arg((n.args, n.kwargs))))
                continue
            out = _tensors(self.env.get(n))
            key.append(
                (
                    n.op,
                    ("attr", *map(_op_argument, out)) if n.op == "get_attr" else _target_key(gm, n),
                    arg((n.args, n.kwargs)),
                    self.op_trace[n],
                    self.fwd_cost[n],
                    self.saved.get(n, 0),
                    tuple((*_op_argument(t), t.grad_fn is not None) for t in out),
                    any(u.op == "output" or u.meta.get(LAYER_META) != layer for u in n.users),
                )
            )
        return tuple(key)


class _Replays:
    """Blocks whose forward a block already ran (a transformer's blocks after its first), known
    before they run: a layer of one module call, sharing no parameter with another layer, whose
    module matches an earlier one's - class, parameters' and buffers' shapes, every plain
    attribute of every submodule (``layer_idx`` too: a transformers block is never replayed),
    no hooks - and whose inputs match too: fake tensors of the same shapes, strides and
    gradients, their storages saved before or not alike. Such a block runs the same code on the
    same shapes, so its forward figures and op trace are the first one's."""

    def __init__(self, gm: fx.GraphModule, param_storages: set[int]):
        self.gm, self.param_storages = gm, param_storages
        members = layer_nodes(gm)
        shared = _sharing_parameters(gm, members)
        self.blocks = {
            nodes[0]
            for layer, nodes in members.items()
            if len(nodes) == 1 and nodes[0].op == "call_module" and layer not in shared
        }
        self.first: dict[tuple, fx.Node] = {}
        self.inputs_saved: dict[fx.Node, list[int]] = {}
        """Per block measured, its input tensors (flattened) whose storage it saved first."""
        self.outputs_saved: dict[fx.Node, list[int]] = {}
        """Per block measured, its output tensors (flattened) it saved itself."""

    def key(self, n: fx.Node, inputs: Any, seen: set[int]) -> tuple | None:
        if n not in self.blocks:
            return None
        flat, spec = tree_flatten(inputs)
        if any(isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) for t in flat):
            return None  # known values: the same shapes may hold other values
        module = _module_key(self.gm.get_submodule(str(n.target)), seen)
        if module is None:
            return None
        return module, str(spec), tuple(_input_key(t, seen) for t in flat)

    def record(
        self, key: tuple, n: fx.Node, out: Any, inputs: Any, seen_before: set[int], seen: set[int]
    ) -> None:
        """``n`` measured: later blocks of ``key`` replay it, unless its outputs share storage
        (fresh ones would not)."""
        outputs = _tensors(out)
        made = [st[0] for t in outputs if (st := _storage(t))]
        if len(set(made)) != len(outputs) or any(not isinstance(t, FakeTensor) for t in outputs):
            return
        self.outputs_saved[n] = [i for i, storage in enumerate(made) if storage in seen]
        flat = _tensors(inputs)
        self.inputs_saved[n] = [
            i
            for i, t in enumerate(flat)
            if (st := _storage(t))
            and st[0] in seen
            and st[0] not in seen_before
            and st[0] not in self.param_storages
        ]
        self.first.setdefault(key, n)


def _sharing_parameters(gm: fx.GraphModule, members: Mapping[str, list[fx.Node]]) -> set[str]:
    """The layers that read a parameter another layer reads too (tied weights, a module run in
    two layers): each accumulates a gradient there, which costs what a first gradient does not."""
    readers: dict[int, set[str]] = defaultdict(set)
    for layer, nodes in members.items():
        for n in nodes:
            for read in (n, *(a for a in n.all_input_nodes if a.op == "get_attr")):
                for param in _params_read(gm, read):
                    readers[id(param)].add(layer)
    return {layer for layers in readers.values() if len(layers) > 1 for layer in layers}


def _input_key(a: Any, seen: set[int]) -> Any:
    if isinstance(a, torch.Tensor):
        st = _storage(a)
        return (*_op_argument(a), tuple(a.stride()), st is not None and st[0] in seen)
    return a if isinstance(a, _PLAIN) else ("object", id(a))


def _module_key(module: nn.Module, seen: set[int]) -> tuple | None:
    """A module's class, parameters, buffers and every submodule's plain attributes; None where
    a submodule has hooks of its own (they may do anything)."""
    parts: list[Any] = [
        tuple((k, *_op_argument(p)) for k, p in module.named_parameters()),
        tuple((k, *_input_key(b, seen)) for k, b in module.named_buffers()),
    ]
    for name, sub in module.named_modules():
        if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks:
            return None
        attributes = []
        for k, value in sorted(vars(sub).items()):
            if k.startswith("_"):
                continue  # parameters, buffers, submodules (above) and hook tables
            if isinstance(value, (list, tuple)) and all(isinstance(x, _PLAIN) for x in value):
                value = (type(value), tuple(value))
            elif isinstance(value, torch.Tensor):
                value = _input_key(value, seen)
            elif not isinstance(value, _PLAIN):
                value = ("object", id(value))  # shared (a config) or not: compared by identity
            attributes.append((k, value))
        parts.append((name, type(sub), tuple(attributes)))
    return tuple(parts)


def _target_key(gm: fx.GraphModule, n: fx.Node) -> Any:
    """What a node runs: a function, a method name, or a module's class with its parameters'
    and buffers' names, shapes, dtypes and whether they take gradients (the module's code does
    the rest; the ops it ran are compared too)."""
    if n.op != "call_module":
        return n.target
    m = gm.get_submodule(str(n.target))
    return (
        type(m),
        tuple((k, *_op_argument(p)) for k, p in m.named_parameters()),
        tuple((k, *_op_argument(b)) for k, b in m.named_buffers()),
    )


def _detached_parameter(t: torch.Tensor) -> torch.Tensor:
    """Same storage, new leaf: gradients land here, not in the user's parameter."""
    return nn.Parameter(t.detach(), requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else t


def annotate(
    gm: fx.GraphModule,
    sample_batch: Mapping[str, Any],
    *,
    tensor_mode: TensorMode = "fake",
    model_name: str | None = None,
    every_layer: bool = False,
) -> AnnotateResult:
    """Measure every node of a captured graph (see the module docstring) and build the LayerGraph.

    Args:
        gm: the output of the capture pass (nodes tagged with layer and region).
        sample_batch: the batch the graph was captured with (real, meta or fake tensors).
        tensor_mode: ``fake`` (default; any size, no memory) or ``real`` (CPU tensors, small models).
        model_name: recorded in the LayerGraph's metadata.
        every_layer: run every layer's forward and backward, also where a layer repeats an
            earlier layer exactly (by default such a layer takes that layer's figures).
    """
    if LAYER_ORDER_META not in gm.meta:
        raise ValueError("annotate needs a graph from the capture pass (no layer order in gm.meta)")
    if tensor_mode not in ("fake", "real"):
        raise ValueError(f"tensor_mode={tensor_mode!r}; use 'fake' or 'real'")
    params = list(gm.parameters())
    if not params:
        raise ModelError("the captured graph has no parameters; nothing to annotate")
    has_values = not any(t.device.type == "meta" for t in [*params, *_tensors(dict(sample_batch))])
    if tensor_mode == "real" and not has_values:
        raise ValueError(
            "tensor_mode='real' needs real CPU weights and inputs; use tensor_mode='fake' for meta models"
        )

    def measure() -> tuple[_Measured, str | None]:
        try:
            return _measure(gm, sample_batch, tensor_mode, model_name, every_layer), None
        except _DataDependentNode as err:
            where = f"node {err.node.name} ({err.node.target}, layer {err.node.meta.get(LAYER_META)})"
            if tensor_mode == "real" or not has_values:
                raise ModelError(
                    f"fake tensors cannot follow the data-dependent operation at {where}: "
                    f"{type(err.cause).__name__}. {_what_to_give(gm, err.node, sample_batch)}"
                ) from err.cause
            fallback = f"data-dependent operation at {where}: {type(err.cause).__name__}"
            return _measure(gm, sample_batch, "real", model_name, every_layer), fallback

    (measured, fallback), memoised = annotate_memo.measured(
        gm,
        sample_batch,
        lambda: _what_it_reads(gm, tensor_mode, model_name, every_layer),
        measure,
        writes=annotate_memo.Writes(node=(NODE_COST_META,), graph=(OUTPUT_META,)),
        # On fake tensors the figures are of shapes alone; on real ones the values may decide some.
        storable=lambda result: result[0].layer_graph.meta["tensor_mode"] == "fake",
    )
    m = measured
    report = AnnotateReport(
        m.layer_graph,
        m.layer_graph.meta["tensor_mode"],
        m.fwd_s,
        m.bwd_s,
        fallback,
        tuple(m.assumed),
        m.repeats,
        m.replayed,
        memoised,
    )
    return AnnotateResult(gm, m.layer_graph, report)


def _what_it_reads(
    gm: fx.GraphModule, tensor_mode: TensorMode, model_name: str | None, every_layer: bool
) -> tuple:
    """What a measurement depends on besides the graph's code, tensors and batch (the key of
    :mod:`vlmcompile.graph.annotate_memo`): the options, each node's tags, the graph's layer order,
    blocks and loss-split verdict."""
    tags = tuple(
        (
            n.name,
            str(n.meta.get(LAYER_META)),
            str(n.meta.get(REGION_META)),
            bool(n.meta.get(RUNTIME_CHECK_META)),
        )
        for n in gm.graph.nodes
    )
    split = gm.meta.get(LOSS_SPLIT_META)
    return (
        tensor_mode,
        model_name or gm.__class__.__name__,  # the layer graph's name
        every_layer,
        tags,
        tuple(gm.meta[LAYER_ORDER_META]),
        tuple(sorted(gm.meta.get(BLOCK_LAYERS_META, ()))),
        "unchecked" if split is None else str(split.verdict),
    )


def _what_to_give(gm: fx.GraphModule, node: fx.Node, batch: Mapping[str, Any]) -> str:
    """Advice for a data-dependent shape on fake tensors: which meta inputs it reads."""
    seen, stack, inputs = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            inputs.append(str(n.target))
        stack.extend(n.all_input_nodes)
    # Meta floats are taken as ones (fake.known_batch): the unknown ones are meta integers.
    meta = sorted(
        k
        for k in inputs
        if isinstance(v := batch.get(k), torch.Tensor)
        and v.device.type == "meta"
        and not v.is_floating_point()
    )
    if meta:
        return (
            f"Its shape depends on the values of batch inputs {meta}, which are meta tensors: give them as "
            "CPU tensors (the model may stay on meta)"
        )
    return (
        "Its shape depends on values computed by the model; annotate it with real weights and inputs "
        "(tensor_mode='real', small configurations) or make that shape independent of tensor values"
    )


class _DataDependentNode(Exception):
    """A node whose output shape or value depends on tensor data, which fake tensors lack."""

    def __init__(self, node: fx.Node, cause: BaseException):
        super().__init__(f"{node.name}: {cause}")
        self.node, self.cause = node, cause


@dataclass(frozen=True, slots=True)
class _Measured:
    layer_graph: LayerGraph
    fwd_s: float
    bwd_s: float
    assumed: list[str]
    repeats: int
    replayed: int
    """Of those, the blocks whose forward was not run either."""
    """Layers whose backward figures are an earlier layer's (their forwards were alike)."""


def _measure(
    gm: fx.GraphModule,
    sample_batch: Mapping[str, Any],
    tensor_mode: TensorMode,
    model_name: str | None,
    every_layer: bool,
) -> _Measured:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if tensor_mode == "fake" else None
    make = fake_factory(fake_mode) if fake_mode else _detached_parameter
    if fake_mode:
        batch, assumed = known_batch(sample_batch, make)
    else:
        batch, assumed = (
            {k: make(v) if isinstance(v, torch.Tensor) else v for k, v in sample_batch.items()},
            [],
        )
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args = [batch[n.target] if n.target in batch else _default_of(n) for n in placeholders]

    with swapped_tensors(gm, make), fake_mode or contextlib.nullcontext():
        sdpa = cpu_sdpa_flop_mapping()
        flops = FlopCounterMode(display=False, custom_mapping=sdpa)
        flop_ops = set(flop_registry) | set(sdpa)
        traffic = _MemoryTraffic(flop_ops)
        counters = _Counters(flops, traffic, {op for op in flop_ops if "attention" in str(op)})
        param_storages = {st[0] for p in gm.parameters() if (st := _storage(p))}
        interp = _Annotator(
            gm,
            counters,
            param_storages,
            fake_mode,
            replay=fake_mode is not None and not every_layer,
            trace_ops=not every_layer,
        )
        known_shapes = ShapesFromKnownValues(fake_mode) if fake_mode else contextlib.nullcontext()
        with flops, traffic, known_shapes:
            start = time.perf_counter()
            try:
                out = interp.run(*args)
                gm.meta[OUTPUT_META] = (
                    torch.empty(out.shape, dtype=out.dtype, device="meta")
                    if isinstance(out, torch.Tensor)
                    else out
                )
            except (DynamicOutputShapeException, DataDependentOutputException) as err:
                raise _DataDependentNode(interp.current, err) from err
            fwd_s = time.perf_counter() - start
            start = time.perf_counter()
            repeats = {} if every_layer else interp.repeated_layers(gm)
            interp.run_backward(gm, repeats)
            bwd_s = time.perf_counter() - start
        layer_graph = _build_layer_graph(
            gm, interp, model_name=model_name, tensor_mode=tensor_mode, batch=sample_batch
        )
    return _Measured(layer_graph, fwd_s, bwd_s, assumed, len(repeats), len(interp.replayed))


def _default_of(n: fx.Node) -> Any:
    if n.args:
        return n.args[0]
    raise ValueError(f"sample_batch has no value for graph input {n.target!r}")


def _build_layer_graph(
    gm: fx.GraphModule,
    interp: _Annotator,
    *,
    model_name: str | None,
    tensor_mode: TensorMode,
    batch: Mapping[str, Any],
) -> LayerGraph:
    order: list[str] = gm.meta[LAYER_ORDER_META]
    position = {layer: i for i, layer in enumerate(order)}
    nodes = [n for n in gm.graph.nodes if n.meta.get(LAYER_META)]
    num_params, param_bytes, num_frozen = _node_costs_and_parameters(gm, nodes, interp, position)
    crossing = _crossings(nodes, interp, position)
    per_layer = layer_nodes(gm)
    blocks = gm.meta.get(BLOCK_LAYERS_META, frozenset())
    layers = []
    running_fwd = running_bwd = 0
    for i, name in enumerate(order):
        running_fwd += crossing.diff_fwd[i]
        running_bwd += crossing.diff_bwd[i]
        members = per_layer[name]
        costs = [n.meta[NODE_COST_META] for n in members]
        saved = sum(c.saved_bytes for c in costs)
        # A layer with no backward (frozen, nothing trainable before it) keeps nothing either way.
        no_backward = saved == 0 and sum(c.bwd_flops for c in costs) == 0
        layers.append(
            Layer(
                index=i,
                name=name,
                region=members[0].meta[REGION_META],
                num_nodes=len(members),
                num_params=num_params[i],
                num_frozen_params=num_frozen[i],
                param_bytes=param_bytes[i],
                fwd_flops=sum(c.fwd_flops for c in costs),
                bwd_flops=sum(c.bwd_flops for c in costs),
                saved_bytes=saved,
                saved_bytes_recompute=0 if no_backward else sum(interp.layer_inputs[name].values()),
                boundary_fwd_bytes=running_fwd if i < len(order) - 1 else 0,
                boundary_bwd_bytes=running_bwd if i < len(order) - 1 else 0,
                outputs=tuple(crossing.outputs[name]),
                fwd_attn_flops=sum(c.fwd_attn_flops for c in costs),
                bwd_attn_flops=sum(c.bwd_attn_flops for c in costs),
                fwd_mem_bytes=sum(c.fwd_mem_bytes for c in costs),
                bwd_mem_bytes=sum(c.bwd_mem_bytes for c in costs),
                block=name in blocks,
            )
        )
    edges = tuple(
        (src, dst, b)
        for (src, dst), b in sorted(
            crossing.edge_bytes.items(), key=lambda kv: (position[kv[0][0]], position[kv[0][1]])
        )
    )
    meta = {
        "model": model_name or gm.__class__.__name__,
        "tensor_mode": tensor_mode,
        "batch": {k: str(_spec(v)) for k, v in batch.items() if isinstance(v, torch.Tensor)},
        "batch_size": num_samples(batch),
        # str, so the LayerGraph's JSON holds it; for reports (the plan pass reads gm.meta's LossSplitCheck).
        "loss_split": str(gm.meta[LOSS_SPLIT_META].verdict) if LOSS_SPLIT_META in gm.meta else "unchecked",
    }
    return LayerGraph(layers=tuple(layers), edges=edges, meta=meta)


def _node_costs_and_parameters(
    gm: fx.GraphModule, nodes: list[fx.Node], interp: _Annotator, position: Mapping[str, int]
) -> tuple[list[int], list[int], list[int]]:
    """Writes each node's :class:`NodeCost` into its meta; returns parameters, their bytes and the
    frozen ones (``requires_grad=False``) per layer, each parameter counted once, in the first
    layer (pipeline order) that reads it."""
    owner: dict[int, tuple[int, nn.Parameter]] = {}
    for n in nodes:
        found = _params_read(gm, n)
        n.meta[NODE_COST_META] = NodeCost(
            outputs=tuple(_spec(t) for t in _tensors(interp.env.get(n))),
            fwd_flops=interp.fwd_cost[n][0],
            bwd_flops=interp.bwd_cost[n][0],
            saved_bytes=interp.saved.get(n, 0),
            param_bytes=sum(p.numel() * p.element_size() for p in found),
            fwd_attn_flops=interp.fwd_cost[n][1],
            bwd_attn_flops=interp.bwd_cost[n][1],
            fwd_mem_bytes=interp.fwd_cost[n][2],
            bwd_mem_bytes=interp.bwd_cost[n][2],
        )
        for p in found:
            if p is not None and (id(p) not in owner or position[n.meta[LAYER_META]] < owner[id(p)][0]):
                owner[id(p)] = (position[n.meta[LAYER_META]], p)
    num_params = [0] * len(position)
    param_bytes = [0] * len(position)
    num_frozen = [0] * len(position)
    for pos, p in owner.values():
        num_params[pos] += p.numel()
        param_bytes[pos] += p.numel() * p.element_size()
        num_frozen[pos] += 0 if p.requires_grad else p.numel()
    return num_params, param_bytes, num_frozen


@dataclass(frozen=True, slots=True)
class _Crossings:
    diff_fwd: list[int]
    """Bytes that start crossing the cut after layer i (positive) or stop (negative)."""
    diff_bwd: list[int]
    """The same for their gradients."""
    edge_bytes: dict[tuple[str, str], int]
    outputs: dict[str, list[TensorSpec]]
    """Per layer, the values it hands on (to a later layer or as the graph's output)."""


def _crossings(nodes: list[fx.Node], interp: _Annotator, position: Mapping[str, int]) -> _Crossings:
    """Values leaving a layer cross every cut from their layer up to the last layer reading them."""
    diff_fwd = [0] * (len(position) + 1)
    diff_bwd = [0] * (len(position) + 1)
    edge_bytes: dict[tuple[str, str], int] = defaultdict(int)
    outputs: dict[str, list[TensorSpec]] = defaultdict(list)
    for n in nodes:
        if n.op == "get_attr":
            continue
        layer = n.meta[LAYER_META]
        readers = {u.meta.get(LAYER_META) for u in n.users if u.op != "output"} - {layer, None}
        returned = any(u.op == "output" for u in n.users)
        if not readers and not returned:
            continue
        tensors = _tensors(interp.env[n])
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        grad_bytes = sum(t.numel() * t.element_size() for t in tensors if t.requires_grad)
        outputs[layer] += [_spec(t) for t in tensors]
        for reader in readers:
            edge_bytes[(layer, reader)] += nbytes
        if readers:
            last = max(position[r] for r in readers)
            diff_fwd[position[layer]] += nbytes
            diff_fwd[last] -= nbytes
            diff_bwd[position[layer]] += grad_bytes
            diff_bwd[last] -= grad_bytes
    return _Crossings(diff_fwd, diff_bwd, edge_bytes, outputs)


def _params_read(gm: fx.GraphModule, n: fx.Node) -> list[nn.Parameter]:
    if n.op == "call_module":
        return list(gm.get_submodule(str(n.target)).parameters())
    if n.op == "get_attr":
        try:
            return [gm.get_parameter(str(n.target))]
        except AttributeError:  # a buffer or constant
            return []
    return []
