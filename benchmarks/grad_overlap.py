"""Gradient reduction overlapped with the backwards, measured against the simulator: the demo VLM
at DP = 2 on 2 local CPU ranks (and PP = 2 x DP = 2 on 4 with ``--ranks 4``).

    python benchmarks/grad_overlap.py [--steps 8] [--global-batch 8] [--ranks 2]

The runtime starts each layer's gradient all-reduce as its last backward on the rank passes it
(:class:`vlmcompile.runtime.gradients.OverlappedReduction`); what the backwards did not hide is
the wait for those reductions after the rank's last action: the step's *exposed* reduction. The
simulator times the same rule (:mod:`vlmcompile.sim.dp`): its exposed reduction is a rank's last
reduction's end past its last action's. Figures are medians over the steps after the first, per rank; the
error is predicted over measured, less one.

Writes ``benchmarks/results/grad_overlap.json`` with this machine named.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from vlmcompile import compile, models
from vlmcompile.runtime.launch import launch
from vlmcompile.sim.simulator import simulate

RESULTS = Path(__file__).parent / "results" / "grad_overlap.json"


def _steps(runner, batch, steps: int) -> dict:
    """This rank's exposed reduction and step time per step."""
    import torch.distributed as dist

    exposed, step_s = [], []
    for _ in range(steps):
        dist.barrier()
        began = time.perf_counter()
        runner.step(batch)
        step_s.append(time.perf_counter() - began)
        exposed.append(runner.reduction.exposed_s)
    return {"exposed_s": exposed, "step_s": step_s, "buckets": len(runner.reduction.buckets)}


def _predicted_exposed(sim, pp_rank: int) -> float:
    """The simulator's reduction on a pipeline rank past its last action."""
    last = max(run.end_s for run in sim.runs if run.rank == pp_rank)
    reduced = [
        end for rank, kind, _, end in sim.dp_collectives if rank == pp_rank and kind == "reduce_scatter"
    ]
    return max(0.0, max(reduced, default=last) - last)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--ranks", type=int, choices=(2, 4), default=2)
    args = parser.parse_args(argv)
    from tests.pipeline_helpers import even_plan

    model = models.build("demo")
    batch = models.sample_batch("demo", batch_size=args.global_batch)
    pipe = compile(model, batch, f"cpu:{args.ranks}", profile=True, log=None)
    pp = args.ranks // 2
    plan = even_plan(pipe.layer_graph, pp=pp, dp=2, global_batch=args.global_batch)
    sim = simulate(plan, pipe.layer_graph, pipe.cluster)
    per_rank = launch(
        _steps, pipe.runner(plan, timeout_s=120), args.ranks, args=(batch, args.steps), timeout_s=120
    )
    rows = []
    for rank, r in enumerate(per_rank):
        predicted = _predicted_exposed(sim, plan.pipeline_parallel.coords(rank)[0])
        exposed = statistics.median(r["exposed_s"][1:])
        step = statistics.median(r["step_s"][1:])
        rows.append(
            {
                "rank": rank,
                "buckets": r["buckets"],
                "measured_exposed_s": exposed,
                "predicted_exposed_s": predicted,
                "error": predicted / exposed - 1 if exposed else None,
                "measured_step_s": step,
                "predicted_step_s": sim.step_time_s,
            }
        )
        print(
            f"rank {rank}: {r['buckets']} buckets; exposed reduction {1e3 * exposed:.2f} ms measured, "
            f"{1e3 * predicted:.2f} ms predicted ({100 * rows[-1]['error']:+.0f} %); step {1e3 * step:.1f} ms "
            f"measured, {1e3 * sim.step_time_s:.1f} ms predicted"
        )
    out = {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (this machine; shared and noisy)",
        "model": "demo",
        "plan": f"1F1B, PP={pp} x DP=2, {plan.num_microbatches} microbatches a replica",
        "global_batch": args.global_batch,
        "steps": args.steps,
        "ranks": rows,
    }
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
