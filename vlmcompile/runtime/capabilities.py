"""What the runtime can run, and the one check a plan passes on its way to the ranks.

:func:`runnable` validates a plan (its structure, every action once, no deadlock; its layers
where a layer graph is given), checks its lowered lists (:func:`~vlmcompile.ir.program.check_lowered`)
and refuses what the runtime cannot run, once; the runner takes the
:class:`RunnablePlan` it returns and checks nothing again. Its degrees are the ones the ranks are
laid out by. The checks of a plan against the model as it is (its frozen stages) and the data
(run-ahead on packed batches) are here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Parallel, Plan
from vlmcompile.ir.program import Op, check_lowered, lower


@dataclass(frozen=True, slots=True)
class RuntimeCapabilities:
    """What the runtime can run; planning for ranks it starts itself keeps within these."""

    tensor_parallel: bool
    split_backward: bool
    """Separate input- and weight-gradient actions (I, W: zero-bubble schedules)."""
    zero_stages: frozenset[int] = frozenset({0, 1})
    """ZeRO stages it runs (:mod:`vlmcompile.runtime.optimizers`)."""


RUNTIME = RuntimeCapabilities(tensor_parallel=False, split_backward=True)


@dataclass(frozen=True, slots=True)
class RunnablePlan:
    """A plan that passed its checks and that the runtime can run, with the degrees its ranks
    are laid out by (its pipeline's: an encoder group with degrees of its own runs as stages
    replicated over the pipeline's ranks)."""

    plan: Plan
    parallel: Parallel
    program: tuple[tuple[Op, ...], ...]
    """Per pipeline rank: its lowered list (:func:`vlmcompile.ir.program.lower`), checked."""


def runnable(plan: Plan, layer_graph=None) -> RunnablePlan:
    """``plan`` validated (against ``layer_graph`` where given) and checked against
    :data:`RUNTIME`, or a :class:`PlanError` saying why it cannot run."""
    plan.validate(layer_graph)
    for name, par in plan.parallel.items():
        if par.tp != 1 and not RUNTIME.tensor_parallel:
            raise PlanError(
                f"the runtime has no tensor parallelism yet; this plan's group {name!r} has TP={par.tp} "
                "(plan with tp=1)"
            )
    check_zero(plan)
    split = plan.split_backward()
    mixed = sorted(
        {a.stage for acts in plan.actions for a in acts if a.kind is ActionKind.B and a.stage in split}
    )
    if mixed:
        raise PlanError(
            f"stage {mixed[0]} runs whole backwards (B) for some microbatches and split ones (I, W) for others; "
            "the runtime runs one kind a stage: give each stage's backwards alike"
        )
    if not RUNTIME.split_backward and any(
        a.kind in (ActionKind.I, ActionKind.W) for acts in plan.actions for a in acts
    ):
        raise PlanError(
            "the runtime runs full backward actions (B); this plan splits backwards into I and W "
            "(zero_bubble) - plan with 1f1b, interleaved_1f1b or (a V-shaped placement) v_1f1b"
        )
    check_run_ahead(plan)
    program = lower(plan)
    check_lowered(plan, program)  # the lists with their sends and receives, as the ranks will run them
    return RunnablePlan(plan, plan.pipeline_parallel, program)


def check_zero(plan: Plan) -> None:
    """The plan's ZeRO stages are ones the runtime runs. Each group's states are sharded over the
    DP it plans: the ranks holding each of its stages (:func:`vlmcompile.runtime.groups.make_groups`'
    shards), which at TP = 1 are exactly that many (plan validation: DP x PP is the pipeline's)."""
    for name, par in plan.parallel.items():
        if par.zero_stage not in RUNTIME.zero_stages:
            raise PlanError(
                f"group {name!r} of the plan has zero_stage={par.zero_stage}; the runtime runs ZeRO stages "
                f"{', '.join(map(str, sorted(RUNTIME.zero_stages)))} (gradients reduced whole, optimizer "
                "states sharded at 1): plan with zero_stage=1"
            )
        if par.zero_stage and par.dp == 1:
            raise PlanError(
                f"group {name!r} of the plan has zero_stage={par.zero_stage} at DP=1: there is no data-parallel "
                "group to shard over; plan with zero_stage=0"
            )


def stages_after_trainable(stages: Sequence[torch.nn.Module]) -> list[bool]:
    """Per stage: whether a stage before it holds a trainable parameter, so its inputs need
    gradients (stage k's inputs come from stage k - 1, which carries everything earlier)."""
    out, seen = [], False
    for module in stages:
        out.append(seen)
        seen = seen or any(p.requires_grad for p in module.parameters())
    return out


def check_forward_only(
    plan: Plan, stages: Sequence[torch.nn.Module], trains_before: Sequence[bool]
) -> frozenset[int]:
    """The plan's stages with no backward actions, checked against the parameters: exactly
    those no gradient reaches (nothing trainable in them or before them)."""
    without = plan.forward_only_stages()
    for s, module in enumerate(stages):
        reached = trains_before[s] or any(p.requires_grad for p in module.parameters())
        if reached == (s in without):
            raise PlanError(
                f"stage {s} has {'no ' if reached else ''}backward actions, but "
                + (
                    "its parameters or those of a stage before it train"
                    if reached
                    else "no gradient reaches it (its parameters and every earlier stage's are frozen)"
                )
                + ": plan again for the model's requires_grad flags as they are now"
            )
    return without


def check_packed_run_ahead(plan: Plan, packed: bool) -> None:
    """The runtime runs a plan's run-ahead forwards on batches of one shape only."""
    if plan.ahead and packed:
        raise PlanError(
            "this plan runs encoder forwards one batch ahead, which the runtime does for batches of one "
            "shape only; plan packed pipelines without run-ahead (run_ahead=0)"
        )


def check_run_ahead(plan: Plan) -> None:
    """The runtime keeps each chain of a plan's run-ahead forwards on one rank (their outputs stay
    there until the next step starts)."""
    if not plan.ahead:
        return
    rank_of = plan.rank_of_action()
    for a in sorted(a for a in plan.ahead if a.stage > 0):
        before = Action(a.stage - 1, ActionKind.F, a.microbatch)
        if rank_of[a] != rank_of[before]:
            raise PlanError(
                f"run-ahead forward {a} runs on pipeline rank {rank_of[a]}, its input {before} on "
                f"{rank_of[before]}; the runtime keeps a chain of run-ahead forwards on one rank - "
                "plan the encoder's stages on one rank each, or without run-ahead"
            )
