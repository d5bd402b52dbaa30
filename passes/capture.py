"""Capture pass: model + sample batch -> an ``fx.GraphModule`` of the training forward (with loss).

Two capture paths, as decided in DESIGN.md:

* ``fx``: ``torch.fx`` symbolic tracing with transformer blocks as leaf modules. Plain-PyTorch
  models (the zoo). The graph keeps the user's modules, so a 200B-parameter model is ~150 nodes.
* ``export``: ``torch.export(strict=False)``. transformers models (symbolic tracing fails on
  every transformers-5 VLM), and the fallback when ``fx`` tracing fails.

Both tag every node with its layer and region (:mod:`vlmcompile.layering`). A model that
returns a ModelOutput is captured up to its ``loss``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import sys
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
from tabulate import tabulate
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from vlmcompile.passes.loss_split import LossSplit, LossSplitCheck, check_loss_split

from vlmcompile.errors import CaptureError, ModelError, SampleBatchError
from vlmcompile.fake import fake_factory, swapped_tensors
from vlmcompile.layering import LayerAssigner, assign_layers, check_regions_detected
from vlmcompile.meta_keys import (
    BLOCK_LAYERS_META,
    LAYER_META,
    LAYER_ORDER_META,
    LOSS_SPLIT_META,
    SPECIALIZED_META,
)
from vlmcompile.regions import Region, check_override_paths, parse_overrides
from vlmcompile.specialize import KnownValues, value_input_tiers

CaptureMethod = Literal["fx", "export"]
_WRAPPED = "inner"  # attribute under which a ModelOutput-returning model is wrapped


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
    """Whether the loss of a batch is the weighted sum of its samples' (see passes/loss_split.py)."""
    dropped_checks: tuple[str, ...] = ()
    """Runtime assertions export inserted and capture removed (they held on the sample batch)."""
    specialized: Specialization | None = None
    """Batch inputs whose values the graph is fixed to, and why."""

    def __str__(self) -> str:
        lines = [
            f"capture: {self.model} via {self.method}, {self.num_nodes} nodes, {len(self.layers)} layers"
        ]
        lines += [f"  {f.method} failed first: {f.reason}" for f in self.fallbacks]
        lines.append(f"  numerics: {self.numerics}")
        lines.append(f"  loss over microbatches: {self.loss_split}")
        if self.specialized:
            lines.append(
                f"  specialised on the values of {list(self.specialized.keys)} (every batch must bring the "
                f"same values), because shapes depend on them: {self.specialized.because}"
            )
        if self.dropped_checks:
            lines.append(
                f"  dropped {len(self.dropped_checks)} runtime check(s) that held on the sample batch: "
                + "; ".join(self.dropped_checks)
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
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(sample_batch) - named)
    if unknown and not takes_kwargs:
        raise SampleBatchError(
            f"sample_batch has key(s) {unknown} that {type(model).__name__}.forward does not take; "
            f"its arguments are {sorted(named)}"
        )
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
    return dict(sample_batch)


