"""LayerGraph: the IR every planning pass reads.

Layers in pipeline order, each with its region and costs; edges (a networkx DiGraph) carry
the bytes one layer sends another, so a two-encoder model shows two branches that meet at
the LLM. Boundary bytes say what a stage cut after a layer would send forward (activations)
and receive back (their gradients) - every value made at or before the cut and read after it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import networkx as nx
from tabulate import tabulate

from vlmcompile.ir.errors import ArgumentError
from vlmcompile.ir.regions import Region

SCHEMA = "vlmcompile.layer_graph"
SCHEMA_VERSION = 3
"""3: which layers are transformer blocks; 2: attention FLOPs and memory traffic per layer."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"

    @property
    def nbytes(self) -> int:
        import torch

        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class NodeCost:
    """What the annotate pass measured for one FX node."""

    outputs: tuple[TensorSpec, ...]
    fwd_flops: int
    bwd_flops: int
    saved_bytes: int
    """Bytes of storages first saved for backward while this node ran (parameters excluded)."""
    param_bytes: int = 0
    """Bytes of the parameters this node reads (a ``get_attr``, or a leaf module's own)."""
    fwd_attn_flops: int = 0
    bwd_attn_flops: int = 0
    fwd_mem_bytes: int = 0
    bwd_mem_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Layer:
    """One layer (a transformer block, an embedding, a projector, a head) and its costs."""

    index: int
    name: str
    region: Region
    num_nodes: int
    num_params: int
    param_bytes: int
    fwd_flops: int
    bwd_flops: int
    """Input-gradient and weight-gradient FLOPs together."""
    saved_bytes: int
    """Bytes saved for backward by this layer, without recompute (measured, parameters excluded)."""
    saved_bytes_recompute: int
    """Bytes this layer keeps with recompute: the inputs a non-reentrant checkpoint holds."""
    boundary_fwd_bytes: int
    """Bytes a stage cut right after this layer sends forward."""
    boundary_bwd_bytes: int
    """Bytes of gradients that cut receives back."""
    outputs: tuple[TensorSpec, ...] = ()
    """Tensors this layer hands to later layers or returns."""
    fwd_attn_flops: int = 0
    """The part of ``fwd_flops`` spent in attention kernels (the rest is matrix products)."""
    bwd_attn_flops: int = 0
    fwd_mem_bytes: int = 0
    """Bytes read and written by the forward's FLOP-free ops (norms, activations, softmax, adds,
    copies; views excluded): the memory-bound share of the layer's time."""
    bwd_mem_bytes: int = 0
    measured: tuple[str, float, float] | None = None
    """(device name, forward s, backward s) for the annotated batch, measured by the profile
    pass; the cost model uses them instead of the roofline on that device."""
    num_frozen_params: int = 0
    """The part of ``num_params`` with ``requires_grad=False``: no gradient, no optimizer state."""
    block: bool = False
    """A repeated transformer block (an element of a ModuleList holding a norm and a linear
    layer), told by the model's structure: decoder layers are the LLM's blocks, whatever their
    attention kernel (SDPA, flash or eager matmul + softmax) or name."""

    @property
    def trainable_share(self) -> float:
        """The share of its parameters that train (1.0 for a layer without parameters)."""
        return (self.num_params - self.num_frozen_params) / self.num_params if self.num_params else 1.0

    @property
    def weight_grad_flops(self) -> float:
        """The weight-gradient part of ``bwd_flops``: a GEMM per forward GEMM for the share of the
        parameters that train (autograd skips a frozen weight's); the rest is the input gradient."""
        fwd_matmul = self.fwd_flops - self.fwd_attn_flops
        return min(fwd_matmul, self.bwd_flops - self.bwd_attn_flops) * self.trainable_share

    def __post_init__(self):
        if not (0 <= self.fwd_attn_flops <= self.fwd_flops and 0 <= self.bwd_attn_flops <= self.bwd_flops):
            raise ValueError(
                f"layer {self.name}: attention FLOPs (fwd {self.fwd_attn_flops}, bwd {self.bwd_attn_flops}) "
                f"exceed the layer's (fwd {self.fwd_flops}, bwd {self.bwd_flops})"
            )
        if self.saved_bytes < 0 or self.fwd_flops < 0 or self.bwd_flops < 0:
            raise ValueError(
                f"layer {self.name}: negative cost (saved {self.saved_bytes}, fwd {self.fwd_flops}, bwd {self.bwd_flops})"
            )


