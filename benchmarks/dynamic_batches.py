"""Variable data at paper scale, simulated: a static plan against a schedule re-planned for every
batch, with and without balanced microbatches and ISF batches, and every baseline, over 200
global batches of each synthetic dataset.

Setups: the Optimus strong-scaling runs (ViT-22B + GPT-175B on 1536, 2048 and 3072 H100s) and
two OmniBal runs (InternViT-6B + Llama3-8B and + InternLM2-20B), at the papers' degrees, v and
microbatches (``vlmcompile.planning.setups``). Samples: each synthetic dataset under the
released model it describes (``families.released_layouts()``: LLaVA's tiles, InternVL's dynamic tiles,
Qwen2-VL's native-resolution patches, Idefics3's split tiles), its vision rows as patches of the
setup's ViT (a tile is one of the setup's images; Qwen's patches as they are) and its image
tokens at the setup's tokens per image; text as drawn. A microbatch holds the setup's
microbatch of tokens (``microbatch_size x llm_tokens``); its encoder is costed by its patches
over the dataset's mean microbatch's, its LLM at capacity (packed rows are computed whole,
padding too). Every plan (ours and the baselines') is made for that mean microbatch, as our
compiler plans for a dataset (``data.distribution``), so a static plan meets its mean.

Methods, each at the setup's degrees, schedule, v, microbatches and recompute rule:

* ``static``: our encoder-in-bubbles plan (``passes.planning.bubbles``), made once for the planned
  microbatch; steps packed by tokens (longest first into the emptiest row, what does not fit
  carried into the next step), run on the plan's schedule;
* ``per-batch``: the same steps, the schedule re-planned for each (``planning.per_batch``, within
  its time limit of 4 % of the planned step per replica, anytime: what is timed by the limit);
* ``per-batch + balanced``: the same, the samples assigned to microbatches and replicas by image
  rows too (``data.microbatches``, greedy);
* ``ISF + per-batch``: microbatches are OmniBal ISF groups (``data.balance``; targets the
  microbatch's tokens and the dataset's ratio of tiles to tokens), re-planned per batch;
* ``megatron``: Megatron-LM's best plan at the same request (the fastest that fits of
  ``passes.baselines.megatron``, the faster of its encoder placements, and
  ``passes.baselines.megatron_balanced``, its layers balanced by time), its data as given:
  ``global_batch`` samples a step in order, ``microbatch_size`` a microbatch, each padded or cut
  to ``llm_tokens``;
* ``torchtitan``: torchtitan's VLM pipeline split (``passes.baselines.torchtitan_vlm``) on steps
  of a fixed token budget (packed by tokens, as ``static``).

Each method's ``of bound`` is its steps' bound over their time: no step at these degrees is
faster than the LLM without its encoders (the LLM-alone bound in the bubbles pass's report,
computed by ``vlmcompile.planning.llm_alone_bound``), nor than its whole compute (every
replica's microbatches, at our plan's recompute) spread evenly over every rank.

A step's time is the slowest data-parallel replica's; to keep 200 batches of a 24-replica
setup within minutes, only the ``--replicas-timed`` replicas with the most encoder work are
simulated (default 1), the others taken as no slower. Every figure is simulated by the cost
model (not measured), DP collectives included as the simulator models them.

    python benchmarks/dynamic_batches.py [--batches 200] [--jobs N] [--setups ...] [--datasets ...] [--readme]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from readme_section import github_table, write_readme_section

from vlmcompile import models
from vlmcompile.compiler import zoo_layer_graph
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.stage_costs import plan_costs
from vlmcompile.data.balance import IsfTargets, SampleSizes, isf_epoch
from vlmcompile.data.distribution import Spread
from vlmcompile.data.microbatches import assign
from vlmcompile.data.synthetic import DISTRIBUTIONS, draw_sizes
from vlmcompile.families import released_layouts
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.regions import ENCODER_SIDE
from vlmcompile.passes.planning.bubbles import bubbles
from vlmcompile.passes.planning.policies import compare_baselines
from vlmcompile.planning.per_batch import per_batch_scheduler
from vlmcompile.planning.request import SolverOptions
from vlmcompile.planning.setups import SETUPS
from vlmcompile.sim.simulator import simulate

RESULTS = Path(__file__).parent / "results" / "dynamic_batches.json"
OWN_FAMILY = {
    "llava-chat": "llava",
    "internvl-tiles": "internvl",
    "qwen-native": "qwen2-vl",
    "interleaved": "idefics3",
}
DEFAULT_SETUPS = (
    "optimus-strong-1536",
    "optimus-strong-2048",
    "optimus-strong-3072",
    "omnibal-InternLM2-20B",
    "omnibal-Llama3-8B",
)
METHODS = ("static", "per-batch", "per-batch + balanced", "ISF + per-batch", "megatron", "torchtitan")


@dataclasses.dataclass(frozen=True)
class Planned:
    """A setup's plans for one dataset (made at its mean microbatch) and the dataset's samples."""

    name: str
    dataset: str
    graph: object
    cluster: str
    ours: object
    baselines: dict
    microbatches: int
    replicas: int
    capacity: int
    """LLM tokens of a microbatch."""
    mean_patches: float
    """Vision patches of the dataset's mean microbatch (what the plans are made for)."""
    global_batch: int
    sizes: SampleSizes
    too_long: float
    """Share of the drawn samples longer than a microbatch (left out of every method)."""
    plan_s: float
    llm_alone_s: float
    """The bound: our plan's LLM stages and schedule without the encoders (the bubbles pass's report,
    computed by ``vlmcompile.planning.llm_alone_bound``)."""


