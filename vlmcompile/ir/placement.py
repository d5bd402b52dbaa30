"""Which pipeline rank holds each virtual stage: the one placement rule.

A pipeline of ``pp`` ranks with ``v`` virtual stages (model chunks) per rank has ``pp x v``
stages in chain order; stage k belongs to chunk ``k // pp``. torch.distributed.pipelining
names the two layouts in use (``generate_stage_to_rank_mapping(pp, num_stages, style)``):

* ``loop`` - stage k on rank ``k mod pp``: Megatron-LM's interleaved placement, and plain 1F1B
  when v = 1;
* ``v`` - the chunks alternate direction: even chunks go down the ranks, odd chunks come back
  up, so the last rank holds two consecutive stages and rank 0 holds the first and the last
  (the V shape of zero-bubble V schedules, Qi et al. 2024). Activations between the two stages
  at a turn stay on their rank.

With v = 1 the two are the same. An encoder's own pipeline replicated along the LLM's ranks is
placed by :func:`replicated_stage_ranks`. Every builder, schedule, solver and baseline asks this
module where a stage goes; no other module computes a rank from a stage index.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vlmcompile.ir.errors import PlanError, choice


class PlacementStyle(str, enum.Enum):
    LOOP = "loop"
    V = "v"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: PlacementStyle | str) -> PlacementStyle:
        return choice(cls, value, "stage placement")


def stage_to_rank(stage: int, pp: int, style: PlacementStyle | str = PlacementStyle.LOOP) -> int:
    """The pipeline rank of virtual stage ``stage`` among ``pp`` ranks (see the module docstring)."""
    if pp < 1 or stage < 0:
        raise PlanError(f"stage {stage} on {pp} pipeline ranks: give pp >= 1 and a stage >= 0")
    chunk, position = divmod(stage, pp)
    if PlacementStyle.parse(style) is PlacementStyle.V and chunk % 2:
        return pp - 1 - position
    return position


def replicated_stage_ranks(stage: int, stages: int, pp: int) -> tuple[int, ...]:
    """The ranks holding ``stage`` of a pipeline of ``stages`` stages that is replicated along
    ``pp`` ranks, one copy per run of ``stages`` consecutive ranks: an encoder's own pipelines
    along the LLM's (Optimus fig. 5: encoder pipeline k runs its stage i on rank k x PP_enc + i)."""
    if stages < 1 or pp % stages or not 0 <= stage < stages:
        raise PlanError(
            f"stage {stage} of {stages} cannot be replicated along {pp} ranks; {stages} must divide {pp}"
        )
    return tuple(k * stages + stage for k in range(pp // stages))


@dataclass(frozen=True, slots=True)
class Placement:
    """The placement of ``pp x v`` virtual stages on ``pp`` ranks."""

    pp: int
    v: int = 1
    style: PlacementStyle = PlacementStyle.LOOP

    def __post_init__(self):
        if self.pp < 1 or self.v < 1:
            raise PlanError(f"a placement needs pp >= 1 and v >= 1 (got pp={self.pp}, v={self.v})")
        object.__setattr__(self, "style", PlacementStyle.parse(self.style))

    @property
    def num_stages(self) -> int:
        return self.pp * self.v

    def rank_of(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise PlanError(
                f"stage {stage} is outside the {self.num_stages} stages (pp x v = {self.pp} x {self.v})"
            )
        return stage_to_rank(stage, self.pp, self.style)

    def ranks(self) -> tuple[int, ...]:
        """Each stage's rank, in stage order."""
        return tuple(self.rank_of(k) for k in range(self.num_stages))

    def stages_on(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, chunk by chunk (its first chunk's stage first)."""
        if self.style is PlacementStyle.LOOP and 0 <= rank < self.pp:
            return tuple(range(rank, self.num_stages, self.pp))  # stage k on rank k mod pp
        return tuple(k for k in range(self.num_stages) if self.rank_of(k) == rank)

    def stage_at(self, rank: int, chunk: int) -> int:
        """The stage of chunk ``chunk`` on ``rank``."""
        return self.stages_on(rank)[chunk]
