"""How a stage's values cross ranks: which values can, the shape header a stage sends before its
first activations, and the tensors' wire form.

A stage sends a tuple of tensors and Python numbers (sizes computed from shapes, sent as 0-d
tensors). The receiving rank learns their shapes and dtypes from a header the sender sends once
per (stage, sender, receiver): the count of values, then per value (is a number, dtype index,
ndim, shape...). Ordered transfers (NCCL) post that header's receive before the shapes are known,
so theirs is padded to a fixed :data:`ORDERED_HEADER` numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlmcompile.ir.errors import PlanError

MAX_VALUES = 1000
"""Values a stage may send; also the tag offset of the shape header (tagged transfers)."""
ORDERED_HEADER = 1024
"""Numbers in the shape header of ordered transfers (fixed: its receive is posted unseen)."""
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.complex64,  # Llama4's rotary frequencies (freqs_cis) are read by every decoder layer
    torch.complex128,
]

Meta = list[tuple[tuple[int, ...], torch.dtype, bool]]
"""(shape, dtype, is a Python number) of each value a stage sends."""


def sendable(stage: int, names: Sequence[str], out: tuple, device: torch.device) -> tuple[tuple, list[bool]]:
    """``out`` (stage ``stage``'s outputs, named ``names``) as tensors to send, and which were
    Python numbers; a :class:`PlanError` for a value that cannot cross ranks."""
    if len(out) >= MAX_VALUES:
        raise PlanError(
            f"stage {stage} would send {len(out)} values to the next rank; the runtime sends fewer than "
            f"{MAX_VALUES} - cut the pipeline elsewhere"
        )
    scalar = [isinstance(x, (bool, int, float)) for x in out]
    for k, x in enumerate(out):
        if not isinstance(x, torch.Tensor) and not scalar[k]:
            raise PlanError(
                f"stage {stage} would send {names[k]!r}, a {type(x).__name__}, to the next rank; "
                "only tensors and Python numbers cross ranks - cut the pipeline elsewhere"
            )
        if isinstance(x, torch.Tensor) and (x.dtype not in DTYPES or (x.is_complex() and x.requires_grad)):
            raise PlanError(
                f"stage {stage} would send {names[k]!r}, a {x.dtype} tensor"
                + (" that needs a gradient" if x.dtype in DTYPES else "")
                + ", to the next rank, which the runtime cannot do; cut the pipeline elsewhere"
            )
    # Python numbers (sizes computed from shapes) travel as 0-d tensors.
    return tuple(torch.tensor(x, device=device) if flag else x for x, flag in zip(out, scalar)), scalar


def meta_of(out: tuple, scalar: Sequence[bool]) -> Meta:
    return [(tuple(x.shape), x.dtype, flag) for x, flag in zip(out, scalar)]


def header(
    stage: int, out: tuple, scalar: Sequence[bool], device: torch.device, *, ordered: bool
) -> torch.Tensor:
    """The shape header of ``out`` (padded to :data:`ORDERED_HEADER` numbers when ``ordered``)."""
    values = [len(out)] + [
        v for x, flag in zip(out, scalar) for v in (int(flag), DTYPES.index(x.dtype), x.dim(), *x.shape)
    ]
    if ordered:  # one fixed size: the receive is posted before the shapes are known
        if len(values) > ORDERED_HEADER:
            raise PlanError(
                f"stage {stage} sends {len(out)} values whose shape header takes {len(values)} numbers, more than "
                f"{ORDERED_HEADER}; cut the pipeline where fewer values cross"
            )
        values += [0] * (ORDERED_HEADER - len(values))
    return torch.tensor(values, dtype=torch.int64, device=device)


def parse_header(header: torch.Tensor) -> Meta:
    """(shape, dtype, is a Python number) of each value a shape header describes."""
    values = header.tolist()
    meta, pos = [], 1
    for _ in range(values[0]):
        flag, dtype, ndim = values[pos], DTYPES[values[pos + 1]], values[pos + 2]
        meta.append((tuple(values[pos + 3 : pos + 3 + ndim]), dtype, bool(flag)))
        pos += 3 + ndim
    return meta


def wire(t: torch.Tensor) -> torch.Tensor:
    """What goes over the wire for ``t``: complex tensors as their real view (gloo has no complex
    types), int16 as bytes (NCCL has no int16); either view shares the buffer's storage."""
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj())
    if t.dtype == torch.int16:
        return t.reshape(-1).view(torch.uint8)
    return t


def floats(values) -> list[torch.Tensor]:
    """The floating-point tensors among ``values`` (what a gradient flows through)."""
    return [x for x in values if isinstance(x, torch.Tensor) and x.is_floating_point()]
