"""Run ``vlmcompile demo`` several times and report the median measured speedup of our plan over
the baselines on 2 local CPU ranks, and the prediction error of every plan.

One demo run compiles the ``demo`` VLM (profiling its layers on this CPU), then runs our plan and
every baseline's interleaved step by step in one launch (``megatron`` and ``megatron_balanced`` at
our PP = 2, each at its fastest predicted v as ours is; ``mimo_colocated`` at its only degrees,
PP = 1 and the ranks data-parallel);
a speedup is the ratio of two median step times, and its prediction the ratio of the same two
plans' simulated step times (both over the same baseline: the fastest measured at PP = 2). Runs
of the same command on a shared machine spread by several percent (the profile, the plan it
leads to and the machine's speed all vary), so the goals are checked on the median over the
repeats:

* measured speedup over the fastest baseline at our degrees (median over repeats): not slower
  (1.00x); held to a memory cap (``--memory-cap``, as on a GPU the model does not fit whole),
  at least 1.08x over every baseline that fits with 4 microbatches (a large pipeline bubble for
  the encoder work to fill), or within 3 % of the bound (every rank busy);
* prediction error |predicted - measured| / measured at most 10 % for every plan, every repeat;
* every plan's losses equal eager training.

    python benchmarks/demo_speedup.py [--repeats 5] [--global-batch 32] [--steps 6] [--readme] [--no-run]

writes ``benchmarks/results/demo_speedup.json`` (one entry per global batch), prints a Markdown table, and exits 1 when a
goal is missed; ``--readme`` also replaces the table between its markers (in docs/benchmarks.md)
(``demo_speedup_<global batch>``). The default global batch is the full-size demo's
(``vlmcompile demo --full``, about 6.5 minutes a run on 2 idle cores; ``vlmcompile demo``'s
default is 8, about 2.5 minutes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from readme_section import github_table, write_readme_section

from vlmcompile.demo import DEFAULT_STEPS, FULL_GLOBAL_BATCH, run_demo

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "demo_speedup.json"
BUBBLE_BATCH = 4
"""4 microbatches of one sample on PP = 2: the pipeline bubble is large."""
SPEEDUP_GOALS = {BUBBLE_BATCH: 1.08}
"""Measured speedup held to a memory cap (``--memory-cap``), per global batch (default 1.00): over
every baseline that fits. Without a cap the goal is 1.00x over the fastest baseline at our
degrees: the demo's model fits whole on a rank, our search takes PP = 1 with DP = 2 where it is
the fastest, and that plan is Megatron MIMO's colocated layout (issue 36 moved the 1.08x of
global batch 4 to the capped run, where data parallelism is no plan)."""
ERROR_GOAL = 0.10


BOUND_GOAL = 1.03
"""Held to a memory cap: where every fitting baseline is not 1.08x slower, ours within 3 % of the
bound (every rank busy: our plan's compute over the ranks)."""


def speedup_goal(global_batch: int) -> float:
    return SPEEDUP_GOALS.get(global_batch, 1.0)


def entry_key(global_batch: int, memory_cap: str | None = None, freeze: list[str] | None = None) -> str:
    """The results file's key of a configuration: "4", "4 --memory-cap 0.6 --freeze vision"."""
    return (
        str(global_batch)
        + (f" --memory-cap {memory_cap}" if memory_cap else "")
        + (f" --freeze {','.join(freeze)}" if freeze else "")
    )


def predicted_speedup(run: dict) -> float:
    """A demo run's predicted speedup over the baseline its measured speedup is over (computed from
    the plans' predictions: runs saved before 2026-11-26 kept the best predicted baseline's)."""
    predicted = {p["policy"]: p["predicted_s"] for p in run["runs"]}
    return predicted[run["best_baseline"]] / run["runs"][0]["predicted_s"]


def _table(runs: list[dict]) -> str:
    policies = [p["policy"] for p in runs[0]["runs"]]
    head = ["run", "ours: degrees, layers per stage"] + [
        f"{p}: predicted / measured s (error)" for p in policies
    ]
    head += ["speedup over the fastest at our degrees (predicted)"]
    body = []
    for k, r in enumerate(runs, 1):
        ours = r["runs"][0]
        cells = [str(k), f"{ours['degrees']}: {ours['stages']}"]  # github_table escapes the stages' pipes
        for p in r["runs"]:
            same = p["degrees"].split()[0] == ours["degrees"].split()[0]
            at = "" if same else f" at {p['degrees']}"
            cells.append(f"{p['predicted_s']:.3f} / {p['measured_s']:.3f} ({100 * p['error']:+.1f} %){at}")
        cells.append(
            f"{r['speedup']:.2f}x over {r['best_baseline']} ({predicted_speedup(r):.2f}x)"
            if r["best_baseline"]
            else "-"
        )
        body.append(cells)
    return github_table(head, body)


def report(runs: list[dict], summary: dict, command: str) -> str:
    """The per-run table and the summary line, in Markdown."""
    errors = ", ".join(f"{100 * e:.1f} % ({p})" for p, e in summary["max_abs_error"].items())
    over = ", ".join(f"{p} {v:.2f}x" for p, v in summary["median_speedup_over"].items())
    first = runs[0]
    held = ""
    if first.get("memory_cap_gib"):
        held = f"Every plan held to {first['memory_cap_gib']:.3f} GiB per rank" + (
            f"; not fitting, so not run: {', '.join(summary['not_fitting'])}. "
            if summary.get("not_fitting")
            else ". "
        )
    if first.get("frozen"):
        held += f"Frozen: {len(first['frozen'])} layers ({first['frozen'][0]} .. {first['frozen'][-1]}). "
    bound = (
        f" Ours measured over the bound (every rank busy, simulated): {summary['median_over_bound']:.2f}x (median)."
        if summary.get("median_over_bound")
        else ""
    )
    return (
        f"{_table(runs)}\n\n{held}Median measured speedup over the fastest baseline at our degrees "
        f"{summary['median_speedup']:.2f}x over {len(runs)} runs (from {summary['min_speedup']:.2f}x to "
        f"{summary['max_speedup']:.2f}x; predicted over the same baseline {summary['median_predicted_speedup']:.2f}x); "
        "median over each "
        f"baseline: {over}.{bound} Largest prediction error: {errors}. Command: `{command}`."
    )


def summarize(runs: list[dict]) -> dict:
    speedups = [r["speedup"] for r in runs if r["speedup"] is not None] or [float("nan")]
    policies = [p["policy"] for p in runs[0]["runs"]]
    return {
        "median_speedup": statistics.median(speedups),
        "min_speedup": min(speedups),
        "max_speedup": max(speedups),
        "median_predicted_speedup": statistics.median(predicted_speedup(r) for r in runs),
        "median_speedup_over": {
            p: statistics.median(r[f"speedup_over_{p}"] for r in runs) for p in policies[1:]
        },
        "max_abs_error": {p: max(abs(r["runs"][j]["error"]) for r in runs) for j, p in enumerate(policies)},
        "all_equal_to_eager": all(p["equal_to_eager"] for r in runs for p in r["runs"]),
        "not_fitting": sorted({p for r in runs for p in r.get("not_fitting", {})}),
        "median_over_bound": statistics.median(
            r["runs"][0]["measured_s"] / r["bound_step_s"] for r in runs if r.get("bound_step_s")
        )
        if all(r.get("bound_step_s") for r in runs)
        else None,
    }


def goals_missed(summary: dict, global_batch: int, *, capped: bool = False) -> list[str]:
    missed = []
    goal = speedup_goal(global_batch)
    if capped:
        # Held to a memory cap: 1.08x over every baseline that fits, or within 3 % of the bound.
        bound = summary.get("median_over_bound")
        near = bound is not None and bound <= BOUND_GOAL
        for policy, speedup in summary["median_speedup_over"].items():
            if speedup < goal and not near:
                missed.append(
                    f"median measured speedup over {policy} {speedup:.2f}x < {goal}x, and ours is "
                    f"{bound:.2f}x the bound (goal <= {BOUND_GOAL})"
                )
    elif summary["median_speedup"] is not None and summary["median_speedup"] < 1.0:
        missed.append(f"median measured speedup {summary['median_speedup']:.2f}x < 1.00x")
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
        "--global-batch",
        type=int,
        default=FULL_GLOBAL_BATCH,
        help=f"samples per step (default {FULL_GLOBAL_BATCH}, as vlmcompile demo --full)",
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="steps per plan and run, the first a warm-up"
    )
    parser.add_argument(
        "--readme", action="store_true", help="update the table between its markers in docs/benchmarks.md"
    )
    parser.add_argument("--memory-cap", help="as vlmcompile demo --memory-cap (e.g. 0.6)")
    parser.add_argument(
        "--freeze", type=lambda t: t.split(","), help="as vlmcompile demo --freeze (e.g. vision)"
    )
    parser.add_argument(
        "--no-run", action="store_true", help="run nothing: print (and with --readme write) the saved table"
    )
    args = parser.parse_args(argv)
    key = entry_key(args.global_batch, args.memory_cap, args.freeze)
    section = "demo_speedup_" + key.replace(" --memory-cap ", "_cap").replace(" --freeze ", "_frozen_")
    if args.no_run:
        saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        if key not in saved:
            parser.error(f"{RESULTS} has no runs at --global-batch {key}; run without --no-run")
        entry = saved[key]
        if any("best_baseline" not in r for r in entry["runs"]):
            parser.error(
                f"the saved runs at --global-batch {args.global_batch} predate the demo's comparison with every "
                "baseline; run without --no-run"
            )
        summary = summarize(entry["runs"])  # from the runs: the saved one may predate a change of the figures
        text = report(entry["runs"], summary, entry["command"])
        print(text)
        if args.readme:
            write_readme_section(section, text)
        return 1 if goals_missed(summary, args.global_batch, capped=bool(args.memory_cap)) else 0
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: run the demo at least once")
    runs = []
    start = time.perf_counter()
    for k in range(args.repeats):
        _, result = run_demo(
            global_batch=args.global_batch,
            num_steps=args.steps,
            log=None,
            memory_cap=args.memory_cap,
            freeze=args.freeze or (),
        )
        runs.append(result.to_json())
        best = result.best_baseline
        over = (
            f"speedup {result.speedup:.2f}x over {best.policy} (predicted {result.predicted_speedup:.2f}x)"
            if best
            else "no baseline fits"
        )
        print(
            f"run {k + 1}/{args.repeats}: {over}, ours {result.ours.measured_s / result.bound_step_s:.2f}x the "
            f"bound; {time.perf_counter() - start:.0f} s so far",
            file=sys.stderr,
            flush=True,
        )
    summary = summarize(runs)
    command = (
        f"python benchmarks/demo_speedup.py --repeats {args.repeats} --global-batch {args.global_batch} "
        f"--steps {args.steps}"
        + (f" --memory-cap {args.memory_cap}" if args.memory_cap else "")
        + (f" --freeze {','.join(args.freeze)}" if args.freeze else "")
    )
    # One entry per global batch: a run at another batch keeps the others.
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    saved[key] = {
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
        write_readme_section(section, text)
    missed = goals_missed(summary, args.global_batch, capped=bool(args.memory_cap))
    for line in missed:
        print(f"goal missed: {line}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
