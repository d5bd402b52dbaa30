"""Codegen pass: split the captured graph into one module per stage of a plan.

Each layer becomes its own ``fx.GraphModule`` (its nodes copied out of the captured graph, its
inputs the values it reads from earlier layers or the batch, its outputs the values later
layers or the loss read). A :class:`StageModule` runs its layers in order, each recomputed
layer under non-reentrant ``torch.utils.checkpoint``. Stages form a chain: a stage receives,
from the stage before it, every value that it or a later stage reads and that an earlier stage
made; batch inputs are read locally on every rank, so token ids and labels never travel.

A layer module keeps the captured graph's attribute paths (``llm.blocks.3.attn.qkv.weight``),
so every stage parameter maps back to the original model's name (:meth:`StageModule.original_names`,
``state_dict`` both ways: :func:`load_original_state`).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from tabulate import tabulate
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlmcompile.errors import PlanError
from vlmcompile.meta_keys import LAYER_META, LAYER_ORDER_META
from vlmcompile.plan import Plan, Recompute

WRAPPER_PREFIX = "inner."
"""Capture wraps transformers models (``_LossOf``): their graph's attribute paths start so."""


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


@dataclass(frozen=True, slots=True)
class StageSummary:
    index: int
    rank: int
    layers: int
    recomputed: int
    receives: int
    sends: int
    params: int


@dataclass(frozen=True, slots=True)
class CodegenReport:
    stages: tuple[StageSummary, ...]

    def __str__(self) -> str:
        rows = [
            [s.index, s.rank, s.layers, s.recomputed, s.receives, s.sends, f"{s.params:,}"]
            for s in self.stages
        ]
        head = f"codegen: {len(self.stages)} stage modules (recompute: non-reentrant torch.utils.checkpoint)"
        return (
            head
            + "\n"
            + tabulate(
                rows,
                headers=["stage", "rank", "layers", "recomputed", "values in", "values out", "parameters"],
            )
        )


@dataclass(frozen=True, slots=True)
class CodegenResult:
    stages: tuple[StageModule, ...]
    report: CodegenReport


def _layer_of(node: fx.Node) -> str:
    return node.meta[LAYER_META]


