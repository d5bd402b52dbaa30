"""When each action of per-rank action lists runs.

An action starts when its rank is free and every action it depends on has ended and sent its
output over (the producer's end plus the transfer, none when the producer ran on the same rank;
transfers overlap compute). This is the
one timing rule of step time: the simulator runs plans with it, and the stage-cut model's
evaluation (:func:`vlmcompile.planning.partition_problem.evaluate`) runs candidate cuts with it; the
CP-SAT model states the same rule as constraints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from vlmcompile.ir.actions import Action, ActionKind, carried, dependencies, execution_order, interned
from vlmcompile.ir.errors import PlanError


@dataclass(frozen=True, slots=True)
class Timed:
    rank: int
    step: int
    """Position in the rank's action list."""
    action: Action
    start_s: float
    end_s: float


def run_actions(
    actions: Sequence[Sequence[Action]],
    num_stages: int,
    *,
    duration: Callable[[Action, float], float],
    transfer: Callable[[Action, Action], float],
    hosts: Mapping[Action, Sequence[Action]] | None = None,
    fused_duration: Callable[[Action, float], float] | None = None,
    order: Sequence[tuple[int, int, Action]] | None = None,
    ahead: frozenset[Action] = frozenset(),
) -> list[Timed]:
    """Every action with its start and end, in an order in which each starts after its inputs.

    Args:
        duration: seconds ``action`` takes when it starts at ``start`` (the simulator's first
            forwards wait for parameters); called in execution order.
        transfer: seconds from the end of ``dep`` until ``action``, which needs its output, may
            start when the two run on different ranks (on one rank nothing moves: a replicated
            stage's holders make this a property of the run, not of the stages).
        hosts: kernel-level actions -> the actions they run inside (``Plan.hosts_of``). A rider
            runs from its first host's start, which waits for the rider's inputs, to its last
            host's end; a host with riders takes ``fused_duration(host, start)``.
        order: the lists' :func:`complete_order`, where the caller keeps it (the simulator
            times one set of lists on many batches).
        ahead: forwards for the next global batch (``Plan.ahead``): the forwards that take their
            outputs have them from the step's start.
    """
    hosts, ahead = hosts or {}, interned(ahead)
    split = frozenset(a.stage for acts in actions for a in acts if a.kind is ActionKind.I)
    if order is None:
        order = complete_order(actions, num_stages, split, hosts, ahead)
    carried = _carried_from(actions, ahead)
    timing = _Timing(len(actions), num_stages, split, ahead, duration, transfer)
    if not hosts and not carried:
        return _run_plain(order, timing)
    return _run_with_riders(order, timing, hosts, fused_duration, carried)


@dataclass(frozen=True, slots=True)
class _Timing:
    """What :func:`run_actions`' loops read: the lists' shape and the two cost functions."""

    num_ranks: int
    num_stages: int
    split: frozenset[int]
    ahead: frozenset[Action]
    duration: Callable[[Action, float], float]
    transfer: Callable[[Action, Action], float]


