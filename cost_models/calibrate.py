"""Fit the per-op-class efficiencies of a device to measured layer times.

The compute model is linear in the inverse efficiencies (see :mod:`.compute`):

    t = (matmul FLOPs / peak) / e_matmul + (attention FLOPs / peak) / e_attention
        + (memory bytes / bandwidth) / e_memory

so a least-squares fit over measured forward and backward times of the annotated layers gives
1 / e per class. Layers timed one by one (the profile pass) also pay the host's launch and sync
cost, which in training overlaps the GPU's work: ``host_overhead=True`` fits it as a constant per
layer and direction, reported apart and left out of the efficiencies (without it, a paper-width
model's norms and embeddings, all overhead, pull the matrix efficiency off its blocks'). Classes the measurements do not exercise keep their prior; fitted values are
clipped to (0, 1] (a kernel cannot beat the peak; a fit that says so is noise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vlmcompile.cost_models.compute import bwd_work, fwd_work
from vlmcompile.cost_models.hardware import DeviceSpec, Efficiency
from vlmcompile.ir.layer_graph import Layer


@dataclass(frozen=True, slots=True)
class LayerMeasurement:
    layer: Layer
    fwd_s: float
    bwd_s: float
    samples: float = 1.0
    """Microbatch size over the annotated batch size, as in the cost model."""


@dataclass(frozen=True, slots=True)
class CalibrationReport:
    device: DeviceSpec
    """The device with the fitted efficiencies."""
    prior: Efficiency
    relative_errors: tuple[float, ...]
    """(predicted - measured) / measured per measurement (forward, then backward) after the fit."""
    overhead_s: float | None = None
    """The fitted host overhead per layer and direction (None: not fitted)."""

    @property
    def median_abs_error(self) -> float:
        return float(np.median(np.abs(self.relative_errors))) if self.relative_errors else 0.0

    def __str__(self) -> str:
        e = self.device.efficiency
        return (
            f"calibrated {self.device.name}: matmul {e.matmul:.2f} (prior {self.prior.matmul:.2f}), attention "
            f"{e.attention:.2f} (prior {self.prior.attention:.2f}), memory {e.memory:.2f} (prior "
            f"{self.prior.memory:.2f}); median |error| {100 * self.median_abs_error:.1f} % over "
            f"{len(self.relative_errors)} measurements"
            + ("" if self.overhead_s is None else f", host overhead {1e6 * self.overhead_s:.0f} us a layer")
        )


def calibrate(
    device: DeviceSpec, measurements: Sequence[LayerMeasurement], *, host_overhead: bool = False
) -> CalibrationReport:
    if not measurements:
        raise ValueError("calibrate needs at least one measured layer")
    rows, times = [], []
    for m in measurements:
        if m.fwd_s <= 0 or m.bwd_s <= 0:
            raise ValueError(
                f"layer {m.layer.name}: measured times must be positive (fwd {m.fwd_s}, bwd {m.bwd_s})"
            )
        rows += [[m.samples * x for x in work(m.layer).base_seconds(device)] for work in (fwd_work, bwd_work)]
        times += [m.fwd_s, m.bwd_s]
    x, t = np.array(rows), np.array(times)
    if host_overhead:
        x = np.hstack([x, np.ones((len(t), 1))])
    # Relative errors matter, not absolute ones: weight each row by 1 / measured time.
    w = 1.0 / t
    prior = device.efficiency
    coefficients = np.array([1 / prior.matmul, 1 / prior.attention, 1 / prior.memory] + [0.0] * host_overhead)
    used = x.sum(axis=0) > 0
    fit, *_ = np.linalg.lstsq(x[:, used] * w[:, None], t * w, rcond=None)
    # Inverse efficiencies are at least 1 (no kernel beats the peak), an overhead at least 0.
    floor = np.array([1.0, 1.0, 1.0, 0.0][: len(coefficients)])
    coefficients[used] = np.maximum(fit, floor[used])
    fitted = device.with_efficiency(Efficiency(*(1 / coefficients[:3])))
    errors = tuple(((x @ coefficients) - t) / t)
    overhead = float(coefficients[3]) if host_overhead else None
    return CalibrationReport(fitted, prior, errors, overhead)
