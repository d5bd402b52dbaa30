"""``vlmcompile.compile``: builds the pass list and runs it.

| #   | pass     | file |
|-----|----------|------|
| 1   | capture  | passes/graph/capture.py (samples of different shapes: passes/graph/capture_packed.py) |
| 2   | annotate | passes/graph/annotate.py |
| (3) | profile  | passes/graph/profile.py (``profile=True``: measured layer times for the plan) |
| 3   | plan     | passes/planning/plan_search.py, passes/planning/partition.py, passes/planning/bubbles.py, every baseline (passes/planning/policies.py) |
| 4   | codegen  | passes/codegen/stages.py: the plan's stage modules (a contrastive model's towers: passes/codegen/contrastive.py) |

The plan pass runs when a cluster is given: the plan search picks the degrees, the partition
pass the cuts and recompute, the bubbles pass the encoders' own plan and their work in the LLM's
bubbles (the schedule is part of the plan), and every baseline is planned at the chosen degrees
for the report. Codegen splits the captured graph along the plan (not on meta tensors: nothing
could run them).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
import torch.fx as fx
from torch import nn

from vlmcompile import families, models
from vlmcompile.compiled_pipeline import CompiledPipeline, CompileReport, frozen_parameters
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.data.distribution import DatasetScan, backlog_limit, scan
from vlmcompile.data.manifest import read_manifest
from vlmcompile.data.packing import check_samples, split_batch
from vlmcompile.data.synthetic import ManifestDataset
from vlmcompile.graph.export import check_loss
from vlmcompile.graph.loss_split import LossSplit
from vlmcompile.ir.contrastive_loss import ContrastiveLoss
from vlmcompile.ir.contrastive_plan import ContrastivePlan
from vlmcompile.ir.errors import (
    ArgumentError,
    ClusterError,
    ModelError,
    VlmCompileError,
    positive_int,
    user_facing,
)
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.meta_keys import (
    CAPTURE_OPTIONS_META,
    COUPLING_META,
    LOSS_SPLIT_META,
    OUTPUT_META,
    PACKED_META,
)
from vlmcompile.ir.microbatch import num_samples
from vlmcompile.ir.plan import Decision, Reason
from vlmcompile.ir.regions import Region
from vlmcompile.pass_runner import Pass, PassRunner
from vlmcompile.passes.codegen.contrastive import codegen_towers
from vlmcompile.passes.codegen.stages import CodegenResult, codegen_for
from vlmcompile.passes.graph.annotate import TensorMode, annotate
from vlmcompile.passes.graph.capture import CaptureMethod, capture
from vlmcompile.passes.graph.capture_packed import capture_packed
from vlmcompile.passes.graph.profile import profile
from vlmcompile.passes.planning.policies import search_and_compare
from vlmcompile.planning.contrastive import predict_step
from vlmcompile.planning.contrastive_placement import place_towers
from vlmcompile.planning.request import SearchSpace, SolverOptions
from vlmcompile.runtime.capabilities import RUNTIME
from vlmcompile.runtime.contrastive import ContrastiveStep
from vlmcompile.runtime.launch import threads_per_rank


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
    codegen: CodegenResult | None = None
    tower_plan: ContrastivePlan | None = None
    """A contrastive model's plan (then ``planned`` stays None)."""
    tower_step: ContrastiveStep | None = None
    profiled: tuple[int, int] | None = None
    """(samples the profile pass timed each layer on, its repeats); None: not profiled."""
    samples: list | None = None
    """Samples of different shapes (a list given as the sample batch): packed capture."""
    tokens_per_microbatch: int | None = None
    packing: Any = None
    """The samples given, packed by the capture pass."""
    dataset: Any = None
    """A dataset of samples to plan for (its scan picks the samples captured)."""
    scan: Any = None
    reports: dict[str, Any] = field(default_factory=dict)


def _capture_pass(state: CompileState, *, region_overrides, method) -> None:
    if state.dataset is not None:
        state.scan = scan(
            state.dataset,
            families.layout_of(state.model),
            global_batch=state.global_batch,
            tokens=state.tokens_per_microbatch,
        )
        state.samples = [state.dataset[i] for i in state.scan.largest]
        state.tokens_per_microbatch = state.scan.tokens
    if state.samples is not None:
        packed = capture_packed(
            state.model, state.samples, tokens=state.tokens_per_microbatch, region_overrides=region_overrides
        )
        state.gm, state.sample_batch, state.packing = packed.gm, packed.example, packed.packing
        state.reports["capture"] = packed.report
        if state.scan is not None:
            state.reports["data"] = state.scan
        return
    result = capture(state.model, state.sample_batch, region_overrides=region_overrides, method=method)
    state.gm = result.gm
    state.reports["capture"] = result.report


