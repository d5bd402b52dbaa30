"""Command line.

Every ``--model`` takes a zoo name, a tiny transformers model (``hf-llava``) or your own model as
``pkg.module:function`` (:mod:`vlmcompile.model_source`).

``vlmcompile annotate --model NAME [--json FILE]``: capture and annotate a model.
``vlmcompile plan --model NAME --cluster PRESET [--policy NAME]``: plan with our policy (or a
baseline of :data:`~vlmcompile.passes.planning.policies.POLICIES`), simulate and print the step and its
bubbles (``--setup NAME`` fills in a paper's configuration; ``--search`` lets the plan search
choose the degrees; ``--data`` plans for samples of any shape).
``vlmcompile demo [--model NAME] [--json FILE]``: the demo VLM (or yours) on 2 local CPU ranks,
our plan against the baselines', measured and predicted.
``vlmcompile run --model NAME --nprocs N``: train a model a few steps on N local CPU ranks.
``vlmcompile train --plan FILE [--steps N ...]``: train a saved plan with AdamW, checkpoints and
metrics; under ``torchrun --nproc-per-node N -m vlmcompile train ...`` each process is a rank.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from vlmcompile import train_command
from vlmcompile.ir.errors import TRACEBACK_ENV, ArgumentError

_DTYPES = ("bf16", "fp16", "fp32")
"""``--dtype`` names; torch's dtypes are looked up when a command runs (``--help`` imports no torch)."""


def _dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


_OUTPUT_FLAGS = ("json", "png", "trace", "log_jsonl")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _positive_float(text: str) -> float:
    value = _float(text)
    if not 0 < value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is not a number > 0")
    return value


def _non_negative_float(text: str) -> float:
    value = _float(text)
    if not 0 <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"{text!r} names nothing: give regions or module paths, e.g. vision,llm"
        )
    return names


