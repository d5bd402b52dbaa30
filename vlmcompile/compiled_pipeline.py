"""What ``compile`` returns: :class:`CompiledPipeline`, and how it builds a rank's runner for a
plan (its own, or any other plan for the same model).

A runner is made from the codegen pass's stage modules and the facts capture left in the
graph's ``meta`` (the batch's shape-deciding values, whether the loss splits over
microbatches); the runtime itself reads no report and runs no pass.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from vlmcompile import families
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import MEMORY_RESERVE, ranks_over, usable_memory_bytes
from vlmcompile.data.packed_step import pack_step
from vlmcompile.data.packing import samples_of
from vlmcompile.data.steps import PackedSteps, check_run
from vlmcompile.graph.loss_split import LossSplit, coupled_loss_error
from vlmcompile.ir.contrastive_plan import ContrastivePlan
from vlmcompile.ir.errors import (
    ArgumentError,
    ClusterError,
    DataError,
    PlanError,
    SampleBatchError,
    user_facing,
)
from vlmcompile.ir.layer_graph import LayerGraph, format_bytes
from vlmcompile.ir.meta_keys import LOSS_SPLIT_META, PACKED_META, SPECIALIZED_META
from vlmcompile.ir.microbatch import rows_per_sample
from vlmcompile.ir.packed import PackedBatch, PackedLayout
from vlmcompile.ir.plan import Precision, check_frozen
from vlmcompile.ir.regions import LANGUAGE_REGIONS
from vlmcompile.pass_runner import RunReport
from vlmcompile.passes.codegen.contrastive import codegen_towers
from vlmcompile.passes.codegen.stages import CodegenResult, codegen_for
from vlmcompile.passes.planning.policies import plan_and_simulate
from vlmcompile.planning.per_batch import RowsScheduler, per_batch_scheduler
from vlmcompile.planning.request import GlobalRecompute, PlanRequest, SolverOptions
from vlmcompile.planning.result import PolicyResult
from vlmcompile.planning.schedules import Schedule
from vlmcompile.runtime import preemption
from vlmcompile.runtime.autocast import check_autocast
from vlmcompile.runtime.capabilities import runnable
from vlmcompile.runtime.checkpoint_dir import check_output_file, checkpoint_bytes
from vlmcompile.runtime.contrastive import ContrastiveStep
from vlmcompile.runtime.executor import PipelineRunner
from vlmcompile.runtime.global_batches import GlobalBatches
from vlmcompile.runtime.launch import check_launchable, launch
from vlmcompile.runtime.saves import resumed_data
from vlmcompile.runtime.timed_steps import one_step
from vlmcompile.runtime.train_loop import (
    Data,
    OptimizerFactory,
    SchedulerFactory,
    Throughput,
    TrainConfig,
    TrainResult,
    check_first_batch,
    check_trainable,
    claim_for,
    stop_line,
    train_on_rank,
)
from vlmcompile.sim.simulator import peak_memory_bytes

if TYPE_CHECKING:
    from vlmcompile.ir.plan import Parallel, Plan


@dataclass(frozen=True, slots=True)
class CompileReport:
    passes: dict[str, Any]
    run: RunReport

    def __str__(self) -> str:
        parts = [f"== {name} ==\n{report}" for name, report in self.passes.items()]
        return "\n\n".join([*parts, f"== passes ==\n{self.run}"])


@dataclass(frozen=True, slots=True)
class CompiledPipeline:
    """What ``compile`` returns: the captured graph, its LayerGraph, the plan with its stage
    modules, and every pass's report; ``step``/``launch``/``runner`` run a plan on
    torch.distributed."""

    gm: fx.GraphModule
    layer_graph: LayerGraph
    report: CompileReport
    cluster: Cluster | None = None
    planned: PolicyResult | None = None
    """The plan chosen by the plan pass (plan search, partition, encoder-in-bubbles), simulated,
    with every baseline at the same degrees (None without a cluster)."""
    codegen: CodegenResult | None = None
    """The codegen pass's stage modules for :attr:`plan` (None without a plan, or on meta tensors)."""
    model: nn.Module | None = None
    sample_batch: Mapping[str, Any] = field(default_factory=dict)
    tower_plan: ContrastivePlan | None = None
    """For a contrastive two-tower model: the plan of its step (towers microbatched, the loss on the
    whole batch); then :attr:`planned` is None."""
    tower_step: ContrastiveStep | None = None
    """The codegen pass's step for :attr:`tower_plan` (None on meta tensors)."""
    frozen_parameters: frozenset[str] = frozenset()
    """The model's parameters with ``requires_grad=False`` when it was compiled."""
    _runners: dict = field(default_factory=dict, repr=False)

    @property
    def plan(self) -> Plan | None:
        return self.planned.plan if self.planned else None

    @user_facing
    def runner(self, plan: Plan | None = None, *, timeout_s: float = 60.0) -> PipelineRunner:
        """This pipeline's stage modules for ``plan`` (default: ``self.plan``), ready to run on
        every rank (see :mod:`vlmcompile.runtime.executor`)."""
        plan = plan or self.plan
        if plan is None:
            raise ValueError("no plan: compile with a cluster (e.g. cluster='cpu:2'), or pass plan=...")
        return make_runner(self, plan, timeout_s=timeout_s)

    @user_facing
    def step(
        self,
        batch: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        next_batch: Mapping[str, Any] | None = None,
    ) -> Any:
        """One training step of ``self.plan`` on this rank (under torchrun, every rank calls it
        with the same global batch); returns the loss. Gradients land in the ``.grad`` of
        ``self.parameters()``. A pipeline compiled for samples of different shapes takes the
        step's samples as a list (:meth:`pack`). ``next_batch``: the next step's batch, where the
        plan runs a frozen encoder's forwards one batch ahead (``Plan.ahead``)."""
        if self.plan is None and self.tower_plan is not None:
            if "towers" not in self._runners:
                self._runners["towers"] = self.tower_step or self.contrastive_step()
            return self._runners["towers"].step(batch)
        runner = self._default_runner()
        if self.packed is not None and not isinstance(batch, PackedBatch):
            batch = self.pack(batch, runner.plan)
            if batch.deferred:
                raise DataError(
                    f"{len(batch.deferred)} of the step's samples fit in none of its {len(batch.microbatches)} "
                    f"microbatches of {self.packed.tokens} LLM tokens (samples {list(batch.deferred)[:8]}); give "
                    "fewer samples a step, or compile with a larger tokens_per_microbatch"
                )
        return runner.step(batch, next_batch=next_batch)

    @property
    def packed(self) -> PackedLayout | None:
        """How a pipeline compiled for samples of different shapes packs them (None otherwise)."""
        return self.gm.meta.get(PACKED_META)

    @user_facing
    def packed_steps(self, data: Any, plan: Plan | None = None) -> PackedSteps:
        """Training data of a packed pipeline: step ``k``'s samples packed into ``plan``'s
        microbatches (:class:`~vlmcompile.data.steps.PackedSteps`). ``data``: a
        :class:`GlobalBatches` (its samples are kept as a list, not collated), or a function of
        the step that returns the step's samples."""
        plan = plan or self.plan
        if isinstance(data, PackedSteps):
            return data
        if isinstance(data, GlobalBatches):
            data = dataclasses.replace(data, collate=list)
        elif not callable(data):
            raise DataError(
                f"data is a {type(data).__name__}; a pipeline compiled for samples of different shapes trains on "
                "GlobalBatches(dataset, global_batch) or a function of the step returning its samples"
            )
        if plan is None or self.model is None:
            raise DataError("packing needs a plan and the model: compile with a cluster and real weights")
        dp = plan.pipeline_parallel.dp
        return PackedSteps(
            data, families.layout_of(self.model), self.packed.tokens, dp * plan.num_microbatches, replicas=dp
        )

    @user_facing
    def pack(self, samples: Sequence[Mapping[str, Any]], plan: Plan | None = None) -> PackedBatch:
        """``samples`` packed into ``plan``'s microbatches (every data-parallel rank's); a Qwen-VL
        dict batch is split into its samples first (:func:`~vlmcompile.data.packing.split_batch`)."""
        plan = plan or self.plan
        if self.packed is None:
            raise DataError(
                "this pipeline was compiled for one batch shape; it takes a dict batch, not samples"
            )
        if plan is None or self.model is None:
            raise DataError("packing needs a plan and the model: compile with a cluster and real weights")
        family = families.layout_of(self.model)
        return pack_step(
            samples_of(samples, family),
            family,
            tokens=self.packed.tokens,
            num_microbatches=plan.pipeline_parallel.dp * plan.num_microbatches,
        )

    def parameters(self) -> list:
        """This rank's parameters under ``self.plan`` (give them to the optimizer)."""
        return self._default_runner().parameters()

    def _default_runner(self) -> PipelineRunner:
        # Built once per process: process groups are set up on the first call.
        if "default" not in self._runners:
            self._runners["default"] = self.runner()
        return self._runners["default"]

    @user_facing
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
        one training step on the sample batch, returning the loss); results in rank order. A
        contrastive model's :class:`ContrastivePlan` runs the same way, ``fn(step, *args)``."""
        if isinstance(plan, ContrastivePlan) or (plan is None and self.tower_plan is not None):
            return self._launch_towers(fn, plan, nprocs=nprocs, args=args, timeout_s=timeout_s)
        runner = self.runner(plan, timeout_s=timeout_s)
        world = runner.parallel.world_size
        check_launchable(world, timeout_s)
        if nprocs is not None and nprocs != world:
            raise ArgumentError(
                f"the plan runs on {world} ranks (PP={runner.parallel.pp} x DP={runner.parallel.dp}); "
                f"nprocs={nprocs} - launch {world} or compile for cluster='cpu:{nprocs}'"
            )
        if fn is None:
            fn, args = one_step, (dict(self.sample_batch),)
        for value in args:  # a batch the ranks would refuse is refused before any rank starts
            if isinstance(value, Mapping) and any(isinstance(v, torch.Tensor) for v in value.values()):
                runner.check_batch(value)
        return launch(fn, runner, world, args=args, timeout_s=timeout_s)

    @user_facing
    def contrastive_step(
        self, plan: ContrastivePlan | None = None, *, timeout_s: float = 60.0
    ) -> ContrastiveStep:
        """The step of ``plan`` (default: :attr:`tower_plan`) for this contrastive model."""
        plan = plan or self.tower_plan
        if plan is None:
            raise PlanError(
                "no contrastive plan: the model's loss is not a contrastive loss capture could shard "
                "(see pipe.report), or it was compiled without a cluster"
            )
        if self.model is None or _on_meta_batch(self.sample_batch):
            raise PlanError("the contrastive step needs the model's real weights and a real sample batch")
        step, _ = codegen_towers(
            self.gm, plan, model=self.model, sample_batch=self.sample_batch, timeout_s=timeout_s
        )
        return step

    def _launch_towers(self, fn, plan, *, nprocs, args, timeout_s) -> list[Any]:
        plan = plan or self.tower_plan
        if plan is self.tower_plan and self.tower_step is not None and self.tower_step.timeout_s == timeout_s:
            step = self.tower_step
        else:
            step = self.contrastive_step(plan, timeout_s=timeout_s)
        check_launchable(plan.num_ranks, timeout_s)
        if nprocs is not None and nprocs != plan.num_ranks:
            raise ArgumentError(
                f"the contrastive plan runs on {plan.num_ranks} ranks; nprocs={nprocs} - launch "
                f"{plan.num_ranks} or compile for cluster='cpu:{nprocs}'"
            )
        if fn is None:
            fn, args = one_step, (dict(self.sample_batch),)
        return launch(fn, step, plan.num_ranks, args=args, timeout_s=timeout_s)

    @user_facing
    def train(
        self,
        data: Data,
        config: TrainConfig,
        *,
        plan: Plan | None = None,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        device: str | torch.device | None = None,
        autocast_dtype: torch.dtype | Literal["auto"] | None = "auto",
        transfers: str = "auto",
        timeout_s: float = 60.0,
        per_batch_schedule: bool | None = None,
    ) -> TrainResult:
        """Train ``plan`` (default ``self.plan``) for ``config.steps`` steps on ``data`` (global
        batches: a function of the step, or an iterable); see :mod:`vlmcompile.runtime.train_loop`.

        Under torchrun (torch.distributed initialised) this process trains as its rank, on the
        GPU ``LOCAL_RANK`` names under NCCL; otherwise the plan's ranks start on this machine's
        CPU (the local launcher), and ``data``, ``optimizer`` and ``scheduler`` must pickle
        (module-level functions, functools.partial). ``autocast_dtype``: "auto" runs bf16
        autocast on a GPU when the plan computes in 2 bytes (its precision), else fp32;
        ``transfers`` is the runner's (:class:`~vlmcompile.runtime.executor.PipelineRunner`).
        ``per_batch_schedule``: re-plan the encoder-in-bubbles schedule for every batch
        (:mod:`vlmcompile.planning.per_batch`); None: where the pipeline is packed and its plan
        gives the encoders a plan of their own. Returns this rank's result (rank 0's when
        launched)."""
        _no_towers_in_train(self if plan is None else None)
        runner = self.runner(plan, timeout_s=timeout_s)
        data = self._training_data(runner, data, per_batch_schedule)
        on_gpu = _placed(runner, device, autocast_dtype)
        runner.transfers = transfers
        world = runner.parallel.world_size
        throughput = self.throughput(runner, on_gpu=on_gpu)
        check_memory(throughput.predicted_peak_bytes, self.cluster, runner)
        if not dist.is_initialized():
            check_launchable(world, timeout_s)
            check_trainable(runner)  # refused before any rank starts, as is a bad first batch
        # The checkpoint directory is checked, held and read before any rank starts (on local
        # ranks by this process, under torchrun by rank 0).
        size = checkpoint_bytes(
            t for stage in runner.stages_all for t in (*stage.parameters(), *stage.buffers())
        )
        with claim_for(config, size) as start:
            data = self._checked_data(resumed_data(data, start), start.step, config.steps)
            if not dist.is_initialized():
                check_first_batch(runner, data, start.step)
            args = (data, config, throughput, optimizer, scheduler, start)
            if dist.is_initialized():
                return train_on_rank(runner, *args)
            names = ("data", "config", "throughput", "optimizer", "scheduler", "start")
            with preemption.stop_requests():  # SIGTERM, SIGUSR1: every rank finishes its step and saves
                result = launch(
                    train_on_rank,
                    runner,
                    world,
                    args=args,
                    arg_names=names,
                    timeout_s=timeout_s,
                    forward_stop_requests=True,
                )[0]
                asked = preemption.requested()
            if result.stopped_by:  # named by the signal this process got, not the one passed on
                if asked:
                    result = dataclasses.replace(result, stopped_by=signal.Signals(asked).name)
                saved = result.checkpoints[-1] if result.checkpoints else None
                last = result.steps[-1].step if result.steps else result.resumed_from
                print(stop_line(result.stopped_by, last, config.steps, saved), file=sys.stderr, flush=True)
            return result

    def _checked_data(self, data: Data, first: int, steps: int) -> Data:
        """A packed run's data checked before any rank starts (:func:`~vlmcompile.data.steps.check_run`:
        every sample's size, the backlog over its steps), and the check said by one process."""
        if not isinstance(data, PackedSteps) or data.dataset is None:
            return data
        speaks = not dist.is_initialized() or dist.get_rank() == 0
        found = check_run(data, first, steps, log=sys.stderr if speaks else None)
        if speaks:
            print(found, file=sys.stderr, flush=True)
        return data

    def _training_data(self, runner: PipelineRunner, data: Data, per_batch_schedule: bool | None) -> Data:
        """A packed pipeline's steps (each with its own schedule where it re-plans), else ``data``."""
        if self.packed is not None:
            data = self.packed_steps(data, runner.plan)
        if self._re_plans(runner.plan, per_batch_schedule):
            data = dataclasses.replace(data, schedule=self.rows_scheduler(runner.plan))
            runner.per_batch_schedules = True
        return data

    def rows_scheduler(self, plan: Plan | None = None, *, time_limit_s: float | None = None) -> RowsScheduler:
        """What re-plans ``plan``'s encoder-in-bubbles schedule for a packed step's microbatches
        (their image rows -> the step's :class:`~vlmcompile.ir.packed.BatchPlan`)."""
        plan = plan or self.plan
        self._re_plans(plan, True)
        rows = int(self.sample_batch[families.layout_of(self.model).image_keys[0]].shape[0])
        replicas = plan.pipeline_parallel.dp
        # Rank 0 re-plans every replica's schedule: the step's share of time is theirs together.
        scheduler = per_batch_scheduler(
            plan, self.layer_graph, self.cluster, time_limit_s=time_limit_s, replicas_per_host=replicas
        )
        return RowsScheduler(scheduler, rows, replicas)

    def _re_plans(self, plan: Plan, asked: bool | None) -> bool:
        """Whether steps of ``plan`` get schedules of their own; asked for where none can be made:
        an :class:`ArgumentError` saying why."""
        if asked is False:
            return False
        why = None
        if self.packed is None:
            why = "the pipeline was compiled for one batch shape (every batch costs the same)"
        elif len({s.group for s in plan.stages}) < 2:
            why = f"the plan ({plan.policy}) gives the encoders no plan of their own to schedule into bubbles"
        elif self.cluster is None or self.model is None:
            why = "re-planning needs the cluster and the model the pipeline was compiled with"
        if why is not None and asked:
            raise ArgumentError(
                f"per_batch_schedule=True: {why}; train with per_batch_schedule=None or False"
            )
        return why is None

    def throughput(self, runner: PipelineRunner, *, on_gpu: bool = False) -> Throughput:
        """What turns the runner's step times into samples/s and MFU (:func:`throughput_of`)."""
        return throughput_of(self.layer_graph, self.cluster, runner, on_gpu=on_gpu)

    @user_facing
    def plan_png(self, path: str | Path, plan: Plan | None = None) -> Path:
        """Draw ``plan``'s simulated step (default: this pipeline's) as a PNG timeline: a row per
        rank, actions coloured by kind and labelled by microbatch, bubbles grey, in ms. Returns
        the path written. What ``vlmcompile plan --png FILE`` draws."""
        from vlmcompile.sim.simulator import simulate
        from vlmcompile.sim.trace import write_png

        if self.cluster is None:
            raise PlanError("no cluster to simulate a plan on: compile with one (e.g. cluster='cpu:2')")
        plan = plan or self.plan
        if plan is None:
            raise PlanError("no plan to draw: the plan pass did not run; pass plan=...")
        check_output_file(path, "path")
        sim = (
            self.planned.sim
            if self.planned is not None and plan is self.plan
            else simulate(plan, self.layer_graph, self.cluster)
        )
        write_png(plan, sim, path)
        return Path(path)

    @user_facing
    def baseline(
        self,
        policy: str = "megatron",
        request: PlanRequest | None = None,
        *,
        tp: int | None = None,
        pp: int | None = None,
        v: int = 1,
        global_batch: int | None = None,
        microbatch_size: int = 1,
        schedule: Schedule | str | None = None,
        recompute: GlobalRecompute | Literal["auto"] = "auto",
        placement: str | None = None,
        solver: SolverOptions | None = None,
    ) -> PolicyResult:
        """Plan with one policy (a name in :data:`~vlmcompile.passes.planning.policies.POLICIES`)
        on the pipeline's cluster and simulate it: for ``request``, or for the degrees given as
        Megatron-LM's flags (``tp``, ``pp``, ``global_batch``; DP is what the cluster leaves);
        ``placement`` is ``megatron``'s encoder placement."""
        if self.cluster is None:
            raise ValueError(
                "compile(..., cluster=...) was given no cluster; pass one (e.g. 'h100x64') to plan"
            )
        if request is None:
            missing = [
                name
                for name, value in (("tp", tp), ("pp", pp), ("global_batch", global_batch))
                if value is None
            ]
            if missing:
                raise ArgumentError(
                    f"give a PlanRequest, or {', '.join(missing)} (e.g. tp=1, pp=2, global_batch=8)"
                )
            request = PlanRequest.on(
                self.cluster,
                tp=tp,
                pp=pp,
                v=v,
                global_batch=global_batch,
                microbatch_size=microbatch_size,
                schedule=schedule,
            )
        return plan_and_simulate(
            self.layer_graph,
            self.cluster,
            policy,
            request,
            recompute=recompute,
            placement=placement,
            solver=solver,
        )


