"""How long ``vlmcompile plan --setup NAME --search`` takes, end to end, and what it chooses.

    python benchmarks/search_speed.py [--only NAME ...] [--repeats 3] [--readme] [--no-run]

Each setup's command runs ``--repeats`` times as a user runs it (a fresh process: the model
annotated on meta tensors, the plan search, the encoder-in-bubbles pass at the degrees it
chooses, every baseline there); the figures are the median wall time and the spread, the plan
chosen and its simulated step (a prediction of the cost model), and the search's own line
(candidates planned, screened, pruned, failed). ``BEFORE`` holds the search as it was before the
bounds and the screen (commit 2f6f32f), measured once per setup.

Results go to ``results/search_speed.json``; ``--readme`` writes the table into docs/benchmarks.md.

``--scale`` runs the search once per row of :data:`SCALE` instead (how its time grows with GPUs,
with layers and with encoders: Optimus's Model D from 1536 to 16,384 H100s, a ViT and an LLM from
75 to 300 layers, three encoders on one LLM), and ``--readme`` writes that table into
docs/benchmarks.md (section ``search_scale``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from readme_section import github_table, write_readme_section

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "search_speed.json"
SETUPS = ("optimus-strong-3072", "optimus-multi-22B-11B", "omnibal-Qwen1.5-110B")
GOAL_S = 60.0
"""The wall time each setup's search must stay within (the median)."""

BEFORE = {
    "note": (
        "the search at commit 2f6f32f (search_and_compare with 3 s of CP-SAT per candidate, every "
        "candidate its bound left partitioned), run once per setup on this machine while other work "
        "ran beside it; the wall time includes annotating the model"
    ),
    "optimus-multi-22B-11B": {
        "wall_s": 776.3,
        "step_s": 4.021815539650784,
        "plan": "DP=8 TP=4 PP=16 V=4 mb=1",
    },
    "optimus-strong-3072": {
        "wall_s": 1563.5,
        "step_s": 3.661945404265484,
        "plan": "DP=96 TP=4 PP=8 V=4 mb=1",
    },
    # benchmarks/partition.py's search row (results/partition.json, 2026-11-24): the search alone (no
    # annotation), before the encoder-in-bubbles pass joined it; its step is the one-chain plan's
    # (ours now: the same one-chain plan, 132845 ms, then the encoder-in-bubbles plan at its degrees)
    "omnibal-Qwen1.5-110B": {
        "wall_s": 864.0,
        "step_s": 132.84465581366615,
        "plan": "DP=2 TP=8 PP=4 V=1 mb=1",
    },
}

SCALE = (
    # (what grows, model, cluster, global batch)
    ("GPUs", "Optimus-Model-D", "h100x1536", 1536),
    ("GPUs", "Optimus-Model-D", "h100x3072", 1536),
    ("GPUs", "Optimus-Model-D", "h100x16384", 1536),
    ("layers", "ViT-11B:25+GPT-11B:50", "h100x512", 256),
    ("layers", "ViT-11B:50+GPT-11B:100", "h100x512", 256),
    ("layers", "ViT-11B:100+GPT-11B:200", "h100x512", 256),
    ("encoders", "ViT-22B+ViT-11B+ViT-5B+GPT-175B", "h100x512", 256),
)
"""The plan-search scale rows: a 16,384-GPU Optimus, a 100-layer ViT with a 200-layer LLM (GPT-11B
and ViT-11B widths at other depths, ``NAME:DEPTH``), a model with three encoders."""

SEARCH_LINE = re.compile(r"plan search on \S+: (\d+) candidates in ([\d.]+) s \(([^)]*)\)")


def run_once(name: str, model_args: tuple[str, ...] = ()) -> dict:
    """One ``vlmcompile plan --search`` in a fresh process: of setup ``name``, or (``model_args``)
    of the model, cluster and global batch they give."""
    what = list(model_args) if model_args else ["--setup", name]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "vlmcompile", "plan", *what, "--search", "--json", str(out)],
            capture_output=True,
            text=True,
            env={**os.environ, "TQDM_DISABLE": "1"},
            timeout=3600,
        )
        wall = time.perf_counter() - start
        if done.returncode not in (0, 3):  # 3: the plan does not fit (said in the output)
            raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
        data = json.loads(out.read_text())
    found = SEARCH_LINE.search(done.stdout)
    plan = data["plan"]
    groups = plan["parallel"]
    par = groups.get("model") or groups["llm"]  # one chain, or the LLM's beside the encoders' plan
    return {
        "wall_s": wall,
        "step_s": data["simulation"]["step_time_s"],
        "plan": f"DP={par['dp']} TP={par['tp']} PP={par['pp']} V={par['v']} mb={plan['microbatch_size']}",
        "groups": sorted(plan["parallel"]),
        "search_s": float(found.group(2)) if found else None,
        "candidates": found.group(1) + " (" + found.group(3) + ")" if found else None,
        "layers": sum(len(stage["layers"]) for stage in plan["stages"]),
        "fits": done.returncode == 0,
    }