def plan_setup(name: str, dataset: str, samples: int) -> Planned:
    setup = SETUPS[name]
    began = time.perf_counter()
    cfg = models.config(setup.model)
    capacity = setup.microbatch_size * cfg.llm_tokens
    sizes, too_long = sample_sizes(dataset, samples, cfg, capacity)
    annotated = setup.microbatch_size * cfg.images_per_sample * cfg.encoders[0].tokens_per_image
    mean = capacity * int(sizes.vision_rows.sum()) / int(sizes.llm_tokens.sum())
    cluster, request = Cluster.preset(setup.cluster), setup.request()
    graph = zoo_layer_graph(setup.model).with_time_scaled(
        dict.fromkeys(ENCODER_SIDE, mean / annotated), f"{dataset}'s mean microbatch: {mean:.0f} patches"
    )
    made = bubbles(graph, cluster, request, solver=SolverOptions(time_limit_s=10, workers=1))
    ours = made.plan
    runs, _ = compare_baselines(graph, cluster, request)
    fitting = {r.plan.policy: r for r in runs if r.fits}
    baselines = {}
    megatron = [r for p, r in fitting.items() if p.startswith("megatron")]
    if megatron:
        baselines["megatron"] = min(megatron, key=lambda r: r.sim.step_time_s).plan
    if "torchtitan_vlm" in fitting:
        baselines["torchtitan"] = fitting["torchtitan_vlm"].plan
    return Planned(
        name,
        dataset,
        graph,
        setup.cluster,
        ours,
        baselines,
        ours.num_microbatches,
        request.parallel.dp,
        capacity,
        mean,
        request.global_batch,
        sizes,
        too_long,
        time.perf_counter() - began,
        made.report.llm_alone_step_s,
    )


def sample_sizes(dataset: str, count: int, cfg, capacity: int) -> tuple[SampleSizes, float]:
    """``count`` samples of ``dataset`` as (the setup's LLM tokens, its ViT's patches), none longer
    than a microbatch, and the share of drawn samples that were."""
    family = released_layouts()[OWN_FAMILY[dataset]]
    encoder = cfg.encoders[0]
    per_image = cfg.image_tokens // cfg.images_per_sample
    tokens, patches = [], []
    index = 0
    while len(tokens) < count:
        drawn = draw_sizes(dataset, index, seed=0)
        index += 1
        _, rows = family.sized(drawn)
        own = rows if OWN_FAMILY[dataset] == "qwen2-vl" else rows * encoder.tokens_per_image
        length = drawn.text_tokens + math.ceil(own / encoder.tokens_per_image * per_image)
        if length <= capacity:
            tokens.append(length)
            patches.append(own)
    sizes = SampleSizes(np.asarray(tokens, dtype=np.int64), np.asarray(patches, dtype=np.int64))
    return sizes, 1 - count / index


def packed_steps(sizes: SampleSizes, planned: Planned, batches: int, method: str):
    """Per step: its microbatches' sample indices (all replicas'), filled to the microbatches'
    tokens from the stream, what does not fit carried into the next."""
    total = planned.microbatches * planned.replicas
    tokens, tiles = sizes.llm_tokens.tolist(), sizes.vision_rows.tolist()
    carried, cursor, out = [], 0, []
    for _ in range(batches):
        todo, room = list(carried), total * planned.capacity - sum(tokens[i] for i in carried)
        while cursor < len(tokens) and tokens[cursor] <= room:
            todo.append(cursor)
            room -= tokens[cursor]
            cursor += 1
        made = assign(
            [tokens[i] for i in todo],
            [tiles[i] for i in todo],
            total,
            planned.capacity,
            first=len(carried),
            replicas=planned.replicas,
            method=method,
        )
        carried = [todo[k] for k in made.deferred]
        out.append([[todo[k] for k in row] for row in made.rows])
        if cursor == len(tokens):
            raise RuntimeError(f"the sample stream ran out at step {len(out)}: draw more samples")
    return out


