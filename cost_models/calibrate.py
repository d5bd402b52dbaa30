"""Fit the per-op-class efficiencies of a device to measured layer times.

The compute model is linear in the inverse efficiencies (see :mod:`.compute`):

    t = (matmul FLOPs / peak) / e_matmul + (attention FLOPs / peak) / e_attention
        + (memory bytes / bandwidth) / e_memory

so a least-squares fit over measured forward and backward times of the annotated layers gives
1 / e per class. Classes the measurements do not exercise keep their prior; fitted values are
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
        )


def calibrate(device: DeviceSpec, measurements: Sequence[LayerMeasurement]) -> CalibrationReport:
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
    # Relative errors matter, not absolute ones: weight each row by 1 / measured time.
    w = 1.0 / t
    prior = device.efficiency
    inverse = np.array([1 / prior.matmul, 1 / prior.attention, 1 / prior.memory])
    used = x.sum(axis=0) > 0
    fit, *_ = np.linalg.lstsq(x[:, used] * w[:, None], t * w, rcond=None)
    inverse[used] = np.maximum(fit, 1.0)
    fitted = device.with_efficiency(Efficiency(*(1 / inverse)))
    errors = tuple(((x @ inverse) - t) / t)
    return CalibrationReport(fitted, prior, errors)
