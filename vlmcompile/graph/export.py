"""torch.export for the capture pass: the loss wrapper, export of meta models on fake CPU
tensors, the runtime checks export inserts (kept, skipped by annotate), specialisation on the batch values that
decide shapes, and failures described by the line of the model that caused them."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import os
import re
import sys
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._pytree import tree_flatten

from vlmcompile.graph import export_memo
from vlmcompile.graph.fake import fake_factory, named_tensors, swapped_tensors
from vlmcompile.graph.specialize import KnownValues, value_input_tiers
from vlmcompile.ir.errors import CaptureError, ModelError, SampleBatchError
from vlmcompile.ir.meta_keys import RUNTIME_CHECK_META, SPECIALIZED_META

WRAPPED = "inner"
"""Attribute under which :class:`LossOf` holds the model (graph paths start ``inner.``)."""


def takes_use_cache(model: nn.Module) -> bool:
    """Whether to pass ``use_cache=False``: a training step keeps no KV cache. transformers 5
    VLMs take it through ``**kwargs`` (their forward does not name it), and without it a
    generative model builds a DynamicCache whose empty tensors end up in the graph."""
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        return True
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    can_generate = getattr(model, "can_generate", None)
    return takes_kwargs and callable(can_generate) and bool(can_generate())


class LossOf(nn.Module):
    """Returns only the loss of a model that returns a ModelOutput or a dict with 'loss'. The
    batch's Python values (``return_loss=True``, image sizes as a list) are passed as constants
    of the graph, and the tensors in ``fixed`` as known values (:mod:`vlmcompile.graph.specialize`)."""

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
            return loss_of(self.inner(**batch, **self.constants, **extra))
        with KnownValues(self.fixed):
            return loss_of(self.inner(**batch, **self.fixed, **self.constants, **extra))


def loss_of(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise SampleBatchError(
            f"the model returned a {type(out).__name__} with no loss in it for the sample batch; return the "
            "loss tensor (or a dict or ModelOutput with 'loss'), and include the labels (e.g. 'labels') when "
            "the model computes its loss from them"
        )
    return loss


def check_loss(loss: Any) -> Any:
    """``loss`` if it is a one-element floating tensor: a training step ends in it. (Capture and
    annotate take any output - a block on its own is captured too; ``compile`` trains.)"""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    got = (
        f"a {list(loss.shape)} {loss.dtype} tensor"
        if isinstance(loss, torch.Tensor)
        else f"a {type(loss).__name__}"
    )
    raise ModelError(
        f"the model's forward returned {got}, not a scalar loss; vlmcompile trains the loss the forward "
        "returns: pass labels (transformers models), or wrap the model in a module whose forward returns "
        "the loss (e.g. cross_entropy of its logits)"
    )


_RUNTIME_ASSERTS = ("aten._assert_scalar", "aten._assert_async", "aten._functional_assert_async")


def export_graph(
    model: nn.Module, batch: dict[str, Any], dynamic_shapes: Mapping[str, Any] | None = None
) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """Export, and mark the runtime assertions export inserts (:func:`mark_runtime_checks`);
    returns the graph and their messages. ``dynamic_shapes`` (by forward argument name) marks
    the dimensions the graph must hold for at any size.

    A model or batch on meta is exported on fake tensors that claim the CPU: a graph exported
    on meta would name the meta device in its constants (``arange(device=meta)``), and small
    CPU inputs whose values decide shapes could not meet meta tensors.

    Within one process a model of the same code, configuration and shapes may be exported once
    (:mod:`vlmcompile.graph.export_memo`, when asked for)."""
    return export_memo.exported(
        model, batch, dynamic_shapes, lambda: _export_graph(model, batch, dynamic_shapes), is_data_dependent
    )


def _export_graph(
    model: nn.Module, batch: dict[str, Any], dynamic_shapes: Mapping[str, Any] | None
) -> tuple[fx.GraphModule, tuple[str, ...]]:
    # On failure torch.export prints the whole partial graph to stderr; the CaptureError says
    # what matters, so keep stderr for a successful export only.
    buffer = io.StringIO()
    with contextlib.redirect_stderr(buffer), warnings.catch_warnings(), _no_stack_traces():
        # Qwen-VL caches its rope deltas on the module in forward, for generation; a training
        # step never reads them back.
        warnings.filterwarnings("ignore", message="The tensor attribute .* was assigned during export")
        meta = on_meta(model, batch)
        if meta:
            program = _export_on_fake_cpu(model, batch, dynamic_shapes)
        else:
            program = torch.export.export(model, (), batch, dynamic_shapes=dynamic_shapes, strict=False)
    sys.stderr.write(buffer.getvalue())
    gm = program.module(check_guards=False)
    if meta:
        _restore_meta_tensors(gm, model)
    drop_metadata_asserts(gm)
    return gm, mark_runtime_checks(gm)


def drop_metadata_asserts(gm: fx.GraphModule) -> int:
    """Erase the ``aten._assert_tensor_metadata`` checks export puts before each ``.to()``: they
    hold the dtype and device the trace saw (float32, cpu), which a stage run under bf16 autocast
    or on a GPU does not have ("Tensor dtype mismatch! Expected: Float, Got: BFloat16"). The
    ``.to()`` calls stay, so a run converts as eager does. Returns how many were erased."""
    asserts = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default
    ]
    for n in asserts:
        gm.graph.erase_node(n)
    if asserts:
        gm.recompile()
    return len(asserts)


@contextlib.contextmanager
def _no_stack_traces():
    """Export without the Python stack of every node (``node.meta["stack_trace"]``): nothing here
    reads it, and extracting and symbolising one per node was about a tenth of the test suite's
    export time (2026-11-29). A failure's message still names the model's line
    (:func:`model_frame`, read off the exception's own traceback)."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def _export_on_fake_cpu(
    model: nn.Module, batch: dict[str, Any], dynamic_shapes: Mapping[str, Any] | None
) -> torch.export.ExportedProgram:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    make = fake_factory(mode)
    fake_batch = {k: make(v) if is_meta(v) else v for k, v in batch.items()}
    with swapped_tensors(model, make), mode:
        return torch.export.export(model, (), fake_batch, dynamic_shapes=dynamic_shapes, strict=False)


