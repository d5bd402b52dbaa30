"""torchtitan's VLM pipeline split: the vision encoder on stage 0 with the LLM embedding, the
LLM's layers split by ``_generate_llm_fqn_per_model_part``, and the one knob its users turn.

Read from pytorch/torchtitan at b5bcd76c (2026-08-21), ``torchtitan/distributed/pipeline_parallel.py``:

* ``pipeline_vlm`` makes the LLM's split, then puts ``vision_encoder`` (the projector lives inside
  it) at the front of stage 0, next to ``tok_embeddings``. Its docstring says the split does
  not count that load and tells the user to raise ``pipeline_parallel_first_stage_less_layers``;
  there is no other guidance, and torchtitan issue #2093 asks for the automatic partitioner
  that does not exist.
* ``_generate_llm_fqn_per_model_part(num_stages, num_layers, input_weight, output_weight)``
  counts the embedding as ``input_weight`` layers and the norm + output as ``output_weight``
  (the ``first/last_stage_less_layers`` settings, default 1): E = layers + both weights;
  every stage gets E // stages, the first E % stages one more; stage 0 then gives up
  ``input_weight`` layers and the last stage ``output_weight``. A weight above E // stages is
  an error.
* The default schedule is 1F1B (one stage per rank); the looped schedules (Interleaved1F1B)
  put stage k on rank k mod pp, as Megatron does.

So this policy plans that split and tunes ``first_stage_less_layers`` as its user would: every
value the function accepts, simulated, the fastest that fits kept. Recompute is one setting for
every layer (torchtitan's ``activation_checkpoint.mode``: none, selective, full).
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.layer_graph import LayerGraph
from vlmcompile.ir.plan import Decision, Plan, Reason
from vlmcompile.planning.build import build_plan
from vlmcompile.planning.model_parts import model_parts, recompute_decision, recompute_flags, with_ends
from vlmcompile.planning.request import GlobalRecompute, NotApplicable, PlanRequest
from vlmcompile.planning.result import PolicyResult
from vlmcompile.sim.simulator import simulate
from vlmcompile.sim.units import format_ms

SOURCE = "pytorch/torchtitan b5bcd76c, torchtitan/distributed/pipeline_parallel.py (pipeline_vlm, _generate_llm_fqn_per_model_part)"


def titan_layer_counts(
    num_layers: int, num_stages: int, input_weight: int = 1, output_weight: int = 1
) -> list[int]:
    """LLM layers per stage as torchtitan's ``_generate_llm_fqn_per_model_part`` splits them."""
    if num_stages < 1:
        raise PlanError(f"{num_stages} pipeline stages; torchtitan needs at least 1")
    if num_stages == 1:
        return [num_layers]
    effective = num_layers + input_weight + output_weight
    base, extra = divmod(effective, num_stages)
    if base == 0:
        raise NotApplicable(
            f"torchtitan splits {num_layers} layers + {input_weight} + {output_weight} (embedding, output) over "
            f"{num_stages} stages: fewer than one per stage; lower pp x v to at most {effective}"
        )
    for name, weight in (
        ("first_stage_less_layers", input_weight),
        ("last_stage_less_layers", output_weight),
    ):
        if not 0 <= weight <= base:
            raise PlanError(
                f"{name}={weight} is outside torchtitan's range 0..{base} (its minimum layers per stage) for "
                f"{num_layers} layers over {num_stages} stages"
            )
    counts = [base + (k < extra) for k in range(num_stages)]
    counts[0] -= input_weight
    counts[-1] -= output_weight
    return counts


@dataclass(frozen=True, slots=True)
class TorchtitanReport:
    first_stage_less_layers: int
    last_stage_less_layers: int
    tried: tuple[tuple[int, float, bool], ...]
    """(first_stage_less_layers, simulated step, fits) for every value tried."""

    def __str__(self) -> str:
        tried = ", ".join(
            f"{k}: {format_ms(s)} ms{'' if fits else ' (over memory)'}" for k, s, fits in self.tried
        )
        return (
            f"torchtitan settings: pipeline_parallel_first_stage_less_layers = "
            f"{self.first_stage_less_layers}, pipeline_parallel_last_stage_less_layers = {self.last_stage_less_layers}"
            f"\ntried first_stage_less_layers {tried}"
        )


def torchtitan_vlm(
    layer_graph: LayerGraph,
    cluster: Cluster,
    request: PlanRequest,
    *,
    recompute: GlobalRecompute = GlobalRecompute(),
    first_stage_less_layers: int | None = None,
    last_stage_less_layers: int = 1,
) -> PolicyResult:
    """torchtitan's ``pipeline_vlm`` split for ``request``; ``first_stage_less_layers`` None:
    tuned (every value torchtitan accepts, the fastest simulated plan that fits)."""
    parts = model_parts(layer_graph)
    stages = request.parallel.pp * request.parallel.v
    if first_stage_less_layers is not None:
        candidates = [first_stage_less_layers]
    else:
        effective = len(parts.decoder) + 1 + last_stage_less_layers
        candidates = list(range(0, max(1, effective // stages) + 1)) if stages > 1 else [1]
    flags = recompute_flags(layer_graph, parts, recompute)
    runs = []
    for k in candidates:
        counts = titan_layer_counts(len(parts.decoder), stages, k, last_stage_less_layers)
        plan = _plan(
            layer_graph, cluster, request, parts, counts, k, last_stage_less_layers, recompute, flags
        )
        runs.append((k, plan, simulate(plan, layer_graph, cluster)))
    k, plan, sim = min(runs, key=lambda r: (not r[2].fits, r[2].step_time_s, r[0]))
    tried = tuple((c, s.step_time_s, s.fits) for c, _, s in runs)
    report = TorchtitanReport(k, last_stage_less_layers, tried)
    result = PolicyResult(plan=plan, sim=sim, report=report, recompute=str(recompute))
    if len(runs) == 1:
        return result
    return result.with_decisions(
        Decision(
            "first_stage_less_layers",
            Reason.TUNED_KNOB,
            f"{k} of {', '.join(str(c) for c in candidates)}: the fastest simulated plan that fits, as a torchtitan "
            "user tunes it for the encoder on stage 0",
            {"first_stage_less_layers": k},
        )
    )


def _plan(layer_graph, cluster, request, parts, counts, first_less, last_less, recompute, flags) -> Plan:
    chunks = with_ends(
        parts,
        counts,
        why_empty=f"lower pp x v ({request.parallel.pp} x {request.parallel.v}) or first_stage_less_layers "
        f"({first_less})",
    )
    decisions = [
        Decision(
            "stage 0",
            Reason.ENCODER_ON_FIRST_STAGE,
            f"vision encoder (projector inside) and the LLM embedding join {counts[0]} LLM layers ({SOURCE})",
            {"decoder_layers": counts[0]},
        ),
        Decision(
            "layer split",
            Reason.EVEN_SPLIT,
            f"LLM layers per stage {counts}: {len(parts.decoder)} layers + {first_less} + {last_less} "
            "(first/last_stage_less_layers) split evenly, the remainder to the first stages",
        ),
        Decision(
            f"stage {len(chunks) - 1}",
            Reason.HEAD_ON_LAST_STAGE,
            f"{', '.join(parts.post)} on the last stage",
        ),
        recompute_decision(parts, recompute),
    ]
    return build_plan(
        layer_graph,
        cluster,
        request,
        policy="torchtitan_vlm",
        chunks=chunks,
        recompute=flags,
        decisions=decisions,
    )
