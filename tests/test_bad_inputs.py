"""Every class of bad input we tried, on the CLI, the API, plan files and batches: each ends in
a one-line message naming the value at fault (never a Python traceback at a CLI user).

``CASES`` is the table of ``tests/README.md`` (``python -m tests.test_bad_inputs`` rewrites it):
each row's message is an excerpt the test asserts in what the user sees. ``ELSEWHERE`` lists the
classes covered by tests in other files (faults, signals, fuzzing); the table test checks that
each of those tests exists.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.pipeline_helpers import even_plan

TESTS = Path(__file__).parent
README = TESTS / "README.md"
BEGIN, END = "<!-- bad_inputs:begin -->", "<!-- bad_inputs:end -->"


@dataclass(frozen=True)
class Case:
    area: str
    what: str
    run: Callable[[Path], object]
    """Does the bad thing; gets a scratch folder."""
    message: str
    """An excerpt of what the user sees."""


# ---- helpers -------------------------------------------------------------------------------
def cli(*argv: str) -> Callable[[Path], object]:
    """Run the CLI in this process; the output the user would see is raised as a CliOutput."""

    def run(tmp: Path):
        from vlmcompile.cli import main

        err = io.StringIO()
        args = [a.replace("{tmp}", str(tmp)) for a in argv]
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(args)
            except SystemExit as exit_:  # argparse's usage errors
                code = exit_.code
        raise CliOutput(code, err.getvalue())

    return run


def cli_train(*argv: str) -> Callable[[Path], object]:
    """``vlmcompile train --plan {tmp}/plan.json ...`` with the tiny model's 2-rank plan."""

    def run(tmp: Path):
        (tmp / "plan.json").write_text(json.dumps(_plan_json()))
        return cli("train", "--plan", "{tmp}/plan.json", "--model", "tiny", *argv)(tmp)

    return run


class CliOutput(Exception):
    def __init__(self, code, stderr: str):
        super().__init__(stderr)
        self.code, self.stderr = code, stderr


def _tiny(batch_size: int = 4, device: str = "cpu"):
    from vlmcompile import models

    return models.build("tiny", device=device), models.sample_batch(
        "tiny", batch_size=batch_size, device=device
    )


def compile_with(**kwargs) -> Callable[[Path], object]:
    def run(tmp: Path):
        from vlmcompile import compile

        model, batch = _tiny(device="meta")
        return compile(model, batch, log=None, **kwargs)

    return run


def compile_batch(change: Callable[[dict], object], device: str = "cpu") -> Callable[[Path], object]:
    def run(tmp: Path):
        from vlmcompile import compile

        model, batch = _tiny(device=device)
        return compile(model, change(dict(batch)), log=None)

    return run


class _Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = nn.Linear(8, 8)
        self.llm = nn.Linear(8, 5)

    def forward(self, x):
        return self.llm(self.vision(x))


class _OddNames(nn.Module):
    """Layers whose names say nothing of their region; the forward returns logits."""

    def __init__(self):
        super().__init__()
        self.front = nn.Linear(8, 8)
        self.back = nn.Linear(8, 5)

    def forward(self, feats, ids):
        return self.back(self.front(feats))


def _llava_batch_keyed(key: str):
    """A tiny transformers LLaVA and its batch with ``pixel_values`` under another key."""
    from vlmcompile import families

    def run(tmp: Path):
        from vlmcompile import compile

        model, batch = families.build_tiny("llava")
        batch[key] = batch.pop("pixel_values")
        return compile(model, batch, log=None)

    return run


def _config_over_earlier_run(tmp: Path):
    from vlmcompile import TrainConfig

    (tmp / "ckpt" / "step_000004").mkdir(parents=True)
    return TrainConfig(steps=2, checkpoint_dir=str(tmp / "ckpt"))


class _NoParams(nn.Module):
    def forward(self, x):
        return x.sum()


def compile_model(model_fn: Callable[[], object], batch: Callable[[], object]):
    def run(tmp: Path):
        from vlmcompile import compile

        return compile(model_fn(), batch(), log=None, region_overrides={"vision": "vision", "llm": "llm"})

    return run


_PIPE = {}


def _pipe():
    if "pipe" not in _PIPE:
        from vlmcompile import compile

        model, batch = _tiny()
        _PIPE["pipe"] = compile(model, batch, log=None)
        _PIPE["batch"] = batch
    return _PIPE["pipe"], _PIPE["batch"]


def _train_tiny(cap_bytes: float | None = None, **options):
    """``pipe.train`` of the tiny model's 2-stage plan, one step, with ``options`` (``cap_bytes``:
    the pipeline's cluster given that much memory a rank)."""
    import dataclasses

    from vlmcompile import TrainConfig
    from vlmcompile.cost_models.cluster import Cluster

    pipe, batch = _pipe()
    if cap_bytes is not None:
        pipe = dataclasses.replace(pipe, cluster=Cluster.preset("cpu:2").with_memory_cap(cap_bytes))
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)
    return pipe.train([batch], TrainConfig(steps=1), plan=plan, timeout_s=20, **options)


def _plan_json():
    pipe, _ = _pipe()
    return even_plan(pipe.layer_graph, pp=2, global_batch=4).to_json()


def plan_file(change: Callable[[dict], object] | None = None, text: str | None = None, run: bool = False):
    """Write a plan file (the tiny model's 2-stage plan, changed), load it and make a runner."""

    def go(tmp: Path):
        from vlmcompile.ir.plan import Plan

        path = tmp / "plan.json"
        if text is not None:
            path.write_text(text)
        else:
            data = _plan_json()
            change(data)
            path.write_text(json.dumps(data))
        plan = Plan.load(path)
        pipe, batch = _pipe()
        if run:
            return pipe.launch(plan=plan, timeout_s=20)
        return pipe.runner(plan)

    return go


def _frozen_pipe():
    """The tiny model with its vision encoder frozen (LLaVA's recipe), compiled."""
    if "frozen" not in _PIPE:
        from vlmcompile import compile

        model, batch = _tiny()
        model.encoders.requires_grad_(False)
        _PIPE["frozen"] = compile(model, batch, log=None)
    return _PIPE["frozen"]


def _encoder_alone(layer_graph):
    from tests.pipeline_helpers import encoder_on_rank_1

    return encoder_on_rank_1(layer_graph, global_batch=4)


def _trained_plan_on_frozen_model(tmp: Path):
    """A plan made while the encoder trained (its stage runs backward actions), run after freezing it."""
    pipe, _ = _pipe()
    return _frozen_pipe().runner(_encoder_alone(pipe.layer_graph))


def _frozen_plan_on_trained_model(tmp: Path):
    pipe, _ = _pipe()
    return pipe.runner(_encoder_alone(_frozen_pipe().layer_graph))


def _run_ahead_on_trainable_encoder(tmp: Path):
    """A run-ahead plan made for the frozen encoder, its JSON run on the model whose encoder trains."""
    from tests.pipeline_helpers import run_ahead_plan
    from vlmcompile.ir.plan import Plan

    plan = run_ahead_plan(_frozen_pipe().layer_graph, global_batch=4, ahead=2)
    plan.save(tmp / "ahead.json")
    pipe, _ = _pipe()
    return pipe.runner(Plan.load(tmp / "ahead.json"))


def _load_missing_plan(tmp: Path):
    from vlmcompile.ir.plan import Plan

    return Plan.load(tmp / "none.json")


def launch_batch(change: Callable[[dict], object]) -> Callable[[Path], object]:
    def run(tmp: Path):
        from vlmcompile.runtime.timed_steps import one_step

        pipe, batch = _pipe()
        plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)
        return pipe.launch(one_step, plan=plan, args=(change(dict(batch)),), timeout_s=20)

    return run


