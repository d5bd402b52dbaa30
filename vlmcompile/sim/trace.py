"""Timelines of a simulated step: Chrome-trace JSON (opens in Perfetto / chrome://tracing)
and a PNG.

The trace has one process per pipeline rank with three threads: compute (one slice per
action, its TP collectives as a nested slice at the end), the DP stream (per-layer all-gathers
and reduce-scatters) and the bubbles (idle intervals, named by cause). Times are microseconds,
as the Trace Event Format requires.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmcompile.ir.actions import ActionKind
from vlmcompile.ir.plan import Plan
from vlmcompile.sim.simulator import SimResult

_COMPUTE, _DP, _BUBBLE, _KERNELS = 0, 1, 2, 3
_COLOURS = {  # one colour per action kind, darker for later virtual stages
    ActionKind.F: "#4C72B0",
    ActionKind.B: "#55A868",
    ActionKind.I: "#55A868",
    ActionKind.W: "#8172B2",
}
_ENCODER_COLOURS = {  # encoder work of a plan whose encoders have their own group
    ActionKind.F: "#DD8452",
    ActionKind.B: "#C44E52",
    ActionKind.I: "#C44E52",
    ActionKind.W: "#937860",
}
_KERNEL_LEVEL = "#E6B800"
"""Encoder kernels run inside an LLM action's communication gaps."""


def _colour(plan: Plan, stage: int, kind: ActionKind) -> str:
    encoder = plan.stages[stage].group != plan.stages[-1].group
    return (_ENCODER_COLOURS if encoder else _COLOURS)[kind]


def chrome_trace(plan: Plan, result: SimResult) -> dict[str, Any]:
    """The trace of ``result``, the simulated step of ``plan``."""
    events = [
        *_names(len(result.ranks)),
        *(e for run in result.runs for e in _action_events(run)),
        *(
            _slice(kind, "dp", rank, _DP, start, end)
            for rank, kind, start, end in result.dp_collectives
            if end > start
        ),
        *(_slice(b.cause, "bubble", b.rank, _BUBBLE, b.start_s, b.end_s) for b in result.bubbles),
    ]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "plan": plan.policy,
            "model": plan.model,
            "cluster": result.cluster.name,
            "step_time_ms": result.step_time_s * 1e3,
            "note": "simulated by the vlmcompile cost model (a prediction, not a measurement)",
        },
    }


def _names(num_ranks: int) -> list[dict[str, Any]]:
    """One process per rank, its threads named."""
    events: list[dict[str, Any]] = []
    for rank in range(num_ranks):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
        )
        for tid, name in (
            (_COMPUTE, "compute"),
            (_DP, "DP collectives"),
            (_BUBBLE, "bubbles"),
            (_KERNELS, "encoder kernels in LLM gaps"),
        ):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
    return events


def _slice(name: str, category: str, rank: int, thread: int, start_s: float, end_s: float) -> dict[str, Any]:
    """A complete event ("X"), in microseconds."""
    return {
        "name": name,
        "cat": category,
        "ph": "X",
        "pid": rank,
        "tid": thread,
        "ts": start_s * 1e6,
        "dur": (end_s - start_s) * 1e6,
    }


def _action_events(run) -> list[dict[str, Any]]:
    """An action's slice, and its TP collectives as a slice nested at its end."""
    a = run.action
    at_kernel_level = run.inside is not None
    action = _slice(
        str(a),
        "kernel-level encoder" if at_kernel_level else a.kind.value,
        run.rank,
        _KERNELS if at_kernel_level else _COMPUTE,
        run.start_s,
        run.end_s,
    )
    action["args"] = {
        "stage": a.stage,
        "microbatch": a.microbatch,
        "step": run.step,
        "compute_ms": run.compute_s * 1e3,
        "tp_comm_ms": run.tp_comm_s * 1e3,
        "dp_wait_ms": run.dp_wait_s * 1e3,
    }
    if run.tp_comm_s <= 0:
        return [action]
    tp = _slice("TP collectives", "tp_comm", run.rank, _COMPUTE, run.end_s - run.tp_comm_s, run.end_s)
    tp["dur"] = run.tp_comm_s * 1e6  # as the simulator has it (not end minus start)
    return [action, tp]


def write_chrome_trace(plan: Plan, result: SimResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(plan, result)))


