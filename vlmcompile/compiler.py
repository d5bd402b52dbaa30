"""``vlmcompile.compile``: builds the pass list and runs it.

| #  | pass     | file               |
|----|----------|--------------------|
| 1  | capture  | passes/capture.py  |
| 2  | annotate | passes/annotate.py |

Planning passes (plan search, partition, schedule), the simulator and codegen join this list
as they land; each reads the state the earlier ones wrote.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import torch.fx as fx
from torch import nn

from vlmcompile.cluster import Cluster
from vlmcompile.layer_graph import LayerGraph
from vlmcompile.pass_runner import Pass, PassRunner, RunReport
from vlmcompile.passes.annotate import TensorMode, annotate
from vlmcompile.passes.capture import CaptureMethod, capture
from vlmcompile.regions import Region

if TYPE_CHECKING:
    from vlmcompile.planning import PlannedRun


@dataclass(kw_only=True, slots=True)
class CompileState:
    """What the passes read and write, in pass order."""

    model: nn.Module
    sample_batch: Mapping[str, Any]
    cluster: Any = None
    model_name: str | None = None
    gm: fx.GraphModule | None = None
    layer_graph: LayerGraph | None = None
    reports: dict[str, Any] = field(default_factory=dict)


def _capture_pass(state: CompileState, *, region_overrides, method) -> None:
    result = capture(state.model, state.sample_batch, region_overrides=region_overrides, method=method)
    state.gm = result.gm
    state.reports["capture"] = result.report


def _annotate_pass(state: CompileState, *, tensor_mode) -> None:
    result = annotate(
        state.gm,
        state.sample_batch,
        tensor_mode=tensor_mode,
        model_name=state.model_name or type(state.model).__name__,
    )
    state.layer_graph = result.layer_graph
    state.reports["annotate"] = result.report


@dataclass(frozen=True, slots=True)
class CompileReport:
    passes: dict[str, Any]
    run: RunReport

    def __str__(self) -> str:
        parts = [f"== {name} ==\n{report}" for name, report in self.passes.items()]
        return "\n\n".join([*parts, f"== passes ==\n{self.run}"])


@dataclass(frozen=True, slots=True)
class CompiledPipeline:
    """What ``compile`` returns: the captured graph, its LayerGraph and every pass's report."""

    gm: fx.GraphModule
    layer_graph: LayerGraph
    report: CompileReport
    cluster: Cluster | None = None

    def baseline(self, policy: str = "megatron", **options: Any) -> PlannedRun:
        """Plan with a baseline policy (``megatron`` or ``megatron_balanced``) on the pipeline's
        cluster and simulate it; ``options`` are the policy's (tp, pp, v, global_batch, ...)."""
        if self.cluster is None:
            raise ValueError(
                "compile(..., cluster=...) was given no cluster; pass one (e.g. 'h100x64') to plan"
            )
        from vlmcompile.planning import plan_and_simulate

        return plan_and_simulate(self.layer_graph, self.cluster, policy, **options)


def compile(
    model: nn.Module,
    sample_batch: Mapping[str, Any],
    cluster: Cluster | str | None = None,
    *,
    region_overrides: Mapping[str, str | Region] | None = None,
    capture_method: CaptureMethod | str = "auto",
    tensor_mode: TensorMode = "fake",
    disable_passes: Sequence[str] = (),
    model_name: str | None = None,
    log: TextIO | None = sys.stderr,
) -> CompiledPipeline:
    """Compile a VLM for training on ``cluster``.

    Args:
        model: the VLM (plain PyTorch or transformers); its forward returns the loss.
        sample_batch: one batch, keyed by ``model.forward``'s argument names (real or meta tensors).
        cluster: the cluster to plan for: a :class:`Cluster` or a preset name ("h100x64", "cpu:2").
        region_overrides: module-path prefix -> region ("vision", "projector", "llm", "text", "head").
        capture_method: "auto", "fx" or "export".
        tensor_mode: "fake" (any size, no memory) or "real" (CPU tensors) for the annotate pass.
        disable_passes: names of passes to skip.
        model_name: shown in reports (default: the model's class name).
        log: where the pass runner prints progress (None for silence).
    """
    if isinstance(cluster, str):
        cluster = Cluster.preset(cluster)
    passes = [
        Pass(
            "capture",
            functools.partial(_capture_pass, region_overrides=region_overrides, method=capture_method),
        ),
        Pass("annotate", functools.partial(_annotate_pass, tensor_mode=tensor_mode)),
    ]
    state = CompileState(model=model, sample_batch=sample_batch, cluster=cluster, model_name=model_name)
    run = PassRunner(passes, disabled=disable_passes, log=log).run(state)
    if state.gm is None or state.layer_graph is None:
        raise ValueError(
            f"passes {list(disable_passes)} were disabled, but capture and annotate are needed to build a "
            "pipeline; disable only optional passes"
        )
    return CompiledPipeline(
        gm=state.gm,
        layer_graph=state.layer_graph,
        report=CompileReport(dict(state.reports), run),
        cluster=cluster,
    )
