"""The process groups one rank of a plan takes part in, made in one place and one order.

Every rank creates every group (``torch.distributed.new_group`` is collective), in the same
order, keeping those it is in:

* data-parallel: the ranks that hold the same pipeline rank (its gradients are summed over them);
* tied: per data-parallel replica, the pipeline ranks that hold one parameter (an LLM's
  embedding and output layer, or an encoder stage replicated over pipeline ranks), whose
  gradient parts are summed;
* pairs (ordered transfers only): a group per pair of pipeline ranks that exchange values, per
  replica (:mod:`vlmcompile.runtime.transport`);
* shards (ZeRO-1 only): per stage replicated over pipeline ranks, every rank holding it in any
  replica, over which its parameters' optimizer states are sharded (its group's DP in the plan);
  a stage on one pipeline rank shards over the data-parallel group.

Ranks are laid out pipeline-major: global rank = pipeline rank x DP + data-parallel rank
(:meth:`~vlmcompile.ir.plan.Parallel.global_rank`).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.plan import Parallel, Plan
from vlmcompile.runtime.collectives import Deadline, sum_gradients


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's groups (None where a group would hold this rank alone)."""

    dp: Any
    """Its data-parallel group (None at DP = 1)."""
    dp_ranks: tuple[int, ...]
    """The global ranks of its data-parallel group."""
    tied: tuple[tuple[Any, tuple[torch.nn.Parameter, ...]], ...]
    """(group, this rank's parameters it holds with the group's other ranks), per set of holders."""
    holders: dict[int, frozenset[int]]
    """id(parameter) -> the pipeline ranks that hold it."""
    pairs: dict[int, Any]
    """Peer pipeline rank -> the group of this rank and that peer (ordered transfers)."""
    shards: tuple[tuple[Any, tuple[torch.nn.Parameter, ...]], ...] = ()
    """(group its optimizer states are sharded over, or None: not sharded; this rank's
    parameters in it), covering every parameter of the rank's stages once."""

    def reduce_gradients(
        self, params: list[torch.nn.Parameter], deadline: Deadline, flat: dict[int, torch.Tensor], device
    ) -> None:
        """Sum the gradients of parameters held on several pipeline ranks over their holders, then
        every gradient over the data-parallel group (``flat``: each reduction's flat buffer, kept
        between steps)."""
        for group, tied in self.tied:
            sum_gradients(
                tied,
                group,
                deadline,
                "the gradient all-reduce of parameters held on several ranks",
                flat,
                device,
            )
        if self.dp is not None:
            what = f"the data-parallel gradient all-reduce over ranks {list(self.dp_ranks)}"
            sum_gradients(params, self.dp, deadline, what, flat, device)


def make_groups(
    plan: Plan,
    parallel: Parallel,
    stages: Sequence[torch.nn.Module],
    rank: int,
    *,
    timeout: datetime.timedelta,
    pair_peers: Sequence[tuple[int, int]] = (),
) -> ProcessGroups:
    """The groups of global rank ``rank`` under ``plan`` (``stages``: every stage module, by
    index), with a group for each pair of pipeline ranks in ``pair_peers``."""
    pp_rank, dp_rank, _ = parallel.coords(rank)
    dp_group, dp_ranks = None, ()
    for p in range(parallel.pp):
        ranks = tuple(parallel.global_rank(p, d) for d in range(parallel.dp))
        group = dist.new_group(list(ranks), timeout=timeout) if parallel.dp > 1 else None
        if p == pp_rank:
            dp_group, dp_ranks = group, ranks
    holders, tied = _tied(plan, parallel, stages, pp_rank, dp_rank, timeout)
    pairs = {}
    for d in range(parallel.dp):
        for a, b in sorted(pair_peers):
            group = dist.new_group([parallel.global_rank(a, d), parallel.global_rank(b, d)], timeout=timeout)
            if d == dp_rank and pp_rank in (a, b):
                pairs[b if a == pp_rank else a] = group
    shards = _shards(plan, parallel, stages, pp_rank, dp_group, timeout)
    return ProcessGroups(dp_group, dp_ranks, tied, holders, pairs, shards)


def _shards(plan, parallel, stages, pp_rank, dp_group, timeout):
    """The groups the optimizer states of this rank's parameters are sharded over, as the memory
    model budgets them (a group's ZeRO stage over its own DP): a stage on several pipeline ranks
    (an encoder data-parallel inside the pipeline) over all its holders in every replica, any
    other stage over the data-parallel group; none where the stage's group plans ZeRO-0."""
    replicated = sorted(
        {
            tuple(sorted(s.ranks))
            for s in plan.stages
            if len(s.ranks) > 1 and plan.parallel[s.group].zero_stage
        }
    )
    made = {}
    for pp_ranks in replicated:  # every rank makes every group, in this order
        ranks = [parallel.global_rank(r, d) for r in pp_ranks for d in range(parallel.dp)]
        made[pp_ranks] = dist.new_group(ranks, timeout=timeout)
    by_key: dict[Any, dict[int, torch.nn.Parameter]] = {}
    key_of: dict[int, Any] = {}
    for s in plan.stages:
        if pp_rank not in s.ranks:
            continue
        zero = plan.parallel[s.group].zero_stage
        key = None if not zero else ("dp" if len(s.ranks) == 1 else tuple(sorted(s.ranks)))
        for p in stages[s.index].parameters():
            if key_of.setdefault(id(p), key) != key:
                raise PlanError(
                    f"a parameter of stage {s.index} is also held by a stage whose optimizer states are "
                    "sharded over other ranks; plan both stages' groups with zero_stage=0"
                )
            by_key.setdefault(key, {})[id(p)] = p
    groups = {None: None, "dp": dp_group, **made}
    return tuple((groups[k], tuple(params.values())) for k, params in by_key.items())


def _tied(plan, parallel, stages, pp_rank, dp_rank, timeout):
    """Parameters held on several pipeline ranks, one group per set of ranks: tied across
    stages (an LLM's embedding and output layer) or in a stage replicated over ranks (an encoder
    data-parallel inside the pipeline). Either way each holder's gradient is a part of the
    whole, and the parts are summed."""
    holders: dict[int, set[int]] = {}
    by_id: dict[int, dict[int, torch.nn.Parameter]] = {}
    for s in plan.stages:
        for p in stages[s.index].parameters():
            holders.setdefault(id(p), set()).update(s.ranks)
            for r in s.ranks:
                by_id.setdefault(id(p), {})[r] = p
    out = []
    for pp_ranks in sorted({tuple(sorted(r)) for r in holders.values() if len(r) > 1}):
        for d in range(parallel.dp):
            group = dist.new_group([parallel.global_rank(r, d) for r in pp_ranks], timeout=timeout)
            if pp_rank in pp_ranks and d == dp_rank:
                params = tuple(by_id[i][pp_rank] for i, r in holders.items() if tuple(sorted(r)) == pp_ranks)
                out.append((group, params))
    return {i: frozenset(r) for i, r in holders.items()}, tuple(out)