def write_png(plan: Plan, result: SimResult, path: str | Path, *, max_ranks: int = 16) -> None:
    """One row per rank: actions coloured by kind and labelled with their microbatch where
    they are wide enough, TP collectives hatched, bubbles grey; times in milliseconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_ranks = min(len(result.ranks), max_ranks)
    step_ms = result.step_time_s * 1e3
    fig, ax = plt.subplots(figsize=(14, 1.6 + 0.55 * num_ranks), dpi=110)
    for rank, start, end in ((b.rank, b.start_s, b.end_s) for b in result.bubbles):
        if rank < num_ranks:
            ax.barh(
                rank, (end - start) * 1e3, left=start * 1e3, height=0.8, color="#DDDDDD", edgecolor="none"
            )
    for run in result.runs:
        # A kernel-level rider is drawn as a strip inside its hosts' bars.
        if run.rank < num_ranks and run.inside is None:
            _draw_action(ax, plan, run, step_ms)
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, step_ms)
    ax.set_xlabel("time (ms)")
    ax.set_title(_png_title(plan, result), fontsize=9)
    legend = _legend(plan)
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    if len(result.ranks) > num_ranks:
        ax.text(
            1.0,
            -0.02,
            f"first {num_ranks} of {len(result.ranks)} ranks",
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=7,
        )
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))
    fig.savefig(path)
    plt.close(fig)


def _draw_action(ax, plan: Plan, run, step_ms: float) -> None:
    """An action's bar (lighter for later virtual stages), its hosted encoder kernels as a strip,
    its TP collectives hatched, and its label where it fits."""
    a = run.action
    start, width = run.start_s * 1e3, (run.end_s - run.start_s) * 1e3
    if run.rider_compute_s > 0:
        # The encoder kernels this LLM action hosts: a thin strip inside its bar, as long as their compute.
        strip = min(run.rider_compute_s * 1e3, width)
        ax.barh(
            run.rank + 0.28,
            strip,
            left=start + width - strip,
            height=0.22,
            color=_KERNEL_LEVEL,
            edgecolor="none",
            zorder=3,
        )
    chunks = plan.num_stages // plan.num_ranks
    alpha = 1.0 - 0.45 * (a.stage // plan.num_ranks) / max(1, chunks - 1)
    color = _colour(plan, a.stage, a.kind)
    ax.barh(
        run.rank, width, left=start, height=0.8, color=color, alpha=alpha, edgecolor="white", linewidth=0.3
    )
    if run.tp_comm_s > 0:
        tp = run.tp_comm_s * 1e3
        ax.barh(
            run.rank,
            tp,
            left=start + width - tp,
            height=0.8,
            color="none",
            hatch="///",
            edgecolor="#333333",
            linewidth=0,
        )
    # With several stages per rank the stage number matters: 2F0, not F0.
    label = str(a) if plan.num_stages > plan.num_ranks else f"{a.kind.value}{a.microbatch}"
    if width > step_ms / 70 * len(label) / 2:
        ax.text(start + width / 2, run.rank, label, ha="center", va="center", fontsize=7, color="white")


def _png_title(plan: Plan, result: SimResult) -> str:
    share = result.idle_share()
    pp = share["pp_warmup"] + share["pp_other"] + share["pp_cooldown"]
    dp = share["dp_all_gather"] + share["dp_reduce_scatter"]
    return (
        f"{plan.model}: {plan.policy} on {result.cluster.name}, {plan.schedule}, "
        f"{plan.num_microbatches} microbatches - simulated step {result.step_time_s * 1e3:.1f} ms, "
        f"bubbles {100 * result.bubble_share:.0f} % (PP {100 * pp:.0f} %, TP {100 * share['tp_comm']:.0f} %, "
        f"DP {100 * dp:.0f} %)"
    )


def _legend(plan: Plan) -> list:
    from matplotlib.patches import Patch

    legend = [
        Patch(color=_COLOURS[ActionKind.F], label="forward"),
        Patch(color=_COLOURS[ActionKind.B], label="backward (B / I)"),
        Patch(color=_COLOURS[ActionKind.W], label="weight grad (W)"),
        Patch(facecolor="white", hatch="///", edgecolor="#333333", label="TP collectives"),
        Patch(color="#DDDDDD", label="bubble"),
    ]
    if len(plan.parallel) > 1:
        legend[2:2] = [
            Patch(color=_ENCODER_COLOURS[ActionKind.F], label="encoder forward"),
            Patch(color=_ENCODER_COLOURS[ActionKind.B], label="encoder backward"),
        ]
    if plan.kernel_level:
        legend.append(Patch(color=_KERNEL_LEVEL, label="encoder kernels in LLM gaps"))
    return legend
