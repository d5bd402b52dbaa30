"""Measured: how long ``launch()`` takes to run a function that does nothing on N local ranks, with
ranks forked from the rank server against ranks spawned (``VLMCOMPILE_RANK_START=spawn``), in
one process, interleaved launch by launch; each rank also times the same matmuls, so a forked
rank that computed slower would show.

    python benchmarks/launch_start.py [--repeats 7] [--nprocs 2]

The server's own start (its torch import, once per process and environment) is timed apart, as
the first forked launch. Prints medians and the ratio; writes ``benchmarks/results/launch_start.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from vlmcompile.runtime import rank_server
from vlmcompile.runtime.launch import launch

RESULTS = Path(__file__).resolve().parent / "results" / "launch_start.json"


def matmuls(_payload) -> float:
    """Seconds for 20 products of two 512 x 512 matrices on this rank's threads."""
    import torch

    a = torch.randn(512, 512)
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    return time.perf_counter() - start


def timed_launch(nprocs: int, spawn: bool) -> tuple[float, float]:
    """(the launch's wall seconds, the slowest rank's matmul seconds)."""
    if spawn:
        os.environ[rank_server.START_ENV] = "spawn"
    try:
        start = time.perf_counter()
        compute = launch(matmuls, None, nprocs, timeout_s=60)
        return time.perf_counter() - start, max(compute)
    finally:
        os.environ.pop(rank_server.START_ENV, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args()
    first, _ = timed_launch(args.nprocs, spawn=False)  # starts the server
    forked, spawned = [], []
    for i in range(args.repeats):
        print(f"repeat {i + 1}/{args.repeats}", flush=True)
        forked.append(timed_launch(args.nprocs, spawn=False))
        spawned.append(timed_launch(args.nprocs, spawn=True))
    result = {
        "nprocs": args.nprocs,
        "repeats": args.repeats,
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "first_forked_launch_s": first,
        "forked_launch_s": statistics.median(t for t, _ in forked),
        "spawned_launch_s": statistics.median(t for t, _ in spawned),
        "forked_matmuls_s": statistics.median(c for _, c in forked),
        "spawned_matmuls_s": statistics.median(c for _, c in spawned),
    }
    result["spawned_over_forked"] = result["spawned_launch_s"] / result["forked_launch_s"]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"launch of {args.nprocs} ranks, median of {args.repeats}: forked {result['forked_launch_s']:.3f} s, "
        f"spawned {result['spawned_launch_s']:.3f} s ({result['spawned_over_forked']:.1f}x); the server's "
        f"first launch {first:.2f} s; rank matmuls forked {result['forked_matmuls_s']:.3f} s, spawned "
        f"{result['spawned_matmuls_s']:.3f} s"
    )


if __name__ == "__main__":
    main()
