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

from vlmcompile.layer_graph import Layer

REPLICATED_SHARE_WITHOUT_SP = 10 / 34
"""Share of a transformer layer's activations outside the TP-sharded regions (Korthikanti et
al. 2022, eq. 2: 10 sbh of 34 sbh + 5 a s^2 b)."""


@dataclass(frozen=True, slots=True)
class LayerTime:
    """Seconds of compute one layer takes on one microbatch on one TP rank."""

    fwd_s: float
    input_grad_s: float
    weight_grad_s: float

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
    eff = device.efficiency
    flop_div = tp if is_tensor_parallel(layer) else 1
    mem_share = sharded_share(layer, tp, sequence_parallel)
    peak, bw = device.peak_flops_per_s, device.mem_bw_bytes_per_s

    def seconds(matmul: float, attention: float, mem_bytes: float) -> float:
        return samples * (
            matmul / flop_div / (peak * eff.matmul)
            + attention / flop_div / (peak * eff.attention)
            + mem_bytes * mem_share / (bw * eff.memory)
        )

    fwd_matmul = layer.fwd_flops - layer.fwd_attn_flops
    bwd_matmul = layer.bwd_flops - layer.bwd_attn_flops
    weight_grad = min(fwd_matmul, bwd_matmul)
    return LayerTime(
        fwd_s=seconds(fwd_matmul, layer.fwd_attn_flops, layer.fwd_mem_bytes),
        input_grad_s=seconds(bwd_matmul - weight_grad, layer.bwd_attn_flops, layer.bwd_mem_bytes),
        weight_grad_s=seconds(weight_grad, 0, 0),
    )
