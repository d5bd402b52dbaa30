"""Measured: a frozen encoder's forwards one global batch ahead (``Plan.ahead``) against the same
encoder-in-bubbles pass without it, on 2 local CPU ranks.

The ``demo`` VLM, its vision tower frozen, compiled with its layers profiled on this CPU; the
encoder-in-bubbles pass plans PP = 2 twice, once free to run the encoder a batch ahead and once
not (``SolverOptions(run_ahead=False)``); both plans train interleaved step by step in one launch
(each step given the next batch: the same batch again, as the demo trains), against eager's
losses. Per repeat: each plan's predicted and measured step (median over the steps after the
warm-up) and the measured and predicted ratio; the summary is the median over repeats.

    python benchmarks/run_ahead.py [--repeats 3] [--global-batch 8] [--steps 6]

writes ``benchmarks/results/run_ahead.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from readme_section import github_table

from vlmcompile import models
from vlmcompile.compiler import freeze_layers, zoo_layer_graph
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.demo import _compiled, _measured  # the demo's compile and measurement, shared on purpose
from vlmcompile.passes.planning.bubbles import bubbles
from vlmcompile.planning.request import PlanRequest, SolverOptions

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "run_ahead.json"
LR = 1e-3


def one_repeat(global_batch: int, steps: int) -> dict:
    model = models.build("demo")
    frozen = freeze_layers(model, zoo_layer_graph("demo"), ["vision"])
    batch = models.sample_batch("demo", batch_size=global_batch)
    cluster = Cluster.preset("cpu:2")
    pipe = _compiled(model, batch, "demo", global_batch, cluster, _quiet, None)
    request = PlanRequest.on(
        cluster, tp=1, pp=2, global_batch=global_batch, sequence_parallel=False, zero_stage=0
    )
    plans = []
    for name, run_ahead in (("run ahead", True), ("in the step", False)):
        solver = SolverOptions(time_limit_s=10, workers=2, run_ahead=run_ahead)
        plans.append((name, bubbles(pipe.layer_graph, cluster, request, solver=solver).plan))
    ahead = plans[0][1]
    eager, runs = _measured(pipe, plans, model, batch, steps, LR, _quiet, None)
    by = {r.policy: r for r in runs}
    fast, slow = by["run ahead"], by["in the step"]
    return {
        "frozen_layers": len(frozen),
        "forwards_ahead": len(ahead.ahead),
        "plans": {
            r.policy: {
                "degrees": r.degrees,
                "stages": r.stages,
                "predicted_s": r.predicted_s,
                "measured_s": r.measured_s,
                "error": r.error,
                "step_s": list(r.step_s),
                "equal_to_eager": r.equal_to_eager,
            }
            for r in runs
        },
        "measured_ratio": slow.measured_s / fast.measured_s,
        "predicted_ratio": slow.predicted_s / fast.predicted_s,
    }


def _quiet(*_args, **_kwargs) -> None:
    return None


def markdown(entry: dict) -> str:
    head = [
        "repeat",
        "forwards ahead",
        "run ahead: predicted / measured s (error)",
        "in the step: predicted / measured s (error)",
        "in the step / run ahead, measured (predicted)",
        "losses equal eager",
    ]
    body = []
    for k, r in enumerate(entry["repeats"], 1):
        cells = [
            f"{p['predicted_s']:.3f} / {p['measured_s']:.3f} ({p['error'] * 100:+.1f} %)"
            for p in (r["plans"]["run ahead"], r["plans"]["in the step"])
        ]
        same = all(p["equal_to_eager"] for p in r["plans"].values())
        ratio = f"{r['measured_ratio']:.3f}x ({r['predicted_ratio']:.3f}x)"
        body.append([k, r["forwards_ahead"], *cells, ratio, "yes" if same else "NO"])
    s = entry["summary"]
    median = (
        f"Median over {len(entry['repeats'])} repeats: the plan without run-ahead takes "
        f"{s['measured_ratio']:.3f}x the run-ahead plan's step, measured ({s['predicted_ratio']:.3f}x "
        f"predicted). Command: `{entry['command']}`."
    )
    return github_table(head, body) + "\n\n" + median


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="compiles and measurements (default 3)")
    parser.add_argument("--global-batch", type=int, default=8, help="samples per step (default 8)")
    parser.add_argument("--steps", type=int, default=6, help="steps per plan and repeat, the first a warm-up")
    args = parser.parse_args(argv)
    repeats = []
    for k in range(args.repeats):
        started = time.perf_counter()
        repeats.append(one_repeat(args.global_batch, args.steps))
        r = repeats[-1]
        print(
            f"repeat {k + 1}/{args.repeats}: {r['forwards_ahead']} forwards ahead; in the step / run ahead "
            f"{r['measured_ratio']:.3f}x measured, {r['predicted_ratio']:.3f}x predicted "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    entry = {
        "note": "measured on this machine's 2 local CPU ranks (predictions from the profiled cost model)",
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "command": "python benchmarks/run_ahead.py "
        f"--repeats {args.repeats} --global-batch {args.global_batch} --steps {args.steps}",
        "repeats": repeats,
        "summary": {
            "measured_ratio": statistics.median(r["measured_ratio"] for r in repeats),
            "predicted_ratio": statistics.median(r["predicted_ratio"] for r in repeats),
        },
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(entry, indent=1))
    print(markdown(entry))
    if not all(p["equal_to_eager"] for r in repeats for p in r["plans"].values()):
        print("a plan's losses differ from eager's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