def _codegen_layers(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Each node's layer for codegen: the capture's, except that a constant-index ``getitem``
    joins the layer of what it indexes, so a multi-output node's tuple never crosses a layer
    boundary (only its elements do). Earlier layer, so every value still flows forward."""
    layer = {n: _layer_of(n) for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
    for n in gm.graph.nodes:
        if (
            n.op == "call_function"
            and n.target is operator.getitem
            and n.args[0] in layer
            and n.all_input_nodes == [n.args[0]]
        ):
            layer[n] = layer[n.args[0]]
    return layer


def _loss_node(gm: fx.GraphModule) -> fx.Node:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    value = output.args[0]
    while isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, fx.Node):
        raise PlanError(
            f"the captured graph returns {value!r}; codegen needs a graph that returns the loss alone"
        )
    return value


def _build_layer_module(gm: fx.GraphModule, nodes: list[fx.Node], outputs: list[fx.Node], name: str):
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for p in n.all_input_nodes:
            if p not in inside and p not in env:
                env[p] = graph.placeholder(p.name)
                env[p].meta = dict(p.meta)
                inputs.append(p)
        env[n] = graph.node_copy(n, lambda p: env[p])
    graph.output(tuple(env[o] for o in outputs))
    module = LayerModule(gm, graph, class_name=f"Layer_{name.replace('.', '_')}")
    return module, inputs


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


def layer_modules(gm: fx.GraphModule) -> list[tuple[fx.GraphModule, list[str], list[str]]]:
    """One module per layer, in pipeline order: (module, names of the values it reads, names of
    the values it returns - those a later layer or the loss reads)."""
    layer_of = _codegen_layers(gm)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    loss = _loss_node(gm)
    nodes_of: dict[str, list[fx.Node]] = {name: [] for name in gm.meta[LAYER_ORDER_META]}
    for n, name in layer_of.items():
        nodes_of[name].append(n)
    out = []
    for name, nodes in nodes_of.items():
        nodes.sort(key=position.__getitem__)
        inside = set(nodes)
        outputs = [n for n in nodes if n is loss or any(u not in inside for u in n.users if u.op != "output")]
        module, inputs = _build_layer_module(gm, nodes, outputs, name)
        out.append((module, [p.name for p in inputs], [o.name for o in outputs]))
    return out


def codegen(gm: fx.GraphModule, plan: Plan) -> CodegenResult:
    """Split ``gm`` along ``plan``'s stages; recomputed layers run under checkpoint.

    Raises:
        PlanError: the plan names layers the graph does not have, splits layers into sub-layer
            pieces, asks for selective recompute, or cuts where a non-tensor value would cross.
    """
    order = list(gm.meta[LAYER_ORDER_META])
    if plan.pieces:
        raise PlanError("codegen runs plans cut at layers; this plan splits layers into pieces")
    planned = [n for s in plan.stages for n in s.layers]
    if planned != order:
        missing = sorted(set(order) - set(planned))[:5]
        extra = sorted(set(planned) - set(order))[:5]
        raise PlanError(
            "the plan's stages do not hold the captured graph's layers in order "
            f"(missing {missing}, unknown {extra}); was the plan made for this model?"
        )
    selective = sorted(n for n, r in plan.recompute.items() if r is Recompute.SELECTIVE)
    if selective:
        raise PlanError(
            f"selective recompute (layers {selective[:3]}...) is not run by codegen; plan with full "
            "per-layer recompute (policy vlmcompile or omnibal) or none"
        )

    layer_of = _codegen_layers(gm)
    stage_of_layer = {name: s.index for s in plan.stages for name in s.layers}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    loss = _loss_node(gm)
    placeholders = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "placeholder"}
    prefix = WRAPPER_PREFIX if any(k.startswith(WRAPPER_PREFIX) for k, _ in gm.named_parameters()) else ""
    built = dict(zip(order, layer_modules(gm)))

    def stage_of(n: fx.Node) -> int | None:
        return None if n.op == "placeholder" else stage_of_layer[layer_of[n]]

    # The last stage at which each computed value is read.
    last_read: dict[fx.Node, int] = {}
    for n, name in layer_of.items():
        for p in n.all_input_nodes:
            if p.op != "placeholder" and layer_of[p] != name:
                last_read[p] = max(last_read.get(p, -1), stage_of_layer[name])

    stages = []
    summaries = []
    for stage in plan.stages:
        modules, wiring = [], []
        for name in stage.layers:
            module, inputs, outputs = built[name]
            modules.append(module)
            wiring.append(
                LayerWiring(name, tuple(inputs), tuple(outputs), plan.recompute_of(name) is Recompute.FULL)
            )
        receive = sorted(
            (p for p, last in last_read.items() if stage_of(p) < stage.index <= last),
            key=position.__getitem__,
        )
        send = sorted(
            (p for p, last in last_read.items() if stage_of(p) <= stage.index < last),
            key=position.__getitem__,
        )
        is_last = stage.index == plan.num_stages - 1
        read_batch = {p for w in wiring for p in w.inputs if p in placeholders}
        module = StageModule(
            stage.index,
            modules,
            wiring,
            receive=tuple(p.name for p in receive),
            send=() if is_last else tuple(p.name for p in send),
            batch_inputs={p: placeholders[p] for p in sorted(read_batch)},
            loss=loss.name if is_last else None,
            prefix=prefix,
        )
        if is_last and stage_of(loss) != stage.index:
            raise PlanError(f"the loss is computed on stage {stage_of(loss)}, not on the last stage")
        stages.append(module)
        summaries.append(
            StageSummary(
                stage.index,
                stage.rank,
                len(stage.layers),
                sum(w.recompute for w in wiring),
                len(receive),
                len(send) if not is_last else 0,
                sum(p.numel() for p in module.parameters()),
            )
        )
    return CodegenResult(tuple(stages), CodegenReport(tuple(summaries)))


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