def _set(key, value):
    def change(d):
        d[key] = value
        return d

    return change


def _stage_rank(d):
    d["stages"][1]["rank"] = 5


def _delete_action(d):
    d["actions"][1].pop(2)


def _swap_lists(d):
    d["actions"].reverse()


def _dp_500(d):
    d["parallel"]["model"]["dp"] = 500
    d["cluster"] = "cpu:1000"  # as the plan's own cluster, so that the launcher's limit is what refuses it


def _deadlock(d):
    d["actions"][0].reverse()


def _other_model(d):
    d["fingerprint"] = "0123456789abcdef"


def _labels_all_ignored(b):
    b["labels"] = torch.full_like(b["labels"], -100)
    return b


def _nan_pixels(b):
    b["pixel_values"] = b["pixel_values"].clone()
    b["pixel_values"][0, 0, 0, 0] = float("nan")
    return b


def _pixels_half(b):
    b["pixel_values"] = b["pixel_values"][:2]
    return b


def _drop_labels(b):
    b.pop("labels")
    return b


def _extra_key(b):
    b["token_type_ids"] = torch.ones_like(b["input_ids"])
    return b


def _launch_api(**kwargs):
    def run(tmp):
        pipe, _ = _pipe()
        return pipe.launch(plan=even_plan(pipe.layer_graph, pp=2, global_batch=4), **kwargs)

    return run


def with_files(files: dict[str, str], run: Callable[[Path], object]) -> Callable[[Path], object]:
    """``run`` after writing ``files`` (name -> text) into the scratch folder."""

    def go(tmp: Path):
        for name, text in files.items():
            (tmp / name).write_text(text)
        return run(tmp)

    return go


def _manifest(count: int, long_line: int | None = None, huge_line: int | None = None, seed: int = 0) -> str:
    """A manifest of ``count`` samples of 12-50 text tokens and 0-2 images; line ``long_line`` a
    text of 400 tokens, line ``huge_line`` one of 100,000,000."""
    import random

    rng = random.Random(seed)
    rows = []
    for n in range(1, count + 1):
        row = {"text_tokens": rng.randint(12, 50), "images": [[336, 336]] * rng.randint(0, 2)}
        if n in (long_line, huge_line):
            row = {"text_tokens": 400 if n == long_line else 100_000_000}
        rows.append(json.dumps(row))
    return "\n".join(rows) + "\n"


TINY_PLAN = ["plan", "--model", "tiny", "--cluster", "cpu:2", "--tp", "1", "--pp", "2"]


def packed_train(*argv: str) -> Callable[[Path], object]:
    """``vlmcompile train --plan {tmp}/packed.json ...``: a plan of the tiny model for 8 samples a
    step of a 40-sample manifest ({tmp}/good.jsonl), planned once per test session."""

    def run(tmp: Path):
        (tmp / "good.jsonl").write_text(_manifest(40))
        if "packed" not in _PIPE:
            from vlmcompile.cli import main

            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                code = main(
                    [
                        *TINY_PLAN,
                        "--global-batch",
                        "8",
                        "--data",
                        str(tmp / "good.jsonl"),
                        "--json",
                        str(tmp / "p.json"),
                    ]
                )
            assert code == 0
            _PIPE["packed"] = (tmp / "p.json").read_text()
        (tmp / "packed.json").write_text(_PIPE["packed"])
        return cli("train", "--plan", "{tmp}/packed.json", *argv)(tmp)

    return run


def _plan_for_frozen_encoder_on_trained_model(tmp: Path):
    """A two-stage plan made with the vision encoder frozen, run on the model whose encoder trains."""
    pipe, _ = _pipe()
    return pipe.runner(even_plan(_frozen_pipe().layer_graph, pp=2, global_batch=4))


def _requires_grad_changed_after_compile(tmp: Path):
    from vlmcompile import compile

    model, batch = _tiny()
    pipe = compile(model, batch, log=None)
    model.encoders.requires_grad_(False)
    return pipe.runner(even_plan(pipe.layer_graph, pp=2, global_batch=4))


def _train_config(**options):
    def run(tmp: Path):
        from vlmcompile.runtime.train_loop import TrainConfig

        return TrainConfig(steps=1, **options)

    return run


def _negative_sizes(tmp: Path):
    import numpy as np

    from vlmcompile.data.balance import SampleSizes

    return SampleSizes(np.asarray([5, -3]), np.asarray([1, 1]))


PLAN = ["plan", "--model", "demo", "--cluster", "h100x8", "--tp", "1", "--pp", "2", "--global-batch", "8"]

