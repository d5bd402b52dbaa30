"""Memory per rank: model states by precision and ZeRO stage, activations per microbatch.

Model states follow Rajbhandari et al. 2020 (ZeRO) with Megatron-LM's mixed precision: bf16
parameters (2 B), fp32 main gradients (4 B) and Adam's fp32 master weights and two moments
(12 B) per parameter (our runtime's, :meth:`Precision.runtime`: fp32 parameters, gradients and
two moments, 16 B, a 4 B copy of the gradients to sum them in at DP > 1, and under bf16 autocast
a 2 B copy of each trainable weight for the step); ZeRO stage 1 (Megatron's distributed optimizer) shards the optimizer
states over the data-parallel ranks, stage 2 also the gradients, stage 3 also the parameters.

Activations are the annotate pass's measured saved bytes, scaled to the microbatch, on one TP
rank (see :func:`vlmcompile.cost_models.compute.sharded_share`). With full recompute a layer
keeps only its inputs, and re-creates its saved tensors during its own backward (one layer at
a time: the transient). Selective recompute (the attention core) frees the s^2 softmax
tensors of Korthikanti et al. 2022; the flash-attention kernels we annotate never store
them, so it frees nothing here and only costs the attention forward again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vlmcompile.cost_models.compute import sharded_share
from vlmcompile.ir.layer_graph import Layer
from vlmcompile.ir.plan import Precision, Recompute

MEMORY_RESERVE = 0.05
"""Share of device memory no plan may use: the CUDA context, NCCL buffers and the caching
allocator's fragmentation (a few GiB on an 80 GB GPU). Every policy is held to the same cap."""


def usable_memory_bytes(device_mem_bytes: float) -> float:
    return device_mem_bytes * (1 - MEMORY_RESERVE)


def plan_precision(ranks_on_this_machine: bool) -> Precision:
    """The model-state bytes every policy's plans are held to on a cluster. On ranks of this
    machine, what our runtime holds when it trains them, in fp32 (:meth:`Precision.runtime`), so
    a plan said to fit a cap fits it when run. On GPUs, Megatron-LM's mixed precision with its
    distributed optimizer (6 + 12 / DP bytes a parameter at ZeRO-1), which is what the baselines'
    own systems hold; our runtime holds more there (10 + 8 / DP, and 4 more for its reduction
    buckets, under bf16 autocast), and refuses before launch a plan that its own bytes do not fit
    (:func:`vlmcompile.compiled_pipeline.check_memory`)."""
    return Precision.runtime(autocast=False) if ranks_on_this_machine else Precision()


def ranks_over(peaks: Sequence[float], cap: float | Sequence[float]) -> list[int]:
    """The ranks whose peak is over the cap (one cap for all, or one per rank): the one rule of
    "fits" that every policy, the solvers' evaluations and the simulator apply."""
    caps = [cap] * len(peaks) if isinstance(cap, (int, float)) else list(cap)
    if len(caps) != len(peaks):
        raise ValueError(f"{len(caps)} memory caps for {len(peaks)} ranks")
    return [r for r, (peak, limit) in enumerate(zip(peaks, caps)) if peak > limit]


def fits(peaks: Sequence[float], cap: float | Sequence[float]) -> bool:
    """Every rank's peak within the cap (:func:`ranks_over` names the ones that are not)."""
    return not ranks_over(peaks, cap)


@dataclass(frozen=True, slots=True)
class ModelStateBytes:
    params: float
    grads: float
    optimizer: float
    compute_copy: float = 0.0
    """The low-precision copy of the trainable weights a step holds (:attr:`Precision.compute_copy_bytes`)."""
    reduction_copy: float = 0.0
    """The buffers the gradients are summed in over DP (:attr:`Precision.reduction_copy_bytes`)."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.compute_copy + self.reduction_copy


def model_state_bytes(
    num_params: float,
    precision: Precision,
    *,
    dp: int,
    zero_stage: int,
    num_trainable: float | None = None,
) -> ModelStateBytes:
    """Bytes of ``num_params`` parameters (already divided by TP) on one rank, of which
    ``num_trainable`` (None: all) have gradients and optimizer states: frozen ones have neither."""
    trainable = num_params if num_trainable is None else num_trainable
    return ModelStateBytes(
        params=num_params * precision.param_bytes / (dp if zero_stage >= 3 else 1),
        grads=trainable * precision.grad_bytes / (dp if zero_stage >= 2 else 1),
        optimizer=trainable * precision.optimizer_bytes / (dp if zero_stage >= 1 else 1),
        compute_copy=trainable * precision.compute_copy_bytes,
        reduction_copy=trainable * precision.reduction_copy_bytes if dp > 1 else 0.0,
    )


def kept_activation_bytes(
    layer: Layer, recompute: Recompute, *, samples: float, tp: int, sequence_parallel: bool
) -> float:
    """Bytes one microbatch leaves on the rank from this layer's forward until its backward."""
    if recompute is Recompute.FULL:
        # The checkpoint keeps the layer's input: the hidden state, sharded only under SP.
        share = 1.0 / tp if sequence_parallel else 1.0
        return samples * layer.saved_bytes_recompute * share
    return samples * layer.saved_bytes * sharded_share(layer, tp, sequence_parallel)


def recompute_transient_bytes(
    layer: Layer, recompute: Recompute, *, samples: float, tp: int, sequence_parallel: bool
) -> float:
    """Extra bytes while a fully recomputed layer runs its backward (its re-created saved tensors)."""
    if recompute is not Recompute.FULL:
        return 0.0
    return samples * layer.saved_bytes * sharded_share(layer, tp, sequence_parallel)