def _restore_meta_tensors(gm: fx.GraphModule, model: nn.Module) -> None:
    """The exported module holds the fake stand-ins; put the model's own meta tensors back
    (by name), so nothing of a dead fake mode outlives the capture."""
    own = named_tensors(model)
    for name, t in named_tensors(gm).items():
        if name in own and own[name] is not t:
            owner, _, attr = name.rpartition(".")
            sub = gm.get_submodule(owner)
            table = sub._parameters if attr in sub._parameters else sub._buffers
            table[attr] = own[name]


def mark_runtime_checks(gm: fx.GraphModule) -> tuple[str, ...]:
    """Mark the runtime assertions export inserts, and what only they read (the ``.item()``
    calls and comparisons), with :data:`RUNTIME_CHECK_META`; return their messages.

    They stay in the graph: on a real batch they hold the model's own checks (LLaVA's "image
    features and image tokens do not match") and the assumptions export made, so a batch that
    breaks them fails instead of training wrong. Annotate skips them: fake tensors hold no
    values to check. (Nothing is erased: a dead-code elimination would also delete calls whose
    effect is not a value, the vmap set-up and tear-down of transformers' mask functions.)"""
    checks, frontier, marked = [], [], set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and str(n.target).startswith(_RUNTIME_ASSERTS):
            checks.append(str(n.args[1]) if len(n.args) > 1 else str(n.target))
            frontier += n.all_input_nodes
            marked.add(n)
    while frontier:
        n = frontier.pop()
        if n in marked or n.op != "call_function" or n.is_impure() or not set(n.users) <= marked:
            continue
        frontier += n.all_input_nodes
        marked.add(n)
    for n in marked:
        n.meta[RUNTIME_CHECK_META] = True
    return tuple(checks)


@dataclass(frozen=True, slots=True)
class Specialization:
    """Batch inputs whose values the graph is specialised on (:mod:`vlmcompile.graph.specialize`)."""

    keys: tuple[str, ...]
    because: str
    """The data-dependent operation that stopped the capture without specialising."""


