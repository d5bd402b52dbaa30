"""Plan: everything the simulator and the runtime need to run one training step.

A plan is a chain of stages (virtual stages when a rank holds several), each a run of
consecutive layers of the model placed on one pipeline rank (where the stage placement says,
:mod:`vlmcompile.ir.placement`), or replicated on several (an encoder stage data-parallel over
the LLM's pipeline ranks: each microbatch's work runs on one of them, and their gradients are
summed); per-layer recompute flags; parallel degrees per stage group (the LLM's and each
encoder's: Optimus's separate plans over the same GPUs); microbatch size and count; one action
list per pipeline rank; and the encoder actions that run at kernel level inside LLM actions.
Every choice a planning pass made is kept as a :class:`Decision`.

``Plan.validate`` rejects malformed plans with a message that names the rank and step, and
prints the step x rank grid with the fault marked.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from vlmcompile.ir.actions import (
    Action,
    ActionKind,
    carried,
    dependencies,
    execution_order,
    format_grid,
    hosts_of,
    interned,
)
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.placement import Placement, PlacementStyle

if TYPE_CHECKING:
    from vlmcompile.ir.layer_graph import LayerGraph

SCHEMA = "vlmcompile.plan"
SCHEMA_VERSION = 3
"""3: stages may be replicated over pipeline ranks (``replicas``) and groups may have their own
degrees (an encoder's plan beside the LLM's). Versions 1 and 2 are refused: re-plan."""
READABLE_VERSIONS = (3,)


class Recompute(str, enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    """Megatron's selective recompute: the attention core is recomputed in the backward."""
    FULL = "full"
    """The whole layer is recomputed; only its inputs are kept."""


class Reason(str, enum.Enum):
    """Why a planning pass made a decision (the report and the tests read these)."""

    ENCODER_ON_FIRST_STAGE = "encoder_on_first_stage"
    EVEN_SPLIT = "even_split"
    CHAIN_SPLIT = "chain_split"
    """Encoder and decoder layers as one chain, split evenly by layer count (Megatron placement b)."""
    FIRST_STAGE_LAYERS = "first_stage_layers"
    LAST_STAGE_LAYERS = "last_stage_layers"
    HEAD_ON_LAST_STAGE = "head_on_last_stage"
    BALANCED = "balanced"
    GLOBAL_RECOMPUTE = "global_recompute"
    TUNED_KNOB = "tuned_knob"
    """A baseline's setting chosen the way its users tune it (the fastest simulated plan that fits)."""
    COLOCATED = "colocated"
    """Every module on every rank (Megatron MIMO's colocated layout)."""
    SCHEDULE = "schedule"
    MICROBATCHES = "microbatches"
    LINEARISED_BRANCHES = "linearised_branches"
    SOLVED = "solved"
    """A stage cut or recompute flag chosen by the CP-SAT partition."""
    LAYER_RECOMPUTE = "layer_recompute"
    WARM_START = "warm_start"
    SOLVER_TIMEOUT = "solver_timeout"
    GREEDY_ANCHOR = "greedy_anchor"
    JITTERED_CUTS = "jittered_cuts"
    ADAPTIVE_RECOMPUTE = "adaptive_recompute"
    PLAN_SEARCH = "plan_search"
    SEPARATE_ENCODER_PLAN = "separate_encoder_plan"
    """The encoders' own degrees beside the LLM's (Optimus's model planner)."""
    BUBBLE_SCHEDULE = "bubble_schedule"
    """Encoder work placed into the LLM pipeline's idle time."""
    LOSS_COUPLED = "loss_coupled"
    """The loss couples the samples of a batch: one microbatch on one data-parallel rank."""
    PACKED = "packed"
    """Samples of different shapes packed into microbatches of a fixed token budget."""
    COUPLED_LOSS_SHARDED = "coupled_loss_sharded"
    """A contrastive loss computed on the whole global batch, its rows sharded over the ranks."""
    TOWER_MEMORY = "tower_memory"
    """Microbatches and activation policy of a contrastive step, chosen by memory."""
    TOWER_PLACEMENT = "tower_placement"
    """Each tower of a contrastive model on ranks of its own (DistMM)."""
    RUN_AHEAD = "run_ahead"
    """A frozen encoder's forwards for the next global batch run in this step's bubbles."""
    TOWER_TIMES = "tower_times"
    """A contrastive plan predicted with layer times measured at each tower's microbatch."""


