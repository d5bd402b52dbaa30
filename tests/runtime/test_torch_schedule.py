"""torch's pipeline engine as a second opinion: our chain plans' action lists (1F1B, interleaved,
zero-bubble with its split backwards) run through
``torch.distributed.pipelining``'s schedule runtime (``_PipelineScheduleRuntime``, our stage
modules wrapped in ``PipelineStage``) give the loss and every gradient our runtime gives, so our
lists and torch's lowering of them keep one meaning.

What the comparison leaves out, and why: torch reads the last stage's losses back in forward
order (every stage must run its forwards in microbatch order: chain 1F1B and interleaved plans
do); it sums no gradient over ranks that share a parameter, computes ``0 x NaN`` for a
microbatch without label tokens where ours skips it, and asks gradients of every received
float; the tiny model's plans here have none of those. Encoder-in-bubbles plans stay ours: torch
refuses a stage on two ranks and forward-only stages.
"""

from __future__ import annotations

import pytest
import torch

from tests.models import build
from tests.pipeline_helpers import even_plan
from vlmcompile import compile
from vlmcompile.runtime.launch import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


def _both_engines(runners, batch):
    """Per runner: (our loss, torch's loss or None off the last stage's rank, the names of the
    gradients torch made equal to ours)."""
    return [_both(runner, batch) for runner in runners]


def _both(runner, batch):
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

    from vlmcompile.ir.microbatch import label_weights
    from vlmcompile.runtime.batches import microbatches_of
    from vlmcompile.runtime.timed_steps import one_step

    class Adapter(nn.Module):
        """torch calls a stage as ``forward(*received, **kwargs)`` and gives every stage the
        microbatch's kwargs; gloo sends contiguous tensors only (a stage may end in a view)."""

        def __init__(self, stage):
            super().__init__()
            self.stage = stage

        def forward(self, *received, **microbatch):
            out = self.stage(received, microbatch)
            return out if isinstance(out, torch.Tensor) else tuple(o.contiguous() for o in out)

    plan, rank = runner.plan, dist.get_rank()
    ours = one_step(runner, batch)  # ours first, on the same stage modules
    grads = {n: g.clone() for n, g in ours["grads"].items() if g is not None}
    for p in runner.parameters():
        p.grad = None
    m = plan.num_microbatches
    stages = [
        PipelineStage(Adapter(runner.stages[s]), s, plan.num_stages, runner.device)
        for s in sorted(runner.stages)
    ]
    schedule = _PipelineScheduleRuntime(
        stages, m, loss_fn=lambda out, weight: out * weight, scale_grads=False
    )
    kinds = {
        "F": _ComputationType.FORWARD,
        "B": _ComputationType.FULL_BACKWARD,
        "I": _ComputationType.BACKWARD_INPUT,
        "W": _ComputationType.BACKWARD_WEIGHT,
    }
    compute = {
        r: [_Action(a.stage, kinds[a.kind.value], a.microbatch) for a in acts]
        for r, acts in enumerate(plan.actions)
    }
    schedule._prepare_schedule_with_comms(compute)  # torch places the sends and receives itself
    lowered = [a for a in schedule.pipeline_order_with_comms[rank] if a.computation_type in kinds.values()]
    assert lowered == compute[rank], f"torch reordered rank {rank}'s actions: {lowered}"
    for stage in stages:  # what step() does before its microbatches run
        stage.has_backward = True
        stage.clear_runtime_states()
    losses: list = []
    schedule._step_microbatches(
        arg_mbs=[()] * m,
        kwarg_mbs=[dict(mb) for mb in microbatches_of(batch, plan, 0, runner.sample_rows, runner.device)],
        target_mbs=[torch.tensor(w, dtype=torch.float32) for w in label_weights(batch, m)],
        losses=losses,
    )
    theirs = torch.stack([x.detach().double() for x in losses]).sum().float() if losses else None
    equal = []
    for name, p in runner.named_parameters().items():
        assert (p.grad is None) == (name not in grads), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[name], msg=lambda s, n=name: f"rank {rank} {n}: {s}")
            equal.append(name)
    return ours["loss"], theirs, equal


def test_our_chain_plans_run_on_torchs_schedule_runtime_with_our_loss_and_gradients():
    model, batch = build("tiny", batch_size=4)
    pipe = compile(model, batch, log=None)
    plans = {"1f1b": even_plan(pipe.layer_graph, pp=2, global_batch=4)}
    plans["interleaved"] = even_plan(pipe.layer_graph, pp=2, v=2, global_batch=4)
    plans["zero_bubble"] = even_plan(pipe.layer_graph, pp=2, global_batch=4, schedule="zero_bubble")
    runners = [pipe.runner(plan, timeout_s=60) for plan in plans.values()]
    per_rank = launch(_both_engines, runners, 2, args=(batch,), timeout_s=60)
    for k, name in enumerate(plans):
        (ours0, theirs0, equal0), (ours1, theirs1, equal1) = (per_rank[0][k], per_rank[1][k])
        torch.testing.assert_close(theirs1, ours1, msg=lambda s, n=name: f"{n} loss: {s}")
        assert theirs0 is None and torch.equal(ours0, ours1)
        assert len(equal0) + len(equal1) == len(list(model.parameters())), name