def make_runner(pipe: CompiledPipeline, plan: Plan, *, timeout_s: float = 60.0) -> PipelineRunner:
    """Check ``plan`` against ``pipe``'s model and cluster, take its stage modules (the codegen
    pass's for ``pipe.plan``, else codegen's for this plan) and wrap them in a runner."""
    mine = pipe.layer_graph.fingerprint()
    if plan.fingerprint and plan.fingerprint != mine:
        raise PlanError(
            f"the plan was made for model {plan.model!r} (fingerprint {plan.fingerprint}); this pipeline "
            f"compiled {pipe.layer_graph.meta.get('model', '?')!r} (fingerprint {mine}). Plan for this model: "
            "vlmcompile plan ... --json FILE, or pipe.baseline(...)/pipe.plan"
        )
    if not plan.fingerprint:
        warnings.warn(
            "the plan carries no model fingerprint; it is not checked against the model", stacklevel=3
        )
    checked = runnable(plan, pipe.layer_graph)  # the one check on the way to the ranks
    _check_trains_as_planned(pipe, plan)
    parallel = check_cluster_size(plan, pipe.cluster, checked.parallel)
    _check_loss_splits(pipe.gm, parallel, plan)
    global_batch = plan.global_batch
    try:
        rows = rows_per_sample(pipe.sample_batch)
    except SampleBatchError:
        if parallel.dp * plan.num_microbatches > 1:
            raise
        rows = dict.fromkeys(pipe.sample_batch, 0)  # one part: the batch is never split
    tensors = {k: v for k, v in pipe.sample_batch.items() if isinstance(v, torch.Tensor)}
    shapes = {
        k: ((global_batch * rows[k], *v.shape[1:]) if rows[k] else tuple(v.shape), v.dtype)
        for k, v in tensors.items()
    }
    made = pipe.codegen if pipe.codegen is not None and plan == pipe.plan else None
    made = made or codegen_for(pipe.gm, plan, model=pipe.model, sample_batch=pipe.sample_batch)
    constants = {k: v for k, v in pipe.sample_batch.items() if not isinstance(v, torch.Tensor)}
    return PipelineRunner(
        checked,
        made.stages,
        batch_shapes=shapes,
        batch_constants=constants,
        sample_rows=rows,
        specialized=made.gm.meta.get(SPECIALIZED_META),
        timeout_s=timeout_s,
        state_names=state_names(pipe.model) if pipe.model is not None else None,
        packed=pipe.packed,
    )


