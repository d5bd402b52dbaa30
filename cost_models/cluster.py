"""``Cluster``: how many devices, how they are grouped into nodes, and the links between them.

Presets are written ``<family>x<num_gpus>`` (``h100x512``, ``a100x32``, ``v100x64``) or
``cpu:<ranks>`` for local CPU ranks; :data:`PAPER_PRESETS` lists the clusters of the papers in
``tests/reference/paper_setups.json``. Link figures are per GPU and per direction; where a
paper does not give them, the assumption is written next to the family.

Ranks are laid out as Megatron-LM does (tensor-parallel fastest, then data-parallel, then
pipeline: rank = tp_rank + tp * (dp_rank + dp * pp_rank)), so a tensor-parallel group of at most
``gpus_per_node`` ranks stays inside one node, and data- and pipeline-parallel peers sit
``tp`` and ``tp * dp`` ranks apart.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from vlmcompile.cost_models.hardware import GB, DeviceSpec, device
from vlmcompile.cost_models.memory import MEMORY_RESERVE
from vlmcompile.ir.errors import ClusterError


@dataclass(frozen=True, slots=True)
class _Family:
    device: str
    gpus_per_node: int
    intra_bw: float
    inter_bw: float
    intra_latency_s: float
    inter_latency_s: float
    note: str


NVLINK4_ACHIEVED = 0.7
"""Share of NVLink 4's 450 GB/s that tensor-parallel collectives achieve, calibrated (issue 15):
Optimus section 2.2 measures a GPT-175B layer's TP all-gather / reduce-scatter at ~300 us on 8
H100s (100.7 MB gathered at microbatch 2, sequence 2048), where the full 450 GB/s gives 217 us
in our ring model; 70 % gives 301 us. NCCL's bus bandwidth at ~100 MB messages sits below its
large-message plateau, which is where a per-layer collective lives. A100 and V100 links keep
their nominal figures: no measurement of theirs to calibrate against."""

_FAMILIES = {
    "h100": _Family(
        "H100-80GB",
        8,
        NVLINK4_ACHIEVED * 450 * GB,
        50 * GB,
        3e-6,
        10e-6,
        "NVLink 450 GB/s per direction (paper_setups.json), of which NCCL's all-gather and reduce-scatter "
        "achieve 70 % (315 GB/s; see NVLINK4_ACHIEVED); between nodes we assume 8 x 400 Gb/s InfiniBand per "
        "node, one NIC per GPU (the Optimus paper says only 'RDMA')",
    ),
    "h200": _Family(
        "H200",
        8,
        NVLINK4_ACHIEVED * 450 * GB,
        50 * GB,
        3e-6,
        10e-6,
        "as h100: NVLink 4 at 70 % (315 GB/s), 400 Gb/s NIC per GPU",
    ),
    "a100": _Family(
        "A100-80GB",
        8,
        300 * GB,
        12.5 * GB,
        3e-6,
        10e-6,
        "NVLink 300 GB/s per direction; 4 x 200 Gb/s InfiniBand per node (OmniBal testbed) = 12.5 GB/s per GPU",
    ),
    "a100-40gb": _Family("A100-40GB", 8, 300 * GB, 25 * GB, 3e-6, 10e-6, "NVLink 3; 200 Gb/s NIC per GPU"),
    "v100": _Family(
        "V100-16GB",
        8,
        150 * GB,
        25e9 / 8 / 8,
        5e-6,
        30e-6,
        "p3.16xlarge (DistMM): NVLink 2 (6 links x 25 GB/s, counted 150 GB/s per direction); "
        "25 Gb/s between nodes, shared by the node's 8 GPUs",
    ),
}

PAPER_PRESETS = {
    "h100x64": "Optimus weak scaling, Model A",
    "h100x128": "Optimus weak scaling, Model B",
    "h100x256": "Optimus weak scaling, Model C",
    "h100x512": "Optimus weak scaling, Model D, and multi-encoder runs",
    "h100x1536": "Optimus strong scaling",
    "h100x2048": "Optimus strong scaling",
    "h100x3072": "Optimus strong scaling",
    "a100x8": "Optimus small single-node run",
    "a100x32": "OmniBal setups with tp x pp x dp = 32",
    "a100x64": "OmniBal setups with tp x pp x dp = 64",
    "v100x64": "DistMM testbed, 8 x p3.16xlarge",
}

_PRESET = re.compile(r"^(?P<family>[a-z0-9-]+?)x(?P<num>\d+)$")


@dataclass(frozen=True, slots=True)
class Cluster:
    """The machines a plan runs on. Bandwidths are per GPU and per direction."""

    name: str
    num_gpus: int
    gpus_per_node: int
    device: DeviceSpec
    intra_node_bw_bytes_per_s: float
    inter_node_bw_bytes_per_s: float
    intra_node_latency_s: float = 3e-6
    inter_node_latency_s: float = 10e-6
    note: str = ""
    ranks_on_this_machine: bool = False
    """Its ranks are processes on this machine (started by the local launcher, sharing its
    cores): a plan for it is meant to run here, on the runtime as it is."""

    def zero_stage(self, dp: int) -> int:
        """The ZeRO stage plans for this cluster use at data-parallel degree ``dp`` unless asked
        otherwise: ZeRO-1 on GPU clusters (Megatron-LM's distributed optimizer; our runtime's
        ``ZeroRedundancyOptimizer``); none on local ranks, which share one machine's memory (ask
        for it: ``PlanRequest.on(..., zero_stage=1)``), and none at DP = 1 (nothing to shard over)."""
        return 0 if self.ranks_on_this_machine or dp == 1 else 1

    def __post_init__(self):
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise ClusterError(
                f"cluster {self.name}: {self.num_gpus} GPUs and {self.gpus_per_node} per node; both must be >= 1"
            )
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ClusterError(
                f"cluster {self.name}: {self.num_gpus} GPUs do not fill nodes of {self.gpus_per_node}; "
                f"use a multiple of {self.gpus_per_node} (e.g. {self.num_gpus // self.gpus_per_node * self.gpus_per_node} "
                f"or {(self.num_gpus // self.gpus_per_node + 1) * self.gpus_per_node})"
            )
        if min(self.intra_node_bw_bytes_per_s, self.inter_node_bw_bytes_per_s) <= 0:
            raise ClusterError(f"cluster {self.name}: link bandwidths must be positive")
        if min(self.intra_node_latency_s, self.inter_node_latency_s) < 0:
            raise ClusterError(f"cluster {self.name}: link latencies must not be negative")

    def with_memory_cap(self, cap_bytes: float) -> Cluster:
        """The same cluster with every plan held to ``cap_bytes`` per rank: on GPUs a device whose
        usable memory (what is left of it after the allocator's reserve) is the cap, as on a GPU on
        which the model does not fit whole. On ranks of this machine the cap is the device: no
        CUDA context or caching allocator takes the reserve there, so it is kept for what the
        memory model misses (a few % on small models: ``benchmarks/memory_fidelity.py``), and
        a plan said to fit holds at most ``cap_bytes`` of tensors when run."""
        if not cap_bytes > 0:
            raise ClusterError(f"memory cap {cap_bytes} B per rank; give a positive size")
        mem_bytes = math.ceil(cap_bytes if self.ranks_on_this_machine else cap_bytes / (1 - MEMORY_RESERVE))
        note = f"{self.note}; " if self.note else ""
        return replace(
            self,
            device=replace(self.device, mem_bytes=mem_bytes),
            note=f"{note}plans held to {cap_bytes / 2**30:.2f} GiB per rank",
        )

    def with_peak(self, flops_per_s: float, why: str) -> Cluster:
        """The same cluster with its device's peak raised to ``flops_per_s`` (a measured peak
        that a profiled layer beat: MFU is work over the peak, so the peak is the best seen)."""
        if flops_per_s <= self.device.peak_flops_per_s:
            return self
        device = replace(self.device, peak_flops_per_s=flops_per_s, source=f"{self.device.source}; {why}")
        return replace(self, device=device)

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    @classmethod
    def preset(cls, name: str) -> Cluster:
        """``h100x512``, ``a100x8``, ``v100x64``, ... or ``cpu:2``; see the module docstring."""
        key = name.strip().lower()
        if key.startswith("cpu:"):
            return cls.local_cpu(_positive_int(key[4:], name))
        match = _PRESET.match(key)
        if not match or match["family"] not in _FAMILIES:
            raise ClusterError(
                f"unknown cluster preset {name!r}; use <family>x<GPUs> with family in "
                f"{', '.join(_FAMILIES)} (paper clusters: {', '.join(PAPER_PRESETS)}) or cpu:<ranks>"
            )
        fam = _FAMILIES[match["family"]]
        num = _positive_int(match["num"], name)
        return cls(
            name=key,
            num_gpus=num,
            gpus_per_node=min(fam.gpus_per_node, num),
            device=device(fam.device),
            intra_node_bw_bytes_per_s=fam.intra_bw,
            inter_node_bw_bytes_per_s=fam.inter_bw,
            intra_node_latency_s=fam.intra_latency_s,
            inter_node_latency_s=fam.inter_latency_s,
            note=fam.note,
        )

    @classmethod
    def local_cpu(cls, num_ranks: int) -> Cluster:
        """``num_ranks`` processes on this machine talking gloo over loopback."""
        return cls(
            name=f"cpu:{num_ranks}",
            num_gpus=num_ranks,
            gpus_per_node=num_ranks,
            device=device("cpu", num_local_ranks=num_ranks),
            # gloo over 127.0.0.1 moves a few GB/s between processes: an assumed figure, not measured
            # (see the note).
            intra_node_bw_bytes_per_s=2 * GB,
            inter_node_bw_bytes_per_s=2 * GB,
            intra_node_latency_s=50e-6,
            inter_node_latency_s=50e-6,
            note="local CPU ranks over gloo; device rates measured here, link figures assumed",
            ranks_on_this_machine=True,
        )

    def data_parallel_size(self, tp: int, pp: int) -> int:
        """GPUs / (tp x pp), or an error that says which sizes would divide."""
        for what, value in (("tensor-parallel", tp), ("pipeline-parallel", pp)):
            if value < 1:
                raise ClusterError(f"{what} size {value} must be >= 1")
        if self.num_gpus % (tp * pp):
            choices = [d for d in range(1, self.num_gpus + 1) if self.num_gpus % (tp * d) == 0][:12]
            raise ClusterError(
                f"tp x pp = {tp} x {pp} = {tp * pp} does not divide the {self.num_gpus} GPUs of {self.name}; "
                f"with tp={tp} choose pp in {choices}"
            )
        return self.num_gpus // (tp * pp)

    def check_tensor_parallel(self, tp: int) -> None:
        if tp > self.gpus_per_node:
            raise ClusterError(
                f"tensor-parallel size {tp} spans nodes of {self.gpus_per_node} GPUs on {self.name}; "
                f"use tp <= {self.gpus_per_node} (its collectives run on every layer)"
            )

    def group_link(self, size: int, stride: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group of ``size`` ranks ``stride`` apart: NVLink if the
        group fits in one node, else the per-GPU network link."""
        if self._same_node(size, stride):
            return self.intra_node_bw_bytes_per_s, self.intra_node_latency_s
        return self.inter_node_bw_bytes_per_s, self.inter_node_latency_s

    def _same_node(self, size: int, stride: int) -> bool:
        # Groups start at node-aligned ranks in the Megatron layout, so the span decides.
        return (size - 1) * stride + 1 <= self.gpus_per_node

    def __str__(self) -> str:
        d = self.device
        return (
            f"{self.name}: {self.num_gpus} x {d.name} ({self.num_nodes} node(s) of {self.gpus_per_node}); "
            f"{_rate(d.peak_flops_per_s)} peak, {d.mem_bytes / GB:.0f} GB, "
            f"links {self.intra_node_bw_bytes_per_s / GB:.0f} GB/s in node, "
            f"{self.inter_node_bw_bytes_per_s / GB:.2f} GB/s between nodes"
        )


def _positive_int(text: str, name: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ClusterError(f"cluster preset {name!r}: {text!r} is not a positive number of GPUs/ranks")
    return int(text)


def _rate(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.0f} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.0f} GFLOP/s"
