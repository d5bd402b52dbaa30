"""What never losing a checkpoint costs, on 2 local CPU ranks: the demo VLM's plan at PP = 2
trained with a save after every step against the same run without saves (the difference is
one save: DCP's write, the checksums read back, the manifest and the renames, all flushed to
disk), and the check a resume makes (every file's size and CRC-32) against reading the whole
checkpoint back (``load_checkpoint``).

    python benchmarks/checkpoint_cost.py [--rounds 3] [--steps 4] [--global-batch 8]

Each round runs both trainings (the order alternating, so a shared machine's drift falls on
both alike), then times the check and the read; figures are medians over the rounds. Writes
``benchmarks/results/checkpoint_cost.json`` with this machine named.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from vlmcompile import compile, models
from vlmcompile.models.synthetic_batches import SyntheticBatches
from vlmcompile.runtime.checkpoint import load_checkpoint, problems
from vlmcompile.runtime.train_loop import TrainConfig

RESULTS = Path(__file__).parent / "results" / "checkpoint_cost.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()
    model = models.build("demo")
    pipe = compile(
        model, models.sample_batch("demo", batch_size=1), model_name="demo", cluster="cpu:2", log=None
    )
    plan = pipe.baseline("megatron", tp=1, pp=2, global_batch=args.global_batch).plan
    data = SyntheticBatches("demo", args.global_batch)
    plain_s, saving_s, check_s, read_s, sizes = [], [], [], [], []
    for r in range(args.rounds):
        scratch = Path(tempfile.mkdtemp(prefix="vlmcompile-ckpt-"))
        try:
            for saving in (False, True) if r % 2 == 0 else (True, False):
                config = TrainConfig(
                    steps=args.steps,
                    checkpoint_dir=str(scratch / "ckpt") if saving else None,
                    checkpoint_every=1 if saving else 0,
                    progress=False,
                )
                began = time.perf_counter()
                pipe.train(data, config, plan=plan, timeout_s=120)
                (saving_s if saving else plain_s).append(time.perf_counter() - began)
            last = scratch / "ckpt" / f"step_{args.steps:06d}"
            sizes.append(sum(f.stat().st_size for f in last.iterdir()))
            began = time.perf_counter()
            assert problems(last) == []
            check_s.append(time.perf_counter() - began)
            began = time.perf_counter()
            load_checkpoint(last)
            read_s.append(time.perf_counter() - began)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        print(
            f"round {r + 1}: {plain_s[-1]:.2f} s without saves, {saving_s[-1]:.2f} s with one a step",
            flush=True,
        )
    per_save = (statistics.median(saving_s) - statistics.median(plain_s)) / args.steps
    result = {
        "machine": f"{platform.machine()} CPU, 2 cores (this machine; shared and noisy)",
        "model": "demo",
        "plan": f"{plan.policy}: PP=2, {plan.num_microbatches} microbatches",
        "global_batch": args.global_batch,
        "steps": args.steps,
        "rounds": args.rounds,
        "checkpoint_mib": statistics.median(sizes) / 2**20,
        "median_run_s": {
            "without_saves": statistics.median(plain_s),
            "save_every_step": statistics.median(saving_s),
        },
        "save_s": per_save,
        "check_s": statistics.median(check_s),
        "read_whole_s": statistics.median(read_s),
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