def _memory_cap(text: str) -> str:
    from vlmcompile.demo import parse_memory_cap

    try:
        parse_memory_cap(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _check_output_paths(args: argparse.Namespace) -> None:
    """Refuse an output file that cannot be written before any work is done, so that a run never
    ends in an error after writing some of its outputs."""
    from vlmcompile.runtime.checkpoint_dir import check_output_file

    for flag in _OUTPUT_FLAGS:
        path = getattr(args, flag, None)
        if path:
            check_output_file(path, f"--{flag.replace('_', '-')}")


def _annotate(args: argparse.Namespace) -> int:
    import vlmcompile
    from vlmcompile import model_source

    built = model_source.build(
        args.model,
        device="cpu" if args.real else "meta",
        dtype=_dtype(args.dtype),
        batch_size=args.batch_size,
    )
    model, batch = built.model, _batch_of(built)
    pipe = vlmcompile.compile(
        model, batch, model_name=args.model, tensor_mode="real" if args.real else "fake"
    )
    print(pipe.report)
    if args.json:
        Path(args.json).write_text(json.dumps(pipe.layer_graph.to_json(), indent=1))
        print(f"\nper-layer figures written to {args.json}", file=sys.stderr)
    return 0


def _batch_of(built):
    """A model's sample batch of one shape (a dict), for the commands that run one."""
    from collections.abc import Mapping

    if not isinstance(built.batch, Mapping) or built.samples is not None:
        given = (
            "returned the model alone"
            if built.batch is None
            else "gave samples of different shapes"
            if isinstance(built.batch, list)
            else "gave a Qwen-VL batch, which is captured as its samples (packed)"
        )
        raise ArgumentError(
            f"--model {built.name} {given}; this command runs one batch of one shape: plan and train it with "
            "vlmcompile plan and vlmcompile train (--data for a dataset of samples)"
        )
    return built.batch


def _plan(args: argparse.Namespace) -> int:
    from vlmcompile.cost_models.cluster import Cluster

    _fill_plan_args(args)
    cluster = Cluster.preset(args.cluster)
    print(f"annotating {args.model} ...", file=sys.stderr)
    graph, found = _layer_graph(args)
    if args.freeze:
        graph = graph.with_frozen(args.freeze)
        frozen = graph.meta["frozen"]
        print(f"frozen: {len(frozen)} of {len(graph)} layers ({frozen[0]} .. {frozen[-1]})", file=sys.stderr)
    run = _plan_run(args, graph, cluster)
    if found is not None:
        from vlmcompile.compiler import packed_decision

        run = run.with_decisions(packed_decision(found))
    if args.search:
        print()
    print(cluster)
    print()
    print(run)
    alone_s, bound_s = _llm_alone_s(run, graph, cluster)
    if alone_s is not None:
        from vlmcompile.sim.units import format_ms

        print(
            f"the same LLM without its encoders at these degrees: {format_ms(alone_s)} ms simulated "
            f"(this plan {run.sim.step_time_s / alone_s:.2f}x of it); with one microbatch's encoder "
            f"forward before it and backward after: {format_ms(bound_s)} ms "
            f"(this plan {run.sim.step_time_s / bound_s:.2f}x of it)"
        )
    held = _runtime_memory(run, graph, cluster)
    if held:
        print(held)
    if not run.fits:
        print(f"\nwarning: the plan does not fit in {cluster.device.name} memory", file=sys.stderr)
    _write_plan_outputs(args, run, graph, alone_s, bound_s)
    return 0 if run.fits else 3


def _llm_alone_s(run, graph, cluster) -> tuple[float | None, float | None]:
    """The bounds' steps (vlmcompile/planning/llm_alone_bound.py): the LLM alone, and with the encoders'
    dependencies; None for a model with nothing but encoders."""
    from vlmcompile.ir.errors import PlanError
    from vlmcompile.planning.llm_alone_bound import dependency_bound, llm_alone_plan, llm_alone_step_s

    try:
        alone = llm_alone_plan(run.plan, graph, cluster)
    except PlanError:
        return None, None
    bound = dependency_bound(alone, graph, cluster).step_s
    return llm_alone_step_s(run.plan, graph, cluster, alone=alone), bound


def _runtime_memory(run, graph, cluster) -> str | None:
    """On GPUs, where every policy plans with Megatron-LM's model-state bytes, what our runtime
    would hold training the plan under bf16 autocast, and whether ``pipe.train`` takes it."""
    from vlmcompile.cost_models.memory import ranks_over, usable_memory_bytes
    from vlmcompile.ir.layer_graph import format_bytes
    from vlmcompile.ir.plan import Precision
    from vlmcompile.sim.simulator import peak_memory_bytes

    plan = run.plan
    runtime = Precision.runtime(autocast=True)
    if plan is None or cluster.ranks_on_this_machine or plan.precision == runtime:
        return None
    peaks = peak_memory_bytes(plan, graph, cluster, precision=runtime)
    cap = usable_memory_bytes(cluster.device.mem_bytes)
    top = max(range(len(peaks)), key=peaks.__getitem__)
    over = ranks_over(peaks, cap)
    verdict = (
        f"over it on {len(over)} of {len(peaks)} pipeline ranks: pipe.train refuses it before launch until the "
        "runtime keeps bf16 parameters and a sharded fp32 master copy (docs/training.md)"
        if over
        else "within it: pipe.train takes it"
    )
    return (
        f"as our runtime trains it (bf16 autocast; fp32 parameters, gradients and AdamW states): peak "
        f"{format_bytes(peaks[top])} on pipeline rank {top}, limit {format_bytes(cap)}; {verdict}"
    )


def _layer_graph(args: argparse.Namespace):
    """(the LayerGraph to plan, the dataset's scan or None): a zoo model on meta weights, or the
    model a user's function builds; packed samples where ``--data`` or the function gives them."""
    from vlmcompile import model_source
    from vlmcompile.compiler import compile, zoo_layer_graph
    from vlmcompile.ir.microbatch import num_samples

    dtype = _dtype(args.dtype) if args.dtype else None
    own = model_source.is_function(args.model) or args.model.startswith("hf-")
    if not own and not args.data:
        return zoo_layer_graph(args.model, dtype=dtype), None
    built = model_source.build(args.model, device="meta", dtype=dtype or (None if own else _dtype("bf16")))
    if args.data:
        data = model_source.data(
            args.data, built.model, num_samples=args.data_samples, text_scale=args.text_scale
        )
    elif built.batch is None:
        raise ArgumentError(
            f"--model {args.model} returned the model alone: give --data (a dataset of its samples), or return "
            "(model, sample_batch) from the function"
        )
    else:
        data = built.samples  # a Qwen-VL dict batch too: it is captured and planned as its samples
        args.global_batch = args.global_batch or (len(data) if data is not None else num_samples(built.batch))
    if data is None:
        held = num_samples(built.batch)
        if model_source.is_function(args.model) and args.global_batch != held:
            raise ArgumentError(
                f"--global-batch {args.global_batch}, but --model {args.model}'s sample batch holds {held} samples, "
                f"which is what vlmcompile train trains each step: give --global-batch {held} (or leave it out), "
                "or samples to draw steps from with --data"
            )
        return compile(built.model, built.batch, model_name=args.model, log=None).layer_graph, None
    if not args.global_batch:
        raise ArgumentError(f"missing --global-batch: the samples a step draws from the {len(data)} given")
    return _data_layer_graph(args, built.model, data)


def _data_layer_graph(args: argparse.Namespace, model, data):
    """The LayerGraph of the packed microbatch a dataset's samples make, on meta weights where
    the model is: memory at the largest microbatch, times at the mean one (the plan then takes
    the microbatches a step needs, one row each), and the dataset's scan."""
    import vlmcompile

    pipe = vlmcompile.compile(
        model,
        dataset=data,
        global_batch=args.global_batch,
        model_name=args.model,
        tokens_per_microbatch=args.tokens_per_microbatch,
        log=None,
    )
    found = pipe.report.passes["data"]
    print(found, file=sys.stderr)
    args.global_batch, args.microbatch_size = found.microbatches, 1
    return found.expected_time(pipe.layer_graph), found


def _fill_plan_args(args: argparse.Namespace) -> None:
    """The policy, a paper setup's values for the flags not given, and a check that nothing needed is missing."""
    from vlmcompile.planning.setups import setup

    if args.search and args.policy not in (None, "vlmcompile"):
        raise ValueError(
            f"--search plans with the vlmcompile policy; drop --policy {args.policy} (or drop --search to plan "
            f"with {args.policy} at the degrees you give)"
        )
    args.policy = args.policy or "vlmcompile"
    _warn_ignored_flags(args)
    if args.setup:
        s = setup(args.setup)
        args.model = args.model or s.model
        args.cluster = args.cluster or s.cluster
        args.tp = args.tp or s.parallel.tp
        args.pp = args.pp or s.parallel.pp
        args.global_batch = args.global_batch or s.global_batch
        args.microbatch_size = args.microbatch_size or s.microbatch_size
        args.v = args.v or s.parallel.v
        if args.policy == "megatron" and args.placement is None and not _uneven_counts(args):
            args.placement = s.placement
    required = (
        ("model", "cluster", "global_batch")
        if args.search
        else ("model", "cluster", "tp", "pp", "global_batch")
    )
    if args.model and _own_model(args.model):
        required = tuple(k for k in required if k != "global_batch")  # the model's own batch gives it
    missing = [f"--{k.replace('_', '-')}" for k in required if not getattr(args, k)]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or give --setup NAME)")


