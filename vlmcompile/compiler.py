"""``vlmcompile.compile``: builds the pass list and runs it.

| #  | pass     | file               |
|----|----------|--------------------|
| 1  | capture  | passes/capture.py  |
| 2  | annotate | passes/annotate.py |
| (3) | profile | passes/profile.py (``profile=True``: measured layer times for the plan) |
| 3  | plan     | passes/plan_search.py, passes/partition.py (through ``planning.search_and_compare``) |

The plan pass runs when a cluster is given: the plan search picks the degrees, the partition
pass the cuts and recompute, and every baseline is planned at the chosen degrees for the
report. The schedule pass and codegen join this list as they land.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import torch
import torch.fx as fx
from torch import nn

from vlmcompile.cluster import Cluster
from vlmcompile.export import check_loss
from vlmcompile.layer_graph import LayerGraph
from vlmcompile.meta_keys import LOSS_SPLIT_META, OUTPUT_META
from vlmcompile.pass_runner import Pass, PassRunner, RunReport
from vlmcompile.passes.annotate import TensorMode, annotate
from vlmcompile.passes.capture import CaptureMethod, capture
from vlmcompile.passes.loss_split import LossSplit
from vlmcompile.plan import Decision, Reason
from vlmcompile.regions import Region

if TYPE_CHECKING:
    from vlmcompile.plan import Plan
    from vlmcompile.planning import PlannedRun
    from vlmcompile.runtime import PipelineRunner


@dataclass(kw_only=True, slots=True)
class CompileState:
    """What the passes read and write, in pass order."""

    model: nn.Module
    sample_batch: Mapping[str, Any]
    cluster: Any = None
    model_name: str | None = None
    global_batch: int | None = None
    gm: fx.GraphModule | None = None
    layer_graph: LayerGraph | None = None
    planned: Any = None
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
    # A model whose forward returns logits would plan, then fail on a rank: refuse it here.
    check_loss(state.gm.meta.pop(OUTPUT_META, None))


def _profile_pass(state: CompileState, *, repeats: int) -> None:
    from vlmcompile.passes.profile import profile

    tensors = [v for v in state.sample_batch.values() if isinstance(v, torch.Tensor)]
    if any(t.device.type == "meta" for t in [*tensors, *state.model.parameters()]):
        state.reports["profile"] = (
            "skipped: the model or the sample batch is on meta tensors (nothing to time)"
        )
        return
    device = state.cluster.device.name if state.cluster is not None else "cpu"
    ranks_here = state.cluster.num_gpus if state.cluster is not None and device == "cpu" else 1
    # One row: the plan search scales per-sample times to its microbatch sizes.
    microbatch = {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in state.sample_batch.items()}
    result = profile(
        state.gm,
        state.layer_graph,
        microbatch,
        device_name=device,
        threads=max(1, (os.cpu_count() or 1) // ranks_here),
        repeats=repeats,
    )
    state.layer_graph = result.layer_graph
    state.reports["profile"] = result.report


def _plan_pass(
    state: CompileState, *, time_limit_s: float, progress: bool, options: Mapping[str, Any]
) -> None:
    if state.cluster is None:
        state.reports["plan"] = "no cluster given: nothing planned (pass cluster=... to plan)"
        return
    from vlmcompile.planning import search_and_compare

    # The runtime has no tensor parallelism yet, so plans meant to run on local CPU ranks keep TP = 1.
    tp_choices = (1,) if state.cluster.name.startswith("cpu") else None
    global_batch = state.global_batch or int(state.layer_graph.meta.get("batch_size", 1))
    options = dict(options)
    check = state.gm.meta.get(LOSS_SPLIT_META)
    coupled = check is not None and check.verdict is LossSplit.BATCH_COUPLED
    if coupled:
        # A loss that couples the samples trains right only on the whole batch at once.
        options.update(microbatch_sizes=(global_batch,), dp_choices=(1,))
    run, search = search_and_compare(
        state.layer_graph,
        state.cluster,
        global_batch=global_batch,
        tp_choices=tp_choices,
        time_limit_s=time_limit_s,
        progress=progress,
        **options,
    )
    if coupled:
        decision = Decision(
            "microbatches",
            Reason.LOSS_COUPLED,
            f"the loss couples the samples of a batch ({check.detail}): "
            f"one microbatch of {global_batch}, DP = 1",
        )
        plan = dataclasses.replace(run.plan, decisions=(*run.plan.decisions, decision))
        run = dataclasses.replace(run, plan=plan)
    state.planned = run
    state.reports["plan"] = f"{search}\n\n{run}"


@dataclass(frozen=True, slots=True)
class CompileReport:
    passes: dict[str, Any]
    run: RunReport

    def __str__(self) -> str:
        parts = [f"== {name} ==\n{report}" for name, report in self.passes.items()]
        return "\n\n".join([*parts, f"== passes ==\n{self.run}"])


@dataclass(frozen=True, slots=True)
class CompiledPipeline:
    """What ``compile`` returns: the captured graph, its LayerGraph and every pass's report;
    ``step``/``launch``/``runner`` run a plan on torch.distributed."""

    gm: fx.GraphModule
    layer_graph: LayerGraph
    report: CompileReport
    cluster: Cluster | None = None
    planned: PlannedRun | None = None
    """The plan chosen by the plan search and partition passes, simulated, with every baseline
    at the same degrees (None without a cluster)."""
    model: nn.Module | None = None
    sample_batch: Mapping[str, Any] = field(default_factory=dict)
    _runners: dict = field(default_factory=dict, repr=False)

    @property
    def plan(self) -> Plan | None:
        return self.planned.plan if self.planned else None

    def runner(self, plan: Plan | None = None, *, timeout_s: float = 60.0) -> PipelineRunner:
        """This pipeline's stage modules for ``plan`` (default: ``self.plan``), ready to run on
        every rank (see :mod:`vlmcompile.runtime`)."""
        from vlmcompile.runtime import make_runner

        plan = plan or self.plan
        if plan is None:
            raise ValueError("no plan: compile with a cluster (e.g. cluster='cpu:2'), or pass plan=...")
        return make_runner(self, plan, timeout_s=timeout_s)

    def step(self, batch: Mapping[str, Any]) -> Any:
        """One training step of ``self.plan`` on this rank (under torchrun, every rank calls it
        with the same global batch); returns the loss. Gradients land in the ``.grad`` of
        ``self.parameters()``."""
        return self._default_runner().step(batch)

    def parameters(self) -> list:
        """This rank's parameters under ``self.plan`` (give them to the optimizer)."""
        return self._default_runner().parameters()

    def _default_runner(self) -> PipelineRunner:
        # Built once per process: codegen and process groups are set up on the first call.
        if "default" not in self._runners:
            self._runners["default"] = self.runner()
        return self._runners["default"]

    def launch(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        nprocs: int | None = None,
        args: Sequence[Any] = (),
        plan: Plan | None = None,
        timeout_s: float = 60.0,
    ) -> list[Any]:
        """Start the plan's ranks on this machine and run ``fn(runner, *args)`` on each (default:
        one training step on the sample batch, returning the loss); results in rank order."""
        from vlmcompile.errors import ArgumentError
        from vlmcompile.launch import check_launchable, launch
        from vlmcompile.runtime import one_step

        runner = self.runner(plan, timeout_s=timeout_s)
        world = runner.topology.world_size
        check_launchable(world, timeout_s)
        if nprocs is not None and nprocs != world:
            raise ArgumentError(
                f"the plan runs on {world} ranks (PP={runner.topology.pp} x DP={runner.topology.dp}); "
                f"nprocs={nprocs} - launch {world} or compile for cluster='cpu:{nprocs}'"
            )
        if fn is None:
            fn, args = one_step, (dict(self.sample_batch),)
        for value in args:  # a batch the ranks would refuse is refused before any rank starts
            if isinstance(value, Mapping) and any(isinstance(v, torch.Tensor) for v in value.values()):
                runner.check_batch(value)
        return launch(fn, runner, world, args=args, timeout_s=timeout_s)

    def baseline(self, policy: str = "megatron", **options: Any) -> PlannedRun:
        """Plan with one policy (``megatron``, ``megatron_balanced``, ``omnibal`` or ``vlmcompile``)
        on the pipeline's cluster and simulate it; ``options`` are the policy's (tp, pp, v,
        global_batch, ...)."""
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
    global_batch: int | None = None,
    plan_time_limit_s: float = 3.0,
    plan_options: Mapping[str, Any] | None = None,
    profile: bool = False,
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
        global_batch: samples per training step to plan for (default: the sample batch's size).
        plan_time_limit_s: CP-SAT's time limit per candidate of the plan search.
        plan_options: passed to the plan search, e.g. ``{"pp_choices": (2,), "microbatch_sizes": (1,)}``.
        profile: time every layer on this machine (real tensors needed) and plan with the
            measured times (the "profile" pass, after annotate).
        log: where the pass runner prints progress (None for silence).
    """
    cluster = _check_compile_args(
        cluster,
        capture_method=capture_method,
        tensor_mode=tensor_mode,
        disable_passes=disable_passes,
        global_batch=global_batch,
        plan_time_limit_s=plan_time_limit_s,
    )
    passes = [
        Pass(
            "capture",
            functools.partial(_capture_pass, region_overrides=region_overrides, method=capture_method),
        ),
        Pass("annotate", functools.partial(_annotate_pass, tensor_mode=tensor_mode)),
        Pass(
            "plan",
            functools.partial(
                _plan_pass,
                time_limit_s=plan_time_limit_s,
                progress=log is not None,
                options=dict(plan_options or {}),
            ),
        ),
    ]
    if profile:
        passes.insert(2, Pass("profile", functools.partial(_profile_pass, repeats=5)))
    state = CompileState(
        model=model,
        sample_batch=sample_batch,
        cluster=cluster,
        model_name=model_name,
        global_batch=global_batch,
    )
    run = PassRunner(passes, disabled=disable_passes, log=log).run(state)
    return CompiledPipeline(
        gm=state.gm,
        layer_graph=state.layer_graph,
        report=CompileReport(dict(state.reports), run),
        cluster=cluster,
        planned=state.planned,
        model=model,
        sample_batch=dict(sample_batch),
    )


_REQUIRED_PASSES = ("capture", "annotate")


def _check_compile_args(
    cluster: Any,
    *,
    capture_method: Any,
    tensor_mode: Any,
    disable_passes: Sequence[str],
    global_batch: Any,
    plan_time_limit_s: Any,
) -> Cluster | None:
    """Refuse bad arguments before any pass runs; returns the cluster as a :class:`Cluster`."""
    from vlmcompile.errors import ClusterError, VlmCompileError, positive_int, positive_number

    if isinstance(cluster, str):
        cluster = Cluster.preset(cluster)
    elif cluster is not None and not isinstance(cluster, Cluster):
        raise ClusterError(
            f"cluster={cluster!r} is a {type(cluster).__name__}; pass a Cluster or a preset name "
            "('cpu:2' for two local ranks, 'h100x64', 'a100x32', ...)"
        )
    if capture_method not in ("auto", "fx", "export"):
        raise VlmCompileError(f"capture_method={capture_method!r}; use 'auto', 'fx' or 'export'")
    if tensor_mode not in ("fake", "real"):
        raise VlmCompileError(f"tensor_mode={tensor_mode!r}; use 'fake' or 'real'")
    if isinstance(disable_passes, str):
        raise VlmCompileError(f"disable_passes={disable_passes!r} is a string; give a list, e.g. ['plan']")
    required = [p for p in disable_passes if p in _REQUIRED_PASSES]
    if required:
        raise VlmCompileError(
            f"disable_passes={list(disable_passes)}: {required} cannot be disabled, every pipeline is built "
            "from the captured and annotated graph; disable only optional passes ('plan', 'profile')"
        )
    if global_batch is not None:
        positive_int(
            "global_batch", global_batch, "the samples per training step, or None for the sample batch's"
        )
    positive_number("plan_time_limit_s", plan_time_limit_s, "CP-SAT's seconds per candidate")
    return cluster
