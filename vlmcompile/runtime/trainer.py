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

import json
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from vlmcompile.ir.errors import ArgumentError, VlmCompileError, positive_int, positive_number
from vlmcompile.runtime import checkpoint
from vlmcompile.runtime.executor import PipelineRunner

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
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
    """Continue from the latest checkpoint in ``checkpoint_dir`` (from step 0 if there is none)."""
    log_jsonl: str | None = None
    """Rank 0 appends one JSON object per step here."""
    progress: bool | None = None
    """Rank 0 draws a progress bar (None: when stderr is a terminal)."""

    def __post_init__(self):
        positive_int("steps", self.steps, "the number of training steps")
        positive_number("lr", self.lr, "the peak learning rate")
        if self.weight_decay < 0:
            raise ArgumentError(f"weight_decay={self.weight_decay} is negative; give 0 or more")
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
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ArgumentError("checkpoint_every and resume need a checkpoint_dir")

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

    def __str__(self) -> str:
        return (
            f"step {self.step}: loss {self.loss:.4f}, lr {self.lr:.3g}, grad norm {self.grad_norm:.3f}, "
            f"{self.step_s:.3f} s, {self.samples_per_s:.1f} samples/s, {_rate(self.tokens_per_s)} tokens/s, "
            f"MFU {100 * self.mfu:.1f} %, peak mem {_gib(max(self.peak_mem_bytes, default=0))} GiB"
        )


@dataclass(frozen=True, slots=True)
class TrainResult:
    steps: tuple[StepMetrics, ...]
    resumed_from: int
    """The step the run started from (0, or a checkpoint's)."""
    checkpoints: tuple[str, ...] = ()
    """The checkpoints this run saved that are still there (``keep_last`` removes older ones)."""

    @property
    def losses(self) -> list[float]:
        return [m.loss for m in self.steps]

    def medians(self) -> dict[str, float]:
        """The median of each rate over the same steps: all but the first (which pays for warm-up)
        when there are several."""
        timed = self.steps[1:] or self.steps
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
            + (f"; checkpoints: {', '.join(self.checkpoints)}" if self.checkpoints else "")
        )


def _rate(x: float) -> str:
    return f"{x / 1e3:.1f} K" if x >= 1e4 else f"{x:.0f}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


@dataclass(slots=True)
class Throughput:
    """What turns a step time into samples/s and MFU."""

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
) -> TrainResult:
    """Train ``config.steps`` steps on this rank (every rank calls it with the same arguments)."""
    opt = (optimizer or config.adamw)(_optimized_parameters(runner))
    sched = (scheduler or config.scheduler)(opt)
    start = 0
    if config.resume:
        found = checkpoint.latest_on_every_rank(config.checkpoint_dir)
        if found is not None:
            start = checkpoint.load(found, runner, opt, sched, config.schedule)
    log = _StepLog(runner.rank == 0, config, start)
    out, saved = [], []
    batches = _batches(data, start)
    for step in range(start, config.steps):
        began = time.perf_counter()  # the step's data is part of it, as in Megatron-LM's iteration time
        if runner.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(runner.device)
        batch = _checked_batch(runner, step, lambda: next(batches, None))
        if batch is None:
            raise ArgumentError(f"the data ran out after {step} global batches; config.steps={config.steps}")
        opt.zero_grad(set_to_none=True)
        loss = runner.step(batch)
        norm, peak_mem = clip_grad_norm(runner, config.max_grad_norm, _peak_memory(runner))
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)  # the update's kernels are part of the step
        step_s = time.perf_counter() - began
        metrics = StepMetrics(
            step=step + 1,
            loss=float(loss),
            lr=float(lr),
            grad_norm=norm,
            step_s=step_s,
            samples_per_s=throughput.global_batch / step_s,
            tokens_per_s=throughput.global_batch * throughput.tokens_per_sample / step_s,
            mfu=throughput.mfu(step_s),
            peak_mem_bytes=peak_mem,
        )
        out.append(metrics)
        log.write(metrics)
        last = step + 1 == config.steps
        if config.checkpoint_dir and (
            last or (config.checkpoint_every and (step + 1) % config.checkpoint_every == 0)
        ):
            began = time.perf_counter()
            path = checkpoint.save(config.checkpoint_dir, step + 1, runner, opt, sched, config.schedule)
            removed = (
                checkpoint.keep_newest(config.checkpoint_dir, config.keep_last) if runner.rank == 0 else []
            )
            saved = [*saved, path][-(config.keep_last or 0) :]  # the ones still there
            log.saved(path, time.perf_counter() - began, removed)
    log.close()
    return TrainResult(tuple(out), start, tuple(saved))


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


