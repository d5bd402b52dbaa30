"""Training steps of packed samples: step ``k``'s global batch packed into a pipeline's
microbatches, the same on every rank, and the padded batch eager trains on for the same step.

A step packs the samples its global batch holds and those the step before deferred (they go
first, so no sample waits more than one step while the carried ones fit the step's rows); what
fits in none of its microbatches is deferred to the next step, counted in
:class:`~vlmcompile.ir.packed.PackedBatch`, never dropped. Which samples a step defers follows
from the sample sizes alone, so step ``k`` is computed from step 0 on (or from a checkpoint's
:meth:`PackedSteps.state`) without building the samples of the steps before it.

The backlog is bounded: a step that would leave more samples for the next than a whole step's
(or than were carried into it) is refused before it trains (:class:`DeferralError`), and
:func:`check_run` replays a run's steps on the dataset's sizes before any rank starts, so a global
batch the plan's microbatches cannot hold is refused with the largest they can.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TextIO

import torch
import torch.distributed as dist

from vlmcompile.data.balance import SampleSizes
from vlmcompile.data.distribution import backlog_limit
from vlmcompile.data.families import Family
from vlmcompile.data.microbatches import assign
from vlmcompile.data.packed_step import step_inputs
from vlmcompile.data.packing import (
    check_budget,
    pack_assigned,
    padded_batch,
    sample_length,
    sample_name,
    samples_of,
    too_long,
)
from vlmcompile.ir.errors import DataError, positive_int
from vlmcompile.ir.packed import BatchPlan, PackedBatch, nonfinite_keys

Sample = Mapping[str, Any]

REPLAY_LIMIT = 2_000_000
"""Sample placements :func:`check_run` replays at most before a run (a few seconds); the steps
past them are checked as they come (:class:`DeferralError`)."""


class DeferralError(DataError):
    """A step would leave more samples for the next than the run allows: the global batch
    outgrows the plan's microbatches."""


class _Given(NamedTuple):
    """A sample of data given as a function of the step (no dataset index to name it by)."""

    step: int
    index: int
    sample: Sample


Item = int | _Given
"""A sample of a step: its dataset index (data from a dataset), else the sample itself."""