CASES = {
    # ---- CLI -----------------------------------------------------------------------------------
    "cli-unknown-command": Case("CLI", "unknown subcommand", cli("fly"), "invalid choice: 'fly'"),
    "cli-train-plan-missing": Case(
        "CLI",
        "train with a plan file that does not exist",
        cli("train", "--plan", "{tmp}/nope.json"),
        "nope.json",
    ),
    "cli-train-plan-not-json": Case(
        "CLI", "train with a plan file that is not JSON", cli("train", "--plan", __file__), "is not JSON"
    ),
    "cli-train-steps-0": Case(
        "CLI", "train --steps 0", cli("train", "--plan", "p.json", "--steps", "0"), "--steps: 0 is not >= 1"
    ),
    "cli-unknown-model": Case(
        "CLI", "unknown zoo model", cli("annotate", "--model", "gpt-9"), "unknown model 'gpt-9'"
    ),
    "cli-missing-flag": Case(
        "CLI",
        "plan without --cluster",
        cli("plan", "--model", "demo", "--tp", "1", "--pp", "2", "--global-batch", "8"),
        "missing --cluster",
    ),
    "cli-unknown-cluster": Case(
        "CLI",
        "unknown cluster preset",
        cli(*PLAN[:4], "tpu9000", *PLAN[5:]),
        "unknown cluster preset 'tpu9000'",
    ),
    "cli-global-batch-0": Case(
        "CLI", "--global-batch 0", cli(*PLAN[:-1], "0"), "--global-batch: 0 is not >= 1"
    ),
    "cli-global-batch-negative": Case(
        "CLI", "--global-batch -4", cli(*PLAN[:-1], "-4"), "--global-batch: -4 is not >= 1"
    ),
    "cli-global-batch-text": Case(
        "CLI", "--global-batch abc", cli(*PLAN[:-1], "abc"), "--global-batch: 'abc' is not an integer"
    ),
    "cli-tp-0": Case("CLI", "--tp 0", cli(*PLAN[:5], "--tp", "0", *PLAN[7:]), "--tp: 0 is not >= 1"),
    "cli-v-0": Case("CLI", "--v 0", cli(*PLAN, "--v", "0"), "--v: 0 is not >= 1"),
    "cli-time-limit-nan": Case(
        "CLI", "--time-limit nan", cli(*PLAN, "--time-limit", "nan"), "--time-limit: nan is not a number > 0"
    ),
    "cli-search-with-policy": Case(
        "CLI",
        "--search with --policy megatron",
        cli(*PLAN, "--search", "--policy", "megatron"),
        "--search plans with the vlmcompile policy; drop --policy megatron",
    ),
    "cli-placement-unknown": Case(
        "CLI",
        "unknown --placement",
        cli(*PLAN, "--policy", "megatron", "--placement", "ring"),
        "argument --placement: invalid choice: 'ring' (choose from 'llava', 'chain', 'uneven')",
    ),
    "cli-placement-chain-too-many-stages": Case(
        "CLI",
        "--placement chain with more virtual stages than layers",
        cli(*PLAN[:8], "4", *PLAN[9:], "--v", "4", "--policy", "megatron", "--placement", "chain"),
        "placement 'chain' splits 12 encoder and decoder layers over pp x v = 4 x 4 = 16 virtual stages",
    ),
    "cli-placement-uneven-without-counts": Case(
        "CLI",
        "--placement uneven without stage counts",
        cli(*PLAN, "--policy", "megatron", "--placement", "uneven"),
        "placement 'uneven' needs first_stage_layers and/or last_stage_layers",
    ),
    "cli-mimo-with-pipeline": Case(
        "CLI",
        "--policy mimo_colocated with --pp 2",
        cli(*PLAN, "--policy", "mimo_colocated"),
        "mimo_colocated runs every module on every rank without a pipeline",
    ),
    "cli-torchtitan-knob-out-of-range": Case(
        "CLI",
        "torchtitan's split over more stages than layers",
        cli(*PLAN[:8], "8", *PLAN[9:], "--v", "2", "--policy", "torchtitan_vlm"),
        "torchtitan splits 8 layers + 0 + 1 (embedding, output) over 16 stages",
    ),
    "cli-unknown-setup": Case(
        "CLI", "unknown --setup", cli("plan", "--setup", "optimus-weak-Z"), "unknown setup 'optimus-weak-Z'"
    ),
    "cli-indivisible-batch": Case(
        "CLI",
        "global batch not a multiple of DP x microbatch",
        cli(*PLAN[:-1], "9"),
        "global batch 9 is not a multiple of dp x microbatch size",
    ),
    "cli-json-missing-dir": Case(
        "CLI",
        "--json into a missing folder",
        cli(*PLAN, "--json", "{tmp}/no/such/plan.json"),
        "which does not exist; create it first",
    ),
    "cli-png-under-a-file": Case(
        "CLI",
        "--png under a regular file",
        lambda tmp: (tmp / "afile").touch() or cli(*PLAN, "--png", "{tmp}/afile/x.png")(tmp),
        "afile', which is a file, not a folder",
    ),
    "cli-model-no-module": Case(
        "CLI",
        "--model pkg.module:function whose module is nowhere",
        cli("plan", "--model", "no_such_vlm:build", "--cluster", "cpu:2", "--search"),
        "no module 'no_such_vlm' in",
    ),
    "cli-model-function-misnamed": Case(
        "CLI",
        "--model naming a function the module lacks",
        cli("plan", "--model", "tests.user_code.my_qwen:build_modle", "--cluster", "cpu:2", "--search"),
        "has no function 'build_modle'; did you mean tests.user_code.my_qwen:build_model?",
    ),
    "cli-model-returns-samples": Case(
        "CLI",
        "--model naming a function that returns no model",
        cli("plan", "--model", "tests.user_code.my_qwen:samples", "--cluster", "cpu:2", "--search"),
        "returned a list; return the model (an nn.Module), or (model, sample_batch)",
    ),
    "cli-png-is-dir": Case(
        "CLI", "--png naming a folder", cli(*PLAN, "--png", "{tmp}"), "is a directory; give a file name"
    ),
    "cli-trace-missing-dir": Case(
        "CLI",
        "--trace into a missing folder",
        cli(*PLAN, "--trace", "{tmp}/none/t.json"),
        "which does not exist; create it first",
    ),
    "cli-annotate-json-dir": Case(
        "CLI",
        "annotate --json naming a folder",
        cli("annotate", "--model", "tiny", "--json", "{tmp}"),
        "is a directory; give a file name",
    ),
    "cli-freeze-unknown": Case(
        "CLI",
        "--freeze a module the model does not have",
        cli(*PLAN, "--freeze", "vision,encoders.0.blokcs"),
        "'encoders.0.blokcs' names no layer of demo: give a region (head, llm, projector, vision)",
    ),
    "cli-freeze-empty": Case("CLI", "--freeze ','", cli(*PLAN, "--freeze", ","), "',' names nothing"),
    "cli-demo-memory-cap-text": Case(
        "CLI",
        "demo --memory-cap that is neither a size nor a fraction",
        cli("demo", "--memory-cap", "2 apples"),
        "memory cap '2 apples': give a size per rank (2GiB, 512MiB) or a positive fraction",
    ),
    "cli-demo-freeze-unknown": Case(
        "CLI",
        "demo --freeze a module the model does not have",
        cli("demo", "--global-batch", "2", "--freeze", "visoin"),
        "'visoin' names no layer of demo",
    ),
    "cli-run-steps-0": Case("CLI", "run --steps 0", cli("run", "--steps", "0"), "--steps: 0 is not >= 1"),
    "cli-run-timeout-0": Case(
        "CLI", "run --timeout 0", cli("run", "--timeout", "0"), "--timeout: 0 is not a number > 0"
    ),
    "cli-run-too-many-ranks": Case(
        "CLI",
        "run --nprocs 1000",
        cli("run", "--nprocs", "1000"),
        "nprocs=1000 local ranks is more than this launcher starts",
    ),
    "cli-run-pp-not-dividing": Case(
        "CLI",
        "run --pp 3 on 2 ranks",
        cli("run", "--model", "tiny", "--policy", "megatron", "--pp", "3", "--global-batch", "4"),
        "--pp 3 does not divide --nprocs 2",
    ),
    "cli-demo-batch-0": Case(
        "CLI", "demo --global-batch 0", cli("demo", "--global-batch", "0"), "--global-batch: 0 is not >= 1"
    ),
    "cli-train-log-missing-dir": Case(
        "CLI",
        "train --log-jsonl into a missing folder (found before capture)",
        cli_train("--log-jsonl", "{tmp}/nope/steps.jsonl"),
        "nope', which does not exist; create it first",
    ),
    "cli-train-checkpoint-dir-unwritable": Case(
        "CLI",
        "train --checkpoint-dir that cannot be created (found before capture)",
        cli_train("--checkpoint-dir", "{tmp}/plan.json/ckpt"),
        "plan.json/ckpt cannot be created (Not a directory); choose another",
    ),
    "cli-train-resume-and-overwrite": Case(
        "CLI",
        "train --resume --overwrite",
        cli_train("--checkpoint-dir", "{tmp}/ckpt", "--resume", "--overwrite"),
        "argument --overwrite: not allowed with argument --resume",
    ),
    # ---- API: compile ----------------------------------------------------------------------------
    "api-model-not-module": Case(
        "API",
        "model is not an nn.Module",
        compile_model(lambda: "llava", lambda: {"x": torch.ones(1)}),
        "model is a str; give a torch.nn.Module",
    ),
    "api-batch-key-misnamed": Case(
        "API",
        "a LLaVA batch keyed 'images' (found before capture)",
        _llava_batch_keyed("images"),
        "sample_batch key 'images' is no argument of LlavaForConditionalGeneration.forward: did you mean "
        "'pixel_values'?",
    ),
    "api-returns-logits-odd-names": Case(
        "API",
        "forward returns logits, layer names unfamiliar (named before region detection)",
        lambda tmp: __import__("vlmcompile").compile(
            _OddNames(), {"feats": torch.ones(2, 8), "ids": torch.ones(2, dtype=torch.long)}, log=None
        ),
        "returned a [2, 5] torch.float32 tensor, not a scalar loss",
    ),
    "api-checkpoint-dir-held": Case(
        "API",
        "TrainConfig over an earlier run's checkpoints (found when made, before compile)",
        _config_over_earlier_run,
        "holds checkpoints of an earlier run (steps 4)",
    ),
    "api-train-fp16": Case(
        "API",
        "pipe.train(autocast_dtype=torch.float16): fp16 without a gradient scaler (before any rank starts)",
        lambda tmp: _train_tiny(autocast_dtype=torch.float16),
        "fp16 gradients underflow without a gradient scaler, which the runtime does not run; train in "
        "torch.bfloat16",
    ),
    "api-train-over-memory": Case(
        "API",
        "pipe.train of a plan predicted over a rank's memory as the runtime holds it (before any rank starts)",
        lambda tmp: _train_tiny(cap_bytes=400 * 1024),
        "as the runtime trains this plan (fp32), over the 380.00 KiB a rank of cpu:2 may hold (its 400.00 KiB "
        "less the 5% reserve): plan again with more pipeline stages, recompute or ZeRO-1",
    ),
    "api-model-no-params": Case(
        "API",
        "model without parameters",
        compile_model(_NoParams, lambda: {"x": torch.ones(2, 8)}),
        "has no parameters",
    ),
    "api-returns-logits": Case(
        "API",
        "forward returns logits, not a loss (real weights)",
        compile_model(_Logits, lambda: {"x": torch.ones(2, 8)}),
        "returned a [2, 5] torch.float32 tensor, not a scalar loss",
    ),
    "api-returns-logits-meta": Case(
        "API",
        "forward returns logits, not a loss (meta)",
        compile_model(lambda: _Logits().to("meta"), lambda: {"x": torch.ones(2, 8, device="meta")}),
        "not a scalar loss",
    ),
    "api-batch-not-mapping": Case(
        "API",
        "sample batch is a list",
        compile_batch(lambda b: list(b.values())),
        "the sample batch is a list of Tensor; give a dict of the model's inputs",
    ),
    "api-batch-missing-key": Case(
        "API",
        "sample batch lacks a forward argument",
        compile_batch(_drop_labels),
        "sample_batch lacks ['labels']",
    ),
    "api-batch-unknown-key": Case(
        "API", "sample batch has a key forward does not take", compile_batch(_extra_key), "token_type_ids"
    ),
    "api-batch-nan": Case(
        "API",
        "NaN in the sample batch",
        compile_batch(_nan_pixels),
        "sample_batch['pixel_values'] hold NaN or infinite values",
    ),
    "api-eager-loss-nan": Case(
        "API",
        "eager loss is NaN (every label ignored)",
        compile_batch(_labels_all_ignored),
        "in eager PyTorch, before any change by vlmcompile",
    ),
    "api-capture-method": Case(
        "API",
        "capture_method='bogus'",
        compile_with(capture_method="bogus"),
        "capture_method='bogus'; use 'auto', 'fx' or 'export'",
    ),
    "api-disable-capture": Case(
        "API",
        "disable_passes=['capture']",
        compile_with(disable_passes=["capture"]),
        "['capture'] cannot be disabled",
    ),
    "api-disable-unknown": Case(
        "API",
        "disable_passes names no pass",
        compile_with(disable_passes=["partition2"]),
        "cannot disable unknown pass(es) ['partition2']",
    ),
    "api-disable-string": Case(
        "API",
        "disable_passes='plan' (a string)",
        compile_with(disable_passes="plan"),
        "is a string; give a list",
    ),
    "api-cluster-int": Case(
        "API", "cluster=2", compile_with(cluster=2), "cluster=2 is a int; pass a Cluster or a preset name"
    ),
    "api-cluster-unknown": Case(
        "API", "cluster='gpu:4'", compile_with(cluster="gpu:4"), "unknown cluster preset 'gpu:4'"
    ),
    "api-global-batch-0": Case(
        "API",
        "global_batch=0",
        compile_with(cluster="cpu:2", global_batch=0),
        "global_batch=0; give the samples per training step",
    ),
    "api-global-batch-negative": Case(
        "API",
        "global_batch=-8",
        compile_with(cluster="cpu:2", global_batch=-8),
        "global_batch=-8; give the samples per training step",
    ),
    "api-tensor-mode": Case(
        "API",
        "tensor_mode='half'",
        compile_with(tensor_mode="half"),
        "tensor_mode='half'; use 'fake' or 'real'",
    ),
    "api-solver-number": Case(
        "API",
        "solver=3 (seconds, not SolverOptions)",
        compile_with(solver=3),
        "solver=3 is a int; pass SolverOptions(time_limit_s=..., workers=...)",
    ),
    "api-launch-timeout-0": Case(
        "API",
        "launch(timeout_s=0)",
        _launch_api(timeout_s=0),
        "timeout_s=0; give the seconds a rank may wait",
    ),
    "api-launch-nprocs": Case(
        "API", "launch(nprocs=3) for a 2-rank plan", _launch_api(nprocs=3), "the plan runs on 2 ranks"
    ),
    "cli-train-freeze-contradicts-plan": Case(
        "CLI",
        "train --freeze naming other layers than the plan keeps frozen",
        cli_train("--freeze", "vision", "--steps", "1"),
        "--freeze vision names 4 layers with parameters (encoders.0.embed .. encoders.0.norm), but the plan "
        "trains every layer",
    ),
    "cli-train-weight-decay-nan": Case(
        "CLI",
        "train --weight-decay nan",
        cli_train("--weight-decay", "nan"),
        "--weight-decay: nan is not a finite number >= 0",
    ),
    "cli-train-global-batch-over-plan": Case(
        "CLI",
        "train --global-batch 32 with a plan whose microbatches hold 8 samples of the data (found before any rank starts)",
        packed_train("--data", "{tmp}/good.jsonl", "--global-batch", "32", "--steps", "8"),
        "cannot hold 32 samples a step of this data",
    ),
    "cli-train-tokens-contradict-plan": Case(
        "CLI",
        "train --tokens-per-microbatch other than the plan's",
        packed_train("--data", "{tmp}/good.jsonl", "--tokens-per-microbatch", "128"),
        "--tokens-per-microbatch 128 contradicts the plan, made for microbatches of 64 LLM tokens",
    ),
    "cli-train-packed-plan-without-data": Case(
        "CLI",
        "train a plan made for packed data without --data",
        packed_train("--steps", "1"),
        "was made for packed samples of varying shapes (vlmcompile plan --data ...): give the data",
    ),
    "cli-train-data-on-one-shape-plan": Case(
        "CLI",
        "train --data with a plan made for batches of one shape",
        cli_train("--data", "synthetic:interleaved", "--steps", "1"),
        "was made for batches of one shape; to train on --data, plan for it",
    ),
    "cli-plan-fewer-samples-than-batch": Case(
        "CLI",
        "plan --data with fewer samples than --global-batch (train refuses it alike)",
        with_files(
            {"three.jsonl": _manifest(3)},
            cli(*TINY_PLAN, "--global-batch", "8", "--data", "{tmp}/three.jsonl"),
        ),
        "the dataset holds 3 samples, fewer than global_batch=8",
    ),
    "cli-plan-huge-sample": Case(
        "CLI",
        "a manifest line of 100,000,000 text tokens (named before anything is built)",
        with_files(
            {"huge.jsonl": _manifest(8, huge_line=6)},
            cli(*TINY_PLAN, "--global-batch", "4", "--data", "{tmp}/huge.jsonl"),
        ),
        "huge.jsonl:6) makes microbatches of 100000000 LLM tokens, whose attention mask alone takes",
    ),
    "cli-train-late-long-sample": Case(
        "CLI",
        "a sample over the plan's token budget late in the data (found before any rank starts)",
        with_files(
            {"late.jsonl": _manifest(50, long_line=48)},
            packed_train("--data", "{tmp}/late.jsonl", "--steps", "1"),
        ),
        "late.jsonl:48) takes 400 LLM tokens, more than a microbatch's 64",
    ),
    "api-plan-frozen-otherwise": Case(
        "API",
        "a plan made with the vision encoder frozen, run on the model that trains it",
        _plan_for_frozen_encoder_on_trained_model,
        "the plan keeps encoders.0.embed, encoders.0.blocks.0",
    ),
    "api-requires-grad-changed": Case(
        "API",
        "requires_grad changed after compile",
        _requires_grad_changed_after_compile,
        "requires_grad changed since compile for",
    ),
    "api-weight-decay-nan": Case(
        "API",
        "TrainConfig(weight_decay=nan)",
        _train_config(weight_decay=float("nan")),
        "weight_decay=nan; give a finite number, 0 or more",
    ),
    "data-isf-negative-sizes": Case(
        "data",
        "ISF sample sizes that are negative",
        _negative_sizes,
        "llm_tokens[1] is -3: a sample's sizes are counts",
    ),
    # ---- plan files ------------------------------------------------------------------------------
    "plan-missing-file": Case("plan file", "no such file", _load_missing_plan, "cannot read plan file"),
    "plan-not-json": Case("plan file", "not JSON", plan_file(text="{stages: oops"), "is not JSON"),
    "plan-wrong-schema": Case(
        "plan file",
        "JSON of something else",
        plan_file(text='{"schema": "other"}'),
        "not a plan JSON (schema 'other'",
    ),
    "plan-old-version": Case(
        "plan file",
        "another schema version",
        plan_file(_set("version", 0)),
        "plan JSON version 0 is not one this vlmcompile reads",
    ),
    "plan-wrong-type": Case(
        "plan file",
        "a number given as a string",
        plan_file(_set("microbatch_size", "2")),
        'plan.microbatch_size is "2"; expected an integer',
    ),
    "plan-missing-field": Case(
        "plan file", "a field deleted", plan_file(lambda d: d.pop("stages")), "plan lacks the field 'stages'"
    ),
    "plan-bad-action": Case(
        "plan file",
        "an action that is not one",
        plan_file(lambda d: d["actions"][0].__setitem__(0, "0X0")),
        "'0X0' is not an action",
    ),
    "plan-deleted-action": Case(
        "plan file", "an action deleted", plan_file(_delete_action), "rank 1 is missing"
    ),
    "plan-stage-rank": Case(
        "plan file",
        "a stage on a rank that does not exist",
        plan_file(_stage_rank),
        "stage 1 is placed on rank 5, but the plan has 2 pipeline ranks",
    ),
    "plan-swapped-lists": Case(
        "plan file", "action lists of two ranks swapped", plan_file(_swap_lists), "which is placed on rank"
    ),
    "plan-deadlock": Case(
        "plan file", "actions in an order that deadlocks", plan_file(_deadlock), "the action lists deadlock"
    ),
    "plan-dp-500": Case(
        "plan file",
        "dp: 500 (1000 local processes)",
        plan_file(_dp_500, run=True),
        "nprocs=1000 local ranks is more than this launcher starts",
    ),
    "plan-cluster-too-small": Case(
        "plan file",
        'a 2-rank plan edited to `"cluster": "cpu:1"`',
        plan_file(_set("cluster", "cpu:1")),
        "the plan runs on 2 ranks (PP=2 x DP=1), more than the 1 device of cpu:1, the cluster the plan names",
    ),
    "plan-other-model": Case(
        "plan file", "a plan made for another model", plan_file(_other_model), "the plan was made for model"
    ),
    "plan-backward-on-frozen": Case(
        "plan file",
        "a plan that gives a frozen encoder (no gradient reaches it) backward actions",
        _trained_plan_on_frozen_model,
        "stage 0 has backward actions, but no gradient reaches its layers",
    ),
    "plan-no-backward-on-trainable": Case(
        "plan file",
        "a plan that gives a trainable stage no backward actions",
        _frozen_plan_on_trained_model,
        "stage 0 has no backward actions, but its layer encoders.0.embed needs one (it trains)",
    ),
    "plan-run-ahead-on-trainable": Case(
        "plan file",
        "a plan that runs the encoder's forwards a batch ahead, on a model whose encoder trains",
        _run_ahead_on_trainable_encoder,
        "stage 0 has no backward actions, but its layer encoders.0.embed needs one (it trains)",
    ),
    "plan-cli-json": Case(
        "plan file",
        "`vlmcompile plan --json` output with a broken plan",
        plan_file(text='{"plan": {"schema": "vlmcompile.plan", "version": 3}, "simulation": {}}'),
        "plan lacks the field 'model'",
    ),
    # ---- batches ---------------------------------------------------------------------------------
    "batch-shape": Case(
        "batch",
        "a batch of other shapes at launch",
        launch_batch(_pixels_half),
        "batch['pixel_values'] is [2, ",
    ),
    "batch-missing-key": Case(
        "batch", "a batch without labels at launch", launch_batch(_drop_labels), "the batch lacks 'labels'"
    ),
    "batch-extra-key": Case(
        "batch",
        "a batch with a key the sample batch had not",
        launch_batch(_extra_key),
        "the batch has keys ['token_type_ids']",
    ),
}

