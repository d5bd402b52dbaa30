"""Codegen for a contrastive loss: the captured graph cut into two tower modules and the module of
the loss's trainable scalars, for :class:`vlmcompile.runtime.contrastive.ContrastiveStep`.

The cut is capture's (:mod:`vlmcompile.graph.contrastive`). A tower module is every node its
embedding depends on, reading batch inputs only. A graph that export captured is fixed to its
batch size, so a microbatch of another size gets the model captured again at that size (from
the sample batch's samples, repeated where it has fewer); its embedding node is found by name.
Every tower, at every microbatch size up to the sample batch's, is run on the sample batch's first
samples alone and must give their rows of the whole batch's embeddings: a tower that mixes
samples in a way capture's perturbation did not show (a max over the batch) is refused here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from vlmcompile.graph.contrastive import CouplingCut, record_values
from vlmcompile.graph.subgraph import ancestors, extract
from vlmcompile.ir.contrastive_loss import ContrastiveLoss
from vlmcompile.ir.contrastive_plan import ContrastivePlan, MemoryPolicy
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.meta_keys import CAPTURE_OPTIONS_META, COUPLING_META, WRAPPER_PREFIX_META
from vlmcompile.ir.microbatch import num_samples, rows_per_sample, take
from vlmcompile.passes.graph.capture import capture
from vlmcompile.runtime.contrastive import ContrastiveStep, Tower, share_parameters
from vlmcompile.runtime.stage import LayerModule


@dataclass(frozen=True, slots=True)
class TowerCodegenReport:
    loss: ContrastiveLoss
    sizes: tuple[int, ...]
    recaptured: tuple[int, ...]
    """Microbatch sizes the model was captured again for (export graphs are fixed to a size)."""
    params: tuple[int, int, int]
    """Parameters of tower a, tower b and the loss's scalars."""

    def __str__(self) -> str:
        again = f"; captured again for microbatches of {list(self.recaptured)}" if self.recaptured else ""
        return (
            f"codegen (contrastive): towers of {self.params[0]:,} and {self.params[1]:,} parameters, "
            f"loss scalars of {self.params[2]:,}; {self.loss.kind} loss on the whole batch; microbatches of "
            f"{list(self.sizes)} samples{again}"
        )


def coupled_loss_of(gm: fx.GraphModule) -> ContrastiveLoss:
    """The contrastive loss capture found in ``gm``.

    Raises:
        PlanError: capture found none (the message says why).
    """
    cut: CouplingCut | None = gm.meta.get(COUPLING_META)
    if cut is None:
        raise PlanError(
            "the captured graph has no coupled loss (its loss splits over microbatches, or capture ran "
            "without numerics): plan it as a pipeline"
        )
    if cut.loss is None:
        raise PlanError(f"the model's coupled loss cannot be microbatched: {cut.refusal}")
    return cut.loss


def codegen_towers(
    gm: fx.GraphModule,
    plan: ContrastivePlan,
    *,
    model: nn.Module,
    sample_batch: Mapping[str, Any],
    timeout_s: float = 60.0,
) -> tuple[ContrastiveStep, TowerCodegenReport]:
    """The step of ``plan`` for the model captured in ``gm`` (see the module docstring)."""
    loss = coupled_loss_of(gm)
    if loss != plan.loss:
        raise PlanError(f"the plan is for the loss {plan.loss.detail!r}; this graph's is {loss.detail!r}")
    _check_runnable(plan)
    sizes = sorted(plan.placement(0).split.sizes | plan.placement(1).split.sizes)
    prefix = gm.meta.get(WRAPPER_PREFIX_META, "")
    exported = gm.meta.get(CAPTURE_OPTIONS_META, {}).get("method") == "export"
    samples = num_samples(sample_batch)
    reference = record_values(gm, sample_batch)
    by_name = {n.name: n for n in gm.graph.nodes}
    towers, recaptured = {}, []
    for size in sizes:
        graph = gm
        if exported and size != samples:
            graph = _capture_at(gm, model, sample_batch, size)
            recaptured.append(size)
        pair = tuple(_tower(graph, name) for name in loss.embeddings)
        if size <= samples or graph is not gm:
            _check_like(
                pair, _repeated(sample_batch, size), [reference[by_name[n]] for n in loss.embeddings], size
            )
        towers[size] = pair
    scalars = _scalars_module(gm, loss)
    modules = [t.module for pair in towers.values() for t in pair] + (
        [scalars] if scalars is not None else []
    )
    share_parameters(modules, prefix)
    rows = rows_per_sample(sample_batch)
    layout = {k: (tuple(v.shape[1:]), v.dtype) if rows[k] else v for k, v in sample_batch.items()}
    step = ContrastiveStep(towers, scalars, plan, timeout_s=timeout_s, prefix=prefix, sample_layout=layout)
    first = towers[min(towers)]
    report = TowerCodegenReport(
        loss,
        tuple(sizes),
        tuple(recaptured),
        (_numel(first[0].module), _numel(first[1].module), _numel(scalars) if scalars is not None else 0),
    )
    return step, report


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _tower(gm: fx.GraphModule, embedding: str) -> Tower:
    node = next((n for n in gm.graph.nodes if n.name == embedding), None)
    if node is None:
        raise PlanError(
            f"the graph captured again has no node {embedding!r}; microbatch with the sample batch's size"
        )
    needed = ancestors([node])
    nodes = [n for n in gm.graph.nodes if n in needed and n.op != "placeholder"]
    module, inputs = extract(gm, nodes, [node], module_class=LayerModule, class_name=f"Tower_{embedding}")
    return Tower(module, tuple(str(p.target) for p in inputs))


