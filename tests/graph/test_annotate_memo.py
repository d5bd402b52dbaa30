"""One annotation of a graph's code, tags, tensors and batch a process: a hit gives the figures a
fresh measurement gives, on the new graph's own nodes, and whatever a measurement depends on
changes the key."""

from __future__ import annotations

import pytest
import torch

from tests.models import build, needs_transformers
from vlmcompile.graph import annotate_memo, export_memo
from vlmcompile.ir.meta_keys import NODE_COST_META, OUTPUT_META
from vlmcompile.passes.graph.annotate import annotate
from vlmcompile.passes.graph.capture import capture

pytestmark = pytest.mark.usefixtures("memos")


def _counts() -> tuple[int, int]:
    return annotate_memo.stats["hits"], annotate_memo.stats["misses"]


def _costs(gm) -> dict:
    return {n.name: n.meta[NODE_COST_META] for n in gm.graph.nodes if NODE_COST_META in n.meta}


@pytest.mark.parametrize("name", ["tiny", pytest.param("hf-llava", marks=needs_transformers)])
def test_a_second_capture_takes_the_first_figures_equal_to_a_fresh_measurement(name, monkeypatch):
    model, batch = build(name)
    annotate(capture(model, batch).gm, batch)
    hits, misses = _counts()
    again = capture(build(name)[0], batch).gm  # another model of the same code and configuration
    got = annotate(again, batch)
    assert _counts() == (hits + 1, misses)
    monkeypatch.delenv(export_memo.MEMO_ENV)
    fresh_gm = capture(model, batch).gm
    fresh = annotate(fresh_gm, batch)
    assert got.layer_graph == fresh.layer_graph
    assert _costs(again) == _costs(fresh_gm) and _costs(again)
    assert OUTPUT_META in again.meta
    for field in ("tensor_mode", "fallback", "assumptions", "repeated_backwards", "replayed_forwards"):
        assert getattr(got.report, field) == getattr(fresh.report, field), field
    assert got.report.memoised and not fresh.report.memoised


def test_what_a_measurement_reads_changes_the_key():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, batch = build("tiny")
    annotate(capture(model, batch).gm, batch)
    frozen = build("tiny")[0]
    frozen.encoders.requires_grad_(False)
    longer = {**batch, "input_ids": torch.cat([batch["input_ids"], batch["input_ids"][:, :4]], 1)}
    longer["labels"] = longer["input_ids"].clone()
    cases = {
        "frozen parameters": lambda: annotate(capture(frozen, batch).gm, batch),
        "every layer": lambda: annotate(capture(model, batch).gm, batch, every_layer=True),
        "a model name": lambda: annotate(capture(model, batch).gm, batch, model_name="other"),
        "another batch": lambda: annotate(capture(model, longer).gm, longer),
        "other token ids": lambda: annotate(
            capture(model, batch).gm, {**batch, "labels": batch["labels"] * 0}
        ),
        "another attention kernel": lambda: _under(sdpa_kernel(SDPBackend.MATH), model, batch),
    }
    for what, run in cases.items():
        hits, misses = _counts()
        run()
        assert _counts() == (hits, misses + 1), what


def _under(context, model, batch):
    with context:
        return annotate(capture(model, batch).gm, batch)


def test_a_measurement_on_real_tensors_is_never_kept():
    model, batch = build("tiny")
    gm = capture(model, batch).gm
    annotate(gm, batch, tensor_mode="real")
    hits, misses = _counts()
    annotate(gm, batch, tensor_mode="real")
    assert _counts() == (hits, misses + 1)


def test_without_the_switch_nothing_is_kept(monkeypatch):
    monkeypatch.delenv(export_memo.MEMO_ENV)
    model, batch = build("tiny")
    counts = _counts()
    for _ in range(2):
        annotate(capture(model, batch).gm, batch)
    assert _counts() == counts