def _own_model(spec: str) -> bool:
    from vlmcompile.model_source import is_function

    return is_function(spec) or spec.startswith("hf-")


def _plan_run(args: argparse.Namespace, graph, cluster):
    from vlmcompile.passes.planning.policies import POLICIES, plan_and_simulate, search_and_compare
    from vlmcompile.planning.request import GlobalRecompute, PlanRequest, SolverOptions

    solver = SolverOptions(time_limit_s=args.time_limit or (SEARCH_TIME_LIMIT_S if args.search else 10.0))
    if args.search:
        return search_and_compare(graph, cluster, global_batch=args.global_batch, solver=solver)
    request = PlanRequest.on(
        cluster,
        tp=args.tp,
        pp=args.pp,
        v=args.v or 1,
        global_batch=args.global_batch,
        microbatch_size=args.microbatch_size or 1,
        schedule=args.schedule,
        placement=args.stage_placement or "loop",
        zero_stage=args.zero_stage,
    )
    recompute = (
        "auto"
        if args.recompute == "auto" and not args.recompute_vision
        else GlobalRecompute(
            granularity="none" if args.recompute == "auto" else args.recompute, vision=args.recompute_vision
        )
    )
    megatron = args.policy == "megatron"
    return plan_and_simulate(
        graph,
        cluster,
        args.policy,
        request,
        recompute=recompute,
        placement=args.placement if megatron else None,
        first_stage_layers=args.first_stage_layers if megatron else None,
        last_stage_layers=args.last_stage_layers if megatron else None,
        solver=solver if "solver" in POLICIES[args.policy].options else None,
    )


