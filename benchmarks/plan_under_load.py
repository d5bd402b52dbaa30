"""Measured: does the plan ``compile(..., profile=True)`` chooses on local CPU ranks hold still
when the machine is busy? The same models compiled for ``cpu:2`` on this machine as it is, then
with ``--busy`` processes spinning beside it (the 1-minute load average raised to about 4 first),
then as it is again. Each run records the plan chosen, the runner-up, the profile's spread and
the "within the noise" decision, if any.

    python benchmarks/plan_under_load.py [--models tiny,demo] [--busy 4]

The verdict per model: the same plan at every load, or every run whose plan differs says its
choice is within the noise and names both plans. Writes ``benchmarks/results/plan_under_load.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "plan_under_load.json"


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _load() -> float:
    return os.getloadavg()[0]


def compiled(name: str) -> dict:
    """One compile of ``name`` for 2 local ranks, profiled here: what it chose and how sure."""
    import vlmcompile
    from vlmcompile import models
    from vlmcompile.ir.meta_keys import PROFILE_SPREAD_META

    model = models.build(name)
    batch = models.sample_batch(name, batch_size=8)
    began, start = _load(), time.perf_counter()
    pipe = vlmcompile.compile(model, batch, cluster="cpu:2", global_batch=8, profile=True, log=None)
    tie = [d.detail for d in pipe.plan.decisions if d.detail.startswith("within the noise")]
    return {
        "plan": str(pipe.plan.pipeline_parallel),
        "step_ms": 1e3 * pipe.planned.sim.step_time_s,
        "spread": pipe.layer_graph.meta.get(PROFILE_SPREAD_META),
        "within_noise": tie[0] if tie else None,
        "load": [began, _load()],
        "compile_s": time.perf_counter() - start,
    }


def busy_load(busy: int, target: float, wait_s: float = 150.0):
    """``busy`` spinning processes, started and left until the load average reaches ``target``
    (at most ``wait_s``); returns (stop event, processes)."""
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + wait_s
    while _load() < target and time.monotonic() < deadline:
        time.sleep(2)
    return stop, procs


def verdict(runs: list[dict]) -> str:
    plans = {r["plan"] for r in runs}
    if len(plans) == 1:
        return f"the same plan at every load: {plans.pop()}"
    unsure = [r for r in runs if r["within_noise"] is None]
    chosen = ", ".join(f"{r['plan']} at load {r['load'][0]:.1f}" for r in runs)
    if not unsure:
        return f"different plans ({chosen}), and every run said its choice was within the noise, naming both"
    return f"different plans ({chosen}); {len(unsure)} run(s) did not call the choice a tie: a report that misleads"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,demo")
    parser.add_argument("--busy", type=int, default=4, help="spinning processes for the loaded run")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    names = args.models.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for phase in ("as it is", f"{args.busy} busy processes", "as it is again"):
        stop, procs = busy_load(args.busy, 0.8 * args.busy) if "busy" in phase else (None, [])
        try:
            for name in names:
                run = compiled(name) | {"phase": phase}
                runs[name].append(run)
                print(
                    f"{name:5s} {phase:22s} load {run['load'][0]:.1f}->{run['load'][1]:.1f}: {run['plan']} "
                    f"{run['step_ms']:.2f} ms, profile spread {100 * (run['spread'] or 0):.0f} %"
                    + (f"; {run['within_noise']}" if run["within_noise"] else ""),
                    flush=True,
                )
        finally:
            if stop is not None:
                stop.set()
                for p in procs:
                    p.join()
    verdicts = {name: verdict(r) for name, r in runs.items()}
    for name, said in verdicts.items():
        print(f"{name}: {said}")
    RESULTS.write_text(
        json.dumps(
            {
                "command": "python benchmarks/plan_under_load.py " + " ".join(argv or []),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "runs": runs,
                "verdicts": verdicts,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
