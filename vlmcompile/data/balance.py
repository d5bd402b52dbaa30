"""Balanced mini-batches: OmniBal's Iterative Sampling and Filtering (ISF, its Algorithm 1) as a
``torch.utils.data`` batch sampler, and the two measures it is judged by.

A sample is two sizes here: its LLM tokens (text and image tokens: what the LLM runs) and its
vision rows (tiles or patches: what the vision encoder runs). ISF groups samples so that both
sums land near targets, in rounds:

* sampling: walk the remaining samples in random order, adding each to the current group; a
  sample that would take the group past the vision target ``Q_v`` or the text target ``Q_t``
  closes the group and starts the next one;
* filtering: keep a group whose vision rows reach ``Q'_v`` or whose tokens reach ``Q'_t``, and
  take its samples out of the pool; the other groups go back to the pool for the next round.

Targets from the dataset's statistics, as OmniBal's section 5.1 sets them: ``Q_t`` is the longest
sample's tokens, ``Q_v`` follows from the dataset's ratio of vision rows to tokens
(``Q_v = Q_t * rows / tokens``), ``Q'_v = Q_v`` and ``Q'_t = Q_t - 128`` at the paper's
``Q_t`` = 4K: we keep that slack as the same share (1/32) of ``Q_t`` for datasets of other lengths.

What no round could place is not lost: it is grouped without the filter at the end of the epoch
(its own, unbalanced, mini-batches; :attr:`BalancedEpoch.unbalanced` counts them), so every
sample trains once an epoch.

Measures (OmniBal, eq. 1 and 2), each for the LLM and for the vision encoder:

* Pad Ratio: within a mini-batch, the share of padding when every sample is padded to the
  largest: ``sum(t_max - t_i) / (t_max * B)``, averaged over mini-batches;
* Dist Ratio: across ``dp`` devices taking one mini-batch each per step, the share of idle work:
  ``sum(T_max - T_i) / (T_max * N)``, averaged over steps. ``T_i`` is the mini-batch's padded
  tokens for the LLM (``B * t_max``) and its vision rows summed for the encoder (an image's tiles
  are never padded); and, for a packed LLM (vlmcompile's), its tokens summed.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np
import torch

from vlmcompile.data.families import Family
from vlmcompile.data.packing import sample_length
from vlmcompile.ir.errors import DataError, positive_int

TEXT_SLACK = 128 / 4096
"""``Q_t - Q'_t`` as a share of ``Q_t``: OmniBal's 128 tokens at ``Q_t`` = 4K (its Table 6)."""
ROUNDS = 8
"""Sampling-and-filtering rounds an epoch at most (OmniBal's ``T``)."""


@dataclass(frozen=True)
class SampleSizes:
    """Per sample: LLM tokens and vision rows."""

    llm_tokens: np.ndarray
    vision_rows: np.ndarray

    def __post_init__(self):
        if len(self.llm_tokens) != len(self.vision_rows):
            raise DataError(f"{len(self.llm_tokens)} token counts for {len(self.vision_rows)} vision counts")
        for name, values in (("llm_tokens", self.llm_tokens), ("vision_rows", self.vision_rows)):
            bad = np.flatnonzero(np.asarray(values) < 0)
            if len(bad):
                raise DataError(
                    f"{name}[{int(bad[0])}] is {int(values[bad[0]])}: a sample's sizes are counts, 0 or more "
                    f"({len(bad)} negative)"
                )
        if len(self.llm_tokens) and not (np.asarray(self.llm_tokens) > 0).all():
            first = int(np.flatnonzero(np.asarray(self.llm_tokens) <= 0)[0])
            raise DataError(f"llm_tokens[{first}] is 0: every sample has at least one LLM token")

    def __len__(self) -> int:
        return len(self.llm_tokens)

    @staticmethod
    def of(
        dataset: Any,
        family: Family,
        *,
        log: TextIO | None = sys.stderr,
        name: Callable[[int], str] | None = None,
        every_s: float = 5.0,
    ) -> SampleSizes:
        """The sizes of every sample of ``dataset``: from its ``sizes(i)`` where it has them (a
        synthetic dataset or a manifest: no sample is built), else from each sample (checked as
        packing checks it, a :class:`DataError` naming it by ``name``), with a progress line to
        ``log`` every ``every_s`` seconds."""
        count = len(dataset)
        tokens, rows = np.zeros(count, dtype=np.int64), np.zeros(count, dtype=np.int64)
        sized = hasattr(dataset, "sizes") and hasattr(family, "sized")
        said = began = time.monotonic()
        for i in range(count):
            if sized:
                tokens[i], rows[i] = family.sized(dataset.sizes(i))
            else:
                sample = dataset[i]
                where = name(i) if name is not None else i
                tokens[i], rows[i] = sample_length(sample, family, where), family.vision_rows(sample)
            if log is not None and time.monotonic() - said >= every_s:
                said = time.monotonic()
                print(
                    f"reading sample sizes: {i + 1}/{count} ({said - began:.0f} s)",
                    file=log,
                    flush=True,
                )
        return SampleSizes(tokens, rows)


@dataclass(frozen=True, slots=True)
class IsfTargets:
    vision: int
    """``Q_v``: a group's vision rows at most."""
    text: int
    """``Q_t``: a group's LLM tokens at most."""
    vision_floor: int
    """``Q'_v``: a group is kept when its vision rows reach this ..."""
    text_floor: int
    """``Q'_t``: ... or its LLM tokens reach this."""

    @staticmethod
    def from_statistics(sizes: SampleSizes) -> IsfTargets:
        """OmniBal's rule (section 5.1): see the module docstring."""
        if not len(sizes):
            raise DataError("the dataset is empty; give one with at least one sample")
        text = int(sizes.llm_tokens.max())
        vision = max(1, round(text * int(sizes.vision_rows.sum()) / max(1, int(sizes.llm_tokens.sum()))))
        return IsfTargets(vision, text, vision, text - math.ceil(text * TEXT_SLACK))

    def __post_init__(self):
        for name in ("vision", "text"):
            positive_int(name, getattr(self, name), f"the {name} target of an ISF mini-batch")
        for floor, target in (("vision_floor", "vision"), ("text_floor", "text")):
            low, high = getattr(self, floor), getattr(self, target)
            if not 0 <= low <= high:
                raise DataError(
                    f"ISF targets: {floor}={low} must lie in 0..{target}={high} (a group is kept once it "
                    f"reaches its floor, and never holds more than its target)"
                )

    def __str__(self) -> str:
        return (
            f"Q_v {self.vision} vision rows (kept from {self.vision_floor}), Q_t {self.text} LLM tokens "
            f"(kept from {self.text_floor})"
        )


def _sampled_groups(order: np.ndarray, sizes: SampleSizes, targets: IsfTargets) -> list[list[int]]:
    """ISF's sampling stage over ``order``."""
    tokens, rows = sizes.llm_tokens, sizes.vision_rows
    groups, group, used_tokens, used_rows = [], [], 0, 0
    for i in order.tolist():
        t, v = int(tokens[i]), int(rows[i])
        if group and (used_tokens + t > targets.text or used_rows + v > targets.vision):
            groups.append(group)
            group, used_tokens, used_rows = [], 0, 0
        group.append(i)
        used_tokens += t
        used_rows += v
    if group:
        groups.append(group)
    return groups


@dataclass(frozen=True)
class BalancedEpoch:
    batches: tuple[tuple[int, ...], ...]
    """Mini-batches in the order they train: the balanced ones, then the unbalanced ones."""
    balanced: int
    """Mini-batches ISF kept; the rest (``len(batches) - balanced``) are the epoch's leftovers."""
    rounds: int

    @property
    def unbalanced(self) -> int:
        return len(self.batches) - self.balanced

    @property
    def balanced_share(self) -> float:
        """Share of the epoch's samples that trained in balanced mini-batches."""
        total = sum(len(b) for b in self.batches)
        return sum(len(b) for b in self.batches[: self.balanced]) / total


def isf_epoch(
    sizes: SampleSizes,
    targets: IsfTargets,
    *,
    seed: int,
    first: Sequence[int] = (),
    rounds: int = ROUNDS,
) -> BalancedEpoch:
    """One epoch of ISF over every sample: rounds of sampling and filtering, then the samples no
    round placed, grouped by the sampling stage alone. ``first`` (the last epoch's leftovers)
    lead the first round's order."""
    positive_int("rounds", rounds, "the sampling-and-filtering rounds of an epoch")
    rng = np.random.default_rng(seed)
    ahead = np.asarray(list(first), dtype=np.int64)
    pool = np.setdiff1d(np.arange(len(sizes)), ahead)
    kept: list[list[int]] = []
    done = 0
    while done < rounds:
        done += 1
        order = np.concatenate([rng.permutation(ahead), rng.permutation(pool)])
        ahead = np.zeros(0, dtype=np.int64)
        placed, back = [], []
        for group in _sampled_groups(order, sizes, targets):
            rows = int(sizes.vision_rows[group].sum())
            tokens = int(sizes.llm_tokens[group].sum())
            (placed if rows >= targets.vision_floor or tokens >= targets.text_floor else back).append(group)
        kept += placed
        pool = np.asarray([i for g in back for i in g], dtype=np.int64)
        if not placed or not len(pool):
            break
    rest = _sampled_groups(rng.permutation(pool), sizes, targets) if len(pool) else []
    order = rng.permutation(len(kept))
    batches = tuple(tuple(kept[k]) for k in order) + tuple(tuple(g) for g in rest)
    return BalancedEpoch(batches, len(kept), done)


class IsfWarning(UserWarning):
    """ISF cannot balance this dataset as asked; the message names the rule it falls back on."""


def _unmet(sizes: SampleSizes, targets: IsfTargets, *, default: bool = False) -> list[str]:
    """Why no or not every group can meet ``targets`` on ``sizes`` (``default``: the targets
    :meth:`IsfTargets.from_statistics` made), each with the fallback."""
    notes = []
    over = int(((sizes.llm_tokens > targets.text) | (sizes.vision_rows > targets.vision)).sum())
    if over:
        largest = f"Q_t {int(sizes.llm_tokens.max())}, Q_v {int(sizes.vision_rows.max())}"
        fix = (
            f"the default Q_v follows the dataset's vision rows per LLM token, below its largest samples' rows: "
            f"give IsfTargets with the largest sample's sizes ({largest}) to balance them too"
            if default
            else f"raise the targets to the largest sample's sizes ({largest}) to balance them too"
        )
        notes.append(
            f"{over} of {len(sizes)} samples alone exceed the targets ({targets}): each trains in a "
            f"mini-batch of its own, over the targets; {fix}"
        )
    tokens, rows = int(sizes.llm_tokens.sum()), int(sizes.vision_rows.sum())
    if tokens < targets.text_floor and rows < targets.vision_floor:
        notes.append(
            f"the dataset holds {tokens} LLM tokens and {rows} vision rows in all, less than one balanced "
            f"mini-batch needs ({targets}): every epoch is the sampling stage alone, unbalanced; give "
            "more samples or lower targets"
        )
    return notes


class IsfBatchSampler(torch.utils.data.Sampler[list[int]]):
    """OmniBal's ISF as a batch sampler: each mini-batch a group of samples whose vision rows and
    LLM tokens are near the targets (see the module docstring). ``set_epoch(e)`` picks the epoch;
    an epoch's leftovers (the samples ISF could not place in a balanced group) train at its end,
    unbalanced, and lead the next epoch's first round."""

    def __init__(
        self,
        sizes: SampleSizes,
        *,
        targets: IsfTargets | None = None,
        seed: int = 0,
        rounds: int = ROUNDS,
    ):
        self.sizes = sizes
        self.targets = targets or IsfTargets.from_statistics(sizes)
        self.notes = _unmet(sizes, self.targets, default=targets is None)
        """What the targets cannot do with this dataset, and the rule ISF falls back on (also warned)."""
        for note in self.notes:
            warnings.warn(note, IsfWarning, stacklevel=2)
        self.seed = seed
        self.rounds = rounds
        self.epoch = 0
        self._epochs: dict[int, BalancedEpoch] = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def plan(self, epoch: int) -> BalancedEpoch:
        """Epoch ``epoch``'s mini-batches (every earlier epoch is planned first: its leftovers lead)."""
        known = max((e for e in self._epochs if e <= epoch), default=-1)
        for e in range(known + 1, epoch + 1):
            before = self._epochs.get(e - 1)
            first = () if before is None else [i for b in before.batches[before.balanced :] for i in b]
            self._epochs[e] = isf_epoch(
                self.sizes, self.targets, seed=self.seed * 1_000_003 + e, first=first, rounds=self.rounds
            )
            # Two epochs kept (the one asked for and the one before): an epoch of 1M samples
            # holds 1M indices, and a run of many epochs would keep them all.
            for old in [k for k in self._epochs if k < e - 1]:
                del self._epochs[old]
        return self._epochs[epoch]

    def __iter__(self) -> Iterator[list[int]]:
        return (list(b) for b in self.plan(self.epoch).batches)

    def __len__(self) -> int:
        return len(self.plan(self.epoch).batches)


@dataclass(frozen=True, slots=True)
class BalanceMeasures:
    pad_ratio_llm: float
    pad_ratio_vision: float
    dist_ratio_llm: float
    dist_ratio_vision: float
    samples_per_batch: float
    dist_ratio_llm_packed: float
    """The LLM's Dist Ratio when a mini-batch is packed (its load its tokens summed, no padding)."""

    def as_dict(self) -> dict[str, float]:
        return {
            "pad_ratio": self.pad_ratio_llm,
            "pad_ratio_vision": self.pad_ratio_vision,
            "dist_ratio_llm": self.dist_ratio_llm,
            "dist_ratio_vision": self.dist_ratio_vision,
            "samples_per_batch": self.samples_per_batch,
            "dist_ratio_llm_packed": self.dist_ratio_llm_packed,
        }


def _pad_ratio(values: np.ndarray) -> float:
    top = int(values.max())
    return 0.0 if top == 0 else float((top - values).sum() / (top * len(values)))


def _dist_ratio(loads: np.ndarray) -> float:
    top = float(loads.max())
    return 0.0 if top == 0 else float((top - loads).sum() / (top * len(loads)))


def measure(batches: Sequence[Sequence[int]], sizes: SampleSizes, *, dp: int) -> BalanceMeasures:
    """Pad Ratio and Dist Ratio of ``batches`` taken ``dp`` at a time (one per device), for the
    LLM and the vision encoder, and the mean samples a mini-batch (a last partial step is left out
    of the Dist Ratio)."""
    positive_int("dp", dp, "the data-parallel devices the Dist Ratio is taken over")
    if not batches:
        raise DataError("no mini-batches to measure")
    groups = [np.asarray(b, dtype=np.int64) for b in batches]
    tokens = [sizes.llm_tokens[g] for g in groups]
    rows = [sizes.vision_rows[g] for g in groups]
    padded_llm = np.asarray([len(t) * int(t.max()) for t in tokens], dtype=np.float64)
    vision = np.asarray([int(r.sum()) for r in rows], dtype=np.float64)
    packed_llm = np.asarray([int(t.sum()) for t in tokens], dtype=np.float64)
    steps = range(0, len(groups) - dp + 1, dp)

    def dist(loads: np.ndarray) -> float:
        return float(np.mean([_dist_ratio(loads[k : k + dp]) for k in steps])) if len(steps) else 0.0

    return BalanceMeasures(
        float(np.mean([_pad_ratio(t) for t in tokens])),
        float(np.mean([_pad_ratio(r) for r in rows])),
        dist(padded_llm),
        dist(vision),
        float(np.mean([len(g) for g in groups])),
        dist(packed_llm),
    )