def _scalars_module(gm: fx.GraphModule, loss: ContrastiveLoss) -> fx.GraphModule | None:
    if not loss.scalars:
        return None
    outputs = [n for name in loss.scalars for n in gm.graph.nodes if n.name == name]
    needed = ancestors(outputs)
    if any(n.op == "placeholder" for n in needed):
        raise PlanError(
            f"the loss's scalars {list(loss.scalars)} read batch inputs; they must come from parameters alone"
        )
    nodes = [n for n in gm.graph.nodes if n in needed]
    module, _ = extract(gm, nodes, outputs, module_class=LayerModule, class_name="LossScalars")
    return module


def _repeated(batch: Mapping[str, Any], size: int) -> dict[str, Any]:
    """The batch's first ``size`` samples, its samples repeated in order where it has fewer."""
    rows = rows_per_sample(batch)
    samples = num_samples(batch)
    reps = -(-size // samples)
    tiled = {k: torch.cat([v] * reps) if rows[k] else v for k, v in batch.items()}
    return take(tiled, 0, size, rows)


def _capture_at(
    gm: fx.GraphModule, model: nn.Module, sample_batch: Mapping[str, Any], size: int
) -> fx.GraphModule:
    options = dict(gm.meta.get(CAPTURE_OPTIONS_META, {}))
    return capture(model, _repeated(sample_batch, size), check_numerics=False, **options).gm


def _check_like(pair, batch: Mapping[str, Any], reference: list[torch.Tensor], size: int) -> None:
    """The towers of this microbatch size give the whole sample batch's embeddings on its first
    samples alone: a tower that mixes samples (a batch statistic the capture's perturbation did
    not show, a max over the batch) or a graph captured again that differs is refused."""
    samples = reference[0].shape[0]
    for tower, want in zip(pair, reference):
        with torch.no_grad():
            got = tower.module(*[batch[k] for k in tower.batch_inputs])[0]
        expected = torch.cat([want] * -(-size // samples))[:size]
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
            raise PlanError(
                f"{tower.module.__class__.__name__} on the first {size} samples alone differs from their rows "
                f"of the whole sample batch (largest difference {float((got - expected).abs().max()) if got.shape == expected.shape else 'shape'}): "
                "the tower mixes the samples of a batch, or its graph captured again for this size differs; "
                "train it in one microbatch on one rank (cluster='cpu:1', SearchSpace(tower_microbatches=1))"
            )


def _check_runnable(plan: ContrastivePlan) -> None:
    """Refuse what the plan asks for and the contrastive runtime does not run."""
    for degree, field in (("tp", "tower_tensor_parallel"), ("pp", "tower_pipeline_parallel")):
        wide = max(getattr(plan.placement(t), degree) for t in (0, 1))
        if wide > 1:
            raise PlanError(
                f"the plan runs a tower at {degree} {wide}; the contrastive runtime runs {degree} 1 (data "
                f"parallelism and microbatches): plan with SearchSpace({field}=(1,)) or give the towers "
                "more devices"
            )
    policies = {plan.memory_of(t) for t in (0, 1)}
    if MemoryPolicy.CHECKPOINT in policies:
        raise PlanError(
            "the plan checkpoints every layer (a baseline's rule); the contrastive runtime keeps or recomputes "
            "whole tower forwards: plan with memory 'keep' or 'recompute'"
        )