def check_first_batch(runner: PipelineRunner, data: Data) -> None:
    """Step 1's global batch checked against the compiled shapes, before any rank starts (data
    that is an iterator is left alone: reading it would consume the batch)."""
    if callable(data) or isinstance(data, Sequence):
        _checked_batch(runner, 0, lambda: data(0) if callable(data) else data[0] if data else None)


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


def _peak_memory(runner: PipelineRunner) -> int:
    """This rank's peak memory of the step so far (its forward and backward)."""
    if runner.device.type == "cuda":
        return torch.cuda.max_memory_allocated(runner.device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def clip_grad_norm(
    runner: PipelineRunner, max_norm: float | None, peak_mem_bytes: int = 0
) -> tuple[float, tuple[int, ...]]:
    """Scale this rank's gradients so the norm over the whole model is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does on the eager model; returns the norm before, and every
    rank's ``peak_mem_bytes``: the norm's all-reduce carries them (one collective, not two)."""
    owned, all_grads = [], []
    owners = runner.parameter_owners()
    for p in runner.trainable_parameters():
        if p.grad is None:
            continue
        all_grads.append(p.grad)
        if owners[id(p)]:
            owned.append(p.grad)
    device = all_grads[0].device if all_grads else runner.device
    # [sum of squares, each rank's peak memory at its own index]: float64 holds byte counts exactly.
    sums = torch.zeros(1 + dist.get_world_size(), dtype=torch.float64, device=device)
    for g in owned:
        sums[0] += g.detach().double().pow(2).sum()
    sums[1 + runner.rank] = peak_mem_bytes
    runner._wait(dist.all_reduce(sums, async_op=True), "the gradient-norm all-reduce")
    norm = math.sqrt(float(sums[0]) / runner.parallel.dp)
    if max_norm is not None and all_grads:
        coefficient = max_norm / (norm + 1e-6)  # clip_grad_norm_'s
        if coefficient < 1:
            torch._foreach_mul_(all_grads, coefficient)
    return norm, tuple(int(x) for x in sums[1:].tolist())


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

    def __init__(self, active: bool, config: TrainConfig, start: int):
        self.active = active
        self.total = config.steps
        self.times: list[float] = []
        self.bar = active and (config.progress if config.progress is not None else sys.stderr.isatty())
        self.jsonl = open(config.log_jsonl, "a") if active and config.log_jsonl else None  # noqa: SIM115
        if active and start:
            print(f"resumed from the checkpoint at step {start}", file=sys.stderr)

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

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()


def eager_training(
    model: torch.nn.Module,
    data: Data,
    config: TrainConfig,
    device: str = "cpu",
    optimizer_factory: OptimizerFactory | None = None,
) -> list[float]:
    """The losses of ``config.steps`` steps of the eager loop a user would write: the same
    optimizer (AdamW by default) and LR schedule, ``clip_grad_norm_`` over the model, the same
    batches (on ``device``); ``model`` is trained. What :func:`train_on_rank` must equal."""
    optimizer = (optimizer_factory or config.adamw)(list(model.parameters()))
    scheduler = config.scheduler(optimizer)
    batches = _batches(data, 0)
    losses = []
    for _ in range(config.steps):
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in next(batches).items()}
        optimizer.zero_grad(set_to_none=True)
        out = model(**batch)
        loss = out if isinstance(out, torch.Tensor) else out.loss  # transformers' ModelOutput
        loss.backward()
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return losses
