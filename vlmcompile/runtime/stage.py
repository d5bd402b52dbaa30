"""The modules codegen makes and the runtime runs: a :class:`StageModule` per stage of a plan,
made of one :class:`LayerModule` (an ``fx.GraphModule``) per layer.

A layer module keeps the captured graph's attribute paths (``llm.blocks.3.attn.qkv.weight``),
so every stage parameter maps back to the original model's name (:meth:`StageModule.original_names`,
``state_dict`` both ways: :func:`load_original_state`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlmcompile.ir.shape_plan import ShapeFormula


@dataclass(frozen=True, slots=True)
class LayerWiring:
    name: str
    inputs: tuple[str, ...]
    """Names of the values the layer reads (captured-graph node names), in argument order."""
    outputs: tuple[str, ...]
    """Names of the values it makes that a later layer or the loss reads."""
    recompute: bool


class StageModule(nn.Module):
    """One stage of the chain: ``forward(received, microbatch)`` returns the values the next
    stage needs (a tuple in ``send`` order), or the loss on the last stage."""

    def __init__(
        self,
        index: int,
        layer_modules: Sequence[fx.GraphModule],
        wiring: Sequence[LayerWiring],
        *,
        receive: tuple[str, ...],
        send: tuple[str, ...],
        batch_inputs: Mapping[str, str],
        loss: str | None,
        prefix: str = "",
        send_shapes: tuple[ShapeFormula, ...] = (),
    ):
        super().__init__()
        self.index = index
        self.layers = nn.ModuleList(layer_modules)
        self.wiring = tuple(wiring)
        self.receive = receive
        self.send = send
        self.batch_inputs = dict(batch_inputs)
        """Placeholder node name -> batch key."""
        self.loss = loss
        self.prefix = prefix
        self.send_shapes = send_shapes
        """The shape of each value in ``send`` over the microbatch's size symbols (packed
        pipelines: :mod:`vlmcompile.ir.shape_plan`)."""

    def forward(self, received: Sequence[Any], microbatch: Mapping[str, Any]) -> Any:
        env: dict[str, Any] = dict(zip(self.receive, received))
        for node, key in self.batch_inputs.items():
            env[node] = microbatch[key]
        for module, wiring in zip(self.layers, self.wiring):
            args = [env[n] for n in wiring.inputs]
            if wiring.recompute:
                outs = checkpoint(module, *args, use_reentrant=False)
            else:
                outs = module(*args)
            env.update(zip(wiring.outputs, outs))
        if self.loss is not None:
            return env[self.loss]
        return tuple(env[n] for n in self.send)

    def original_names(self) -> dict[str, str]:
        """Stage parameter/buffer name -> the original model's name."""
        out = {}
        for name, _ in [*self.named_parameters(), *self.named_buffers()]:
            # "layers.<i>.<captured path>": the captured path is the original's, behind the wrapper.
            path = name.split(".", 2)[2]
            out[name] = path[len(self.prefix) :] if path.startswith(self.prefix) else path
        return out


def move_stage(stage: nn.Module, device: torch.device) -> None:
    """Move a stage's parameters and buffers to ``device`` and point the devices its graphs name
    there too: capture records the device it ran on in calls like ``arange(device=cpu)`` and
    ``to(device=cpu)`` (transformers' LLaVA, Gemma3, Qwen2.5-VL), which on a GPU would make CPU
    tensors. (Export's ``_assert_tensor_metadata(device=cpu)`` checks are dropped at capture.)"""
    stage.to(device)
    for module in stage.modules():
        if isinstance(module, fx.GraphModule) and retarget_devices(module.graph, device):
            module.recompile()


def retarget_devices(graph: fx.Graph, device: torch.device) -> int:
    """Point every CPU device ``graph``'s calls name (``device=`` or positional, as in
    ``aten.to.device(x, cpu, float32)``) to ``device``; returns how many calls changed."""

    def retarget(value):
        if isinstance(value, torch.device) and value.type == "cpu":
            return device
        if isinstance(value, (tuple, list)):
            return type(value)(retarget(v) for v in value)
        return value

    moved = 0
    for node in graph.nodes:
        args = tuple(retarget(a) for a in node.args)
        kwargs = {k: retarget(v) for k, v in node.kwargs.items()}
        if kwargs.get("device") in ("cpu", torch.device("cpu")):
            kwargs["device"] = device
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            moved += 1
    return moved


