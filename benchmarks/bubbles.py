"""Encoder work in the LLM's bubbles on every Optimus setup, against every baseline at the same
LLM degrees and against the LLM alone (simulated: predictions of the cost model, not
measurements).

    python benchmarks/bubbles.py [--only NAME ...] [--frozen | --trainable] [--readme] [--no-run]

Per setup (``vlmcompile.planning.setups``, the ``optimus-*`` ones: weak scaling, strong scaling,
multi-encoder, single node), at the paper's request (DP/TP/PP, v, microbatches), with the
vision encoder trained and again frozen (``requires_grad=False``, as LLaVA's second stage trains;
every policy gets the same freezing):

* every baseline as its users run it (:func:`~vlmcompile.passes.planning.policies.compare_baselines`:
  ``megatron`` at its faster even placement, ``megatron_balanced``, ``omnibal``,
  ``torchtitan_vlm``, ``mimo_colocated``), the least global recompute that fits;
* ours: the encoder-in-bubbles pass (:func:`~vlmcompile.passes.planning.bubbles.bubbles`) at the same LLM
  degrees; where it holds more memory than the best baseline, ours held to that baseline's peak:
  the faster of the encoder-in-bubbles pass and the stage-cut partition (started from the fastest
  baseline that fits) planned there, as ``vlmcompile`` chooses;
* the bound: the same LLM without its encoders at these degrees, schedule and recompute
  (:mod:`vlmcompile.planning.llm_alone_bound`), and every rank busy (our plan's compute over the ranks).

Columns: step per policy (s), ours over the best baseline that fits, our step over the LLM
alone (the goal: <= 1.08 with the encoder trained, <= 1.02 frozen), every rank busy over the LLM
alone and the dependency bound over it (the LLM alone with one microbatch's encoder forward
before its first stage and its encoder backward after: :func:`~vlmcompile.planning.llm_alone_bound.dependency_bound`;
where either bound is above the goal, the goal is above its bound), the share of the encoder's cost
we recover against the best baseline, (best - ours) / (best - LLM alone), the share of encoder
compute run in the LLM's bubbles (layer level: while the rank's next LLM action lacked its LLM
inputs; kernel level: inside TP gaps), where our step goes past our own LLM stages run alone
(:func:`~vlmcompile.planning.llm_alone_bound.encoder_delays`: how much later the LLM starts, how much its
actions stretch, how long the step runs past its last action; in brackets the dependency bound's
head and tail), our placement's bound over the LLM alone (the least step any schedule reaches
with each of our plan's actions on its rank and the LLM's order:
:func:`~vlmcompile.planning.llm_alone_bound.placement_bound`; it bounds schedules of our placement, not
every plan, so it does not make a goal "above its bound"), our peak memory over the best
baseline's, our plan held to that memory (its speedup over the best baseline, the pass that made
it, and the encoder-in-bubbles pass's own held plan), and the pass's wall time on this machine
(measured).

Targets (issue 36): never slower than a baseline; held to the best baseline's peak memory, never
slower than it; our step within 1.08x (trained) or 1.02x (frozen) of the LLM alone, or where
a bound allows less, reported as above its bound; the pass within 30 s per setup. The
script exits 1 when one is missed and says which, and lists the held rows met only by the best
baseline's own plan (the partition's warm start, unimproved).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from readme_section import github_table, write_readme_section

from vlmcompile.compiler import zoo_layer_graph
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.errors import PlanError
from vlmcompile.passes.planning.bubbles import bubbles
from vlmcompile.passes.planning.policies import BASELINES, compare_baselines, stage_cuts
from vlmcompile.planning.llm_alone_bound import encoder_cost_recovered
from vlmcompile.planning.request import SolverOptions
from vlmcompile.planning.setups import SETUPS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "bubbles.json"
SETUP_NAMES = [n for n in SETUPS if n.startswith("optimus-")]
TARGETS = {"wall_s": 30.0, "overhead": 1.08, "overhead_frozen": 1.02}


def setup_row(name: str, graphs: dict, *, frozen: bool = False) -> dict:
    setup = SETUPS[name]
    if setup.model not in graphs:
        graphs[setup.model] = zoo_layer_graph(setup.model)
    graph, cluster, request = graphs[setup.model], Cluster.preset(setup.cluster), setup.request()
    if frozen:
        graph = graph.with_frozen(["vision"])
    runs, rows = compare_baselines(graph, cluster, request)
    steps = {r.policy: r.step_s if r.fits else None for r in rows}
    fitting = [r for r in runs if r.fits]
    best_run = min(fitting, key=lambda r: r.sim.step_time_s, default=None)
    row = {
        "setup": name,
        "frozen": frozen,
        "model": setup.model,
        "cluster": setup.cluster,
        "request": str(request),
        "degrees": (
            f"{request.parallel.dp}/{request.parallel.tp}/{request.parallel.pp}/{request.parallel.v} "
            f"mb={request.microbatch_size}x{request.num_microbatches}"
        ),
        "baselines": steps,
        "frugal_baseline_gib": min((max(r.sim.peak_mem_bytes) for r in fitting), default=0) / 2**30 or None,
        "best_baseline_gib": max(best_run.sim.peak_mem_bytes) / 2**30 if best_run else None,
    }
    solver = SolverOptions(time_limit_s=10, workers=2)
    try:
        ours = bubbles(graph, cluster, request, solver=solver)
    except PlanError as err:
        row["ours"] = None
        row["note"] = str(err)
        return row
    report = ours.report
    held = row["best_baseline_gib"]
    if held is not None and max(ours.sim.peak_mem_bytes) / 2**30 > held:
        # Our fastest plan holds more than the best baseline: plan again within its memory.
        try:
            lean = bubbles(graph, cluster, request, solver=solver, memory_budget_bytes=held * 2**30)
            row["within_memory"] = {
                "step_s": lean.sim.step_time_s,
                "peak_gib": max(lean.sim.peak_mem_bytes) / 2**30,
                "recompute": lean.report.recompute,
                "encoder_plan": str(lean.report.chosen),
                "wall_s": lean.report.wall_s,
            }
        except PlanError as err:
            row["within_memory"] = {"note": str(err)}
        row["within_memory"]["stage_cuts"] = held_stage_cuts(graph, cluster, request, held, solver)
    row.update(
        ours=ours.sim.step_time_s,
        fits=ours.fits,
        peak_gib=max(ours.sim.peak_mem_bytes) / 2**30,
        encoder_plan=str(report.chosen),
        recompute=report.recompute,
        hidden_share=report.hidden_share,
        layer_hidden_share=report.layer_hidden_share,
        kernel_hidden_share=report.kernel_hidden_share,
        llm_alone_s=report.llm_alone_step_s,
        work_bound_s=sum(r.busy_s for r in ours.sim.ranks) / len(ours.sim.ranks),
        dependency_bound_s=report.dependency_bound.step_s,
        dependency_head_tail_s=[report.dependency_bound.first_head_s, report.dependency_bound.last_tail_s],
        placement_bound_s=report.placement_bound.step_s,
        own_llm_alone_s=report.own_llm_alone_step_s,
        delays_s=[report.delays.start_s, report.delays.stretch_s, report.delays.tail_s],
        encoder_overhead=report.encoder_overhead,
        phased_s=report.phased_step_s,
        wall_s=report.wall_s,
        solver=report.solver_status,
        gap=report.gap,
    )
    print(
        f"  ours {ours.sim.step_time_s:.3f} s ({report.chosen}), {report.encoder_overhead:.3f}x the LLM alone; "
        "baselines "
        + ", ".join(f"{p} {s:.3f}" for p, s in steps.items() if s is not None)
        + f"; pass {report.wall_s:.1f} s",
        file=sys.stderr,
    )
    return row


def held_stage_cuts(graph, cluster: Cluster, request, held_gib: float, solver: SolverOptions) -> dict:
    """Our other pass held to ``held_gib`` per rank: the stage-cut partition started from the
    fastest baseline that fits there (what ``vlmcompile`` plans when the encoder-in-bubbles plan
    is the slower or does not fit)."""
    try:
        chain = stage_cuts(graph, cluster.with_memory_cap(held_gib * 2**30), request, solver=solver)
    except PlanError as err:
        return {"note": str(err)}
    return {
        "step_s": chain.sim.step_time_s,
        "peak_gib": max(chain.sim.peak_mem_bytes) / 2**30,
        "fits": chain.fits,
        "recompute": chain.recompute,
    }


def held_ours(row: dict) -> tuple[float, str] | None:
    """(step, pass) of our plan held to the best baseline's peak memory: the faster of the
    encoder-in-bubbles pass and the stage-cut partition held there (``vlmcompile``'s rule);
    None where neither has a plan."""
    lean = row.get("within_memory") or {}
    chain = lean.get("stage_cuts") or {}
    tried = [(lean["step_s"], "bubbles")] if "step_s" in lean else []
    tried += [(chain["step_s"], "partition")] if chain.get("fits") else []
    return min(tried) if tried else None


def best_baseline(row: dict) -> tuple[str, float] | None:
    fitting = [(p, s) for p, s in row["baselines"].items() if s is not None]
    return min(fitting, key=lambda ps: ps[1]) if fitting else None


def goal(row: dict) -> float:
    """Our step over the LLM alone the row aims at."""
    return TARGETS["overhead_frozen" if row.get("frozen") else "overhead"]


def markdown_table(rows: list[dict]) -> str:
    head = ["setup", "vision", "DP/TP/PP/V mb", *BASELINES, "ours", "vs best baseline"]
    head += [
        "ours / LLM alone (goal)",
        "every rank busy / LLM alone",
        "dependency bound / LLM alone",
        "our placement's bound / LLM alone",
        "encoder cost recovered vs best",
        "encoder compute in bubbles (layer + kernel)",
        "LLM start / stretch / tail ms over its stages alone (bound)",
        "peak vs best baseline's",
        "held to the best baseline's memory",
        "pass wall s",
    ]
    body = []
    for r in rows:
        cells = [r["setup"], "frozen" if r.get("frozen") else "trained", r["degrees"]]
        cells += [f"{r['baselines'][p]:.2f}" if r["baselines"].get(p) is not None else "-" for p in BASELINES]
        ours = r.get("ours")
        best = best_baseline(r)
        if not ours:
            body.append(cells + ["-"] * (len(head) - len(cells)))
            continue
        alone = r["llm_alone_s"]
        cells.append(f"{ours:.2f}")
        cells.append(f"{best[1] / ours:.2f}x ({best[0]})" if best else "-")
        cells.append(f"{ours / alone:.3f} ({goal(r):.2f})")
        cells.append(f"{r['work_bound_s'] / alone:.3f}")
        dep = r.get("dependency_bound_s")
        cells.append(f"{dep / alone:.3f}" if dep else "-")
        cells.append(f"{r['placement_bound_s'] / alone:.3f}")
        cells.append(f"{100 * encoder_cost_recovered(ours, best[1], alone):.0f} %" if best else "-")
        cells.append(f"{100 * r['layer_hidden_share']:.0f} + {100 * r['kernel_hidden_share']:.0f} %")
        cells.append(_delays_cell(r))
        held = r.get("best_baseline_gib")
        cells.append(f"{r['peak_gib'] / held:.2f}" if held else "-")
        cells.append(_within_memory_cell(r, best))
        cells.append(f"{r['wall_s']:.1f}")
        body.append(cells)
    return github_table(head, body)


def _within_memory_cell(row: dict, best: tuple[str, float] | None) -> str:
    lean = row.get("within_memory")
    if lean is None:
        return "(ours already)"
    bubbles_cell = (
        f"bubbles {lean['step_s']:.2f} s ({lean['recompute']}"
        + (f", {best[1] / lean['step_s']:.2f}x)" if best else ")")
        if "step_s" in lean
        else "bubbles: no plan"
    )
    ours = held_ours(row)
    if ours is None:
        return f"{bubbles_cell}; partition: no plan"
    over = f"{best[1] / ours[0]:.2f}x" if best else "-"
    if ours[1] == "bubbles":
        return f"{over}: bubbles {ours[0]:.2f} s ({lean['recompute']})"
    if best and _baselines_own(row, ours, best):
        return f"{over}: {best[0]}'s own plan (the partition found none faster); {bubbles_cell}"
    return f"{over}: partition {ours[0]:.2f} s; {bubbles_cell}"


def _baselines_own(row: dict, held: tuple[float, str], best: tuple[str, float]) -> bool:
    """Whether our held plan is the stage-cut partition returning its warm start, the best
    baseline's plan: the same step and peak."""
    chain = row["within_memory"].get("stage_cuts") or {}
    return (
        held[1] == "partition"
        and abs(held[0] - best[1]) <= 1e-9 * best[1]
        and abs(chain.get("peak_gib", 0.0) - row["best_baseline_gib"]) <= 1e-9 * row["best_baseline_gib"]
    )


def _delays_cell(row: dict) -> str:
    delays, bound = row.get("delays_s"), row.get("dependency_head_tail_s")
    if not delays:
        return "-"
    start, stretch, tail = (round(1e3 * d) for d in delays)  # ints: no "-0" from float residue
    cell = f"{start} / {stretch} / {tail}"
    return f"{cell} ({round(1e3 * bound[0])} / - / {round(1e3 * bound[1])})" if bound else cell


def missed_targets(rows: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """(targets missed, goals above their bound: reported with the figures, not missed, targets
    met only by the best baseline's own plan: reported, not missed)."""
    missed, above, fallback = [], [], []
    for r in rows:
        what = f"{r['setup']} ({'frozen' if r.get('frozen') else 'trained'} vision)"
        ours = r.get("ours")
        if ours is None:
            missed.append(f"{what}: no plan ({r.get('note', '')})")
            continue
        best = best_baseline(r)
        if best and ours > best[1] * (1 + 1e-9):
            missed.append(f"{what}: slower than {best[0]} ({ours:.3f} s vs {best[1]:.3f} s)")
        lean = r.get("within_memory")
        if best and lean is not None:
            held = held_ours(r)
            if held is None:
                why = [lean.get("note"), (lean.get("stage_cuts") or {}).get("note")]
                missed.append(
                    f"{what}: no plan within {best[0]}'s peak memory ({'; '.join(w for w in why if w)})"
                )
            elif held[0] > best[1] * (1 + 1e-9):
                missed.append(
                    f"{what}: held to {best[0]}'s peak memory ({r['best_baseline_gib']:.1f} GiB) ours ({held[1]}) "
                    f"takes {held[0]:.3f} s vs its {best[1]:.3f} s"
                )
            elif _baselines_own(r, held, best) and "step_s" in lean:
                fallback.append(
                    f"{what}: held to {best[0]}'s peak memory, ours is {best[0]}'s own plan (the stage-cut "
                    f"partition found nothing faster); the encoder-in-bubbles pass there is "
                    f"{best[1] / lean['step_s']:.3f}x it"
                )
        if r["wall_s"] > TARGETS["wall_s"]:
            missed.append(f"{what}: the pass took {r['wall_s']:.1f} s > 30 s")
        alone, busy, dep = r["llm_alone_s"], r["work_bound_s"], r.get("dependency_bound_s") or 0.0
        if ours / alone > goal(r) * (1 + 1e-9):
            figures = f"ours {ours:.3f} s = {ours / alone:.3f}x the LLM alone {alone:.3f} s > {goal(r):.2f}"
            bounds = f"every rank busy {busy / alone:.3f}x, the dependency bound {dep / alone:.3f}x"
            if max(busy, dep) / alone > goal(r):
                above.append(f"{what}: {figures}; {bounds} already (ours {ours / max(busy, dep):.3f}x it)")
            else:
                placed = r["placement_bound_s"] / alone  # our plan's alone: not a bound on every plan
                missed.append(f"{what}: {figures} ({bounds}; our placement's bound {placed:.3f}x)")
    return missed, above, fallback


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="*", help="setup names (default: every optimus-* setup)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--frozen", action="store_true", help="only the rows with the vision encoder frozen")
    which.add_argument(
        "--trainable", action="store_true", help="only the rows with the vision encoder trained"
    )
    parser.add_argument("--readme", action="store_true", help="update its table (README.md or docs/)")
    parser.add_argument(
        "--no-run", action="store_true", help="print (and with --readme write) the saved table"
    )
    args = parser.parse_args(argv)
    unknown = [n for n in args.only or [] if n not in SETUP_NAMES]
    if unknown:
        parser.error(f"unknown setups {unknown}; choose from {', '.join(SETUP_NAMES)}")
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data["note"] = (
        "simulated by the vlmcompile cost model: predictions, not measurements (pass wall times are measured)"
    )
    data["machine"] = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    if not args.no_run:
        graphs: dict = {}
        kinds = [False] * (not args.frozen) + [True] * (not args.trainable)
        for name in args.only or SETUP_NAMES:
            for frozen in kinds:
                vision = "frozen" if frozen else "trained"
                print(
                    f"{name}: {SETUPS[name].model} on {SETUPS[name].cluster}, vision {vision}",
                    file=sys.stderr,
                    flush=True,
                )
                fresh = setup_row(name, graphs, frozen=frozen)
                # Written after every row: a long run that is stopped keeps what it finished.
                rows = [
                    r for r in data.get("rows", []) if (r["setup"], r.get("frozen", False)) != (name, frozen)
                ] + [fresh]
                rows.sort(key=lambda r: (r.get("frozen", False), SETUP_NAMES.index(r["setup"])))
                data["rows"] = rows
                RESULTS.parent.mkdir(parents=True, exist_ok=True)
                RESULTS.write_text(json.dumps(data, indent=1))
    rows = data.get("rows", [])
    table = markdown_table(rows)
    print(table)
    missed, above, fallback = missed_targets(rows)
    for line in above:
        print(f"goal above its bound: {line}", file=sys.stderr)
    for line in fallback:
        print(f"met by the baseline's own plan: {line}", file=sys.stderr)
    for line in missed:
        print(f"target missed: {line}", file=sys.stderr)
    if args.readme:
        write_readme_section("bubbles", table)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
