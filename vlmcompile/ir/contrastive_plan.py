"""The plan of a contrastive two-tower step (:mod:`vlmcompile.runtime.contrastive` runs it).

Which ranks embed which samples of the global batch and in how many microbatches, what a rank
keeps between its tower forwards and the loss (``keep`` every microbatch's activations, or
``recompute`` them in the backward phase as GradCache does), and how many rows of the loss a
rank computes at once (``tile_rows``: its memory is ``tile_rows x N`` similarities).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vlmcompile.ir.contrastive_loss import ContrastiveLoss
from vlmcompile.ir.errors import ArgumentError
from vlmcompile.ir.layer_graph import format_bytes
from vlmcompile.ir.plan import Decision, Precision


class MemoryPolicy(str, enum.Enum):
    KEEP = "keep"
    """Every microbatch's tower activations stay until its backward (memory: all of them)."""
    RECOMPUTE = "recompute"
    """Tower forwards without activations; each runs again before its backward (memory: one
    microbatch's, for a second forward)."""
    CHECKPOINT = "checkpoint"
    """Every layer's input kept, each layer's forward run again in its backward (Megatron-LM's
    full recompute, open_clip's ``--grad-checkpointing``): the baselines' rule; the contrastive
    runtime does not run it."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class SampleSplit:
    """Which samples of the global batch each rank embeds, and in which microbatches."""

    num_samples: int
    first_sample: tuple[int, ...]
    """Per rank: its first sample (ranks hold consecutive runs, in rank order)."""
    microbatches: tuple[tuple[int, ...], ...]
    """Per rank: its microbatches' sizes."""

    def __post_init__(self):
        counts = [sum(m) for m in self.microbatches]
        expected = [sum(counts[:r]) for r in range(len(counts))]
        if list(self.first_sample) != expected or sum(counts) != self.num_samples:
            raise ValueError(
                f"ranks hold samples from {list(self.first_sample)} in microbatches {self.microbatches}: "
                f"not consecutive runs covering {self.num_samples} samples"
            )
        if any(size < 1 for m in self.microbatches for size in m) or any(not m for m in self.microbatches):
            raise ValueError(
                f"microbatches {self.microbatches} leave a rank or a microbatch without samples; every rank "
                "takes part in the loss phase with samples of its own"
            )

    @classmethod
    def even(cls, num_samples: int, num_ranks: int, microbatches_per_rank: int) -> SampleSplit:
        """As even as the counts allow: the first ``num_samples % num_ranks`` ranks hold one sample
        more, and within a rank the first microbatches do.

        Raises:
            ArgumentError: fewer samples than ranks x microbatches.
        """
        if num_samples < num_ranks * microbatches_per_rank:
            raise ArgumentError(
                f"a global batch of {num_samples} samples cannot fill {num_ranks} ranks x "
                f"{microbatches_per_rank} microbatches; give at least {num_ranks * microbatches_per_rank} "
                "samples a step, or fewer microbatches"
            )
        counts = _near_equal(num_samples, num_ranks)
        return cls(
            num_samples,
            tuple(sum(counts[:r]) for r in range(num_ranks)),
            tuple(tuple(_near_equal(c, microbatches_per_rank)) for c in counts),
        )

    @property
    def num_ranks(self) -> int:
        return len(self.microbatches)

    def count(self, rank: int) -> int:
        return sum(self.microbatches[rank])

    @property
    def sizes(self) -> frozenset[int]:
        return frozenset(s for m in self.microbatches for s in m)


