"""A step's samples assigned to microbatches and data-parallel replicas so that both the LLM's
and the encoder's work come out even: a two-dimensional packing over text tokens (each
microbatch holds at most the token budget) and image rows (the encoder's work).

Packing by tokens alone (:func:`~vlmcompile.data.packing.assign_rows`) fills rows evenly but
leaves the images where they fall: one microbatch may carry ten images and the next none, and
the step waits for the encoder's busiest microbatch and the busiest replica. Here the samples a
step keeps (the same ones token packing keeps, so what is deferred does not change) are placed
again:

* ``greedy``: the most image rows first, each into the microbatch with the fewest image rows
  that still has room for its tokens (ties: the fewest tokens); then the microbatches dealt to
  replicas the same way, the heaviest to the lightest replica with a slot left;
* ``cp-sat``: the same assignment as an integer program minimising the largest microbatch's
  image rows, started from the greedy one, within a deterministic time limit (every rank
  assigns its step itself, and must get the same answer).

Where the greedy one places some kept sample in no microbatch (tokens packed too tightly to
move), the token packing stands (CP-SAT starts from it) and :attr:`Assignment.method` says so. The loss is a sum over label
tokens, so which microbatch a sample lands in changes no numerics.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from vlmcompile.data.packing import assign_rows
from vlmcompile.ir.errors import DataError

METHODS = ("tokens", "greedy", "cp-sat")
CP_SAT_LIMIT_S = 0.5
"""Default time limit of the integer program per step."""


@dataclass(frozen=True, slots=True)
class Assignment:
    rows: tuple[tuple[int, ...], ...]
    """Per microbatch (replica ``d``'s are ``rows[d * m : (d + 1) * m]``), its sample indices."""
    deferred: tuple[int, ...]
    method: str
    """What made it: ``tokens``, ``greedy``, ``cp-sat (optimal)``, ``cp-sat (time limit ...)``
    (a solution, not proven best), ``tokens (the greedy one did not fit)``, and in brackets why
    CP-SAT's was not taken where it was not."""
    solve_s: float

    def image_rows(self, vision: Sequence[int]) -> list[int]:
        return [sum(vision[i] for i in row) for row in self.rows]


def assign(
    lengths: Sequence[int],
    vision: Sequence[int],
    num_microbatches: int,
    tokens: int,
    *,
    first: int = 0,
    replicas: int = 1,
    method: str = "greedy",
    time_limit_s: float = CP_SAT_LIMIT_S,
) -> Assignment:
    """Samples of ``lengths`` tokens and ``vision`` image rows in ``num_microbatches``
    microbatches of ``tokens`` (all replicas' together, ``replicas`` of them); the first
    ``first`` samples (carried in from the step before) are kept before any other."""
    if method not in METHODS:
        raise DataError(f"unknown microbatch assignment {method!r}; use one of {', '.join(METHODS)}")
    if len(lengths) != len(vision):
        raise DataError(f"{len(lengths)} sample lengths but {len(vision)} image row counts")
    if num_microbatches % replicas:
        raise DataError(f"{num_microbatches} microbatches do not split over {replicas} replicas")
    began = time.perf_counter()
    by_tokens, deferred = assign_rows(lengths, num_microbatches, tokens, first=first)
    if method == "tokens":
        return Assignment(
            tuple(map(tuple, by_tokens)), tuple(deferred), "tokens", time.perf_counter() - began
        )
    kept = sorted(i for row in by_tokens for i in row)
    rows, made = _greedy(kept, lengths, vision, num_microbatches, tokens), "greedy"
    if rows is None:
        rows, made = by_tokens, "tokens (the greedy one did not fit)"
    if method == "cp-sat":
        solved, status = _cp_sat(kept, lengths, vision, num_microbatches, tokens, rows, time_limit_s)
        if solved is not None and _heaviest(solved, vision) <= _heaviest(rows, vision):
            rows, made = solved, f"cp-sat ({status})"
        else:
            made += f" (cp-sat: {status})"
    rows = _by_replica(rows, vision, replicas)
    return Assignment(
        tuple(tuple(sorted(r)) for r in rows), tuple(deferred), made, time.perf_counter() - began
    )


def _heaviest(rows, vision) -> int:
    return max((sum(vision[i] for i in row) for row in rows), default=0)


def _greedy(kept, lengths, vision, num_microbatches: int, tokens: int) -> list[list[int]] | None:
    rows: list[list[int]] = [[] for _ in range(num_microbatches)]
    used, seen = [0] * num_microbatches, [0] * num_microbatches
    # The biggest first, in whichever of the two sizes is nearer its microbatch's share: a long
    # text-only sample left to the end would find no row with room.
    share = max(1.0, sum(vision[i] for i in kept) / num_microbatches)
    for i in sorted(kept, key=lambda i: (-max(vision[i] / share, lengths[i] / tokens), i)):
        fits = [r for r in range(num_microbatches) if used[r] + lengths[i] <= tokens]
        if not fits:
            return None
        r = min(fits, key=lambda r: (seen[r], used[r], r))
        rows[r].append(i)
        used[r] += lengths[i]
        seen[r] += vision[i]
    return rows


def _by_replica(rows: list[list[int]], vision: Sequence[int], replicas: int) -> list[list[int]]:
    """``rows`` dealt to replicas (the heaviest in image rows to the lightest replica with a slot
    left), each replica's in the order dealt."""
    if replicas == 1:
        return rows
    per = len(rows) // replicas
    load, slots = [0] * replicas, [[] for _ in range(replicas)]
    for row in sorted(rows, key=lambda r: -sum(vision[i] for i in r)):
        d = min((d for d in range(replicas) if len(slots[d]) < per), key=lambda d: (load[d], d))
        slots[d].append(row)
        load[d] += sum(vision[i] for i in row)
    return [row for replica in slots for row in replica]


def _cp_sat(kept, lengths, vision, num_microbatches: int, tokens: int, hint, time_limit_s: float):
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    x = {(i, r): model.new_bool_var(f"x{i}_{r}") for i in kept for r in range(num_microbatches)}
    for i in kept:
        model.add_exactly_one(x[i, r] for r in range(num_microbatches))
    heaviest = model.new_int_var(0, sum(vision[i] for i in kept), "heaviest")
    for r in range(num_microbatches):
        model.add(sum(lengths[i] * x[i, r] for i in kept) <= tokens)
        model.add(sum(vision[i] * x[i, r] for i in kept) <= heaviest)
    # Rows are interchangeable: sample k goes to a row no later than k (breaks the symmetry).
    for k, i in enumerate(sorted(kept, key=lambda i: (-vision[i], i))):
        for r in range(k + 1, num_microbatches):
            model.add(x[i, r] == 0)
    model.minimize(heaviest)
    # The hint's rows renamed in the order the symmetry breaking visits samples, so it obeys it.
    label: dict[int, int] = {}
    row_of = {i: r for r, row in enumerate(hint) for i in row}
    for i in sorted(kept, key=lambda i: (-vision[i], i)):
        label.setdefault(row_of[i], len(label))
    where = {i: label[row_of[i]] for i in kept}
    for (i, r), var in x.items():
        model.add_hint(var, where[i] == r)
    solver = cp_model.CpSolver()
    # Every rank assigns its step on its own: one worker and a deterministic limit (CP-SAT's
    # work units, about seconds) give each the same answer; a wall-clock limit would not.
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.num_workers = 1
    status = solver.solve(model)
    if status == cp_model.OPTIMAL:
        said = "optimal"
    elif status == cp_model.FEASIBLE:
        said = f"time limit {time_limit_s:g} s, bound {solver.best_objective_bound:g} rows"
    else:
        return None, f"no solution in {time_limit_s:g} s"
    return [[i for i in kept if solver.value(x[i, r])] for r in range(num_microbatches)], said