def measure_scale() -> list[dict]:
    """Each :data:`SCALE` row's search, once (a fresh process each)."""
    rows = []
    for grows, model, cluster, batch in SCALE:
        args = ("--model", model, "--cluster", cluster, "--global-batch", str(batch))
        run = run_once(model, args)
        rows.append({"grows": grows, "model": model, "cluster": cluster, "global_batch": batch, **run})
        print(f"{model} on {cluster}: {run['wall_s']:.1f} s, {run['plan']}", file=sys.stderr)
    return rows


def scale_table(rows: list[dict]) -> str:
    head = [
        "grows",
        "model",
        "layers",
        "cluster",
        "candidates",
        "wall (one run)",
        "search alone",
        "plan chosen",
        "simulated step",
    ]
    body = []
    for r in rows:
        plan = (
            r["plan"]
            + (" + encoder plan" if len(r["groups"]) > 1 else "")
            + ("" if r["fits"] else ", over memory")
        )
        body.append(
            [
                r["grows"],
                r["model"],
                r["layers"],
                r["cluster"],
                r["candidates"],
                f"{r['wall_s']:.1f} s",
                f"{r['search_s']:.1f} s",
                plan,
                f"{1e3 * r['step_s']:.0f} ms",
            ]
        )
    return github_table(head, body)


def measure(names, repeats: int) -> dict:
    out = {}
    for name in names:
        runs = []
        for k in range(repeats):
            runs.append(run_once(name))
            print(f"{name} run {k + 1}: {runs[-1]['wall_s']:.1f} s, {runs[-1]['plan']}", file=sys.stderr)
        walls = [r["wall_s"] for r in runs]
        out[name] = {
            "median_wall_s": statistics.median(walls),
            "wall_s": walls,
            "within_goal": statistics.median(walls) <= GOAL_S,
            "runs": runs,
        }
    return out


def markdown_table(results: dict) -> str:
    head = [
        "setup",
        "wall (median of 3)",
        "runs",
        "search alone",
        "plan chosen",
        "simulated step",
        "before: wall, step",
    ]
    body = []
    for name, r in results["setups"].items():
        last = r["runs"][-1]
        steps = {round(x["step_s"], 6) for x in r["runs"]}
        before = BEFORE.get(name)
        was = f"{before['wall_s']:.0f} s, {1e3 * before['step_s']:.0f} ms" if before else "-"
        plan = last["plan"] + (" + encoder plan" if len(last["groups"]) > 1 else "")
        body.append(
            [
                name,
                f"{r['median_wall_s']:.1f} s",
                ", ".join(f"{w:.0f}" for w in r["wall_s"]) + " s",
                f"{last['search_s']:.1f} s",
                plan,
                " / ".join(f"{1e3 * s:.0f} ms" for s in sorted(steps)),
                was,
            ]
        )
    return github_table(head, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="setups to run (default: the three)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--readme", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--no-run", action="store_true", help="only print (and --readme) the stored results")
    parser.add_argument(
        "--scale", action="store_true", help="the SCALE rows (once each) instead of the setups"
    )
    args = parser.parse_args()
    if args.scale:
        stored = json.loads(RESULTS.read_text())
        if not args.no_run:
            stored["scale"] = {
                "note": "one run per row, a fresh process each, annotation included; steps simulated",
                "machine": f"{platform.machine()}, {os.cpu_count()} threads",
                "rows": measure_scale(),
            }
            RESULTS.write_text(json.dumps(stored, indent=1))
        table = scale_table(stored["scale"]["rows"])
        print(table)
        if args.readme:
            write_readme_section("search_scale", table)
        return
    if args.no_run:
        results = json.loads(RESULTS.read_text())
    else:
        names = args.only or SETUPS
        stored = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"setups": {}}
        stored["setups"].update(measure(names, args.repeats))
        results = {
            "note": "wall times measured end to end (a fresh process per run); steps simulated by the cost model",
            "machine": f"{platform.machine()}, {os.cpu_count()} threads",
            "goal_s": GOAL_S,
            "before": BEFORE,
            "setups": {n: stored["setups"][n] for n in SETUPS if n in stored["setups"]},
            **({"scale": stored["scale"]} if "scale" in stored else {}),
        }
        RESULTS.write_text(json.dumps(results, indent=1))
    table = markdown_table(results)
    print(table)
    if args.readme:
        write_readme_section("search_speed", table)


if __name__ == "__main__":
    main()
