"""Capture: graph equals eager, every node tagged, regions detected, bad input named."""

import dataclasses
import operator
import re

import pytest
import torch
import torch.fx as fx
from torch import nn

from tests.models import ALL, build, needs_transformers
from tests.pipeline_helpers import even_plan
from vlmcompile import CaptureError, ModelError, Region, RegionError, SampleBatchError
from vlmcompile.graph.export import mark_runtime_checks
from vlmcompile.ir.meta_keys import (
    CAPTURE_OPTIONS_META,
    LAYER_META,
    LAYER_ORDER_META,
    REGION_META,
    RUNTIME_CHECK_META,
    SPECIALIZED_META,
)
from vlmcompile.passes.codegen.stages import codegen
from vlmcompile.passes.graph.annotate import annotate
from vlmcompile.passes.graph.capture import capture, layer_nodes


@pytest.mark.parametrize("name", ALL)
def test_a_captured_graph_runs_under_bf16_autocast_as_eager_does(name):
    """Export asserts the dtype and device it traced before every ``.to()``; the capture drops
    those checks (keeping the conversions), so a stage under bf16 autocast computes what eager
    computes under it (issue 65: "Tensor dtype mismatch! Expected: Float, Got: BFloat16")."""
    model, batch = build(name)
    gm = capture(model, batch).gm
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    with torch.autocast("cpu", torch.bfloat16):
        torch.manual_seed(0)
        expected = model(**batch)
        expected = expected if isinstance(expected, torch.Tensor) else expected.loss
        torch.manual_seed(0)
        got = gm(**batch)
    assert expected.dtype == got.dtype
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("name", ALL)
def test_captured_graph_equals_eager_and_tags_every_node(name):
    model, batch = build(name)
    result = capture(model, batch)
    torch.manual_seed(0)
    expected = model(**batch)
    expected = expected if isinstance(expected, torch.Tensor) else expected.loss
    torch.manual_seed(0)
    torch.testing.assert_close(result.gm(**batch), expected)
    assert result.report.numerics.startswith("equal to eager")
    for node in result.gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        assert node.meta[LAYER_META] in result.gm.meta[LAYER_ORDER_META], node
        assert isinstance(node.meta[REGION_META], Region), node
    regions = {lr.region for lr in result.report.layers}
    assert Region.VISION in regions and regions & {Region.LLM, Region.TEXT} and Region.HEAD in regions
    assert Region.OTHER not in regions


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("tiny", {"vision": 4, "projector": 1, "llm": 4, "head": 1}),
        ("tiny-two-encoder", {"vision": 8, "projector": 2, "llm": 4, "head": 1}),
        ("tiny-contrastive", {"vision": 4, "text": 4, "head": 1}),
    ],
)
def test_zoo_layers_per_region(name, expected):
    model, batch = build(name)
    result = capture(model, batch)
    counts: dict[str, int] = {}
    for lr in result.report.layers:
        counts[lr.region.value] = counts.get(lr.region.value, 0) + 1
    assert counts == expected
    assert result.report.method == "fx"


def test_zoo_blocks_are_single_leaf_nodes_and_export_path_agrees():
    model, batch = build("tiny")
    fx_result = capture(model, batch)
    assert [n.op for n in layer_nodes(fx_result.gm)["llm.blocks.1"]] == ["call_module"]
    export_result = capture(model, batch, method="export")
    assert export_result.report.method == "export"
    assert [lr.layer for lr in export_result.report.layers] == [lr.layer for lr in fx_result.report.layers]
    torch.testing.assert_close(export_result.gm(**batch), fx_result.gm(**batch))


@needs_transformers
@pytest.mark.hf
def test_transformers_llava_layers_and_regions():
    model, batch = build("hf-llava")
    report = capture(model, batch).report
    assert report.method == "export"
    by_layer = {lr.layer: lr.region for lr in report.layers}
    assert by_layer["model.vision_tower.encoder.layers.0"] is Region.VISION
    assert by_layer["model.multi_modal_projector"] is Region.PROJECTOR
    assert by_layer["model.language_model.layers.1"] is Region.LLM
    assert by_layer["lm_head"] is Region.HEAD
    assert report.runtime_checks  # export's runtime asserts are listed, and kept