@dataclass(frozen=True, slots=True)
class LayerGraph:
    layers: tuple[Layer, ...]
    edges: tuple[tuple[str, str, int], ...]
    """(producer layer, consumer layer, bytes) for every pair of layers that exchange values."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Where the figures come from: model name, batch shapes, tensor mode."""

    def __post_init__(self):
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate layer names: {sorted({n for n in names if names.count(n) > 1})}")
        for src, dst, _ in self.edges:
            if src not in names or dst not in names:
                raise ValueError(f"edge {src} -> {dst} names a layer the graph does not have")
            if names.index(src) >= names.index(dst):
                raise ValueError(f"edge {src} -> {dst} goes backwards in the layer order")

    def fingerprint(self) -> str:
        """Identifies the model a plan is for: its layers' names, regions and parameter counts
        (not the batch), as 16 hex digits."""
        text = ";".join(f"{layer.name}:{layer.region.value}:{layer.num_params}" for layer in self.layers)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def graph(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for layer in self.layers:
            g.add_node(layer.name, layer=layer)
        for src, dst, nbytes in self.edges:
            g.add_edge(src, dst, bytes=nbytes)
        return g

    def __getitem__(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer {name!r}; layers: {[layer.name for layer in self.layers][:8]}...")

    def __len__(self) -> int:
        return len(self.layers)

    def with_time_scaled(self, factors: Mapping[Region, float], why: str) -> LayerGraph:
        """The same layers with the work of those in ``factors``' regions scaled by their factor:
        FLOPs, memory traffic and measured times (what a layer's time is made of), its memory
        (saved bytes, boundaries, parameters) left as it is. A microbatch with ``f`` times the
        image rows costs an encoder layer about ``f`` times the time (linear: each image's
        attention is its own) and no more memory than the largest one the graph was annotated
        at. ``why`` goes into ``meta``."""
        layers = []
        for layer in self.layers:
            f = factors.get(layer.region)
            if f is None:
                layers.append(layer)
                continue
            measured = layer.measured
            if measured is not None:
                measured = (measured[0], measured[1] * f, measured[2] * f)
            layers.append(
                replace(
                    layer,
                    fwd_flops=round(layer.fwd_flops * f),
                    bwd_flops=round(layer.bwd_flops * f),
                    fwd_attn_flops=min(round(layer.fwd_attn_flops * f), round(layer.fwd_flops * f)),
                    bwd_attn_flops=min(round(layer.bwd_attn_flops * f), round(layer.bwd_flops * f)),
                    fwd_mem_bytes=round(layer.fwd_mem_bytes * f),
                    bwd_mem_bytes=round(layer.bwd_mem_bytes * f),
                    measured=measured,
                )
            )
        return LayerGraph(tuple(layers), self.edges, {**self.meta, "time_scaled": why})

    def in_region(self, *regions: Region) -> list[Layer]:
        return [layer for layer in self.layers if layer.region in regions]

    def trains_before(self) -> dict[str, bool]:
        """Per layer name: whether a layer before it has a trainable parameter (then the layer's
        input gradient is needed: the gradient flows on to that layer)."""
        out, seen = {}, False
        for layer in self.layers:
            out[layer.name] = seen
            seen = seen or layer.num_params > layer.num_frozen_params
        return out

    def forward_only(self) -> frozenset[str]:
        """Layers with no backward at all: nothing trainable in them or before them (a frozen
        encoder at the bottom of the graph; every layer of a model with nothing to train). No
        gradient reaches them, so their stages get no backward actions."""
        before = self.trains_before()
        return frozenset(
            layer.name
            for layer in self.layers
            if not before[layer.name] and layer.num_frozen_params == layer.num_params
        )

    def select(self, names: Iterable[str]) -> list[str]:
        """The layers ``names`` mean, in layer order: each name a region (``vision``, ``llm``, ...)
        or a module path, which takes the layers at or under it (``llm.blocks.3``, ``encoders.0``).

        Raises:
            ArgumentError: a name matches no layer (the message lists the regions and the closest
                layer names).
        """
        chosen: set[str] = set()
        for name in names:
            hit = {
                layer.name
                for layer in self.layers
                if layer.region.value == name or layer.name == name or layer.name.startswith(name + ".")
            }
            if not hit:
                regions = sorted({layer.region.value for layer in self.layers})
                close = difflib.get_close_matches(
                    name, [layer.name for layer in self.layers], n=3, cutoff=0.5
                )
                hint = f"; closest layers: {', '.join(close)}" if close else ""
                raise ArgumentError(
                    f"{name!r} names no layer of {self.meta.get('model', 'the model')}: give a region "
                    f"({', '.join(regions)}) or a module path of a layer or above one{hint}"
                )
            chosen |= hit
        return [layer.name for layer in self.layers if layer.name in chosen]

    def with_frozen(self, names: Iterable[str]) -> LayerGraph:
        """The same model with every parameter of the layers ``names`` (:meth:`select`) frozen
        (``requires_grad=False``), as a training recipe freezes a module, and the figures as the
        annotate pass measures them on a model so frozen: a frozen layer's backward loses its
        weight gradient, and a layer no gradient reaches (:meth:`forward_only`) has no backward
        and keeps nothing for one. What a frozen layer above a trainable one keeps stays as
        annotated (autograd may keep less once no weight gradient needs its input: an upper
        bound)."""
        chosen = set(self.select(names))
        layers = [
            _without_weight_gradient(layer)
            if layer.name in chosen and layer.num_frozen_params < layer.num_params
            else layer
            for layer in self.layers
        ]
        graph = LayerGraph(tuple(layers), self.edges, self.meta)
        no_gradient = graph.forward_only()
        layers = [_without_backward(layer) if layer.name in no_gradient else layer for layer in layers]
        frozen = [layer.name for layer in layers if layer.num_frozen_params]
        return LayerGraph(tuple(layers), self.edges, {**self.meta, "frozen": frozen})

    def fastest_measured_rate(self) -> float:
        """The highest FLOP rate (forward + backward) a profiled layer reached; 0 where none was
        profiled. A device's peak is at least this: MFU is work over the peak."""
        rates = [
            (layer.fwd_flops + layer.bwd_flops) / (layer.measured[1] + layer.measured[2])
            for layer in self.layers
            if layer.measured is not None and layer.measured[1] + layer.measured[2] > 0
        ]
        return max(rates, default=0.0)

    def totals(self, layers: Iterable[Layer] | None = None) -> dict[str, int]:
        chosen = list(self.layers if layers is None else layers)
        keys = (
            "num_params",
            "num_frozen_params",
            "param_bytes",
            "fwd_flops",
            "bwd_flops",
            "fwd_attn_flops",
            "fwd_mem_bytes",
            "saved_bytes",
            "saved_bytes_recompute",
        )
        return {k: sum(getattr(layer, k) for layer in chosen) for k in keys}

    def region_table(self) -> str:
        total_fwd = max(1, self.totals()["fwd_flops"])
        rows = []
        for region in Region:
            layers = self.in_region(region)
            if not layers:
                continue
            t = self.totals(layers)
            rows.append(
                [
                    region.value,
                    len(layers),
                    format_count(t["num_params"]),
                    format_count(t["num_params"] - t["num_frozen_params"]),
                    format_count(t["num_frozen_params"]),
                    _flops(t["fwd_flops"]),
                    _flops(t["bwd_flops"]),
                    f"{100 * t['fwd_flops'] / total_fwd:.1f}",
                    format_bytes(t["saved_bytes"]),
                    format_bytes(t["saved_bytes_recompute"]),
                ]
            )
        t = self.totals()
        rows.append(
            [
                "total",
                len(self.layers),
                format_count(t["num_params"]),
                format_count(t["num_params"] - t["num_frozen_params"]),
                format_count(t["num_frozen_params"]),
                _flops(t["fwd_flops"]),
                _flops(t["bwd_flops"]),
                "100.0",
                format_bytes(t["saved_bytes"]),
                format_bytes(t["saved_bytes_recompute"]),
            ]
        )
        return tabulate(
            rows,
            headers=[
                "region",
                "layers",
                "params",
                "trainable",
                "frozen",
                "fwd FLOPs",
                "bwd FLOPs",
                "fwd %",
                "saved",
                "saved w/ recompute",
            ],
            disable_numparse=True,
        )

    def layer_table(self, max_rows: int | None = None) -> str:
        rows = []
        layers = list(self.layers)
        shown = (
            layers
            if max_rows is None or len(layers) <= max_rows
            else layers[: max_rows // 2] + layers[-max_rows // 2 :]
        )
        for layer in shown:
            if max_rows is not None and len(layers) > max_rows and layer is layers[-max_rows // 2]:
                rows.append(
                    ["...", f"({len(layers) - len(shown)} more layers)", "", "", "", "", "", "", "", ""]
                )
            rows.append(
                [
                    layer.index,
                    layer.name,
                    layer.region.value,
                    format_count(layer.num_params),
                    _flops(layer.fwd_flops),
                    _flops(layer.bwd_flops),
                    format_bytes(layer.saved_bytes),
                    format_bytes(layer.saved_bytes_recompute),
                    format_bytes(layer.boundary_fwd_bytes),
                    ", ".join(str(o) for o in layer.outputs[:2]) + (" ..." if len(layer.outputs) > 2 else ""),
                ]
            )
        return tabulate(
            rows,
            headers=[
                "#",
                "layer",
                "region",
                "params",
                "fwd FLOPs",
                "bwd FLOPs",
                "saved",
                "saved w/ rc",
                "cut sends",
                "outputs",
            ],
            disable_numparse=True,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "meta": self.meta,
            "layers": [
                {
                    **asdict(layer),
                    "region": layer.region.value,
                    "outputs": [{"shape": list(o.shape), "dtype": o.dtype} for o in layer.outputs],
                }
                for layer in self.layers
            ],
            "edges": [{"src": s, "dst": d, "bytes": b} for s, d, b in self.edges],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerGraph:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a LayerGraph JSON (schema {data.get('schema')!r}, expected {SCHEMA!r})")
        if data.get("version") != SCHEMA_VERSION:
            raise ValueError(
                f"LayerGraph JSON version {data.get('version')} is not {SCHEMA_VERSION}; re-run "
                "`vlmcompile annotate` to regenerate it"
            )
        layers = tuple(
            Layer(
                **{
                    **d,
                    "region": Region(d["region"]),
                    "outputs": tuple(TensorSpec(tuple(o["shape"]), o["dtype"]) for o in d["outputs"]),
                    "measured": tuple(d["measured"]) if d.get("measured") else None,
                }
            )
            for d in data["layers"]
        )
        edges = tuple((e["src"], e["dst"], e["bytes"]) for e in data["edges"])
        return cls(layers=layers, edges=edges, meta=dict(data.get("meta", {})))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> LayerGraph:
        return cls.from_json(json.loads(Path(path).read_text()))


def _without_weight_gradient(layer: Layer) -> Layer:
    """``layer`` with every parameter frozen: its backward less the weight gradient of the share
    that trained (measured times scaled alike)."""
    bwd = layer.bwd_flops - round(layer.weight_grad_flops)
    measured = layer.measured
    if measured is not None and layer.bwd_flops:
        measured = (measured[0], measured[1], measured[2] * bwd / layer.bwd_flops)
    return replace(layer, num_frozen_params=layer.num_params, bwd_flops=bwd, measured=measured)


def _without_backward(layer: Layer) -> Layer:
    """``layer`` as annotated when no gradient reaches it: no backward work, nothing kept for one."""
    measured = layer.measured and (layer.measured[0], layer.measured[1], 0.0)
    return replace(
        layer,
        bwd_flops=0,
        bwd_attn_flops=0,
        bwd_mem_bytes=0,
        saved_bytes=0,
        saved_bytes_recompute=0,
        measured=measured,
    )


def format_count(n: float) -> str:
    """47.4 K, 10.0 M, 197.2 B: parameter counts at a glance."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def _flops(n: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def format_bytes(n: float) -> str:
    """1.50 GiB, 12.00 MiB, 512 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