def _write_plan_outputs(
    args: argparse.Namespace, run, graph, llm_alone_s: float | None, dependency_bound_s: float | None
) -> None:
    import dataclasses

    from vlmcompile.planning.megatron_layout import megatron_layout

    if args.json:
        data = {
            "plan": run.plan.to_json(),
            "simulation": run.sim.to_json(),
            "llm_alone_step_s": llm_alone_s,
            "dependency_bound_s": dependency_bound_s,
            "megatron_layout": megatron_layout(run.plan, graph)[0],
            "policies": [dataclasses.asdict(r) for r in run.baselines],
        }
        Path(args.json).write_text(json.dumps(data, indent=1))
        print(f"plan and simulation written to {args.json}", file=sys.stderr)
    if args.trace or args.png:
        from vlmcompile.sim.trace import write_chrome_trace, write_png

        if args.trace:
            write_chrome_trace(run.plan, run.sim, args.trace)
            print(f"Chrome trace written to {args.trace} (open in https://ui.perfetto.dev)", file=sys.stderr)
        if args.png:
            write_png(run.plan, run.sim, args.png)
            print(f"timeline written to {args.png}", file=sys.stderr)


SEARCH_TIME_LIMIT_S = 3.0
"""CP-SAT's limit per candidate a ``plan --search`` partitions (the search partitions a few; at
fixed degrees the one partition gets 10 s)."""
_SEARCHED = (
    "tp",
    "pp",
    "v",
    "microbatch_size",
    "schedule",
    "stage_placement",
    "placement",
    "first_stage_layers",
    "last_stage_layers",
    "zero_stage",
)
"""Flags of ``plan`` that ``--search`` chooses itself (ZeRO: the cluster's)."""
_MEGATRON_ONLY = ("placement", "first_stage_layers", "last_stage_layers")


def _uneven_counts(args: argparse.Namespace) -> bool:
    return args.first_stage_layers is not None or args.last_stage_layers is not None


def _warn_ignored_flags(args: argparse.Namespace) -> None:
    """Say which given flags a ``plan`` command will not use, rather than dropping them silently."""
    ignored = []
    if args.search:
        ignored = [k for k in _SEARCHED if getattr(args, k) is not None]
        ignored += ["recompute"] * (args.recompute != "auto") + ["recompute_vision"] * args.recompute_vision
        why = "--search chooses them itself (recompute per layer)"
    elif args.policy != "megatron":
        ignored = [k for k in _MEGATRON_ONLY if getattr(args, k) is not None]
        why = f"only the megatron policy reads them, not {args.policy}"
    if ignored:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in ignored)
        print(f"vlmcompile: warning: ignoring {flags}: {why}", file=sys.stderr)
    train_command.warn_without_data(args)


def _demo(args: argparse.Namespace) -> int:
    from vlmcompile.demo import run_demo

    def show(pipe) -> None:  # the compile report, to read while the plans are measured
        print(pipe.report, end="\n\n", flush=True)

    _, result = run_demo(
        global_batch=args.global_batch,
        num_steps=args.steps,
        full=args.full,
        log=sys.stderr,
        on_compiled=show,
        memory_cap=args.memory_cap,
        freeze=args.freeze or (),
        model_name=args.model,
    )
    print(result, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1))
        print(f"\nfigures written to {args.json}", file=sys.stderr)
    return 0