def _is_transformers_model(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.")


def _takes_use_cache(model: nn.Module) -> bool:
    """Whether to pass ``use_cache=False``: a training step keeps no KV cache. transformers 5
    VLMs take it through ``**kwargs`` (their forward does not name it), and without it a
    generative model builds a DynamicCache whose empty tensors end up in the graph."""
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        return True
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    can_generate = getattr(model, "can_generate", None)
    return takes_kwargs and callable(can_generate) and bool(can_generate())


class _LossOf(nn.Module):
    """Returns only the loss of a model that returns a ModelOutput or a dict with 'loss'. The
    batch's Python values (``return_loss=True``, image sizes as a list) are passed as constants
    of the graph, and the tensors in ``fixed`` as known values (:mod:`vlmcompile.specialize`)."""

    def __init__(
        self,
        inner: nn.Module,
        no_cache: bool,
        fixed: Mapping[str, torch.Tensor] | None = None,
        constants: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        self.inner = inner
        self.no_cache = no_cache
        self.fixed = dict(fixed or {})  # a plain dict: not buffers, so not graph inputs
        self.constants = dict(constants or {})

    def forward(self, **batch):
        extra = {"use_cache": False} if self.no_cache else {}
        if not self.fixed:
            return _loss_of(self.inner(**batch, **self.constants, **extra))
        with KnownValues(self.fixed):
            return _loss_of(self.inner(**batch, **self.fixed, **self.constants, **extra))


def _loss_of(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise SampleBatchError(
            "the model returned no loss for the sample batch; include the labels (e.g. 'labels') "
            "so that the captured step ends in the training loss"
        )
    return loss


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
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


_RUNTIME_ASSERTS = ("aten._assert_scalar", "aten._assert_async", "aten._functional_assert_async")


def _export(model: nn.Module, batch: dict[str, Any]) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """Export, then drop the data-dependent runtime assertions export inserts (each reads a
    tensor value with .item(), which fake tensors cannot answer). They held on the sample
    batch, and a compiled pipeline runs at the sample's shapes; the report lists them.

    A model or batch on meta is exported on fake tensors that claim the CPU: a graph exported
    on meta would name the meta device in its constants (``arange(device=meta)``), and small
    CPU inputs whose values decide shapes could not meet meta tensors."""
    # On failure torch.export prints the whole partial graph to stderr; the CaptureError says
    # what matters, so keep stderr for a successful export only.
    buffer = io.StringIO()
    with contextlib.redirect_stderr(buffer), warnings.catch_warnings():
        # Qwen-VL caches its rope deltas on the module in forward, for generation; a training
        # step never reads them back.
        warnings.filterwarnings("ignore", message="The tensor attribute .* was assigned during export")
        if _on_meta(model, batch):
            program = _export_on_fake_cpu(model, batch)
        else:
            program = torch.export.export(model, (), batch, strict=False)
    sys.stderr.write(buffer.getvalue())
    gm = program.module(check_guards=False)
    if _on_meta(model, batch):
        _restore_meta_tensors(gm, model)
    return gm, _drop_runtime_asserts(gm)


def _export_on_fake_cpu(model: nn.Module, batch: dict[str, Any]) -> torch.export.ExportedProgram:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    make = fake_factory(mode)
    fake_batch = {k: make(v) if _is_meta(v) else v for k, v in batch.items()}
    with swapped_tensors(model, make), mode:
        return torch.export.export(model, (), fake_batch, strict=False)


def _restore_meta_tensors(gm: fx.GraphModule, model: nn.Module) -> None:
    """The exported module holds the fake stand-ins; put the model's own meta tensors back
    (by name), so nothing of a dead fake mode outlives the capture."""
    own = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers()]:
        if name in own and own[name] is not t:
            owner, _, attr = name.rpartition(".")
            sub = gm.get_submodule(owner)
            table = sub._parameters if attr in sub._parameters else sub._buffers
            table[attr] = own[name]


def _drop_runtime_asserts(gm: fx.GraphModule) -> tuple[str, ...]:
    """Erase the runtime assertions and what only they read (the ``.item()`` calls and
    comparisons). Not a general dead-code elimination: that would also delete calls whose
    effect is not a value, such as the vmap nesting set-up and tear-down of transformers'
    mask functions (Gemma3)."""
    dropped, frontier, erased = [], [], set()
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and str(n.target).startswith(_RUNTIME_ASSERTS):
            dropped.append(str(n.args[1]) if len(n.args) > 1 else str(n.target))
            frontier += n.all_input_nodes
            gm.graph.erase_node(n)
            erased.add(n)
    while frontier:
        n = frontier.pop()
        if n in erased or n.users or n.op != "call_function" or n.is_impure():
            continue
        frontier += n.all_input_nodes
        gm.graph.erase_node(n)
        erased.add(n)
    if dropped:
        gm.recompile()
    return tuple(dropped)


@dataclass(frozen=True, slots=True)
class Specialization:
    """Batch inputs whose values the graph is specialised on (:mod:`vlmcompile.specialize`)."""

    keys: tuple[str, ...]
    because: str
    """The data-dependent operation that stopped the capture without specialising."""


def _is_data_dependent(err: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    kinds = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
    while err is not None:
        if isinstance(err, kinds) or "data-dependent" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _export_specialising(
    model: nn.Module, root: nn.Module, batch: dict[str, Any]
) -> tuple[fx.GraphModule, tuple[str, ...], nn.Module, Specialization | None]:
    """Export ``root``; if a shape depends on tensor values, export again specialised on the
    fewest batch inputs that get it through. Returns the graph, the dropped checks, the module
    exported and the specialisation."""
    no_cache = root.no_cache if isinstance(root, _LossOf) else _takes_use_cache(model)
    # Python values are constants of the graph, not inputs: export would make an input of
    # every int in a list (``image_sizes_0_0``), which no batch key names.
    constants = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if constants:
        root = _LossOf(model, no_cache, constants=constants)
    try:
        return (*_export(root, tensors), root, None)
    except Exception as err:
        if not _is_data_dependent(err):
            raise
        first = err
    for keys in value_input_tiers(batch):
        on_meta = [k for k in keys if batch[k].device.type == "meta"]
        if on_meta:
            raise CaptureError(
                f"{type(model).__name__}'s shapes depend on the values of batch inputs ({_describe_failure(first)}); "
                f"capture specialises on {list(keys)}, but {on_meta} are meta tensors, which hold no values. "
                "Give those inputs as CPU tensors (they are small: image sizes and grids, token types) and "
                "keep the rest on meta"
            ) from first
        wrapped = _LossOf(model, no_cache, fixed={k: batch[k] for k in keys}, constants=constants)
        try:
            gm, dropped = _export(wrapped, {k: v for k, v in tensors.items() if k not in keys})
        except Exception as err:
            if not _is_data_dependent(err):
                raise
            continue
        gm.meta[SPECIALIZED_META] = {k: batch[k].detach().clone() for k in keys}
        return gm, dropped, wrapped, Specialization(keys, _describe_failure(first))
    raise first


_LIBRARY_DIRS = tuple(
    os.path.dirname(path) + os.sep
    for path in (torch.__file__, contextlib.__file__, __file__, inspect.getfile(Region))
)
"""torch, the standard library and vlmcompile: frames there are not the model's."""


def model_frame(err: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the model's own code (the user's file, or transformers') in the
    traceback of ``err`` or of the exceptions it was raised from."""
    chain, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    for e in reversed(chain):  # the root cause first: its frames are the deepest
        frames = [
            f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(_LIBRARY_DIRS)
        ]
        if frames:
            return frames[-1]
    return None


def _describe_failure(err: BaseException) -> str:
    """One paragraph naming the operation that failed, the line of the model that made it, and
    torch's suggested fix, if any."""
    text = str(err)
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    fix = re.search(
        r"To fix the error, insert one of the following checks before this call:\n(.*?)\n\n", text, re.S
    )
    parts = [f"{type(err).__name__}: {first[:300]}"]
    frame = model_frame(err)
    where = re.search(r"The following call raised this error:\n\s*(File .*?)\n\s*(.+?)\n", text)
    if frame is not None:
        parts.append(
            f'at File "{frame.filename}", line {frame.lineno}, in {frame.name}: `{(frame.line or "").strip()}`'
        )
    elif where:
        parts.append(f"at {where.group(1).strip()}: `{where.group(2).strip()}`")
    if fix:
        parts.append("torch suggests: " + " or ".join(line.strip() for line in fix.group(1).splitlines()))
    return "; ".join(parts)


_DATA_DEPENDENT_HELP = (
    "The model's control flow or shapes depend on tensor values at that line. Capture already "
    "specialises on the batch's integer inputs other than input_ids and labels (image sizes and "
    "grids, token types), so this depends on the token ids or on computed values. Workarounds: "
    "compute such sizes from tensor shapes or from those integer inputs, replace the branch with "
    "torch.where / torch.cond, or add the torch._check hints torch suggests above."
)


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def _on_meta(model: nn.Module, batch: Mapping[str, Any]) -> bool:
    return any(_is_meta(t) for t in [*batch.values(), *model.parameters()])


def _check_numerics(model: nn.Module, gm: fx.GraphModule, batch: dict[str, Any]) -> str:
    if _on_meta(model, batch):
        return "not checked (meta tensors hold no values)"
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)
        expected = _loss_of(model(**batch))
        torch.manual_seed(0)
        specialized = gm.meta.get(SPECIALIZED_META, {})
        actual = gm(
            **{k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in specialized}
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
) -> CaptureResult:
    """Capture ``model``'s forward on ``sample_batch`` and tag each node with layer and region.

    Args:
        model: the VLM; its forward returns the loss (a tensor or a ModelOutput with ``loss``).
        sample_batch: one batch, keyed by ``forward``'s argument names.
        region_overrides: module-path prefix -> region, taking precedence over detection.
        method: ``fx``, ``export``, or ``auto`` (export for transformers models, else fx first).
        check_numerics: run the captured graph and eager on the batch and compare (skipped on meta).
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
        root = _LossOf(model, _takes_use_cache(model))
    assigner = LayerAssigner(model, overrides)

    # Symbolic tracing fails on every transformers-5 VLM (DESIGN.md): export only, for those.
    order = ["export"] if method == "auto" and _is_transformers_model(model) else ["fx", "export"]
    if method != "auto":
        order = [method]
    fallbacks: list[Fallback] = []
    gm = None
    dropped: tuple[str, ...] = ()
    specialized: Specialization | None = None
    last_err: BaseException | None = None
    for attempt in order:
        try:
            if attempt == "fx":
                # The wrapper would hide the blocks' paths from the tracer: trace the bare model.
                if root is not model:
                    raise CaptureError(
                        "fx tracing captures plain-tensor outputs only; the model returns a ModelOutput"
                    )
                gm = _trace_fx(model, batch, assigner.blocks)
            else:
                gm, dropped, root, specialized = _export_specialising(model, root, batch)
            used: CaptureMethod = attempt  # type: ignore[assignment]
            break
        except (SampleBatchError, ModelError, CaptureError):
            raise
        except Exception as err:  # each path fails in its own exception types
            fallbacks.append(Fallback(attempt, _describe_failure(err)))  # type: ignore[arg-type]
            last_err = err
    if gm is None:
        tried = "; ".join(f"{f.method}: {f.reason}" for f in fallbacks)
        raise CaptureError(
            f"could not capture {type(model).__name__}. {tried}. {_DATA_DEPENDENT_HELP}"
        ) from last_err
    strip = f"{_WRAPPED}." if root is not model else ""

    regions = assign_layers(gm, assigner, strip_prefix=strip)
    layer_order = list(regions)
    layers = tuple(LayerRegion(layer, *found) for layer, found in regions.items())
    check_regions_detected(
        {lr.region for lr in layers},
        overridden=bool(overrides),
        top_level=[n for n, _ in model.named_children()],
    )
    gm.meta[LAYER_ORDER_META] = layer_order
    gm.meta[BLOCK_LAYERS_META] = frozenset(layer for layer in layer_order if layer in assigner.blocks)
    numerics = _check_numerics(model, gm, batch) if check_numerics else "not checked (check_numerics=False)"
    if check_numerics:
        eager = _LossOf(model, _takes_use_cache(model)) if _is_transformers_model(model) else model
        loss_split = check_loss_split(lambda b: _loss_of(eager(**b)), batch)
    else:
        loss_split = LossSplitCheck(LossSplit.UNCHECKED, "check_numerics=False")
    gm.meta[LOSS_SPLIT_META] = loss_split

    report = CaptureReport(
        model=type(model).__name__,
        method=used,
        fallbacks=tuple(fallbacks),
        num_nodes=len(gm.graph.nodes),
        layers=layers,
        numerics=numerics,
        loss_split=loss_split,
        dropped_checks=dropped,
        specialized=specialized,
    )
    return CaptureResult(gm, report)


def layer_nodes(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """The nodes of each layer, in graph order."""
    out: dict[str, list[fx.Node]] = {layer: [] for layer in gm.meta[LAYER_ORDER_META]}
    for n in gm.graph.nodes:
        if n.meta.get(LAYER_META):
            out[n.meta[LAYER_META]].append(n)
    return out
