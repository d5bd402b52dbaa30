import dataclasses
import json

import pytest

from tests.models import build
from vlmcompile.ir.layer_graph import SCHEMA_VERSION, Layer, LayerGraph
from vlmcompile.ir.regions import Region
from vlmcompile.passes.graph.annotate import annotate
from vlmcompile.passes.graph.capture import capture


@pytest.fixture(scope="module")
def graph() -> LayerGraph:
    model, batch = build("tiny-two-encoder")
    return annotate(capture(model, batch).gm, batch).layer_graph


def test_json_round_trip_is_lossless(graph, tmp_path):
    path = tmp_path / "layers.json"
    graph.save(path)
    loaded = LayerGraph.load(path)
    assert loaded.layers == graph.layers
    assert loaded.edges == graph.edges
    assert json.loads(path.read_text())["schema"] == "vlmcompile.layer_graph"


def test_an_old_schema_version_is_rejected_with_the_fix(graph):
    data = graph.to_json()
    data["version"] = 0
    with pytest.raises(ValueError, match=f"version 0 is not {SCHEMA_VERSION}; re-run `vlmcompile annotate`"):
        LayerGraph.from_json(data)
    with pytest.raises(ValueError, match="not a LayerGraph JSON"):
        LayerGraph.from_json({"schema": "something"})


def test_tables_show_every_region_and_layer(graph):
    regions = graph.region_table()
    for name in ("vision", "projector", "llm", "head", "total"):
        assert name in regions
    layers = graph.layer_table()
    assert all(layer.name in layers for layer in graph.layers)
    short = graph.layer_table(max_rows=6)
    assert "more layers" in short


def test_edges_only_go_forward():
    layer = Layer(
        index=0,
        name="a",
        region=Region.LLM,
        num_nodes=1,
        num_params=0,
        param_bytes=0,
        fwd_flops=0,
        bwd_flops=0,
        saved_bytes=0,
        saved_bytes_recompute=0,
        boundary_fwd_bytes=0,
        boundary_bwd_bytes=0,
    )
    other = Layer(**{**{f: getattr(layer, f) for f in layer.__slots__}, "index": 1, "name": "b"})
    with pytest.raises(ValueError, match="goes backwards"):
        LayerGraph(layers=(layer, other), edges=(("b", "a", 4),))


def test_time_scaled_scales_the_work_of_the_regions_named_and_nothing_else(graph):
    measured = LayerGraph(
        tuple(
            dataclasses.replace(layer, measured=("cpu", 1e-3, 2e-3))
            if layer.region is Region.VISION
            else layer
            for layer in graph.layers
        ),
        graph.edges,
        graph.meta,
    )
    scaled = measured.with_time_scaled({Region.VISION: 0.5}, "half the images")
    assert scaled.meta["time_scaled"] == "half the images" and scaled.fingerprint() == graph.fingerprint()
    for before, after in zip(measured.layers, scaled.layers):
        if before.region is Region.VISION:
            assert after.fwd_flops == round(before.fwd_flops * 0.5) and after.bwd_flops == round(
                before.bwd_flops * 0.5
            )
            assert after.fwd_mem_bytes == round(before.fwd_mem_bytes * 0.5)
            assert after.measured == ("cpu", 0.5e-3, 1e-3)
        else:
            assert after == before
        # Memory stays the largest microbatch's: the plan must fit it.
        assert (after.saved_bytes, after.boundary_fwd_bytes, after.param_bytes) == (
            before.saved_bytes,
            before.boundary_fwd_bytes,
            before.param_bytes,
        )


def test_select_takes_regions_and_module_paths_in_layer_order(graph):
    assert graph.select(["projector"]) == ["projectors.0", "projectors.1"]
    assert graph.select(["encoders.1", "llm.blocks.0"]) == [
        "encoders.1.embed",
        "encoders.1.blocks.0",
        "encoders.1.blocks.1",
        "encoders.1.norm",
        "llm.blocks.0",
    ]
    # A path component is whole: "encoders.1.blocks.1" is not under "encoders.1.blocks.1x".
    assert graph.select(["encoders.0.blocks.1"]) == ["encoders.0.blocks.1"]


def test_an_unknown_name_is_refused_naming_the_regions_and_the_closest_layers(graph):
    from vlmcompile.ir.errors import ArgumentError

    with pytest.raises(ArgumentError, match=r"'encoders.0.block' names no layer.*vision.*closest layers"):
        graph.select(["encoders.0.block"])


def test_a_frozen_encoder_at_the_bottom_has_no_backward_but_one_after_a_trainable_layer_has(graph):
    assert graph.forward_only() == frozenset(), "every layer trains"
    first = graph.with_frozen(["encoders.0"])
    assert first.forward_only() == {layer.name for layer in graph.layers[:4]}
    assert first.totals()["num_frozen_params"] == sum(layer.num_params for layer in graph.layers[:4])
    assert first.meta["frozen"] == [layer.name for layer in graph.layers[:4]]
    # The second encoder comes after the first's trainable projector in the chain: gradients
    # flow through it (the chain's order is what the stages follow), so it keeps a backward.
    second = graph.with_frozen(["encoders.1"])
    assert second.forward_only() == frozenset()
    assert second.trains_before()["encoders.1.embed"]
    everything = graph.with_frozen(["vision", "projector", "llm", "head"])
    assert everything.forward_only() == {layer.name for layer in graph.layers}