def test_region_override_takes_precedence_and_is_reported():
    model, batch = build("tiny")
    report = capture(model, batch, region_overrides={"projectors.0": "vision"}).report
    projector = next(lr for lr in report.layers if lr.layer == "projectors.0")
    assert projector.region is Region.VISION and projector.source == "override"


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = nn.Linear(4, 4)
        self.llm = nn.Linear(4, 4)

    def forward(self, x):
        h = self.vision(x)
        if h.sum() > 0:  # data-dependent control flow
            h = h * 2
        return self.llm(h).mean()


def test_data_dependent_control_flow_names_the_operation_and_the_workaround():
    with pytest.raises(CaptureError) as err:
        capture(_Branchy(), {"x": torch.randn(2, 4)})
    message = str(err.value)
    # Both capture paths name the model's line: the file, the line number and its source.
    for path in ("fx:", "export:"):
        said = message.split(path, 1)[1]
        assert re.search(r'test_capture\.py", line \d+, in forward: `if h\.sum\(\) > 0:', said), message
    assert "Workarounds" in message and "torch.cond" in message


def test_sample_batch_keys_that_forward_does_not_take_are_named():
    model, batch = build("tiny")
    with pytest.raises(
        SampleBatchError,
        match=r"key 'images' is no argument of VLM.forward: did you mean 'pixel_values'\? \(its arguments: .*input_ids, "
        r"labels,.*pixel_values",
    ):
        capture(
            model,
            {"images": batch["pixel_values"], "input_ids": batch["input_ids"], "labels": batch["labels"]},
        )
    with pytest.raises(SampleBatchError, match=r"lacks \['labels'\]"):
        capture(model, {"pixel_values": batch["pixel_values"], "input_ids": batch["input_ids"]})
    with pytest.raises(SampleBatchError, match="give a dict"):
        capture(model, [batch["pixel_values"]])


class _Anonymous(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).mean()


def test_undetectable_regions_ask_for_an_override_with_an_example():
    with pytest.raises(RegionError, match=r"could not detect the regions.*region_overrides=\{'a': .*'b': "):
        capture(_Anonymous(), {"x": torch.randn(2, 4)})
    report = capture(
        _Anonymous(), {"x": torch.randn(2, 4)}, region_overrides={"a": "vision", "b": "llm"}
    ).report
    assert [lr.region for lr in report.layers] == [Region.VISION, Region.LLM]


class _NoParams(nn.Module):
    def forward(self, x):
        return x.sum()


def test_a_model_without_parameters_is_rejected():
    with pytest.raises(ModelError, match="no parameters"):
        capture(_NoParams(), {"x": torch.randn(2)})


def test_an_override_naming_a_missing_module_is_rejected():
    model, batch = build("tiny")
    with pytest.raises(RegionError, match=r"'encoder\.0'.*does not have.*close matches"):
        capture(model, batch, region_overrides={"encoder.0": "vision"})
    with pytest.raises(RegionError, match="unknown region"):
        capture(model, batch, region_overrides={"llm": "language"})


@needs_transformers
@pytest.mark.hf
def test_shapes_from_image_grids_specialise_the_capture_on_their_values():
    from vlmcompile import families

    model, batch = families.build_tiny("qwen2-vl")
    result = capture(model, batch)
    spec = result.report.specialized
    # torch.split(..., lengths.tolist()) on the grid; the rope index walks the token types.
    assert spec is not None and spec.keys == ("image_grid_thw", "mm_token_type_ids")
    assert "modeling_qwen2_vl.py" in spec.because and "lengths.tolist()" in spec.because
    assert "equal to eager" in result.report.numerics
    placeholders = {n.target for n in result.gm.graph.nodes if n.op == "placeholder"}
    assert "image_grid_thw" not in placeholders and "input_ids" in placeholders
    assert torch.equal(result.gm.meta[SPECIALIZED_META]["image_grid_thw"], batch["image_grid_thw"])