def _check_trains_as_planned(pipe: CompiledPipeline, plan: Plan) -> None:
    """Refuse a plan made for another freezing of the model, or for packed microbatches of
    another size, and a model whose ``requires_grad`` flags changed since compile."""
    if pipe.model is not None and frozen_parameters(pipe.model) != pipe.frozen_parameters:
        now = frozen_parameters(pipe.model)
        changed = sorted(now ^ pipe.frozen_parameters)
        raise PlanError(
            f"requires_grad changed since compile for {len(changed)} parameters ({', '.join(changed[:3])}"
            f"{', ...' if len(changed) > 3 else ''}); compile again: a pipeline is planned for the flags it was "
            "compiled with"
        )
    check_frozen(plan, pipe.layer_graph)
    tokens = plan.packed_tokens
    if tokens is not None and (pipe.packed is None or pipe.packed.tokens != tokens):
        now = f"packs {pipe.packed.tokens}" if pipe.packed is not None else "takes batches of one shape"
        raise PlanError(
            f"the plan was made for packed microbatches of {tokens} LLM tokens; this pipeline {now}: compile for "
            f"the data with tokens_per_microbatch={tokens} (vlmcompile train --data ... --tokens-per-microbatch "
            f"{tokens}), or plan for this pipeline"
        )


