"""DistMM's contrastive setups, simulated: our two-tower plan against the baselines on one cost model.

    python benchmarks/contrastive.py [--models CLIP-S ...] [--gpus 1 8 64] [--measure-only]

Every model of DistMM (``tests/reference/paper_setups.json``: CLIP, CoCa and LiT, three sizes
each, as the zoo builds them) on its cluster of V100-16GB (8 a node, 25 Gbit/s between nodes)
at single-device (1 GPU), single-node (8) and multi-node (64) scale, planned four ways:

* ``vlmcompile``: each tower on GPUs of its own or both on every GPU, whichever is predicted
  faster; per tower a tensor-parallel degree inside a node, pipeline stages (towers apart),
  microbatches, and activations kept or recomputed (:func:`~vlmcompile.planning.contrastive_placement.place_towers`).
* ``megatron``: both towers on every GPU at one TP and DP (DistMM's baseline). An exact loss
  needs the whole global batch in one microbatch (Megatron-LM's schedules microbatch the loss);
  activations kept, or every layer checkpointed (``--recompute-granularity full``) where keeping
  does not fit; the TP predicted fastest; distributed optimizer (ZeRO-1).
* ``open_clip``: DDP on every GPU (TP 1; fp32 parameters, gradients and Adam moments on every
  GPU: 16 bytes a parameter), ``--local-loss --gather-with-grad`` (each GPU its rows of the
  loss, as ours), ``--grad-checkpointing`` where keeping does not fit, ``--accum-freq 1``.
* ``one_microbatch``: what compile planned for a contrastive loss before it recognised one: one
  data-parallel group (DP = 1) runs the whole global batch in one microbatch, at the fastest TP
  that fits in a node; the other GPUs wait.

For each plan the largest global batch it trains exactly (bisection over the batch), then, at
each baseline's largest batch, that baseline's step and ours on the same batch: step,
samples/s, each tower's MFU (its model FLOPs - forward and backward, nothing recomputed - over
the peak FLOPs of the GPUs that hold it for the step; a layer both towers share counts for
neither) and ours over the baseline. Every figure is the cost model's prediction.

Then one plan is measured: a small zoo-style pair compiled for 2 CPU ranks over gloo with
measured layer times (``profile=True``), its step run ``--steps`` times in each of ``--repeats``
launches, the median step and phases against the prediction.

Writes ``benchmarks/results/contrastive.json`` and the section ``contrastive`` of docs/contrastive.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from readme_section import github_table, write_readme_section

from vlmcompile import compile, models
from vlmcompile.compiler import zoo_contrastive_loss, zoo_layer_graph
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.contrastive_loss import ContrastiveLoss
from vlmcompile.ir.contrastive_plan import ContrastivePlan, MemoryPolicy
from vlmcompile.ir.errors import ArgumentError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Precision
from vlmcompile.planning.contrastive import plan_towers, tower_layers
from vlmcompile.planning.contrastive_placement import place_towers
from vlmcompile.planning.request import SearchSpace

RESULTS = Path(__file__).parent / "results" / "contrastive.json"
MODELS = tuple(f"{family}-{size}" for family in ("CLIP", "CoCa", "LiT") for size in "SML")
GPUS = (1, 8, 64)
TENSOR_PARALLEL = (1, 2, 4, 8)
PIPELINE_PARALLEL = (1, 2, 4, 8)
POLICIES = ("vlmcompile", "megatron", "open_clip", "one_microbatch")
BASELINES = POLICIES[1:]
OPEN_CLIP_PRECISION = Precision(param_bytes=4, grad_bytes=4, optimizer_bytes=8, dp_grad_bytes=4)
"""AMP with fp32 parameters, fp32 gradients and Adam's two fp32 moments, nothing sharded."""
MOST_PER_GPU = 1 << 10
"""The bisection's ceiling: samples a GPU a step (ours is bounded by the loss phase, far above)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    model: str
    family: str
    """The cluster preset's family (``v100``): a DP = 1 plan runs on ``<family>x<tp>``."""
    cluster: Cluster
    layer_graph: LayerGraph
    loss: ContrastiveLoss


