"""The order in which two pipeline ranks exchange their stage-to-stage values, for backends that
pair messages by order rather than by tag.

NCCL ignores tags: the k-th send from rank a to rank b meets the k-th receive b posts from a.
It also runs a pair's sends and receives on one stream in the order they were issued, so if a
issues a receive from b before a send to b while b does the same, both streams wait forever.
Both problems go away when the two ranks issue every transfer between them - either way - in
one order they agree on. That order is the plan's: run the action lists with every action
taking no time (:func:`~vlmcompile.ir.actions.execution_order`, the order ``Plan.validate``
checks for deadlock) and list each transfer where its producing action runs.

Why it cannot deadlock: when a rank needs transfer M, every transfer before M in its pair's
order was produced earlier in that run. Its own sends there come from actions before the one
waiting for M in its list, so it has issued them; the peer's sends there need nothing from this
rank that it has not issued; and the receives there have known shapes, since the forward whose
output gradient a receive brings ran before.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from vlmcompile.ir.actions import Action, ActionKind, execution_order


@dataclass(frozen=True, slots=True, order=True)
class Transfer:
    """One value crossing ranks: a forward's activations for the next stage (``kind`` F) or a
    backward's input gradients for the stage before (``kind`` B)."""

    kind: ActionKind
    stage: int
    """The producing action's stage."""
    microbatch: int
    src: int
    """Pipeline rank that produces it."""
    dst: int
    """Pipeline rank that consumes it."""

    @property
    def consumer(self) -> Action:
        step = 1 if self.kind is ActionKind.F else -1
        return Action(self.stage + step, self.kind, self.microbatch)

    def __str__(self) -> str:
        what = "activations" if self.kind is ActionKind.F else "input gradients"
        return f"{Action(self.stage, self.kind, self.microbatch)}'s {what}"


def transfer_order(plan) -> dict[int, dict[int, list[Transfer]]]:
    """Per pipeline rank, per peer pipeline rank: the transfers between the two (either way) in
    the order both issue them. A run-ahead forward's output that crosses the step boundary
    (``Plan.carried``) is sent as the next step starts."""
    rank_of = plan.rank_of_action()
    order, _ = execution_order(
        plan.actions, plan.num_stages, plan.split_backward(), plan.hosts_of(), plan.ahead
    )
    out: dict[int, dict[int, list[Transfer]]] = defaultdict(lambda: defaultdict(list))
    last = plan.num_stages - 1
    carried = plan.carried()
    # The outputs the step before made for this step go first, as the step starts; those this
    # step makes for the next are kept, not sent.
    start = [(rank_of[a], -1, a) for a in sorted(carried)]
    for rank, _, a in start + [x for x in order if x[2] not in carried]:
        if a.kind is ActionKind.F and a.stage < last:
            dst = rank_of[Action(a.stage + 1, ActionKind.F, a.microbatch)]
        elif (
            a.kind is ActionKind.B
            and a.stage > 0
            and Action(a.stage - 1, ActionKind.B, a.microbatch) in rank_of
        ):
            # (none to a stage with no backward: no gradient goes back there)
            dst = rank_of[Action(a.stage - 1, ActionKind.B, a.microbatch)]
        else:
            continue
        if dst != rank:
            t = Transfer(a.kind, a.stage, a.microbatch, rank, dst)
            out[rank][dst].append(t)
            out[dst][rank].append(t)
    return {r: dict(peers) for r, peers in out.items()}
