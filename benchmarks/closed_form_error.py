"""How far the closed-form step time of the stage-cut model is from the simulated step.

The CP-SAT partition solves a closed form first, then the schedule's timeline
(``vlmcompile/planning/stage_cuts.py``). This measures why the second is there: on random
stage times (forward 0.5-2, backward 0.5-4, no communication) of 1F1B and interleaved 1F1B
schedules, the relative error of the closed form against the simulator, which times the same
action lists action by action.

    python benchmarks/closed_form_error.py [--plans 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.sim_helpers import make_plan, synthetic_costs  # noqa: E402
from vlmcompile.cost_models.cluster import Cluster  # noqa: E402
from vlmcompile.ir.placement import Placement  # noqa: E402
from vlmcompile.planning.schedules import make_schedule  # noqa: E402
from vlmcompile.sim.simulator import simulate  # noqa: E402


def closed_form_errors(num_plans: int, seed: int) -> list[tuple[int, int, int, float]]:
    """(p, v, m, (closed form - simulated) / simulated) per random plan."""
    cluster = Cluster.preset("h100x8")
    rng = random.Random(seed)
    out = []
    while len(out) < num_plans:
        p = rng.choice([1, 2, 3, 4])
        v = rng.choice([1, 2]) if p > 1 else 1
        m = p * rng.randint(1, 2) if v > 1 else rng.randint(1, 8)
        stages = p * v
        plan = make_plan(
            make_schedule("interleaved_1f1b" if v > 1 else "1f1b", Placement(p, v), m), stages, v=v
        )
        fwd = [rng.uniform(0.5, 2) for _ in range(stages)]
        bwd = [rng.uniform(0.5, 4) for _ in range(stages)]
        simulated = simulate(plan, None, cluster, costs=synthetic_costs(plan, fwd, bwd)).step_time_s
        placement = Placement(p, v)
        work = [sum(fwd[k] + bwd[k] for k in placement.stages_on(r)) for r in range(p)]
        closed = ((v * m - 1) * max(work) + sum(fwd) + sum(bwd)) / v
        out.append((p, v, m, (closed - simulated) / simulated))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--plans", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    errors = closed_form_errors(args.plans, args.seed)
    for label, rows in (
        ("1F1B (v = 1)", [e for p, v, _, e in errors if v == 1 and p > 1]),
        ("interleaved (v = 2)", [e for _, v, _, e in errors if v == 2]),
        ("one rank", [e for p, _, _, e in errors if p == 1]),
    ):
        if rows:
            size = [abs(e) for e in rows]
            print(
                f"{label:20s} {len(rows):4d} plans: |error| median {100 * statistics.median(size):.1f} %, "
                f"max {100 * max(size):.1f} %, over {100 * max(rows):+.1f} % / under {100 * min(rows):+.1f} %"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