def isf_steps(sizes: SampleSizes, planned: Planned, batches: int):
    total = planned.microbatches * planned.replicas
    ratio = int(sizes.vision_rows.sum()) / max(1, int(sizes.llm_tokens.sum()))
    vision = max(1, round(planned.capacity * ratio))
    targets = IsfTargets(vision, planned.capacity, vision, planned.capacity - planned.capacity // 32)
    groups = list(isf_epoch(sizes, targets, seed=0).batches)
    return [groups[k * total : (k + 1) * total] for k in range(min(batches, len(groups) // total))]


def megatron_steps(sizes: SampleSizes, planned: Planned, batches: int):
    mbs = planned.global_batch // (planned.microbatches * planned.replicas)
    step = planned.global_batch
    return [
        [list(range(k * step + j * mbs, k * step + (j + 1) * mbs)) for j in range(step // mbs)]
        for k in range(batches)
    ]


def _work(rows, tiles, planned: Planned):
    return [(sum(tiles[i] for i in row) / planned.mean_patches, 1.0) for row in rows]


def _heaviest(step, tiles, planned: Planned, replicas_timed: int):
    m = planned.microbatches
    replicas = [step[d * m : (d + 1) * m] for d in range(len(step) // m)]
    replicas.sort(key=lambda r: -sum(tiles[i] for row in r for i in row))
    return [_work(r, tiles, planned) for r in replicas[:replicas_timed]]


def _samples_needed(setup, dataset: str, batches: int) -> int:
    """Samples enough for ``batches`` steps of every method: packed steps take a step's tokens
    (every microbatch full) of samples of the dataset's mean length, Megatron-LM's a global batch."""
    cfg = models.config(setup.model)
    probe, _ = sample_sizes(dataset, 2000, cfg, setup.microbatch_size * cfg.llm_tokens)
    per_step_tokens = setup.global_batch * cfg.llm_tokens
    per_step = max(setup.global_batch, per_step_tokens / float(probe.llm_tokens.mean()))
    return math.ceil(1.5 * batches * per_step)


def run_job(args) -> dict:
    name, dataset, batches, replicas_timed, methods = args
    setup = SETUPS[name]
    try:
        planned = plan_setup(name, dataset, _samples_needed(setup, dataset, batches))
    except PlanError as err:
        return {"setup": name, "dataset": dataset, "note": f"not planned: {err}", "methods": {}}
    cluster = Cluster.preset(planned.cluster)
    sizes = planned.sizes
    tiles, lengths = sizes.vision_rows.tolist(), sizes.llm_tokens.tolist()
    cfg_tokens = models.config(setup.model).llm_tokens
    steps = {
        "static": packed_steps(sizes, planned, batches, "tokens"),
        "per-batch + balanced": packed_steps(sizes, planned, batches, "greedy"),
        "ISF + per-batch": isf_steps(sizes, planned, batches),
        "megatron": megatron_steps(sizes, planned, batches),
    }
    steps["per-batch"] = steps["static"]
    steps["torchtitan"] = steps["static"]
    row = {
        "setup": name,
        "dataset": dataset,
        "batches": batches,
        "plan_s": planned.plan_s,
        "mean_patches_per_microbatch": planned.mean_patches,
        "too_long_share": planned.too_long,
        "llm_alone_step_s": planned.llm_alone_s,
        "methods": {},
    }
    ours_costs = plan_costs(planned.ours, planned.graph, cluster)
    per_microbatch = busy_per_microbatch(planned, cluster, ours_costs)
    for method in methods:
        plan = (
            planned.ours if method in ("static",) or "per-batch" in method else planned.baselines.get(method)
        )
        if plan is None:
            row["methods"][method] = {"note": "no plan of this policy fits the setup"}
            continue
        costs = ours_costs if plan is planned.ours else plan_costs(plan, planned.graph, cluster)
        scheduler = per_batch_scheduler(plan, planned.graph, cluster) if "per-batch" in method else None
        times, samples, trained, solves, bubbles_share, bounds = [], [], [], [], [], []
        # Megatron-LM cuts each sample to the sequence length; packed steps train every token.
        cut = cfg_tokens if method == "megatron" else planned.capacity
        for step in steps[method]:
            work = _heaviest(step, tiles, planned, replicas_timed)
            bounds.append(step_bound(_work(step, tiles, planned), per_microbatch, planned))
            samples.append(sum(len(r) for r in step))
            trained.append(sum(min(lengths[i], cut) for r in step for i in r))
            if scheduler is not None:
                made = scheduler.schedule(work)
                times.append(made.step_s)
                solves.append(made.solve_s / len(work))
                continue
            sims = [simulate(plan, planned.graph, cluster, costs=costs, work=w) for w in work]
            slowest = max(sims, key=lambda s: s.step_time_s)
            times.append(slowest.step_time_s)
            bubbles_share.append(slowest.bubble_share)
        row["methods"][method] = _summary(times, samples, trained, solves, bubbles_share, scheduler, bounds)
    return row


def busy_per_microbatch(planned: Planned, cluster: Cluster, costs) -> tuple[float, float]:
    """Compute seconds of one microbatch summed over a pipeline's ranks: its encoder side and its
    LLM side at the costed size (a step's compute is linear in its microbatches' work factors)."""
    m = planned.microbatches
    sides = []
    for work in ([(1.0, 0.0)] * m, [(0.0, 1.0)] * m):
        sim = simulate(planned.ours, planned.graph, cluster, costs=costs, work=work)
        sides.append(sum(r.busy_s for r in sim.ranks) / m)
    return sides[0], sides[1]


def step_bound(work, per_microbatch: tuple[float, float], planned: Planned) -> float:
    """No step at these degrees is faster than the LLM without its encoders, nor than its whole
    compute (every replica's microbatches, at our plan's recompute) spread evenly over every rank."""
    encoder, llm = per_microbatch
    compute = sum(encoder * e + llm * w for e, w in work)
    return max(planned.llm_alone_s, compute / (planned.ours.num_ranks * planned.replicas))


def _summary(times, samples, trained, solves, bubbles_share, scheduler, bounds) -> dict:
    out = {
        "steps": len(times),
        "step_mean_s": statistics.fmean(times),
        "step_p95_s": Spread.of(times).p95,
        "bound_step_mean_s": statistics.fmean(bounds),
        "of_bound": statistics.fmean(bounds) / statistics.fmean(times),
        "samples_per_step": statistics.fmean(samples),
        "samples_per_s": sum(samples) / sum(times),
        "tokens_per_s": sum(trained) / sum(times),
    }
    if bubbles_share:
        out["bubble_share"] = statistics.fmean(bubbles_share)
    if scheduler is not None:
        out["solve_mean_s"] = statistics.fmean(solves)
        out["solve_share_of_step"] = statistics.fmean(solves) / out["step_mean_s"]
        shares = [solve / step for solve, step in zip(solves, times)]
        out["solve_share_p95"] = Spread.of(shares).p95
        out["solve_share_max"] = max(shares)
        out["fell_back"] = scheduler.timed_out
        out["time_limit_s"] = scheduler.time_limit_s
    return out


def assignment_row(dataset: str, steps: int = 20, step_samples: int = 64, time_limit_s: float = 0.5) -> dict:
    """Token packing, the greedy assignment and CP-SAT's on ``steps`` steps of ``dataset`` (its own
    family, rows of 8K tokens, two replicas): the heaviest microbatch's image rows over the mean,
    the heavier replica's over half, and the time each took (medians over the steps)."""
    family = released_layouts()[OWN_FAMILY[dataset]]
    drawn = [family.sized(draw_sizes(dataset, i, seed=0)) for i in range(steps * step_samples)]
    budget = 8192
    out = {"dataset": dataset, "methods": {}}
    for method in ("tokens", "greedy", "cp-sat"):
        heaviest, replica, took, said = [], [], [], set()
        for k in range(steps):
            step = [d for d in drawn[k * step_samples : (k + 1) * step_samples] if d[0] <= budget]
            lengths, rows = [d[0] for d in step], [d[1] for d in step]
            m = -(-sum(lengths) // budget) + 2
            m += m % 2
            made = assign(lengths, rows, m, budget, replicas=2, method=method, time_limit_s=time_limit_s)
            per = made.image_rows(rows)
            mean = sum(per) / m
            heaviest.append(max(per) / mean if mean else 1.0)
            replica.append(max(sum(per[: m // 2]), sum(per[m // 2 :])) / (sum(per) / 2) if sum(per) else 1.0)
            took.append(made.solve_s)
            said.add(made.method.split(" (")[0] if "time limit" not in made.method else "cp-sat (time limit)")
        out["methods"][method] = {
            "heaviest_over_mean": statistics.median(heaviest),
            "heavier_replica_over_half": statistics.median(replica),
            "solve_s": statistics.median(took),
            "outcomes": sorted(said),
        }
    return out


def assignment_table(rows: list[dict]) -> str:
    head = [
        "dataset",
        "assignment",
        "heaviest microbatch / mean",
        "heavier replica / half",
        "time a step (median)",
    ]
    body = [
        [
            row["dataset"],
            f"{method} ({', '.join(m['outcomes'])})",
            f"{m['heaviest_over_mean']:.3f}",
            f"{m['heavier_replica_over_half']:.3f}",
            f"{1e3 * m['solve_s']:.1f} ms",
        ]
        for row in rows
        for method, m in row["methods"].items()
    ]
    return github_table(head, body) + "\n"


def markdown_table(rows: list[dict]) -> str:
    head = [
        "setup",
        "dataset",
        "batches",
        "method",
        "step mean / p95 (s)",
        "samples/s",
        "tokens/s trained",
        "vs static",
        "of bound",
        "solve / step",
    ]
    unmeasured = [""] * 5  # a row that ran nothing: its note stands in the step column, the rest blank
    body = []
    for row in rows:
        if "note" in row:
            body.append([row["setup"], row["dataset"], "-", "-", row["note"], *unmeasured])
            continue
        static = row["methods"].get("static", {}).get("tokens_per_s")
        for method, m in row["methods"].items():
            if "note" in m:
                body.append([row["setup"], row["dataset"], row["batches"], method, m["note"], *unmeasured])
                continue
            vs = f"{m['tokens_per_s'] / static:.3f}x" if static else "-"
            bound = f"{m['of_bound']:.2f}" if "of_bound" in m else "-"
            solve = "-"
            if "solve_mean_s" in m:
                worst = f"max {100 * m['solve_share_max']:.1f} %, " if "solve_share_max" in m else ""
                solve = f"{100 * m['solve_share_of_step']:.1f} % ({worst}{m['fell_back']} late)"
            body.append(
                [
                    row["setup"],
                    row["dataset"],
                    row["batches"],
                    method,
                    f"{m['step_mean_s']:.2f} / {m['step_p95_s']:.2f}",
                    f"{m['samples_per_s']:.1f}",
                    f"{m['tokens_per_s'] / 1e3:.1f} K",
                    vs,
                    bound,
                    solve,
                ]
            )
    return github_table(head, body) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=200, help="global batches per dataset (default 200)")
    parser.add_argument("--setups", nargs="*", default=list(DEFAULT_SETUPS), choices=sorted(SETUPS))
    parser.add_argument("--datasets", nargs="*", default=list(DISTRIBUTIONS), choices=sorted(DISTRIBUTIONS))
    parser.add_argument("--replicas-timed", type=int, default=1, help="replicas simulated a step (default 1)")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS, help="(default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--json", default=str(RESULTS), help=f"result JSON (default {RESULTS})")
    parser.add_argument(
        "--readme", action="store_true", help="write the table into docs/data.md (section dynamic_batches)"
    )
    args = parser.parse_args(argv)
    if args.batches < 1 or args.replicas_timed < 1 or args.jobs < 1:
        parser.error("--batches, --replicas-timed and --jobs take positive numbers")
    began = time.perf_counter()
    methods = [m for m in METHODS if m in args.methods]
    jobs = [
        (name, d, args.batches, args.replicas_timed, methods) for name in args.setups for d in args.datasets
    ]
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        assigned = pool.map_async(assignment_row, args.datasets)
        rows = []
        for k, row in enumerate(pool.imap_unordered(run_job, jobs), 1):
            rows.append(row)
            # Written as rows finish: a run stopped at a time limit keeps what it measured.
            Path(args.json).write_text(json.dumps({"partial": True, "rows": rows}, indent=1) + "\n")
            said = row.get("note", f"planned in {row.get('plan_s', 0):.0f} s")
            print(f"  [{k}/{len(jobs)}] {row['setup']} {row['dataset']}: {said}", file=sys.stderr, flush=True)
        assignments = assigned.get()
    rows.sort(key=lambda r: (args.setups.index(r["setup"]), args.datasets.index(r["dataset"])))
    out = {
        "note": "simulated by the cost model: predictions, not measurements",
        "replicas_timed": args.replicas_timed,
        "wall_s": time.perf_counter() - began,
        "rows": rows,
        "assignment": assignments,
    }
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    table = (
        markdown_table(rows)
        + "\nMicrobatch assignment (each dataset under its own family, 64 samples a step):\n\n"
    )
    table += assignment_table(assignments)
    print(table)
    if args.readme:
        write_readme_section("dynamic_batches", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
