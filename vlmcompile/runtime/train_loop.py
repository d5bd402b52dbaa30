"""The training loop a user keeps: an optimizer over the rank's parameters, an LR schedule, a
global gradient-norm clip, global batches from the user's data, checkpoints, and per-step
metrics (loss, LR, gradient norm, step time, samples/s, tokens/s, MFU, peak memory per rank).

Every rank runs :func:`train_on_rank` with the same data: each step's global batch is the same on
every rank, and the runner takes its data-parallel shard of it (rows ``dp_rank * m * mbs`` on)
and the label-token weights of the whole batch, so the loss is the global batch's, as in eager.

Clipping is eager's: the norm is over every parameter of the model once, whichever ranks hold
it. A parameter held on several pipeline ranks (tied embeddings, a stage replicated over ranks)
counts on its lowest holder only, and data-parallel replicas (equal after the gradient
all-reduce) are summed over the world and divided by DP.

Frozen parameters (``requires_grad=False``) train as in eager: no gradient, so no optimizer
state, no part in the norm or the reductions, and the same bits after any number of steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from vlmcompile.ir.errors import (
    ArgumentError,
    DataError,
    VlmCompileError,
    positive_int,
    positive_number,
    user_facing,
)
from vlmcompile.ir.layer_graph import format_bytes
from vlmcompile.ir.microbatch import IGNORE_INDEX
from vlmcompile.ir.packed import PackedBatch, nonfinite_keys
from vlmcompile.runtime import checkpoint, preemption
from vlmcompile.runtime.checkpoint_dir import Start, check_start, claim, kept_saves
from vlmcompile.runtime.executor import BatchError, PipelineRunner
from vlmcompile.runtime.launch import LOCAL_RANK_ENV
from vlmcompile.runtime.memory import StepMemory
from vlmcompile.runtime.optimizers import OptimizerFactory, local_states, make_optimizer
from vlmcompile.runtime.saves import RunSaves, epochs_of
from vlmcompile.runtime.wire import floats

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
Data = Callable[[int], Mapping[str, Any]] | Iterable[Mapping[str, Any]]
"""Global batches: a function of the step number, or an iterable giving one per step."""


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """What to train for and how. The defaults are Megatron-LM's for a VLM's fine-tuning stage:
    AdamW (0.9, 0.95), linear warm-up then cosine decay to a tenth, global norm clip 1.0."""

    steps: int
    lr: float = 1e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    decay_steps: int | None = None
    """The step the LR's decay ends at, counted from step 0 (None: ``steps``). Fix it to train a
    run further than first planned: a run resumes only under the LR schedule it was saved with."""
    min_lr_ratio: float = 0.1
    max_grad_norm: float | None = 1.0
    """None: no clipping (the norm is still measured and logged)."""
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    """Save every this many steps (0: only after the last step, when ``checkpoint_dir`` is set)."""
    keep_last: int | None = None
    """Keep only this many of the newest checkpoints of the run's directory (None: keep all)."""
    resume: bool = False
    """Continue from the newest checkpoint in ``checkpoint_dir`` (from step 0 if there is none)."""
    overwrite: bool = False
    """Delete the checkpoints ``checkpoint_dir`` holds and start at step 0 (without it, or
    ``resume``, a directory holding checkpoints is refused)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient norm is NaN or infinite: stop before the optimizer step,
    naming the step and the batch's non-finite values ("stop"), or leave the weights, the
    optimizer and the LR schedule as they are and go on ("skip", counted in the metrics)."""
    log_jsonl: str | None = None
    """Rank 0 appends one JSON object per step here."""
    progress: bool | None = None
    """Rank 0 draws a progress bar (None: when stderr is a terminal)."""
    measure_memory: Literal["once", "every", "off"] = "once"
    """Which steps measure each rank's peak tensor memory on CPU ranks (GPUs measure every step,
    for free): "once", the run's first step with optimizer states (its second, or a resumed run's
    first), "every" step (each measured CPU step takes longer: :mod:`vlmcompile.runtime.memory`),
    or "off"."""

    @user_facing
    def __post_init__(self):
        positive_int("steps", self.steps, "the number of training steps")
        positive_number("lr", self.lr, "the peak learning rate")
        if not 0 <= self.weight_decay < math.inf:
            raise ArgumentError(f"weight_decay={self.weight_decay}; give a finite number, 0 or more")
        positive_number("eps", self.eps, "AdamW's epsilon")
        if not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise ArgumentError(f"betas={self.betas} must be two numbers in [0, 1)")
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            raise ArgumentError(f"warmup_steps={self.warmup_steps} must be between 0 and steps={self.steps}")
        if self.decay_steps is not None and self.decay_steps < self.warmup_steps:
            raise ArgumentError(
                f"decay_steps={self.decay_steps} is shorter than warmup_steps={self.warmup_steps}"
            )
        if self.decay not in ("cosine", "linear", "constant"):
            raise ArgumentError(f"decay={self.decay!r}; give 'cosine', 'linear' or 'constant'")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ArgumentError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.max_grad_norm is not None:
            positive_number(
                "max_grad_norm", self.max_grad_norm, "the global gradient norm to clip to, or None"
            )
        if self.checkpoint_every < 0:
            raise ArgumentError(f"checkpoint_every={self.checkpoint_every} is negative")
        if self.keep_last is not None:
            positive_int("keep_last", self.keep_last, "how many of the newest checkpoints to keep, or None")
        if (self.checkpoint_every or self.resume or self.overwrite) and not self.checkpoint_dir:
            raise ArgumentError("checkpoint_every, resume and overwrite need a checkpoint_dir")
        if self.resume and self.overwrite:
            raise ArgumentError("resume and overwrite contradict each other: give one")
        check_start(self.checkpoint_dir, resume=self.resume, overwrite=self.overwrite)
        if self.on_nonfinite not in ("stop", "skip"):
            raise ArgumentError(f"on_nonfinite={self.on_nonfinite!r}; give 'stop' or 'skip'")
        if self.measure_memory not in ("once", "every", "off"):
            raise ArgumentError(f"measure_memory={self.measure_memory!r}; give 'once', 'every' or 'off'")

    def lr_factor(self, step: int) -> float:
        """The LR at ``step`` (0-based) over ``lr``: linear warm-up, then the decay to ``min_lr_ratio``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        span = max(1, (self.decay_steps or self.steps) - self.warmup_steps)
        done = min(1.0, (step - self.warmup_steps) / span)
        shape = 0.5 * (1 + math.cos(math.pi * done)) if self.decay == "cosine" else 1 - done
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * shape

    def adamw(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
        )

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor)

    @property
    def schedule(self) -> dict[str, Any]:
        """What decides each step's LR: a run resumes only under the same."""
        return {
            "lr": self.lr,
            "warmup_steps": self.warmup_steps,
            "decay": self.decay,
            "decay_steps": self.decay_steps or self.steps,
            "min_lr_ratio": self.min_lr_ratio,
        }