def frozen_parameters(model: nn.Module) -> frozenset[str]:
    """Names of the model's parameters with ``requires_grad=False``."""
    return frozenset(n for n, p in model.named_parameters() if not p.requires_grad)


def state_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Name -> every ``state_dict`` name of the same tensor (tied parameters have several; a
    non-persistent buffer none)."""
    keys = set(model.state_dict(keep_vars=True))
    by_tensor: dict[int, list[str]] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        by_tensor.setdefault(id(t), []).append(name)
    return {n: tuple(a for a in names if a in keys) for names in by_tensor.values() for n in names}


def _sequence_length(layer_graph: LayerGraph) -> int:
    """The positions of one sample in the language model (image tokens included): the sequence
    dimension of its first block's hidden states ``[batch, sequence, hidden]`` (0 without one)."""
    for layer in layer_graph.in_region(*LANGUAGE_REGIONS):
        hidden = [o.shape for o in layer.outputs if len(o.shape) == 3]
        if layer.block and hidden:
            return hidden[0][1]
    return 0


def _check_loss_splits(gm: fx.GraphModule, parallel: Parallel, plan: Plan) -> None:
    """Refuse to split a batch whose loss couples its samples (graph/loss_split.py)."""
    check = gm.meta.get(LOSS_SPLIT_META)
    if check is None or check.verdict is not LossSplit.BATCH_COUPLED:
        return
    parts = parallel.dp * plan.num_microbatches
    if parts > 1:
        raise PlanError(
            f"the plan splits each batch into {parts} parts (DP={parallel.dp} x {plan.num_microbatches} "
            f"microbatches), but {coupled_loss_error(check.detail)}"
        )


