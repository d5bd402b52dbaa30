"""The optimizer a rank trains with, as its plan's ZeRO stage says: whole on every rank
(ZeRO-0), or its states sharded (ZeRO-1, torch's ``ZeroRedundancyOptimizer``: each rank steps
the parameters it owns and broadcasts them) over the ranks that hold the parameters: the
data-parallel group, or for an encoder stage replicated over pipeline ranks every holder in
every replica (the encoder group's own DP), one optimizer per group stepped together.

Gradients are reduced whole at both stages (:mod:`vlmcompile.runtime.gradients`), so the global
norm and its clip read the same on every rank. ZeRO-2 and -3 (sharded gradients and parameters)
are refused before launch (:func:`vlmcompile.runtime.capabilities.runnable`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vlmcompile.ir.errors import PlanError

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


Shards = Sequence[tuple[Any, Sequence[torch.nn.Parameter]]]
"""(the group a set of parameters' optimizer states are sharded over, or None; those parameters),
as :attr:`vlmcompile.runtime.groups.ProcessGroups.shards` gives them."""


def make_optimizer(
    params: list[torch.nn.Parameter], factory: OptimizerFactory, *, shards: Shards = ()
) -> torch.optim.Optimizer:
    """``factory``'s optimizer over ``params``, its states sharded over each group of ``shards``
    (ZeRO-1: the same class and settings over the trainable parameters of the group; a frozen
    parameter has no state to shard, and its owner would broadcast it to members that may not hold
    it). One optimizer where one group holds them all; else one per group, stepped together."""
    optimizer = factory(params)
    wanted = {id(p) for p in params}
    sharded: list[tuple[Any, list[torch.nn.Parameter]]] = []
    for group, members in shards:
        mine = [p for p in members if id(p) in wanted and p.requires_grad] if group is not None else []
        if mine:
            sharded.append((group, mine))
    if not sharded:
        return optimizer
    # Imported here: torch.distributed.optim takes a second to import (it scripts functional optimizers).
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if len(optimizer.param_groups) != 1:
        raise PlanError(
            f"the optimizer has {len(optimizer.param_groups)} parameter groups; ZeRO-1 shards an optimizer of "
            "one group (its class and settings): give one group, or plan with zero_stage=0"
        )
    # The settings its class takes (AdamW's defaults also hold what AdamW derives itself).
    takes = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in takes}
    parts: list[torch.optim.Optimizer] = [
        ZeroRedundancyOptimizer(mine, optimizer_class=type(optimizer), process_group=group, **settings)
        for group, mine in sharded
    ]
    covered = {id(p) for _, mine in sharded for p in mine}
    rest = [p for p in params if id(p) not in covered]
    if rest:
        parts.append(factory(rest))
    return parts[0] if len(parts) == 1 else ShardedOptimizers(parts)


class ShardedOptimizers(torch.optim.Optimizer):
    """Optimizers over disjoint parameters, each sharded over its own group, as one: an LR
    scheduler sets their parameter groups (which are theirs, shared), a step steps each."""

    def __init__(self, parts: Sequence[torch.optim.Optimizer]):
        super().__init__([p for part in parts for g in part.param_groups for p in g["params"]], {})
        self.parts = list(parts)
        self.param_groups = [g for part in self.parts for g in part.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeRO-1 optimizers take no closure")
        for part in self.parts:
            part.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``state_dict`` numbers the parameters in :attr:`param_groups` order, as one optimizer's."""
        first = 0
        groups = iter(state_dict["param_groups"])
        for part in self.parts:
            count = sum(len(g["params"]) for g in part.param_groups)
            settings = [next(groups) for _ in part.param_groups]
            part.load_state_dict(
                {
                    "state": {
                        i - first: v for i, v in state_dict["state"].items() if first <= i < first + count
                    },
                    "param_groups": [
                        {**given, "params": own["params"]} for given, own in zip(settings, param_groups(part))
                    ],
                }
            )
            first += count
        # Loading makes each part new group dicts: the scheduler must set those.
        self.param_groups = [g for part in self.parts for g in part.param_groups]

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "the optimizer states are sharded over ranks: save them with the training loop's checkpoints "
            "(TrainConfig.checkpoint_dir), which keep each rank's own"
        )


def _parts(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    return optimizer.parts if isinstance(optimizer, ShardedOptimizers) else [optimizer]


def local_states(optimizer: torch.optim.Optimizer) -> dict[torch.nn.Parameter, dict[str, Any]]:
    """The optimizer states this rank holds, by parameter (at ZeRO-1: those of the parameters
    it owns)."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # not imported: not sharded
    out = {}
    for part in _parts(optimizer):
        if zero is not None and isinstance(part, zero.ZeroRedundancyOptimizer):
            out.update(part.optim.state)
        else:
            out.update(part.state)
    return out


def holds_state(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter) -> bool:
    """Whether this rank keeps ``p``'s optimizer state (at ZeRO-1, only the rank that owns it)."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    for part in _parts(optimizer):
        if zero is not None and isinstance(part, zero.ZeroRedundancyOptimizer) and p in part._param_to_rank:
            return part._param_to_rank[p] == part.rank
    return True


def param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's parameter groups as ``state_dict`` gives them (parameters by index), which
    a sharded optimizer gives only after gathering every state to one rank."""
    out, index = [], 0
    for group in optimizer.param_groups:
        out.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": list(range(index, index + len(group["params"]))),
            }
        )
        index += len(group["params"])
    return out