def _run(args: argparse.Namespace) -> int:
    import statistics

    from vlmcompile import model_source
    from vlmcompile.compiler import compile
    from vlmcompile.ir.microbatch import num_samples
    from vlmcompile.planning.request import SearchSpace
    from vlmcompile.runtime.launch import check_launchable
    from vlmcompile.runtime.timed_steps import timed_steps

    check_launchable(args.nprocs, args.timeout)  # before minutes of compiling
    built = model_source.build(args.model, batch_size=args.global_batch)
    model, batch = built.model, _batch_of(built)
    if num_samples(batch) != args.global_batch:
        raise ArgumentError(
            f"--global-batch {args.global_batch}, but --model {args.model}'s sample batch holds {num_samples(batch)} "
            f"samples, which run trains: give --global-batch {num_samples(batch)}"
        )
    pipe = compile(
        model,
        batch,
        cluster=f"cpu:{args.nprocs}",
        model_name=args.model,
        global_batch=args.global_batch,
        profile=True,
        search_space=SearchSpace(microbatch_sizes=(1,)),
    )
    if args.policy == "vlmcompile":
        plan = pipe.plan
    else:
        if args.nprocs % args.pp:
            raise ValueError(f"--pp {args.pp} does not divide --nprocs {args.nprocs}")
        plan = pipe.baseline(args.policy, tp=1, pp=args.pp, global_batch=args.global_batch).plan
    print(plan)
    results = pipe.launch(timed_steps, plan=plan, args=(batch, args.steps, args.lr), timeout_s=args.timeout)
    steps = [max(r["step_s"][k] for r in results) for k in range(args.steps)]
    print(f"\nlosses: {', '.join(f'{x:.6f}' for x in results[0]['losses'])}")
    timed = steps[1:] or steps
    print(
        f"step times (s): {', '.join(f'{t:.3f}' for t in steps)}; median after the first: {statistics.median(timed):.3f} s"
    )
    return 0


def _setup_names() -> list[str]:
    from vlmcompile.planning.setups import SETUPS

    return list(SETUPS)


def _policies() -> dict:
    from vlmcompile.passes.planning.policies import POLICIES

    return POLICIES


def _policy_names() -> list[str]:
    return list(_policies())


def _schedule_names() -> list[str]:
    from vlmcompile.planning.schedules import Schedule

    return [s.value for s in Schedule]


def _stage_placement_names() -> list[str]:
    from vlmcompile.ir.placement import PlacementStyle

    return [s.value for s in PlacementStyle]


def _placement_names() -> list[str]:
    from vlmcompile.passes.baselines.megatron import EncoderPlacement

    return [p.value for p in EncoderPlacement]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (plain text), and every option's default where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        missing = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        shown = not missing and "default" not in text
        if shown and action.option_strings and action.nargs != 0:
            text += " (default: %(default)s)"
        return text


def _plain(text: str) -> str:
    """A docstring as help text: without reStructuredText's double backticks."""
    return text.replace("``", "")


def _command(sub, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=description or help, formatter_class=_HelpFormatter)


_MODEL_HELP = (
    "a zoo name (demo, InternVL-Chat-1.5, Optimus-Model-D, ViT-22B+GPT-175B, ...), a tiny transformers model "
    "(hf-llava, hf-qwen2-vl, ...), or your own: pkg.module:function, a function returning the model or "
    "(model, sample_batch), found from the folder you run in"
)


def _add_annotate(sub) -> None:
    p = _command(sub, "annotate", "capture and annotate a model; print the report")
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--json", metavar="FILE", help="write the LayerGraph (per-layer figures) as JSON")
    p.add_argument(
        "--batch-size", type=_positive_int, default=1, help="samples in the sample batch (default 1)"
    )
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="parameter and activation dtype")
    p.add_argument(
        "--real",
        action="store_true",
        help="build with real CPU weights and measure on real tensors (small models only)",
    )
    p.set_defaults(run=_annotate)