def throughput_of(
    layer_graph: LayerGraph, compiled_for: Cluster | None, runner: PipelineRunner, *, on_gpu: bool = False
) -> Throughput:
    """What turns the runner's step times into samples/s and MFU: the model's FLOPs per sample
    (annotated) and one device's peak: on GPUs the plan's cluster's device (an H100 when it
    names none), on CPU ranks this CPU's share (measured)."""
    world = runner.parallel.world_size
    totals = layer_graph.totals()
    per_sample = (totals["fwd_flops"] + totals["bwd_flops"]) / float(layer_graph.meta.get("batch_size", 1))
    plan = runner.plan
    named = [c for c in (compiled_for.name if compiled_for else None, plan.cluster) if c]
    if on_gpu:
        gpu = next((c for c in named if not c.startswith("cpu")), "h100x1")
        cluster = Cluster.preset(gpu)
    else:  # this CPU's measured peak, or the rate a profiled layer beat it by
        rate = layer_graph.fastest_measured_rate()
        cluster = Cluster.preset(f"cpu:{world}").with_peak(rate, "the fastest profiled layer's rate")
    return Throughput(
        global_batch=plan.global_batch,
        flops_per_sample=per_sample,
        tokens_per_sample=_sequence_length(layer_graph),
        peak_flops_per_s=cluster.device.peak_flops_per_s,
        world_size=world,
        peak_of=cluster.device.name,
        predicted_peak_bytes=predicted_peaks(runner, layer_graph, compiled_for or cluster),
    )


