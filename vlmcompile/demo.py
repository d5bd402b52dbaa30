"""``vlmcompile demo``: compile the ``demo`` VLM for 2 local CPU ranks, run our plan and the
baselines' on the same runtime, and compare measurement with eager and with prediction.

Our plan and the pipelined baselines run at the same degrees and microbatches (PP = 2,
microbatches of one sample, the same global batch), each at its fastest predicted v of 1, 2, 3,
4 (:data:`V_CHOICES`; v is a setting each system's user tunes; a baseline held at our v would not be the best its
users run: at 4 microbatches ``megatron_balanced`` is 12 % faster at v = 4 than at v = 1, and
our search may pick v = 1). ``megatron``
is the faster of its even placements (``llava``: the vision encoder, projector and embedding on
stage 0 with an even share of the LLM blocks; ``chain``: encoder and LLM blocks split evenly as
one chain), ``megatron_balanced`` the appendix-B split. Ours is the plan search's: the stage-cut
partition, or the encoders on a plan of their own with their work in the LLM's bubbles,
whichever the simulator predicts faster, over every layout of the 2 ranks (PP = 2, and PP = 1
with DP = 2). ``mimo_colocated`` (Megatron MIMO's colocated layout) runs only at PP = 1, so it is
measured at its own degrees (DP = 2) and said to be.

``--memory-cap`` holds every plan to a memory per rank, as on a GPU the model does not fit whole
on: a size, or a share of what one rank needs to train the whole model alone. A baseline whose
plan does not fit is reported, not run. ``--freeze`` freezes regions or module paths first.

Layer times come from the profile pass on this CPU (one thread per rank), so the prediction is
of this machine. Every plan runs in one launch, step by step, the order reversed every other step,
each on its own copy of the weights: the speed of a shared machine drifts over minutes, and
interleaving puts the drift on every plan alike. Every step time is measured; the first step of
each plan is a warm-up, left out of the median.

Sizes: the default global batch is 8 (8 microbatches on PP = 2; 2 min 44 s on 2 idle cores, 7 min
45 s at load 2-5, measured 2026-11-28), ``full=True`` (``vlmcompile demo --full``) the benchmark's 32. The compile
passes see a sample of the batch (its first samples: the capture pass checks numerics on it and
the profile pass times single samples), the plans are made for the whole global batch, and the
plans and eager train on the whole batch. Every phase prints a line with the elapsed time as it
starts and ends, and each measured step one line with every plan's time.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch
import torch.distributed as dist
from tabulate import tabulate

from vlmcompile import families, model_source
from vlmcompile.compiler import compile, freeze_layers
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import usable_memory_bytes
from vlmcompile.ir.errors import ArgumentError, PlanError
from vlmcompile.ir.layer_graph import format_bytes
from vlmcompile.ir.microbatch import num_samples, rows_per_sample, take
from vlmcompile.passes.planning.policies import plan_and_simulate
from vlmcompile.planning.request import PlanRequest, SearchSpace
from vlmcompile.runtime.launch import launch
from vlmcompile.runtime.timed_steps import interleaved_steps
from vlmcompile.runtime.train_loop import TrainConfig, eager_training
from vlmcompile.sim.simulator import simulate

NUM_RANKS = 2
DEFAULT_GLOBAL_BATCH = 8
"""8 microbatches of one sample on PP = 2 (2 min 44 s on 2 idle cores, 7 min 45 s at load 2-5)."""
FULL_GLOBAL_BATCH = 32
"""``--full``: the batch-32 table of docs/benchmarks.md (4x the default's samples a step)."""
DEFAULT_STEPS = 6
"""A warm-up step and 5 timed steps, the fewest the demo takes (a median of 5)."""
SAMPLE_SIZE = 2
"""Samples the compile passes see: the capture pass runs eager and the captured graph on them and
checks the loss splits into per-sample losses (on the whole batch of 32 that took 2 minutes on a
loaded machine); the annotate pass counts per sample and the profile pass times one sample, so the
plans are the same as from the whole batch."""
ERROR_LIMIT = 0.10
"""The project's goal (docs/benchmarks.md) for every plan's prediction error |predicted - measured| / measured."""


@dataclass(frozen=True, slots=True)
class PlanRun:
    policy: str
    degrees: str
    """e.g. "PP=2 V=1" or, for a plan at other degrees than ours, "DP=2 PP=1"."""
    stages: str
    """Layers per stage, e.g. "9 | 9" (a replicated encoder stage: "4 (x2)")."""
    predicted_s: float
    step_s: tuple[float, ...]
    """Measured wall time of every step (the slowest rank's), warm-up first."""
    losses: tuple[float, ...]
    max_loss_diff: float
    """Largest |loss - eager loss| over the steps."""
    equal_to_eager: bool
    """Every step's loss within torch.testing.assert_close's fp32 tolerance of eager's."""
    peak_gib: float | None = None
    """The simulator's peak memory of the plan's busiest rank."""
    ours_too: bool = False
    """A baseline whose plan is ours (the same stages, ranks and actions, only another policy's
    name): its measured ratio to ours is the machine's noise between two runs of one plan."""

    @property
    def measured_s(self) -> float:
        return statistics.median(self.step_s[1:])

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


@dataclass(frozen=True, slots=True)
class DemoResult:
    global_batch: int
    num_steps: int
    eager_losses: tuple[float, ...]
    runs: tuple[PlanRun, ...]
    """Ours first, then the baselines."""
    command: str = ""
    """The command that measures the same again (the warning names it)."""
    load_avg: float | None = None
    """This machine's 1-minute load average when the demo started (other processes' work)."""
    memory_cap_gib: float | None = None
    """The memory every plan was held to per rank (``--memory-cap``); None: the machine's."""
    not_fitting: Mapping[str, float] = field(default_factory=dict)
    """Baselines whose plan does not fit in the cap, by their predicted peak (GiB): not run."""
    bound_step_s: float | None = None
    """Every rank busy: our plan's compute over the ranks, simulated (no plan at these sizes can
    be faster)."""
    frozen: tuple[str, ...] = ()
    """The layers frozen (``--freeze``), every plan alike."""

    @property
    def ours(self) -> PlanRun:
        return self.runs[0]

    def run_of(self, policy: str) -> PlanRun:
        return next(r for r in self.runs if r.policy == policy)

    def speedup_over(self, policy: str, *, predicted: bool = False) -> float:
        """The baseline's step time over ours: measured (medians), or predicted (simulated)."""
        run = self.run_of(policy)
        if predicted:
            return run.predicted_s / self.ours.predicted_s
        return run.measured_s / self.ours.measured_s

    @property
    def best_baseline(self) -> PlanRun | None:
        """The fastest measured baseline at our PP (each at its own fastest v), else at any
        degrees; None when no baseline fits."""
        return min(self.same_degrees or self.runs[1:], key=lambda r: r.measured_s, default=None)

    @property
    def same_degrees(self) -> tuple[PlanRun, ...]:
        pp = self.ours.degrees.split()[0]  # "PP=2"
        return tuple(r for r in self.runs[1:] if r.degrees.split()[0] == pp)

    @property
    def speedup(self) -> float | None:
        """Measured, over the fastest measured baseline at our PP."""
        best = self.best_baseline
        return self.speedup_over(best.policy) if best else None

    @property
    def predicted_speedup(self) -> float | None:
        """Predicted, over the same baseline as :attr:`speedup` (the fastest measured at our PP)."""
        best = self.best_baseline
        return self.speedup_over(best.policy, predicted=True) if best else None

    @property
    def warning(self) -> str | None:
        return prediction_warning(
            {r.policy: r.error for r in self.runs},
            command=self.command,
            load_avg=self.load_avg,
            steps_s={r.policy: r.step_s[1:] for r in self.runs},
        )

    def to_json(self) -> dict[str, Any]:
        out = {
            **asdict(self),
            "runs": [{**asdict(r), "measured_s": r.measured_s, "error": r.error} for r in self.runs],
            "speedup": self.speedup,
            "predicted_speedup": self.predicted_speedup,
            "best_baseline": self.best_baseline.policy if self.best_baseline else None,
            "warning": self.warning,
            "machine": _machine(),
        }
        for r in self.runs[1:]:
            out[f"speedup_over_{r.policy}"] = self.speedup_over(r.policy)
            out[f"predicted_speedup_over_{r.policy}"] = self.speedup_over(r.policy, predicted=True)
        for policy, peak in self.not_fitting.items():
            out[f"speedup_over_{policy}"] = (
                f"does not fit: {format_bytes(peak * 2**30)} predicted, over the cap"
            )
        return out

    def table(self) -> str:
        rows = [
            [
                r.policy,
                r.degrees,
                r.stages,
                f"{r.predicted_s:.3f}",
                f"{r.measured_s:.3f}",
                f"{100 * r.error:+.1f} %",
                f"{r.losses[0]:.6f}",
                f"{r.max_loss_diff:.1e} ({'equal' if r.equal_to_eager else 'NOT equal'})",
            ]
            for r in self.runs
        ]
        return tabulate(
            rows,
            headers=[
                "plan",
                "degrees",
                "layers per stage",
                "predicted s",
                "measured s (median)",
                "error",
                "loss, step 1",
                "max |loss - eager|",
            ],
            disable_numparse=True,
        )

    def speedup_lines(self) -> list[str]:
        """One line per baseline: our measured speedup over it next to our predicted speedup over
        it; the last line the same for the fastest measured baseline at our degrees."""
        ours = self.ours
        lines = []
        for r in self.runs[1:]:
            if r.ours_too:
                other = ", the same plan as ours"
            else:
                other = "" if r in self.same_degrees else ", not our degrees"
            lines.append(
                f"  over {r.policy} ({r.degrees}{other}): measured {self.speedup_over(r.policy):.2f}x, "
                f"predicted {self.speedup_over(r.policy, predicted=True):.2f}x"
            )
        for policy, peak in self.not_fitting.items():
            lines.append(
                f"  over {policy}: not run, its plan does not fit ({format_bytes(peak * 2**30)} predicted, over the "
                f"{format_bytes(self.memory_cap_gib * 2**30)} cap)"
            )
        best = self.best_baseline
        if best is not None:
            where = ours.degrees.split()[0] if best in self.same_degrees else "any degrees"
            noise = (
                " (its plan is ours: the ratio is the noise between two runs of one plan)"
                if best.ours_too
                else ""
            )
            lines.append(
                f"{ours.policy} over the fastest measured baseline at {where}, {best.policy}: "
                f"measured {self.speedup:.2f}x, predicted {self.predicted_speedup:.2f}x{noise}"
            )
        if self.bound_step_s:
            lines.append(
                f"the bound, every rank busy (our plan's compute over the ranks, simulated): "
                f"{self.bound_step_s:.3f} s; ours predicted {ours.predicted_s / self.bound_step_s:.2f}x of it, "
                f"measured {ours.measured_s / self.bound_step_s:.2f}x"
            )
        return lines

    def __str__(self) -> str:
        equal = all(r.equal_to_eager for r in self.runs)
        held = (
            f", every plan held to {format_bytes(self.memory_cap_gib * 2**30)} per rank"
            if self.memory_cap_gib
            else ""
        )
        frozen = (
            f", {len(self.frozen)} layers frozen ({self.frozen[0]} .. {self.frozen[-1]})"
            if self.frozen
            else ""
        )
        lines = [
            f"{NUM_RANKS} CPU ranks, global batch {self.global_batch} in microbatches of 1, "
            f"{self.num_steps} steps of SGD (first a warm-up, left out of the median){held}{frozen}",
            self.table(),
            f"eager loss, step 1: {self.eager_losses[0]:.6f}; "
            + (
                f"every plan's loss equals eager's at all {self.num_steps} steps"
                if equal
                else "a plan's loss is NOT equal to eager's (see the table)"
            ),
            "",
            f"measured: the median step time of steps 2-{self.num_steps} on {NUM_RANKS} local CPU ranks "
            "(the slowest rank's)",
            "predicted: the simulator's step time, from this CPU's profiled layer times",
            f"speedup of {self.ours.policy} ({self.ours.degrees}), each measured and predicted over the same "
            "baseline (its step time over ours):",
            *self.speedup_lines(),
        ]
        if self.warning:
            lines.append(self.warning)
        return "\n".join(lines)


def prediction_warning(
    errors: Mapping[str, float],
    *,
    command: str,
    load_avg: float | None = None,
    steps_s: Mapping[str, Sequence[float]] | None = None,
    num_cores: int | None = None,
    limit: float = ERROR_LIMIT,
) -> str | None:
    """A warning when any plan's prediction error (policy -> (predicted - measured) / measured) is
    over ``limit`` in size, naming the likely cause and the command that measures again; None
    when every error is within it. ``load_avg`` (the 1-minute load average when the demo started)
    and ``steps_s`` (policy -> its timed steps; the widest spread of a plan over the limit) are
    cited as evidence."""
    over = {p: e for p, e in errors.items() if abs(e) > limit}
    if not over:
        return None
    cores = num_cores or os.cpu_count() or NUM_RANKS
    causes = []
    if any(e < 0 for e in over.values()):
        causes.append(
            "the plans measured slower than predicted: other processes were likely running on "
            f"this machine's {cores} cores while the steps were timed"
        )
    if any(e > 0 for e in over.values()):
        causes.append(
            "the plans measured faster than predicted: other processes were likely running on "
            f"this machine's {cores} cores while the profile pass timed the layers the prediction is built on"
        )
    evidence = []
    if load_avg is not None:
        evidence.append(
            f"the 1-minute load average was {load_avg:.1f} when the demo started (0 on an idle machine)"
        )
    spread = {p: (min(t), max(t)) for p, t in (steps_s or {}).items() if p in over and t}
    if spread:
        p, (low, high) = max(spread.items(), key=lambda kv: kv[1][1] / kv[1][0])
        evidence.append(
            f"{p}'s timed steps ranged from {low:.2f} s to {high:.2f} s (+{100 * (high / low - 1):.0f} %; "
            "on idle cores they agree within a few %)"
        )
    listed = ", ".join(f"{p} {100 * e:+.1f} %" for p, e in over.items())
    return "\n".join(
        [
            f"warning: prediction error over {100 * limit:.0f} % (the goal): {listed}",
            f"  likely cause, a loaded machine: {'; '.join(causes)}",
            *(f"  {line}" for line in evidence),
            f"  re-measure when nothing else runs on the {cores} cores (check with `uptime`): {command}",
        ]
    )


def demo_command(
    global_batch: int,
    num_steps: int,
    *,
    memory_cap: str | None = None,
    freeze: Sequence[str] = (),
    model: str = "demo",
) -> str:
    """The command line that runs the demo at these sizes."""
    extra = (
        (f" --model {model}" if model != "demo" else "")
        + (f" --memory-cap {memory_cap}" if memory_cap else "")
        + (f" --freeze {','.join(freeze)}" if freeze else "")
    )
    if (global_batch, num_steps) == (FULL_GLOBAL_BATCH, DEFAULT_STEPS):
        return f"vlmcompile demo --full{extra}"
    return f"vlmcompile demo --global-batch {global_batch} --steps {num_steps}{extra}"


def _machine() -> str:
    import os
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def eager_losses(model, batch, num_steps: int, lr: float) -> list[float]:
    """The losses of ``num_steps`` eager SGD(lr) steps on the same batch (``model`` is trained):
    the runtime's eager reference loop, at a constant LR without clipping."""
    config = TrainConfig(steps=num_steps, lr=lr, decay="constant", max_grad_norm=None)
    sgd = functools.partial(torch.optim.SGD, lr=lr)
    return eager_training(model, [batch] * num_steps, config, optimizer_factory=sgd)


V_CHOICES = (1, 2, 3, 4)
"""The v each pipelined policy may run at: the plan search's choices for ours, and for a
baseline the one its user would pick (its fastest predicted). The plan search's default v
(1, 2, 4) and 3: the demo model's 18 layers make 6 stages of 3 at v = 3, which Megatron-LM's
interleaved schedule takes as they are (layers per virtual stage a whole number); held to a
memory cap (``--memory-cap 0.6``) it can be ours' fastest."""


def fastest(plans: Iterable[Callable[[], Any]], what: str):
    """The fastest predicted of the plans made by ``plans`` (those that fit first); a plan that
    cannot be made (e.g. v > 1 where the microbatches do not divide over the ranks) is left out."""
    tried = []
    for make in plans:
        try:
            tried.append(make())
        except PlanError:
            continue
    if not tried:
        raise PlanError(f"{what} cannot split the demo model over pp={NUM_RANKS} at any v of {V_CHOICES}")
    return min(tried, key=lambda r: (not r.fits, r.sim.step_time_s))


def megatron_at_best_v(pipe, global_batch: int):
    """Megatron-LM's plan at PP = 2 and our microbatches: the faster of its even placements,
    llava and chain, at the fastest v, as its user would pick."""
    return fastest(
        (
            functools.partial(
                pipe.baseline,
                "megatron",
                tp=1,
                pp=NUM_RANKS,
                v=v,
                global_batch=global_batch,
                microbatch_size=1,
                placement=placement,
            )
            for v in V_CHOICES
            for placement in ("llava", "chain")
        ),
        "Megatron-LM",
    )


def baselines(pipe, global_batch: int) -> list[tuple[str, Any]]:
    """Every baseline the demo measures: Megatron's two policies at PP = 2, each at its fastest
    v, and Megatron MIMO's colocated layout at the only degrees it has (PP = 1, the ranks
    data-parallel)."""
    out = [("megatron", megatron_at_best_v(pipe, global_batch))]
    out.append(
        (
            "megatron_balanced",
            fastest(
                (
                    functools.partial(
                        pipe.baseline,
                        "megatron_balanced",
                        tp=1,
                        pp=NUM_RANKS,
                        v=v,
                        global_batch=global_batch,
                        microbatch_size=1,
                    )
                    for v in V_CHOICES
                ),
                "megatron_balanced",
            ),
        )
    )
    out.append(
        (
            "mimo_colocated",
            pipe.baseline("mimo_colocated", tp=1, pp=1, global_batch=global_batch, microbatch_size=1),
        )
    )
    return out


def degrees_of(plan) -> str:
    par = plan.pipeline_parallel
    return f"PP={par.pp} V={par.v}" if par.pp > 1 else f"DP={par.dp} PP=1"


def stages_of(plan) -> str:
    return " | ".join(f"{len(s.layers)}" + (f" (x{len(s.ranks)})" if s.replicas else "") for s in plan.stages)


class Progress:
    """Prints one line per phase, flushed, with the time since the demo started (``[demo 1:05]``);
    the ranks print theirs with the same clock (``started`` is wall-clock time)."""

    def __init__(self, log: TextIO | None, started: float | None = None):
        self.log = log
        self.started = time.time() if started is None else started

    def __call__(self, text: str) -> None:
        if self.log is not None:
            elapsed = int(time.time() - self.started)
            print(f"[demo {elapsed // 60}:{elapsed % 60:02d}] {text}", file=self.log, flush=True)

    @contextlib.contextmanager
    def still(self, what: str):
        """While the block runs, a line every :data:`HEARTBEAT_S` seconds saying it still does
        (``what``, and for how long): a loaded machine makes a phase minutes long, and a silent
        terminal looks like a hang."""
        if self.log is None:
            yield
            return
        done = threading.Event()
        began = time.time()

        def beat() -> None:
            while not done.wait(HEARTBEAT_S):
                self(f"  ... still {what} ({time.time() - began:.0f} s so far)")

        thread = threading.Thread(target=beat, name="demo-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


HEARTBEAT_S = 15.0
"""Seconds between the demo's lines during a long phase (no phase stays silent 20 s)."""


def measured_steps(
    runners: Sequence[Any],
    batch: Mapping[str, Any],
    num_steps: int,
    lr: float,
    names: Sequence[str],
    started: float | None,
) -> list[dict[str, list[float]]]:
    """:func:`~vlmcompile.runtime.timed_steps.interleaved_steps`, rank 0 printing every plan's time
    after each round when ``started`` is given; runs on every rank."""
    say = Progress(sys.stderr if started is not None and dist.get_rank() == 0 else None, started)
    rounds_s, last = [], [time.perf_counter()]

    def report(k: int, out: list[dict[str, list[float]]]) -> None:
        now = time.perf_counter()
        rounds_s.append(now - last[0])
        last[0] = now
        took = ", ".join(f"{name} {out[j]['step_s'][-1]:.2f} s" for j, name in enumerate(names))
        # The warm-up round also sets up the process groups: the estimate leaves it out when it can.
        left = (num_steps - k - 1) * statistics.median(rounds_s[1:] or rounds_s)
        warm = " (warm-up)" if k == 0 else ""
        more = f"; about {left:.0f} s to go" if k + 1 < num_steps else ""
        say(f"  step {k + 1}/{num_steps}{warm}, rank 0's times: {took}{more}")

    return interleaved_steps(runners, batch, num_steps, lr, on_step=report)


def _demo_batch(global_batch: int | None, num_steps: int, full: bool) -> int:
    """The demo's global batch, its options checked."""
    if num_steps < DEFAULT_STEPS:
        raise ValueError(
            f"num_steps={num_steps}; the demo needs a warm-up step and at least {DEFAULT_STEPS - 1} timed steps"
        )
    if full and global_batch not in (None, FULL_GLOBAL_BATCH):
        raise ValueError(
            f"full=True runs global batch {FULL_GLOBAL_BATCH}, not {global_batch}; give one of the two"
        )
    return global_batch or (FULL_GLOBAL_BATCH if full else DEFAULT_GLOBAL_BATCH)


def _demo_model(model_name: str, global_batch: int, *, given: str | None):
    """(model, batch, global batch): a zoo model with a batch of ``global_batch``, or the model and
    batch a user's function returns (the demo trains that batch; a ``given`` global batch must be
    its size)."""
    built = model_source.build(model_name, batch_size=global_batch)
    if not isinstance(built.batch, Mapping):
        raise ArgumentError(
            f"--model {model_name} gave {'no sample batch' if built.batch is None else 'samples of different shapes'}; "
            "the demo trains one batch of one shape: return (model, batch) with the batch a dict keyed by the "
            "forward's argument names"
        )
    if families.packs_dict_batches(built.model):
        raise ArgumentError(
            f"--model {model_name}'s batch is captured as its samples, packed (a Qwen-VL family); the demo measures "
            "plans on one batch of one shape: compare plans with vlmcompile plan --search, train with vlmcompile train"
        )
    held = num_samples(built.batch)
    if held != global_batch:
        if given is not None:
            raise ArgumentError(
                f"{given} samples a step, but --model {model_name}'s sample batch holds {held}: leave it out (the "
                f"demo trains the batch given), or return a batch of {global_batch}"
            )
        global_batch = held
    return built.model, built.batch, global_batch


def _layer_graph(model_name: str):
    """The model's layers, captured on meta weights where its source builds them there."""
    meta = model_source.build(model_name, device="meta")
    return compile(meta.model, meta.batch, model_name=model_name, log=None).layer_graph


def _sample(batch, global_batch: int):
    return take(batch, 0, min(SAMPLE_SIZE, global_batch), rows_per_sample(batch))


def _compiled(model, batch, model_name: str, global_batch: int, cluster: Cluster, say, log):
    """The demo VLM compiled for the local ranks from a few of the batch's samples; the plan
    search takes every layout of the ranks (PP = 2, and PP = 1 with DP = 2)."""
    say(f"compiling the {model_name} VLM for {NUM_RANKS} CPU ranks, global batch {global_batch} ...")
    return compile(
        model,
        _sample(batch, global_batch),
        cluster=cluster,
        model_name=model_name,
        global_batch=global_batch,
        profile=True,
        search_space=SearchSpace(pp_choices=(1, NUM_RANKS), microbatch_sizes=(1,), v_choices=V_CHOICES),
        log=log,
    )


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|MiB|KiB|GB|MB|KB|B)\s*$")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def parse_memory_cap(text: str) -> tuple[float, bool]:
    """``--memory-cap``: (bytes, False) for a size (``2GiB``, ``512MiB``), or (share, True) for a
    fraction of what one rank needs to train the whole model alone (``0.6``).

    Raises:
        ArgumentError: neither a size nor a positive number.
    """
    size = _SIZE.match(text)
    if size:
        value = float(size[1]) * _UNITS[size[2]]
        fraction = False
    else:
        try:
            value, fraction = float(text), True
        except ValueError:
            value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise ArgumentError(
            f"memory cap {text!r}: give a size per rank (2GiB, 512MiB) or a positive fraction of what one rank "
            "needs to train the whole model alone (0.6)"
        )
    return value, fraction


def whole_model_need_bytes(model, batch, model_name: str, global_batch: int, cluster: Cluster) -> float:
    """What one rank needs to train the whole model alone: the peak of the plan with every layer
    on every rank (PP = 1, the ranks data-parallel), one microbatch of one sample at a time."""
    pipe = compile(
        model, _sample(batch, global_batch), model_name=model_name, global_batch=global_batch, log=None
    )
    request = PlanRequest.on(cluster, tp=1, pp=1, global_batch=global_batch, zero_stage=0)
    run = plan_and_simulate(pipe.layer_graph, cluster, "mimo_colocated", request)
    return max(run.sim.peak_mem_bytes)


def _plans_to_measure(pipe, global_batch: int) -> tuple[tuple[tuple[str, Any], ...], dict[str, float]]:
    """(ours and the baselines that fit, by name; the baselines that do not, by predicted peak GiB)."""
    fitting, not_fitting = [], {}
    for name, run in baselines(pipe, global_batch):
        if run.fits:
            fitting.append((name, run.plan))
        else:
            not_fitting[name] = max(run.sim.peak_mem_bytes) / 2**30
    return (("vlmcompile", pipe.plan), *fitting), not_fitting


def _measured(
    pipe, plans, model, batch, num_steps: int, lr: float, say, log
) -> tuple[list[float], list[PlanRun]]:
    """Eager's losses, then every plan's run, all interleaved step by step in one launch."""
    say(f"eager reference: {num_steps} SGD steps of the whole batch in this process ...")
    start = time.perf_counter()
    with say.still("training eager"):
        eager = eager_losses(copy.deepcopy(model), batch, num_steps, lr)
    took = time.perf_counter() - start
    say(f"eager reference done in {took:.1f} s ({took / num_steps:.1f} s a step)")
    # Each plan's runner gets its own copy of the parameters: all train from the same weights.
    runners = tuple(copy.deepcopy(pipe.runner(plan, timeout_s=120)) for _, plan in plans)
    say(
        f"measuring {len(plans)} plans on {NUM_RANKS} ranks, {num_steps} steps each, interleaved step by "
        "step (the order reversed every other step); starting the ranks ..."
    )
    start = time.perf_counter()
    names = [name for name, _ in plans]
    started = say.started if log is not None else None
    with say.still("measuring the plans on the ranks"):
        results = launch(
            measured_steps, runners, NUM_RANKS, args=(batch, num_steps, lr, names, started), timeout_s=300
        )
    say(f"measured in {time.perf_counter() - start:.1f} s")
    runs = [
        _plan_run(policy, plan, [r[j] for r in results], eager, pipe)
        for j, (policy, plan) in enumerate(plans)
    ]
    return eager, runs


def _capped(cluster: Cluster, cap, model, batch, model_name: str, global_batch: int, say) -> Cluster:
    """``cluster`` with every plan held to ``cap`` (:func:`parse_memory_cap`'s; None: as it is)."""
    if cap is None:
        return cluster
    cap_bytes, fraction = cap
    if fraction:
        need = whole_model_need_bytes(model, batch, model_name, global_batch, cluster)
        say(
            f"one rank needs {format_bytes(need)} to train the whole model alone; memory cap "
            f"{cap_bytes:g} of it: {format_bytes(cap_bytes * need)} per rank"
        )
        cap_bytes *= need
    return cluster.with_memory_cap(cap_bytes)


def run_demo(
    *,
    global_batch: int | None = None,
    num_steps: int = DEFAULT_STEPS,
    full: bool = False,
    lr: float = 1e-3,
    log: TextIO | None = sys.stderr,
    on_compiled: Callable[[Any], None] | None = None,
    model_name: str = "demo",
    memory_cap: str | None = None,
    freeze: Sequence[str] = (),
) -> tuple[Any, DemoResult]:
    """Compile, then run eager and every plan; returns (the compiled pipeline, the figures).

    Args:
        global_batch: samples per step (default :data:`DEFAULT_GLOBAL_BATCH`, with ``full``
            :data:`FULL_GLOBAL_BATCH`).
        num_steps: training steps per plan, the first a warm-up.
        full: the full-size demo (global batch :data:`FULL_GLOBAL_BATCH`).
        log: where the progress lines go (None: silence).
        on_compiled: called with the compiled pipeline before anything is measured (the CLI prints
            the compile report there, so that it is read while the plans run).
        model_name: the model to run: a zoo VLM (the tests run "tiny"), a tiny transformers model
            (``hf-llava``) or a user's function, ``pkg.module:function``, returning (model, batch):
            the demo then trains that batch (:mod:`vlmcompile.model_source`).
        memory_cap: hold every plan to this memory per rank, as on a device on which the model
            does not fit whole: a size (``2GiB``) or a fraction of what one rank needs to train the
            whole model alone (``0.6``; :func:`whole_model_need_bytes`). A baseline whose plan does
            not fit is reported, not run.
        freeze: regions or module paths to freeze (``requires_grad=False``) before compiling;
            every plan trains the model so frozen.
    """
    given_batch = (
        f"--global-batch {global_batch}"
        if global_batch
        else f"--full's {FULL_GLOBAL_BATCH}"
        if full
        else None
    )
    global_batch = _demo_batch(global_batch, num_steps, full)
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    say = Progress(log)
    cap = parse_memory_cap(memory_cap) if memory_cap is not None else None
    model, batch, global_batch = _demo_model(model_name, global_batch, given=given_batch)
    with say.still("finding the layers to freeze"):
        frozen = tuple(freeze_layers(model, _layer_graph(model_name), freeze)) if freeze else ()
    start = time.perf_counter()
    with say.still("planning the whole model on one rank, for the memory cap"):
        cluster = _capped(
            Cluster.preset(f"cpu:{NUM_RANKS}"), cap, model, batch, model_name, global_batch, say
        )
    with say.still("compiling"):
        pipe = _compiled(model, batch, model_name, global_batch, cluster, say, log)
    plans, not_fitting = _plans_to_measure(pipe, global_batch)
    say(
        f"compiled in {time.perf_counter() - start:.1f} s; plans to measure: "
        + ", ".join(f"{name} ({degrees_of(plan)})" for name, plan in plans)
        + "".join(
            f"; {name} does not fit ({format_bytes(peak * 2**30)} predicted)"
            for name, peak in not_fitting.items()
        )
    )
    if on_compiled is not None:
        on_compiled(pipe)
    eager, runs = _measured(pipe, plans, model, batch, num_steps, lr, say, log)
    ours = pipe.planned.sim
    result = DemoResult(
        global_batch,
        num_steps,
        tuple(eager),
        tuple(runs),
        demo_command(global_batch, num_steps, memory_cap=memory_cap, freeze=freeze, model=model_name),
        load_avg,
        memory_cap_gib=usable_memory_bytes(cluster.device.mem_bytes) / 2**30 if cap is not None else None,
        not_fitting=not_fitting,
        bound_step_s=sum(r.busy_s for r in ours.ranks) / len(ours.ranks),
        frozen=frozen,
    )
    return pipe, result


def _plan_run(policy: str, plan, mine: list[dict[str, list[float]]], eager: list[float], pipe) -> PlanRun:
    """One plan's figures from every rank's losses and step times."""
    num_steps = len(eager)
    steps = tuple(max(r["step_s"][k] for r in mine) for k in range(num_steps))
    diff = max(abs(a - b) for r in mine for a, b in zip(r["losses"], eager))
    same = all(
        torch.allclose(torch.tensor(r["losses"]), torch.tensor(eager), rtol=1.3e-6, atol=1e-5) for r in mine
    )
    sim = simulate(plan, pipe.layer_graph, pipe.cluster)
    return PlanRun(
        policy,
        degrees_of(plan),
        stages_of(plan),
        sim.step_time_s,
        steps,
        tuple(mine[0]["losses"]),
        diff,
        same,
        max(sim.peak_mem_bytes) / 2**30,
        ours_too=is_our_plan(plan, pipe.plan),
    )


def is_our_plan(plan, ours) -> bool:
    """Whether ``plan`` is ``ours`` under another policy's name: the same stages, ranks and actions
    (what a policy decided, and why, may differ)."""
    return plan is not ours and ours.same_layout(plan)
