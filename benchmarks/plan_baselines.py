"""Simulate the Megatron-LM baselines on every Optimus and OmniBal setup of paper_setups.json.

For each setup (``vlmcompile.planning.setups``) the model is annotated once on meta tensors;
``megatron`` (with the encoder placement the setup names) and ``megatron_balanced`` (the Optimus
appendix-B split) are planned at the same degrees, v, microbatches and recompute rule (the
setup's, or the least global recompute that fits in memory), and simulated. Every figure is a
prediction of the cost model, not a measurement. Simulation time (median of 3 runs, this
machine) is recorded for the issue's speed goals: Model D (512 GPUs) within 2 s, the
3072-GPU strong-scaling setup within 5 s.

    python benchmarks/plan_baselines.py [--only NAME ...] [--readme]

writes ``benchmarks/results/plan_baselines.json`` and prints a Markdown table; ``--readme``
also replaces the table between its markers (in docs/benchmarks.md).
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
from readme_section import github_table, write_readme_section

from vlmcompile.compiler import zoo_layer_graph
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.passes.planning.policies import plan_and_simulate
from vlmcompile.planning.setups import SETUPS
from vlmcompile.sim.simulator import simulate

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "plan_baselines.json"


def _graph(model: str, cache: dict):
    if model not in cache:
        start = time.perf_counter()
        cache[model] = zoo_layer_graph(model)
        print(f"  annotated {model} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return cache[model]


def _row(setup, policy, run, sim_s):
    sim = run.sim
    share = sim.idle_share()
    par = run.plan.pipeline_parallel
    return {
        "setup": setup.name,
        "model": setup.model,
        "cluster": setup.cluster,
        "policy": policy,
        "placement": setup.placement if policy == "megatron" else None,
        "parallel": {"dp": par.dp, "tp": par.tp, "pp": par.pp, "v": par.v},
        "microbatches": run.plan.num_microbatches,
        "schedule": run.plan.schedule,
        "recompute": run.recompute,
        "fits": run.fits,
        "step_time_s": sim.step_time_s,
        "mfu": sim.mfu,
        "hfu": sim.hfu,
        "bubble_share": sim.bubble_share,
        "bubble_share_by_cause": share,
        "peak_mem_gib_per_stage": [r.peak_mem_bytes / 2**30 for r in sim.ranks],
        "simulate_s_median": sim_s,
        "megatron_layout": run.report.layout,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="*", help="setup names to run (default: all)")
    parser.add_argument("--readme", action="store_true", help="update its table (README.md or docs/)")
    args = parser.parse_args(argv)
    names = args.only or list(SETUPS)
    graphs: dict = {}
    rows = []
    for name in names:
        setup = SETUPS[name]
        print(f"{name}: {setup.model} on {setup.cluster}", file=sys.stderr)
        graph = _graph(setup.model, graphs)
        cluster = Cluster.preset(setup.cluster)
        for policy, options in (("megatron", {"placement": setup.placement}), ("megatron_balanced", {})):
            run = plan_and_simulate(
                graph, cluster, policy, setup.request(), recompute=setup.recompute, **options
            )
            times = []
            for _ in range(3):
                start = time.perf_counter()
                simulate(run.plan, graph, cluster)
                times.append(time.perf_counter() - start)
            rows.append(_row(setup, policy, run, statistics.median(times)))
            r = rows[-1]
            print(
                f"  {policy:18s} step {r['step_time_s'] * 1e3:9.1f} ms  MFU {100 * r['mfu']:5.1f} %  "
                f"bubbles {100 * r['bubble_share']:5.1f} %  simulate {r['simulate_s_median']:.3f} s",
                file=sys.stderr,
            )
    if args.only and RESULTS.exists():
        # A partial run replaces its own rows and keeps the others, in setup order.
        fresh = {(r["setup"], r["policy"]) for r in rows}
        kept = [r for r in json.loads(RESULTS.read_text())["rows"] if (r["setup"], r["policy"]) not in fresh]
        order = list(SETUPS)
        rows = sorted([*kept, *rows], key=lambda r: (order.index(r["setup"]), r["policy"]))
    data = {
        "note": "simulated by the vlmcompile cost model: predictions, not measurements",
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(data, indent=1))
    table = markdown_table(rows)
    print(table)
    if args.readme:
        write_readme_section("plan_baselines", table)
    return 0


def markdown_table(rows: list[dict]) -> str:
    head = [
        "setup",
        "policy",
        "DP/TP/PP/V",
        "mb",
        "recompute",
        "step (s)",
        "MFU (model FLOPs)",
        "HFU (recompute counted)",
        "bubbles",
        "DP ag / warm / other / cool / TP / DP rs",
        "peak GiB per stage",
        "sim (s)",
    ]
    body = []
    for r in rows:
        p = r["parallel"]
        s = r["bubble_share_by_cause"]
        causes = " / ".join(
            f"{100 * s[c]:.1f}"
            for c in ("dp_all_gather", "pp_warmup", "pp_other", "pp_cooldown", "tp_comm", "dp_reduce_scatter")
        )
        peaks = " ".join(f"{g:.0f}" for g in r["peak_mem_gib_per_stage"])
        fits = "" if r["fits"] else " (does not fit)"
        policy = f"{r['policy']} ({r['placement']})" if r.get("placement") else r["policy"]
        body.append(
            [
                r["setup"],
                policy,
                f"{p['dp']}/{p['tp']}/{p['pp']}/{p['v']}",
                r["microbatches"],
                f"{r['recompute']}{fits}",
                f"{r['step_time_s']:.2f}",
                f"{100 * r['mfu']:.1f} %",
                f"{100 * r['hfu']:.1f} %",
                f"{100 * r['bubble_share']:.1f} %",
                causes,
                peaks,
                f"{r['simulate_s_median']:.2f}",
            ]
        )
    return github_table(head, body)


if __name__ == "__main__":
    sys.exit(main())
