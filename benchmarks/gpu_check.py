"""GPU check: the demo model's plans trained on CUDA with NCCL against eager training, and the
GPU cost model calibrated to measured layer times.

    python benchmarks/gpu_check.py [--steps 5] [--device cuda|cpu]

On a machine with CUDA it

1. plans the demo VLM for 1 GPU (PP 1) and, with N >= 2 GPUs, for N (PP N), writes the plans as
   JSON and trains each with ``torchrun --nproc-per-node N -m vlmcompile train`` (NCCL, ordered
   transfers, fp32 so the comparison is exact up to kernel order), then trains the same model on
   the same batches eagerly on one GPU with the same AdamW, schedule and clip, and compares the
   losses (``torch.testing.assert_close``);
2. trains the 1-GPU plan once more in bf16 autocast (the plan's precision) and reports the loss
   gap to fp32 and the peak memory;
3. times every layer of the demo in bf16 on the GPU (the profile pass) and fits the device's
   efficiencies (``cost_models/calibrate.py``), printing the fit and its error;
4. does the same for each ``--calibrate-at`` model cut to two layers a tower (paper widths: the
   demo's layers are too narrow to keep a GPU busy, so its fit measures launch overhead);
5. trains a transformers LLaVA (export capture) in bf16 on one GPU, and with N >= 2 GPUs the
   demo's ZeRO-1 plan at DP = N against eager; every run records its step and each rank's peak
   tensor memory against the plan's predictions.

The figures go to ``benchmarks/results/gpu_check_<device>.json`` with the device named.
``--device cpu`` runs the same steps on CPU ranks over gloo: a dry run of this script on a
machine without a GPU (what the test suite and CI can do), not a GPU measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from vlmcompile import compile, models
from vlmcompile.cost_models.calibrate import LayerMeasurement, calibrate
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.models.synthetic_batches import SyntheticBatches
from vlmcompile.passes.graph.profile import profile
from vlmcompile.runtime.train_loop import TrainConfig, eager_training

LLAVA = "hf-llava"
"""The transformers model trained in bf16 (captured by torch.export, as every transformers family)."""
MODEL = "demo"
"""The model checked (``--model`` takes another zoo model: the test suite's dry run uses ``tiny``)."""
GLOBAL_BATCH = 8
PAPER_WIDTHS = ("InternVL-Chat-1.5", "Optimus-Model-A")
"""Paper models whose widths the GPU fit is made at (InternViT-6B + InternLM2-20B, ViT-11B + LLAMA-70B)."""
SHALLOW_DEPTH = 2
RESULTS = Path(__file__).parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5, help="training steps per check (default 5)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", help="result JSON (default benchmarks/results/gpu_check_<device>.json)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per layer in the calibration")
    parser.add_argument("--model", default=MODEL, help=f"zoo model to check (default {MODEL})")
    parser.add_argument(
        "--calibrate-at",
        nargs="*",
        default=list(PAPER_WIDTHS),
        help="zoo models whose layers, two a tower, are timed and fitted too (default: "
        + ", ".join(PAPER_WIDTHS)
        + "; none on --device cpu)",
    )
    parser.add_argument(
        "--refit",
        metavar="RESULT_JSON",
        help="fit the layer times a result file recorded again (this version's calibration), in place",
    )
    args = parser.parse_args(argv)
    if args.refit:
        return refit(Path(args.refit))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: this machine has no CUDA device; nothing measured (--device cpu for a dry run)")
        return 2
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    name = (
        torch.cuda.get_device_name(0)
        if args.device == "cuda"
        else f"CPU ({platform.processor() or 'unknown'})"
    )
    cluster_of = _cluster_family(name) if args.device == "cuda" else "cpu:"
    print(f"gpu_check on {name} ({gpus} {'GPUs' if args.device == 'cuda' else 'CPU ranks'})", flush=True)
    config = TrainConfig(steps=args.steps, lr=1e-4, warmup_steps=1, max_grad_norm=1.0)
    # The demo as the train command's ranks build it (seed 0), trained eagerly on one device.
    eager = eager_training(
        models.build(args.model, seed=0).to(args.device),
        SyntheticBatches(args.model, GLOBAL_BATCH),
        config,
        args.device,
    )
    result: dict = {
        "device": name,
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "torch": torch.__version__,
        "model": args.model,
        "global_batch": GLOBAL_BATCH,
        "eager_losses_fp32": eager,
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        result["runs"] += _plan_checks(Path(tmp), args, cluster_of, gpus, eager)
        for n in sorted({1, gpus} if gpus >= 2 else {1}):
            cluster = f"{cluster_of}{n}" if args.device == "cpu" else f"{cluster_of}x{n}"
            plan = _plan_file(Path(tmp), cluster, pp=n, model=args.model)
            for precision in ("fp32", "bf16") if n == 1 else ("fp32",):
                run = _torchrun(n, plan, args, precision, Path(tmp))
                run["cluster"], run["precision"] = cluster, precision
                if precision == "fp32":  # recorded, not raised: a mismatch loses no figure
                    try:
                        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(eager))
                        run["equals_eager"] = True
                    except AssertionError as err:
                        run["equals_eager"], run["mismatch"] = False, str(err)
                run["max_abs_loss_diff_to_eager_fp32"] = max(abs(a - b) for a, b in zip(run["losses"], eager))
                run.update(_prediction_error(plan, run))
                print(f"  {cluster} {precision}: {run['summary']}", flush=True)
                result["runs"].append(run)
    result["calibration"] = calibrate_layers(args.device, cluster_of, args.repeats, args.model)
    print(f"  {args.model}: {result['calibration']['summary']}", flush=True)
    result["calibration_at_paper_widths"] = {}
    for name in args.calibrate_at if args.device == "cuda" else ():
        fit = calibrate_layers(args.device, cluster_of, args.repeats, shallow(name))
        result["calibration_at_paper_widths"][name] = fit
        print(f"  {name} ({SHALLOW_DEPTH} layers a tower): {fit['summary']}", flush=True)
    out = Path(args.out) if args.out else RESULTS / f"gpu_check_{_slug(name)}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {out}")
    failed = [r["cluster"] for r in result["runs"] if r.get("equals_eager") is False]
    if failed:
        print(f"gpu_check: the losses on {', '.join(failed)} differ from eager training (see {out})")
        return 1
    return 0


