"""``vlmcompile train``: train a saved plan, under torchrun or on local ranks; the model is the
plan's (or ``--model``'s): a zoo name, a tiny transformers model or a user's
``pkg.module:function``, built with the same seed on every rank.

Under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment) this process is one
rank: it joins the process group (gloo on CPU, NCCL on CUDA with ``LOCAL_RANK`` picking the
GPU), builds the model with the same seed as every other rank, captures it, takes its stage
modules for the plan and trains. Otherwise it starts the plan's ranks on this machine with the
local launcher. The plan is read from JSON, never searched again here: a search on every rank
could choose differently on each.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vlmcompile.ir.errors import ArgumentError, PlanError
from vlmcompile.runtime.launch import threads_per_rank

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_PRECISIONS = ("fp32", "bf16")
"""``--precision`` besides ``auto``: fp32, or bf16 autocast. Names only: ``vlmcompile plan --help``
imports no torch (this module is read to build the command line)."""


def under_torchrun() -> bool:
    return all(k in os.environ for k in _TORCHRUN_ENV)


def data_arguments(parser: argparse.ArgumentParser, positive_int, positive_float, what: str) -> None:
    """``--data`` and its companions (``plan`` and ``train`` alike)."""
    parser.add_argument(
        "--data",
        metavar="SPEC",
        help="synthetic:<name> (llava-chat, internvl-tiles, qwen-native, interleaved), a JSONL manifest of "
        f'sample sizes ({{"text_tokens": 412, "images": [[768, 1024]]}} a line), or your own dataset of samples '
        f"as pkg.module:function: {what}",
    )
    parser.add_argument(
        "--data-samples", type=positive_int, default=1024, help="samples of a synthetic:<name> dataset"
    )
    parser.add_argument(
        "--text-scale", type=positive_float, default=1.0, help="scale every sample's text tokens (--data)"
    )
    parser.add_argument(
        "--tokens-per-microbatch",
        type=positive_int,
        metavar="N",
        help="LLM tokens of a packed microbatch (--data; default: the plan's, else the longest sample's, "
        "rounded up to 16)",
    )


def warn_without_data(args: argparse.Namespace) -> None:
    """Say that ``--tokens-per-microbatch`` goes unread without ``--data``, rather than drop it."""
    if args.tokens_per_microbatch and not args.data:
        print(
            "vlmcompile: warning: ignoring --tokens-per-microbatch: only --data packs samples into microbatches",
            file=sys.stderr,
        )


def add_arguments(
    parser: argparse.ArgumentParser, positive_int, positive_float, *, non_negative_float, names
) -> None:
    parser.add_argument(
        "--plan", required=True, metavar="FILE", help="plan JSON (vlmcompile plan ... --json FILE)"
    )
    parser.add_argument(
        "--model", help="the model: a zoo name or your own pkg.module:function (default: the plan's)"
    )
    parser.add_argument(
        "--freeze",
        type=names,
        action="extend",
        metavar="NAMES",
        help="regions or module paths to train frozen, as the plan was made (vlmcompile plan --freeze): the "
        "plan's own freezing is applied either way, and a --freeze that names other layers is refused",
    )
    data_arguments(
        parser,
        positive_int,
        positive_float,
        "train on samples of these sizes (random content), packed; without it, synthetic batches of the "
        "model's one shape",
    )
    parser.add_argument(
        "--global-batch",
        type=positive_int,
        help="samples a step of packed samples (default: the plan's, made with --data or a model's own samples)",
    )
    parser.add_argument("--steps", type=positive_int, default=10, help="training steps")
    parser.add_argument("--lr", type=positive_float, default=1e-4, help="peak learning rate (AdamW)")
    parser.add_argument(
        "--weight-decay", type=non_negative_float, default=0.1, help="AdamW's decoupled weight decay"
    )
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps")
    parser.add_argument(
        "--decay", choices=["cosine", "linear", "constant"], default="cosine", help="LR decay after warm-up"
    )
    parser.add_argument(
        "--decay-steps",
        type=positive_int,
        help="steps the LR decays over (None: --steps; fix it to extend a run)",
    )
    parser.add_argument("--max-grad-norm", type=positive_float, default=1.0, help="global gradient-norm clip")
    parser.add_argument("--no-clip", action="store_true", help="do not clip the gradients")
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed (the same on every rank)")
    _checkpoint_arguments(parser, positive_int)
    parser.add_argument(
        "--skip-nonfinite-steps",
        action="store_true",
        help="skip a step whose loss or gradient norm is NaN or infinite (no update) and go on; without it "
        "the run stops before that step's update, naming the step and the samples",
    )
    parser.add_argument("--log-jsonl", metavar="FILE", help="append one JSON line of metrics per step")
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: CUDA for a plan made for GPUs, the CPU for a cpu:N plan",
    )
    parser.add_argument(
        "--precision",
        choices=["auto", *_PRECISIONS],
        default="auto",
        help="compute dtype; auto: bf16 autocast on CUDA when the plan's parameters are 2 bytes, else fp32 "
        "(parameters, gradients and their reduction are fp32 either way)",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=120.0, help="seconds any rank may wait for another"
    )


def _checkpoint_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    """``--checkpoint-dir`` and how a run saves into it and starts from it."""
    parser.add_argument("--checkpoint-dir", help="save checkpoints here (DCP, under the model's names)")
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="save every K steps (0: only after the last)"
    )
    parser.add_argument(
        "--keep-last",
        type=positive_int,
        help="keep only the K newest checkpoints in --checkpoint-dir (None: keep all)",
    )
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir (from step 0 if it holds none)",
    )
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the checkpoints in --checkpoint-dir and start at step 0 (without it or --resume, a "
        "directory holding checkpoints is refused)",
    )


def run(args: argparse.Namespace) -> int:
    """Train; returns the exit code: 0, or 128 + the signal's number when a stop request (SIGTERM,
    SIGUSR1) ended the run early, after saving."""
    import signal

    from vlmcompile.compiled_pipeline import check_cluster_size
    from vlmcompile.ir.plan import Plan

    plan = Plan.load(args.plan)
    warn_without_data(args)
    world = check_cluster_size(plan).world_size
    torchrun = under_torchrun()
    started = int(os.environ["WORLD_SIZE"]) if torchrun else world  # the local launcher starts the plan's
    if started != world:
        raise PlanError(
            f"the plan in {args.plan} runs on {world} ranks; torchrun started {started}. Start {world} "
            f"(torchrun --nproc-per-node {world} ...), or plan for {started}: vlmcompile plan ... --json FILE"
        )
    device = _device(args.device, plan)
    if device == "cuda" and not torchrun:
        raise ArgumentError(
            f"the local launcher starts CPU ranks over gloo; on GPUs start one rank per GPU with torchrun: "
            f"torchrun --nproc-per-node {world} -m vlmcompile train --plan {args.plan} ..."
        )
    autocast = _autocast(args.precision)
    if torchrun:
        _join_process_group(device, args.timeout)
    rank = int(os.environ.get("RANK", 0))
    try:
        result = _train(args, plan, device, autocast)
    except BaseException:
        if torchrun:
            _abort_process_group()
        raise
    if torchrun:
        import torch.distributed as dist

        dist.destroy_process_group()
    if rank == 0:
        print(result)
    return 128 + int(getattr(signal, result.stopped_by)) if result.stopped_by else 0


def _train(args: argparse.Namespace, plan, device: str, autocast):
    from vlmcompile import model_source
    from vlmcompile.runtime.checkpoint_dir import checkpoint_bytes
    from vlmcompile.runtime.train_loop import TrainConfig, claim_for

    config = TrainConfig(
        steps=args.steps,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        decay=args.decay,
        decay_steps=args.decay_steps,
        max_grad_norm=None if args.no_clip else args.max_grad_norm,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep_last=args.keep_last,
        resume=args.resume,
        overwrite=args.overwrite,
        on_nonfinite="skip" if args.skip_nonfinite_steps else "stop",
        log_jsonl=args.log_jsonl,
    )
    name = args.model or plan.model
    built = model_source.build(name, seed=args.seed)
    model = built.model
    _freeze_as_planned(model, plan)
    size = checkpoint_bytes([*model.parameters(), *model.buffers()])
    # The checkpoint directory and the log are checked (and the directory held) before capture;
    # train() below claims it again, from this claim.
    with claim_for(config, size):
        if args.data or built.samples is not None:
            pipe, data = _packed_data(args, built, plan)
        else:
            if plan.packed_tokens is not None:
                raise ArgumentError(
                    f"the plan in {args.plan} was made for packed samples of varying shapes (vlmcompile plan "
                    "--data ...): give the data to train on, --data SPEC"
                )
            global_batch = plan.global_batch
            pipe, data = _one_shape_data(built, global_batch, args.seed)
        _check_freeze_flag(args.freeze, pipe.layer_graph, plan)
        return pipe.train(
            data, config, plan=plan, device=device, autocast_dtype=autocast, timeout_s=args.timeout
        )


@dataclass(frozen=True)
class SameBatch:
    """Every step's global batch: the one a model's function gave (picklable, for the ranks)."""

    batch: Mapping[str, Any]

    def __call__(self, step: int) -> Mapping[str, Any]:
        return self.batch


def _one_shape_data(built, global_batch: int, seed: int):
    """The pipeline compiled for batches of one shape, and every step's global batch: a zoo
    model's synthetic batches, or the sample batch a function (or a tiny transformers builder)
    gives, every step."""
    from vlmcompile import model_source
    from vlmcompile.compiler import compile
    from vlmcompile.ir.microbatch import num_samples
    from vlmcompile.models.synthetic_batches import SyntheticBatches

    name = built.name
    if not (model_source.is_function(name) or name.startswith("hf-")):
        data = SyntheticBatches(name, global_batch, seed=seed)
        return compile(built.model, built.batch, model_name=name, log=None), data
    batch = (
        model_source.build(name, batch_size=global_batch, seed=seed).batch
        if name.startswith("hf-")
        else built.batch
    )
    if not isinstance(batch, Mapping):
        raise ArgumentError(
            f"--model {name} returned the model alone: give --data (a dataset of its samples), or return (model, "
            "sample_batch) from the function"
        )
    held = num_samples(batch)
    if held != global_batch:
        raise ArgumentError(
            f"the plan trains {global_batch} samples a step; --model {name}'s sample batch holds {held}: plan for "
            f"it (vlmcompile plan --model {name} --global-batch {held} ...), or train samples with --data"
        )
    return compile(built.model, batch, model_name=name, log=None), SameBatch(batch)


def _freeze_as_planned(model, plan) -> None:
    """Freeze the modules of the layers the plan keeps frozen (whole layers, as ``vlmcompile plan
    --freeze`` froze them; the pipeline then checks the counts against the plan's)."""
    for layer in plan.frozen or {}:
        try:
            model.get_submodule(layer).requires_grad_(False)
        except AttributeError:
            raise PlanError(
                f"the plan keeps layer {layer!r} frozen, which is no module of {type(model).__name__}: plan for "
                "this model (vlmcompile plan ... --freeze ...)"
            ) from None


def _check_freeze_flag(names, layer_graph, plan) -> None:
    """``--freeze`` must name the layers the plan keeps frozen (it is a check: the plan's freezing
    is what trains)."""
    if not names:
        return
    meant = [n for n in layer_graph.select(names) if layer_graph[n].num_params]
    frozen = list(plan.frozen or {})
    if set(meant) != set(frozen):
        flag = ",".join(names)
        does = f"freezes {len(frozen)} layers ({_span(frozen)})" if frozen else "trains every layer"
        raise ArgumentError(
            f"--freeze {flag} names {len(meant)} layers with parameters ({_span(meant)}), but the plan {does}: "
            f"drop --freeze (the plan's freezing is applied), or make a plan with it: vlmcompile plan ... --freeze "
            f"{flag} --json FILE"
        )


def _span(names) -> str:
    """The first and last of layers given in layer order."""
    names = list(names)
    return "none" if not names else names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def _packed_data(args: argparse.Namespace, built, plan):
    """The pipeline compiled for the samples (``--data``'s, else the model function's) at the
    plan's token budget, and its global batches of them."""
    from vlmcompile import model_source
    from vlmcompile.compiler import compile
    from vlmcompile.runtime.global_batches import GlobalBatches

    args.global_batch = args.global_batch or plan.packed_global_batch or 8

    if args.data:
        samples = max(args.data_samples, args.global_batch)
        data = model_source.data(
            args.data, built.model, num_samples=samples, seed=args.seed, text_scale=args.text_scale
        )
    else:
        data = built.samples
    model, name = built.model, built.name
    planned = plan.packed_tokens
    if planned is None:
        raise ArgumentError(
            f"the plan in {args.plan} was made for batches of one shape; to train on --data, plan for it: "
            "vlmcompile plan ... --data SPEC --json FILE"
        )
    if args.tokens_per_microbatch and args.tokens_per_microbatch != planned:
        raise ArgumentError(
            f"--tokens-per-microbatch {args.tokens_per_microbatch} contradicts the plan, made for microbatches of "
            f"{planned} LLM tokens: give {planned} (or leave it out), or plan again with --tokens-per-microbatch "
            f"{args.tokens_per_microbatch}"
        )
    pipe = compile(
        model,
        dataset=data,
        global_batch=args.global_batch,
        model_name=name,
        tokens_per_microbatch=planned,
        log=None,
    )
    return pipe, GlobalBatches(data, args.global_batch, seed=args.seed)


def _device(choice: str, plan) -> str:
    import torch

    gpu_plan = bool(plan.cluster) and not plan.cluster.startswith("cpu")
    device = choice if choice != "auto" else ("cuda" if gpu_plan else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ArgumentError(
            f"the plan was made for {plan.cluster or 'GPUs'} and asks for CUDA, but this machine has none; "
            "run it on CPU ranks with --device cpu, or on a machine with GPUs"
        )
    return device


def _autocast(choice: str):
    """ "auto" lets train() follow the plan's precision (bf16 on GPUs for 2-byte parameters)."""
    import torch

    return {"auto": "auto", "fp32": None, "bf16": torch.bfloat16}[choice]


def _abort_process_group() -> None:
    """After an error: abort, not destroy (NCCL's destroy waits for every operation in flight,
    and a receive posted ahead may never complete); the error itself is what the user sees."""
    from torch.distributed import distributed_c10d

    try:
        distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001 - the error being raised matters more than the clean-up's
        pass


def _join_process_group(device: str, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    # NCCL's watchdog times operations from when they were issued and ends the process at this
    # timeout: room past the runner's, so the runner's own wait names the peer it lost.
    timeout = datetime.timedelta(seconds=2 * timeout_s + 30)
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        if local >= torch.cuda.device_count():
            raise ArgumentError(
                f"LOCAL_RANK={local}, but this machine has {torch.cuda.device_count()} CUDA devices: start at most "
                "one rank per GPU (torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
    else:
        torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        dist.init_process_group("gloo", timeout=timeout)


def rank_prefix() -> str:
    """ "rank R: " under torchrun, so each rank's error names itself."""
    return f"rank {os.environ['RANK']}: " if under_torchrun() else ""