@dataclass
class PackedSteps:
    """``steps(k)``: step ``k``'s :class:`PackedBatch` for ``num_microbatches`` microbatches of
    ``tokens`` LLM tokens. ``samples(k)`` gives step ``k``'s global batch as a list of samples:
    a :class:`~vlmcompile.runtime.global_batches.GlobalBatches` with ``collate=list`` (its samples are then
    named, sized and checkpointed by dataset index), or any function of the step."""

    samples: Callable[[int], Sequence[Sample]]
    family: Family
    tokens: int
    num_microbatches: int
    assignment: str = "greedy"
    """How a step's samples go to microbatches (:mod:`vlmcompile.data.microbatches`): ``greedy``
    or ``cp-sat`` (image rows even over microbatches and replicas, within the token budget), or
    ``tokens`` (longest first into the emptiest row). Greedy by default: on the synthetic
    datasets CP-SAT's heaviest microbatch is 1-4 % lighter at 100-1000 times the time
    (``benchmarks/dynamic_batches.py``)."""
    replicas: int = 1
    """Data-parallel replicas the microbatches are split over (each its ``1 / replicas``)."""
    schedule: Callable[[Sequence[int]], BatchPlan] | None = None
    """Image rows per microbatch (all of a step's, every replica's in turn) -> the step's own
    schedule. Solved on global rank 0 alone (the runner sends rank 0's to every rank), for step
    ``k + 1`` while step ``k`` trains."""
    sizes: SampleSizes | None = None
    """LLM tokens and vision rows of every dataset sample (data from a dataset): steps are
    assigned from them without building a sample (None: read off each step's samples)."""
    _carried: dict[int, list[Item]] = field(default_factory=lambda: {0: []}, repr=False)
    """Step -> the samples deferred into it (computed steps only)."""
    _newest: int = field(default=0, repr=False)
    """The latest step of :attr:`_carried`, where a replay goes on from (in O(1))."""
    _planned: dict[int, tuple] = field(default_factory=dict, repr=False)
    """The last steps' :meth:`_plan` (a step is asked for several times: assigned once)."""
    _own: dict[int, int] = field(default_factory=dict, repr=False)
    """Step -> the samples of its own global batch (computed steps only)."""
    _ahead: dict[int, Future] = field(default_factory=dict, repr=False)
    _solver: ThreadPoolExecutor | None = field(default=None, repr=False)

    def __post_init__(self):
        positive_int("tokens", self.tokens, "the LLM tokens of a microbatch")
        positive_int("num_microbatches", self.num_microbatches, "the microbatches of a step")

    def __getstate__(self) -> dict:
        # Pickled for the local launcher's ranks: a solver thread and its futures stay here.
        return {**self.__dict__, "_ahead": {}, "_solver": None, "_planned": {}, "_own": {}}

    # ---- the samples, by dataset index where there is one ------------------------------------
    @property
    def dataset(self) -> Any:
        """The dataset the steps draw from (None: data given as a function of the step)."""
        return getattr(self.samples, "dataset", None) if hasattr(self.samples, "indices") else None

    def _items(self, step: int) -> list[Item]:
        if self.dataset is not None:
            return list(self.samples.indices(step))
        return [_Given(step, j, s) for j, s in enumerate(samples_of(self.samples(step), self.family))]

    def _sample(self, item: Item) -> Sample:
        return item.sample if isinstance(item, _Given) else self.dataset[item]

    def name(self, item: Item) -> str:
        """How a message names the sample: its dataset index (and manifest line), or its place."""
        if isinstance(item, _Given):
            return f"sample {item.index} of step {item.step + 1}'s global batch"
        return sample_name(self.dataset, item)

    def _size(self, item: Item) -> tuple[int, int]:
        """(LLM tokens, vision rows) of a sample: the sizes table's, else the sample's own."""
        if self.sizes is not None and not isinstance(item, _Given):
            return int(self.sizes.llm_tokens[item]), int(self.sizes.vision_rows[item])
        sample = self._sample(item)
        return sample_length(sample, self.family, self.name(item)), self.family.vision_rows(sample)

    # ---- which samples each step packs --------------------------------------------------------
    def _plan(self, step: int) -> tuple[list[Item], list[list[int]], list[int]]:
        """Step ``step``'s samples (carried first), their positions per microbatch, the deferred."""
        if step not in self._planned:
            self._planned = {k: v for k, v in self._planned.items() if k >= step - 1}
            self._planned[step] = self._assigned(step)
        return self._planned[step]

    def _assigned(self, step: int) -> tuple[list[Item], list[list[int]], list[int]]:
        carried = self._carried_into(step)
        own = self._items(step)
        self._own[step] = len(own)
        todo = [*carried, *own]
        if not todo:
            raise DataError(f"step {step + 1} has no samples; the data gave an empty global batch")
        sizes = [self._size(item) for item in todo]
        longest = max(range(len(todo)), key=lambda i: sizes[i][0])
        if sizes[longest][0] > self.tokens:
            raise too_long(self.name(todo[longest]), sizes[longest][0], self.tokens)
        made = assign(
            [n for n, _ in sizes],
            [v for _, v in sizes],
            self.num_microbatches,
            self.tokens,
            first=len(carried),
            replicas=self.replicas,
            method=self.assignment,
        )
        return todo, [list(r) for r in made.rows], list(made.deferred)

    def _carried_into(self, step: int) -> list[Item]:
        if step in self._carried:
            return self._carried[step]
        if self._newest <= step:
            known = self._newest
        else:  # asked for an earlier step than the latest (rare): the nearest before it
            known = max((k for k in self._carried if k <= step), default=None)
        if known is None:
            raise DataError(
                f"step {step + 1} comes before step {min(self._carried) + 1}, where these steps start"
            )
        for k in range(known, step):
            self._carry(k)
        return self._carried[step]

    def _carry(self, step: int) -> None:
        """What step ``step`` leaves, as the next step's first samples."""
        todo, _, deferred = self._plan(step)
        self._carried[step + 1] = [todo[i] for i in deferred]
        self._newest = max(self._newest, step + 1)

    def limit(self, step: int) -> int:
        """The samples step ``step`` may leave for the next: a whole step's, or as many as were
        carried into it (a backlog that shrinks, as after a run resumed with fewer samples a
        step, goes on; one that grows past a step is refused)."""
        self._plan(step)
        return max(backlog_limit(self._own[step]), len(self._carried_into(step)))

    def _check_backlog(self, step: int, deferred: int) -> None:
        limit = self.limit(step)
        if deferred > limit:
            raise DeferralError(
                f"step {step + 1} would leave {deferred} samples for the next, more than the {limit} a step may "
                f"(its {self.num_microbatches} microbatches of {self.tokens} LLM tokens cannot hold its samples "
                "and the backlog grows): plan for this global batch (vlmcompile plan --data ... --global-batch N), "
                "or give fewer samples a step"
            )

    def trained(self, step: int) -> list[Sample]:
        """The samples step ``step`` trains on (carried in, and its own not deferred)."""
        todo, rows, _ = self._plan(step)
        return [self._sample(todo[i]) for row in rows for i in row]

    def __call__(self, step: int) -> PackedBatch:
        ahead = self._ahead.pop(step, None)
        if ahead is not None:
            ahead.result()  # the solve shares this object's state: let it finish first
        todo, rows, deferred = self._plan(step)
        self._check_backlog(step, len(deferred))
        self._carry(step)
        used, samples, names = self._built(step)
        lengths = [sample_length(sample, self.family, name) for sample, name in zip(samples, names)]
        if self.sizes is not None:
            for i, name, length in zip(used, names, lengths):
                _check_size(name, length, self._size(todo[i])[0])
        place = {i: k for k, i in enumerate(used)}
        packing = pack_assigned(
            samples,
            self.family,
            [[place[i] for i in r] for r in rows],
            self.tokens,
            names=names,
            lengths=lengths,
        )
        microbatches = tuple(
            step_inputs(mb, self.family, packing.label_tokens) for mb in packing.microbatches
        )
        schedule = None
        if self.schedule is not None and _plans_here():
            schedule = ahead.result() if ahead is not None else self.schedule(self._image_rows(step))
            if self._solver is None:
                self._solver = ThreadPoolExecutor(1, thread_name_prefix="batch-schedule")
            self._ahead = {step + 1: self._solver.submit(self._solve_ahead, step + 1)}
        images = any(self.family.vision_rows(s) for s in samples)
        return PackedBatch(microbatches, len(used), tuple(deferred), schedule, images=images)

    def _built(self, step: int) -> tuple[list[int], list[Sample], list[str]]:
        """The positions (in :meth:`_plan`'s list) of the samples step ``step`` trains, the
        samples, built, and their names."""
        todo, rows, _ = self._plan(step)
        used = sorted({i for row in rows for i in row})
        return used, [self._sample(todo[i]) for i in used], [self.name(todo[i]) for i in used]

    def nonfinite(self, step: int) -> tuple[str, ...]:
        """Each sample of step ``step`` that holds NaN or infinite values: its name, the keys,
        its packed microbatch and the data-parallel rank that runs it (read only when a step's
        loss is non-finite: the samples are built again)."""
        _, rows, _ = self._plan(step)
        used, samples, names = self._built(step)
        microbatch = {i: k for k, row in enumerate(rows) for i in row}
        per_rank = max(1, len(rows) // self.replicas)
        out = []
        for i, sample, name in zip(used, samples, names):
            bad = nonfinite_keys(sample)
            if bad:
                k = microbatch[i]
                out.append(
                    f"{name} holds NaN or infinite values in {bad} (packed microbatch {k}, data-parallel rank "
                    f"{k // per_rank})"
                )
        return tuple(out)

    def _image_rows(self, step: int) -> list[int]:
        """Image rows each of step ``step``'s microbatches carries, as its inputs count them
        (a microbatch without images runs the encoder on the family's smallest)."""
        todo, rows, _ = self._plan(step)
        return [max(1, sum(self._size(todo[i])[1] for i in row)) for row in rows]

    def _solve_ahead(self, step: int) -> BatchPlan:
        return self.schedule(self._image_rows(step))

    # ---- checkpoints ---------------------------------------------------------------------------
    def epochs(self, step: int) -> float | None:
        """Epochs of the dataset the steps before step ``step`` took (None: data without one)."""
        return self.samples.epochs(step) if self.dataset is not None else None

    def state(self, step: int) -> dict[str, Any] | None:
        """What a checkpoint saved after step ``step`` (0-based) keeps: where the next step begins
        in the stream and the dataset indices it carries in (None: data without indices)."""
        if self.dataset is None:
            return None
        todo, _, deferred = self._plan(step)
        return {**self.samples.state(step), "carried": [int(todo[i]) for i in deferred]}

    def resumed(self, step: int, state: Mapping[str, Any]) -> PackedSteps:
        """These steps going on at step ``step`` from a checkpoint's :meth:`state` (with any
        global batch: the stream goes on where the checkpoint left it, its backlog first)."""
        if self.dataset is None or "carried" not in state:
            return self
        carried = [int(i) for i in state["carried"]]
        bad = [i for i in carried if not 0 <= i < len(self.dataset)]
        if bad:
            raise DataError(f"the checkpoint carries dataset samples {bad[:5]}, which this dataset has not")
        return dataclasses.replace(
            self,
            samples=self.samples.resumed(step, state),
            _carried={step: carried},
            _newest=step,
            _planned={},
            _own={},
            _ahead={},
        )


def _check_size(name: str, real: int, sized: int) -> None:
    if real != sized:
        raise DataError(
            f"{name} has {real} LLM tokens, but the dataset's sizes say {sized}; make its sizes(i) agree with "
            "its samples"
        )


@dataclass(frozen=True, slots=True)
class RunCheck:
    """What :func:`check_run` found."""

    samples: int
    longest: int
    tokens: int
    steps: tuple[int, int]
    """The steps replayed (first, last), 1-based."""
    most_deferred: int
    limit: int

    def __str__(self) -> str:
        first, last = self.steps
        replayed = (
            f"replaying steps {first}-{last} on their sizes, a step leaves at most {self.most_deferred} samples for "
            f"the next (the run allows {self.limit})"
            if last >= first
            else "no step to replay"
        )
        return (
            f"checked the data before training: {self.samples} samples, the longest {self.longest} LLM tokens "
            f"(a microbatch holds {self.tokens}); {replayed}"
        )


def check_run(steps: PackedSteps, first: int, last: int, *, log: TextIO | None = sys.stderr) -> RunCheck:
    """Before any rank starts: the sizes of every sample of ``steps``' dataset (kept in
    ``steps.sizes``), none over the token budget, and the steps ``first`` .. ``last - 1`` replayed on
    them (to :data:`REPLAY_LIMIT` placements): none may leave more samples for the next than the
    run allows. A :class:`DataError` names the sample too long, or the step whose backlog grows
    too far and the largest global batch the microbatches hold."""
    if steps.dataset is None:
        raise DataError("only data drawn from a dataset (GlobalBatches) can be checked before training")
    if steps.sizes is None:  # every sample's, checked as packing checks it, with progress lines
        dataset = steps.dataset
        steps.sizes = SampleSizes.of(dataset, steps.family, log=log, name=lambda i: sample_name(dataset, i))
    tokens = steps.sizes.llm_tokens
    longest = int(tokens.argmax())
    if int(tokens[longest]) > steps.tokens:
        over = int((tokens > steps.tokens).sum())
        raise too_long(
            sample_name(steps.dataset, longest), int(tokens[longest]), steps.tokens, over, len(tokens)
        )
    check_budget(steps.tokens, "the plan's token budget")
    batch = steps.samples.global_batch
    last = min(last, first + max(1, REPLAY_LIMIT // (batch * steps.num_microbatches)))
    most, failed = _replayed(steps, first, last)
    if failed is not None:
        step, deferred = failed
        fits = _largest_global_batch(steps, first, last)
        held = (
            f"the most they hold is {fits} a step (found replaying as many samples): give --global-batch {fits} "
            f"(global_batch={fits}), or plan for {batch}"
            if fits
            else f"plan for {batch}"
        )
        raise DeferralError(
            f"the plan's {steps.num_microbatches} microbatches of {steps.tokens} LLM tokens cannot hold {batch} samples "
            f"a step of this data: replayed on its sizes, step {step + 1} would leave {deferred} samples for the next "
            f"(a run allows {steps.limit(step)}, a whole step's) and the backlog grows. {held[0].upper()}{held[1:]}: "
            f"vlmcompile plan --data ... --global-batch {batch}"
        )
    return RunCheck(
        len(tokens), int(tokens[longest]), steps.tokens, (first + 1, last), most, steps.limit(first)
    )


def _replayed(steps: PackedSteps, first: int, last: int) -> tuple[int, tuple[int, int] | None]:
    """The most samples a step of ``first`` .. ``last - 1`` leaves for the next, and the first
    step that leaves more than the run allows with how many (None if none does)."""
    most = 0
    for step in range(first, last):
        _, _, deferred = steps._plan(step)
        most = max(most, len(deferred))
        if len(deferred) > steps.limit(step):
            return most, (step, len(deferred))
        steps._carry(step)
    return most, None


def _largest_global_batch(steps: PackedSteps, first: int, last: int) -> int:
    """The largest global batch found whose steps, replayed over as many samples as ``first`` ..
    ``last - 1`` take, stay within the run's backlog (0: not even one sample a step): a bisection,
    then the few above it (a backlog is not quite monotone in the global batch)."""
    source, samples = steps.samples, (last - first) * steps.samples.global_batch

    def holds(batch: int) -> bool:
        trial = dataclasses.replace(
            steps,
            samples=dataclasses.replace(source, global_batch=batch),
            _carried={first: list(steps._carried_into(first))},
            _newest=first,
            _planned={},
            _own={},
        )
        return _replayed(trial, first, first + -(-samples // batch))[1] is None

    low, high = 0, source.global_batch - 1
    while low < high:
        batch = (low + high + 1) // 2
        low, high = (batch, high) if holds(batch) else (low, batch - 1)
    above = range(low + 1, min(source.global_batch, low + 1 + _ABOVE))
    return max([low, *(b for b in above if holds(b))])


_ABOVE = 8
"""Global batches above the bisection's answer tried one by one."""


@dataclass(frozen=True)
class PaddedSteps:
    """``steps(k)``: the samples packed step ``k`` trains on, right-padded in one batch (what an
    eager loop trains on for the same step: ``model(**batch).loss``)."""

    packed: PackedSteps

    def __call__(self, step: int) -> dict[str, torch.Tensor]:
        return padded_batch(self.packed.trained(step), self.packed.family)


def _plans_here() -> bool:
    """Whether this process makes the steps' schedules: global rank 0, or no ranks at all."""
    return not dist.is_initialized() or dist.get_rank() == 0