def shallow(
    name: str, depth: int = SHALLOW_DEPTH, images: int = 1
) -> models.VLMConfig | models.ContrastiveConfig:
    """A zoo VLM or contrastive pair at its own widths and sequence length with ``depth`` layers
    a tower and ``images`` images a sample: what fits one GPU and still times the paper's kernels."""
    cfg = models.config(name)
    if isinstance(cfg, models.ContrastiveConfig):  # DistMM's pairs: both towers cut
        return dataclasses.replace(
            cfg,
            name=f"{name}-{depth}-layers",
            vision=dataclasses.replace(cfg.vision, depth=min(depth, cfg.vision.depth)),
            text=dataclasses.replace(cfg.text, depth=min(depth, cfg.text.depth)),
        )
    if not isinstance(cfg, models.VLMConfig):
        raise SystemExit(
            f"gpu_check: --calibrate-at takes VLMs and contrastive pairs; {name!r} is a {type(cfg).__name__}"
        )
    encoders = tuple(dataclasses.replace(e, depth=min(depth, e.depth)) for e in cfg.encoders)
    return dataclasses.replace(
        cfg,
        name=f"{name}-{depth}-layers",
        encoders=encoders,
        llm=dataclasses.replace(cfg.llm, depth=min(depth, cfg.llm.depth)),
        images_per_sample=min(images, cfg.images_per_sample),
    )