@pytest.mark.hf
def test_a_capture_at_another_batch_size_specialises_at_once_on_what_the_first_needed(monkeypatch):
    """Codegen captures an exported model again at its microbatch size: on the inputs the first
    capture specialised on, in one export, where trying the tiers again took three."""
    from vlmcompile import families
    from vlmcompile.graph import export as export_module
    from vlmcompile.ir.microbatch import rows_per_sample, take

    model, batch = families.build_tiny("qwen2-vl")
    real, calls = export_module.export_graph, []
    monkeypatch.setattr(export_module, "export_graph", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = capture(model, batch)
    keys = first.report.specialized.keys
    assert len(calls) == 3, "the plain export and the first tier fail, the second tier captures"
    calls.clear()
    one = take(batch, 0, 1, rows_per_sample(batch))
    options = first.gm.meta[CAPTURE_OPTIONS_META]  # what codegen captures again with
    assert options["specialise_first"] == keys
    again = capture(model, one, **options)
    assert len(calls) == 1
    assert again.report.specialized.keys == keys and "equal to eager" in again.report.numerics
    calls.clear()
    assert capture(model, one).report.specialized.keys == keys and len(calls) == 3


class _BranchOnValues(nn.Module):
    """Branches on a float value: no specialisation on integer inputs can capture it."""

    def __init__(self):
        super().__init__()
        self.vision = nn.Linear(4, 4)
        self.llm = nn.Linear(4, 4)

    def forward(self, x, sizes):
        h = self.vision(x).split(sizes.tolist())[0]
        if self.llm(h).sum() > 0:  # the line the error must name
            h = h * 2
        return h.sum()


def test_a_capture_failure_names_the_operation_and_the_models_line_with_the_cause_chained():
    batch = {"x": torch.randn(8, 4), "sizes": torch.tensor([3, 5])}
    with pytest.raises(CaptureError) as err:
        capture(_BranchOnValues(), batch, method="export")
    message = str(err.value)
    assert "GuardOnDataDependentSymNode" in message
    assert f'"{__file__}"' in message and "`if self.llm(h).sum() > 0:" in message
    assert err.value.__cause__ is not None  # the original traceback


def test_runtime_checks_and_what_only_they_read_are_marked_and_nothing_is_erased():
    graph = fx.Graph()
    x = graph.placeholder("x")
    enter = graph.call_function(torch._C._functorch._vmap_increment_nesting, (2, "error"))
    item = graph.call_function(torch.ops.aten._local_scalar_dense.default, (x,))
    ge = graph.call_function(operator.ge, (item, 0))
    check = graph.call_function(torch.ops.aten._assert_scalar.default, (ge, "u0 >= 0"))
    leave = graph.call_function(torch._C._functorch._vmap_decrement_nesting, ())
    graph.output(x)
    gm = fx.GraphModule(nn.Module(), graph)
    assert mark_runtime_checks(gm) == ("u0 >= 0",)
    assert {n for n in gm.graph.nodes if n.meta.get(RUNTIME_CHECK_META)} == {item, ge, check}
    assert [n for n in gm.graph.nodes if n.op == "call_function"] == [enter, item, ge, check, leave]


@needs_transformers
@pytest.mark.hf
def test_a_batch_that_breaks_the_models_own_check_fails_instead_of_training_wrong():
    model, batch = build("hf-llava")
    gm = capture(model, batch).gm
    ids = batch["input_ids"].clone()
    ids[1, 1] = 5  # sample 1 loses an image token: eager raises "image tokens do not match"
    bad = {**batch, "input_ids": ids}
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        model(**bad)
    with pytest.raises(RuntimeError, match="Runtime assertion failed"):
        gm(**bad)
    # The stage modules carry the check too (every layer of one stage, run in this process).
    plan = even_plan(annotate(gm, batch).layer_graph, pp=1, microbatch_size=2, global_batch=2)
    (stage,) = codegen(gm, plan).stages
    torch.testing.assert_close(stage((), batch), gm(**batch))
    with pytest.raises(RuntimeError, match="Runtime assertion failed"):
        stage((), bad)


def test_capture_does_not_need_real_weights():
    from vlmcompile import models

    model = models.build("tiny", device="meta")
    result = capture(model, models.sample_batch("tiny", device="meta"))
    assert "not checked" in result.report.numerics
    assert len(result.report.layers) == 10


@needs_transformers
@pytest.mark.hf
def test_python_values_in_the_batch_are_constants_of_the_graph():
    from vlmcompile import families

    model, batch = families.build_tiny("llava-next")
    batch["image_sizes"] = batch["image_sizes"].tolist()  # as a list: no per-sample rows to split
    result = capture(model, batch)
    placeholders = {str(n.target) for n in result.gm.graph.nodes if n.op == "placeholder"}
    assert placeholders == {"input_ids", "pixel_values", "labels"}
    assert "equal to eager" in result.report.numerics
    # Each sample alone would still get both sizes: the batch runs as one microbatch.
    split = result.report.loss_split
    assert split.verdict.value == "batch-coupled" and "does not run on one sample" in split.detail


class _PerSampleLengths(nn.Module):
    """Each sample uses its own number of rows: the loss splits by sample, but a graph
    specialised on one sample's length would be wrong for another's."""

    def __init__(self):
        super().__init__()
        self.vision = nn.Linear(4, 4)
        self.llm = nn.Linear(4, 1)

    def forward(self, x, lengths):
        losses = [self.llm(self.vision(x[i, : int(lengths[i, 0])])).mean() for i in range(len(x))]
        return torch.stack(losses).mean()


def test_a_graph_specialised_on_values_that_differ_between_samples_runs_as_one_microbatch():
    batch = {"x": torch.randn(2, 6, 4), "lengths": torch.tensor([[3], [5]])}
    report = capture(_PerSampleLengths(), batch, method="export").report
    assert report.specialized.keys == ("lengths",)
    assert report.loss_split.verdict.value == "batch-coupled"
    assert "['lengths'], whose values differ between the samples" in report.loss_split.detail
    same = capture(_PerSampleLengths(), {**batch, "lengths": torch.tensor([[4], [4]])}, method="export")
    assert same.report.loss_split.verdict.value == "per-sample"


def test_tensors_inside_python_values_are_refused():
    model, batch = build("tiny")
    with pytest.raises(SampleBatchError, match=r"batch\['pixel_values'\] is a list holding tensors"):
        capture(model, {**batch, "pixel_values": list(batch["pixel_values"])}, method="export")


class _ReturnsLoss(nn.Module):
    """A plain model whose forward returns its loss in one of the shapes users write."""

    def __init__(self, kind: str):
        super().__init__()
        self.vision, self.llm, self.kind = nn.Linear(8, 8), nn.Linear(8, 8), kind

    def forward(self, x, labels):
        loss = ((self.llm(self.vision(x)) - labels) ** 2).mean()
        if self.kind == "dict":
            return {"loss": loss, "logits": x}
        if self.kind == "dataclass":
            return _Output(loss=loss, logits=x)
        return loss, x


@dataclasses.dataclass
class _Output:
    loss: torch.Tensor
    logits: torch.Tensor


@pytest.mark.parametrize("kind", ["dict", "dataclass"])
def test_a_plain_model_returning_its_loss_in_a_dict_or_dataclass_is_captured_to_the_loss(kind):
    model = _ReturnsLoss(kind)
    batch = {"x": torch.randn(2, 8), "labels": torch.randn(2, 8)}
    result = capture(model, batch, region_overrides={"vision": "vision", "llm": "llm"})
    expected = model(**batch).loss if kind == "dataclass" else model(**batch)["loss"]
    torch.testing.assert_close(result.gm(**batch), expected)
    assert "equal to eager" in str(result.report)


def test_a_plain_model_returning_a_tuple_is_refused_naming_the_fix():
    batch = {"x": torch.randn(2, 8), "labels": torch.randn(2, 8)}
    with pytest.raises(ModelError, match="returned a tuple with no 'loss' in it; .* return the loss tensor"):
        capture(_ReturnsLoss("tuple"), batch, region_overrides={"vision": "vision", "llm": "llm"})
