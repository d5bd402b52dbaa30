"""What a planning policy is asked for: :class:`PlanRequest` (degrees, batch, schedule), and the
options of the policies that solve (:class:`SolverOptions`) or recompute globally
(:class:`GlobalRecompute`).

Two policies are compared like for like by giving them the same request. A policy whose layout
cannot express a request at all (MIMO's colocated layout at PP > 1, Megatron's even split of 8
layers over 16 stages) raises :class:`NotApplicable`: a comparison then says "n/a" and why, not
that its plan does not fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.cost_models.memory import plan_precision
from vlmcompile.ir.errors import ClusterError, PlanError, positive_int, positive_number
from vlmcompile.ir.placement import PlacementStyle
from vlmcompile.ir.plan import Parallel, Precision, Recompute
from vlmcompile.planning.schedules import Schedule


class NotApplicable(PlanError):
    """The policy cannot express this request (its layout rules out these degrees or this model);
    not the same as a plan that does not fit in memory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRequest:
    """Degrees, batch and schedule of one plan; each policy chooses the rest (cuts, recompute)."""

    parallel: Parallel
    """The degrees: TP x PP x DP is the cluster's GPU count (:meth:`on` derives DP from it)."""
    global_batch: int
    """Samples per training step, over all data-parallel replicas."""
    microbatch_size: int = 1
    """Samples per microbatch."""
    schedule: Schedule | None = None
    """None: Megatron-LM's default for ``parallel.v`` (1F1B, or interleaved 1F1B when v > 1)."""
    precision: Precision = Precision()
    """The model-state bytes its plans are held to: Megatron-LM's by default; :meth:`on` gives the
    cluster's (:func:`~vlmcompile.cost_models.memory.plan_precision`)."""

    def __post_init__(self):
        positive_int("global_batch", self.global_batch, "the samples per training step")
        positive_int("microbatch_size", self.microbatch_size, "the samples per microbatch")
        if self.schedule is not None:
            object.__setattr__(self, "schedule", Schedule.parse(self.schedule))
        per_step = self.parallel.dp * self.microbatch_size
        if self.global_batch % per_step:
            raise PlanError(
                f"global batch {self.global_batch} is not a multiple of dp x microbatch size = "
                f"{self.parallel.dp} x {self.microbatch_size}; use a global batch of "
                f"{(self.global_batch // per_step + 1) * per_step}"
            )

    @classmethod
    def on(
        cls,
        cluster: Cluster,
        *,
        tp: int,
        pp: int,
        v: int = 1,
        global_batch: int,
        microbatch_size: int = 1,
        schedule: Schedule | str | None = None,
        sequence_parallel: bool = True,
        zero_stage: int | None = None,
        placement: PlacementStyle | str = PlacementStyle.LOOP,
    ) -> PlanRequest:
        """The request Megatron-LM's flags make on ``cluster``: DP is what TP x PP leave; ZeRO
        the cluster's (:meth:`Cluster.zero_stage`) unless given; ``placement`` the virtual
        stages' (:mod:`vlmcompile.ir.placement`: ``loop``, or ``v`` with the v_1f1b schedule)."""
        for name, value in (("tp", tp), ("pp", pp), ("v", v)):
            positive_int(name, value, f"the {name.upper()} degree")
        dp = cluster.data_parallel_size(tp, pp)
        cluster.check_tensor_parallel(tp)
        parallel = Parallel(
            dp=dp,
            tp=tp,
            pp=pp,
            v=v,
            sequence_parallel=sequence_parallel,
            zero_stage=cluster.zero_stage(dp) if zero_stage is None else zero_stage,
            placement=placement,
        )
        return cls(
            parallel=parallel,
            global_batch=global_batch,
            microbatch_size=microbatch_size,
            schedule=schedule,
            precision=plan_precision(cluster.ranks_on_this_machine),
        )

    def with_degrees(self, **degrees: int) -> PlanRequest:
        """The same request with some degrees changed (``v=2``), DP left as it is."""
        return replace(self, parallel=replace(self.parallel, **degrees))

    def check_on(self, cluster: Cluster) -> None:
        """Refuse degrees that do not use exactly the cluster's GPUs, or TP across nodes."""
        par = self.parallel
        if par.dp * par.tp * par.pp != cluster.num_gpus:
            raise ClusterError(
                f"DP x TP x PP = {par.dp} x {par.tp} x {par.pp} = {par.dp * par.tp * par.pp} GPUs, but "
                f"{cluster.name} has {cluster.num_gpus}; make the request with PlanRequest.on(cluster, ...)"
            )
        cluster.check_tensor_parallel(par.tp)

    @property
    def num_microbatches(self) -> int:
        """Microbatches per data-parallel replica per step."""
        return self.global_batch // (self.parallel.dp * self.microbatch_size)

    @property
    def schedule_name(self) -> Schedule:
        return self.schedule or Schedule.default(self.parallel.v, self.parallel.placement)

    def __str__(self) -> str:
        p = self.parallel
        return f"DP={p.dp} TP={p.tp} PP={p.pp} V={p.v} mb={self.microbatch_size}x{self.num_microbatches}"


