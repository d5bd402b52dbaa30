"""Calibration recovers the efficiencies that produced a set of layer times."""

import pytest

from vlmcompile.cost_models.calibrate import LayerMeasurement, calibrate
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.compute import layer_time
from vlmcompile.cost_models.hardware import Efficiency


def test_fit_recovers_the_efficiencies_behind_the_times(demo_graph):
    device = Cluster.preset("h100x8").device
    truth = device.with_efficiency(Efficiency(matmul=0.62, attention=0.41, memory=0.7))
    measured = []
    for layer in demo_graph.layers:
        t = layer_time(layer, truth)
        if t.fwd_s > 0:
            measured.append(LayerMeasurement(layer, t.fwd_s, t.bwd_s))
    report = calibrate(device, measured)
    e = report.device.efficiency
    assert (e.matmul, e.attention, e.memory) == pytest.approx((0.62, 0.41, 0.7), rel=1e-6)
    assert report.median_abs_error < 1e-9
    assert f"matmul 0.62 (prior {device.efficiency.matmul:.2f})" in str(report)


def test_a_host_overhead_per_layer_is_fitted_apart_from_the_efficiencies(demo_graph):
    # Layers timed one by one pay a launch-and-sync cost that swamps a norm's kernel: fitted
    # without a constant it drags the efficiencies; with one, both come back.
    device = Cluster.preset("h100x8").device
    truth = device.with_efficiency(Efficiency(matmul=0.55, attention=0.4, memory=0.6))
    overhead = 150e-6
    measured = [
        LayerMeasurement(layer, t.fwd_s + overhead, t.bwd_s + overhead)
        for layer in demo_graph.layers
        if (t := layer_time(layer, truth)).fwd_s > 0
    ]
    plain = calibrate(device, measured)
    assert plain.median_abs_error > 0.05 and plain.overhead_s is None
    report = calibrate(device, measured, host_overhead=True)
    e = report.device.efficiency
    assert (e.matmul, e.attention, e.memory) == pytest.approx((0.55, 0.4, 0.6), rel=1e-6)
    assert report.overhead_s == pytest.approx(overhead, rel=1e-6)
    assert report.median_abs_error < 1e-9 and "host overhead 150 us a layer" in str(report)


def test_classes_without_work_keep_their_prior(demo_graph):
    device = Cluster.preset("h100x8").device
    norm = demo_graph["llm.norm"]  # memory-bound only
    report = calibrate(device, [LayerMeasurement(norm, 1e-5, 2e-5)])
    # The fit works in 1 / efficiency, so the prior comes back to the last bit or so.
    assert report.device.efficiency.matmul == pytest.approx(device.efficiency.matmul, rel=1e-12)
    assert report.device.efficiency.attention == pytest.approx(device.efficiency.attention, rel=1e-12)


def test_bad_measurements_are_refused(demo_graph):
    device = Cluster.preset("h100x8").device
    with pytest.raises(ValueError, match="at least one"):
        calibrate(device, [])
    with pytest.raises(ValueError, match="must be positive"):
        calibrate(device, [LayerMeasurement(demo_graph["head"], 0.0, 1.0)])


def test_a_layer_measured_faster_than_the_peak_allows_is_clipped_to_the_peak(demo_graph):
    # A kernel cannot beat the peak: a fit that says so is noise, so the efficiencies the
    # measurement exercises stop at 1 and the prediction stays above the measurement.
    device = Cluster.preset("h100x8").device
    report = calibrate(device, [LayerMeasurement(demo_graph["llm.blocks.0"], 1e-12, 1e-12)])
    e = report.device.efficiency
    assert e.matmul == 1.0 and e.memory == 1.0
    assert all(err > 0 for err in report.relative_errors)