def check_memory(predicted: Sequence[int], cluster: Cluster | None, runner: PipelineRunner) -> None:
    """Refuse a plan whose peak, as the runtime holds it, is over the memory ``cluster`` gives a
    rank (after :data:`~vlmcompile.cost_models.memory.MEMORY_RESERVE`): a plan made for one
    precision runs out of memory in another (frozen weights stay fp32 under autocast)."""
    if cluster is None or not predicted:
        return
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    over = ranks_over(predicted, cap)
    if over:
        r = max(over, key=lambda k: predicted[k])
        held = "bf16 autocast, fp32 states" if runner.autocast_dtype is not None else "fp32"
        raise PlanError(
            f"rank {r} would hold {format_bytes(predicted[r])} as the runtime trains this plan ({held}), over the "
            f"{format_bytes(cap)} a rank of {cluster.name} may hold (its {format_bytes(cluster.device.mem_bytes)} "
            f"less the {MEMORY_RESERVE:.0%} reserve): plan again with more pipeline stages, recompute or ZeRO-1, or a "
            "larger memory cap"
        )


def predicted_peaks(runner: PipelineRunner, layer_graph: LayerGraph, cluster: Cluster) -> tuple[int, ...]:
    """Per global rank, the peak memory the simulator predicts for the runner's plan as the
    runtime holds it (:meth:`~vlmcompile.ir.plan.Precision.runtime`: fp32 states, and a bf16
    copy of the trainable weights under autocast), whatever precision the plan was made for."""
    precision = Precision.runtime(autocast=runner.autocast_dtype is not None)
    per_pp_rank = peak_memory_bytes(runner.plan, layer_graph, cluster, precision=precision)
    parallel = runner.parallel
    return tuple(int(per_pp_rank[parallel.coords(r)[0]]) for r in range(parallel.world_size))


