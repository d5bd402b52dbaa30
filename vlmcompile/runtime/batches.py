"""A step's batch as one rank takes it: checked against the shapes the pipeline was compiled for,
cut into this rank's microbatches, a packed batch's size symbols bound, the batch's own schedule
where it brings one."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from vlmcompile.ir.errors import PlanError, VlmCompileError
from vlmcompile.ir.microbatch import take
from vlmcompile.ir.packed import BatchPlan, PackedBatch, PackedLayout
from vlmcompile.ir.plan import Parallel, Plan


class BatchError(VlmCompileError, ValueError):
    """A training batch does not match the shapes the pipeline was compiled for."""


def check_dict_batch(
    batch: Mapping[str, Any],
    plan: Plan,
    parallel: Parallel,
    *,
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    constants: Mapping[str, Any],
    specialized: Mapping[str, torch.Tensor],
    sample_rows: Mapping[str, int],
) -> None:
    """A :class:`BatchError` naming the first way ``batch`` differs from the compiled one."""
    for key, (shape, dtype) in shapes.items():
        if key not in batch:
            raise BatchError(f"the batch lacks {key!r}; the pipeline was compiled for {sorted(shapes)}")
        value = batch[key]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype != dtype:
            got = (
                f"{list(value.shape)} {value.dtype}"
                if isinstance(value, torch.Tensor)
                else type(value).__name__
            )
            raise BatchError(
                f"batch[{key!r}] is {got}; the pipeline expects {list(shape)} {dtype} (global batch "
                f"{plan.global_batch} = DP x "
                "microbatches x microbatch size; other dims as in the compiled sample batch)"
            )
    for key, expected in constants.items():
        got = batch.get(key, "missing")
        if got is not expected and got != expected:
            raise BatchError(
                f"batch[{key!r}] is {got!r}; the pipeline was compiled with {expected!r}, and capture "
                "fixes non-tensor values in the graph: pass the same value, or compile again with this one"
            )
    extra = sorted(set(batch) - set(shapes) - set(constants))
    if extra:
        raise BatchError(f"the batch has keys {extra} the compiled sample batch did not have")
    if specialized:
        mbs = plan.microbatch_size
        for i in range(parallel.dp * plan.num_microbatches):
            _check_specialized(take(batch, i * mbs, mbs, sample_rows), i, specialized)


def _check_specialized(
    microbatch: Mapping[str, Any], index: int, specialized: Mapping[str, torch.Tensor]
) -> None:
    for key, expected in specialized.items():
        got = microbatch[key]
        if got.shape != expected.shape or not torch.equal(got, expected.to(got.device)):
            raise BatchError(
                f"microbatch {index}'s {key!r} {_first_difference(got, expected)}: the model's shapes depend on "
                "these values, so every microbatch must bring the ones the pipeline was captured for (same "
                "image sizes and token layout), or compile again with such a batch"
            )


def packed_sizes(
    batch: Any, plan: Plan, parallel: Parallel, packed: PackedLayout | None, indices: Sequence[int]
) -> list[dict[str, int]]:
    """The size symbols of the packed microbatches ``indices`` of ``batch``, after checking it
    is a :class:`PackedBatch` of this pipeline's microbatches."""
    if packed is None or not isinstance(batch, PackedBatch):
        compiled = "packed microbatches" if packed is not None else "one batch shape"
        raise BatchError(
            f"the step got a {type(batch).__name__}; this pipeline was compiled for {compiled}: "
            + (
                "give a PackedBatch (CompiledPipeline.step packs a list of samples)"
                if packed
                else "give a dict"
            )
        )
    expected = parallel.dp * plan.num_microbatches
    if len(batch.microbatches) != expected:
        raise BatchError(
            f"the packed batch holds {len(batch.microbatches)} microbatches; the plan runs DP {parallel.dp} x "
            f"{plan.num_microbatches} microbatches = {expected}"
        )
    sizes = []
    for i in indices:
        microbatch = batch.microbatches[i]
        missing = sorted(set(packed.input_sizes.inputs) - set(microbatch))
        if missing:
            raise BatchError(f"packed microbatch {i} lacks {missing}")
        try:
            sizes.append(packed.input_sizes.bind(microbatch))
        except PlanError as err:
            raise BatchError(f"packed microbatch {i}: {err}") from None
    return sizes


def agreed_schedule(batch: Any, rank: int, lost: Callable[..., Exception]) -> BatchPlan | None:
    """Global rank 0's schedule for this step, on every rank (``lost(what, err, peer)``: the
    error that names rank 0 lost)."""
    sent = [getattr(batch, "schedule", None) if rank == 0 else None]
    try:
        dist.broadcast_object_list(sent, src=0)
    except RuntimeError as err:
        raise lost("the step's schedule from rank 0", err, 0) from err
    return sent[0]


def schedule_actions(plan: Plan, schedule: BatchPlan | None, dp: int, dp_rank: int) -> tuple:
    """The action lists a step of replica ``dp_rank`` runs under a batch's ``schedule`` (None:
    the plan's own), or a :class:`PlanError` for a schedule the plan cannot take."""
    if schedule is None:
        return plan.actions
    if plan.ahead:
        raise PlanError(
            "this plan runs encoder forwards one batch ahead, and per-batch schedules do not keep them; "
            "plan without run-ahead (run_ahead=0) to re-plan every batch"
        )
    if len(schedule.actions) != dp:
        raise PlanError(
            f"the batch's schedule is for {len(schedule.actions)} data-parallel replicas; the plan has {dp}"
        )
    return schedule.actions[dp_rank]


def microbatches_of(
    batch: Mapping[str, Any], plan: Plan, dp_rank: int, sample_rows: Mapping[str, int], device: torch.device
) -> list[dict[str, Any]]:
    """Data-parallel rank ``dp_rank``'s shard of a global batch, cut into microbatches (on ``device``)."""
    m, mbs = plan.num_microbatches, plan.microbatch_size
    shard = take(batch, dp_rank * m * mbs, m * mbs, sample_rows)
    microbatches = [take(shard, i * mbs, mbs, sample_rows) for i in range(m)]
    if device.type != "cpu":
        microbatches = [to_device(mb, device) for mb in microbatches]
    return microbatches


def same_batch(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two batches hold the same keys and values."""
    if set(a) != set(b):
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
            if not (same and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _first_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    if got.shape != expected.shape:
        return f"has shape {list(got.shape)}, the captured one {list(expected.shape)}"
    if got.numel() <= 16:
        return f"is {got.tolist()}, but the pipeline was captured for {expected.tolist()}"
    where = tuple(int(i) for i in (got != expected.to(got.device)).nonzero()[0])
    return (
        f"is {got[where].item()} at {list(where)}, but the pipeline was captured for {expected[where].item()}"
    )


def to_device(microbatch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in microbatch.items()
    }