def calibrate_layers(
    device: str, cluster_of: str, repeats: int, model: str | models.VLMConfig = MODEL
) -> dict:
    """Time a model's layers in bf16 on ``device`` and fit the device's efficiencies."""
    dtype = torch.bfloat16
    model_name = model if isinstance(model, str) else model.name
    # Captured on meta and given random values on the device: building paper-width layers on the
    # host takes longer than timing them, and a layer's time does not depend on its values.
    pipe = _captured_on_meta(model)
    pipe.gm.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for tensor in [*pipe.gm.parameters(), *pipe.gm.buffers()]:
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.02, generator=generator)
            else:
                tensor.zero_()
    batch = models.sample_batch(model, batch_size=1, dtype=dtype)
    microbatch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    spec = Cluster.preset(f"{cluster_of}1" if cluster_of == "cpu:" else f"{cluster_of}x1").device
    measured = profile(pipe.gm, pipe.layer_graph, microbatch, device_name=spec.name, repeats=repeats)
    report = calibrate(spec, measured.report.measurements, host_overhead=True)
    e = report.device.efficiency
    return {
        "model": model_name,
        "device_spec": spec.name,
        "layers": len(measured.report.measurements),
        "fitted_efficiency": {"matmul": e.matmul, "attention": e.attention, "memory": e.memory},
        "prior_efficiency": {
            "matmul": report.prior.matmul,
            "attention": report.prior.attention,
            "memory": report.prior.memory,
        },
        "median_abs_error_after_fit": report.median_abs_error,
        "host_overhead_s_per_layer": report.overhead_s,
        "layer_times_s": [
            {"layer": m.layer.name, "fwd_s": m.fwd_s, "bwd_s": m.bwd_s} for m in measured.report.measurements
        ],
        "summary": str(report),
    }


def _captured_on_meta(model: str | models.VLMConfig):
    """A zoo model compiled (captured, annotated) on meta tensors in bf16, as the fit times it."""
    meta = models.sample_batch(model, batch_size=1, dtype=torch.bfloat16, device="meta")
    name = model if isinstance(model, str) else model.name
    return compile(models.build(model, dtype=torch.bfloat16, device="meta"), meta, model_name=name, log=None)


def refit(path: Path) -> int:
    """The calibrations of a recorded result fitted again from its layer times (no GPU needed:
    the layers are rebuilt on meta), each stored beside the one it replays as ``refit``."""
    result = json.loads(path.read_text())
    fits = [(result["model"], result["calibration"])]
    fits += [(shallow(name), c) for name, c in result.get("calibration_at_paper_widths", {}).items()]
    for model, recorded in fits:
        name = model if isinstance(model, str) else model.name
        layers = {layer.name: layer for layer in _captured_on_meta(model).layer_graph.layers}
        measured = [
            LayerMeasurement(layers[t["layer"]], t["fwd_s"], t["bwd_s"]) for t in recorded["layer_times_s"]
        ]
        spec = Cluster.preset(f"{_cluster_family(result['device'])}x1").device
        report = calibrate(spec, measured, host_overhead=True)
        e = report.device.efficiency
        recorded["refit"] = {
            "fitted_efficiency": {"matmul": e.matmul, "attention": e.attention, "memory": e.memory},
            "host_overhead_s_per_layer": report.overhead_s,
            "median_abs_error_after_fit": report.median_abs_error,
            "summary": str(report),
        }
        print(f"  {name}: {report}")
    path.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _plan_checks(tmp: Path, args, cluster_of: str, gpus: int, eager: list[float]) -> list[dict]:
    """What the plan promises beyond the demo's fp32 and bf16 runs: a transformers LLaVA trained
    in bf16 autocast on one device (the capture's dtype checks once crashed every transformers
    model there), and with 2 devices or more the demo's ZeRO-1 plan at DP = N (optimizer states
    sharded) against eager training. Each with its step and peak tensor memory per rank against
    the plan's prediction."""

    def cluster(n: int) -> str:
        return f"{cluster_of}{n}" if args.device == "cpu" else f"{cluster_of}x{n}"

    out = []
    llava = _plan_file(tmp, cluster(1), pp=1, model=LLAVA)
    run = _torchrun(1, llava, args, "bf16", tmp)
    run.update(
        cluster=cluster(1), precision="bf16", model=LLAVA, finite=all(map(math.isfinite, run["losses"]))
    )
    run.update(_prediction_error(llava, run))
    print(f"  {LLAVA} {run['cluster']} bf16: {run['summary']}", flush=True)
    out.append(run)
    if gpus >= 2:
        zero = _plan_file(tmp, cluster(gpus), pp=1, model=args.model, extra=("--zero-stage", "1"))
        run = _torchrun(gpus, zero, args, "fp32", tmp)
        run.update(cluster=cluster(gpus), precision="fp32", zero_stage=1)
        try:
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(eager))
            run["equals_eager"] = True
        except AssertionError as err:
            run["equals_eager"], run["mismatch"] = False, str(err)
        run.update(_prediction_error(zero, run))
        print(f"  {run['cluster']} ZeRO-1 at DP={gpus}: {run['summary']}", flush=True)
        out.append(run)
    return out