def is_data_dependent(err: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    kinds = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
    while err is not None:
        if isinstance(err, kinds) or "data-dependent" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def export_specialising(
    model: nn.Module, root: nn.Module, batch: dict[str, Any], *, first: tuple[str, ...] = ()
) -> tuple[fx.GraphModule, tuple[str, ...], nn.Module, Specialization | None]:
    """Export ``root``; if a shape depends on tensor values, export again specialised on the
    fewest batch inputs that get it through. ``first``: the inputs a capture of the same model at
    another batch size was specialised on, tried before anything else (an export that fails
    costs as much as one that works). Returns the graph, its runtime checks, the module exported
    and the specialisation."""
    no_cache = root.no_cache if isinstance(root, LossOf) else takes_use_cache(model)
    # Python values are constants of the graph, not inputs: export would make an input of
    # every int in a list (``image_sizes_0_0``), which no batch key names.
    constants = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}
    for key, value in constants.items():
        if any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(value)[0]):
            raise SampleBatchError(
                f"batch[{key!r}] is a {type(value).__name__} holding tensors; capture takes tensors and plain "
                "Python values, and would fix these tensors in the graph. Give one tensor (stack or pad them)"
            )
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if constants:
        root = LossOf(model, no_cache, constants=constants)
    tiers = value_input_tiers(batch)
    if first and first in tiers and not _on_meta(batch, first):
        try:
            return _specialised(
                model, no_cache, batch, tensors, constants, first, "as its capture at another batch size was"
            )
        except Exception as err:
            if not is_data_dependent(err):
                raise
    try:
        return (*export_graph(root, tensors), root, None)
    except Exception as err:
        if not is_data_dependent(err):
            raise
        first_failure = err
    for keys in tiers:
        on_meta = _on_meta(batch, keys)
        if on_meta:
            raise CaptureError(
                f"{type(model).__name__}'s shapes depend on the values of batch inputs ({describe_failure(first_failure)}); "
                f"capture specialises on {list(keys)}, but {on_meta} are meta tensors, which hold no values. "
                "Give those inputs as CPU tensors (they are small: image sizes and grids, token types) and "
                "keep the rest on meta"
            ) from first_failure
        try:
            return _specialised(
                model, no_cache, batch, tensors, constants, keys, describe_failure(first_failure)
            )
        except Exception as err:
            if not is_data_dependent(err):
                raise
    raise first_failure


def _on_meta(batch: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    return [k for k in keys if batch[k].device.type == "meta"]


def _specialised(model, no_cache, batch, tensors, constants, keys, why: str):
    """The export of ``model`` with the values of ``keys`` fixed into the graph."""
    # Copies: the graph's constants must not share memory with the caller's batch.
    wrapped = LossOf(model, no_cache, fixed={k: batch[k].detach().clone() for k in keys}, constants=constants)
    gm, checks = export_graph(wrapped, {k: v for k, v in tensors.items() if k not in keys})
    gm.meta[SPECIALIZED_META] = dict(wrapped.fixed)
    return gm, checks, wrapped, Specialization(keys, why)


_LIBRARY_DIRS = tuple(
    os.path.dirname(path) + os.sep for path in (torch.__file__, contextlib.__file__, __file__)
) + tuple(
    os.path.join(d, "") for d in importlib.util.find_spec("vlmcompile.passes").submodule_search_locations
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


def describe_failure(err: BaseException) -> str:
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


DATA_DEPENDENT_HELP = (
    "The model's control flow or shapes depend on tensor values at that line. Capture already "
    "specialises on the batch's integer inputs other than input_ids and labels (image sizes and "
    "grids, token types), so this depends on the token ids or on computed values. Workarounds: "
    "compute such sizes from tensor shapes or from those integer inputs, replace the branch with "
    "torch.where / torch.cond, or add the torch._check hints torch suggests above."
)


def is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def on_meta(model: nn.Module, batch: Mapping[str, Any]) -> bool:
    return any(is_meta(t) for t in [*batch.values(), *model.parameters()])