def _run_with_riders(
    order: Sequence[tuple[int, int, Action]],
    timing: _Timing,
    hosts: Mapping[Action, Sequence[Action]],
    fused_duration: Callable[[Action, float], float] | None,
    carried: Mapping[Action, tuple[Action, int]],
) -> list[Timed]:
    """:func:`run_actions` with kernel-level riders or outputs carried from the step before."""
    num_stages, split, ahead = timing.num_stages, timing.split, timing.ahead
    duration, transfer = timing.duration, timing.transfer
    first_of: dict[Action, list[Action]] = {}
    last_of: dict[Action, list[Action]] = {}
    for rider, span in hosts.items():
        first_of.setdefault(span[0], []).append(rider)
        last_of.setdefault(span[-1], []).append(rider)
    spanned = {host for span in hosts.values() for host in span}
    end: dict[Action, float] = {}
    ran_on: dict[Action, int] = {}
    free = [0.0] * timing.num_ranks
    steps: dict[Action, int] = {}
    rider_start: dict[Action, float] = {}
    out = []

    def ready_at(a: Action, rank: int, ending: Sequence[Action] = ()) -> float:
        made = carried.get(a)  # its input, made the step before, is sent as this step starts
        return max(
            (
                end[d] + (transfer(d, a) if ran_on[d] != rank else 0.0)
                for d in dependencies(a, num_stages, split, ahead)
                if d not in ending  # a rider ending in this host runs before it, in the same host
            ),
            default=transfer(made[0], a) if made is not None and made[1] != rank else 0.0,
        )

    for rank, step, a in order:
        ran_on[a] = rank
        steps[a] = step
        if a in hosts:
            continue  # timed with its hosts, which come later on this rank
        opening = first_of.get(a, ())
        ending = last_of.get(a, ())
        start = max(free[rank], ready_at(a, rank), *(ready_at(r, rank, ending) for r in opening))
        if a in spanned:
            if fused_duration is None:
                raise PlanError("the plan runs actions at kernel level; give run_actions a fused_duration")
            finish = start + fused_duration(a, start)
        else:
            finish = start + duration(a, start)
        for r in opening:
            rider_start[r] = start
        end[a] = finish
        for r in sorted(ending, key=steps.__getitem__):
            end[r] = finish
            out.append(Timed(rank, steps[r], r, rider_start[r], finish))
        out.append(Timed(rank, step, a, start, finish))
        free[rank] = finish
    return out


def _run_plain(order: Sequence[tuple[int, int, Action]], timing: _Timing) -> list[Timed]:
    """:func:`run_actions` without riders or outputs carried from the step before: the same rule
    as :func:`_run_with_riders`, in the loop every screen and solve of the plan search runs
    hundreds of thousands of actions through."""
    num_stages, split, ahead = timing.num_stages, timing.split, timing.ahead
    duration, transfer = timing.duration, timing.transfer
    end: dict[Action, float] = {}
    ran_on: dict[Action, int] = {}
    free = [0.0] * timing.num_ranks
    out = []
    for rank, step, a in order:
        ran_on[a] = rank
        start = free[rank]
        for d in dependencies(a, num_stages, split, ahead):
            ready = end[d] if ran_on[d] == rank else end[d] + transfer(d, a)
            if ready > start:
                start = ready
        finish = start + duration(a, start)
        end[a] = finish
        free[rank] = finish
        out.append(Timed(rank, step, a, start, finish))
    return out


def _carried_from(
    actions: Sequence[Sequence[Action]], ahead: frozenset[Action]
) -> dict[Action, tuple[Action, int]]:
    """Per forward that takes an output made the step before (``Plan.carried``): the run-ahead
    forward that makes it, and its rank."""
    takers = carried(ahead)
    return {takers[a]: (a, rank) for rank, acts in enumerate(actions) for a in acts if a in takers}


def complete_order(
    actions: Sequence[Sequence[Action]],
    num_stages: int,
    split: frozenset[int],
    hosts: Mapping[Action, Sequence[Action]],
    ahead: frozenset[Action] = frozenset(),
) -> list[tuple[int, int, Action]]:
    """The lists' execution order; :class:`PlanError` where they deadlock."""
    order, position = execution_order(actions, num_stages, split, hosts, ahead)
    if len(order) < sum(len(a) for a in actions):
        stuck = [str(acts[position[r]]) for r, acts in enumerate(actions) if position[r] < len(acts)]
        raise PlanError(f"the action lists deadlock (next actions {stuck}); run plan.validate() for the grid")
    return order


def transfer_between_stages(send_fwd_s: Sequence[float], send_bwd_s: Sequence[float]):
    """The transfer rule of a stage chain: a forward's activations go from stage k to k + 1 in
    ``send_fwd_s[k]``, a backward's gradients from stage k back to k - 1 in ``send_bwd_s[k]``;
    nothing moves within a stage."""

    def transfer(dep: Action, action: Action) -> float:
        if dep.stage == action.stage:
            return 0.0
        return send_fwd_s[dep.stage] if dep.kind is ActionKind.F else send_bwd_s[dep.stage]

    return transfer


def transfer_of(stages: Sequence) -> Callable[[Action, Action], float]:
    """:func:`transfer_between_stages` of stage costs (``send_fwd_s``, ``send_bwd_s`` each)."""
    return transfer_between_stages([s.send_fwd_s for s in stages], [s.send_bwd_s for s in stages])