def _add_layout_flags(q) -> None:
    """``plan``'s flags for a layout at fixed degrees: recompute, Megatron's placement, the schedule."""
    q.add_argument(
        "--recompute",
        choices=["auto", "none", "selective", "full"],
        default="auto",
        help="global recompute of the LLM decoder layers (Megatron policies); auto: the least that fits in memory",
    )
    q.add_argument("--recompute-vision", action="store_true", help="also recompute the vision encoder")
    q.add_argument(
        "--placement",
        choices=_placement_names(),
        help="where megatron puts the encoder: llava (first stage, decoder split evenly), chain (encoder and "
        "decoder layers in one chain split evenly), uneven (llava with --first/--last-stage-layers); default "
        "the setup's, else llava (uneven when those counts are given)",
    )
    q.add_argument(
        "--first-stage-layers",
        type=int,
        help="decoder layers on the first stage (megatron, placement uneven)",
    )
    q.add_argument(
        "--last-stage-layers", type=int, help="decoder layers on the last stage (megatron, placement uneven)"
    )
    q.add_argument("--schedule", choices=_schedule_names())
    q.add_argument(
        "--stage-placement",
        choices=_stage_placement_names(),
        help="which rank holds each virtual stage: loop (stage k on rank k mod pp; the default) or v "
        "(V-shaped; schedule v_1f1b by default)",
    )


def _add_plan(sub) -> None:
    q = _command(
        sub,
        "plan",
        "plan a model on a cluster with our policy (a baseline's with --policy); simulate it",
    )
    q.add_argument(
        "--setup", help="a paper configuration (fills the options below): " + ", ".join(_setup_names())
    )
    q.add_argument("--model", help=_MODEL_HELP)
    q.add_argument("--cluster", help="preset: h100x512, a100x32, v100x64, cpu:2, ...")
    q.add_argument(
        "--policy",
        choices=_policy_names(),
        help="default vlmcompile (ours); "
        + "; ".join(f"{name}: {p.summary}" for name, p in _policies().items()),
    )
    q.add_argument(
        "--search", action="store_true", help="let the plan search choose TP/PP/DP/v/microbatch (vlmcompile)"
    )
    q.add_argument(
        "--time-limit",
        type=_positive_float,
        default=None,
        help=f"CP-SAT time limit in seconds (vlmcompile; default 10, with --search {SEARCH_TIME_LIMIT_S:g} per "
        "candidate it partitions)",
    )
    q.add_argument("--tp", type=_positive_int, help="tensor-parallel size")
    q.add_argument("--pp", type=_positive_int, help="pipeline-parallel size (dp is what the cluster leaves)")
    q.add_argument("--v", type=_positive_int, help="virtual stages per rank (interleaved 1F1B when > 1)")
    q.add_argument("--global-batch", type=_positive_int, help="samples per step")
    q.add_argument("--microbatch-size", type=_positive_int, help="samples per microbatch (default 1)")
    q.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 1),
        help="ZeRO stage (0: optimizer states whole on every data-parallel rank, 1: sharded over them); "
        "default: 1 on GPU clusters at DP > 1, else 0",
    )
    _add_layout_flags(q)
    q.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        help="parameter and activation dtype (default: bf16 for a zoo model; a function's model keeps its own)",
    )
    q.add_argument(
        "--freeze",
        type=_names,
        action="extend",
        metavar="NAMES",
        help="plan with these parameters frozen (requires_grad=False), as a recipe freezes them: regions "
        "(vision, projector, llm, head) or module paths, comma-separated, e.g. vision or vision,llm,head "
        "(LLaVA's first stage); every policy gets the same freezing",
    )
    train_command.data_arguments(
        q,
        _positive_int,
        _positive_float,
        "plan for samples of these sizes, packed (--global-batch: samples a step)",
    )
    q.add_argument("--json", metavar="FILE", help="write the plan and the simulation as JSON")
    q.add_argument("--trace", metavar="FILE", help="write a Chrome trace (Perfetto) of the simulated step")
    q.add_argument("--png", metavar="FILE", help="write a PNG timeline of the simulated step")
    q.set_defaults(run=_plan)


