import json

import pytest

from tests.models import build
from vlmcompile.ir.layer_graph import SCHEMA_VERSION, Layer, LayerGraph
from vlmcompile.ir.regions import Region
from vlmcompile.passes.annotate import annotate
from vlmcompile.passes.capture import capture


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
