"""Device catalogue: peak rates and memory of the accelerators we plan for, and a CPU whose
rates are measured on the machine at hand.

Rates are dense bf16 (fp16 on V100) tensor-core peaks from the vendors' datasheets, the same
figures as ``tests/reference/paper_setups.json`` where it gives them. Achieved rates are a
fraction of peak; the default fractions per op class (:class:`Efficiency`) are:

* matrix products 0.75: large bf16 GEMMs in cuBLAS reach 70-80 % of the dense peak on A100
  and H100 (the Megatron-LM GPT runs of Narayanan et al. 2021 sustain 52 % of peak end to end,
  communication and bubbles included, so the GEMMs themselves run well above that);
* attention 0.5: FlashAttention-2 reaches 50-73 % of A100 peak in the forward and less in the
  backward (Dao 2023, sec. 4.1); FlashAttention-3 about 75 % of H100 peak forward (Shah et al.
  2024). 0.5 is the fwd+bwd average we assume;
* memory-bound ops 0.8 of the HBM bandwidth (STREAM-like copies reach 80-90 %).

They are priors: :mod:`vlmcompile.cost_models.calibrate` fits them to measured layer times.
Hopper GPUs (H100, H200) use :data:`HOPPER_EFFICIENCY`, calibrated to the Optimus paper's
measured layer times.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field, replace

from vlmcompile.ir.errors import ClusterError

GB = 10**9
GiB = 2**30


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of the peak rates that kernels of each op class achieve."""

    matmul: float = 0.75
    attention: float = 0.5
    memory: float = 0.8

    def __post_init__(self):
        for name in ("matmul", "attention", "memory"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} efficiency {value} is outside (0, 1]; it is a fraction of peak")


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    peak_flops_per_s: float
    """Dense tensor-core peak in the training dtype (bf16; fp16 on V100)."""
    mem_bytes: int
    mem_bw_bytes_per_s: float
    efficiency: Efficiency = field(default_factory=Efficiency)
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self):
        if self.peak_flops_per_s <= 0 or self.mem_bytes <= 0 or self.mem_bw_bytes_per_s <= 0:
            raise ValueError(
                f"device {self.name}: peak {self.peak_flops_per_s} FLOP/s, memory {self.mem_bytes} B and "
                f"bandwidth {self.mem_bw_bytes_per_s} B/s must all be positive"
            )

    def with_efficiency(self, efficiency: Efficiency) -> DeviceSpec:
        return replace(self, efficiency=efficiency)


HOPPER_EFFICIENCY = Efficiency(matmul=0.445)
"""H100 (and H200, the same compute) calibrated to measured layer times (issue 15): Optimus
section 2.3 measures a ViT-22B layer at ~1.4 ms forward and ~2.0 ms backward at microbatch 2,
TP 8 and 2048 tokens, 3.4 ms in all for 1.43e12 FLOP per GPU; with attention and memory-bound
ops at their priors, matrix products at 44.5 % of the dense peak give that sum (the 0.75 prior
gives 2.1 ms). We read the figures as the layer's kernels without its TP collectives, which
section 2.3 sets against 300 us TP bubbles; Table 5's step times, which the calibration was
not fitted to, come out within 11 % of the measured ones with it
(``benchmarks/fidelity.py``). Large cuBLAS GEMMs reach more on a bench; a training step's
GEMMs are TP-sliced (hidden / 8 wide) and run at the power-capped clock."""

DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("A100-40GB", 312e12, 40 * GB, 1.555e12, source="NVIDIA A100 datasheet (SXM4)"),
        DeviceSpec("A100-80GB", 312e12, 80 * GB, 2.0e12, source="NVIDIA A100 datasheet; paper_setups.json"),
        DeviceSpec(
            "H100-80GB",
            989e12,
            80 * GB,
            3.35e12,
            efficiency=HOPPER_EFFICIENCY,
            source="NVIDIA H100 SXM datasheet; paper_setups.json; efficiency calibrated (HOPPER_EFFICIENCY)",
        ),
        DeviceSpec(
            "H200",
            989e12,
            141 * GB,
            4.8e12,
            efficiency=HOPPER_EFFICIENCY,
            source="NVIDIA H200 SXM datasheet; the H100's compute, so its calibrated efficiency",
        ),
        DeviceSpec(
            "V100-16GB", 125e12, 16 * GB, 0.9e12, source="NVIDIA V100 SXM2 datasheet; paper_setups.json"
        ),
    )
}


def device(name: str, *, num_local_ranks: int = 1) -> DeviceSpec:
    """A catalogue device by name, or ``cpu`` measured here for ``num_local_ranks`` ranks sharing it."""
    if name == "cpu":
        return measure_cpu(num_local_ranks)
    if name not in DEVICES:
        raise ClusterError(f"unknown device {name!r}; choose one of {', '.join([*DEVICES, 'cpu'])}")
    return DEVICES[name]


@functools.cache
def measure_cpu(num_local_ranks: int = 1) -> DeviceSpec:
    """This machine's CPU as one of ``num_local_ranks`` ranks sharing it: the cores are split
    between the ranks, so the rates are measured with that many threads (fp32 GEMM for the
    peak, a large copy for the bandwidth) and the memory is divided."""
    import torch

    cores = os.cpu_count() or 1
    threads = max(1, cores // num_local_ranks)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        gemm_s = _best_time(lambda: torch.mm(a, b))
        src = torch.empty(16 * 2**20 // 4)
        dst = torch.empty_like(src)
        copy_s = _best_time(lambda: dst.copy_(src))
    finally:
        torch.set_num_threads(saved)
    total_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceSpec(
        "cpu",
        peak_flops_per_s=2 * n**3 / gemm_s,
        mem_bytes=total_mem // num_local_ranks,
        mem_bw_bytes_per_s=2 * src.numel() * 4 / copy_s,
        # Measured rates are achieved rates already: matmul and copies run at 1.0; the CPU flash
        # attention kernel is slower than a GEMM of the same FLOPs (calibrate to refine).
        efficiency=Efficiency(matmul=1.0, attention=0.5, memory=1.0),
        source=f"measured on this machine: {threads} threads of {cores} cores, the best of 15 fp32 GEMMs {n}^3 and 16 MiB copies",
    )


def _best_time(fn, repeats: int = 15) -> float:
    """The fastest of ``repeats`` runs: a peak rate is the best the machine did, and a shared
    machine's slow spells only ever lengthen a run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