@dataclass(frozen=True, slots=True)
class StepMetrics:
    step: int
    """1-based: the step just finished."""
    loss: float
    lr: float
    grad_norm: float
    """Before clipping, over the whole model."""
    step_s: float
    """Rank 0's wall time of the step, forward to optimizer update (the loss all-reduce ends it
    on every rank together)."""
    samples_per_s: float
    tokens_per_s: float
    """LLM positions per second (text and image tokens, padding included, as Megatron-LM counts)."""
    mfu: float
    """Model FLOPs (forward + backward, no recompute) per second over the world's peak."""
    peak_mem_bytes: tuple[int, ...]
    """Per rank: the most memory it held in the step's forward and backward (GPU: allocated by
    torch; CPU: the process's peak resident set so far, which only grows)."""
    peak_tensor_bytes: tuple[int, ...] | None = None
    """Per rank: the most tensor memory it held in the step, forward to optimizer update
    (:mod:`vlmcompile.runtime.memory`); None: not measured this step
    (:attr:`TrainConfig.measure_memory`)."""
    predicted_peak_bytes: tuple[int, ...] | None = None
    """Per rank: the plan's predicted peak memory for the precision trained in (the simulator's,
    states and activations), beside a measured ``peak_tensor_bytes``."""
    skipped_steps: int = 0
    """Steps skipped so far for a non-finite loss or gradient norm (``on_nonfinite="skip"``),
    this one included."""
    skipped: bool = False
    """This step was skipped: the weights, the optimizer and the LR schedule did not move."""
    samples: int = 0
    """Samples of the step (packed data: those carried in and its own not deferred); a skipped
    step's are left out of training."""
    deferred_samples: int = 0
    """Packed data: samples of this step's global batch that fit in none of its microbatches,
    moved to the next step."""
    schedule: str | None = None
    """Where the step's schedule came from (``re-planned``, ``static``, ``last good``: see
    :class:`~vlmcompile.ir.packed.BatchPlan`; `` (late)`` where a try overran the time limit and
    went unused); None: the plan's, not re-planned."""
    planned_step_s: float | None = None
    """The cost model's step for this batch under its schedule (a prediction)."""
    solve_s: float | None = None
    """Host seconds its schedule took to make (one step ahead, beside the step before)."""

    def __str__(self) -> str:
        if self.skipped:
            return (
                f"step {self.step}: skipped: loss {self.loss:.4f}, grad norm {self.grad_norm:.3f} "
                f"({self.skipped_steps} skipped so far)"
            )
        return (
            f"step {self.step}: loss {self.loss:.4f}, lr {self.lr:.3g}, grad norm {self.grad_norm:.3f}, "
            f"{self.step_s:.3f} s, {self.samples_per_s:.1f} samples/s, {_rate(self.tokens_per_s)} tokens/s, "
            f"MFU {100 * self.mfu:.1f} %, peak mem {_gib(max(self.peak_mem_bytes, default=0))} GiB"
            + (
                f", {self.deferred_samples} sample{'s' if self.deferred_samples > 1 else ''} deferred to the next step"
                if self.deferred_samples
                else ""
            )
            + (
                _memory_line(self.peak_tensor_bytes, self.predicted_peak_bytes)
                if self.peak_tensor_bytes
                else ""
            )
            + (
                f", schedule {self.schedule} (predicted {self.planned_step_s:.3f} s, made in "
                f"{1e3 * self.solve_s:.0f} ms)"
                if self.schedule is not None
                else ""
            )
        )


