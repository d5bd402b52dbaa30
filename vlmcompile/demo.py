"""``vlmcompile demo``: compile the ``demo`` VLM for 2 local CPU ranks, run our plan and the
baselines' on the same runtime, and compare measurement with eager and with prediction.

Our plan and the pipelined baselines run at the same degrees and microbatches (PP = 2,
microbatches of one sample, the same global batch), each at its fastest predicted v of 1, 2, 4
(v is a setting each system's user tunes; a baseline held at our v would not be the best its
users run: at 4 microbatches ``megatron_balanced`` is 12 % faster at v = 4 than at v = 1, and
our search may pick v = 1). ``megatron``
is the faster of its even placements (``llava``: the vision encoder, projector and embedding on
stage 0 with an even share of the LLM blocks; ``chain``: encoder and LLM blocks split evenly as
one chain), ``megatron_balanced`` the appendix-B split. Ours is the plan search's: the stage-cut
partition, or the encoders on a plan of their own with their work in the LLM's bubbles,
whichever the simulator predicts faster. ``mimo_colocated`` (Megatron MIMO's colocated layout)
runs only at PP = 1, so it is measured at its own degrees (DP = 2) and said to be.

Layer times come from the profile pass on this CPU (one thread per rank), so the prediction is
of this machine. Every plan runs in one launch, step by step, the order reversed every other step, each on its own
copy of the weights: the speed of a shared machine drifts over minutes, and interleaving puts
the drift on every plan alike. Every step time is measured; the first step of each plan is a
warm-up, left out of the median.
"""

from __future__ import annotations

import copy
import functools
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import torch
from tabulate import tabulate

from vlmcompile import models
from vlmcompile.compiler import compile
from vlmcompile.ir.errors import PlanError
from vlmcompile.planning.request import SearchSpace
from vlmcompile.runtime.launch import launch
from vlmcompile.runtime.training import interleaved_steps
from vlmcompile.sim.simulator import simulate

NUM_RANKS = 2


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

    @property
    def ours(self) -> PlanRun:
        return self.runs[0]

    def speedup_over(self, policy: str, *, predicted: bool = False) -> float:
        run = next(r for r in self.runs if r.policy == policy)
        if predicted:
            return run.predicted_s / self.ours.predicted_s
        return run.measured_s / self.ours.measured_s

    @property
    def best_baseline(self) -> PlanRun:
        """The fastest measured baseline at our PP (each at its own fastest v)."""
        return min(self.same_degrees, key=lambda r: r.measured_s)

    @property
    def same_degrees(self) -> tuple[PlanRun, ...]:
        pp = self.ours.degrees.split()[0]  # "PP=2"
        return tuple(r for r in self.runs[1:] if r.degrees.split()[0] == pp)

    @property
    def speedup(self) -> float:
        """Measured, over the fastest baseline at our PP."""
        return self.best_baseline.measured_s / self.ours.measured_s

    @property
    def predicted_speedup(self) -> float:
        return min(r.predicted_s for r in self.same_degrees) / self.ours.predicted_s

    def to_json(self) -> dict[str, Any]:
        out = {
            **asdict(self),
            "runs": [{**asdict(r), "measured_s": r.measured_s, "error": r.error} for r in self.runs],
            "speedup": self.speedup,
            "predicted_speedup": self.predicted_speedup,
            "best_baseline": self.best_baseline.policy,
            "machine": _machine(),
        }
        for r in self.runs[1:]:
            out[f"speedup_over_{r.policy}"] = self.speedup_over(r.policy)
            out[f"predicted_speedup_over_{r.policy}"] = self.speedup_over(r.policy, predicted=True)
        return out

    def __str__(self) -> str:
        rows = [
            [
                r.policy,
                r.degrees,
                r.stages,
                f"{r.predicted_s:.3f}",
                f"{r.measured_s:.3f}",
                f"{100 * r.error:+.1f} %",
                "-" if r is self.ours else f"{self.speedup_over(r.policy):.2f}x",
                f"{r.losses[0]:.6f}",
                f"{r.max_loss_diff:.1e} ({'equal' if r.equal_to_eager else 'NOT equal'})",
            ]
            for r in self.runs
        ]
        table = tabulate(
            rows,
            headers=[
                "plan",
                "degrees",
                "layers per stage",
                "predicted s",
                "measured s (median)",
                "error",
                "ours is faster by",
                "loss, step 1",
                "max |loss - eager|",
            ],
            disable_numparse=True,
        )
        return (
            f"{NUM_RANKS} CPU ranks, global batch {self.global_batch} in microbatches of 1, "
            f"{self.num_steps} steps of SGD (first a warm-up, left out of the median)\n{table}\n"
            f"eager loss, step 1: {self.eager_losses[0]:.6f}\n"
            f"measured speedup of vlmcompile over the fastest baseline at its degrees ({self.best_baseline.policy}): "
            f"{self.speedup:.2f}x (predicted {self.predicted_speedup:.2f}x)"
        )