def train(pipe: CompiledPipeline, data: Data, config: TrainConfig, **options: Any) -> TrainResult:
    """``pipe.train(data, config, **options)``: train a compiled pipeline (see :meth:`CompiledPipeline.train`)."""
    return pipe.train(data, config, **options)


def check_cluster_size(
    plan: Plan, compiled_for: Cluster | None = None, parallel: Parallel | None = None
) -> Parallel:
    """The degrees the plan's ranks run by (``parallel``, a checked plan's; else the runtime's
    check of ``plan``, :func:`~vlmcompile.runtime.capabilities.runnable`), refused when they need
    more ranks than the cluster the plan names, or than ``compiled_for`` (the pipeline's) has."""
    parallel = parallel or runnable(plan).parallel
    named = None
    if plan.cluster:
        try:
            named = Cluster.preset(plan.cluster)
        except ClusterError:  # a cluster the user described, not a preset: its size is unknown here
            named = None
    for cluster, whose in (
        (named, "the cluster the plan names"),
        (compiled_for, "the cluster this pipeline was compiled for"),
    ):
        if cluster is not None and parallel.world_size > cluster.num_gpus:
            raise PlanError(
                f"the plan runs on {parallel.world_size} ranks (PP={parallel.pp} x DP={parallel.dp}), more than the "
                f"{cluster.num_gpus} device{'s' if cluster.num_gpus > 1 else ''} of {cluster.name}, {whose}; plan "
                "for the cluster you run on"
            )
    return parallel