def plan(policy: str, problem: Problem, global_batch: int) -> ContrastivePlan:
    """``policy``'s plan of ``global_batch`` samples (module docstring).

    Raises:
        ArgumentError: it does not fit, or the batch is smaller than its data-parallel groups.
    """
    lg, cluster, loss = problem.layer_graph, problem.cluster, problem.loss
    common = dict(global_batch=global_batch, embedding_width=loss.width)
    if policy == "vlmcompile":
        return place_towers(
            lg, cluster, loss, tensor_parallel=TENSOR_PARALLEL, pipeline_parallel=PIPELINE_PARALLEL, **common
        )
    if policy == "one_microbatch":
        return _fastest(
            lambda tp: plan_towers(
                lg,
                Cluster.preset(f"{problem.family}x{tp}"),
                loss,
                microbatches=1,
                memory=MemoryPolicy.KEEP,
                tensor_parallel=(tp,),
                **common,
            ),
            [tp for tp in TENSOR_PARALLEL if tp <= cluster.num_gpus],
        )
    tps, precision, zero = (
        (TENSOR_PARALLEL, Precision(), 1) if policy == "megatron" else ((1,), OPEN_CLIP_PRECISION, 0)
    )
    return _fastest(
        lambda memory: plan_towers(
            lg,
            cluster,
            loss,
            microbatches=1,
            memory=memory,
            tensor_parallel=tps,
            precision=precision,
            zero_stage=zero,
            **common,
        ),
        [MemoryPolicy.KEEP, MemoryPolicy.CHECKPOINT],
    )


def _fastest(planner, options) -> ContrastivePlan:
    plans, refusals = [], []
    for option in options:
        try:
            plans.append(planner(option))
        except ArgumentError as err:
            refusals.append(str(err))
    if not plans:
        raise ArgumentError(refusals[-1])
    return min(plans, key=lambda p: p.predicted.step_s)


