"""The model, cluster and parallel configurations of the Optimus and OmniBal papers
(``shared/reference/paper_setups.json``), as named setups the CLI and the benchmark share.

Where a paper leaves a value out, ours is marked in ``note``:

* Optimus' Megatron-LM baseline gives dp/pp/tp only, so it runs 1F1B (v = 1); its balanced
  baseline gives v. The multi-encoder runs give no v: we use 12, as for Model D (same LLM and GPUs).
* The Optimus single-node run gives no parallel plan: we use tp 4, pp 2.
* OmniBal gives no global batch: we use 512 samples (microbatches of 1 sample = 9 tiles and a
  4096-token sequence), and v = 1 for both baselines.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmcompile.ir.plan import Parallel
from vlmcompile.planning.request import PlanRequest


@dataclass(frozen=True, slots=True)
class Setup:
    name: str
    paper: str
    model: str
    cluster: str
    parallel: Parallel
    """The paper's degrees, v = 1."""
    global_batch: int
    microbatch_size: int
    v_balanced: int = 1
    """v of the paper's balanced baseline (and ours)."""
    note: str = ""

    def request(self, v: int = 1) -> PlanRequest:
        """The paper's request, with ``v`` virtual stages per rank."""
        return PlanRequest(
            parallel=Parallel(dp=self.parallel.dp, tp=self.parallel.tp, pp=self.parallel.pp, v=v),
            global_batch=self.global_batch,
            microbatch_size=self.microbatch_size,
        )


def _setup(
    name: str,
    paper: str,
    model: str,
    cluster: str,
    tp: int,
    pp: int,
    dp: int,
    global_batch: int,
    microbatch_size: int,
    v_balanced: int = 1,
    note: str = "",
) -> Setup:
    parallel = Parallel(dp=dp, tp=tp, pp=pp)
    return Setup(name, paper, model, cluster, parallel, global_batch, microbatch_size, v_balanced, note)


def _optimus() -> list[Setup]:
    weak = [
        ("Model A", "ViT-11B", "LLAMA-70B", 64, 32, 2, 4, 8, 6),
        ("Model B", "ViT-22B", "LLAMA-70B", 128, 64, 4, 4, 8, 6),
        ("Model C", "ViT-11B", "GPT-175B", 256, 128, 4, 8, 8, 12),
        ("Model D", "ViT-22B", "GPT-175B", 512, 256, 8, 8, 8, 12),
    ]
    out = [
        _setup(
            f"optimus-weak-{n[-1]}", "Optimus", f"Optimus-Model-{n[-1]}", f"h100x{g}", tp, pp, dp, gb, 2, v
        )
        for n, _, _, g, gb, dp, pp, tp, v in weak
    ]
    for gpus, dp in ((1536, 24), (2048, 32), (3072, 48)):
        out.append(
            _setup(
                f"optimus-strong-{gpus}", "Optimus", "Optimus-Model-D", f"h100x{gpus}", 8, 8, dp, 1536, 2, 12
            )
        )
    for encoders in (("ViT-11B", "ViT-5B"), ("ViT-22B", "ViT-5B"), ("ViT-22B", "ViT-11B")):
        model = "+".join([*encoders, "GPT-175B"])
        out.append(
            _setup(
                f"optimus-multi-{'-'.join(e.removeprefix('ViT-') for e in encoders)}",
                "Optimus",
                model,
                "h100x512",
                8,
                8,
                8,
                256,
                2,
                12,
                note="v=12 ours (the paper gives none)",
            )
        )
    out.append(
        _setup(
            "optimus-single-node",
            "Optimus",
            "ViT-3B+GPT-11B",
            "a100x8",
            4,
            2,
            1,
            16,
            2,
            2,
            note="tp 4, pp 2 and v 2 ours (the paper gives no plan)",
        )
    )
    return out


def _omnibal() -> list[Setup]:
    rows = [
        ("Llama3-8B", 1, 4, 8),
        ("InternLM2-20B", 2, 4, 4),
        ("Yi-34B", 4, 4, 2),
        ("Llama3-70B", 4, 8, 2),
        ("Qwen1.5-110B", 8, 8, 1),
    ]
    return [
        _setup(
            f"omnibal-{llm}",
            "OmniBal",
            f"InternViT-6B+{llm}",
            f"a100x{tp * pp * dp}",
            tp,
            pp,
            dp,
            512,
            1,
            1,
            note="global batch 512 ours (the paper gives none)",
        )
        for llm, tp, pp, dp in rows
    ]


SETUPS: dict[str, Setup] = {s.name: s for s in [*_optimus(), *_omnibal()]}


def setup(name: str) -> Setup:
    if name not in SETUPS:
        raise KeyError(f"unknown setup {name!r}; choose one of {', '.join(SETUPS)}")
    return SETUPS[name]
