"""Balanced mini-batches: random batching, length grouping and OmniBal's ISF on every synthetic
dataset (and a manifest), measured by Pad Ratio and Dist Ratio as OmniBal's Table 3 does.

Each sample is its LLM tokens and its vision rows (tiles or patches) under a released model's
image layout (``vlmcompile.families.released_layouts()``; each synthetic dataset under the family it
models unless ``--family`` says otherwise). The three methods, like with like:

* random: the samples in random order, mini-batches of ``B`` samples;
* length grouping (what a Hugging Face Trainer's ``group_by_length`` does): megabatches of
  ``50 B`` samples in random order, each sorted by LLM tokens, cut into mini-batches of ``B``;
* ISF: one epoch of :func:`vlmcompile.data.balance.isf_epoch` with the targets from the
  dataset's statistics; every sample once, the leftovers' unbalanced mini-batches included.

``B`` is the mean samples of ISF's mini-batches, so the three hold the same samples a
mini-batch on average. The Dist Ratio is taken over ``--dp`` devices, one mini-batch each a step.

    python benchmarks/data_balance.py [--samples 100000] [--dp 32] [--readme]
    python benchmarks/data_balance.py --manifest FILE --family internvl --dp 32 --json OUT

Writes ``benchmarks/results/data_balance.json`` (or ``--json``): one row per dataset and method
with ``method``, ``pad_ratio`` (the LLM's), ``pad_ratio_vision``, ``dist_ratio_vision``,
``dist_ratio_llm``, ``dist_ratio_llm_packed`` (a packed LLM's: tokens summed, no padding),
``samples_per_batch``, and for ISF the seconds it took and the share of the
samples it placed in balanced mini-batches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from readme_section import github_table, write_readme_section

from vlmcompile.data.balance import IsfTargets, SampleSizes, isf_epoch, measure
from vlmcompile.data.manifest import read_manifest
from vlmcompile.data.synthetic import DISTRIBUTIONS, draw_sizes
from vlmcompile.families import released_layouts

RESULTS = Path(__file__).parent / "results" / "data_balance.json"
OWN_FAMILY = {
    "llava-chat": "llava",
    "internvl-tiles": "internvl",
    "qwen-native": "qwen2-vl",
    "interleaved": "idefics3",
}
MEGABATCH = 50
"""Mini-batches a length-grouping megabatch holds (transformers' ``LengthGroupedSampler``)."""


def _sizes(samples, family) -> SampleSizes:
    pairs = np.asarray([family.sized(s) for s in samples], dtype=np.int64).reshape(-1, 2)
    return SampleSizes(pairs[:, 0], pairs[:, 1])


def _random(count: int, size: int, rng) -> list[np.ndarray]:
    order = rng.permutation(count)
    return [order[k : k + size] for k in range(0, count, size)]


def _length_grouped(sizes: SampleSizes, size: int, rng) -> list[np.ndarray]:
    order = rng.permutation(len(sizes))
    batches = []
    for k in range(0, len(order), MEGABATCH * size):
        mega = order[k : k + MEGABATCH * size]
        mega = mega[np.argsort(-sizes.llm_tokens[mega], kind="stable")]
        batches += [mega[j : j + size] for j in range(0, len(mega), size)]
    return [batches[k] for k in rng.permutation(len(batches))]


def compare(name: str, sizes: SampleSizes, dp: int, seed: int = 0) -> list[dict]:
    """The three methods' measures on one dataset."""
    started = time.perf_counter()
    targets = IsfTargets.from_statistics(sizes)
    epoch = isf_epoch(sizes, targets, seed=seed)
    seconds = time.perf_counter() - started
    isf = measure(epoch.batches, sizes, dp=dp)
    size = max(1, round(isf.samples_per_batch))
    rng = np.random.default_rng(seed)
    rows = []
    for method, batches in (
        ("random", _random(len(sizes), size, rng)),
        ("length grouping", _length_grouped(sizes, size, rng)),
    ):
        rows.append({"dataset": name, "method": method, **measure(batches, sizes, dp=dp).as_dict()})
    rows.append(
        {
            "dataset": name,
            "method": "ISF",
            **isf.as_dict(),
            "seconds": seconds,
            "balanced_share": epoch.balanced_share,
            "targets": str(targets),
        }
    )
    return rows


def table(rows: list[dict]) -> str:
    head = [
        "dataset",
        "method",
        "Pad Ratio (LLM)",
        "Dist Ratio (vision)",
        "Dist Ratio (LLM)",
        "Dist Ratio (LLM, packed)",
        "samples a mini-batch",
    ]
    body = [
        [
            r["dataset"],
            r["method"],
            f"{r['pad_ratio']:.3f}",
            f"{r['dist_ratio_vision']:.3f}",
            f"{r['dist_ratio_llm']:.3f}",
            f"{r['dist_ratio_llm_packed']:.3f}",
            f"{r['samples_per_batch']:.2f}",
        ]
        for r in rows
    ]
    return github_table(head, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=100_000, help="samples of each synthetic dataset")
    parser.add_argument("--dp", type=int, default=32, help="data-parallel devices of the Dist Ratio")
    parser.add_argument(
        "--manifest", help="a JSONL manifest of sample sizes, measured instead of the synthetic datasets"
    )
    parser.add_argument(
        "--family", choices=sorted(released_layouts()), help="the image layout (default: each dataset's own)"
    )
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--readme", action="store_true")
    args = parser.parse_args(argv)
    if args.manifest:
        if not args.family:
            parser.error("--manifest needs --family: the image layout that turns image sizes into tokens")
        datasets = {Path(args.manifest).name: (read_manifest(args.manifest), args.family)}
    else:
        datasets = {
            name: ([draw_sizes(name, i) for i in range(args.samples)], args.family or OWN_FAMILY[name])
            for name in DISTRIBUTIONS
        }
    rows = []
    for name, (samples, family) in datasets.items():
        print(f"{name}: {len(samples)} samples as {family}'s ...", file=sys.stderr, flush=True)
        rows += compare(name, _sizes(samples, released_layouts()[family]), args.dp)
        isf = rows[-1]
        print(
            f"  ISF in {isf['seconds']:.1f} s, {isf['balanced_share']:.0%} balanced ({isf['targets']})",
            file=sys.stderr,
        )
    args.json.write_text(json.dumps({"dp": args.dp, "rows": rows}, indent=1))
    text = table(rows)
    print(text)
    if args.readme:
        write_readme_section("data_balance", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
