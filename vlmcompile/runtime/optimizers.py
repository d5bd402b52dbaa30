"""The optimizer a rank trains with, as its plan's ZeRO stage says: whole on every rank
(ZeRO-0), or its states sharded over the data-parallel group (ZeRO-1, torch's
``ZeroRedundancyOptimizer``: each rank steps the parameters it owns and broadcasts them).

Gradients are reduced whole at both stages (:mod:`vlmcompile.runtime.gradients`), so the global
norm and its clip read the same on every rank. ZeRO-2 and -3 (sharded gradients and parameters)
are refused before launch (:func:`vlmcompile.runtime.capabilities.runnable`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from vlmcompile.ir.errors import PlanError

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def make_optimizer(
    params: list[torch.nn.Parameter], factory: OptimizerFactory, *, zero_stage: int, dp_group: Any
) -> torch.optim.Optimizer:
    """``factory``'s optimizer over ``params``; at ZeRO-1 (``dp_group``: the rank's data-parallel
    group) the same class and settings, sharded over the group."""
    optimizer = factory(params)
    if zero_stage == 0 or dp_group is None:
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
    return ZeroRedundancyOptimizer(
        params, optimizer_class=type(optimizer), process_group=dp_group, **settings
    )


def local_states(optimizer: torch.optim.Optimizer) -> dict[torch.nn.Parameter, dict[str, Any]]:
    """The optimizer states this rank holds, by parameter (at ZeRO-1: those of the parameters
    it owns)."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # not imported: not sharded
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return dict(optimizer.optim.state)
    return dict(optimizer.state)


def holds_state(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter) -> bool:
    """Whether this rank keeps ``p``'s optimizer state (at ZeRO-1, only the rank that owns it)."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer._param_to_rank[p] == optimizer.rank
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
