"""Layer compute time: a roofline per op class, summed over the classes.

A layer runs its kernels one after another, so its time is the sum over op classes of the
work of that class over the achieved rate (:class:`~vlmcompile.cost_models.hardware.Efficiency`):

    t = matmul FLOPs / (peak * e_matmul) + attention FLOPs / (peak * e_attention)
        + memory-bound bytes / (HBM bandwidth * e_memory)

FLOPs and bytes come from the annotate pass (attention kernels and FLOP-free ops measured
apart). Work is scaled by ``samples`` (microbatch size / annotated batch size: every figure
is per sample) and divided by the tensor-parallel size for sharded layers.

Backward split (zero-bubble schedules run the halves apart): every weight matrix needs one
GEMM of its forward's size for its gradient (W); everything else - the input-gradient GEMMs,
the attention backward and the FLOP-free backward ops - is the input gradient (I).

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019; Korthikanti et al. 2022): blocks
with attention shard their matrices and attention heads; without sequence parallelism the
norms, dropouts and residual adds run replicated on every TP rank - 10 of the 34 sbh bytes
per layer in Korthikanti et al.'s count (their eq. 2), which we also take as the replicated
share of memory traffic and saved activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmcompile.cost_models.hardware import DeviceSpec
from vlmcompile.ir.layer_graph import Layer

REPLICATED_SHARE_WITHOUT_SP = 10 / 34
"""Share of a transformer layer's activations outside the TP-sharded regions (Korthikanti et
al. 2022, eq. 2: 10 sbh of 34 sbh + 5 a s^2 b)."""


@dataclass(frozen=True, slots=True)
class Work:
    """A pass's work per op class: what the roofline divides by the achieved rates."""

    matmul_flops: float
    attention_flops: float
    memory_bytes: float

    def base_seconds(self, device: DeviceSpec) -> tuple[float, float, float]:
        """Seconds per class at the peak rates (efficiency 1): time = sum of these / efficiency."""
        peak, bw = device.peak_flops_per_s, device.mem_bw_bytes_per_s
        return self.matmul_flops / peak, self.attention_flops / peak, self.memory_bytes / bw

    def seconds(self, device: DeviceSpec) -> float:
        eff = device.efficiency
        matmul, attention, memory = self.base_seconds(device)
        return matmul / eff.matmul + attention / eff.attention + memory / eff.memory


def fwd_work(layer: Layer) -> Work:
    return Work(layer.fwd_flops - layer.fwd_attn_flops, layer.fwd_attn_flops, layer.fwd_mem_bytes)


def bwd_work(layer: Layer) -> Work:
    return Work(layer.bwd_flops - layer.bwd_attn_flops, layer.bwd_attn_flops, layer.bwd_mem_bytes)


@dataclass(frozen=True, slots=True)
class LayerTime:
    """Seconds of compute one layer takes on one microbatch on one TP rank."""

    fwd_s: float
    input_grad_s: float
    weight_grad_s: float
    fwd_attention_s: float
    """The attention kernels' part of ``fwd_s`` (what selective recompute runs again)."""

    @property
    def bwd_s(self) -> float:
        return self.input_grad_s + self.weight_grad_s


def is_tensor_parallel(layer: Layer) -> bool:
    """Megatron shards matrix products and weight matrices (vocab-parallel embedding, column/row
    parallel linears); norms - parameters no wider than twice their output - stay replicated."""
    width = max((o.shape[-1] for o in layer.outputs if o.shape), default=0)
    return layer.fwd_flops > 0 or layer.num_params > 2 * max(width, 1)


def sharded_share(layer: Layer, tp: int, sequence_parallel: bool) -> float:
    """Share of a layer's memory-bound work and activations one TP rank holds."""
    if tp == 1 or not is_tensor_parallel(layer):
        return 1.0 / tp if sequence_parallel and tp > 1 else 1.0
    if sequence_parallel:
        return 1.0 / tp
    return REPLICATED_SHARE_WITHOUT_SP + (1 - REPLICATED_SHARE_WITHOUT_SP) / tp


def layer_time(
    layer: Layer, device: DeviceSpec, *, samples: float = 1.0, tp: int = 1, sequence_parallel: bool = True
) -> LayerTime:
    flop_div = tp if is_tensor_parallel(layer) else 1
    mem_share = sharded_share(layer, tp, sequence_parallel)

    def on_rank(w: Work) -> Work:
        return Work(
            samples * w.matmul_flops / flop_div,
            samples * w.attention_flops / flop_div,
            samples * w.memory_bytes * mem_share,
        )

    fwd, bwd = on_rank(fwd_work(layer)), on_rank(bwd_work(layer))
    weight_grad = Work(samples * layer.weight_grad_flops / flop_div, 0.0, 0.0)
    input_grad = Work(bwd.matmul_flops - weight_grad.matmul_flops, bwd.attention_flops, bwd.memory_bytes)
    roofline = LayerTime(
        fwd_s=fwd.seconds(device),
        input_grad_s=input_grad.seconds(device),
        weight_grad_s=weight_grad.seconds(device),
        fwd_attention_s=Work(0.0, fwd.attention_flops, 0.0).seconds(device),
    )
    if layer.measured is None or layer.measured[0] != device.name:
        return roofline
    # Measured on this device (profile pass): the times are the layer's, the roofline only
    # splits them (backward into I and W, forward's attention share).
    fwd_s, bwd_s = (samples * t / flop_div for t in layer.measured[1:])
    w_share = roofline.weight_grad_s / roofline.bwd_s if roofline.bwd_s > 0 else 0.0
    attn_share = roofline.fwd_attention_s / roofline.fwd_s if roofline.fwd_s > 0 else 0.0
    return LayerTime(
        fwd_s=fwd_s,
        input_grad_s=bwd_s * (1 - w_share),
        weight_grad_s=bwd_s * w_share,
        fwd_attention_s=fwd_s * attn_share,
    )