@dataclass(frozen=True, slots=True)
class Decision:
    subject: str
    """What was decided about: a stage, a layer, the schedule."""
    reason: Reason
    detail: str
    numbers: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Parallel:
    """Parallel degrees of one group of stages (the whole model in Megatron's policy)."""

    dp: int
    tp: int
    pp: int
    v: int = 1
    """Virtual stages (model chunks) per pipeline rank."""
    sequence_parallel: bool = True
    zero_stage: int = 1
    """0: replicated optimizer; 1: optimizer states sharded over DP (Megatron's distributed
    optimizer); 2: and gradients; 3: and parameters."""
    placement: PlacementStyle = PlacementStyle.LOOP
    """Which rank holds each virtual stage (:mod:`vlmcompile.ir.placement`): ``loop`` (stage k
    on rank k mod pp) or ``v`` (V-shaped)."""

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "v"):
            if getattr(self, name) < 1:
                raise PlanError(f"parallel degree {name}={getattr(self, name)} must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"zero_stage={self.zero_stage}; use 0, 1, 2 or 3")
        object.__setattr__(self, "placement", PlacementStyle.parse(self.placement))

    @property
    def stage_placement(self) -> Placement:
        """Where this group's pp x v virtual stages sit."""
        return Placement(self.pp, self.v, self.placement)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int = 0) -> int:
        """Megatron-LM's layout: tensor-parallel fastest, then data-parallel, then pipeline."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        rest, tp_rank = divmod(rank, self.tp)
        pp_rank, dp_rank = divmod(rest, self.dp)
        return pp_rank, dp_rank, tp_rank

    def __str__(self) -> str:
        sp = ", SP" if self.sequence_parallel and self.tp > 1 else ""
        shape = ", V-shaped" if self.placement is PlacementStyle.V and self.v > 1 else ""
        return f"DP={self.dp} TP={self.tp} PP={self.pp} V={self.v}{shape}{sp}, ZeRO-{self.zero_stage}"


@dataclass(frozen=True, slots=True)
class Stage:
    index: int
    """Position in the stage chain: activations flow from stage i to stage i + 1."""
    rank: int
    """Pipeline rank that runs it (the first of its holders when it is replicated)."""
    layers: tuple[str, ...]
    """LayerGraph layer names, in order."""
    group: str = "model"
    """Key into ``Plan.parallel``."""
    replicas: tuple[int, ...] = ()
    """Other pipeline ranks holding a copy of the stage: a microbatch's forward and backward run
    on one holder, and the holders' gradients are summed (the group's data parallelism inside
    one LLM pipeline)."""

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every pipeline rank holding the stage."""
        return (self.rank, *self.replicas)


@dataclass(frozen=True, slots=True)
class Precision:
    """Bytes per element of the model states (Megatron mixed precision with Adam by default)."""

    param_bytes: int = 2
    grad_bytes: int = 4
    """fp32 main gradients."""
    optimizer_bytes: int = 12
    """fp32 master weights + Adam's two moments."""
    dp_grad_bytes: int = 4
    """Bytes per gradient element on the wire in the DP reduction."""
    compute_copy_bytes: int = 0
    """Bytes per trainable parameter element of a low-precision copy the step computes with,
    held from the weight's first forward to the step's end: 2 where fp32 parameters train under
    bf16 autocast (our runtime keeps one cast a weight a step); 0 where the parameters are kept
    in the compute dtype (Megatron-LM's bf16 parameters) or the step runs in fp32."""
    reduction_copy_bytes: int = 0
    """Bytes per trainable parameter element of the buffers a data-parallel reduction sums the
    gradients in, kept between steps, at DP > 1: 4 for our runtime's flat buckets (a copy of the
    gradients); 0 where the gradients are reduced in place (Megatron-LM's grad buffer)."""

    @classmethod
    def runtime(cls, autocast: bool) -> Precision:
        """What our runtime holds: fp32 parameters, gradients and AdamW's two moments (the
        parameters are the master weights), the gradient buckets at DP > 1, and under bf16
        autocast one bf16 copy of each trainable weight a step."""
        return cls(
            param_bytes=4,
            grad_bytes=4,
            optimizer_bytes=8,
            dp_grad_bytes=4,
            compute_copy_bytes=2 * autocast,
            reduction_copy_bytes=4,
        )


