"""Profile pass: measured layer times land on the LayerGraph and drive the cost model there only."""

from __future__ import annotations

import dataclasses

from tests.models import build
from vlmcompile.cost_models.compute import layer_time
from vlmcompile.cost_models.hardware import device
from vlmcompile.passes.graph.annotate import annotate
from vlmcompile.passes.graph.capture import capture
from vlmcompile.passes.graph.profile import profile


def test_every_layer_is_timed_and_the_cost_model_uses_the_times_on_that_device_only():
    model, batch = build("tiny", batch_size=2)
    gm = capture(model, batch).gm
    graph = annotate(gm, batch).layer_graph
    microbatch = {k: v[:1] for k, v in batch.items()}
    result = profile(gm, graph, microbatch, device_name="cpu", threads=1, repeats=3)
    layers = result.layer_graph.layers
    assert all(layer.measured and layer.measured[0] == "cpu" for layer in layers)
    assert all(layer.measured[1] > 0 and layer.measured[2] > 0 for layer in layers)
    # Times are per annotated batch (2 rows): twice the one-row measurement.
    m0 = result.report.measurements[0]
    assert layers[0].measured[1] == 2 * m0.fwd_s
    block = next(layer for layer in layers if "blocks.0" in layer.name)
    norm = next(layer for layer in layers if layer.name.endswith("norm"))
    assert block.measured[1] > norm.measured[1]

    cpu = device("cpu")
    t = layer_time(block, cpu, samples=0.5)
    assert abs(t.fwd_s - 0.5 * block.measured[1]) < 1e-12
    assert abs(t.bwd_s - 0.5 * block.measured[2]) < 1e-12
    roofline = layer_time(dataclasses.replace(block, measured=None), cpu, samples=0.5)
    assert layer_time(block, device("H100-80GB")) == layer_time(
        dataclasses.replace(block, measured=None), device("H100-80GB")
    )
    assert t != roofline
    assert "profile: " in str(result.report) and "blocks.0" in str(result.report)


def test_profiled_times_survive_the_json_round_trip(tmp_path):
    model, batch = build("tiny", batch_size=1)
    gm = capture(model, batch).gm
    graph = annotate(gm, batch).layer_graph
    profiled = profile(gm, graph, batch, repeats=1).layer_graph
    path = tmp_path / "layers.json"
    profiled.save(path)
    assert type(profiled).load(path).layers == profiled.layers


def test_the_profile_reports_its_rounds_spread_and_the_load_and_the_graph_keeps_the_spread():
    from vlmcompile.ir.meta_keys import PROFILE_SPREAD_META

    model, batch = build("tiny", batch_size=1)
    gm = capture(model, batch).gm
    graph = annotate(gm, batch).layer_graph
    result = profile(gm, graph, batch, device_name="cpu", threads=1, repeats=4)
    totals = result.report.round_totals_s
    assert len(totals) == 4 and all(t > 0 for t in totals)
    spread = result.layer_graph.meta[PROFILE_SPREAD_META]
    middle = sorted(totals)[1:3]
    assert abs(spread - (max(totals) - min(totals)) / (sum(middle) / 2)) < 1e-12
    assert abs(spread - result.report.spread) < 1e-12
    text = str(result.report)
    assert "4 rounds, each layer once a round" in text and "a spread of" in text and "load average" in text


def test_two_plans_closer_than_the_profiles_spread_are_called_a_tie_naming_both():
    """The plan search's choice between degrees is only as sure as the layer times: where the
    runner-up is within the profile's spread, a decision names both (else none)."""
    from vlmcompile.cost_models.cluster import Cluster
    from vlmcompile.ir.meta_keys import PROFILE_SPREAD_META
    from vlmcompile.passes.planning.policies import search_and_compare

    model, batch = build("tiny", batch_size=4)
    gm = capture(model, batch).gm
    graph = annotate(gm, batch).layer_graph
    cluster = Cluster.preset("cpu:2")

    def ties(spread):
        noisy = dataclasses.replace(graph, meta={**graph.meta, PROFILE_SPREAD_META: spread})
        run = search_and_compare(noisy, cluster, global_batch=4, progress=False)
        return run, [d.detail for d in run.plan.decisions if d.detail.startswith("within the noise")]

    run, found = ties(10.0)  # any runner-up is within a spread of 1000 %
    assert len(found) == 1, [d.detail for d in run.plan.decisions]
    assert str(run.plan.pipeline_parallel) in found[0] and found[0].count("ms") >= 2, found[0]
    assert ties(0.0)[1] == []