@dataclass(frozen=True, slots=True)
class TrainResult:
    steps: tuple[StepMetrics, ...]
    resumed_from: int
    """The step the run started from (0, or a checkpoint's)."""
    checkpoints: tuple[str, ...] = ()
    """The checkpoints this run saved that are still there (``keep_last`` removes older ones)."""
    stopped_by: str | None = None
    """The signal that stopped the run early (SIGTERM, SIGUSR1), after saving; None: it ran
    every step."""
    epochs: float | None = None
    """Epochs of the dataset the run's stream of samples had reached at its end (None: data
    given as a function of the step)."""

    @property
    def samples(self) -> int:
        """Samples the run trained (not those of steps skipped as non-finite)."""
        return sum(m.samples for m in self.steps if not m.skipped)

    @property
    def skipped_samples(self) -> int:
        """Samples of the steps skipped as non-finite: left out of training."""
        return sum(m.samples for m in self.steps if m.skipped)

    @property
    def deferred_at_end(self) -> int:
        """Samples the last step left for the next: untrained, they open it when the run goes on."""
        return self.steps[-1].deferred_samples if self.steps else 0

    @property
    def skipped_steps(self) -> int:
        return self.steps[-1].skipped_steps if self.steps else 0

    @property
    def losses(self) -> list[float]:
        return [m.loss for m in self.steps]

    def medians(self) -> dict[str, float]:
        """The median of each rate over the same steps: all but the first (which pays for warm-up)
        when there are several."""
        timed = [m for m in self.steps[1:] or self.steps if not m.skipped] or self.steps
        return {
            key: statistics.median(getattr(m, key) for m in timed)
            for key in ("step_s", "samples_per_s", "tokens_per_s", "mfu")
        }

    def __str__(self) -> str:
        if not self.steps:
            return f"nothing to train: the checkpoint is at step {self.resumed_from} already"
        first, last = self.steps[0], self.steps[-1]
        m = self.medians()
        which = f"steps {first.step + 1}-{last.step}" if len(self.steps) > 1 else f"step {first.step}"
        peak = max(max(s.peak_mem_bytes, default=0) for s in self.steps)
        return (
            f"trained steps {first.step}-{last.step}: loss {first.loss:.4f} -> {last.loss:.4f}; "
            f"medians over {which}: step {m['step_s']:.3f} s, {m['samples_per_s']:.2f} samples/s, "
            f"{_rate(m['tokens_per_s'])} tokens/s, MFU {100 * m['mfu']:.1f} %; peak memory {_gib(peak)} GiB "
            "on the busiest rank"
            + self._tensors_line()
            + f"; {self._samples_line()}"
            + (f"; {self.skipped_steps} steps skipped (non-finite)" if self.skipped_steps else "")
            + (f"; checkpoints: {', '.join(self.checkpoints)}" if self.checkpoints else "")
            + (f"; stopped early by {self.stopped_by}" if self.stopped_by else "")
        )

    def _tensors_line(self) -> str:
        """The measured peak tensor memory against the plan's prediction, on the rank and step
        that held the most (empty where no step measured it)."""
        measured = [s for s in self.steps if s.peak_tensor_bytes]
        if not measured:
            return ""
        top = max(measured, key=lambda s: max(s.peak_tensor_bytes))
        return f"; tensors at their peak (step {top.step})" + _memory_line(
            top.peak_tensor_bytes, top.predicted_peak_bytes
        ).removeprefix(", tensors")

    def _samples_line(self) -> str:
        deferred = [m.deferred_samples for m in self.steps]
        left = (
            f"{self.skipped_samples} left out in skipped steps"
            if self.skipped_samples
            else "no sample left out"
        )
        line = f"{self.samples} samples trained" + (
            f" ({self.epochs:.2f} epochs of the dataset in all, {left})" if self.epochs is not None else ""
        )
        if self.epochs is None and self.skipped_samples:
            line += f" ({left})"
        if any(deferred):
            line += (
                f", at most {max(deferred)} deferred to a step's next; {self.deferred_at_end} left by the last "
                "step (they open the next when the run goes on)"
            )
        return line