def _add_demo(sub) -> None:
    d = _command(
        sub,
        "demo",
        "compile the demo VLM for 2 CPU ranks; run our plan and the baselines'; measured vs predicted",
        "Compile the demo VLM for 2 local CPU ranks, run eager training and our plan and the "
        "baselines' (Megatron-LM, its balanced variant, Megatron MIMO's colocated layout) on the same "
        "runtime, and print measured against predicted step times. The default took 2 min 44 s on 2 idle "
        "cores (load 0.5) and 7 min 45 s at load 2-5 (measured 2026-11-28); --full trains 4x the samples a step. "
        "Progress goes to stderr as it happens, a line at least every 15 s.",
    )
    d.add_argument(
        "--model",
        default="demo",
        help=_MODEL_HELP + "; a function's model trains its own sample batch (default demo)",
    )
    size = d.add_mutually_exclusive_group()
    size.add_argument(
        "--global-batch", type=_positive_int, help="samples per step (default 8, 32 with --full)"
    )
    size.add_argument(
        "--full",
        action="store_true",
        help="the full-size demo: global batch 32, the size of the batch-32 table in docs/benchmarks.md (4x the default's samples a step)",
    )
    d.add_argument(
        "--steps",
        type=_positive_int,
        default=6,
        help="training steps per plan, the first a warm-up (default 6, the fewest)",
    )
    d.add_argument(
        "--memory-cap",
        type=_memory_cap,
        metavar="SIZE",
        help="hold every plan to this memory per rank, as on a GPU the model does not fit whole: a size "
        "(2GiB, 512MiB) or a fraction of what one rank needs to train the whole model alone (0.6); a "
        "baseline that does not fit is reported, not run",
    )
    d.add_argument(
        "--freeze",
        type=_names,
        action="extend",
        metavar="NAMES",
        help="freeze these regions or module paths (requires_grad=False) before compiling, e.g. vision",
    )
    d.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    d.set_defaults(run=_demo)


def _add_run(sub) -> None:
    r = _command(sub, "run", "compile a model for N local CPU ranks and train a few steps on them")
    r.add_argument("--model", default="demo", help=_MODEL_HELP + " (default demo)")
    r.add_argument("--nprocs", type=_positive_int, default=2, help="local ranks, one thread each (default 2)")
    r.add_argument("--policy", choices=_policy_names(), default="vlmcompile")
    r.add_argument(
        "--pp", type=_positive_int, default=2, help="pipeline size for the baseline policies (default 2)"
    )
    r.add_argument("--global-batch", type=_positive_int, default=8)
    r.add_argument("--steps", type=_positive_int, default=3)
    r.add_argument("--lr", type=_positive_float, default=1e-3, help="SGD learning rate")
    r.add_argument(
        "--timeout", type=_positive_float, default=120.0, help="seconds any rank may wait for another"
    )
    r.set_defaults(run=_run)


def _add_train(sub) -> None:
    t = _command(
        sub,
        "train",
        "train a saved plan (of a zoo model or your own): AdamW, LR schedule, clipping, checkpoints, metrics; under "
        "torchrun (torchrun --nproc-per-node N -m vlmcompile train --plan FILE) or on local ranks",
    )
    train_command.add_arguments(
        t, _positive_int, _positive_float, non_negative_float=_non_negative_float, names=_names
    )
    t.set_defaults(run=train_command.run)


def parser() -> argparse.ArgumentParser:
    """Every command and its flags."""
    top = argparse.ArgumentParser(
        prog="vlmcompile", description=_plain(__doc__), formatter_class=_HelpFormatter
    )
    sub = top.add_subparsers(dest="command", required=True)
    for add in (_add_annotate, _add_plan, _add_demo, _add_run, _add_train):
        add(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from vlmcompile.ir.errors import VlmCompileError
    from vlmcompile.runtime.launch import Interrupted, interrupt_on_stop_signals, restore_signals
    from vlmcompile.train_command import rank_prefix

    previous = interrupt_on_stop_signals()
    try:
        _check_output_paths(args)
        return args.run(args)
    except Interrupted as err:
        done = "stopped at once, without saving" if train_command.under_torchrun() else "stopped every rank"
        print(f"vlmcompile: {rank_prefix()}interrupted by {err.signal_name}; {done}", file=sys.stderr)
        return 128 + int(getattr(signal, err.signal_name))
    except (VlmCompileError, ValueError, KeyError, OSError) as err:
        print(f"vlmcompile: {rank_prefix()}error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a bug: one line, and the traceback on request
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(
            f"vlmcompile: {rank_prefix()}internal error: {type(err).__name__}: {err} - a bug in vlmcompile; please report it "
            "with the command (VLMCOMPILE_TRACEBACK=1 shows the traceback)",
            file=sys.stderr,
        )
        return 70
    finally:
        restore_signals(previous)


if __name__ == "__main__":
    sys.exit(main())
