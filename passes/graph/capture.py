"""Capture pass: model + sample batch -> an ``fx.GraphModule`` of the training forward (with loss).

Two capture paths (docs/models.md, "Capture"):

* ``fx``: ``torch.fx`` symbolic tracing with transformer blocks as leaf modules. Plain-PyTorch
  models (the zoo). The graph keeps the user's modules, so a 200B-parameter model is ~150 nodes.
* ``export``: ``torch.export(strict=False)``. transformers models (symbolic tracing fails on
  every transformers-5 VLM), and the fallback when ``fx`` tracing fails.

Both tag every node with its layer and region (:mod:`vlmcompile.graph.layering`). A model that
returns a ModelOutput is captured up to its ``loss``. The export machinery - meta models on fake
CPU tensors, specialisation on the batch values that decide shapes, failures named by the
model's line - is :mod:`vlmcompile.graph.export`. On real weights capture then checks the graph
against eager and whether the loss splits over microbatches (:mod:`vlmcompile.graph.loss_split`).
"""

from __future__ import annotations

import difflib
import inspect
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
from tabulate import tabulate
from torch import nn

from vlmcompile import families
from vlmcompile.graph.contrastive import CouplingCut, find_coupling
from vlmcompile.graph.export import (
    DATA_DEPENDENT_HELP,
    WRAPPED,
    LossOf,
    Specialization,
    check_loss,
    describe_failure,
    export_specialising,
    loss_of,
    on_meta,
    takes_use_cache,
)
from vlmcompile.graph.layering import LayerAssigner, assign_layers, check_regions_detected
from vlmcompile.graph.loss_split import LossSplit, LossSplitCheck, check_loss_split
from vlmcompile.graph.specialize import differs_between_samples
from vlmcompile.ir.errors import CaptureError, ModelError, RegionError, SampleBatchError, VlmCompileError
from vlmcompile.ir.meta_keys import (
    BLOCK_LAYERS_META,
    CAPTURE_OPTIONS_META,
    COUPLING_META,
    LAYER_META,
    LAYER_ORDER_META,
    LOSS_SPLIT_META,
    SPECIALIZED_META,
    WRAPPER_PREFIX_META,
)
from vlmcompile.ir.regions import Region, check_override_paths, parse_overrides

CaptureMethod = Literal["fx", "export"]


@dataclass(frozen=True, slots=True)
class Fallback:
    """A capture path that was tried and failed, and why."""

    method: CaptureMethod
    reason: str


@dataclass(frozen=True, slots=True)
class LayerRegion:
    layer: str
    region: Region
    source: str
    """How the region was found: override, module attribute, path keyword, undetected."""


@dataclass(frozen=True, slots=True)
class CaptureReport:
    model: str
    method: CaptureMethod
    fallbacks: tuple[Fallback, ...]
    num_nodes: int
    layers: tuple[LayerRegion, ...]
    numerics: str
    """'equal to eager (max abs diff ...)', or why the check was skipped."""
    loss_split: LossSplitCheck = LossSplitCheck(LossSplit.UNCHECKED, "not checked")
    """Whether the loss of a batch is the weighted sum of its samples' (see vlmcompile/graph/loss_split.py)."""
    coupling: CouplingCut | None = None
    """For a loss that couples the samples: the contrastive loss found, or why none (graph/contrastive.py)."""
    runtime_checks: tuple[str, ...] = ()
    """Runtime assertions export inserted (they hold on the sample batch; the runtime runs them)."""
    specialized: Specialization | None = None
    """Batch inputs whose values the graph is fixed to, and why."""
    packed: str | None = None
    """For packed training data: the one capture's layout and what varies in it."""

    def __str__(self) -> str:
        lines = [
            f"capture: {self.model} via {self.method}, {self.num_nodes} nodes, {len(self.layers)} layers"
        ]
        lines += [f"  {f.method} failed first: {f.reason}" for f in self.fallbacks]
        if self.packed:
            lines.append(f"  {self.packed}")
        lines.append(f"  numerics: {self.numerics}")
        lines.append(f"  loss over microbatches: {self.loss_split}")
        if self.coupling is not None:
            found = self.coupling.loss
            lines.append(
                f"  coupled loss: {found.detail}; towers microbatched, loss on the whole batch"
                if found
                else f"  coupled loss: not shardable ({self.coupling.refusal}): one microbatch, DP = 1"
            )
        if self.specialized:
            lines.append(
                f"  specialised on the values of {list(self.specialized.keys)} (every batch must bring the "
                f"same values), because shapes depend on them: {self.specialized.because}"
            )
        if self.runtime_checks:
            lines.append(
                f"  {len(self.runtime_checks)} runtime check(s) kept for the run (annotate skips them): "
                + "; ".join(self.runtime_checks)
            )
        by_region: dict[Region, list[LayerRegion]] = {}
        for lr in self.layers:
            by_region.setdefault(lr.region, []).append(lr)
        rows = [
            [
                r.value,
                len(lrs),
                f"{lrs[0].layer} .. {lrs[-1].layer}" if len(lrs) > 1 else lrs[0].layer,
                ", ".join(sorted({lr.source for lr in lrs})),
            ]
            for r, lrs in by_region.items()
        ]
        lines.append(tabulate(rows, headers=["region", "layers", "span", "found by"]))
        undetected = [lr.layer for lr in self.layers if lr.region is Region.OTHER]
        if undetected:
            lines.append(
                f"  layers with no detected region (give region_overrides to place them): {undetected}"
            )
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class CaptureResult:
    gm: fx.GraphModule
    report: CaptureReport