def _machine() -> str:
    import os
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def eager_losses(model, batch, num_steps: int, lr: float) -> list[float]:
    """The losses of ``num_steps`` eager SGD(lr) steps on the same batch (``model`` is trained)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(num_steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


V_CHOICES = SearchSpace().v_choices
"""The v each pipelined policy may run at: the plan search's choices for ours, and for a
baseline the one its user would pick (its fastest predicted)."""


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


def run_demo(
    *, global_batch: int = 32, num_steps: int = 6, lr: float = 1e-3, log: TextIO | None = sys.stderr
) -> tuple[Any, DemoResult]:
    """Compile, then run both plans; returns (the compiled pipeline, the figures)."""
    if num_steps < 6:
        raise ValueError(f"num_steps={num_steps}; the demo needs a warm-up step and at least 5 timed steps")
    model = models.build("demo")
    batch = models.sample_batch("demo", batch_size=global_batch)
    pipe = compile(
        model,
        batch,
        cluster=f"cpu:{NUM_RANKS}",
        model_name="demo",
        global_batch=global_batch,
        profile=True,
        search_space=SearchSpace(pp_choices=(NUM_RANKS,), microbatch_sizes=(1,)),
        log=log,
    )
    plans = (("vlmcompile", pipe.plan), *((name, run.plan) for name, run in baselines(pipe, global_batch)))
    say = (lambda text: print(text, file=log, flush=True)) if log else (lambda text: None)
    say("eager training on this process ...")
    eager = eager_losses(copy.deepcopy(model), batch, num_steps, lr)
    # Each plan's runner gets its own copy of the parameters: all train from the same weights.
    runners = tuple(copy.deepcopy(pipe.runner(plan, timeout_s=120)) for _, plan in plans)
    say(
        f"running {len(plans)} plans on {NUM_RANKS} ranks, {num_steps} steps each, interleaved step by step "
        f"(the order reversed every other step) ..."
    )
    start = time.perf_counter()
    results = launch(interleaved_steps, runners, NUM_RANKS, args=(batch, num_steps, lr), timeout_s=300)
    say(f"  done in {time.perf_counter() - start:.1f} s")
    runs = []
    for j, (policy, plan) in enumerate(plans):
        mine = [r[j] for r in results]
        steps = tuple(max(r["step_s"][k] for r in mine) for k in range(num_steps))
        losses = tuple(mine[0]["losses"])
        diff = max(abs(a - b) for r in mine for a, b in zip(r["losses"], eager))
        same = all(
            torch.allclose(torch.tensor(r["losses"]), torch.tensor(eager), rtol=1.3e-6, atol=1e-5)
            for r in mine
        )
        runs.append(
            PlanRun(
                policy,
                degrees_of(plan),
                stages_of(plan),
                simulate(plan, pipe.layer_graph, pipe.cluster).step_time_s,
                steps,
                losses,
                diff,
                same,
            )
        )
    return pipe, DemoResult(global_batch, num_steps, tuple(eager), tuple(runs))
