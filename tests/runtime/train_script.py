"""A training run in its own process, for tests that signal, pause or break it from outside:
``python -m tests.runtime.train_script --checkpoint-dir D --steps N [...]``. It trains the tiny
model over 2 local ranks (PP = 2) with the Python API, as a user's script would, and exits as the
CLI does (0; 128 + the signal after a stop request; 2 and one line for an error).

``--step-sleep S`` makes every step take S seconds more (its data arrives late; on one rank
only with ``--sleep-rank R``, so the other waits for it), so a test can land a signal or a pause
inside a step. ``--fault hang|stop --fault-rank R`` makes rank R hang (sleep) or
stop itself (SIGSTOP) when it starts a checkpoint save: faults of the run, injected into the
real save on one rank.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from tests.models import build
from tests.pipeline_helpers import even_plan
from vlmcompile import compile
from vlmcompile.ir.errors import VlmCompileError
from vlmcompile.models.synthetic_batches import SyntheticBatches
from vlmcompile.runtime.launch import Interrupted, LaunchError
from vlmcompile.runtime.train_loop import TrainConfig


class SlowData:
    """The tiny model's synthetic batches, each ``sleep_s`` late; with a fault, the first batch
    arms it on its rank."""

    def __init__(self, sleep_s: float, sleep_rank: int | None, fault: str | None, fault_rank: int):
        self.batches = SyntheticBatches("tiny", 4)
        self.sleep_s = sleep_s
        self.sleep_rank = sleep_rank
        self.fault = fault
        self.fault_rank = fault_rank

    def __call__(self, step: int):
        rank = int(os.environ.get("RANK", -1))
        if self.fault and rank == self.fault_rank:
            _arm(self.fault)
        if self.sleep_rank is None or rank == self.sleep_rank:
            time.sleep(self.sleep_s)
        return self.batches(step)


def _arm(fault: str) -> None:
    import torch.distributed.checkpoint as dcp

    if getattr(dcp.save, "armed", False):
        return
    real = dcp.save

    def faulty_save(*args, **kwargs):
        if fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(3600)
        return real(*args, **kwargs)

    faulty_save.armed = True
    dcp.save = faulty_save


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--every", type=int, default=0)
    parser.add_argument("--decay-steps", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument(
        "--sleep-rank", type=int, help="only this rank's data is late (default: every rank's)"
    )
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--fault", choices=["hang", "stop"])
    parser.add_argument("--fault-rank", type=int, default=1)
    args = parser.parse_args()
    model, batch = build("tiny", batch_size=4)
    pipe = compile(model, batch, log=None)
    plan = even_plan(pipe.layer_graph, global_batch=4, pp=2)
    config = TrainConfig(
        steps=args.steps,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.every,
        decay_steps=args.decay_steps,
        resume=args.resume,
        progress=False,
    )
    print("compiled", file=sys.stderr, flush=True)
    try:
        result = pipe.train(
            SlowData(args.step_sleep, args.sleep_rank, args.fault, args.fault_rank),
            config,
            plan=plan,
            timeout_s=args.timeout,
        )
    except Interrupted as err:
        print(f"interrupted by {err.signal_name}", file=sys.stderr)
        return 128 + int(getattr(signal, err.signal_name))
    except (VlmCompileError, LaunchError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result)
    return 128 + int(getattr(signal, result.stopped_by)) if result.stopped_by else 0


if __name__ == "__main__":
    sys.exit(main())
