"""Memory as planned, measured: each rank's peak tensor memory in training against the plan's
prediction, on local CPU ranks.

    python benchmarks/memory_fidelity.py [--steps 3] [--only NAME ...]

Each case trains a plan for ``--steps`` AdamW steps with ``measure_memory="every"``: a rank's
peak tensor memory is what the CPU allocator held at its most in the step, forward to optimizer
update (:mod:`vlmcompile.runtime.memory`: the profiler's allocation events, not the process's
resident set). The prediction is the simulator's per-rank peak for the plan as the runtime holds
it (fp32 parameters, gradients and AdamW moments; ZeRO-1 shards the moments; the activations the
annotate pass measured). The figure is the largest over the steps after the first (which has no optimizer
states yet; a packed run's steps differ), against the prediction at the token budget the
pipeline was compiled for. Error = predicted / measured - 1. Goal: every rank
within 10 %.

Writes ``benchmarks/results/memory_fidelity.json`` with this machine named; ``--readme``
replaces the table between the ``memory_fidelity`` markers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from readme_section import github_table, write_readme_section

from vlmcompile import compile, models
from vlmcompile.runtime.train_loop import TrainConfig, memory_error

RESULTS = Path(__file__).parent / "results" / "memory_fidelity.json"
TARGET = 0.10


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    make: Callable  # (pipe, batch) -> the plan
    what: str
    ranks: int = 2


def _even(**options):
    from tests.pipeline_helpers import even_plan

    return lambda pipe, batch: even_plan(pipe.layer_graph, global_batch=len(batch["input_ids"]), **options)


CASES = [
    Case("demo-1f1b", "demo", _even(pp=2), "1F1B, PP=2, no recompute"),
    Case(
        "demo-1f1b-recompute",
        "demo",
        _even(pp=2, recompute=tuple(range(8, 16))),
        "1F1B, PP=2, LLM blocks recomputed",
    ),
    Case("demo-interleaved", "demo", _even(pp=2, v=2), "interleaved 1F1B, PP=2, v=2"),
    Case(
        "demo-bubbles",
        "demo",
        lambda pipe, batch: _bubbles(pipe, batch),
        "encoder in the LLM's bubbles, PP=2",
    ),
    Case("demo-dp2", "demo", _even(pp=2, dp=2), "1F1B, PP=2 x DP=2, ZeRO-0", 4),
    Case("demo-dp2-zero1", "demo", _even(pp=2, dp=2, zero_stage=1), "1F1B, PP=2 x DP=2, ZeRO-1", 4),
    Case("llava-1f1b", "llava-small", _even(pp=2), "transformers LLaVA (6 M), 1F1B, PP=2"),
    Case("llava-interleaved", "llava-small", _even(pp=2, v=2), "transformers LLaVA (6 M), interleaved, v=2"),
    Case(
        "llava-dp2-zero1-recompute",
        "llava-small",
        _even(pp=2, dp=2, zero_stage=1, recompute=(10, 11, 12, 13)),
        "transformers LLaVA (6 M), PP=2 x DP=2, ZeRO-1, LLM recomputed",
        4,
    ),
    Case(
        "demo-packed", "demo-packed", None, "packed variable data (text-only samples too), the compiled plan"
    ),
    Case("tiny-llava-1f1b", "hf-llava", _even(pp=2), "transformers LLaVA (65 K), 1F1B, PP=2"),
]


def _bubbles(pipe, batch):
    from tests.pipeline_helpers import separate_plan

    return separate_plan(pipe.layer_graph, pp=2, encoder_pp=1, global_batch=len(batch["input_ids"]))


def _small_llava(batch: int):
    """A transformers LLaVA of 6 M parameters (the tiny one's 65 K make a kernel's workspace a
    third of a rank's memory): CLIP 4 x 192 on 112 px tiles (64 patches), Llama 4 x 256."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from vlmcompile.families.tiny import IMAGE_TOKEN, build_model, finish, pixels, token_ids

    vision = dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4)
    text = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4)
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(**vision, image_size=112, patch_size=14, projection_dim=64),
        text_config=LlamaConfig(vocab_size=2000, num_key_value_heads=4, max_position_embeddings=512, **text),
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-1,
    )
    model = build_model(LlavaForConditionalGeneration, cfg, "sdpa", "cpu")
    b = {"input_ids": token_ids(batch, 64, (112 // 14) ** 2), "pixel_values": pixels(batch, 3, 112, 112)}
    return finish(model, b, "cpu")


def _build(name: str, global_batch: int):
    if name == "llava-small":
        return _small_llava(global_batch)
    if name.startswith("hf-"):
        from vlmcompile.families import build_tiny_by_name

        return build_tiny_by_name(name, batch=global_batch)
    return models.build(name), models.sample_batch(name, batch_size=global_batch)


def _packed_demo():
    """The demo compiled once for samples of any image count and size (text-only ones too), and
    global batches of 4 such samples from a synthetic dataset."""
    from vlmcompile import families
    from vlmcompile.data.synthetic import SyntheticDataset
    from vlmcompile.planning.request import SearchSpace
    from vlmcompile.runtime.global_batches import GlobalBatches

    model = models.build("demo")
    family = families.layout_of(model)
    options = dict(text_only=0.3, text_scale=1 / 30, pixel_scale=224 / 640)
    data = SyntheticDataset("interleaved", family, 40, seed=5, **options)
    samples = [data[i] for i in range(8)]
    tokens = max(data[i]["input_ids"].numel() for i in range(len(data)))
    space = SearchSpace(pp_choices=(2,))
    pipe = compile(model, samples, "cpu:2", search_space=space, tokens_per_microbatch=tokens, log=None)
    return pipe, GlobalBatches(data, 4, seed=2)


def run_case(case: Case, steps: int) -> dict:
    if case.model == "demo-packed":
        pipe, data = _packed_demo()
        plan = pipe.plan
    else:
        model, batch = _build(case.model, 4)
        pipe = compile(model, batch, f"cpu:{case.ranks}", log=None)
        plan, data = case.make(pipe, batch), [batch] * steps
    config = TrainConfig(steps=steps, lr=1e-4, measure_memory="every")
    result = pipe.train(data, config, plan=plan, timeout_s=120)
    # Steps after the first (which has no optimizer states yet): a packed run's differ, its largest is taken.
    later = result.steps[1:] or result.steps
    measured = tuple(
        max(s.peak_tensor_bytes[r] for s in later) for r in range(len(later[0].peak_tensor_bytes))
    )
    predicted = later[-1].predicted_peak_bytes
    return {
        "case": case.name,
        "what": case.what,
        "ranks": [
            {"rank": r, "measured_bytes": m, "predicted_bytes": p, "error": memory_error(m, p)}
            for r, (m, p) in enumerate(zip(measured, predicted))
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--readme", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        print(f"{case.name}: {case.what} ...", file=sys.stderr, flush=True)
        rows.append(run_case(case, args.steps))
    headers = ["case", "plan", "rank", "measured MiB", "predicted MiB", "error"]
    table = []
    for row in rows:
        for r in row["ranks"]:
            table.append(
                [
                    row["case"],
                    row["what"],
                    str(r["rank"]),
                    f"{r['measured_bytes'] / 2**20:.2f}",
                    f"{r['predicted_bytes'] / 2**20:.2f}",
                    f"{100 * r['error']:+.1f} %",
                ]
            )
    errors = [abs(r["error"]) for row in rows for r in row["ranks"]]
    within = sum(e <= TARGET for e in errors)
    print(github_table(headers, table))
    print(f"\n{within} of {len(errors)} ranks within {TARGET:.0%}; worst {max(errors):.1%}")
    out = {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (this machine)",
        "steps": args.steps,
        "target": TARGET,
        "cases": rows,
    }
    if not args.only:
        RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    if args.readme:
        write_readme_section("memory_fidelity", github_table(headers, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
