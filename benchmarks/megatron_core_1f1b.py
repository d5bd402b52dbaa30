"""Megatron-core's own 1F1B schedule driving our captured stages, against our runtime on the same
plan: 2 local CPU ranks over gloo, the ``demo`` VLM, Megatron's plan (PP = 2, 1F1B).

On every rank, both run the same stage modules (codegen's, each on its own copy of the weights)
on the same microbatches: ours with :class:`~vlmcompile.runtime.executor.PipelineRunner`,
Megatron's with ``megatron.core.pipeline_parallel.schedules.
forward_backward_pipelining_without_interleaving`` (megatron-core 0.16). Steps alternate
between the two (A B, B A, ...) so that a shared machine's drift falls on both; each takes SGD
steps with the same learning rate, and their losses and final weights must agree.

What it takes to run megatron-core 0.16's schedule on CPU ranks (each is a CUDA assumption in
its code, not in the schedule itself):

* ``schedules.py`` makes its token counter with ``torch.zeros(..., device="cuda")``: the
  schedule module's ``torch`` is given a ``zeros`` that puts it on the CPU;
* ``p2p_communication.py`` allocates receive buffers on ``torch.cuda.current_device()``: that
  returns "cpu" in these processes;
* ``batch_p2p_sync=False`` (it calls ``torch.cuda.synchronize()`` otherwise);
* the config needs ``hidden_size`` and ``fine_grained_activation_offloading``, which
  TransformerConfig has and ModelParallelConfig does not;
* Megatron sends one tensor of ``[seq_length, micro_batch_size, hidden_size]`` between stages:
  our stage boundary (several tensors of several dtypes) travels packed into one float32 vector
  of N elements (``seq_length = N``, the other two 1) and is unpacked on the next rank, the
  integer parts exactly (they are small).

    python benchmarks/megatron_core_1f1b.py [--global-batch 16] [--steps 6] [--repeats 3]

writes ``benchmarks/results/megatron_core_1f1b.json``; exits 1 if the losses or weights differ.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from vlmcompile import models
from vlmcompile.compiler import compile
from vlmcompile.ir.microbatch import label_weights, take
from vlmcompile.runtime.launch import launch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "megatron_core_1f1b.json"
NUM_RANKS = 2


def _cpu_megatron():
    """megatron-core 0.16's schedule and p2p modules, their CUDA assumptions pointed at the CPU."""
    with warnings.catch_warnings():  # no Transformer Engine / Apex: it says so and falls back
        warnings.simplefilter("ignore")
        import megatron.core.pipeline_parallel.schedules as schedules

    class _TorchOnCpu:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*args, device=None, **kwargs):
            return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    schedules.torch = _TorchOnCpu()
    torch.cuda.current_device = lambda: "cpu"
    return schedules


def _pack(values) -> torch.Tensor:
    parts = [torch.as_tensor(x).reshape(-1).to(torch.float32) for x in values]
    flat = torch.cat(parts)
    return flat.view(flat.numel(), 1, 1)


def _layout(values) -> list[tuple[tuple[int, ...], torch.dtype, bool]]:
    return [
        (tuple(torch.as_tensor(x).shape), torch.as_tensor(x).dtype, not isinstance(x, torch.Tensor))
        for x in values
    ]


def _unpack(packed: torch.Tensor, layout) -> tuple:
    flat, out, at = packed.reshape(-1), [], 0
    for shape, dtype, scalar in layout:
        n = 1
        for d in shape:
            n *= d
        piece = flat[at : at + n].view(shape)
        at += n
        if scalar:
            out.append(piece.item() if dtype.is_floating_point else int(piece.item()))
        elif dtype.is_floating_point:
            out.append(piece.to(dtype))
        else:
            out.append(piece.detach().round().to(dtype))
    return tuple(out)


class _MegatronStage(torch.nn.Module):
    """One of our stage modules as Megatron's schedule wants a model chunk: ``config``,
    ``model_type``, ``set_input_tensor``, and one packed tensor out (or the loss)."""

    def __init__(self, stage, config, model_type, layout, first: bool, last: bool):
        super().__init__()
        self.stage, self.config, self.model_type = stage, config, model_type
        self.layout, self.first, self.last = layout, first, last
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, microbatch):
        received = () if self.first else _unpack(self.input_tensor, self.layout)
        out = self.stage(received, microbatch)
        return out if self.last else _pack(out)


def _megatron_setup(runner, microbatch0):
    """Megatron's parallel state, config and model chunk for this rank; the boundary's layout
    comes from the first stage's rank (a forward of microbatch 0 without gradients)."""
    schedules = _cpu_megatron()
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.enums import ModelType

    runner.setup()
    plan = runner.plan
    pp = plan.pipeline_parallel.pp
    if plan.pipeline_parallel.v != 1 or plan.num_stages != pp:
        raise ValueError("this benchmark drives Megatron's 1F1B without interleaving: give a v = 1 plan")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=pp, distributed_timeout_minutes=2
    )
    (index,) = runner.stages
    stage = runner.stages[index]
    box = [None]
    if index == 0:
        with torch.no_grad():
            box[0] = _layout(stage((), microbatch0))
    dist.broadcast_object_list(box, src=plan.pipeline_parallel.global_rank(0, runner.dp_rank))
    layout = box[0]
    elements = sum(int(torch.tensor(shape).prod()) for shape, _, _ in layout)
    config = ModelParallelConfig(
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, batch_p2p_sync=False
    )
    config.hidden_size = 1
    config.fine_grained_activation_offloading = False
    chunk = _MegatronStage(stage, config, ModelType.encoder_or_decoder, layout, index == 0, index == pp - 1)
    return schedules, chunk, elements


