"""Megatron-core MIMO's colocated layout: every module on every rank, no pipeline.

Read from NVIDIA/Megatron-LM at d98e8a64 (main; megatron-core 0.16.1 ships none of it):

* ``megatron/core/models/mimo/config/role.py``: ``ModuleLayout.COLOCATED``, "all modules share
  the same ranks"; a colocated rank runs every module with PP = 1.
* ``megatron/core/models/mimo/model/base.py``, ``MimoModel._forward_all_modules``: per
  microbatch the encoders run, their embeddings are bridged to the language model's layout and
  spliced into the text embeddings, and the language model runs; the encoders' backward is part
  of the same microbatch's autograd graph (no separate encoder phase).
* ``megatron/core/models/mimo/comm/colocated_communicator.py``, ``ColocatedBridgeCommunicator``:
  the encoder may use other TP and DP degrees than the language model over the same ranks
  (FAN_IN / FAN_OUT gather or slice along the batch); both grids must have PP = 1.

We model the EQUAL bridge (the encoder at the language model's TP and DP, which our runtime
runs); other encoder degrees (FAN_IN / FAN_OUT) are not modelled in this baseline. The encoder
is data-parallel over every rank. Recompute is one global setting, as Megatron's.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Reason
from vlmcompile.planning.build import build_plan
from vlmcompile.planning.model_parts import model_parts, recompute_decision, recompute_flags
from vlmcompile.planning.request import GlobalRecompute, NotApplicable, PlanRequest
from vlmcompile.planning.result import PolicyResult
from vlmcompile.sim.simulator import simulate

SOURCE = (
    "NVIDIA/Megatron-LM d98e8a64, megatron/core/models/mimo/config/role.py (ModuleLayout.COLOCATED) and "
    "comm/colocated_communicator.py (both grids PP = 1)"
)


@dataclass(frozen=True, slots=True)
class ColocatedReport:
    def __str__(self) -> str:
        return "Megatron MIMO: ModuleLayout.COLOCATED, EQUAL bridge (encoder at the language model's degrees)"


def mimo_colocated(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    recompute: GlobalRecompute = GlobalRecompute(),
) -> PolicyResult:
    """MIMO's colocated plan for ``request`` (see the module docstring); it needs pp = 1."""
    par = request.parallel
    if par.pp != 1 or par.v != 1:
        raise NotApplicable(
            f"mimo_colocated runs every module on every rank without a pipeline ({SOURCE}); it cannot plan "
            f"pp={par.pp}, v={par.v}: ask for pp=1 (the GPUs go to data and tensor parallelism) or use megatron"
        )
    parts = model_parts(layer_graph)
    encoder = [n for n in parts.pre if n not in parts.decoder]
    decisions = [
        Decision(
            "modules",
            Reason.COLOCATED,
            f"encoders, projector and language model on every rank, the encoder data-parallel over all "
            f"{par.dp * par.tp} GPUs at the language model's TP {par.tp} and DP {par.dp} (the EQUAL bridge); "
            f"{len(encoder)} encoder/projector/embedding layers and {len(parts.decoder)} decoder layers per "
            f"microbatch, forward then backward ({SOURCE})",
        ),
        recompute_decision(parts, recompute),
    ]
    flags = recompute_flags(layer_graph, parts, recompute)
    plan = build_plan(
        layer_graph,
        cluster,
        request,
        policy="mimo_colocated",
        chunks=[[layer.name for layer in layer_graph.layers]],
        recompute=flags,
        decisions=decisions,
    )
    return PolicyResult(
        plan=plan,
        sim=simulate(plan, layer_graph, cluster),
        report=ColocatedReport(),
        recompute=str(recompute),
    )