def _near_equal(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


@dataclass(frozen=True, slots=True)
class TowerStepCost:
    """A contrastive step's predicted seconds on its busiest rank, by phase, and what its loss
    phase moves and holds (a cost model's prediction, not a measurement)."""

    towers_fwd_s: float
    towers_bwd_s: float
    """Both towers' backward; with ``recompute``, their forward run again is in it."""
    loss_s: float
    """The loss phase's compute: the rank's rows of similarities, forward and backward."""
    gather_s: float
    scatter_s: float
    grad_reduce_s: float
    gather_bytes: float
    """Both embeddings of the whole batch, gathered onto every rank."""
    scatter_bytes: float
    """The gathered embeddings' gradients, reduce-scattered back to their owners."""
    loss_mem_bytes: float
    """The loss phase's memory on a rank: the gathered embeddings and one tile of similarities."""
    mem_bytes: float
    """The busiest rank's peak: model states, activations and the loss phase."""

    @property
    def step_s(self) -> float:
        return (
            self.towers_fwd_s
            + self.loss_s
            + self.gather_s
            + self.scatter_s
            + self.towers_bwd_s
            + self.grad_reduce_s
        )

    @property
    def loss_phase_s(self) -> float:
        return self.loss_s + self.gather_s + self.scatter_s


@dataclass(frozen=True, slots=True)
class TowerPlacement:
    """One tower's ranks (global ranks, in order) and how the batch's samples spread over them."""

    ranks: tuple[int, ...]
    split: SampleSplit
    """Over the tower's data-parallel groups: ``tp x pp`` ranks embed the same samples."""
    memory: MemoryPolicy | None = None
    """This tower's activation policy (None: the plan's)."""
    tp: int = 1
    """Tensor-parallel degree: consecutive ranks of one node share each layer's matrices."""
    pp: int = 1
    """Pipeline stages: the tower's layers in ``pp`` consecutive stages, its microbatches run
    through them (GPipe's order) before the loss. Ranks are laid out as Megatron-LM's: tensor-
    parallel fastest, then data-parallel, then pipeline."""

    def __post_init__(self):
        size = self.split.num_ranks * self.tp * self.pp
        if min(self.tp, self.pp) < 1 or len(self.ranks) != size or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(
                f"tower ranks {list(self.ranks)} for a split over {self.split.num_ranks} data-parallel "
                f"groups of tp={self.tp} x pp={self.pp}"
            )
        if self.memory is not None:
            object.__setattr__(self, "memory", MemoryPolicy(self.memory))

    @property
    def dp(self) -> int:
        return self.split.num_ranks

    def rows_of(self, rank: int) -> tuple[int, int]:
        """(first sample, count) this global rank embeds in this tower; (0, 0) if it holds none."""
        if rank not in self.ranks:
            return 0, 0
        group = (self.ranks.index(rank) // self.tp) % self.dp
        return self.split.first_sample[group], self.split.count(group)


@dataclass(frozen=True, slots=True)
class ContrastivePlan:
    """Everything the contrastive step needs, and why it was chosen."""

    loss: ContrastiveLoss
    split: SampleSplit
    """How the samples spread over the ranks when both towers sit on every rank (colocated)."""
    memory: MemoryPolicy = MemoryPolicy.KEEP
    tile_rows: int = 4096
    decisions: tuple[Decision, ...] = field(default_factory=tuple)
    predicted: TowerStepCost | None = None
    separate: tuple[TowerPlacement, TowerPlacement] | None = None
    """Each tower on ranks of its own (DistMM's placement), each with its own split of the whole
    batch; None: both towers on every rank, as ``split`` says."""
    gpus_per_node: int | None = None
    """The cluster's node size, for the report's node x GPU grid (None: no grid)."""
    tp: int = 1
    """Colocated: the tensor-parallel degree of both towers (``split`` is over the data-parallel
    groups); separate: each placement has its own."""
    precision: Precision = field(default_factory=Precision)
    zero_stage: int = 1
    """Optimizer states sharded over each tower's data-parallel ranks (1) or replicated (0, DDP)."""

    def memory_of(self, tower: int) -> MemoryPolicy:
        """The activation policy of one tower (its own, when it has ranks of its own and one)."""
        return self.placement(tower).memory or self.memory

    def placement(self, tower: int) -> TowerPlacement:
        if self.separate is not None:
            return self.separate[tower]
        return TowerPlacement(tuple(range(self.split.num_ranks * self.tp)), self.split, tp=self.tp)

    def __post_init__(self):
        if self.separate is not None:
            ranks = sorted(r for p in self.separate for r in p.ranks)
            if ranks != list(range(len(ranks))) or len(set(ranks)) != len(ranks):
                raise ValueError(
                    f"towers on ranks {[list(p.ranks) for p in self.separate]}: each rank must hold one tower, "
                    f"ranks 0..{len(ranks) - 1}"
                )
            if any(p.split.num_samples != self.split.num_samples for p in self.separate):
                raise ValueError("each tower embeds the whole global batch: give both splits its samples")
        if self.tile_rows < 1:
            raise ArgumentError(f"tile_rows={self.tile_rows}; give a positive number of loss rows a tile")
        object.__setattr__(self, "memory", MemoryPolicy(self.memory))

    def grid(self) -> list[str]:
        """The placement as a node x GPU grid: which tower (0, 1, or 01 for both) each rank runs."""
        if not self.gpus_per_node:
            return []
        towers = [
            "".join(str(t) for t in (0, 1) if r in self.placement(t).ranks) for r in range(self.num_ranks)
        ]
        per = self.gpus_per_node
        lines = ["  placement (node x GPU: the tower each runs):"]
        for node in range(-(-self.num_ranks // per)):
            cells = towers[node * per : (node + 1) * per]
            lines.append(f"    node {node}: " + " ".join(f"{c:>2}" for c in cells))
        return lines

    @property
    def num_ranks(self) -> int:
        if self.separate is not None:
            return sum(len(p.ranks) for p in self.separate)
        return self.split.num_ranks * self.tp

    @property
    def global_batch(self) -> int:
        return self.split.num_samples

    def __str__(self) -> str:
        if self.separate is None:
            counts = [self.split.count(r) for r in range(self.split.num_ranks)]
            where = [
                f"contrastive step: {self.global_batch} samples on {self.num_ranks} ranks (both towers on each), "
                f"{_per_group(self.tp, 1)} {counts}, microbatches {[list(m) for m in self.split.microbatches]}"
            ]
        else:
            where = [f"contrastive step: {self.global_batch} samples, each tower on ranks of its own"] + [
                f"  tower {t} on ranks {list(p.ranks)}: {_per_group(p.tp, p.pp)} "
                f"{[p.split.count(i) for i in range(p.split.num_ranks)]}, microbatches "
                f"{[list(m) for m in p.split.microbatches]}, activations {self.memory_of(t)}"
                for t, p in enumerate(self.separate)
            ]
        lines = [
            *where,
            f"  {self.loss.kind} loss on the whole batch, rows sharded over the ranks, tiles of "
            f"{self.tile_rows} rows; activations: {self.memory}",
        ]
        lines += [f"  {d.subject}: {d.detail}" for d in self.decisions]
        lines += self.grid()
        p = self.predicted
        if p is not None:
            lines.append(
                f"  predicted step {p.step_s * 1e3:.2f} ms: tower forwards {p.towers_fwd_s * 1e3:.2f}, loss phase "
                f"{p.loss_phase_s * 1e3:.2f} (compute {p.loss_s * 1e3:.2f}, all-gather of {format_bytes(p.gather_bytes)} "
                f"{p.gather_s * 1e3:.2f}, reduce-scatter of {format_bytes(p.scatter_bytes)} {p.scatter_s * 1e3:.2f}; "
                f"{format_bytes(p.loss_mem_bytes)} a rank), tower backwards {p.towers_bwd_s * 1e3:.2f}, gradient "
                f"all-reduce {p.grad_reduce_s * 1e3:.2f}; peak memory {format_bytes(p.mem_bytes)} (simulated)"
            )
        return "\n".join(lines)


def _per_group(tp: int, pp: int) -> str:
    if tp == pp == 1:
        return "samples per rank"
    return f"tp {tp}, pp {pp}, samples per data-parallel group"
