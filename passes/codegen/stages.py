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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from tabulate import tabulate
from torch import nn

from vlmcompile.graph.subgraph import extract
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.meta_keys import (
    CAPTURE_OPTIONS_META,
    LAYER_META,
    LAYER_ORDER_META,
    PACKED_META,
    WRAPPER_PREFIX_META,
)
from vlmcompile.ir.microbatch import num_samples, rows_per_sample, take
from vlmcompile.ir.plan import Plan, Recompute, Stage
from vlmcompile.ir.shape_plan import ShapeFormula
from vlmcompile.passes.graph.capture import capture
from vlmcompile.runtime.stage import LayerModule, LayerWiring, StageModule


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
    gm: fx.GraphModule
    """The graph the stages were split from (its ``meta`` says what the runtime must check)."""


def _layers(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Each computing node's layer, as capture wrote it."""
    return {n: n.meta[LAYER_META] for n in gm.graph.nodes if n.op not in ("placeholder", "output")}


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
    return extract(gm, nodes, outputs, module_class=LayerModule, class_name=f"Layer_{name.replace('.', '_')}")


def layer_modules(gm: fx.GraphModule) -> list[tuple[fx.GraphModule, list[str], list[str]]]:
    """One module per layer, in pipeline order: (module, names of the values it reads, names of
    the values it returns - those a later layer or the loss reads)."""
    layer_of = _layers(gm)
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
    _check_plan(gm, plan)
    split = _Split(gm, plan)
    stages, summaries = [], []
    for stage in plan.stages:
        module, summary = split.stage_module(stage)
        stages.append(module)
        summaries.append(summary)
    return CodegenResult(tuple(stages), CodegenReport(tuple(summaries)), gm)


def _check_plan(gm: fx.GraphModule, plan: Plan) -> None:
    order = list(gm.meta[LAYER_ORDER_META])
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


class _Split:
    """The captured graph read once for a plan: each node's layer and stage, and the last stage
    that reads each value, from which every stage's inputs and outputs follow."""

    def __init__(self, gm: fx.GraphModule, plan: Plan):
        self.plan = plan
        self.layer_of = _layers(gm)
        self.stage_of_layer = {name: s.index for s in plan.stages for name in s.layers}
        self.position = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.loss = _loss_node(gm)
        self.placeholders = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "placeholder"}
        self.prefix = gm.meta.get(WRAPPER_PREFIX_META, "")
        self.packed = gm.meta.get(PACKED_META)
        self.built = dict(zip(gm.meta[LAYER_ORDER_META], layer_modules(gm)))
        self.last_read: dict[fx.Node, int] = {}
        for n, name in self.layer_of.items():
            for p in n.all_input_nodes:
                if p.op != "placeholder" and self.layer_of[p] != name:
                    self.last_read[p] = max(self.last_read.get(p, -1), self.stage_of_layer[name])

    def _check_shapes_known(self, stage: int, send: list[fx.Node], shapes: tuple[ShapeFormula, ...]) -> None:
        """A packed pipeline plans every transfer's shape from the microbatch's input sizes: a
        value whose shape follows from tensor values instead cannot cross ranks."""
        if self.packed is None:
            return
        known = self.packed.input_sizes.symbols
        for node, shape in zip(send, shapes):
            unknown = sorted(shape.symbols - known)
            if unknown:
                raise PlanError(
                    f"stage {stage} would send {node.name!r}, whose shape {list(shape.dims)} depends on tensor "
                    f"values ({unknown}), not on the microbatch's sizes; cut the pipeline elsewhere"
                )

    def stage_of(self, n: fx.Node) -> int | None:
        return None if n.op == "placeholder" else self.stage_of_layer[self.layer_of[n]]

    def stage_module(self, stage: Stage) -> tuple[StageModule, StageSummary]:
        modules, wiring = [], []
        for name in stage.layers:
            module, inputs, outputs = self.built[name]
            modules.append(module)
            recompute = self.plan.recompute_of(name) is Recompute.FULL
            wiring.append(LayerWiring(name, tuple(inputs), tuple(outputs), recompute))
        # A stage receives what an earlier stage made and it or a later one reads; it sends on
        # what it or an earlier stage made and a later one reads.
        receive = sorted(
            (p for p, last in self.last_read.items() if self.stage_of(p) < stage.index <= last),
            key=self.position.__getitem__,
        )
        send = sorted(
            (p for p, last in self.last_read.items() if self.stage_of(p) <= stage.index < last),
            key=self.position.__getitem__,
        )
        is_last = stage.index == self.plan.num_stages - 1
        if is_last and self.stage_of(self.loss) != stage.index:
            raise PlanError(
                f"the loss is computed on stage {self.stage_of(self.loss)}, not on the last stage"
            )
        read_batch = {p for w in wiring for p in w.inputs if p in self.placeholders}
        send_shapes = () if is_last else tuple(ShapeFormula.of(p.meta.get("val")) for p in send)
        self._check_shapes_known(stage.index, send, send_shapes)
        module = StageModule(
            stage.index,
            modules,
            wiring,
            receive=tuple(p.name for p in receive),
            send=() if is_last else tuple(p.name for p in send),
            batch_inputs={p: self.placeholders[p] for p in sorted(read_batch)},
            loss=self.loss.name if is_last else None,
            prefix=self.prefix,
            send_shapes=send_shapes,
        )
        summary = StageSummary(
            stage.index,
            stage.rank,
            len(stage.layers),
            sum(w.recompute for w in wiring),
            len(receive),
            0 if is_last else len(send),
            sum(p.numel() for p in module.parameters()),
        )
        return module, summary


def graph_for(
    gm: fx.GraphModule, plan: Plan, *, model: nn.Module | None, sample_batch: Mapping[str, Any]
) -> fx.GraphModule:
    """The captured graph to split for ``plan``: ``gm`` itself, unless export made it (export
    specialises shapes) at another batch size than the plan's microbatch; then the model is
    captured again, with the same options, at the first microbatch of the sample batch."""
    options = gm.meta.get(CAPTURE_OPTIONS_META, {})
    samples = num_samples(sample_batch)
    if options.get("method") != "export" or samples == plan.microbatch_size:
        return gm
    if model is None or samples < plan.microbatch_size:
        raise PlanError(
            f"the graph was exported for batches of {samples}; the plan's microbatches hold "
            f"{plan.microbatch_size}. Compile with a sample batch of {plan.microbatch_size} samples"
        )
    microbatch = take(sample_batch, 0, plan.microbatch_size, rows_per_sample(sample_batch))
    return capture(model, microbatch, check_numerics=False, **options).gm


def codegen_for(
    gm: fx.GraphModule, plan: Plan, *, model: nn.Module | None, sample_batch: Mapping[str, Any]
) -> CodegenResult:
    """The codegen pass: :func:`codegen` on :func:`graph_for`'s graph."""
    return codegen(graph_for(gm, plan, model=model, sample_batch=sample_batch), plan)