def _memory_line(measured: tuple[int, ...], predicted: tuple[int, ...] | None) -> str:
    """The peak tensor memory of the rank that held the most, against its prediction."""
    rank = max(range(len(measured)), key=measured.__getitem__)
    line = f", tensors {format_bytes(measured[rank])} on rank {rank}"
    if predicted:
        line += f" (predicted {format_bytes(predicted[rank])}, {memory_error(measured[rank], predicted[rank]):+.0%})"
    return line


def memory_error(measured: float, predicted: float) -> float:
    """Predicted over measured, less one: +10 % predicts a tenth more than the rank held."""
    return predicted / measured - 1 if measured else 0.0


def _rate(x: float) -> str:
    return f"{x / 1e3:.1f} K" if x >= 1e4 else f"{x:.0f}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


@dataclass(slots=True)
class Throughput:
    """What a step's measurements are read against: what turns its time into samples/s and MFU,
    and the plan's predicted peak memory."""

    global_batch: int
    flops_per_sample: float
    """Forward + backward FLOPs of one sample (no recompute)."""
    peak_flops_per_s: float
    """Of one device."""
    tokens_per_sample: int = 0
    """LLM positions of one sample (its sequence length, image tokens included)."""
    world_size: int = 1
    peak_of: str = ""
    """The device whose peak MFU is over."""
    predicted_peak_bytes: tuple[int, ...] = ()
    """Per global rank: the plan's predicted peak memory, for the precision trained in."""

    def mfu(self, step_s: float) -> float:
        capacity = step_s * self.world_size * self.peak_flops_per_s
        return self.global_batch * self.flops_per_sample / capacity if capacity > 0 else 0.0


def train_on_rank(
    runner: PipelineRunner,
    data: Data,
    config: TrainConfig,
    throughput: Throughput,
    optimizer: OptimizerFactory | None = None,
    scheduler: SchedulerFactory | None = None,
    start: Start | None = None,
) -> TrainResult:
    """Train ``config.steps`` steps on this rank (every rank calls it with the same arguments).
    ``start``: where the run starts, decided by the process that holds the checkpoint directory
    (the local launcher's); None: this call claims it (rank 0 does, under torchrun)."""
    with contextlib.ExitStack() as held:
        if start is None:
            start = held.enter_context(claim_for(config, None))
        # On local ranks the launcher passes stop requests on (SIGUSR1) and stops the ranks itself
        # at a second; a SIGTERM to the job's whole process group reaches them too, as a request.
        local = os.environ.get(LOCAL_RANK_ENV) == "1"
        held.enter_context(preemption.stop_requests(second_stops=not local))
        return _train(runner, data, config, throughput, optimizer, scheduler, start)


def _schedule_metrics(batch: Any) -> dict[str, Any]:
    planned = getattr(batch, "schedule", None)
    if planned is None:
        return {}
    source = planned.source + (" (late)" if planned.late and planned.source != "last good" else "")
    return {"schedule": source, "planned_step_s": planned.step_s, "solve_s": planned.solve_s}


def claim_for(config: TrainConfig, checkpoint_bytes: int | None):
    """:func:`~vlmcompile.runtime.checkpoint_dir.claim` of ``config``'s paths, with the number of
    checkpoints the run keeps at most."""
    saves = kept_saves(config.steps, 0, config.checkpoint_every, config.keep_last)
    return claim(
        config.checkpoint_dir,
        resume=config.resume,
        overwrite=config.overwrite,
        log_jsonl=config.log_jsonl,
        checkpoint_bytes=checkpoint_bytes,
        saves=saves,
    )


