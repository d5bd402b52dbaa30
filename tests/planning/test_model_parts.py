"""The model read the way the baselines build a VLM, their global recompute as flags per layer,
and the one ladder of recompute settings."""

import pytest

from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Parallel, Recompute
from vlmcompile.ir.regions import Region
from vlmcompile.planning.model_parts import (
    GLOBAL_LADDER,
    PARTIAL_BASE,
    RECOMPUTE_LADDER,
    RecomputeRung,
    model_parts,
    recompute_flags,
    with_ends,
)
from vlmcompile.planning.request import GlobalRecompute, NotApplicable


def test_the_demo_reads_as_encoders_and_embedding_then_decoder_then_head(demo_graph):
    parts = model_parts(demo_graph)
    assert (
        parts.pre[-1] == "llm.embed"
        and parts.decoder[0] == "llm.blocks.0"
        and parts.post == ("llm.norm", "head")
    )
    assert len(parts.decoder) == 8
    chunks = with_ends(parts, [2, 6], why_empty="")
    assert chunks[0][: len(parts.pre)] == list(parts.pre) and chunks[-1][-2:] == ["llm.norm", "head"]
    with pytest.raises(NotApplicable, match=r"virtual stages \[1\] get no layers; lower pp"):
        with_ends(parts, [4, 0, 4], why_empty="lower pp")


def test_a_global_recompute_flags_every_decoder_layer_and_the_vision_blocks(demo_graph):
    parts = model_parts(demo_graph)
    flags = recompute_flags(demo_graph, parts, GlobalRecompute(granularity="selective", vision=True))
    vision_blocks = {layer.name for layer in demo_graph.in_region(Region.VISION) if layer.block}
    assert set(flags) == set(parts.decoder) | vision_blocks
    assert all(flags[n] is Recompute.SELECTIVE for n in parts.decoder)
    assert all(flags[n] is Recompute.FULL for n in vision_blocks)
    assert recompute_flags(demo_graph, parts, GlobalRecompute()) == {}


def test_one_ladder_the_least_recompute_first_and_the_baselines_rungs_of_it():
    assert [str(r) for r in GLOBAL_LADDER] == ["none", "selective", "full", "full + vision"]
    assert set(GLOBAL_LADDER) <= {r.base for r in RECOMPUTE_LADDER if not r.full_share}
    shares = [r.full_share for r in RECOMPUTE_LADDER if r.full_share]
    assert shares == sorted(shares) and len(RECOMPUTE_LADDER) == 4 + len(shares) + 2


def test_a_partial_rung_recomputes_the_first_share_of_every_ranks_llm_layers(demo_graph):
    parts = model_parts(demo_graph)
    llm = [n for n in parts.decoder]
    chunks = [llm[k::4] for k in range(4)]  # virtual stage k on rank k mod 2
    llm_par = Parallel(dp=1, tp=1, pp=2, v=2)
    flags = RecomputeRung(PARTIAL_BASE, 0.5).flags(demo_graph, parts, chunks, llm_par)
    base = RecomputeRung(PARTIAL_BASE).flags(demo_graph, parts, chunks, llm_par)
    for rank in range(2):
        layers = [n for k, chunk in enumerate(chunks) if k % 2 == rank for n in chunk]
        fully = [flags[n] is Recompute.FULL for n in layers]
        assert fully == [True] * (len(layers) // 2) + [False] * (len(layers) - len(layers) // 2)
        assert all(base[n] is Recompute.SELECTIVE for n in layers)
    vision = [n for n in base if n not in llm]
    assert vision and all(flags[n] is base[n] is Recompute.FULL for n in vision)
    with pytest.raises(PlanError, match="full_share=1.0; give a share"):
        RecomputeRung(PARTIAL_BASE, 1.0)