def check_sample_batch(model: nn.Module, sample_batch: Any) -> dict[str, Any]:
    """The batch as keyword arguments of ``model.forward``, or a SampleBatchError saying what is off."""
    if not isinstance(sample_batch, Mapping):
        raise SampleBatchError(
            f"sample_batch is a {type(sample_batch).__name__}; give a dict from forward's argument names "
            "to tensors, e.g. {'pixel_values': ..., 'input_ids': ..., 'labels': ...}"
        )
    params = inspect.signature(model.forward).parameters
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    _check_keys(type(model).__name__, set(sample_batch), named, _keyword_arguments(params))
    required = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    missing = [n for n in required if n not in sample_batch]
    if missing:
        raise SampleBatchError(
            f"sample_batch lacks {missing}, required by {type(model).__name__}.forward; "
            f"add them (batch keys: {sorted(sample_batch)})"
        )
    if not any(isinstance(v, torch.Tensor) for v in sample_batch.values()):
        raise SampleBatchError("sample_batch holds no tensor; give the model's input tensors")
    non_finite = [
        k
        for k, v in sample_batch.items()
        if isinstance(v, torch.Tensor)
        and v.is_floating_point()
        and v.device.type != "meta"
        and not bool(torch.isfinite(v).all())
    ]
    if non_finite:
        raise SampleBatchError(
            f"sample_batch{non_finite} hold NaN or infinite values; capture checks the graph against eager "
            "on finite numbers: give a batch of real data (or random finite values)"
        )
    return dict(sample_batch)


_ALIASES = {
    "pixel_values": ("images", "image", "pixels", "img", "imgs", "image_tensor", "pixel_value", "vision"),
    "input_ids": ("ids", "tokens", "token_ids", "text", "input", "inputs", "text_ids"),
    "attention_mask": ("mask", "masks", "attn_mask", "attention_masks"),
    "labels": ("label", "targets", "target", "target_ids"),
}
"""Names users give a forward argument under another name (the processors' keys are the right ones)."""


def _alias_of(key: str, names: set[str]) -> str | None:
    """The argument of ``names`` that ``key`` is a known other name of, or None."""
    return next(
        (name for name, aliases in _ALIASES.items() if name in names and key.lower() in aliases), None
    )


def closest_argument(key: str, names: set[str]) -> str | None:
    """The argument of ``names`` a batch key ``key`` most likely meant, or None."""
    close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
    return _alias_of(key, names) or (close[0] if close else None)