def _train(runner, data, config, throughput, optimizer, scheduler, start: Start) -> TrainResult:
    opt = make_optimizer(
        _optimized_parameters(runner), optimizer or config.adamw, shards=runner.groups.shards
    )
    sched = (scheduler or config.scheduler)(opt)
    first = 0
    if start.checkpoint is not None:
        first = checkpoint.load(start.checkpoint, runner, opt, sched, config.schedule)
    log = _StepLog(runner.rank == 0, config, start)
    memory = StepMemory(runner.device)
    saves = RunSaves(
        config, runner, opt, sched, data, log, start, (DataError, BatchError, NonFiniteStepError)
    )
    out: list[StepMetrics] = []
    skipped = 0
    stopped_by = None
    batches = _batches(data, first)
    upcoming = None
    for step in range(first, config.steps):
        began = time.perf_counter()  # the step's data is part of it, as in Megatron-LM's iteration time
        if runner.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(runner.device)
        with saves.on_failure(step):
            batch = upcoming or _checked_batch(runner, step, lambda: next(batches, None))
            if batch is None:
                raise ArgumentError(
                    f"the data ran out after {step} global batches; config.steps={config.steps}"
                )
            # A plan that runs a frozen encoder's forwards one batch ahead takes the next batch now.
            ahead = runner.plan.ahead and step + 1 < config.steps
            upcoming = _checked_batch(runner, step + 1, lambda: next(batches, None)) if ahead else None
        opt.zero_grad(set_to_none=True)
        measured = _measures(config, step, first, runner.device)
        with memory.window(measured, held=held_tensors(runner, opt) if measured else ()):
            loss = float(runner.step(batch, next_batch=upcoming))
            stats = clip_grad_norm(runner, config.max_grad_norm, _peak_memory(runner), preemption.requested())
            lr = opt.param_groups[0]["lr"]
            finite = math.isfinite(loss) and math.isfinite(stats.norm)
            if finite:
                opt.step()
        peaks = _every_rank(runner, memory.peak_bytes) if measured else None
        if finite:
            sched.step()
        elif config.on_nonfinite == "skip":
            opt.zero_grad(set_to_none=True)
            skipped += 1
        else:  # every rank has the same loss and norm, so every rank stops here, alike
            opt.zero_grad(set_to_none=True)
            with saves.on_failure(step):
                raise NonFiniteStepError(_non_finite(runner, step, loss, stats.norm, batch, data))
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)  # the update's kernels are part of the step
        metrics = _step_metrics(
            step, loss, lr, stats, time.perf_counter() - began, batch, throughput, skipped, finite, peaks
        )
        out.append(metrics)
        log.write(metrics)
        stopped_by = stats.stop_signal
        last = step + 1 == config.steps or stopped_by is not None
        if config.checkpoint_dir and (
            last or (config.checkpoint_every and (step + 1) % config.checkpoint_every == 0)
        ):
            saves.save(step + 1)
        if stopped_by is not None:
            log.stopped(
                stopped_by, step + 1, saves.saved[-1] if saves.saved and config.checkpoint_dir else None
            )
            break
    log.close()
    done = out[-1].step if out else first
    return TrainResult(tuple(out), first, tuple(saves.kept), stopped_by, epochs_of(data, done))


def _step_metrics(
    step, loss, lr, stats: StepStats, step_s: float, batch, throughput, skipped: int, finite: bool, peaks
) -> StepMetrics:
    # A packed step's samples are not its microbatches: count the samples it trained.
    samples = batch.num_samples if isinstance(batch, PackedBatch) else throughput.global_batch
    return StepMetrics(
        step=step + 1,
        loss=loss,
        lr=float(lr),
        grad_norm=stats.norm,
        step_s=step_s,
        samples_per_s=samples / step_s,
        tokens_per_s=throughput.global_batch * throughput.tokens_per_sample / step_s,
        mfu=throughput.mfu(step_s),
        peak_mem_bytes=stats.peak_mem_bytes,
        peak_tensor_bytes=peaks,
        predicted_peak_bytes=(throughput.predicted_peak_bytes or None) if peaks else None,
        skipped_steps=skipped,
        skipped=not finite,
        samples=samples,
        deferred_samples=len(batch.deferred) if isinstance(batch, PackedBatch) else 0,
        **_schedule_metrics(batch),
    )


