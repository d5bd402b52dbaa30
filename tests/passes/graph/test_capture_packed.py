"""Capture for samples of different shapes: bad samples refused naming them, and compile planning
for a dataset or a manifest. (That the one capture holds for microbatches it never saw is tested
on every family in tests/runtime/test_packed_pipeline.py, whose pipelines compile once.)"""

import pytest
import torch

from tests.models import needs_transformers
from vlmcompile import families
from vlmcompile.data.synthetic import SyntheticDataset
from vlmcompile.ir.errors import DataError
from vlmcompile.passes.graph.capture_packed import capture_packed

pytestmark = [needs_transformers, pytest.mark.hf]


def _model(name):
    return families.build_tiny_by_name(name, batch=1)[0]


def _samples(family, seed, count=6):
    data = SyntheticDataset(
        "interleaved", family, 64, seed=seed, text_only=0.3, text_scale=1 / 30, pixel_scale=28 / 640
    )
    return [data[i] for i in range(count)]


def test_bad_samples_are_refused_naming_them():
    model = _model("hf-llava")
    family = families.layout_of(model)
    good = _samples(family, seed=1, count=3)
    with pytest.raises(DataError, match="the sample list is empty"):
        capture_packed(model, [])
    with pytest.raises(DataError, match="sample 1 is a Tensor"):
        capture_packed(model, [good[0], torch.zeros(3)])
    broken = dict(good[0], input_ids=good[0]["input_ids"].clone())
    broken["input_ids"][0, -1] = family.image_token_id  # one image token too many
    with pytest.raises(DataError, match="sample 1 has .* image tokens"):
        capture_packed(model, [good[1], broken])
    foreign = dict(good[0], image_grid_thw=torch.tensor([[1, 2, 2]]))
    with pytest.raises(DataError, match="another model family"):
        capture_packed(model, [foreign])
    with pytest.raises(DataError, match="sample 0 takes .* LLM tokens, more than a microbatch's 4"):
        capture_packed(model, good, tokens=4)


def test_a_model_without_a_sample_layout_is_refused():
    from vlmcompile import models

    model = models.build("tiny-contrastive")
    with pytest.raises(DataError, match="no sample layout for ContrastivePair .*give one batch dict"):
        capture_packed(model, [{"input_ids": torch.ones(1, 4, dtype=torch.long)}])


def test_compile_plans_for_a_dataset_or_a_manifest(tmp_path):
    import json

    from vlmcompile import compile
    from vlmcompile.ir.plan import Reason
    from vlmcompile.planning.request import SearchSpace

    model = _model("hf-qwen2-vl")
    family = families.layout_of(model)
    data = SyntheticDataset(
        "qwen-native", family, 60, seed=1, text_only=0.1, text_scale=1 / 30, pixel_scale=1 / 16
    )
    space = SearchSpace(pp_choices=(2,))
    pipe = compile(model, dataset=data, cluster="cpu:2", global_batch=12, search_space=space, log=None)
    found = pipe.report.passes["data"]
    assert found.scanned == 60 and pipe.packed.tokens == found.tokens
    assert pipe.plan.num_microbatches == found.microbatches
    assert any(d.reason is Reason.PACKED for d in pipe.plan.decisions)
    # Captured at the largest microbatch the scan packed: the memory plan's worst case.
    assert pipe.sample_batch["pixel_values"].shape[0] == found.image_rows.max
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "\n".join(json.dumps({"text_tokens": 5 + i, "images": [[56, 84]] * (i % 2)}) for i in range(12))
    )
    pipe = compile(
        model, dataset=str(manifest), cluster="cpu:2", global_batch=4, search_space=space, log=None
    )
    assert pipe.report.passes["data"].of == 12


def test_compile_refuses_what_it_cannot_plan_for(tmp_path):
    from vlmcompile import compile
    from vlmcompile.ir.errors import VlmCompileError

    model = _model("hf-llava")
    family = families.layout_of(model)
    data = SyntheticDataset("llava-chat", family, 8, text_scale=1 / 30, pixel_scale=28 / 640)
    with pytest.raises(VlmCompileError, match="give a sample batch"):
        compile(model, log=None)
    with pytest.raises(VlmCompileError, match="not both"):
        compile(model, [data[0]], dataset=data, global_batch=2, log=None)
    with pytest.raises(VlmCompileError, match="needs global_batch="):
        compile(model, dataset=data, log=None)
    with pytest.raises(DataError, match="the dataset is empty"):
        compile(model, dataset=[], global_batch=2, log=None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text_tokens": -3}\n')
    with pytest.raises(DataError, match="bad.jsonl:1: text_tokens=-3"):
        compile(model, dataset=str(bad), global_batch=2, log=None)
    qwen = families.layout_of(_model("hf-qwen2-vl"))
    other = SyntheticDataset("qwen-native", qwen, 8, text_scale=1 / 30, pixel_scale=1 / 16)
    with pytest.raises(DataError, match="another model family"):
        compile(model, dataset=other, global_batch=2, log=None)


def _released_layout(name, device):
    """Qwen2.5-VL with the released models' vision windows (56 px over 14 px patches: 2 x 2 merge
    units a window, which the window index reorders; layer 1 full attention), or Qwen3-VL with its
    default vision attention, deepstack features and learned position table."""
    from vlmcompile.families.qwen2_5_vl import tiny as qwen2_5_vl

    if name == "qwen2.5-vl":
        return qwen2_5_vl(1, device=device, patch_size=14, window_size=56)[0], 1 / 8
    return families.build_tiny("qwen3-vl", batch=1, device=device)[0], 1 / 16


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3-vl"])
def test_qwen_as_released_captures_once(name, device):
    """The configurations whose capture stopped at a data-dependent guard (``int(grid_t)`` in the
    window index, ``lengths.tolist()`` in the vision attention): one capture, equal to eager on
    every packed microbatch (on real weights), with real and meta weights alike."""
    model, scale = _released_layout(name, device)
    family = families.layout_of(model)
    data = SyntheticDataset(
        "qwen-native", family, 24, seed=3, text_only=0.2, text_scale=1 / 30, pixel_scale=scale
    )
    samples = [data[i] for i in range(8)]
    result = capture_packed(model, samples)
    grids = [g for s in samples if "image_grid_thw" in s for g in s["image_grid_thw"].tolist()]
    assert max(h * w for _, h, w in grids) > 16  # images of several windows (a window is 4 x 4 patches)
    report = str(result.report)
    assert "captured once" in report and len(result.packing.microbatches) > 1
    if device == "cpu":
        assert "numerics: equal to eager" in report and "max abs diff" in report, report
    else:
        assert "not checked (meta tensors hold no values)" in report