def _keyword_arguments(params: Mapping[str, inspect.Parameter]) -> set[str] | None:
    """The keys ``**kwargs`` takes: a typed dict's (transformers' ``**kwargs: Unpack[...]``), an
    empty set for a forward without ``**kwargs``, None for untyped ``**kwargs`` (anything)."""
    var = [p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    if not var:
        return set()
    typed = next(iter(typing.get_args(var[0].annotation)), None)
    keys = getattr(typed, "__annotations__", None) if typing.is_typeddict(typed) else None
    return set(keys) if keys is not None else None


def _check_keys(model: str, keys: set[str], named: set[str], keyword: set[str] | None) -> None:
    """Refuse a batch key the forward does not take (or, behind untyped ``**kwargs``, one that
    looks like an argument under another name), naming the argument it most likely meant."""
    missing = named - keys
    for key in sorted(keys - named - (keyword or set())):
        if keyword is None:  # untyped **kwargs may read it: refused only as a known other name of an argument
            meant = _alias_of(key, missing or named)
            if meant is None:
                continue
        else:
            meant = closest_argument(key, missing or named)
        hint = f"did you mean {meant!r}? " if meant else ""
        raise SampleBatchError(
            f"sample_batch key {key!r} is no argument of {model}.forward: {hint}(its arguments: "
            f"{', '.join(sorted(named))})"
        )


def _is_transformers_model(model: nn.Module) -> bool:
    """A transformers class, or the user's own subclass of one."""
    return any(cls.__module__.startswith("transformers.") for cls in type(model).__mro__)


class _BlockLeafTracer(fx.Tracer):
    def __init__(self, blocks: set[str]):
        super().__init__()
        self.blocks = blocks

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.blocks or super().is_leaf_module(m, module_qualified_name)


def _trace_fx(model: nn.Module, batch: dict[str, Any], blocks: set[str]) -> fx.GraphModule:
    params = inspect.signature(model.forward).parameters
    concrete = {
        n: p.default for n, p in params.items() if n not in batch and p.default is not inspect.Parameter.empty
    }
    tracer = _BlockLeafTracer(blocks)
    graph = tracer.trace(model, concrete_args=concrete or None)
    _drop_concrete_placeholders(graph, batch)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _drop_concrete_placeholders(graph: fx.Graph, batch: Mapping[str, Any]) -> None:
    """fx keeps a placeholder for each argument fixed to its default (``attention_mask=None``),
    read only by a guard that it is still that value; no batch brings it, so both go."""
    for n in list(graph.nodes):
        if n.op != "placeholder" or n.target in batch:
            continue
        guards = list(n.users)
        if all(
            u.op == "call_function" and getattr(u.target, "__name__", "") == "_assert_is_none" for u in guards
        ):
            for u in guards:
                graph.erase_node(u)
            graph.erase_node(n)


def _output_only_the_loss(gm: fx.GraphModule) -> fx.GraphModule:
    """A traced forward that returns its loss in a dict or a dataclass (``{"loss": ...}``, a
    ModelOutput of the user's own) returns the loss alone, as ``loss_of`` reads the eager output;
    one that returns a tuple is refused: which element is the loss cannot be told."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    value = output.args[0]
    made = isinstance(value, fx.Node) and value.op == "call_function" and isinstance(value.target, type)
    if isinstance(value, fx.Node) and not made:
        return gm
    # The tracer records a dataclass it returns as a call of its class, with the fields as kwargs.
    fields = value.kwargs if made else value if isinstance(value, Mapping) else None
    loss = fields.get("loss") if fields is not None else getattr(value, "loss", None)
    if isinstance(loss, fx.Node):
        output.args = (loss,)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm
    raise ModelError(
        f"the model's forward returned a {value.target.__name__ if made else type(value).__name__} with no "
        "'loss' in it; vlmcompile trains the "
        "loss the forward returns: return the loss tensor, or a dict or dataclass with the loss under 'loss'"
    )


def _check_numerics(model: nn.Module, gm: fx.GraphModule, batch: dict[str, Any]) -> str:
    if on_meta(model, batch):
        return "not checked (meta tensors hold no values)"
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)
        expected = loss_of(model(**batch))
        torch.manual_seed(0)
        specialized = gm.meta.get(SPECIALIZED_META, {})
        actual = gm(
            **{k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in specialized}
        )
    if not bool(torch.isfinite(expected).all()):
        shown = expected.item() if expected.numel() == 1 else "not finite"
        raise ModelError(
            f"the model's loss on the sample batch is {shown} in eager PyTorch, before any change by "
            "vlmcompile; fix the model or the batch (labels that are all -100 give 0/0, for one)"
        )
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError as err:
        raise CaptureError(
            f"the captured graph's output differs from eager on the sample batch: {err}. "
            "Report this model to the vlmcompile developers; meanwhile try the other capture path "
            "(method='export' or method='fx')."
        ) from None
    diff = (actual.detach().float() - expected.detach().float()).abs().max().item()
    return f"equal to eager on the sample batch (max abs diff {diff:.1e})"


def capture(
    model: nn.Module,
    sample_batch: Mapping[str, Any],
    *,
    region_overrides: Mapping[str, str | Region] | None = None,
    method: CaptureMethod | Literal["auto"] = "auto",
    check_numerics: bool = True,
    specialise_first: tuple[str, ...] = (),
) -> CaptureResult:
    """Capture ``model``'s forward on ``sample_batch`` and tag each node with layer and region.

    Args:
        model: the VLM; its forward returns the loss (a tensor or a ModelOutput with ``loss``).
        sample_batch: one batch, keyed by ``forward``'s argument names.
        region_overrides: module-path prefix -> region, taking precedence over detection.
        method: ``fx``, ``export``, or ``auto`` (export for transformers models, else fx first).
        check_numerics: run the captured graph and eager on the batch and compare (skipped on meta).
        specialise_first: for export, the batch inputs to specialise on first (those a capture of
            the model at another batch size needed), before the export without them.
    """
    if not isinstance(model, nn.Module):
        raise ModelError(f"model is a {type(model).__name__}; give a torch.nn.Module")
    if next(model.parameters(), None) is None:
        raise ModelError(
            f"{type(model).__name__} has no parameters, so there is nothing to train or partition; "
            "pass the model with its parameters registered (nn.Parameter attributes or submodules)"
        )
    batch = check_sample_batch(model, sample_batch)
    overrides = parse_overrides(region_overrides)
    check_override_paths(overrides, [p for p, _ in model.named_modules()])

    root = model
    if _is_transformers_model(model):
        root = LossOf(model, takes_use_cache(model))
    eager = root  # what the loss-split check runs: export may wrap root further
    assigner = LayerAssigner(model, overrides, families.region_keywords(model))

    graph = _first_that_captures(model, root, batch, assigner, method, specialise_first)
    gm, used, root, specialized = graph.gm, graph.method, graph.root, graph.specialized
    layers = _tag_layers(model, gm, root, assigner, overrides, used, specialized, batch)
    numerics = _check_numerics(model, gm, batch) if check_numerics else "not checked (check_numerics=False)"
    loss_split = _loss_split(eager, batch, specialized) if check_numerics else None
    gm.meta[LOSS_SPLIT_META] = loss_split = loss_split or LossSplitCheck(
        LossSplit.UNCHECKED, "check_numerics=False"
    )
    coupling = None
    if loss_split.verdict is LossSplit.BATCH_COUPLED:
        # Where the samples meet, and whether it is a contrastive loss the runtime can shard.
        gm.meta[COUPLING_META] = coupling = find_coupling(gm, batch)

    report = CaptureReport(
        model=type(model).__name__,
        method=used,
        fallbacks=graph.fallbacks,
        num_nodes=len(gm.graph.nodes),
        layers=layers,
        numerics=numerics,
        loss_split=loss_split,
        coupling=coupling,
        runtime_checks=graph.checks,
        specialized=specialized,
    )
    return CaptureResult(gm, report)


def _tag_layers(
    model: nn.Module,
    gm: fx.GraphModule,
    root: nn.Module,
    assigner: LayerAssigner,
    overrides: Mapping[str, Region] | None,
    method: str,
    specialized: Specialization | None,
    batch: Mapping[str, Any],
) -> tuple[LayerRegion, ...]:
    """Tag every node of ``gm`` with its layer and region and record the layer order and the
    options to capture the model again with (at another batch size: specialised first on what
    this capture needed) in ``gm.meta``; returns each layer's region."""
    strip = f"{WRAPPED}." if root is not model else ""
    regions = assign_layers(gm, assigner, strip_prefix=strip)
    layer_order = list(regions)
    layers = tuple(LayerRegion(layer, *found) for layer, found in regions.items())
    try:
        check_regions_detected(
            {lr.region for lr in layers},
            overridden=bool(overrides),
            top_level=[n for n, _ in model.named_children()],
        )
    except RegionError:
        _check_returns_a_loss(gm, root, batch)  # a forward without a loss is the mistake to name first
        raise
    gm.meta[LAYER_ORDER_META] = layer_order
    gm.meta[BLOCK_LAYERS_META] = frozenset(layer for layer in layer_order if layer in assigner.blocks)
    gm.meta[CAPTURE_OPTIONS_META] = {
        "region_overrides": overrides or None,
        "method": method,
        "specialise_first": specialized.keys if specialized else (),
    }
    gm.meta[WRAPPER_PREFIX_META] = strip
    return layers


def _check_returns_a_loss(gm: fx.GraphModule, root: nn.Module, batch: Mapping[str, Any]) -> None:
    """Raise :func:`check_loss`'s error where the forward returns no scalar loss: the output's
    value as export recorded it, else one eager forward (real tensors only; on meta nothing runs)."""
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    first = out.args[0]
    first = first[0] if isinstance(first, (tuple, list)) and first else first
    value = first.meta.get("val") if isinstance(first, fx.Node) else None
    if value is None and not on_meta(root, batch):
        with torch.no_grad():
            value = root(**batch)
    if value is not None:
        check_loss(value if isinstance(value, torch.Tensor) else loss_of(value))


def _what_to_try(model: nn.Module) -> str:
    """The way out of a failed capture: samples, for a model the packed path takes (captured once
    for any images), else what makes a forward capturable."""
    try:
        family = families.layout_of(model)
    except VlmCompileError:
        return DATA_DEPENDENT_HELP
    return (
        f"Give the samples as a list instead (compile(model, [sample, ...]), one dict each): {family.name} is then "
        "captured once for any images and lengths, packed"
    )


@dataclass(frozen=True, slots=True)
class _Captured:
    gm: fx.GraphModule
    method: CaptureMethod
    root: nn.Module
    """What was captured: the model, or a wrapper of it (transformers' models: its loss)."""
    checks: tuple[str, ...]
    specialized: Specialization | None
    fallbacks: tuple[Fallback, ...]


def _first_that_captures(
    model: nn.Module,
    root: nn.Module,
    batch: Mapping[str, Any],
    assigner: LayerAssigner,
    method: str,
    specialise_first: tuple[str, ...] = (),
) -> _Captured:
    """The graph of the first capture method that works (``auto``: fx, then export; export only
    for transformers models, as symbolic tracing fails on every transformers-5 VLM), with why the
    others failed; :class:`CaptureError` naming every failure when none does."""
    order = ["export"] if method == "auto" and _is_transformers_model(model) else ["fx", "export"]
    if method != "auto":
        order = [method]
    fallbacks: list[Fallback] = []
    last_err: BaseException | None = None
    for attempt in order:
        try:
            if attempt != "fx":
                gm, checks, wrapped, specialized = export_specialising(
                    model, root, batch, first=specialise_first
                )
                return _Captured(gm, attempt, wrapped, checks, specialized, tuple(fallbacks))  # type: ignore[arg-type]
            # The wrapper would hide the blocks' paths from the tracer: trace the bare model.
            if root is not model:
                raise CaptureError(
                    "fx tracing captures plain-tensor outputs only; the model returns a ModelOutput"
                )
            gm = _output_only_the_loss(_trace_fx(model, batch, assigner.blocks))
            return _Captured(gm, "fx", root, (), None, tuple(fallbacks))
        except (SampleBatchError, ModelError, CaptureError):
            raise
        except Exception as err:  # each path fails in its own exception types
            fallbacks.append(Fallback(attempt, describe_failure(err)))  # type: ignore[arg-type]
            last_err = err
    tried = "; ".join(f"{f.method}: {f.reason}" for f in fallbacks)
    raise CaptureError(
        f"could not capture {type(model).__name__}. {tried}. {_what_to_try(model)}"
    ) from last_err


def _loss_split(
    eager: nn.Module, batch: Mapping[str, Any], specialized: Specialization | None
) -> LossSplitCheck:
    """Whether the loss splits over microbatches, on the sample batch; a graph specialised on
    values that differ between the samples holds for the whole batch only (a microbatch's graph
    would be specialised on its own first samples' values)."""
    loss_split = check_loss_split(lambda b: loss_of(eager(**b)), batch)
    differ = differs_between_samples(batch, specialized.keys) if specialized else []
    if differ and loss_split.verdict is LossSplit.PER_SAMPLE:
        return LossSplitCheck(
            LossSplit.BATCH_COUPLED,
            f"the graph is specialised on {differ}, whose values differ between the samples of the batch, "
            "so it holds for the whole batch only",
        )
    return loss_split


def layer_nodes(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """The nodes of each layer, in graph order."""
    out: dict[str, list[fx.Node]] = {layer: [] for layer in gm.meta[LAYER_ORDER_META]}
    for n in gm.graph.nodes:
        if n.meta.get(LAYER_META):
            out[n.meta[LAYER_META]].append(n)
    return out