def stop_line(signal_name: str, step: int, steps: int, saved: str | None) -> str:
    """What a run stopped by a signal says."""
    then = f"saved {saved}; resume goes on from there" if saved else "nothing saved (no checkpoint directory)"
    return f"stopped by {signal_name} after step {step} of {steps}: {then}"


class NonFiniteStepError(VlmCompileError, ArithmeticError):
    """A step's loss or gradient norm was NaN or infinite; it was stopped before the optimizer
    step, so no weight changed."""


def _non_finite(runner: PipelineRunner, step: int, loss: float, norm: float, batch, data: Data) -> str:
    """Why step ``step`` (0-based) stopped: its figures, the batch's non-finite values (the
    samples that hold them, and the data-parallel rank whose shard does), or its want of labels."""
    global_batch = runner.plan.global_batch
    if isinstance(batch, PackedBatch):
        named = getattr(data, "nonfinite", None)  # packed data names its samples by dataset index
        where = "; ".join(named(step) if callable(named) else ()) or _non_finite_microbatches(
            batch, runner.plan.num_microbatches
        )
        labels = [mb.get("labels") for mb in batch.microbatches]
    else:
        where = _non_finite_values(batch, global_batch, runner.parallel.dp)
        labels = [batch.get("labels")]
    if where:
        cause = f"{where}; fix or drop those samples"
    elif all(isinstance(x, torch.Tensor) and not bool((x != IGNORE_INDEX).any()) for x in labels):
        cause = (
            "the global batch has no label token (every label is -100), so its loss is 0/0: give its samples "
            "labels, or drop them"
        )
    else:
        cause = "the batch is finite, so the model diverged or overflowed: lower the LR, warm up longer or clip harder"
    return (
        f"step {step + 1}: the loss is {loss} and the gradient norm {norm}: stopped before the optimizer step, "
        f"so no weight changed. {cause}. To skip such steps instead, give --skip-nonfinite-steps "
        "(on_nonfinite='skip')"
    )


def _non_finite_microbatches(batch: PackedBatch, per_rank: int) -> str:
    """Where a packed step holds NaN or infinite values: each microbatch and key, and the
    data-parallel rank that runs it."""
    parts = []
    for k, microbatch in enumerate(batch.microbatches):
        bad = nonfinite_keys(microbatch)
        if bad:
            parts.append(
                f"packed microbatch {k} holds NaN or infinite values in {bad} (data-parallel rank {k // per_rank})"
            )
    return "; ".join(parts)


