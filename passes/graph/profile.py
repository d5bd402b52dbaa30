"""Profile pass: measure every layer's forward and backward time on the device at hand, so the
cost model predicts runs on it (the CPU ranks of ``vlmcompile demo``, or a GPU).

Each layer runs as the module codegen makes of it, on the real values it receives when the
whole graph runs on one microbatch: a warm-up, then the median of ``repeats`` rounds over all
layers, each timing a forward and a forward + backward (gradients of random values flow into
its outputs). On a CPU the measurement uses ``threads`` threads, the share of the cores one
local rank gets. The result goes onto the LayerGraph (``Layer.measured``);
``cost_models.calibrate`` can fit the roofline's efficiencies to the same measurements for
layers and models not profiled.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from tabulate import tabulate

from vlmcompile.cost_models.calibrate import LayerMeasurement
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.meta_keys import PROFILE_SPREAD_META
from vlmcompile.passes.codegen.stages import layer_modules


@dataclass(frozen=True, slots=True)
class ProfileReport:
    device: str
    threads: int
    rows: int
    """Batch rows the layers were timed on (one microbatch)."""
    measurements: tuple[LayerMeasurement, ...]
    wall_s: float
    round_totals_s: tuple[float, ...] = ()
    """Each round's time over every layer (forward + backward): the spread of the figures."""
    load: tuple[float | None, float | None] = (None, None)
    """The machine's load average when the timing began and ended."""

    @property
    def spread(self) -> float:
        return spread(self.round_totals_s)

    def noise_line(self) -> str:
        """How steady the machine was: the rounds' totals and the load."""
        totals = self.round_totals_s
        if not totals:
            return ""
        began, ended = self.load
        load = f"; load average {began:.1f} -> {ended:.1f}" if began is not None and ended is not None else ""
        return (
            f"{len(totals)} rounds, each layer once a round: a round {1e3 * min(totals):.1f} .. "
            f"{1e3 * max(totals):.1f} ms (median {1e3 * statistics.median(totals):.1f}), a spread of "
            f"{100 * self.spread:.0f} %{load}; the medians are kept"
        )

    def __str__(self) -> str:
        rows = [
            [m.layer.name, m.layer.region.value, f"{1e3 * m.fwd_s:.2f}", f"{1e3 * m.bwd_s:.2f}"]
            for m in self.measurements
        ]
        total_f = sum(m.fwd_s for m in self.measurements)
        total_b = sum(m.bwd_s for m in self.measurements)
        head = (
            f"profile: {len(rows)} layers on {self.device} ({self.threads} thread(s)), microbatch of "
            f"{self.rows} rows, in {self.wall_s:.1f} s; forward {1e3 * total_f:.1f} ms, backward "
            f"{1e3 * total_b:.1f} ms"
        )
        noise = self.noise_line()
        head += f"\n{noise}" if noise else ""
        return head + "\n" + tabulate(rows, headers=["layer", "region", "fwd ms", "bwd ms"])


@dataclass(frozen=True, slots=True)
class ProfileResult:
    layer_graph: LayerGraph
    """The input LayerGraph with ``measured`` set on every layer."""
    report: ProfileReport


def _node_values(gm: fx.GraphModule, microbatch: Mapping[str, Any]) -> dict[str, Any]:
    """Every node's value when the graph runs on ``microbatch``."""
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.no_grad():
        Recorder(gm).run(*[microbatch[n.target] for n in gm.graph.nodes if n.op == "placeholder"])
    return values