def _megatron_step(schedules, chunk, elements, microbatches, weights) -> float:
    m = len(microbatches)
    total = [0.0]

    def forward_step(data, model):
        microbatch, weight = next(data)

        def loss_func(out):
            # Megatron divides each microbatch's loss by m; our runtime weights it by its label tokens.
            total[0] += float(out.detach()) * weight
            scaled = out * (weight * m)
            return scaled, {"loss": scaled.detach()}

        return model(microbatch), loss_func

    schedules.forward_backward_pipelining_without_interleaving(
        forward_step_func=forward_step,
        data_iterator=iter(zip(microbatches, weights)),
        model=[chunk],
        num_microbatches=m,
        seq_length=elements,
        micro_batch_size=1,
        forward_only=False,
    )
    return total[0]  # 0 on the ranks without the last stage


def both_on_this_rank(runners, batch, num_steps: int, lr: float) -> dict:
    """Our runner and Megatron's schedule on the same stage (their own weights), step by step."""
    ours, theirs = runners
    plan = theirs.plan
    m, mbs = plan.num_microbatches, plan.microbatch_size
    microbatches = [take(batch, i * mbs, mbs, theirs.sample_rows) for i in range(m)]
    weights = label_weights(batch, m)
    schedules, chunk, elements = _megatron_setup(theirs, microbatches[0])
    optimizers = [torch.optim.SGD(r.parameters(), lr=lr) for r in runners]
    out = {"ours": {"losses": [], "step_s": []}, "megatron": {"losses": [], "step_s": []}}
    for k in range(num_steps):
        for name in ("ours", "megatron") if k % 2 == 0 else ("megatron", "ours"):
            j = 0 if name == "ours" else 1
            optimizers[j].zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            if name == "ours":
                loss = float(ours.step(batch))
            else:
                local = torch.tensor([_megatron_step(schedules, chunk, elements, microbatches, weights)])
                # Only the last stage has the loss: share it.
                dist.all_reduce(local)
                loss = float(local)
            out[name]["step_s"].append(time.perf_counter() - start)
            optimizers[j].step()
            out[name]["losses"].append(loss)
    weights_ours = ours.named_parameters()
    weights_theirs = theirs.named_parameters()
    out["max_weight_difference"] = max(
        float((weights_ours[n] - weights_theirs[n]).detach().abs().max()) for n in weights_ours
    )
    return out


def run_once(global_batch: int, num_steps: int, lr: float) -> dict:
    model = models.build("demo")
    batch = models.sample_batch("demo", batch_size=global_batch)
    pipe = compile(
        model, batch, cluster=f"cpu:{NUM_RANKS}", model_name="demo", global_batch=global_batch, log=None
    )
    plan = pipe.baseline("megatron", tp=1, pp=NUM_RANKS, global_batch=global_batch, microbatch_size=1).plan
    runners = tuple(copy.deepcopy(pipe.runner(plan, timeout_s=120)) for _ in range(2))
    results = launch(both_on_this_rank, runners, NUM_RANKS, args=(batch, num_steps, lr), timeout_s=120)
    row = {"plan": " | ".join(str(len(s.layers)) for s in plan.stages)}
    for name in ("ours", "megatron"):
        steps = [max(r[name]["step_s"][k] for r in results) for k in range(num_steps)]
        row[name] = {
            "step_s": steps,
            "median_step_s": statistics.median(steps[1:]),
            "losses": results[0][name]["losses"],
        }
    row["loss_difference"] = max(abs(a - b) for a, b in zip(row["ours"]["losses"], row["megatron"]["losses"]))
    row["max_weight_difference"] = max(r["max_weight_difference"] for r in results)
    row["megatron_over_ours"] = row["megatron"]["median_step_s"] / row["ours"]["median_step_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6, help="steps per schedule, the first a warm-up")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    runs = []
    for k in range(args.repeats):
        start = time.perf_counter()
        runs.append(run_once(args.global_batch, args.steps, args.lr))
        r = runs[-1]
        print(
            f"run {k + 1}: ours {r['ours']['median_step_s']:.3f} s, megatron-core {r['megatron']['median_step_s']:.3f} s "
            f"({r['megatron_over_ours']:.3f}x), loss difference {r['loss_difference']:.2e}, weight difference "
            f"{r['max_weight_difference']:.2e} ({time.perf_counter() - start:.0f} s)",
            file=sys.stderr,
        )
    ratio = statistics.median(r["megatron_over_ours"] for r in runs)
    same = all(r["loss_difference"] <= 1e-5 and r["max_weight_difference"] <= 1e-5 for r in runs)
    RESULTS.write_text(
        json.dumps(
            {
                "note": "measured: megatron-core 0.16's 1F1B schedule and our runtime on the same plan and stages",
                "command": f"python benchmarks/megatron_core_1f1b.py --global-batch {args.global_batch} "
                f"--steps {args.steps} --repeats {args.repeats}",
                "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
                "median_megatron_over_ours": ratio,
                "losses_and_weights_agree": same,
                "runs": runs,
            },
            indent=1,
        )
    )
    print(
        f"megatron-core step / ours, median over {len(runs)} runs: {ratio:.3f}; losses and weights agree: {same}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
