"""Forwards one batch ahead (``Plan.ahead``): a frozen encoder's forwards on the next step's
batch, run in this step's bubbles, their outputs kept on the rank for the next step.

A chain of them stays on one rank (``runtime.capabilities.check_run_ahead``). The outputs that
cross the step boundary (``Plan.carried``) are handed to the next step as it starts: kept on the
rank, or sent by the ``SEND`` entries that head its lowered list. Where the next step's batch is
not the one promised (the first step, a resume, another batch), they are computed then.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.runtime.batches import same_batch


@dataclass(frozen=True, slots=True)
class Carry:
    """What this rank's run-ahead forwards made during a step, for the next."""

    batch: Mapping[str, Any]
    """The global batch they were computed on (the ``next_batch`` that step was given)."""
    outputs: dict[tuple[int, int], tuple]
    """(consuming stage, microbatch) -> the outputs of the forward that ran ahead."""


class RunAhead:
    """One rank's run-ahead forwards across steps.

    ``new_state(batch)``: a step state over ``batch``'s microbatches (no loss, no gradients);
    ``run_stage(stage, received, microbatch)``: a stage's forward, (its input leaves, its outputs)."""

    def __init__(self, new_state: Callable[[Mapping[str, Any]], Any], run_stage: Callable[..., tuple]):
        self.new_state, self.run_stage = new_state, run_stage
        self.carry: Carry | None = None
        self.recomputed = 0
        """Steps whose run-ahead outputs this rank computed at their start (the first step, one
        after a resume, or one whose batch was not the ``next_batch`` promised the step before)."""

    def forward(self, action: Action, ahead) -> None:
        """A forward of a stage no gradient reaches on the next batch's microbatch: its output
        stays on this rank (for the next run-ahead stage, or for the next step)."""
        s, i = action.stage, action.microbatch
        received = ahead.local_fwd.pop((s, i)) if s > 0 else ()
        _, out = self.run_stage(s, received, ahead.microbatches[i])
        ahead.local_fwd[(s + 1, i)] = out

    def keep(self, batch: Mapping[str, Any], ahead) -> None:
        """Keep what this step's run-ahead forwards made on ``batch`` for the next step."""
        self.carry = Carry(batch, ahead.local_fwd)

    def start(self, plan, batch: Mapping[str, Any], state, actions, rank_of_action, pp_rank: int) -> None:
        """Hand this step the outputs the step before made ahead for it (computed now when there
        are none for this batch): to ``state.local_fwd`` when their consumer runs here, else to
        ``state.produced`` for the sends that head the list."""
        mine = [a for a in sorted(plan.carried()) if rank_of_action[a] == pp_rank]
        carry, self.carry = self.carry, None
        if not mine:
            return
        if carry is not None and (carry.batch is batch or same_batch(carry.batch, batch)):
            outputs = carry.outputs
        else:  # the first step, a resume, or not the batch promised: make them now
            self.recomputed += 1
            prologue = self.new_state(batch)
            for a in actions:
                if a in plan.ahead:
                    self.forward(a, prologue)
            outputs = prologue.local_fwd
        for a in mine:
            s, i = a.stage, a.microbatch
            out = outputs.pop((s + 1, i))
            if rank_of_action[Action(s + 1, ActionKind.F, i)] == pp_rank:
                state.local_fwd[(s + 1, i)] = out
            else:
                state.produced[a] = out