class LayerModule(fx.GraphModule):
    """One layer's graph. Pickles as a list of its nodes and the objects it reads, not as code:
    fx unpickles a GraphModule by tracing its generated code again, which fails on calls that
    take no proxies (functorch's vmap set-up in transformers' mask functions, Gemma3); and an
    ``fx.Graph`` does not pickle, its operators (``aten.view.default``) do not."""

    def __reduce__(self):
        rows = []
        for n in self.graph.nodes:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: _NodeRef(a.name))
            target = _OpRef.of(n.target) if isinstance(n.target, _TORCH_OPS) else n.target
            rows.append((n.op, n.name, target, args, kwargs))
        targets = {str(n.target) for n in self.graph.nodes if n.op in ("get_attr", "call_module")}
        attrs = {t: _get_attr(self, t) for t in targets}
        return (_rebuild_layer, (attrs, rows, type(self).__name__))


_TORCH_OPS = (torch._ops.OpOverload, torch._ops.HigherOrderOperator)


@dataclass(frozen=True, slots=True)
class _NodeRef:
    name: str


@dataclass(frozen=True, slots=True)
class _OpRef:
    """A torch operator by its path under ``torch.ops`` (``aten.view.default``)."""

    path: tuple[str, ...]

    @staticmethod
    def of(op: Any) -> _OpRef:
        if isinstance(op, torch._ops.HigherOrderOperator):
            return _OpRef(("higher_order", op.name()))
        return _OpRef((op.namespace, op._schema.name.split("::", 1)[1], op._overloadname))

    def resolve(self) -> Any:
        out: Any = torch.ops
        for part in self.path:
            out = getattr(out, part)
        return out


def _get_attr(module: nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)


def _rebuild_layer(attrs: dict[str, Any], rows: list[tuple], class_name: str) -> LayerModule:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs in rows:
        args, kwargs = fx.node.map_aggregate(
            (args, kwargs), lambda a: env[a.name] if isinstance(a, _NodeRef) else a
        )
        if op == "output":
            graph.output(args[0])
            continue
        target = target.resolve() if isinstance(target, _OpRef) else target
        env[name] = graph.create_node(op, target, args, kwargs, name=name)
    return LayerModule(attrs, graph, class_name=class_name)


def load_original_state(stage: StageModule, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy the original model's ``state_dict`` entries into this stage's parameters and buffers."""
    names = stage.original_names()
    params = dict(stage.named_parameters())
    missing = sorted(orig for name, orig in names.items() if name in params and orig not in state_dict)
    if missing:
        raise KeyError(f"the state dict lacks parameters {missing[:5]} needed by stage {stage.index}")
    own = {**dict(stage.named_buffers()), **params}
    with torch.no_grad():
        for name, orig in names.items():
            if orig in state_dict:  # buffers absent from a state dict are non-persistent (derived)
                own[name].copy_(state_dict[orig])


def parameters_of(stages: Iterable[StageModule]) -> list[torch.nn.Parameter]:
    """The parameters of ``stages``, each once (a tied one is held by several), frozen ones included."""
    seen, out = set(), []
    for stage in stages:
        for p in stage.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def original_parameters(stages: Iterable[StageModule]) -> dict[str, torch.nn.Parameter]:
    """The parameters of ``stages`` under the original model's names."""
    out = {}
    for stage in stages:
        own = dict(stage.named_parameters())
        for name, orig in stage.original_names().items():
            if name in own:
                out[orig] = own[name]
    return out


def original_state(
    stages: Iterable[StageModule], state_names: Mapping[str, tuple[str, ...]] | None
) -> dict[str, torch.Tensor]:
    """``stages``' share of the original model's ``state_dict``: their parameters and persistent
    buffers under every name the original gives them (``state_names``: original name -> those
    names; None: parameters under their captured names only)."""
    out: dict[str, torch.Tensor] = {}
    for stage in stages:
        own = {**dict(stage.named_parameters()), **dict(stage.named_buffers())}
        for name, orig in stage.original_names().items():
            if name not in own:
                continue
            if state_names is None:
                if isinstance(own[name], torch.nn.Parameter):
                    out[orig] = own[name]
                continue
            for alias in state_names.get(orig, ()):
                out[alias] = own[name]
    return out
