"""One exact training step of a two-tower model whose contrastive loss couples the global batch.

Three phases (docs/contrastive.md; DistMM's batch-sync instruction, GradCache):

1. **Towers.** Each rank runs its samples' microbatches through the towers it holds (both, or
   one when each tower has ranks of its own: DistMM's placement) and keeps their embeddings
   (``keep``: with their autograd graphs; ``recompute``: without, under ``no_grad``, the RNG
   state noted to replay them).
2. **Loss.** Every rank gathers both embeddings of the whole global batch, computes the loss
   term of its own rows of the embeddings it holds (:func:`vlmcompile.ir.contrastive_loss.rows_loss`,
   in tiles of ``tile_rows`` rows so no rank holds an ``N x N`` matrix), and the gradients of the gathered
   embeddings go back to the ranks that own those rows by reduce-scatter. The loss of the batch
   is the sum of the ranks' terms. Never a loss per microbatch.
3. **Backward.** Each microbatch's embeddings are seeded with their rows of the gradient (the
   ``recompute`` policy runs their forward again first), then the gradients are summed over the
   ranks: each rank's are its share of the gradient of one loss, so a sum, not a mean (a
   tower's over its own ranks, the loss scalars' over every rank).

The result equals eager training on the whole global batch, for any split of the samples over
ranks and microbatches, when the towers draw no random numbers (dropout draws others for a
microbatch than for the whole batch; ``recompute`` replays each microbatch's own).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from vlmcompile.ir.contrastive_loss import rows_loss
from vlmcompile.ir.contrastive_plan import ContrastivePlan, MemoryPolicy
from vlmcompile.ir.errors import ArgumentError
from vlmcompile.ir.microbatch import num_samples, rows_per_sample, take
from vlmcompile.runtime.collectives import Deadline, sum_gradients
from vlmcompile.runtime.executor import BatchError


@dataclass(frozen=True, slots=True)
class Tower:
    """One tower as a module: batch inputs (``batch_inputs``, in argument order) -> (embedding,)."""

    module: fx.GraphModule
    batch_inputs: tuple[str, ...]


class ContrastiveStep:
    """A rank's share of the step (module docstring). Built by the contrastive codegen; every rank
    gets the same object and calls :meth:`step` with the same global batch."""

    def __init__(
        self,
        towers: Mapping[int, tuple[Tower, Tower]],
        scalars: fx.GraphModule | None,
        plan: ContrastivePlan,
        *,
        timeout_s: float = 60.0,
        prefix: str = "",
        sample_layout: Mapping[str, Any] | None = None,
    ):
        self.placements = (plan.placement(0), plan.placement(1))
        missing = sorted(frozenset().union(*(p.split.sizes for p in self.placements)) - set(towers))
        if missing:
            raise ArgumentError(f"no tower modules for microbatches of {missing} samples")
        self.towers = dict(towers)
        self.scalars = scalars
        self.plan = plan
        self.loss = plan.loss
        self.split = plan.split
        self._groups: list[Any] | None = None
        self.recompute = tuple(plan.memory_of(t) is MemoryPolicy.RECOMPUTE for t in (0, 1))
        self.tile_rows = plan.tile_rows
        self.timeout_s = timeout_s
        self.prefix = prefix
        self._buffers: dict[int, torch.Tensor] = {}
        self.sample_layout = dict(sample_layout or {})
        """Batch key -> (a sample's shape, dtype) for tensors, the value itself for Python values:
        what the towers were captured for."""
        self.last_phases_s: dict[str, float] = {}
        """This rank's measured seconds of each phase of the last step."""

    # -- the step ------------------------------------------------------------------------------

    def step(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """One step on this rank: returns the loss of the whole global batch. The step's gradient
        (the ranks' shares summed) is added to ``.grad``, as eager ``loss.backward()`` adds to it;
        what ``.grad`` held before is set aside meanwhile, so it is not summed over the ranks again."""
        self.check_batch(batch)
        rank, world = _rank_and_world(self.plan.num_ranks)
        deadline = Deadline(rank, self.timeout_s)
        groups = self._tower_groups()
        params = self.parameters()
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        clock = [time.perf_counter()]
        held = [t for t in (0, 1) if rank in self.placements[t].ranks]
        microbatches = {t: self._microbatches(batch, rank, t) for t in held}
        embeddings, rng = {}, {}
        for t in held:
            embeddings[t], rng[t] = self._tower_forwards(microbatches[t], t)
        local = [torch.cat(embeddings[t]).detach() if t in held else None for t in (0, 1)]
        clock.append(time.perf_counter())
        loss, local_grads = self._loss_phase(local, rank, world, deadline)
        clock.append(time.perf_counter())
        for t in held:
            self._tower_backwards(microbatches[t], t, embeddings[t], rng[t], local_grads[t])
        clock.append(time.perf_counter())
        self._sum_gradients(rank, groups, deadline)
        for p, before in zip(params, earlier):
            if before is not None:
                p.grad = before if p.grad is None else before + p.grad
        clock.append(time.perf_counter())
        self.last_phases_s = dict(
            zip(
                ("towers_fwd", "loss_phase", "towers_bwd", "grad_reduce"),
                (b - a for a, b in zip(clock, clock[1:])),
            )
        )
        return loss

    def _tower_groups(self) -> list[Any]:
        """Each tower's process group (None: every rank); made on the first step, by every rank
        in the same order, as torch.distributed requires."""
        if self._groups is None:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            self._groups = [
                dist.new_group(list(p.ranks), timeout=timeout) if self.plan.separate is not None else None
                for p in self.placements
            ]
        return self._groups

    def _sum_gradients(self, rank: int, groups: list[Any], deadline: Deadline) -> None:
        """Sum each tower's gradients over its ranks, the loss scalars' over every rank (every rank
        holds them and adds its rows' share)."""
        if self.plan.separate is None:
            what = f"the gradient all-reduce over {self.plan.num_ranks} ranks"
            sum_gradients(self.parameters(), None, deadline, what, self._buffers)
            return
        # A parameter both towers read (or the loss scalars) gets shares on ranks of both towers.
        both = {id(p) for p in self._tower_parameters(0)} & {id(p) for p in self._tower_parameters(1)}
        everywhere = self._scalar_parameters() + [p for p in self._tower_parameters(0) if id(p) in both]
        shared = {id(p) for p in everywhere}
        for t, placement in enumerate(self.placements):
            if rank in placement.ranks:
                own = [p for p in self._tower_parameters(t) if id(p) not in shared]
                what = f"tower {t}'s gradient all-reduce over ranks {list(placement.ranks)}"
                sum_gradients(own, groups[t], deadline, what, self._buffers)
        what = "the gradient all-reduce of the loss scalars and the towers' shared parameters over every rank"
        sum_gradients(list({id(p): p for p in everywhere}.values()), None, deadline, what, self._buffers)

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Refuse a batch the towers were not captured for, naming the key and what was expected.

        Raises:
            BatchError: a key missing or extra, another sample shape or dtype, another Python
                value, or another number of samples than the plan's.
        """
        if num_samples(batch) != self.split.num_samples:
            raise BatchError(
                f"the batch holds {num_samples(batch)} samples; the step was planned for {self.split.num_samples}"
            )
        extra = sorted(set(batch) - set(self.sample_layout))
        if self.sample_layout and extra:
            raise BatchError(f"the batch has keys {extra} the compiled sample batch did not have")
        for key, expected in self.sample_layout.items():
            got = batch.get(key, "missing")
            if isinstance(expected, tuple) and len(expected) == 2 and isinstance(expected[1], torch.dtype):
                if not isinstance(got, torch.Tensor) or (tuple(got.shape[1:]), got.dtype) != expected:
                    shown = f"{list(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else repr(got)
                    raise BatchError(
                        f"batch[{key!r}] is {shown}; the towers expect {list(expected[0])} {expected[1]} a sample "
                        "(as in the compiled sample batch)"
                    )
            elif got is not expected and got != expected:
                raise BatchError(
                    f"batch[{key!r}] is {got!r}; the towers were compiled with {expected!r}: pass the same value"
                )

    def _microbatches(self, batch: Mapping[str, Any], rank: int, tower: int) -> list[dict[str, Any]]:
        placement = self.placements[tower]
        index = placement.ranks.index(rank)
        rows = rows_per_sample(batch)
        start, out = placement.split.first_sample[index], []
        for size in placement.split.microbatches[index]:
            out.append(take(batch, start, size, rows))
            start += size
        return out

    def _run_tower(self, microbatch: Mapping[str, Any], tower: int) -> torch.Tensor:
        module = self.towers[num_samples(microbatch)][tower]
        out = module.module(*[microbatch[k] for k in module.batch_inputs])
        return out[0] if isinstance(out, (tuple, list)) else out

    def _tower_forwards(self, microbatches, tower: int):
        embeddings, rng = [], []
        for mb in microbatches:
            if self.recompute[tower]:
                rng.append(_rng_state())
                with torch.no_grad():
                    embeddings.append(self._run_tower(mb, tower))
            else:
                embeddings.append(self._run_tower(mb, tower))
        return embeddings, rng

    def _tower_backwards(self, microbatches, tower: int, embeddings, rng, local_grad) -> None:
        offset = 0
        after = _rng_state()
        for k, mb in enumerate(microbatches):
            size = num_samples(mb)
            grad = local_grad[offset : offset + size]
            offset += size
            if self.recompute[tower]:
                _set_rng_state(rng[k])  # the same dropout masks as the forward that was dropped
                out = self._run_tower(mb, tower)
            else:
                out = embeddings[k]
            if out.requires_grad:  # a frozen tower needs no backward (nothing below it trains)
                torch.autograd.backward([out], [grad])
        _set_rng_state(after)

    # -- the loss phase ------------------------------------------------------------------------

    def _loss_phase(
        self, local: list[torch.Tensor | None], rank: int, world: int, deadline: Deadline
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The loss of the global batch, and this rank's rows of the gradients of the embeddings
        it holds (None for a tower it does not hold)."""
        like = next(x for x in local if x is not None)
        gathered = [self._gather(x, t, like, world, deadline) for t, x in enumerate(local)]
        scale, bias, scalar_outs = self._scalars()
        columns = [g.requires_grad_() for g in gathered]
        row_grads = [torch.zeros_like(x) if x is not None else None for x in local]
        total = torch.zeros((), dtype=torch.float64, device=like.device)
        for r, c in self.loss.directions():
            if local[r] is None:
                continue  # the other tower's ranks compute these rows
            first, count = self.placements[r].rows_of(rank)
            for i in range(0, count, self.tile_rows):
                rows = local[r][i : i + self.tile_rows].detach().requires_grad_()
                term = rows_loss(
                    self.loss.kind, rows, columns[c], first + i, self.split.num_samples, scale, bias
                )
                term.backward()
                row_grads[r][i : i + rows.shape[0]] += rows.grad
                total += term.detach().double()
        # Every rank scatters the same columns (those some direction reads), whatever its rows.
        for t in sorted({c for _, c in self.loss.directions()}):
            grad = columns[t].grad if columns[t].grad is not None else torch.zeros_like(columns[t])
            mine = self._scatter(grad, t, rank, world, deadline)
            if row_grads[t] is not None:
                row_grads[t] += mine
        pairs = [(out, leaf) for out, leaf in zip(scalar_outs, (x for x in (scale, bias) if x is not None))]
        pairs = [(out, leaf.grad) for out, leaf in pairs if out.requires_grad and leaf.grad is not None]
        if pairs:  # a frozen scale or bias takes no gradient
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        deadline.wait(dist.all_reduce(total, async_op=True), "the loss all-reduce")
        return total.to(like.dtype), row_grads

    def _scalars(self):
        """The loss's trainable scalars (scale, bias) as leaves of the loss phase, and the outputs of
        the module that made them (their gradients go back through it once)."""
        if self.scalars is None:
            return None, None, []
        outs = list(self.scalars())
        leaves = iter(o.detach().requires_grad_() for o in outs)
        names = [n for n in (self.loss.scale, self.loss.bias) if n is not None]
        values = dict(zip(names, leaves))
        return values.get(self.loss.scale), values.get(self.loss.bias), outs

    def _counts(self, tower: int, world: int) -> list[tuple[int, int]]:
        return [self.placements[tower].rows_of(r) for r in range(world)]

    def _gather(
        self, local: torch.Tensor | None, tower: int, like: torch.Tensor, world: int, deadline: Deadline
    ) -> torch.Tensor:
        """The tower's embedding of the whole batch: every rank's rows (none from a rank that does
        not hold the tower), padded to the largest count for the collective."""
        counts = self._counts(tower, world)
        width = max(n for _, n in counts)
        padded = like.new_zeros((width, self.loss.width))
        if local is not None:
            padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(world)]
        what = f"the all-gather of embedding {tower}"
        deadline.wait(dist.all_gather(parts, padded, async_op=True), what)
        full = like.new_empty((self.split.num_samples, self.loss.width))
        for (first, n), part in zip(counts, parts):
            full[first : first + n] = part[:n]
        return full.detach()

    def _scatter(
        self, full: torch.Tensor, tower: int, rank: int, world: int, deadline: Deadline
    ) -> torch.Tensor:
        """The sum over ranks of ``full``'s rows that ``rank`` owns in ``tower`` (none if it does not
        hold the tower)."""
        counts = self._counts(tower, world)
        width = max(n for _, n in counts)
        blocks = []
        for first, n in counts:
            block = full.new_zeros((width, *full.shape[1:]))
            block[:n] = full[first : first + n]
            blocks.append(block)
        out = torch.empty_like(blocks[0])
        what = f"the reduce-scatter of embedding {tower}'s gradient"
        deadline.wait(dist.reduce_scatter(out, blocks, async_op=True), what)
        return out[: counts[rank][1]]

    # -- names ---------------------------------------------------------------------------------

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """The original model's parameter name -> the parameter here (each parameter once): the
        towers this rank holds and the loss's scalars, as
        :meth:`~vlmcompile.runtime.executor.PipelineRunner.named_parameters`."""
        rank = dist.get_rank() if dist.is_initialized() else None
        held = [t for t in (0, 1) if rank is None or rank in self.placements[t].ranks]
        modules = [pair[t].module for pair in self.towers.values() for t in held]
        if self.scalars is not None:
            modules.append(self.scalars)
        return _by_original_name(modules, self.prefix)

    def _tower_parameters(self, tower: int) -> list[nn.Parameter]:
        return list(
            _by_original_name([pair[tower].module for pair in self.towers.values()], self.prefix).values()
        )

    def _scalar_parameters(self) -> list[nn.Parameter]:
        return [] if self.scalars is None else list(_by_original_name([self.scalars], self.prefix).values())

    def parameters(self) -> list[nn.Parameter]:
        return list(self.named_parameters().values())

    def _wait(self, work, what: str) -> None:
        """Wait on ``work`` within the step's timeout (the training loops' barrier)."""
        Deadline(dist.get_rank(), self.timeout_s).wait(work, what)


def _by_original_name(modules: Sequence[nn.Module], prefix: str) -> dict[str, nn.Parameter]:
    out: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for module in modules:
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.setdefault(name.removeprefix(prefix), p)
    return out


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _rank_and_world(planned: int) -> tuple[int, int]:
    if not dist.is_initialized():
        raise ArgumentError(
            "the contrastive step runs under torch.distributed: launch it (pipe.launch, torchrun)"
        )
    world = dist.get_world_size()
    if world != planned:
        raise ArgumentError(f"the step was planned for {planned} ranks; this job has {world}")
    return dist.get_rank(), world


def share_parameters(modules: Sequence[nn.Module], prefix: str = "") -> None:
    """Make every module hold the same parameter object under the same name (tower modules captured
    at several microbatch sizes each hold their own), so gradients meet in one ``.grad``."""
    first: dict[str, nn.Parameter] = {}
    for module in modules:
        for name, p in list(module.named_parameters(remove_duplicate=False)):
            keep = first.setdefault(name.removeprefix(prefix), p)
            if keep is not p:
                owner_path, _, attr = name.rpartition(".")
                owner = module.get_submodule(owner_path) if owner_path else module
                setattr(owner, attr, keep)