def largest_batch(policy: str, problem: Problem) -> int:
    """The largest global batch ``policy`` plans (0: none fits), by bisection up to
    ``MOST_PER_GPU`` a GPU; feasibility falls with the batch for every policy."""
    gpus = problem.cluster.num_gpus
    lo, hi = 0, MOST_PER_GPU * gpus
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(policy, problem, mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _fits(policy: str, problem: Problem, global_batch: int) -> bool:
    # Ours fits if both towers on every GPU do (quick); else the splits are searched.
    planners = [lambda: plan(policy, problem, global_batch)]
    if policy == "vlmcompile":
        planners.insert(
            0,
            lambda: plan_towers(
                problem.layer_graph,
                problem.cluster,
                problem.loss,
                global_batch=global_batch,
                embedding_width=problem.loss.width,
                tensor_parallel=TENSOR_PARALLEL,
            ),
        )
    for planner in planners:
        try:
            planner()
            return True
        except ArgumentError:
            continue
    return False


def figures(problem: Problem, tower_plan: ContrastivePlan) -> dict:
    """Step, samples/s and each tower's MFU of a plan (module docstring)."""
    step = tower_plan.predicted.step_s
    n = tower_plan.global_batch
    peak = problem.cluster.device.peak_flops_per_s
    lg, loss = problem.layer_graph, problem.loss
    shared = set(loss.tower_layers[0]) & set(loss.tower_layers[1])
    mfu = {}
    for t, name in enumerate(("vision", "text")):
        own = [layer for layer in tower_layers(lg, loss, t) if layer.name not in shared]
        flops = n * sum(layer.fwd_flops + layer.bwd_flops for layer in own) / (lg.meta.get("batch_size") or 1)
        gpus = len(tower_plan.placement(t).ranks) if tower_plan.separate else problem.cluster.num_gpus
        mfu[name] = flops / (gpus * step * peak)
    return {
        "global_batch": n,
        "step_s": step,
        "samples_per_s": n / step,
        "mfu": mfu,
        "placement": _placement(tower_plan),
        "mem_gib": tower_plan.predicted.mem_bytes / 2**30,
    }


def _placement(tower_plan: ContrastivePlan) -> str:
    """A short description: where each tower runs, at which TP, kept or recomputed, microbatches."""
    parts = []
    for t, name in enumerate(("vision", "text")):
        p = tower_plan.placement(t)
        parts.append(
            f"{name} {len(p.ranks)} GPU tp{p.tp} pp{p.pp} {tower_plan.memory_of(t)} x{len(p.split.microbatches[0])}"
        )
    where = "separate" if tower_plan.separate else "colocated"
    return f"{where}: " + ", ".join(parts)


def run_setup(model: str, gpus: int, layer_graph: LayerGraph, loss: ContrastiveLoss) -> dict:
    """Every policy's largest batch, and ours against each baseline at that baseline's largest."""
    problem = Problem(model, "v100", Cluster.preset(f"v100x{gpus}"), layer_graph, loss)
    row = {"model": model, "gpus": gpus, "largest_batch": {}, "vs": {}}
    for policy in POLICIES:
        row["largest_batch"][policy] = largest_batch(policy, problem)
    most = row["largest_batch"]["vlmcompile"]
    row["ours_at_largest"] = figures(problem, plan("vlmcompile", problem, most)) if most else None
    for baseline in BASELINES:
        n = row["largest_batch"][baseline]
        if n == 0:
            row["vs"][baseline] = None
            continue
        theirs = figures(problem, plan(baseline, problem, n))
        ours = figures(problem, plan("vlmcompile", problem, n))
        row["vs"][baseline] = {"theirs": theirs, "ours": ours, "speedup": theirs["step_s"] / ours["step_s"]}
    return row


def _batch_cell(n: int, gpus: int) -> str:
    if n == 0:
        return "does not fit"
    if n >= MOST_PER_GPU * gpus:
        return f">= {MOST_PER_GPU}"
    return f"{n / gpus:.0f}"


def table(rows: list[dict]) -> str:
    head = [
        "model",
        "GPUs",
        "largest exact batch a GPU: ours / Megatron / open_clip / one microbatch",
        "ours over Megatron (at its batch)",
        "ours over open_clip (at its batch)",
        "ours over one microbatch (at its batch)",
        "ours at Megatron's batch (else our largest): N, step, samples/s, MFU vision / text",
        "our plan there",
    ]
    body = []
    for row in rows:
        g = row["gpus"]
        largest = " / ".join(_batch_cell(row["largest_batch"][p], g) for p in POLICIES)
        speed = [
            "-"
            if row["vs"][b] is None
            else f"{row['vs'][b]['speedup']:.2f}x (N={row['vs'][b]['ours']['global_batch']})"
            for b in BASELINES
        ]
        ours = row["vs"]["megatron"]["ours"] if row["vs"]["megatron"] else row.get("ours_at_largest")
        said = (
            "-"
            if ours is None
            else f"{ours['global_batch']}, {ours['step_s']:.3g} s, {ours['samples_per_s']:.0f}, "
            f"{ours['mfu']['vision']:.0%} / {ours['mfu']['text']:.0%}"
        )
        where = "-" if ours is None else ours["placement"]
        body.append([row["model"], g, largest, *speed, said, where])
    return github_table(head, body)


# -- measured on CPU ranks -------------------------------------------------------------------------

MEASURED = models.ContrastiveConfig(
    name="measured-pair",
    vision=models.ViTConfig(
        name="measured-vit", width=192, depth=4, mlp=768, heads=6, head_dim=32, image_px=84, patch=14
    ),
    text=models.TextEncoderConfig(
        name="measured-text", width=128, depth=4, heads=4, head_dim=32, mlp=512, vocab=512, tokens=32
    ),
    embed_dim=64,
)
"""A zoo-style pair large enough that a CPU step is compute, not launch overhead."""


def _timed_steps(step, batch, steps: int) -> list[dict]:
    """On each rank: ``steps`` steps on ``batch``; per step the seconds and its phases."""
    out = []
    for _ in range(steps):
        for p in step.parameters():
            p.grad = None
        start = time.perf_counter()
        step.step(batch)
        out.append({"step_s": time.perf_counter() - start, **step.last_phases_s})
    return out


def measure(*, ranks: int, global_batch: int, steps: int, repeats: int, placement: str) -> dict:
    """The measured pair on ``ranks`` CPU ranks: median step and phases over every launch's steps
    after its first, against the plan's prediction (from measured layer times)."""
    model = models.build(MEASURED)
    batch = models.sample_batch(MEASURED, batch_size=global_batch)
    pipe = compile(
        model,
        batch,
        f"cpu:{ranks}",
        profile=True,
        search_space=SearchSpace(tower_placement=placement),
        log=None,
    )
    plan_ = pipe.tower_plan
    runs = [pipe.launch(_timed_steps, args=(batch, steps), timeout_s=600) for _ in range(repeats)]
    # The step ends on every rank together (its last phase is a collective): take rank 0's.
    kept = [s for run in runs for s in run[0][1:]]
    measured = {k: statistics.median(s[k] for s in kept) for k in kept[0]}
    p = plan_.predicted
    predicted = {
        "step_s": p.step_s,
        "towers_fwd": p.towers_fwd_s,
        "loss_phase": p.loss_phase_s,
        "towers_bwd": p.towers_bwd_s,
        "grad_reduce": p.grad_reduce_s,
    }
    return {
        "ranks": ranks,
        "global_batch": global_batch,
        "placement": _placement(plan_),
        "steps_timed": len(kept),
        "measured_s": measured,
        "predicted_s": predicted,
        "error": {k: predicted[k] / measured[k] - 1 for k in predicted if measured.get(k)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--gpus", nargs="+", type=int, default=list(GPUS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=48, help="samples a measured step")
    parser.add_argument("--measure-only", action="store_true", help="skip the simulated setups")
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"result JSON (default {RESULTS})")
    args = parser.parse_args(argv)
    out = json.loads(args.out.read_text()) if args.out.exists() else {}
    if not args.measure_only:
        rows = []
        for model in args.models:
            layer_graph, loss = zoo_layer_graph(model), zoo_contrastive_loss(model)
            for gpus in args.gpus:
                start = time.perf_counter()
                rows.append(run_setup(model, gpus, layer_graph, loss))
                print(
                    f"{model} on {gpus} GPUs: {time.perf_counter() - start:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        print(table(rows))
        out["setups"] = rows
    out["measured"] = [
        measure(
            ranks=args.ranks,
            global_batch=args.global_batch,
            steps=args.steps,
            repeats=args.repeats,
            placement=placement,
        )
        for placement in ("colocated", "separate")
    ]
    for m in out["measured"]:
        print(
            f"measured on {m['ranks']} CPU ranks, {m['placement']}: step {m['measured_s']['step_s'] * 1e3:.0f} ms, "
            f"predicted {m['predicted_s']['step_s'] * 1e3:.0f} ms ({m['error']['step_s']:+.0%}); "
            + ", ".join(f"{k} {v:+.0%}" for k, v in m["error"].items() if k != "step_s")
        )
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    if not args.no_readme and "setups" in out:
        write_readme_section("contrastive", table(out["setups"]) + "\n\n" + measured_lines(out["measured"]))
    return 0


def measured_lines(measured: list[dict]) -> str:
    lines = []
    for m in measured:
        lines.append(
            f"Measured, {m['ranks']} CPU ranks over gloo, {m['global_batch']} samples, {m['placement']}: "
            f"step {m['measured_s']['step_s'] * 1e3:.0f} ms (median of {m['steps_timed']}), predicted "
            f"{m['predicted_s']['step_s'] * 1e3:.0f} ms ({m['error']['step_s']:+.0%}); by phase "
            + ", ".join(f"{k} {v:+.0%}" for k, v in m["error"].items() if k != "step_s")
            + "."
        )
    return "\n\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