def _non_finite_values(batch: Mapping[str, Any], global_batch: int, dp: int) -> str:
    """Where the batch holds NaN or infinite values: each key, its samples (the first five) and
    the data-parallel ranks whose shards hold them (a key with several rows per sample, such as
    several images each, counted by sample)."""
    parts = []
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() == 0:
            continue
        bad = ~torch.isfinite(value).reshape(value.shape[0], -1).all(dim=1)
        if not bad.any():
            continue
        per_sample = max(1, value.shape[0] // global_batch)
        rows = sorted({r // per_sample for r in bad.nonzero().flatten().tolist()})
        shard = max(1, global_batch // dp)
        ranks = sorted({r // shard for r in rows})
        parts.append(
            f"batch[{key!r}] holds NaN or infinite values in sample{'s' if len(rows) > 1 else ''} "
            f"{', '.join(map(str, rows[:5]))}{', ...' if len(rows) > 5 else ''} (the shard of data-parallel "
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
        )
    return "; ".join(parts)


def check_trainable(runner: PipelineRunner) -> None:
    """Refuse a model whose every parameter is frozen: training it would do nothing."""
    if not any(p.requires_grad for stage in runner.stages_all for p in stage.parameters()):
        raise ArgumentError(
            "every parameter of the model has requires_grad=False: there is nothing to train; unfreeze "
            "what should train (module.requires_grad_(True)) before compile"
        )


def _optimized_parameters(runner: PipelineRunner) -> list[torch.nn.Parameter]:
    """What the optimizer is built over: the rank's trainable parameters (a frozen one never has a
    gradient, so it never has optimizer state either). A rank that holds frozen ones only (a
    frozen encoder's stage) still gets an optimizer, over them: it steps nothing, as in eager."""
    check_trainable(runner)
    return runner.trainable_parameters() or runner.parameters()


def check_first_batch(runner: PipelineRunner, data: Data, step: int = 0) -> None:
    """The first step's global batch (``step``, 0-based: a resumed run's) checked against the
    compiled shapes, before any rank starts (data that is an iterator is left alone: reading it
    would consume the batch)."""
    if callable(data):
        _checked_batch(runner, step, lambda: data(step))
    elif isinstance(data, Sequence):
        _checked_batch(runner, step, lambda: data[step] if step < len(data) else None)


def _checked_batch(
    runner: PipelineRunner, step: int, get: Callable[[], Mapping[str, Any] | None]
) -> Mapping[str, Any] | None:
    """Step ``step``'s global batch (0-based; None when the data ran out), checked against the
    compiled shapes; an error names the 1-based step being trained."""
    try:
        batch = get()
        if batch is not None:
            runner.check_batch(batch)
    except VlmCompileError as err:  # a collate failure, or a batch of other shapes
        raise type(err)(f"the data's global batch for step {step + 1}: {err}") from None
    return batch


def _measures(config: TrainConfig, step: int, first: int, device: torch.device) -> bool:
    """Whether ``step`` (0-based; the run starts at ``first``) measures peak tensor memory: alike
    on every rank (the peaks are all-reduced)."""
    if config.measure_memory == "off":
        return False
    if config.measure_memory == "every" or device.type == "cuda":
        return True
    # The second step holds the optimizer's states, which the first makes at its end.
    return step == min(first + 1, config.steps - 1)


def held_tensors(runner: PipelineRunner, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a rank holds between steps: parameters, gradients, buffers, optimizer states, the
    gradient reductions' buffers, outputs made a batch ahead."""
    params = runner.parameters()
    states = [
        t for state in local_states(optimizer).values() for t in state.values() if isinstance(t, torch.Tensor)
    ]
    buffers = [b for stage in runner.stages.values() for b in stage.buffers()]
    # the gradient reductions' flat buffers, kept from the steps before
    reductions = [*runner.reduction.buffers(), *runner._flat.values()]
    carried = [
        t
        for out in (runner.run_ahead.carry.outputs.values() if runner.run_ahead.carry else ())
        for t in floats(out)
    ]
    return [
        *params,
        *(p.grad for p in params if p.grad is not None),
        *buffers,
        *states,
        *reductions,
        *carried,
    ]


def _every_rank(runner: PipelineRunner, value: int | None) -> tuple[int, ...]:
    """Every rank's ``value`` (one all-reduce; float64 holds byte counts exactly)."""
    out = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=runner.device)
    out[runner.rank] = value or 0
    runner._wait(dist.all_reduce(out, async_op=True), "the peak-memory all-reduce")
    return tuple(int(x) for x in out.tolist())


def _peak_memory(runner: PipelineRunner) -> int:
    """This rank's peak memory of the step so far (its forward and backward)."""
    if runner.device.type == "cuda":
        return torch.cuda.max_memory_allocated(runner.device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass(frozen=True, slots=True)
class StepStats:
    """What the step's one all-reduce after the backward brings every rank."""

    norm: float
    """The global gradient norm before clipping."""
    peak_mem_bytes: tuple[int, ...]
    """Every rank's peak memory."""
    stop_signal: str | None
    """A stop signal some rank received (SIGTERM, SIGUSR1), None if none did: every rank stops
    after this step."""


def clip_grad_norm(
    runner: PipelineRunner, max_norm: float | None, peak_mem_bytes: int = 0, stop_signal: int = 0
) -> StepStats:
    """Scale this rank's gradients so the norm over the whole model is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does on the eager model; the norm's all-reduce also carries
    every rank's ``peak_mem_bytes`` and ``stop_signal`` (one collective, not three). A non-finite
    norm clips nothing: that step is stopped or skipped."""
    owned, all_grads = [], []
    owners = runner.parameter_owners()
    for p in runner.trainable_parameters():
        if p.grad is None:
            continue
        all_grads.append(p.grad)
        if owners[id(p)]:
            owned.append(p.grad)
    device = all_grads[0].device if all_grads else runner.device
    world = dist.get_world_size()
    # [sum of squares, each rank's peak memory, each rank's stop signal]: float64 holds byte
    # counts exactly.
    sums = torch.zeros(1 + 2 * world, dtype=torch.float64, device=device)
    for g in owned:
        sums[0] += g.detach().double().pow(2).sum()
    sums[1 + runner.rank] = peak_mem_bytes
    sums[1 + world + runner.rank] = stop_signal
    runner._wait(dist.all_reduce(sums, async_op=True), "the gradient-norm all-reduce")
    norm = math.sqrt(float(sums[0]) / runner.parallel.dp)
    if max_norm is not None and all_grads and math.isfinite(norm):
        coefficient = max_norm / (norm + 1e-6)  # clip_grad_norm_'s
        if coefficient < 1:
            torch._foreach_mul_(all_grads, coefficient)
    values = sums.tolist()
    signals = [int(x) for x in values[1 + world :] if x]
    return StepStats(
        norm=norm,
        peak_mem_bytes=tuple(int(x) for x in values[1 : 1 + world]),
        stop_signal=signal.Signals(signals[0]).name if signals else None,
    )


def _batches(data: Data, start: int) -> Iterator[Mapping[str, Any]]:
    """Global batches from step ``start`` on (an iterable is advanced past the first ``start``)."""
    if callable(data) and not isinstance(data, Iterable):
        step = start
        while True:
            yield data(step)
            step += 1
    it = iter(data)
    for _ in range(start):
        if next(it, None) is None:
            return
    yield from it


class _StepLog:
    """Rank 0's per-step output: a progress bar with an ETA on a terminal (else a line every
    step), a line per checkpoint saved, and JSON lines on request."""

    def __init__(self, active: bool, config: TrainConfig, start: Start):
        self.active = active
        self.total = config.steps
        self.times: list[float] = []
        self.bar = active and (config.progress if config.progress is not None else sys.stderr.isatty())
        self.jsonl = open(config.log_jsonl, "a") if active and config.log_jsonl else None  # noqa: SIM115
        if active and start.note:
            print(start.note, file=sys.stderr, flush=True)

    def write(self, m: StepMetrics) -> None:
        if not self.active:
            return
        self.times.append(m.step_s)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(asdict(m)) + "\n")
            self.jsonl.flush()
        if self.bar:
            width = 30
            done = int(width * m.step / self.total)
            sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {m}, ETA {self.eta(m.step)}")
            if m.step == self.total:
                sys.stderr.write("\n")
        else:
            print(m, file=sys.stderr)
        sys.stderr.flush()

    def eta(self, step: int) -> str:
        """The steps left at the median step time so far (the first step's warm-up left out)."""
        timed = self.times[1:] or self.times
        left = (self.total - step) * statistics.median(timed)
        return f"{int(left // 60)}:{int(left % 60):02d}" if left < 3600 else f"{left / 3600:.1f} h"

    def saved(self, path: str, took_s: float, removed: list[str]) -> None:
        if not self.active:
            return
        size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        line = f"saved checkpoint {path} ({size / 2**20:.1f} MiB, {took_s:.1f} s)"
        if removed:
            line += f"; removed {', '.join(removed)} (keep_last)"
        print(("\n" if self.bar else "") + line, file=sys.stderr, flush=True)

    def stopped(self, signal_name: str, step: int, saved: str | None) -> None:
        # On local ranks the launching process got the signal (the ranks, its SIGUSR1): it says so.
        if not self.active or os.environ.get(LOCAL_RANK_ENV) == "1":
            return
        print(
            ("\n" if self.bar else "") + stop_line(signal_name, step, self.total, saved),
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()


def eager_training(
    model: torch.nn.Module,
    data: Data,
    config: TrainConfig,
    device: str = "cpu",
    optimizer_factory: OptimizerFactory | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> list[float]:
    """The losses of ``config.steps`` steps of the eager loop a user would write: the same
    optimizer (AdamW by default) and LR schedule, ``clip_grad_norm_`` over the model, the same
    batches (on ``device``), a step with a non-finite loss or norm skipped when
    ``config.on_nonfinite`` says so, the forward under ``torch.autocast`` in ``autocast_dtype``
    (None: none); ``model`` is trained. What :func:`train_on_rank` must equal."""
    optimizer = (optimizer_factory or config.adamw)(list(model.parameters()))
    scheduler = config.scheduler(optimizer)
    batches = _batches(data, 0)
    losses = []
    for _ in range(config.steps):
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in next(batches).items()}
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, autocast_dtype, enabled=autocast_dtype is not None):
            out = model(**batch)
        loss = out if isinstance(out, torch.Tensor) else out.loss  # transformers' ModelOutput
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm or math.inf)
        losses.append(float(loss.detach()))
        if config.on_nonfinite == "skip" and not (math.isfinite(losses[-1]) and math.isfinite(norm)):
            continue  # Megatron-LM's skipped iteration: no update, the LR schedule does not move
        optimizer.step()
        scheduler.step()
    return losses
