"""Mixed precision on the ranks: the stages' forwards under ``torch.autocast`` while parameters,
their gradients, reductions and optimizer states stay fp32; one low-precision copy of each
trainable weight a step; and the compute dtypes the runtime trains in, checked before any rank
starts.

Why the step holds one copy: autocast casts a weight for every forward that reads it, and keeps
the casts of leaf parameters that take gradients until the outermost autocast context exits.
Each stage forward enters its own context, so without an outer one every microbatch in flight
held its own bf16 copy of the stage's weights (4 microbatches, 4 copies). A disabled context
around the step's actions keeps the first cast for the whole step (recomputes in backwards
included), while backwards run outside autocast, as torch asks. A frozen weight is cast where it
is read: torch caches only weights that take gradients.
"""

from __future__ import annotations

import contextlib

import torch

from vlmcompile.ir.errors import PlanError


def forward_context(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    """Where a stage's forward runs: under autocast in ``dtype`` (None: fp32, no autocast)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def step_context(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    """Around a step's actions: autocast's casts of trainable weights kept for the step (one copy
    a weight), autocast itself off outside the stages' forwards."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, enabled=False)


def check_autocast(dtype: torch.dtype | None, device: torch.device) -> str | None:
    """Refuse a compute dtype the runtime cannot train in on ``device`` (a :class:`PlanError`
    naming it and the fix); for bf16 on a CPU without bf16 instructions, the line to tell the
    user (torch emulates it there: a 512 x 512 matmul took 108x fp32's time on an AVX2 CPU, a step
    of the zoo's demo 20x, 2026-11-29)."""
    if dtype is None:
        return None
    if dtype == torch.float16:
        raise PlanError(
            "autocast_dtype=torch.float16: fp16 gradients underflow without a gradient scaler, which the "
            "runtime does not run; train in torch.bfloat16 (same speed on GPUs since Ampere) or fp32 (None)"
        )
    if dtype != torch.bfloat16:
        raise PlanError(f"autocast_dtype={dtype}: the runtime trains in torch.bfloat16 or fp32 (None)")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise PlanError(
            f"autocast_dtype=torch.bfloat16 on {torch.cuda.get_device_name(device)}, which has no bf16 "
            "arithmetic (it came with Ampere); train in fp32 (autocast_dtype=None, --precision fp32)"
        )
    if device.type == "cpu" and not (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    ):
        return (
            "bf16 on this CPU is emulated (no AVX512-BF16 or AMX instructions): steps take several times "
            "fp32's (20x for the zoo's demo on an AVX2 CPU); fp32 is faster here"
        )
    return None
