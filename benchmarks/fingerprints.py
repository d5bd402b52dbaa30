"""Fingerprints of what a change to the runtime or the simulator must leave alone: the simulated
Chrome trace of several plans, and one training step's loss and every gradient on 2 CPU ranks
(tagged and ordered transfers), each as a SHA-256 of its bytes.

    python benchmarks/fingerprints.py --out before.json     # at one commit
    python benchmarks/fingerprints.py --out after.json      # at another
    python benchmarks/fingerprints.py --compare before.json after.json

Equal fingerprints mean byte-identical traces, losses and gradients on this machine (floating
point can differ between machines: compare runs made on one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.readme_section import github_table  # noqa: E402

SIMULATED = {
    "1f1b": dict(pp=4),
    "interleaved": dict(pp=4, v=2),
    "v-shaped": dict(pp=4, v=2, placement="v"),
    "dp2": dict(pp=2, dp=2),
}
"""Hand-cut plans of the demo VLM on 16 H100s, global batch 16."""
RUN = {
    "1f1b": dict(pp=2, recompute=(2, 5)),
    "interleaved": dict(pp=2, v=2),
    "v-shaped": dict(pp=2, v=2, placement="v"),
    "dp2": dict(pp=1, dp=2),
}
"""Plans of the zoo's tiny VLM on 2 CPU ranks, global batch 4."""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _trace(plan, sim) -> str:
    from vlmcompile.sim.trace import chrome_trace

    return _digest(json.dumps(chrome_trace(plan, sim), sort_keys=True).encode())


def simulated() -> dict[str, str]:
    from tests.pipeline_helpers import even_plan
    from vlmcompile import compile, models
    from vlmcompile.compiler import zoo_layer_graph
    from vlmcompile.cost_models.cluster import Cluster
    from vlmcompile.sim.simulator import simulate

    graph, cluster = zoo_layer_graph("demo"), Cluster.preset("h100x16")
    out = {}
    for name, options in SIMULATED.items():
        plan = even_plan(graph, global_batch=16, **options)
        out[f"trace: {name}"] = _trace(plan, simulate(plan, graph, cluster))
    meta = compile(
        models.build("demo", device="meta"),
        models.sample_batch("demo", device="meta"),
        cluster="h100x16",
        log=None,
    )
    out["trace: ours (searched)"] = _trace(meta.plan, meta.planned.sim)
    run = meta.baseline("megatron", tp=1, pp=4, global_batch=16)
    out["trace: megatron pp=4"] = _trace(run.plan, run.sim)
    return out


def step(runner, batch):
    loss = runner.step(batch)
    grads = {n: p.grad.clone() for n, p in runner.named_parameters().items() if p.grad is not None}
    return {"loss": loss, "grads": grads}


def measured() -> dict[str, str]:
    from tests.models import build
    from tests.pipeline_helpers import even_plan
    from vlmcompile import compile
    from vlmcompile.runtime.launch import launch

    model, batch = build("tiny", batch_size=4)
    pipe = compile(model, batch, log=None)
    out = {}
    for name, options in RUN.items():
        plan = even_plan(pipe.layer_graph, global_batch=4, **options)
        for transfers in ("tagged", "ordered"):
            runner = pipe.runner(plan, timeout_s=60)
            runner.transfers = transfers
            h = hashlib.sha256()
            for rank in launch(step, runner, runner.parallel.world_size, args=(batch,), timeout_s=60):
                h.update(rank["loss"].numpy().tobytes())
                for key in sorted(rank["grads"]):
                    h.update(key.encode())
                    h.update(rank["grads"][key].numpy().tobytes())
            out[f"step: {name}, {transfers}"] = h.hexdigest()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="write the fingerprints here (JSON)")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"), help="compare two runs' files")
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        rows = [(key, "same" if a.get(key) == b.get(key) else "DIFFERENT") for key in sorted(set(a) | set(b))]
        print(github_table(["fingerprint", f"{args.compare[0].name} vs {args.compare[1].name}"], rows))
        sys.exit(0 if all(r[1] == "same" for r in rows) else 1)
    found = {**simulated(), **measured()}
    print(github_table(["fingerprint", "sha256 (first 16)"], [(k, v[:16]) for k, v in found.items()]))
    if args.out:
        args.out.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