def _timed_s(fn, sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()  # a GPU runs the kernels after the call returns
    return time.perf_counter() - start


def _no_sync() -> None:
    pass


def _layer_runs(module: fx.GraphModule, leaves: list[Any]) -> tuple[Callable[[], Any], Callable[[], None]]:
    """(a forward, a forward + backward) of one layer on its real inputs."""
    with torch.no_grad():
        grads = [
            torch.randn_like(o) if isinstance(o, torch.Tensor) and o.is_floating_point() else None
            for o in module(*leaves)
        ]

    def forward_backward():
        pairs = [(o, g) for o, g in zip(module(*leaves), grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    return (lambda: module(*leaves)), forward_backward


def spread(round_totals_s: tuple[float, ...]) -> float:
    """(slowest - fastest round) / median round: how far a plan's times may move with the
    machine's load while it is profiled (0 without rounds)."""
    totals = round_totals_s
    return (max(totals) - min(totals)) / statistics.median(totals) if totals else 0.0


@dataclass(frozen=True, slots=True)
class Timings:
    """Every layer's (forward s, backward s), the median of the rounds; and the spread of the
    rounds' totals (one round times every layer once, so a round is one snapshot of the
    machine's speed)."""

    layers: tuple[tuple[float, float], ...]
    round_totals_s: tuple[float, ...]
    """Each round's forward + backward time over every layer, in order."""

    @property
    def spread(self) -> float:
        return spread(self.round_totals_s)


def _time_layers(
    runs: list[tuple[Callable, Callable]], repeats: int, sync: Callable[[], None] = _no_sync
) -> Timings:
    """Every layer timed in ``repeats`` rounds; the backward is a forward + backward run less
    the forward.

    Rounds go over every layer in turn, not layer after layer: a shared machine's speed drifts
    over seconds, and round-robin spreads a slow spell over all layers instead of inflating
    the few timed during it (which would move the stage cuts)."""
    for forward, forward_backward in runs:  # warm-up: allocator, kernel selection
        forward()
        forward_backward()
    fwd: list[list[float]] = [[] for _ in runs]
    both: list[list[float]] = [[] for _ in runs]
    totals = []
    for _ in range(repeats):
        total = 0.0
        for k, (forward, forward_backward) in enumerate(runs):
            fwd[k].append(_timed_s(forward, sync))
            both[k].append(_timed_s(forward_backward, sync))
            total += both[k][-1]
        totals.append(total)
    out = []
    for f, b in zip(fwd, both):
        fwd_s = statistics.median(f)
        # Timer noise can make a tiny layer's difference negative; keep a floor.
        out.append((fwd_s, max(statistics.median(b) - fwd_s, 0.05 * fwd_s)))
    return Timings(tuple(out), tuple(totals))


def profile(
    gm: fx.GraphModule,
    layer_graph: LayerGraph,
    microbatch: Mapping[str, Any],
    *,
    device_name: str = "cpu",
    threads: int = 1,
    repeats: int = 5,
) -> ProfileResult:
    """Time every layer of ``gm`` on ``microbatch`` (real tensors on the device to measure, with
    ``gm``'s parameters there too; on a GPU each timing waits for the kernels).

    Args:
        device_name: the ``DeviceSpec.name`` the times hold for (the cost model uses them there only).
        threads: CPU threads during the measurement (a local rank's share of the cores).
        repeats: timed runs per layer and direction; the median is kept.
    """
    tensor = next(v for v in microbatch.values() if isinstance(v, torch.Tensor))
    rows = tensor.shape[0]
    sync = torch.cuda.synchronize if tensor.is_cuda else _no_sync
    per_batch = layer_graph.meta.get("batch_size", 1) / rows
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    start = time.perf_counter()
    try:
        values = _node_values(gm, microbatch)
        runs = []
        for module, inputs, _ in layer_modules(gm):
            leaves = [
                a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                for a in (values[n] for n in inputs)
            ]
            runs.append(_layer_runs(module, leaves))
        load = _load()
        timings = _time_layers(runs, repeats, sync)
        measurements = [
            LayerMeasurement(layer, fwd_s, bwd_s, samples=1 / per_batch)
            for layer, (fwd_s, bwd_s) in zip(layer_graph.layers, timings.layers)
        ]
    finally:
        torch.set_num_threads(saved_threads)
    wall = time.perf_counter() - start
    layers = tuple(
        dataclasses.replace(m.layer, measured=(device_name, m.fwd_s * per_batch, m.bwd_s * per_batch))
        for m in measurements
    )
    meta = {**layer_graph.meta, "profiled_on": device_name, PROFILE_SPREAD_META: timings.spread}
    graph = dataclasses.replace(layer_graph, layers=layers, meta=meta)
    report = ProfileReport(
        device_name, threads, rows, tuple(measurements), wall, timings.round_totals_s, (load, _load())
    )
    return ProfileResult(graph, report)


def _load() -> float | None:
    """The machine's 1-minute load average (None where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None
