"""Run ``vlmcompile demo`` several times and report the median measured speedup of our plan over
Megatron-LM's on 2 local CPU ranks, and the prediction error of both plans.

One demo run compiles the ``demo`` VLM (profiling its layers on this CPU), then runs our plan and
Megatron's interleaved step by step in one launch; its speedup is the ratio of the two median
step times. Runs of the same command on a shared machine spread by several percent (the
profile, the plan it leads to and the machine's speed all vary), so the goals are checked on
the median over the repeats:

* measured speedup (median over repeats) at least 1.25x;
* prediction error |predicted - measured| / measured at most 10 % for both plans, every repeat.

    python benchmarks/demo_speedup.py [--repeats 5] [--global-batch 32] [--steps 6] [--readme] [--no-run]

writes ``benchmarks/results/demo_speedup.json`` (one entry per global batch), prints a Markdown table, and exits 1 when a
goal is missed; ``--readme`` also replaces the table between its markers in README.md
(``demo_speedup_<global batch>``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from readme_section import write_readme_section

from vlmcompile.demo import run_demo

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "demo_speedup.json"
SPEEDUP_GOAL = 1.25
ERROR_GOAL = 0.10


def _table(runs: list[dict]) -> str:
    lines = [
        "| run | ours: layers per stage | ours: predicted / measured s | error | megatron: predicted / measured s | error | measured speedup | predicted speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, r in enumerate(runs, 1):
        ours, meg = r["runs"]
        stages = ours["stages"].replace("|", "\\|")  # a pipe would end the Markdown cell
        lines.append(
            f"| {k} | {stages} | {ours['predicted_s']:.3f} / {ours['measured_s']:.3f} | "
            f"{100 * ours['error']:+.1f} % | {meg['predicted_s']:.3f} / {meg['measured_s']:.3f} | "
            f"{100 * meg['error']:+.1f} % | {r['speedup']:.2f}x | {r['predicted_speedup']:.2f}x |"
        )
    return "\n".join(lines)


def report(runs: list[dict], summary: dict, command: str) -> str:
    """The per-run table and the summary line, in Markdown."""
    return (
        f"{_table(runs)}\n\nMedian measured speedup {summary['median_speedup']:.2f}x over {len(runs)} runs "
        f"(from {summary['min_speedup']:.2f}x to {summary['max_speedup']:.2f}x; predicted "
        f"{summary['median_predicted_speedup']:.2f}x); largest prediction error "
        f"{100 * summary['max_abs_error']['vlmcompile']:.1f} % (ours), "
        f"{100 * summary['max_abs_error']['megatron']:.1f} % (megatron). Command: `{command}`."
    )


def summarize(runs: list[dict]) -> dict:
    speedups = [r["speedup"] for r in runs]
    errors = {p: [r["runs"][j]["error"] for r in runs] for j, p in enumerate(("vlmcompile", "megatron"))}
    return {
        "median_speedup": statistics.median(speedups),
        "min_speedup": min(speedups),
        "max_speedup": max(speedups),
        "median_predicted_speedup": statistics.median(r["predicted_speedup"] for r in runs),
        "max_abs_error": {p: max(abs(e) for e in errs) for p, errs in errors.items()},
        "all_equal_to_eager": all(p["equal_to_eager"] for r in runs for p in r["runs"]),
    }


def goals_missed(summary: dict) -> list[str]:
    missed = []
    if summary["median_speedup"] < SPEEDUP_GOAL:
        missed.append(f"median measured speedup {summary['median_speedup']:.2f}x < {SPEEDUP_GOAL}x")
    for policy, err in summary["max_abs_error"].items():
        if err > ERROR_GOAL:
            missed.append(f"{policy}: prediction error up to {100 * err:.1f} % > {100 * ERROR_GOAL:.0f} %")
    if not summary["all_equal_to_eager"]:
        missed.append("a plan's losses differ from eager training")
    return missed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5, help="demo runs (default 5)")
    parser.add_argument(
        "--global-batch", type=int, default=32, help="samples per step (default 32, as vlmcompile demo)"
    )
    parser.add_argument("--steps", type=int, default=6, help="steps per plan and run, the first a warm-up")
    parser.add_argument("--readme", action="store_true", help="update the table in README.md")
    parser.add_argument(
        "--no-run", action="store_true", help="run nothing: print (and with --readme write) the saved table"
    )
    args = parser.parse_args(argv)
    if args.no_run:
        saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        if str(args.global_batch) not in saved:
            parser.error(f"{RESULTS} has no runs at --global-batch {args.global_batch}; run without --no-run")
        entry = saved[str(args.global_batch)]
        text = report(entry["runs"], entry["summary"], entry["command"])
        print(text)
        if args.readme:
            write_readme_section(f"demo_speedup_{args.global_batch}", text)
        return 1 if goals_missed(entry["summary"]) else 0
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: run the demo at least once")
    runs = []
    start = time.perf_counter()
    for k in range(args.repeats):
        _, result = run_demo(global_batch=args.global_batch, num_steps=args.steps, log=None)
        runs.append(result.to_json())
        print(
            f"run {k + 1}/{args.repeats}: speedup {result.speedup:.2f}x (predicted "
            f"{result.predicted_speedup:.2f}x), {time.perf_counter() - start:.0f} s so far",
            file=sys.stderr,
            flush=True,
        )
    summary = summarize(runs)
    command = f"python benchmarks/demo_speedup.py --repeats {args.repeats} --global-batch {args.global_batch} --steps {args.steps}"
    # One entry per global batch: a run at another batch keeps the others.
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    saved[str(args.global_batch)] = {
        "command": command,
        "note": "measured on this machine: 2 local CPU ranks, one thread each; predictions from the profile pass",
        "wall_s": time.perf_counter() - start,
        "summary": summary,
        "runs": runs,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(saved, indent=1))
    text = report(runs, summary, command)
    print(text)
    if args.readme:
        write_readme_section(f"demo_speedup_{args.global_batch}", text)
    missed = goals_missed(summary)
    for line in missed:
        print(f"goal missed: {line}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
