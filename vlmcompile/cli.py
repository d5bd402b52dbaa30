"""Command line: ``vlmcompile annotate --model NAME [--json FILE]``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _annotate(args: argparse.Namespace) -> int:
    import vlmcompile
    from vlmcompile import models

    if args.model.startswith("hf-"):
        from vlmcompile.models import hf_tiny

        model, batch = hf_tiny.build(args.model)
    else:
        device = "cpu" if args.real else "meta"
        model = models.build(args.model, device=device, dtype=_DTYPES[args.dtype])
        batch = models.sample_batch(
            args.model, batch_size=args.batch_size, device=device, dtype=_DTYPES[args.dtype]
        )
    pipe = vlmcompile.compile(
        model, batch, model_name=args.model, tensor_mode="real" if args.real else "fake"
    )
    print(pipe.report)
    if args.json:
        Path(args.json).write_text(json.dumps(pipe.layer_graph.to_json(), indent=1))
        print(f"\nper-layer figures written to {args.json}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlmcompile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("annotate", help="capture and annotate a zoo model; print the report")
    p.add_argument(
        "--model",
        required=True,
        help="zoo name (demo, tiny, InternVL-Chat-1.5, ViT-22B+GPT-175B, CLIP-L, ...) or a tiny "
        "transformers model (hf-llava, hf-internvl, hf-idefics3, hf-paligemma)",
    )
    p.add_argument("--json", metavar="FILE", help="write the LayerGraph (per-layer figures) as JSON")
    p.add_argument("--batch-size", type=int, default=1, help="samples in the sample batch (default 1)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="parameter and activation dtype")
    p.add_argument(
        "--real",
        action="store_true",
        help="build with real CPU weights and measure on real tensors (small models only)",
    )
    p.set_defaults(run=_annotate)
    args = parser.parse_args(argv)
    from vlmcompile.errors import VlmCompileError

    try:
        return args.run(args)
    except VlmCompileError as err:
        print(f"vlmcompile: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
