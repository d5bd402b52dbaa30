"""Capture pass, for training data whose samples differ: one capture for every packed microbatch.

``compile(model, samples, ...)`` with a list of per-sample dicts (what a transformers processor
returns for one example each) lands here instead of :func:`capture.capture`. The samples are
packed into microbatches of ``tokens`` LLM tokens (:mod:`vlmcompile.data.packing`); the model is
wrapped in :class:`~vlmcompile.data.packed_step.PackedStep` and exported once, at the microbatch
with the most image rows, with the vision sizes dynamic. The graph is then run on every packed
microbatch of the samples and their losses must add up to the model's own loss on the samples
right-padded in one batch: the one capture is checked against eager on every layout the user's
samples hold, not one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from vlmcompile import families
from vlmcompile.data.distribution import Spread
from vlmcompile.data.families import Family
from vlmcompile.data.packed_step import PackedStep, capturable, dynamic_shapes, export_example, step_inputs
from vlmcompile.data.packing import Packing, check_samples, fewest_rows, pack, padded_batch, sample_length
from vlmcompile.graph.export import WRAPPED, export_graph, loss_of, on_meta
from vlmcompile.graph.layering import LayerAssigner
from vlmcompile.graph.loss_split import LossSplit, LossSplitCheck
from vlmcompile.ir.errors import CaptureError, DataError, ModelError
from vlmcompile.ir.meta_keys import LOSS_SPLIT_META, PACKED_META
from vlmcompile.ir.packed import PackedLayout, VaryingDim
from vlmcompile.ir.regions import Region, check_override_paths, parse_overrides
from vlmcompile.ir.shape_plan import InputSizes, ShapeFormula
from vlmcompile.passes.graph.capture import CaptureReport, _tag_layers


@dataclass(frozen=True, slots=True)
class PackedCaptureResult:
    gm: fx.GraphModule
    report: CaptureReport
    example: dict[str, torch.Tensor]
    """The microbatch the graph was exported at (annotate measures it)."""
    family: Family
    packing: Packing
    """The samples given, packed one microbatch a row."""


def default_tokens(samples: Sequence[Mapping[str, Any]], family: Family) -> int:
    """A row budget when none is given: the longest sample, rounded up to a multiple of 16."""
    longest = max(sample_length(s, family, i) for i, s in enumerate(samples))
    return -(-longest // 16) * 16


def capture_packed(
    model: nn.Module,
    samples: Sequence[Mapping[str, Any]],
    *,
    tokens: int | None = None,
    region_overrides: Mapping[str, str | Region] | None = None,
    check_numerics: bool = True,
) -> PackedCaptureResult:
    """Capture ``model`` once for packed microbatches of ``tokens`` LLM tokens (default:
    :func:`default_tokens`) and check the graph against eager on every microbatch of ``samples``."""
    samples = check_samples(samples)
    family = families.layout_of(model)
    overrides = parse_overrides(region_overrides)
    check_override_paths(overrides, [p for p, _ in model.named_modules()])
    tokens = tokens or default_tokens(samples, family)
    lengths = [sample_length(s, family, i) for i, s in enumerate(samples)]
    packing = pack(samples, family, tokens=tokens, num_microbatches=fewest_rows(lengths, tokens))
    inputs = [step_inputs(mb, family, packing.label_tokens) for mb in packing.microbatches if mb.tokens]
    example = export_example(
        max(inputs, key=lambda b: (b["pixel_values"].shape[0], b["image_token_index"].numel())), family
    )
    root = PackedStep(model, family, families.spec_of(model).image_features)
    dynamic = dynamic_shapes(example, family)
    try:
        with capturable(model, family):
            gm, checks = export_graph(root, example, dynamic)
    except (DataError, ModelError):
        raise
    except Exception as err:
        raise CaptureError(
            f"could not capture {type(model).__name__} once for packed microbatches with varying images: "
            f"{type(err).__name__}: {str(err).strip().splitlines()[0][:400]}"
        ) from err
    assert WRAPPED == "inner"  # PackedStep holds the model where LossOf does
    layers = _tag_layers(
        model,
        gm,
        root,
        LayerAssigner(model, overrides, families.region_keywords(model)),
        overrides,
        "export",
        None,
        example,
    )
    gm.meta[PACKED_META] = _layout(gm, family, tokens, dynamic)
    if on_meta(model, example):
        numerics = "not checked (meta tensors hold no values)"
    elif check_numerics:
        numerics = _check_packed_numerics(model, gm, root, samples, family, inputs)
    else:
        numerics = None
    gm.meta[LOSS_SPLIT_META] = loss_split = LossSplitCheck(
        LossSplit.PER_SAMPLE,
        "packed microbatches: each one's loss is its sum over the step's label tokens (num_items_in_batch)",
    )
    report = CaptureReport(
        model=type(model).__name__,
        method="export",
        fallbacks=(),
        num_nodes=len(gm.graph.nodes),
        layers=layers,
        numerics=numerics or "not checked (check_numerics=False)",
        loss_split=loss_split,
        runtime_checks=checks,
        packed=f"captured once: {gm.meta[PACKED_META].describe()}\n  {distribution(packing)}",
    )
    return PackedCaptureResult(gm, report, example, family, packing)


def distribution(packing: Packing) -> str:
    """The microbatches the samples packed into: LLM tokens, images and image rows (tiles or
    patches) per microbatch, mean / p95 / max, and the padding share."""
    used = [mb for mb in packing.microbatches if mb.tokens]

    images = [
        int(mb.inputs["image_grid_thw"].shape[0]) if "image_grid_thw" in mb.inputs else 0 for mb in used
    ]
    columns = [
        ("LLM tokens", [mb.tokens for mb in used]),
        ("image rows", [mb.vision_rows for mb in used]),
    ]
    if any(images):
        columns.append(("images", images))
    shown = "; ".join(f"{name} {Spread.of(values)}" for name, values in columns)
    return (
        f"the samples given packed into {len(used)} microbatches (mean / p95 / max a microbatch): {shown}; "
        f"padding {packing.pad_share:.0%} of the LLM tokens"
    )


def _layout(gm: fx.GraphModule, family: Family, tokens: int, dynamic: Mapping[str, Any]) -> PackedLayout:
    varying = []
    for key, dims in dynamic.items():
        for dim, spec in (dims or {}).items():
            name = getattr(spec, "__name__", str(spec))
            low, high = getattr(spec, "min", 0), getattr(spec, "max", None)
            varying.append(VaryingDim(key, dim, name, int(low), int(high) if high is not None else -1))
    sizes = InputSizes(
        {str(n.target): ShapeFormula.of(n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder"}
    )
    return PackedLayout(family.name, tokens, tuple(varying), sizes)


def _check_packed_numerics(
    model: nn.Module,
    gm: fx.GraphModule,
    root: nn.Module,
    samples: Sequence[Mapping[str, Any]],
    family: Family,
    inputs: Sequence[Mapping[str, torch.Tensor]],
) -> str:
    """The captured graph on every packed microbatch adds up to the model's loss on the samples
    right-padded in one batch (and each microbatch's equals the wrapper's in eager)."""
    with torch.no_grad():
        expected = loss_of(model(**padded_batch(samples, family)))
        total = torch.zeros((), dtype=torch.float64)
        for i, batch in enumerate(inputs):
            got, eager = gm(**batch), root(**batch)
            try:
                torch.testing.assert_close(got, eager)
            except AssertionError as err:
                raise CaptureError(
                    f"the captured graph differs from eager on packed microbatch {i}: {err}"
                ) from None
            total += got.double()
    if not bool(torch.isfinite(expected)):
        raise ModelError(
            f"the model's loss on the samples is {expected.item()} in eager PyTorch; fix the data"
        )
    try:
        torch.testing.assert_close(total.float(), expected.float())
    except AssertionError as err:
        raise CaptureError(
            f"the packed microbatches' losses do not add up to the padded batch's: {err}. Report this model"
        ) from None
    vision = [b["pixel_values"].shape[0] for b in inputs]
    return (
        f"equal to eager on {len(samples)} samples right-padded in one batch, through {len(inputs)} packed "
        f"microbatches of one capture ({min(vision)}..{max(vision)} image rows; max abs diff "
        f"{abs(total.item() - expected.item()):.1e})"
    )