def _no_towers_in_train(pipe: CompiledPipeline | None) -> None:
    if pipe is not None and pipe.plan is None and pipe.tower_plan is not None:
        raise PlanError(
            "train() does not run contrastive two-tower steps yet (no checkpoints or LR schedule for "
            "them); train with your own loop: pipe.launch(fn) runs fn(step, ...) on every rank, and "
            "step.step(batch) is one exact step (see tests/runtime/test_contrastive.py's sgd_steps)"
        )


def _on_meta_batch(batch: Mapping[str, Any]) -> bool:
    return any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in batch.values())


def _placed(runner: PipelineRunner, device, autocast_dtype) -> bool:
    """Set the runner's device (under torchrun, the GPU ``LOCAL_RANK`` names) and compute dtype
    (checked: :func:`~vlmcompile.runtime.autocast.check_autocast`); whether it trains on GPUs."""
    on_gpu = _on_gpu(device)
    if on_gpu and not dist.is_initialized():
        raise ArgumentError(
            "the local launcher starts CPU ranks over gloo; to train on GPUs start one process per GPU with "
            "torchrun (it initialises NCCL), and call train() in each"
        )
    if on_gpu and torch.device(device or "cuda").index is None:
        local = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())
    if on_gpu:
        torch.cuda.set_device(device)  # NCCL's collectives and every kernel launch use the current device
    runner.device = torch.device(device) if device is not None else None
    if autocast_dtype == "auto":
        low = runner.plan.precision.param_bytes == 2 or runner.plan.precision.compute_copy_bytes == 2
        autocast_dtype = torch.bfloat16 if on_gpu and low else None
    note = check_autocast(autocast_dtype, runner.device or torch.device("cuda" if on_gpu else "cpu"))
    if note and (not dist.is_initialized() or dist.get_rank() == 0):
        print(note, file=sys.stderr, flush=True)
    runner.autocast_dtype = autocast_dtype
    return on_gpu


def _on_gpu(device: str | torch.device | None) -> bool:
    """Whether training runs on GPUs: asked for, or torch.distributed runs NCCL."""
    if device is not None:
        return torch.device(device).type == "cuda"
    return dist.is_initialized() and dist.get_backend() == "nccl"