ELSEWHERE = {
    "isf-dataset-too-small": (
        "data",
        "ISF on a dataset holding less than one balanced mini-batch",
        "tests/data/test_balance.py::test_a_dataset_too_small_for_one_balanced_batch_is_said_and_trains_unbalanced",
        "(IsfWarning) the dataset holds 450 LLM tokens and 3 vision rows in all, less than one balanced mini-batch "
        "needs (...): every epoch is the sampling stage alone, unbalanced",
    ),
    "isf-targets-unmet": (
        "data",
        "ISF targets no group can meet, or samples over them",
        "tests/data/test_balance.py::test_targets_no_group_can_meet_are_refused_or_said",
        "ISF targets: text_floor=5000 must lie in 0..text=4096; (IsfWarning) 20 of 60 samples alone exceed the "
        "targets (...): each trains in a mini-batch of its own",
    ),
    "microbatch-assignment-unknown": (
        "data",
        "an unknown microbatch assignment",
        "tests/data/test_microbatches.py::test_bad_requests_are_refused",
        "unknown microbatch assignment 'lpt'; use one of tokens, greedy, cp-sat",
    ),
    "per-batch-schedule-late": (
        "train",
        "a batch whose re-planning overruns its time limit",
        "tests/planning/test_per_batch.py::test_a_re_planning_over_its_time_limit_runs_the_last_good_schedule_and_is_counted",
        "(no error) the last good schedule runs; StepMetrics.schedule says 'last good' and the scheduler counts it",
    ),
    "per-batch-schedule-impossible": (
        "train",
        "a schedule per batch asked of a plan without an encoder plan of its own",
        "tests/planning/test_per_batch.py::test_re_planning_a_plan_without_an_encoder_plan_of_its_own_is_refused",
        "per_batch_schedule=True: the plan (vlmcompile) gives the encoders no plan of their own to schedule into "
        "bubbles; train with per_batch_schedule=None or False",
    ),
    "train-more-ranks-than-torchrun": (
        "train",
        "a plan for more ranks than torchrun started",
        "tests/test_train_command.py::test_a_plan_for_more_ranks_than_torchrun_started_is_refused",
        "vlmcompile: rank 0: error: the plan in plan.json runs on 4 ranks; torchrun started 2",
    ),
    "train-cuda-plan-without-cuda": (
        "train",
        "a plan made for GPUs on a machine without CUDA",
        "tests/test_train_command.py::test_a_cuda_plan_without_cuda_is_refused_and_runs_on_cpu_when_asked",
        "made for h100x2 and asks for CUDA, but this machine has none; run it on CPU ranks with --device cpu",
    ),
    "train-rank-killed": (
        "train",
        "a torchrun worker killed mid-run",
        "tests/test_train_command.py::test_a_rank_killed_mid_run_ends_the_job_within_the_timeout_naming_it",
        "(torchrun ends the job and names it) rank: 1 ... Signal 9 (SIGKILL)",
    ),
    "train-checkpoint-other-model": (
        "train",
        "resuming from a checkpoint of another model",
        "tests/runtime/test_train_loop.py::test_a_checkpoint_of_another_model_names_the_parameters_that_differ",
        "the checkpoint ... is not of this model: N parameters missing from it (the first five named)",
    ),
    "train-checkpoint-larger-model": (
        "train",
        "resuming from a checkpoint of a larger model (it holds all this model's tensors and more)",
        "tests/runtime/test_train_loop.py::test_a_checkpoint_of_another_model_names_the_parameters_that_differ",
        "is not of this model: N tensors the model does not have (encoders.1....",
    ),
    "train-resume-other-schedule": (
        "train",
        "resuming under another LR schedule (--lr, --steps, --warmup-steps, --decay changed)",
        "tests/runtime/test_train_loop.py::test_a_run_resumed_under_another_lr_schedule_is_refused_naming_what_changed",
        "was trained with another LR schedule: decay_steps 4 (now 6), lr 0.0001 (now 0.001)",
    ),
    "train-gpu-without-torchrun": (
        "train",
        "train(device='cuda') without torchrun",
        "tests/runtime/test_train_loop.py::test_training_on_gpus_without_torchrun_says_to_use_it",
        "to train on GPUs start one process per GPU with torchrun",
    ),
    "train-latest-stale": (
        "train",
        "a `latest` pointer naming a missing or an older step, or none",
        "tests/runtime/test_checkpoint.py::test_the_newest_checkpoint_is_found_whatever_latest_says",
        "resuming from step 6: .../step_000006 is the newest checkpoint in ... (latest names step_000008, which is not there)",
    ),
    "train-existing-checkpoints": (
        "train",
        "a run into a directory holding another run's checkpoints, without --resume",
        "tests/test_train_command.py::test_a_second_run_into_a_directory_holding_checkpoints_is_refused_and_overwrite_starts_again",
        "holds checkpoints of an earlier run (steps 2, 4): continue it with --resume (resume=True), or start again with --overwrite",
    ),
    "train-directory-in-use": (
        "train",
        "two runs writing one checkpoint directory at once",
        "tests/runtime/test_checkpoint_dir.py::test_one_live_run_holds_a_directory_and_a_dead_ones_successor_takes_it_over",
        "is in use by another run (pid N on HOST, since ...); wait for it to end, or give another checkpoint directory",
    ),
    "train-damaged-checkpoint": (
        "train",
        "a truncated, deleted or bit-flipped shard, a cut .metadata, a deleted manifest",
        "tests/runtime/test_checkpoint.py::test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_newest_intact_one",
        "the newest checkpoint .../step_000006 is damaged: __1_0.distcp has N bytes, not the M saved; the newest intact checkpoint is .../step_000004",
    ),
    "train-resume-nothing": (
        "train",
        "--resume into a checkpoint directory that does not exist (a typo)",
        "tests/runtime/test_checkpoint_dir.py::test_resuming_where_there_is_nothing_starts_at_step_0_and_says_why",
        "starting at step 0: nothing to resume from (.../chekpoints did not exist; it was created)",
    ),
    "train-save-never-finished": (
        "train",
        "a save killed before it finished (its partial directory left behind)",
        "tests/runtime/test_checkpoint_dir.py::test_a_save_that_never_finished_is_cleared_and_named",
        "removed .step_000004.partial (left by a save that never finished)",
    ),
    "train-save-fails": (
        "train",
        "a write failing mid-save (a full disk, a file size limit) and non-finite weights at a save",
        "tests/runtime/test_checkpoint.py::test_a_failed_save_leaves_nothing_and_non_finite_weights_are_never_saved",
        "saving step 8 failed on rank 0: RuntimeError: ... unexpected pos 704 vs 598; ... (.../ckpt has N MiB free); nothing of it was kept, and the newest checkpoint is .../step_000006",
    ),
    "train-checkpoint-dir-unusable": (
        "train",
        "a checkpoint directory that cannot be created, is a file, or has no room for one checkpoint",
        "tests/runtime/test_checkpoint_dir.py::test_a_directory_that_cannot_be_written_or_has_no_room_is_refused_before_any_work",
        "has N GiB free, and one checkpoint of this model takes about M GiB; free some space or give another checkpoint directory",
    ),
    "train-nonfinite-step": (
        "train",
        "NaN or infinite values in a batch (or a diverged loss)",
        "tests/runtime/test_train_loop.py::test_a_non_finite_step_stops_before_the_update_naming_the_step_and_the_samples",
        "step 3: the loss is nan and the gradient norm nan: stopped before the optimizer step, so no weight changed. batch['pixel_values'] holds NaN or infinite values in sample 3 (the shard of data-parallel rank 1)",
    ),
    "train-nonfinite-skipped": (
        "train",
        "the same with --skip-nonfinite-steps",
        "tests/runtime/test_train_loop.py::test_skipped_non_finite_steps_train_like_eager_that_skips_them",
        "step 2: skipped: loss nan, grad norm nan (1 skipped so far); trains equal to eager that skips the step",
    ),
    "train-data-shapes": (
        "train",
        "data whose global batches do not match the compiled shapes",
        "tests/runtime/test_train_loop.py::test_data_whose_batches_do_not_match_the_compiled_shapes_is_refused_before_ranks_start",
        "batch['pixel_values'] is [8, 1, 3, 16, 16] torch.float32; the pipeline expects [4, 1, 3, 16, 16]",
    ),
    "train-data-later-batch": (
        "train",
        "a later global batch of other shapes",
        "tests/runtime/test_train_loop.py::test_a_later_batch_of_other_shapes_names_its_step",
        "the data's global batch for step 2: batch['pixel_values'] is [2, ...",
    ),
    "train-data-collate": (
        "train",
        "samples of one global batch with other text lengths (the default collate)",
        "tests/runtime/test_global_batches.py::test_samples_of_other_lengths_are_refused_naming_the_key_and_the_fix",
        "samples of one batch differ in 'input_ids': sample 0 is [1, 8], sample 2 [1, 5]. ... pad or crop",
    ),
    "train-data-lambda": (
        "train",
        "data given as a lambda to local ranks",
        "tests/runtime/test_global_batches.py::test_data_the_local_ranks_cannot_receive_is_refused_with_the_fix",
        "data (...<lambda>) cannot be sent to the local ranks, which are separate processes",
    ),
    "train-all-frozen": (
        "train",
        "a model whose every parameter is frozen",
        "tests/runtime/test_frozen.py::test_a_model_with_nothing_trainable_is_refused_before_training",
        "every parameter of the model has requires_grad=False: there is nothing to train",
    ),
    "train-options": (
        "train",
        "training options out of range (steps 0, warm-up beyond the steps, resume without a directory)",
        "tests/runtime/test_train_loop.py::test_bad_training_options_are_named",
        "warmup_steps=5 must be between 0 and steps=3",
    ),
    "cli-flags-ignored": (
        "CLI",
        "flags a plan command does not read (--tp with --search, --first-stage-layers with omnibal)",
        "tests/test_cli.py::test_a_flag_the_policy_does_not_read_is_named",
        "vlmcompile: warning: ignoring --tp, --v: --search chooses them itself (the plan goes on)",
    ),
    "batch-no-label-tokens": (
        "batch",
        "a microbatch with no label tokens (its own loss is 0/0)",
        "tests/runtime/test_executor.py::test_a_microbatch_without_label_tokens_trains_like_eager",
        "trains equal to eager (no error: nothing is wrong)",
    ),
    "batch-specialized-values": (
        "batch",
        "a microbatch whose shape-deciding values differ from the captured ones",
        "tests/runtime/test_executor.py::test_batch_values_the_graph_is_fixed_to_must_come_back_unchanged",
        "microbatch 1's 'image_grid_thw' is [[1, 2, 8]], but the pipeline was captured for ...",
    ),
    "batch-constant-changed": (
        "batch",
        "a non-tensor batch value other than the captured one",
        "tests/runtime/test_executor.py::test_batch_values_the_graph_is_fixed_to_must_come_back_unchanged",
        "batch['return_loss'] is False; the pipeline was compiled with True",
    ),
    "fault-dead-rank": (
        "fault",
        "a rank killed mid-step",
        "tests/runtime/test_executor.py::test_a_dead_rank_fails_the_others_naming_it",
        "rank 1 failed first: killed by SIGKILL ... rank 3: ... waiting for ... from rank 1",
    ),
    "fault-hung-rank": (
        "fault",
        "a rank that hangs",
        "tests/runtime/test_launch.py::test_a_hung_rank_is_blamed_and_killed_soon_after_its_peer_gives_up",
        "rank 1 hung: rank 0 gave up waiting for it after ... s and the launcher killed it",
    ),
    "fault-no-main-guard": (
        "fault",
        'a script that launches ranks without `if __name__ == "__main__":`',
        "tests/runtime/test_launch.py::test_a_script_without_a_main_guard_is_told_to_add_one",
        'guard the script\'s entry point with `if __name__ == "__main__":`',
    ),
    "fault-too-many-ranks": (
        "fault",
        "launch(nprocs=0 or 1000), timeout_s=0",
        "tests/runtime/test_launch.py::test_rank_counts_and_timeouts_no_local_run_can_use_are_refused_before_anything_starts",
        "nprocs=1000 local ranks is more than this launcher starts (64)",
    ),
    "fault-open-ports": (
        "fault",
        "a rendezvous store reachable from other machines",
        "tests/runtime/test_launch.py::test_the_store_and_gloo_listen_on_127_0_0_1_only",
        "(none: every listening socket is on 127.0.0.1)",
    ),
    "fault-mutated-plans": (
        "plan file",
        "100 random plan mutations (delete/duplicate/swap actions, move stages and layers, numbers, types)",
        "tests/runtime/test_plan_fuzz.py::test_mutated_plans_are_refused_or_train_equal_to_eager",
        "a PlanError naming the fault, or a step equal to eager",
    ),
    "signal-sigint": (
        "signal",
        "SIGINT (Ctrl-C) to `vlmcompile run`",
        "tests/runtime/test_launch.py::test_a_signal_to_the_cli_stops_every_rank_and_says_so_in_one_line",
        "vlmcompile: interrupted by SIGINT; stopped every rank",
    ),
    "signal-sigterm": (
        "signal",
        "SIGTERM to `vlmcompile run`",
        "tests/runtime/test_launch.py::test_a_signal_to_the_cli_stops_every_rank_and_says_so_in_one_line",
        "vlmcompile: interrupted by SIGTERM; stopped every rank",
    ),
    "signal-preemption": (
        "signal",
        "SIGTERM or SIGUSR1 to a training run on local ranks (a scheduler's preemption)",
        "tests/runtime/test_preemption.py::test_a_stop_request_finishes_the_step_saves_and_the_run_resumes_from_it",
        "stopped by SIGTERM after step N of 200: saved .../step_00000N; resume goes on from there",
    ),
    "signal-preemption-twice": (
        "signal",
        "a second stop signal while the step in flight finishes",
        "tests/runtime/test_preemption.py::test_a_second_signal_stops_at_once_without_saving",
        "interrupted by SIGTERM (stopped at once, nothing saved)",
    ),
    "signal-preemption-torchrun": (
        "signal",
        "SIGTERM to torchrun (`--signals-to-handle SIGTERM,SIGUSR1`)",
        "tests/test_train_command.py::test_sigterm_to_torchrun_saves_the_step_in_flight_and_only_torchrun_listens_beyond_loopback",
        "stopped by SIGTERM after step N of 100000: saved .../step_00000N; resume goes on from there",
    ),
    "demo-memory-cap-too-small": (
        "CLI",
        "`vlmcompile demo --memory-cap` under what any plan needs",
        "tests/test_demo.py::test_a_memory_cap_no_plan_fits_in_names_the_least_any_plan_needs",
        "no parallel plan fits in 47.48 KiB per rank on cpu:2, of 5 candidates: 5 pruned: even with every layer recomputed they need more than the cap (least 288.96 KiB on a fullest rank, 241.48 KiB (509 %) over it). For memory: more GPUs (more PP / TP), ...",
    ),
    "fault-hung-in-save": (
        "fault",
        "a rank that hangs, or is stopped (SIGSTOP), inside a checkpoint save",
        "tests/runtime/test_preemption.py::test_a_rank_that_hangs_or_is_stopped_inside_a_save_is_named",
        "rank 1 hung: rank 0 gave up waiting for a collective ... / rank 1 stopped (SIGSTOP or Ctrl-Z) for N s, longer than the 4 s timeout",
    ),
    "fault-paused-job": (
        "fault",
        "the whole job paused (Ctrl-Z) for longer than --timeout",
        "tests/runtime/test_launch.py::test_a_pause_is_told_apart_from_a_hang_only_when_it_came_within_the_timeout",
        "the job was paused for N s (stopped: Ctrl-Z or SIGSTOP), longer than the 3 s the ranks wait for each other ...; no rank failed",
    ),
    "fault-torchrun-ports": (
        "fault",
        "what listens under torchrun",
        "tests/test_train_command.py::test_sigterm_to_torchrun_saves_the_step_in_flight_and_only_torchrun_listens_beyond_loopback",
        "(the ranks on 127.0.0.1 only; torchrun's own rendezvous store on every interface, as the README says)",
    ),
    "data-padding-unpackable": (
        "data",
        "a sample's padding packing cannot reproduce: labels on it, a left-padded first label, holes in its "
        "attention_mask; images of an integer dtype",
        "tests/data/test_packing.py::test_padding_packing_cannot_reproduce_is_refused_naming_the_sample",
        "sample 0: 1 labels on its padding (attention_mask 0); set labels to -100 where the mask is 0 / sample 0: "
        "left-padded, and its first token has label 5, which eager predicts from padding alone / sample 0: its "
        "attention_mask has 0s between its tokens / sample 0: pixel_values are torch.uint8, not floating point",
    ),
    "data-padded-samples": (
        "data",
        "samples padded by their tokenizer (left or right, a 0/1 attention_mask), zoo and transformers LLaVA",
        "tests/data/test_packing.py::test_a_sample_s_own_padding_is_dropped_as_eager_masks_it",
        "(no error) the padding is dropped, each token at eager's position: loss and gradients equal eager's on "
        "the padded batch",
    ),
    "data-step-without-labels": (
        "train",
        "a packed step whose samples have no label token (every label -100)",
        "tests/runtime/test_packed_pipeline.py::test_a_packed_step_without_label_tokens_stops_saying_so_or_is_skipped",
        "step 1: the loss is nan ...: the global batch has no label token (every label is -100), so its loss is "
        "0/0 (with --skip-nonfinite-steps: skipped, its samples counted as left out)",
    ),
    "data-long-sample-anywhere": (
        "data",
        "a sample over the token budget anywhere in a dataset (not only its first 2048)",
        "tests/data/test_steps.py::test_a_long_sample_anywhere_in_the_data_is_named_by_its_line_before_the_run",
        "dataset sample 56 (.../data.jsonl:57) takes 408 LLM tokens, more than a microbatch's 64; plan for "
        "microbatches of at least 408 (vlmcompile plan --data ... --tokens-per-microbatch 408; ...)",
    ),
    "data-backlog-grows": (
        "data",
        "a global batch the microbatches cannot hold, from data given as a function of the step (no replay "
        "before the run)",
        "tests/data/test_steps.py::test_a_run_that_outgrows_its_microbatches_stops_before_the_step",
        "step 2 would leave N samples for the next, more than the 32 a step may (its 7 microbatches of 64 LLM "
        "tokens cannot hold its samples and the backlog grows)",
    ),
    "data-resume-other-stream": (
        "train",
        "resuming with another global batch (the stream goes on), or on another dataset",
        "tests/data/test_steps.py::test_a_resumed_run_goes_on_where_its_checkpoint_left_the_stream_with_another_global_batch",
        "(no error with another global batch: every sample of the stream once) the checkpoint's run drew its "
        "samples from another stream: samples 40 (now 39)",
    ),
    "isf-default-targets-unmet": (
        "data",
        "ISF's default targets under some samples' vision rows",
        "tests/data/test_balance.py::test_bad_sizes_are_refused_and_the_default_targets_warning_says_what_to_give",
        "(IsfWarning) 1 of 21 samples alone exceed the targets (...); the default Q_v follows the dataset's "
        "vision rows per LLM token, ...: give IsfTargets with the largest sample's sizes (Q_t 400, Q_v 40)",
    ),
    "train-data-fails-mid-run": (
        "train",
        "a step whose data fails on every rank mid-run (a broken sample)",
        "tests/runtime/test_train_loop.py::test_a_step_whose_data_fails_saves_the_steps_before_it_and_the_run_goes_on_from_there",
        "the data's global batch for step 3: ...; the steps before it were saved first: the newest checkpoint is "
        ".../step_000002",
    ),
    "train-step-without-labels": (
        "train",
        "a global batch whose every label is -100 (its loss 0/0)",
        "tests/runtime/test_train_loop.py::test_a_step_without_label_tokens_stops_saying_so_after_saving_the_steps_before_it",
        "step 2: the loss is nan ...: the global batch has no label token (every label is -100), so its loss is "
        "0/0: give its samples labels, or drop them; the steps before it were saved first: ...",
    ),
    "train-nan-packed": (
        "train",
        "NaN images in a packed step",
        "tests/runtime/test_packed_pipeline.py::test_a_packed_step_with_nan_images_stops_naming_the_dataset_samples",
        "step 1: the loss is nan ... dataset sample N holds NaN or infinite values in ['pixel_values'] (packed "
        "microbatch K, data-parallel rank R)",
    ),
    "train-frozen-plan-cli": (
        "train",
        "a plan made with --freeze (a frozen vision tower; LLaVA's stage 1), trained from the CLI",
        "tests/test_train_command.py::test_a_frozen_plan_trains_exactly_its_frozen_set_from_the_cli",
        "(no error) the plan's frozen layers train frozen: bit for bit unchanged in the checkpoint, losses "
        "equal eager's",
    ),
    "train-global-batch-over-plan-cli": (
        "train",
        "--global-batch 32 on a plan for 8 of a 40-sample manifest; another --global-batch on --resume",
        "tests/test_train_command.py::test_a_global_batch_the_plan_cannot_hold_is_refused_and_a_resume_may_change_it",
        "the plan's 7 microbatches of 64 LLM tokens cannot hold 32 samples a step of this data: ... The most they "
        "hold is N a step; (resumed with 8: the stream goes on where the checkpoint left it)",
    ),
    "train-load-checkpoint-damaged-newest": (
        "train",
        "load_checkpoint(run_dir) whose newest checkpoint is damaged",
        "tests/runtime/test_checkpoint.py::test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_newest_intact_one",
        "(UserWarning) reading .../step_000004, the newest intact checkpoint in ... (.../step_000006 is damaged: ...)",
    ),
    "api-all-frozen-compile": (
        "API",
        "compile a model whose every parameter is frozen, with a cluster",
        "tests/passes/planning/test_plan_search.py::test_a_screen_that_meets_its_own_bound_is_kept",
        "(no error: it plans; was 'no parallel plan fits ... least peak 92.50 KiB') train() then says: every "
        "parameter of the model has requires_grad=False: there is nothing to train",
    ),
    "api-clip-arange-targets": (
        "API",
        "a plain-PyTorch CLIP loss whose targets are torch.arange(pixel_values.shape[0])",
        "tests/runtime/test_contrastive.py::test_a_clip_loss_with_targets_of_the_batch_size_trains_split_like_eager",
        "(no error) recognised as InfoNCE: the loss on the whole global batch, split over the ranks, equal to eager",
    ),
    "signal-sigkill": (
        "signal",
        "SIGKILL of `vlmcompile run` (no cleanup possible)",
        "tests/runtime/test_launch.py::test_ranks_exit_on_their_own_when_the_launcher_is_killed",
        "(the ranks exit on their own within a second)",
    ),
    "signal-after-solve": (
        "signal",
        "Ctrl-C after a CP-SAT solve",
        "tests/runtime/test_launch.py::test_a_python_level_sigint_handler_survives_a_cp_sat_solve",
        "KeyboardInterrupt as usual (CP-SAT no longer resets the handler)",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_gets_a_message_naming_it(name, tmp_path):
    case = CASES[name]
    if case.area == "CLI":
        with pytest.raises(CliOutput) as info:
            case.run(tmp_path)
        out = info.value
        assert out.code not in (0, None), out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        assert case.message in out.stderr, out.stderr
        error_lines = [line for line in out.stderr.splitlines() if "error" in line]
        assert len(error_lines) == 1, out.stderr
        return
    from vlmcompile.ir.errors import VlmCompileError

    with pytest.raises(VlmCompileError) as info:
        case.run(tmp_path)
    assert case.message in str(info.value), str(info.value)


def table() -> str:
    rows = [
        "| # | area | bad input | covered by | what the user sees |",
        "|---|------|-----------|------------|--------------------|",
    ]
    entries = [
        (c.area, c.what, f"tests/test_bad_inputs.py::test_bad_input_gets_a_message_naming_it[{n}]", c.message)
        for n, c in CASES.items()
    ]
    entries += list(ELSEWHERE.values())
    for i, (area, what, test, message) in enumerate(entries, 1):
        cells = [str(i), area, what, f"`{test}`", message.replace("|", "\\|")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def test_the_readme_table_lists_every_case():
    text = README.read_text()
    assert BEGIN in text and END in text, f"{README} lost its {BEGIN} markers"
    inside = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert inside == table(), "tests/README.md's table is stale: run python -m tests.test_bad_inputs"
    assert len(CASES) + len(ELSEWHERE) >= 40


@pytest.mark.parametrize("name", sorted(ELSEWHERE))
def test_every_test_the_table_names_exists(name):
    path, _, test = ELSEWHERE[name][2].partition("::")
    tree = ast.parse((TESTS.parent / path).read_text())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert test in defined, f"{path} has no {test}"


def _write_readme() -> None:
    text = README.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{BEGIN}\n{table()}\n{END}{tail}")


if __name__ == "__main__":
    _write_readme()
    print(f"wrote {len(CASES) + len(ELSEWHERE)} rows to {README}", file=sys.stderr)