@dataclass(frozen=True, slots=True)
class Plan:
    model: str
    policy: str
    stages: tuple[Stage, ...]
    parallel: Mapping[str, Parallel]
    microbatch_size: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    """One action list per pipeline rank."""
    schedule: str
    recompute: Mapping[str, Recompute] = field(default_factory=dict)
    """Layer -> recompute flag; layers not named are not recomputed."""
    kernel_level: Mapping[Action, int] = field(default_factory=dict)
    """Encoder actions that run at kernel level -> how many LLM actions they span: their kernels
    run inside the next that many LLM actions of the pipeline's group on their rank (their
    hosts), the compute kernels in the hosts' TP communication gaps and the TP collectives
    during the hosts' compute (Optimus design decision 3). Its inputs must be there when its
    first host starts; its outputs are ready when its last host ends. How the work spreads over
    the hosts is the simulator's (:mod:`vlmcompile.sim.kernel_stream`). The runtime runs them
    before their first host, one after the other."""
    run_ahead: int = 0
    """How many global batches ahead of the step the actions in :attr:`ahead` work: 0 (none) or
    1. A frozen encoder's forwards do not depend on the step's weight update, so the next
    batch's may run in this step's bubbles (Megatron MIMO's encoder prefetch does the same)."""
    ahead: frozenset[Action] = frozenset()
    """Forwards of stages no gradient reaches that run on the next global batch's microbatch
    (its step then starts with their outputs: they wait for nothing this step, and nothing this
    step waits for them). Their outputs are held across the step boundary (the simulator counts
    them); the runtime computes them at the start of a step when it has none (the first step,
    after a resume, or a batch other than the one promised)."""
    precision: Precision = field(default_factory=Precision)
    cluster: str = ""
    decisions: tuple[Decision, ...] = ()
    fingerprint: str = ""
    """``LayerGraph.fingerprint()`` of the model the plan was made for ("" for hand-made plans)."""
    frozen: Mapping[str, int] | None = field(default_factory=dict)
    """Layer -> its parameters frozen (``requires_grad=False``) in the model the plan was made
    for, for every layer with any: what the runtime trains is exactly the rest
    (:func:`frozen_layers` of a LayerGraph; a model frozen otherwise is refused). None: a plan
    saved before plans kept it (it runs only on a model with nothing frozen)."""

    def __post_init__(self):
        # One object per equal set: dependencies() is cached on it (see interned()).
        object.__setattr__(self, "ahead", interned(frozenset(self.ahead)))

    # ---- views -----------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of(self) -> dict[str, int]:
        return {name: s.index for s in self.stages for name in s.layers}

    def stages_on(self, rank: int) -> list[Stage]:
        """The stages ``rank`` holds (replicated ones included)."""
        return [s for s in self.stages if rank in s.ranks]

    @property
    def pipeline_parallel(self) -> Parallel:
        """The degrees that lay out the ranks: the group of the last stage (the LLM's head).
        Other groups (encoders) spread their own degrees over the same GPUs."""
        return self.parallel[self.stages[-1].group]

    @property
    def global_batch(self) -> int:
        """Samples a step trains: DP x microbatches x microbatch size, the one product (a packed
        plan's microbatches hold rows of samples instead: :attr:`packed_global_batch`)."""
        return self.pipeline_parallel.dp * self.num_microbatches * self.microbatch_size

    def rank_of_action(self) -> dict[Action, int]:
        """The pipeline rank that runs each action (a replicated stage's work runs on one holder)."""
        return {a: rank for rank, acts in enumerate(self.actions) for a in acts}

    def hosts_of(self) -> dict[Action, tuple[Action, ...]]:
        """Each kernel-level action's hosts: the ``kernel_level[a]`` actions of the pipeline's
        group after it on its rank (fewer where the list ends first: ``validate`` refuses that)."""
        pipeline_group = self.stages[-1].group
        return hosts_of(
            self.actions, self.kernel_level, lambda a: self.stages[a.stage].group == pipeline_group
        )

    def forward_only_stages(self) -> frozenset[int]:
        """Stages with no backward action: no gradient reaches them (frozen, nothing trainable
        before them, :meth:`LayerGraph.forward_only`)."""
        backward = {a.stage for acts in self.actions for a in acts if a.kind is not ActionKind.F}
        return frozenset(s.index for s in self.stages if s.index not in backward)

    def carried(self) -> dict[Action, Action]:
        """The forwards of :attr:`ahead` whose output crosses the step boundary -> the forward of
        the next step that takes it (:func:`~vlmcompile.ir.actions.carried`)."""
        return carried(self.ahead)

    @property
    def packed_global_batch(self) -> int | None:
        """Samples a step of the packed plan was made for (None: one batch shape, or an older plan)."""
        found = next((d for d in self.decisions if d.reason is Reason.PACKED), None)
        return (
            int(found.numbers["global_batch"])
            if found is not None and "global_batch" in found.numbers
            else None
        )

    @property
    def packed_tokens(self) -> int | None:
        """LLM tokens of the packed microbatches the plan was made for (its ``packed`` decision);
        None: a plan for batches of one shape."""
        for d in self.decisions:
            if d.reason is Reason.PACKED:
                if "tokens" not in d.numbers:
                    raise PlanError(
                        "the plan packs samples, but was saved before plans kept their token budget: re-plan "
                        "(vlmcompile plan ... --data ... --json FILE)"
                    )
                return int(d.numbers["tokens"])
        return None

    def split_backward(self) -> frozenset[int]:
        """Stages whose backward runs as separate I and W actions."""
        return frozenset(a.stage for acts in self.actions for a in acts if a.kind is ActionKind.I)

    def recompute_of(self, layer: str) -> Recompute:
        return self.recompute.get(layer, Recompute.NONE)

    def grid(self, max_steps: int | None = 40) -> str:
        longest = max((len(a) for a in self.actions), default=0)
        steps = None if max_steps is None or longest <= max_steps else range(max_steps)
        return format_grid(self.actions, steps=steps)

    def stage_table(self) -> str:
        grouped = len(self.parallel) > 1
        rows = []
        for s in self.stages:
            rc = Counter(self.recompute_of(name).value for name in s.layers)
            names = list(s.layers)
            shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            rows.append(
                [s.index, ", ".join(map(str, s.ranks))]
                + ([s.group] if grouped else [])
                + [len(names), shown, ", ".join(f"{k} {v}" for k, v in sorted(rc.items()))]
            )
        headers = ["stage", "rank"] + (["group"] if grouped else []) + ["layers", "from .. to", "recompute"]
        return tabulate(rows, headers=headers, disable_numparse=True)

    def __str__(self) -> str:
        par = "; ".join(f"{k}: {v}" for k, v in self.parallel.items())
        head = (
            f"plan '{self.policy}' for {self.model} on {self.cluster or '?'}: {par}; "
            f"{self.num_microbatches} microbatches of {self.microbatch_size}; schedule {self.schedule}"
        )
        if self.ahead:
            head += f"; {len(self.ahead)} forwards run one global batch ahead"
        decisions = [f"  - [{d.reason.value}] {d.subject}: {d.detail}" for d in self.decisions]
        return "\n".join([head, "", self.stage_table(), "", "decisions:", *decisions])

    # ---- JSON ------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "frozen": None if self.frozen is None else dict(self.frozen),
            "policy": self.policy,
            "cluster": self.cluster,
            "schedule": self.schedule,
            "microbatch_size": self.microbatch_size,
            "num_microbatches": self.num_microbatches,
            "parallel": {k: asdict(v) for k, v in self.parallel.items()},
            "precision": asdict(self.precision),
            "stages": [asdict(s) for s in self.stages],
            "recompute": {k: v.value for k, v in self.recompute.items()},
            "kernel_level": {str(a): span for a, span in sorted(self.kernel_level.items())},
            "run_ahead": self.run_ahead,
            "ahead": [str(a) for a in sorted(self.ahead)],
            "actions": [[str(a) for a in acts] for acts in self.actions],
            "decisions": [
                {
                    "subject": d.subject,
                    "reason": d.reason.value,
                    "detail": d.detail,
                    "numbers": dict(d.numbers),
                }
                for d in self.decisions
            ],
        }

    @classmethod
    def from_json(cls, data: Any) -> Plan:
        """Read a plan from its JSON form (or from the JSON of ``vlmcompile plan --json``, which holds
        it under ``"plan"``); every field is type-checked, and a malformed one raises
        :class:`PlanError` naming it."""
        if isinstance(data, Mapping) and "schema" not in data and isinstance(data.get("plan"), Mapping):
            if data.get("frozen_layers") and "frozen" not in data["plan"]:
                raise PlanError(
                    "the plan was saved before plans kept their frozen layers (it freezes "
                    f"{len(data['frozen_layers'])} layers); re-plan: vlmcompile plan ... --freeze ... --json FILE"
                )
            data = data["plan"]
        r = _Reader(data, "plan")
        if data.get("schema") != SCHEMA:
            raise PlanError(f"not a plan JSON (schema {data.get('schema')!r}, expected {SCHEMA!r})")
        if data.get("pieces"):
            raise PlanError(
                "the plan splits layers into sub-layer pieces, which this vlmcompile does not run; re-plan"
            )
        if data.get("version") not in READABLE_VERSIONS:
            older = isinstance(data.get("version"), int) and data["version"] < SCHEMA_VERSION
            raise PlanError(
                f"plan JSON version {data.get('version')!r} is not one this vlmcompile reads "
                f"({', '.join(map(str, READABLE_VERSIONS))})"
                + ("; it was written before plans could hold encoder plans of their own" if older else "")
                + "; re-plan: `vlmcompile plan ... --json FILE`, or "
                "compile(...).plan.save(FILE)"
            )
        try:
            return cls(
                model=r.get("model", str),
                fingerprint=r.get("fingerprint", str, ""),
                frozen=_frozen(r.get("frozen", dict, None)),
                policy=r.get("policy", str),
                cluster=r.get("cluster", str, ""),
                schedule=r.get("schedule", str),
                microbatch_size=r.get("microbatch_size", int),
                num_microbatches=r.get("num_microbatches", int),
                parallel={
                    name: Parallel(**_Reader(v, f"parallel.{name}").fields(_PARALLEL_FIELDS))
                    for name, v in r.get("parallel", dict).items()
                },
                precision=Precision(
                    **_Reader(r.get("precision", dict, {}), "plan.precision").fields(_PRECISION_FIELDS)
                ),
                stages=tuple(
                    Stage(**_Reader(v, f"stages[{i}]").fields(_STAGE_FIELDS))
                    for i, v in enumerate(r.get("stages", list))
                ),
                recompute={
                    k: Recompute(_Reader.typed(v, str, f"recompute[{k!r}]"))
                    for k, v in r.get("recompute", dict, {}).items()
                },
                kernel_level={
                    Action.from_str(a): _Reader.typed(span, int, f"kernel_level[{a!r}]")
                    for a, span in r.get("kernel_level", dict, {}).items()
                },
                run_ahead=r.get("run_ahead", int, 0),
                ahead=frozenset(
                    Action.from_str(_Reader.typed(a, str, f"ahead[{i}]"))
                    for i, a in enumerate(r.get("ahead", list, []))
                ),
                actions=tuple(
                    tuple(
                        Action.from_str(_Reader.typed(a, str, f"actions[{rank}][{step}]"))
                        for step, a in enumerate(_Reader.typed(acts, list, f"actions[{rank}]"))
                    )
                    for rank, acts in enumerate(r.get("actions", list))
                ),
                decisions=tuple(
                    Decision(**_Reader(v, f"decisions[{i}]").fields(_DECISION_FIELDS))
                    for i, v in enumerate(r.get("decisions", list, []))
                ),
            )
        except PlanError:
            raise
        except (ValueError, TypeError) as err:  # enum values, actions, degrees out of range
            raise PlanError(f"malformed plan JSON: {err}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    def same_layout(self, other: Plan) -> bool:
        """Whether ``other`` runs as this plan does: the same stages, layers, recompute, ranks,
        degrees and actions (the policy that made it, and its reasons, may differ)."""
        return dataclasses.replace(other, policy=self.policy, decisions=self.decisions) == self

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan saved by :meth:`save` or by ``vlmcompile plan --json``; an unreadable or
        malformed file raises :class:`PlanError` naming the file and the fault."""
        try:
            raw = Path(path).read_bytes()
        except OSError as err:
            raise PlanError(f"cannot read plan file {str(path)!r}: {err.strerror or err}") from None
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise PlanError(f"plan file {str(path)!r} is not JSON: {err}") from None
        try:
            return cls.from_json(data)
        except PlanError as err:
            raise PlanError(f"plan file {str(path)!r}: {err}") from None

    # ---- validation ------------------------------------------------------------------------
    def validate(self, layer_graph: LayerGraph | None = None) -> None:
        """Raise :class:`PlanError` for the first fault found: structure, layer coverage (with
        ``layer_graph``), missing or misplaced actions, deadlock. Whether the plan fits in memory
        is the simulator's to say (:meth:`vlmcompile.sim.simulator.SimResult.check_fits`)."""
        _check_structure(self)
        if layer_graph is not None:
            _check_layers(self, layer_graph)
        # The action checks read the schedule and where stages sit, not the layers or recompute:
        # plans of one schedule (a policy's recompute settings, the search's candidates) pass once.
        schedule = _schedule_key(self)
        if schedule not in _SCHEDULES_CHECKED:
            _check_actions(self)
        _check_ahead(self)
        _check_kernel_level(self)
        if schedule not in _SCHEDULES_CHECKED:
            _check_deadlock(self)
            _SCHEDULES_CHECKED[schedule] = None
            if len(_SCHEDULES_CHECKED) > _SCHEDULES_KEPT:
                _SCHEDULES_CHECKED.pop(next(iter(_SCHEDULES_CHECKED)), None)

    def grid_around(self, rank: int, step: int, note: str) -> str:
        """The grid's rows near ``step``, with ``note`` next to rank ``rank``'s action there."""
        longest = max(len(a) for a in self.actions)
        return format_grid(
            self.actions, mark={(rank, step): note}, steps=range(max(0, step - 3), min(longest, step + 4))
        )


_PARALLEL_FIELDS = {
    "dp": int,
    "tp": int,
    "pp": int,
    "v": (int, 1),
    "sequence_parallel": (bool, True),
    "zero_stage": (int, 1),
    "placement": (str, "loop"),
}
_PRECISION_FIELDS = {
    "param_bytes": (int, 2),
    "grad_bytes": (int, 4),
    "optimizer_bytes": (int, 12),
    "dp_grad_bytes": (int, 4),
    "compute_copy_bytes": (int, 0),
    "reduction_copy_bytes": (int, 0),
}


_STAGE_FIELDS = {
    "index": int,
    "rank": int,
    "layers": "strings",
    "group": (str, "model"),
    "replicas": ("ints", ()),
}
_DECISION_FIELDS = {"subject": str, "reason": "reason", "detail": str, "numbers": ("numbers", {})}
_MISSING = object()


class _Reader:
    """Typed access to one JSON object of a plan file; every fault names the field."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, Mapping):
            raise PlanError(f"{where} is {_shown(data)}; expected an object")
        self.data, self.where = data, where

    def get(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        if key not in self.data:
            if default is _MISSING:
                raise PlanError(f"{self.where} lacks the field {key!r}")
            return default
        return self.typed(self.data[key], kind, f"{self.where}.{key}")

    def fields(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(self.data) - set(spec))
        if unknown:
            raise PlanError(f"{self.where} has unknown fields {unknown}; expected {sorted(spec)}")
        out = {}
        for key, kind in spec.items():
            kind, default = kind if isinstance(kind, tuple) else (kind, _MISSING)
            if kind == "strings":
                out[key] = self.strings(self.get(key, list, default), f"{self.where}.{key}")
            elif kind == "ints":
                values = self.get(key, list, default)
                out[key] = tuple(self.typed(v, int, f"{self.where}.{key}[{i}]") for i, v in enumerate(values))
            elif kind == "reason":
                value = self.get(key, str, default)
                try:
                    out[key] = Reason(value)
                except ValueError:
                    raise PlanError(f"{self.where}.{key} is {value!r}, not a known reason") from None
            elif kind == "numbers":
                numbers = self.get(key, dict, default)
                for k, v in numbers.items():
                    self.typed(v, float, f"{self.where}.{key}[{k!r}]")
                out[key] = numbers
            else:
                out[key] = self.get(key, kind, default)
        return out

    @staticmethod
    def typed(value: Any, kind: type, where: str) -> Any:
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            names = {
                int: "an integer",
                float: "a number",
                str: "a string",
                bool: "true or false",
                list: "a list",
                dict: "an object",
            }
            raise PlanError(f"{where} is {_shown(value)}; expected {names.get(kind, kind.__name__)}")
        return value

    @classmethod
    def strings(cls, value: Any, where: str) -> tuple[str, ...]:
        return tuple(cls.typed(v, str, f"{where}[{i}]") for i, v in enumerate(cls.typed(value, list, where)))


def _shown(value: Any) -> str:
    text = (
        json.dumps(value) if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__
    )
    return text if len(text) <= 40 else text[:37] + "..."


def _frozen(value: Mapping[str, Any] | None) -> dict[str, int] | None:
    """A plan JSON's ``frozen``; None where a plan saved before plans kept it has none."""
    if value is None:
        return None
    for layer, count in value.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise PlanError(
                f"plan.frozen[{layer!r}] is {count!r}; expected the layer's frozen parameters, >= 1"
            )
    return dict(value)


def frozen_layers(layer_graph: LayerGraph) -> dict[str, int]:
    """Layer -> frozen parameters, for every layer of ``layer_graph`` with any (what a plan made
    for it keeps in :attr:`Plan.frozen`)."""
    return {layer.name: layer.num_frozen_params for layer in layer_graph.layers if layer.num_frozen_params}


def check_frozen(plan: Plan, layer_graph: LayerGraph) -> None:
    """Refuse to run ``plan`` on a model frozen otherwise than the one it was made for: it would
    train what the plan keeps frozen, or keep frozen what it trains."""
    mine = frozen_layers(layer_graph)
    if plan.frozen is None:
        if mine:
            raise PlanError(
                f"the plan was saved before plans kept their frozen layers, and this model keeps {len(mine)} "
                "layers frozen: re-plan (vlmcompile plan ... --freeze ... --json FILE, or compile(...).plan)"
            )
        return
    if dict(plan.frozen) == mine:
        return

    def some(names: list[str]) -> str:
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    order = [layer.name for layer in layer_graph.layers]  # names in layer order
    planned = [n for n in order if n in plan.frozen and n not in mine]
    trained = [n for n in order if n in mine and n not in plan.frozen]
    partly = [n for n in order if n in mine and n in plan.frozen and mine[n] != plan.frozen[n]]
    parts = [f"the plan keeps {some(planned)} frozen, which the model trains"] if planned else []
    if trained:
        parts.append(f"the model keeps {some(trained)} frozen, which the plan trains")
    if partly:
        n = partly[0]
        parts.append(
            f"{some(partly)} are frozen in part otherwise ({n}: {plan.frozen[n]} parameters frozen in the plan, "
            f"{mine[n]} in the model)"
        )
    raise PlanError(
        f"{'; '.join(parts)}. Freeze the model as the plan does before compile (requires_grad_(False) on "
        "those modules; vlmcompile train reads the plan's), or make a plan for the model as it is "
        "(vlmcompile plan ... --freeze REGIONS)"
    )


def _check_structure(plan: Plan) -> None:
    if plan.microbatch_size < 1 or plan.num_microbatches < 1:
        raise PlanError(
            f"microbatch size {plan.microbatch_size} and count {plan.num_microbatches} must both be >= 1"
        )
    if not plan.stages:
        raise PlanError("the plan has no stages")
    if not plan.actions:
        raise PlanError("the plan has no action lists (one per pipeline rank)")
    for i, stage in enumerate(plan.stages):
        if stage.index != i:
            raise PlanError(
                f"stage at position {i} has index {stage.index}; stages must be listed 0, 1, 2, ..."
            )
        bad = [r for r in stage.ranks if not 0 <= r < plan.num_ranks]
        if bad:
            raise PlanError(
                f"stage {i} is placed on rank {bad[0]}, but the plan has {plan.num_ranks} pipeline ranks "
                f"(action lists); use a rank in 0..{plan.num_ranks - 1}"
            )
        if len(set(stage.ranks)) != len(stage.ranks):
            raise PlanError(
                f"stage {i} names rank(s) {list(stage.ranks)} more than once; list each holder once"
            )
        if stage.group not in plan.parallel:
            raise PlanError(f"stage {i} names parallel group {stage.group!r}, not in {sorted(plan.parallel)}")
        if not stage.layers:
            raise PlanError(f"stage {i} (rank {stage.rank}) holds no layers")
    _check_groups(plan)
    placed = Counter(n for s in plan.stages for n in s.layers)
    twice = sorted(n for n, c in placed.items() if c > 1)
    if twice:
        raise PlanError(
            f"layers in more than one stage: {twice[:5]}; each layer belongs to exactly one stage"
        )
    unknown_rc = sorted(set(plan.recompute) - set(placed))
    if unknown_rc:
        raise PlanError(f"recompute flags for layers in no stage: {unknown_rc[:5]}")


def _check_groups(plan: Plan) -> None:
    """The pipeline's group (the last stage's) lays out the ranks: its PP is the number of action
    lists. Another group (an encoder's own plan) spreads the same GPUs its own way: PP a divisor
    of the pipeline's, TP a divisor of its TP, the same number of GPUs; each of its stages is held
    by PP_pipeline / PP_group ranks."""
    pipe_name = plan.stages[-1].group
    pipe = plan.parallel[pipe_name]
    if pipe.pp != plan.num_ranks:
        raise PlanError(
            f"parallel group {pipe_name!r} says PP={pipe.pp}, but the plan has {plan.num_ranks} pipeline ranks"
        )
    for name, par in plan.parallel.items():
        if name == pipe_name:
            continue
        if plan.num_ranks % par.pp or pipe.tp % par.tp or par.world_size != pipe.world_size:
            raise PlanError(
                f"parallel group {name!r} ({par}) does not spread over the pipeline's GPUs ({pipe_name!r}: {pipe}): "
                f"its PP must divide {plan.num_ranks}, its TP divide {pipe.tp}, and DP x TP x PP equal "
                f"{pipe.world_size}"
            )
    for stage in plan.stages:
        par = plan.parallel[stage.group]
        holders = plan.num_ranks // par.pp
        if len(stage.ranks) != holders:
            raise PlanError(
                f"stage {stage.index} (group {stage.group!r}, PP={par.pp} over {plan.num_ranks} pipeline ranks) is "
                f"held by ranks {list(stage.ranks)}; it must be held by {holders} rank(s)"
                + ("" if holders == 1 else " (rank and replicas)")
            )


def _check_layers(plan: Plan, layer_graph: LayerGraph) -> None:
    names = [layer.name for layer in layer_graph.layers]
    expanded = [n for s in plan.stages for n in s.layers]
    missing = [n for n in names if n not in set(expanded)]
    if missing:
        raise PlanError(
            f"layers in no stage: {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"({len(missing)} of {len(names)}); every layer must be placed on a stage"
        )
    unknown = [n for n in expanded if n not in set(names)]
    if unknown:
        raise PlanError(f"stages name layers the model does not have: {unknown[:5]}")
    order = {n: i for i, n in enumerate(names)}
    positions = [order[n] for n in expanded]
    _check_forward_only(plan, layer_graph)
    for a, b in zip(range(len(positions)), range(1, len(positions))):
        if positions[b] < positions[a]:
            raise PlanError(
                f"layer {expanded[b]} comes after {expanded[a]} in the stage chain but before it in the model; "
                "stages must hold consecutive layers in pipeline order"
            )


def _check_forward_only(plan: Plan, layer_graph: LayerGraph) -> None:
    """A stage runs backward actions exactly when a gradient reaches it: it or a layer before it
    trains (``requires_grad``)."""
    no_gradient = layer_graph.forward_only()
    without = plan.forward_only_stages()
    for stage in plan.stages:
        reached = [n for n in stage.layers if n not in no_gradient]
        if stage.index in without and reached:
            before = layer_graph.trains_before()[reached[0]]
            why = "a layer before it trains" if before else "it trains"
            raise PlanError(
                f"stage {stage.index} has no backward actions, but its layer {reached[0]} needs one ({why}); "
                "plan again for this model's trainable parameters, or freeze the layers that train"
            )
        if stage.index not in without and not reached:
            raise PlanError(
                f"stage {stage.index} has backward actions, but no gradient reaches its layers (frozen, with "
                f"nothing trainable before them: {stage.layers[0]} ...); drop them, or plan again for "
                "this model's trainable parameters"
            )


_SCHEDULES_CHECKED: dict[tuple, None] = {}
"""The schedules (:func:`_schedule_key`) whose actions and deadlock checks passed, oldest first."""
_SCHEDULES_KEPT = 16


def _schedule_key(plan: Plan) -> tuple:
    """Everything :func:`_check_actions` and :func:`_check_deadlock` read of a plan."""
    return (
        tuple(tuple(acts) for acts in plan.actions),
        tuple((s.index, s.ranks, s.group) for s in plan.stages),
        plan.num_microbatches,
        plan.ahead,
        frozenset((plan.kernel_level or {}).items()),
    )


def _check_actions(plan: Plan) -> None:
    holders = {s.index: s.ranks for s in plan.stages}
    seen: dict[Action, tuple[int, int]] = {}
    for rank, acts in enumerate(plan.actions):
        for step, a in enumerate(acts):
            if a.stage not in holders:
                raise PlanError(
                    f"rank {rank} step {step}: {a} names stage {a.stage}, but the plan has stages "
                    f"0..{plan.num_stages - 1}\n" + plan.grid_around(rank, step, "<- unknown stage")
                )
            if rank not in holders[a.stage]:
                where = (
                    f"placed on rank {holders[a.stage][0]}"
                    if len(holders[a.stage]) == 1
                    else f"held by ranks {list(holders[a.stage])}"
                )
                raise PlanError(
                    f"rank {rank} step {step}: {a} belongs to stage {a.stage}, which is {where}\n"
                    + plan.grid_around(rank, step, "<- wrong rank")
                )
            if a.microbatch >= plan.num_microbatches:
                raise PlanError(
                    f"rank {rank} step {step}: {a} names microbatch {a.microbatch}, but the plan has "
                    f"{plan.num_microbatches}\n" + plan.grid_around(rank, step, "<- no such microbatch")
                )
            if a in seen:
                raise PlanError(
                    f"rank {rank} step {step}: {a} is scheduled twice (also at step {seen[a][1]})\n"
                    + plan.grid_around(rank, step, "<- again")
                )
            seen[a] = (rank, step)
    # A backward needs what its forward saved: on a replicated stage both run on one holder.
    for a, (rank, step) in seen.items():
        if a.kind is ActionKind.F:
            continue
        fwd = seen.get(Action(a.stage, ActionKind.F, a.microbatch))
        if fwd is not None and fwd[0] != rank:
            raise PlanError(
                f"rank {rank} step {step}: {a} runs on another rank than its forward "
                f"{Action(a.stage, ActionKind.F, a.microbatch)} (rank {fwd[0]} step {fwd[1]}); a microbatch's "
                "backward runs where its forward kept the activations\n"
                + plan.grid_around(rank, step, "<- forward elsewhere")
            )
    kinds: dict[tuple[int, int], set[ActionKind]] = defaultdict(set)
    for a in seen:
        kinds[(a.stage, a.microbatch)].add(a.kind)
    forward_only = plan.forward_only_stages()
    first_backward = min(set(range(plan.num_stages)) - forward_only, default=plan.num_stages)
    late = sorted(k for k in forward_only if k > first_backward)
    if late:
        raise PlanError(
            f"stage {late[0]} has no backward actions, but stage {first_backward} before it has: a "
            "gradient that reaches a stage flows on to every stage after it, so forward-only stages must "
            "come first"
        )
    for stage in plan.stages:
        for m in range(plan.num_microbatches):
            have = kinds[(stage.index, m)]
            if stage.index in forward_only:
                if ActionKind.F not in have:
                    raise PlanError(
                        f"{_holders_text(stage)} is missing {Action(stage.index, ActionKind.F, m)}; every "
                        "stage runs F once per microbatch\n" + plan.grid()
                    )
                continue
            if ActionKind.B in have and (ActionKind.I in have or ActionKind.W in have):
                raise PlanError(
                    f"stage {stage.index} microbatch {m} has both a full backward (B) and split (I/W) actions "
                    f"on {_holders_text(stage)}; use B, or I and W"
                )
            split = ActionKind.I in have or ActionKind.W in have
            need = (ActionKind.F, ActionKind.I, ActionKind.W) if split else (ActionKind.F, ActionKind.B)
            absent = [k for k in need if k not in have]
            if absent:
                missing = ", ".join(str(Action(stage.index, k, m)) for k in absent)
                raise PlanError(
                    f"{_holders_text(stage)} is missing {missing} (stage {stage.index}, microbatch {m}); every stage "
                    "runs F and B (or I and W) once per microbatch (only stages no gradient reaches run F "
                    "alone, for every microbatch)\n" + plan.grid()
                )


def _check_kernel_level(plan: Plan) -> None:
    """A kernel-level action is an encoder action (not of the pipeline's group) spanning at least
    one LLM action after it on its rank (its hosts), none of which needs its output or feeds it
    (they run at once)."""
    if not plan.kernel_level:
        return
    where = {a: (rank, step) for rank, acts in enumerate(plan.actions) for step, a in enumerate(acts)}
    pipeline_group = plan.stages[-1].group
    hosts = plan.hosts_of()
    split = plan.split_backward()
    for a, span in sorted(plan.kernel_level.items()):
        if a not in where:
            raise PlanError(f"kernel-level action {a} is in no rank's action list")
        rank, step = where[a]
        if plan.stages[a.stage].group == pipeline_group:
            raise PlanError(
                f"rank {rank} step {step}: {a} is marked kernel-level, but it is the pipeline's own work "
                f"(group {pipeline_group!r}); only encoder actions run inside another action\n"
                + plan.grid_around(rank, step, "<- not an encoder action")
            )
        if span < 1 or len(hosts[a]) < span:
            raise PlanError(
                f"rank {rank} step {step}: kernel-level {a} spans {span} LLM action(s), but rank {rank} has "
                f"{len(hosts[a])} after it to run inside; put it before enough of them, or run it at layer level\n"
                + plan.grid_around(rank, step, "<- too few hosts")
            )
        for host in hosts[a]:
            if a in dependencies(host, plan.num_stages, split, plan.ahead) or host in dependencies(
                a, plan.num_stages, split, plan.ahead
            ):
                raise PlanError(
                    f"rank {rank} step {step}: kernel-level {a} and its host {host} depend on each other; they "
                    "cannot run at once\n" + plan.grid_around(rank, step, "<- depends on its host")
                )


def _check_ahead(plan: Plan) -> None:
    """Run-ahead forwards: one global batch ahead at most, of stages no gradient reaches, each
    with its input made ahead too (or none: the first stage)."""
    if plan.run_ahead not in (0, 1):
        raise PlanError(
            f"run_ahead={plan.run_ahead}; vlmcompile runs forwards at most one global batch ahead (0 or 1)"
        )
    if bool(plan.ahead) != bool(plan.run_ahead):
        raise PlanError(
            f"run_ahead={plan.run_ahead} with {len(plan.ahead)} forwards ahead; give run_ahead=1 with the "
            "forwards that run for the next batch, or run_ahead=0 with none"
        )
    scheduled = {a for acts in plan.actions for a in acts}
    forward_only = plan.forward_only_stages()
    for a in sorted(plan.ahead):
        if a not in scheduled:
            raise PlanError(f"run-ahead forward {a} is in no rank's action list")
        if a.kind is not ActionKind.F or a.stage not in forward_only:
            raise PlanError(
                f"{a} runs ahead, but only forwards of stages no gradient reaches may (their weights do "
                f"not change in the step; forward-only stages: {sorted(forward_only)})"
            )
        if a.stage > 0 and Action(a.stage - 1, ActionKind.F, a.microbatch) not in plan.ahead:
            raise PlanError(
                f"{a} runs ahead, but its input {Action(a.stage - 1, ActionKind.F, a.microbatch)} does not: "
                "a forward for the next batch needs its input from the next batch"
            )


def _holders_text(stage: Stage) -> str:
    return f"rank {stage.rank}" if not stage.replicas else f"ranks {list(stage.ranks)}"


def _check_deadlock(plan: Plan) -> None:
    """Run the action lists with every action taking no time: a deadlock is a state where no
    rank's next action has its inputs."""
    split = plan.split_backward()
    order, position = execution_order(plan.actions, plan.num_stages, split, plan.hosts_of(), plan.ahead)
    done = {a for _, _, a in order}
    stuck = [r for r in range(plan.num_ranks) if position[r] < len(plan.actions[r])]
    if not stuck:
        return
    where = {}
    for rank, acts in enumerate(plan.actions):
        for step, a in enumerate(acts):
            where[a] = (rank, step)
    lines = []
    mark = {}
    for r in stuck:
        a = plan.actions[r][position[r]]
        waits = [d for d in dependencies(a, plan.num_stages, split, plan.ahead) if d not in done]
        desc = ", ".join(
            f"{d} (rank {where[d][0]} step {where[d][1]})" if d in where else f"{d} (nowhere)" for d in waits
        )
        lines.append(f"rank {r} is stuck at step {position[r]} on {a}, waiting for {desc}")
        mark[(r, position[r])] = "<- stuck"
    lo = max(0, min(position[r] for r in stuck) - 3)
    hi = min(max(len(a) for a in plan.actions), max(position[r] for r in stuck) + 4)
    raise PlanError(
        "the action lists deadlock: "
        + "; ".join(lines)
        + "\n"
        + format_grid(plan.actions, mark=mark, steps=range(lo, hi))
    )