GAP_GOAL = 0.02
"""A CP-SAT gap above this share of the objective is explained wherever it is reported."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverOptions:
    """How long and on how many cores CP-SAT may work on one plan."""

    time_limit_s: float = 10.0
    """Wall-clock limit; on a timeout the best plan found is returned and the report says so."""
    workers: int | None = None
    """Parallel search workers; None: the machine's cores, at most 8."""
    timeline_share: float = 0.25
    """At most this share of the time limit goes to the timeline model after the closed form
    (:func:`vlmcompile.planning.stage_cuts.solve`); it proves small instances optimal, and on
    large ones rarely finds better, so a plan search should not spend whole limits on it."""
    closed_form: bool = True
    """False: skip the closed form and give the timeline model its share of the limit, started
    from the warm start's plan (a plan search's polish of a plan it already has)."""
    run_ahead: bool = True
    """Whether the encoder-in-bubbles pass may run a frozen encoder's forwards one global batch
    ahead (``Plan.ahead``); off for pipelines the runtime runs ahead-less (packed samples)."""

    def __post_init__(self):
        positive_number("time_limit_s", self.time_limit_s, "CP-SAT's seconds")
        if not 0 <= self.timeline_share <= 1:
            raise PlanError(f"timeline_share={self.timeline_share!r}; give a share of the time limit, 0 to 1")
        if not self.closed_form and self.timeline_share == 0:
            raise PlanError(
                "closed_form=False with timeline_share=0 leaves no model to solve; give timeline_share > 0"
            )
        if self.workers is not None:
            positive_int("workers", self.workers, "CP-SAT's parallel workers")

    @property
    def num_workers(self) -> int:
        return self.workers or max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True, kw_only=True, slots=True)
class GlobalRecompute:
    """Megatron-LM's recompute flags: one setting for every decoder layer
    (``--recompute-granularity``), and the vision encoder fully recomputed or not."""

    granularity: Recompute = Recompute.NONE
    vision: bool = False

    def __post_init__(self):
        try:
            object.__setattr__(self, "granularity", Recompute(self.granularity))
        except ValueError:
            raise PlanError(
                f"recompute={self.granularity!r}; use one of {', '.join(r.value for r in Recompute)}"
            ) from None

    def __str__(self) -> str:
        return f"{self.granularity.value}{' + vision' if self.vision else ''}"


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpace:
    """The degrees the plan search may choose from; None: every value the cluster allows."""

    tp_choices: tuple[int, ...] | None = None
    """Default: powers of two up to a node's GPUs that divide the GPU count."""
    pp_choices: tuple[int, ...] | None = None
    """Default: every PP that divides what TP leaves, up to the number of layers."""
    dp_choices: tuple[int, ...] | None = None
    """Default: what TP x PP leave."""
    microbatch_sizes: tuple[int, ...] = (1, 2, 4)
    v_choices: tuple[int, ...] = (1, 2, 4)
    """Virtual stages per rank; v > 1 only where the microbatches divide over the PP ranks."""
    tower_microbatches: int | None = None
    """Contrastive two-tower models: microbatches each rank runs its samples in (default: the
    fewest that fit its memory)."""
    tower_placement: str = "auto"
    """Contrastive two-tower models: "colocated" (both towers on every rank), "separate" (each on
    ranks of its own, DistMM's placement) or "auto" (the faster predicted step)."""
    tower_tensor_parallel: tuple[int, ...] = (1,)
    """Contrastive two-tower models: the tensor-parallel degrees a tower may run at (inside a
    node). The contrastive runtime runs tp 1, so 1 is the default; the benchmarks plan wider."""
    tower_pipeline_parallel: tuple[int, ...] = (1,)
    """Contrastive two-tower models on ranks of their own: the pipeline stages a tower may be cut
    into. The contrastive runtime runs pp 1, so 1 is the default; the benchmarks plan deeper."""
    round_up_global_batch: bool = False
    """Packed microbatches: the global batch is the least a step needs, and each candidate takes
    it up to the next multiple of its DP x microbatch size (x PP for v > 1): more microbatches
    hold the same samples."""

    def __post_init__(self):
        for name in ("tp_choices", "pp_choices", "dp_choices", "microbatch_sizes", "v_choices"):
            values = getattr(self, name)
            if values is None:
                continue
            if isinstance(values, (int, str)) or not values:
                raise PlanError(f"{name}={values!r}; give a non-empty tuple of integers >= 1, e.g. (1, 2)")
            for value in values:
                positive_int(name, value, "degrees as integers >= 1")
            object.__setattr__(self, name, tuple(values))