def _plan_file(tmp: Path, cluster: str, pp: int, model: str = MODEL, extra: tuple[str, ...] = ()) -> str:
    path = tmp / f"plan_{model}_{cluster.replace(':', '')}{''.join(extra).replace('-', '_')}.json"
    command = [sys.executable, "-m", "vlmcompile", "plan", "--model", model, "--cluster", cluster, *extra]
    command += ["--tp", "1", "--pp", str(pp), "--global-batch", str(GLOBAL_BATCH), "--json", str(path)]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    return str(path)


def _torchrun(n: int, plan: str, args, precision: str, tmp: Path) -> dict:
    log = tmp / f"steps_{Path(plan).stem}_{precision}.jsonl"  # one a run: --log-jsonl appends
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    command += ["-m", "vlmcompile", "train", "--plan", plan, "--steps", str(args.steps), "--lr", "1e-4"]
    command += [
        "--warmup-steps",
        "1",
        "--precision",
        precision,
        "--device",
        args.device,
        "--log-jsonl",
        str(log),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"gpu_check: {' '.join(command)} failed:\n{done.stderr[-4000:]}")
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    timed = steps[1:] or steps
    return {
        "ranks": n,
        "losses": [s["loss"] for s in steps],
        "median_step_s_after_first": statistics.median(s["step_s"] for s in timed),
        "median_mfu_after_first": statistics.median(s["mfu"] for s in timed),
        "peak_mem_bytes_per_rank": [max(col) for col in zip(*(s["peak_mem_bytes"] for s in steps))],
        **_tensor_memory(steps),
        "wall_s": time.perf_counter() - start,
        "summary": done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "",
    }


def _tensor_memory(steps: list[dict]) -> dict:
    """Each rank's measured peak tensor memory (the steps that measured it; every step on a GPU)
    against the runtime's prediction for the precision trained in."""
    measured = [s for s in steps[1:] or steps if s.get("peak_tensor_bytes")]
    if not measured:
        return {}
    peaks = [max(col) for col in zip(*(s["peak_tensor_bytes"] for s in measured))]
    predicted = measured[-1]["predicted_peak_bytes"]
    return {
        "peak_tensor_bytes_per_rank": peaks,
        "runtime_predicted_peak_bytes_per_rank": predicted,
        "tensor_memory_error_per_rank": [p / m - 1 if m else None for p, m in zip(predicted, peaks)],
    }


def _prediction_error(plan: str, run: dict) -> dict:
    """The plan's simulated step and peak memory per rank against the run's measured ones
    (the plan is made for bf16, so the bf16 run is the like-for-like one)."""
    simulated = json.loads(Path(plan).read_text())["simulation"]
    predicted_mem = [r["peak_mem_bytes"] for r in simulated["ranks"]]
    measured_mem = run["peak_mem_bytes_per_rank"]
    return {
        "predicted_step_s": simulated["step_time_s"],
        "step_error": simulated["step_time_s"] / run["median_step_s_after_first"] - 1,
        "predicted_peak_mem_bytes_per_rank": predicted_mem,
        "peak_mem_error_per_rank": [p / m - 1 if m else None for p, m in zip(predicted_mem, measured_mem)],
    }


def _cluster_family(device_name: str) -> str:
    for family in ("h200", "h100", "a100", "v100"):
        if family in device_name.lower():
            return family
    print(f"  (no preset for {device_name!r}: the H100 spec is the calibration's prior)")
    return "h100"


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


if __name__ == "__main__":
    sys.exit(main())