def _expected_time(state: CompileState) -> LayerGraph:
    """A dataset's plan: memory for the largest microbatch (the graph's, annotated there), time
    for the mean one."""
    return state.layer_graph if state.scan is None else state.scan.expected_time(state.layer_graph)


def _packed_rows(state: CompileState) -> tuple[int, Decision]:
    """Microbatches a step of ``global_batch`` samples needs: what the dataset's scan found, or
    the rate the samples given packed at (one microbatch is one row of the token budget)."""
    if state.scan is not None:
        return state.scan.microbatches, packed_decision(state.scan)
    used = sum(1 for mb in state.packing.microbatches if mb.tokens)
    given = len(state.samples)
    samples = state.global_batch or given
    rows = max(1, -(-used * samples // given))
    layout = state.gm.meta[PACKED_META]
    decision = Decision(
        "microbatches",
        Reason.PACKED,
        f"{samples} samples a step pack into {rows} microbatches of {layout.tokens} LLM tokens (the {given} "
        f"samples given filled {used}, {1 - state.packing.pad_share:.0%} of their tokens)",
        {"tokens": layout.tokens, "global_batch": samples},
    )
    return rows, decision


def packed_decision(found: DatasetScan) -> Decision:
    """The decision a plan for a dataset's packed microbatches keeps: how many a step takes, of
    how many LLM tokens (what a run of the plan must pack), and the backlog a step may leave."""
    return Decision(
        "microbatches",
        Reason.PACKED,
        f"{found.global_batch} samples a step pack into {found.microbatches} microbatches of "
        f"{found.tokens} LLM tokens on the dataset's first {found.scanned} samples, deferring at most "
        f"{found.deferred.max} samples a step to the next (the busiest step alone needs {found.most_needed}; a "
        f"run stops before a step that would leave more than {backlog_limit(found.global_batch)}, a whole step's)"
        + (f"; warning: {found.warning}" if found.warning else ""),
        {"tokens": found.tokens, "global_batch": found.global_batch},
    )


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
    if _on_meta(state):
        state.reports["profile"] = (
            "skipped: the model or the sample batch is on meta tensors (nothing to time)"
        )
        return
    # One row: the plan search scales per-sample times to its microbatch sizes. A packed sample
    # batch is one microbatch of one row already (cutting it would cut its images). A
    # contrastive rank embeds its share of the batch at once, and a small layer's time per row
    # falls with the rows: time that share.
    rows = 1
    cut = state.gm.meta.get(COUPLING_META)
    if cut is not None and cut.loss is not None:
        rows = max(1, num_samples(state.sample_batch) // _ranks_here(state))
    elif state.samples is None and state.gm.meta.get(CAPTURE_OPTIONS_META, {}).get("method") == "export":
        # An exported graph holds the sample batch's shapes: it runs at that many rows only.
        rows = num_samples(state.sample_batch)
    result = _profiled(state, rows, repeats)
    state.layer_graph, state.profiled = result.layer_graph, (rows, repeats)
    state.reports["profile"] = result.report
    if state.cluster is not None:
        state.cluster = with_profiled_peak(state.cluster, result.layer_graph)


def with_profiled_peak(cluster: Cluster, layer_graph: LayerGraph) -> Cluster:
    """``cluster`` with its device's peak at least the fastest profiled layer's rate."""
    rate = layer_graph.fastest_measured_rate()
    return cluster.with_peak(rate, f"peak raised to the fastest profiled layer's {rate / 1e9:.1f} GFLOP/s")


def _profiled(state: CompileState, rows: int, repeats: int):
    """The profile pass's timing of every layer on the first ``rows`` samples of the sample batch
    (a packed one whole)."""
    microbatch = (
        dict(state.sample_batch)
        if state.samples is not None
        else {k: v[:rows] if isinstance(v, torch.Tensor) else v for k, v in state.sample_batch.items()}
    )
    return profile(
        state.gm,
        state.layer_graph,
        microbatch,
        device_name=state.cluster.device.name if state.cluster is not None else "cpu",
        threads=threads_per_rank(_ranks_here(state)),
        repeats=repeats,
    )


def _ranks_here(state: CompileState) -> int:
    """The plan's ranks that share this machine's cores (1 for a cluster elsewhere)."""
    local = state.cluster is not None and state.cluster.ranks_on_this_machine
    return state.cluster.num_gpus if local else 1


def _timed_at_tower_microbatches(state: CompileState, plan: ContrastivePlan) -> ContrastivePlan:
    """``plan`` predicted again with each tower's layers timed at its own largest microbatch, where
    that is not the share the profile pass timed (a layer's time per sample falls with the
    samples: towers on ranks of their own, or in several microbatches, run other sizes)."""
    timed_rows, repeats = state.profiled
    rows = [max(plan.placement(t).split.sizes) for t in (0, 1)]
    if set(rows) == {timed_rows}:
        return plan
    measured = {}
    for size in sorted(set(rows)):
        graph = state.layer_graph if size == timed_rows else _profiled(state, size, repeats).layer_graph
        names = {n for t in (0, 1) if rows[t] == size for n in plan.loss.tower_layers[t]}
        measured.update({layer.name: layer.measured for layer in graph.layers if layer.name in names})
    graph = dataclasses.replace(
        state.layer_graph,
        layers=tuple(
            dataclasses.replace(layer, measured=measured.get(layer.name, layer.measured))
            for layer in state.layer_graph.layers
        ),
    )
    decision = Decision(
        "prediction",
        Reason.TOWER_TIMES,
        f"layer times measured again at each tower's largest microbatch ({rows[0]} and {rows[1]} samples; "
        f"the plan was chosen with times at {timed_rows})",
    )
    state.cluster = with_profiled_peak(state.cluster, graph)  # its MFU against a peak no layer beat
    return dataclasses.replace(
        plan, predicted=predict_step(graph, state.cluster, plan), decisions=(*plan.decisions, decision)
    )


def _plan_pass(state: CompileState, *, solver: SolverOptions, progress: bool, space: SearchSpace) -> None:
    if state.cluster is None:
        state.reports["plan"] = "no cluster given: nothing planned (pass cluster=... to plan)"
        return
    # A plan for ranks on this machine is meant to run here: keep to what the runtime can do.
    if state.cluster.ranks_on_this_machine and not RUNTIME.tensor_parallel:
        space = dataclasses.replace(space, tp_choices=(1,))
    global_batch = state.global_batch or int(state.layer_graph.meta.get("batch_size", 1))
    graph, packed = state.layer_graph, None
    if state.samples is not None:
        # The pipeline's unit is a packed microbatch of one row: plan that many a step.
        global_batch, packed = _packed_rows(state)
        space = dataclasses.replace(space, microbatch_sizes=(1,), round_up_global_batch=True)
        graph = _expected_time(state)
        # Packed steps re-plan their schedules per batch, which keep no forward a batch ahead.
        solver = dataclasses.replace(solver, run_ahead=False)
    check = state.gm.meta.get(LOSS_SPLIT_META)
    coupled = check is not None and check.verdict is LossSplit.BATCH_COUPLED
    cut = state.gm.meta.get(COUPLING_META)
    if coupled and cut is not None and cut.loss is not None:
        # A contrastive loss: towers microbatched over every rank, the loss on the whole batch.
        state.tower_plan = place_towers(
            state.layer_graph,
            state.cluster,
            cut.loss,
            global_batch=global_batch,
            embedding_width=cut.loss.width,
            placement=space.tower_placement,
            microbatches=space.tower_microbatches,
            tensor_parallel=space.tower_tensor_parallel,
            pipeline_parallel=space.tower_pipeline_parallel,
        )
        if state.profiled is not None:
            state.tower_plan = _timed_at_tower_microbatches(state, state.tower_plan)
        state.reports["plan"] = state.tower_plan
        return
    if coupled:
        # A loss that couples the samples trains right only on the whole batch at once.
        space = dataclasses.replace(space, microbatch_sizes=(global_batch,), dp_choices=(1,))
    run = search_and_compare(
        graph,
        state.cluster,
        global_batch=global_batch,
        space=space,
        solver=solver,
        progress=progress,
    )
    if coupled:
        run = run.with_decisions(
            Decision(
                "microbatches",
                Reason.LOSS_COUPLED,
                f"the loss couples the samples of a batch ({check.detail}): "
                f"one microbatch of {global_batch}, DP = 1",
            )
        )
    if packed is not None:
        run = run.with_decisions(packed)
    state.planned = run
    state.reports["plan"] = run


def _codegen_pass(state: CompileState) -> None:
    if state.tower_plan is not None and not _on_meta(state):
        state.tower_step, report = codegen_towers(
            state.gm, state.tower_plan, model=state.model, sample_batch=state.sample_batch
        )
        state.reports["codegen"] = report
        return
    if state.planned is None:
        state.reports["codegen"] = "no plan: nothing to split"
        return
    if _on_meta(state):
        state.reports["codegen"] = (
            "skipped: the model or the sample batch is on meta tensors (nothing could run)"
        )
        return
    state.codegen = codegen_for(
        state.gm, state.planned.plan, model=state.model, sample_batch=state.sample_batch
    )
    state.reports["codegen"] = state.codegen.report


def _on_meta(state: CompileState) -> bool:
    tensors = [v for v in state.sample_batch.values() if isinstance(v, torch.Tensor)]
    return any(t.device.type == "meta" for t in [*tensors, *state.model.parameters()])


@user_facing
def compile(
    model: nn.Module,
    sample_batch: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    cluster: Cluster | str | None = None,
    *,
    dataset: Any = None,
    region_overrides: Mapping[str, str | Region] | None = None,
    capture_method: CaptureMethod | str = "auto",
    tensor_mode: TensorMode = "fake",
    disable_passes: Sequence[str] = (),
    model_name: str | None = None,
    global_batch: int | None = None,
    solver: SolverOptions | None = None,
    search_space: SearchSpace | None = None,
    profile: bool = False,
    tokens_per_microbatch: int | None = None,
    log: TextIO | None = sys.stderr,
) -> CompiledPipeline:
    """Compile a VLM for training on ``cluster``.

    Args:
        model: the VLM (plain PyTorch or transformers); its forward returns the loss.
        sample_batch: one batch, keyed by ``model.forward``'s argument names (real or meta tensors);
            or a list of samples of different shapes (one dict per example, as a transformers
            processor returns it: any number of images, any length), for a pipeline captured
            once that packs every step's samples into microbatches of ``tokens_per_microbatch``
            LLM tokens (the families :func:`~vlmcompile.families.layout_of` packs: LLaVA,
            LLaVA-NeXT, InternVL, Idefics3, SmolVLM, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the zoo's
            VLMs).
        cluster: the cluster to plan for: a :class:`Cluster` or a preset name ("h100x64", "cpu:2").
        region_overrides: module-path prefix -> region ("vision", "projector", "llm", "text", "head").
        capture_method: "auto", "fx" or "export".
        tensor_mode: "fake" (any size, no memory) or "real" (CPU tensors) for the annotate pass.
        disable_passes: names of passes to skip.
        model_name: shown in reports (default: the model's class name).
        global_batch: samples per training step to plan for (default: the sample batch's size).
        dataset: instead of a sample batch, a dataset of such samples (anything with ``len`` and
            indexing) or a JSONL manifest of sample sizes (a path): its first samples are
            scanned and the pipeline planned for them (``global_batch`` samples a step).
        tokens_per_microbatch: with samples or a dataset: the LLM tokens of a microbatch
            (default: the longest sample, rounded up to a multiple of 16).
        solver: CP-SAT's limits per candidate of the plan search (default: 3 s each).
        search_space: the degrees the plan search may choose from, e.g.
            ``SearchSpace(pp_choices=(2,), microbatch_sizes=(1,))`` (default: all the cluster allows).
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
        solver=solver,
    )
    passes = _passes(
        region_overrides=region_overrides,
        capture_method=capture_method,
        tensor_mode=tensor_mode,
        solver=solver,
        search_space=search_space,
        progress=log is not None,
        profile=profile,
    )
    samples, dataset = _samples_or_dataset(model, sample_batch, dataset, global_batch)
    state = CompileState(
        model=model,
        sample_batch={} if samples is not None else sample_batch,
        cluster=cluster,
        model_name=model_name,
        global_batch=global_batch,
        samples=samples,
        tokens_per_microbatch=tokens_per_microbatch,
        dataset=dataset,
    )
    run = PassRunner(passes, disabled=disable_passes, log=log).run(state)
    return _pipeline(state, run)


def _pipeline(state: CompileState, run) -> CompiledPipeline:
    """What the passes made, as the pipeline ``compile`` returns."""
    return CompiledPipeline(
        gm=state.gm,
        layer_graph=state.layer_graph,
        report=CompileReport(dict(state.reports), run),
        cluster=state.cluster,
        planned=state.planned,
        codegen=state.codegen,
        tower_plan=state.tower_plan,
        tower_step=state.tower_step,
        model=state.model,
        sample_batch=dict(state.sample_batch),
        frozen_parameters=frozen_parameters(state.model),
    )


def _passes(
    *, region_overrides, capture_method, tensor_mode, solver, search_space, progress: bool, profile: bool
) -> list[Pass]:
    """The pass list of :func:`compile`, in order."""
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
                solver=solver or SolverOptions(time_limit_s=3.0),
                progress=progress,
                space=search_space or SearchSpace(),
            ),
        ),
        Pass("codegen", _codegen_pass),
    ]
    if profile:
        passes.insert(2, Pass("profile", functools.partial(_profile_pass, repeats=5)))
    return passes


def _samples_or_dataset(model: nn.Module, sample_batch: Any, dataset: Any, global_batch: int | None):
    """(samples, dataset) from what ``compile`` was given; a manifest path becomes a dataset of
    the model's samples of its sizes."""
    if dataset is None:
        if sample_batch is None:
            raise VlmCompileError(
                "give a sample batch (a dict), a list of samples of different shapes, or dataset=..."
            )
        if isinstance(sample_batch, Mapping):
            return (
                split_batch(sample_batch, families.layout_of(model))
                if families.packs_dict_batches(model)
                else None
            ), None
        return check_samples(sample_batch), None
    if sample_batch is not None:
        raise VlmCompileError("give either a sample batch or dataset=..., not both")
    if global_batch is None:
        raise VlmCompileError("compiling for a dataset needs global_batch= (the samples of a training step)")
    if isinstance(dataset, (str, os.PathLike)):
        dataset = ManifestDataset(tuple(read_manifest(dataset)), families.layout_of(model))
    return None, dataset


@user_facing
def freeze_layers(model: nn.Module, layer_graph: LayerGraph, names: Sequence[str]) -> list[str]:
    """Freeze (``requires_grad=False``) the parameters of the layers ``names`` mean in
    ``layer_graph`` (regions or module paths, :meth:`LayerGraph.select`), as a recipe's
    ``--freeze-ViT`` does; returns the layers frozen. Compile the model again afterwards: a
    pipeline plans for the ``requires_grad`` flags it was compiled with.

    Raises:
        ArgumentError: a name matches no layer, or a layer is no module of ``model``.
    """
    chosen = layer_graph.select(names)
    for name in chosen:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ArgumentError(
                f"layer {name} is no module of {type(model).__name__}: freeze it with requires_grad_(False) on "
                "the module that holds its parameters"
            ) from None
        module.requires_grad_(False)
    return chosen


def zoo_layer_graph(model_name: str, *, dtype: Any = None) -> LayerGraph:
    """A zoo model's LayerGraph for one sample, annotated on meta tensors (any size, no memory)."""
    dtype = dtype or torch.bfloat16
    model = models.build(model_name, device="meta", dtype=dtype)
    batch = models.sample_batch(model_name, batch_size=1, device="meta", dtype=dtype)
    return compile(model, batch, model_name=model_name, log=None).layer_graph


def zoo_contrastive_loss(model_name: str) -> ContrastiveLoss:
    """A zoo contrastive model's loss as capture recognises it, for the paper-size model that
    :func:`zoo_layer_graph` annotates on meta tensors (where nothing runs, so nothing can be
    recognised): the loss is recognised on a narrow copy with the same layers on real tensors,
    and given the model's embedding width.

    Raises:
        ModelError: the model is not a contrastive pair, or its loss is not recognised.
    """
    cfg = models.config(model_name)
    if not isinstance(cfg, models.ContrastiveConfig):
        raise ModelError(f"{model_name!r} is not a contrastive two-tower model; zoo pairs: {_zoo_pairs()}")
    small = models.narrowed(cfg)
    batch = models.sample_batch(small, batch_size=4)
    pipe = compile(models.build(small), batch, "cpu:2", log=None)
    if pipe.tower_plan is None:
        raise ModelError(f"{model_name!r}: capture did not recognise a contrastive loss on its narrow copy")
    return dataclasses.replace(pipe.tower_plan.loss, width=cfg.embed_dim)


def _zoo_pairs() -> list[str]:
    return sorted(n for n, c in models.VLMS.items() if isinstance(c, models.ContrastiveConfig))


_REQUIRED_PASSES = ("capture", "annotate")


def _check_compile_args(
    cluster: Any,
    *,
    capture_method: Any,
    tensor_mode: Any,
    disable_passes: Sequence[str],
    global_batch: Any,
    solver: Any,
) -> Cluster | None:
    """Refuse bad arguments before any pass runs; returns the cluster as a :class:`Cluster`."""
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
            "from the captured and annotated graph; disable only optional passes ('plan', 'profile', 'codegen')"
        )
    if global_batch is not None:
        positive_int(
            "global_batch", global_batch, "the samples per training step, or None for the sample batch's"
        )
    if solver is not None and not isinstance(solver, SolverOptions):
        raise VlmCompileError(
            f"solver={solver!r} is a {type(solver).__name__}; pass SolverOptions(time_limit_s=..., workers=...) "
            "from vlmcompile.planning.request, or None for the defaults"
        )
    return cluster
