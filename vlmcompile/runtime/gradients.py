"""A step's gradients on a rank: made apart from those the caller holds (only this step's are
reduced), added to them afterwards as eager's ``backward`` accumulates, and dropped where eager
training would have none."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.runtime.collectives import Deadline, flat_gradients, write_sums


@contextlib.contextmanager
def added_to_held(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Within: ``params`` start without gradients, so a reduction sums this step's alone (the
    gradients held before, by a caller accumulating over steps, were summed when they were
    made); after: those held before are added back."""
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    yield
    for p, old in zip(params, held):
        if old is not None:
            p.grad = old if p.grad is None else p.grad + old


def drop_unused_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """``grad = None`` for the parameters whose gradient is zero everywhere, after a packed step
    without a single image: eager training on that step never runs the vision encoder, so its
    parameters get no gradient and AdamW skips them (no momentum step, no weight decay); here each
    microbatch ran the encoder on a stand-in image whose features reach no token, which gives
    exact zeros. Every rank holds the reduced gradients, so every rank drops the same ones."""
    for p in params:
        if p.grad is not None and not bool(p.grad.any()):
            p.grad = None


class OverlappedReduction:
    """A rank's data-parallel gradient reduction overlapped with its backwards: a bucket per layer
    (the parameters it holds that train and are reduced here alone), started as an asynchronous
    all-reduce once the layer's last backward on this rank this step has passed it, as Megatron-LM's
    ``--overlap-grad-reduce`` and DDP's buckets do; :mod:`vlmcompile.sim.dp` times the same rule.

    A parameter's gradient is final when its last backward action on the rank (B, or W where the
    backward is split) accumulates it: a hook after each accumulation marks it there. A W action
    adds its gradients itself (torch's split runs no accumulation hook): its layers are marked as
    it ends, as is any parameter the action left without a gradient. Every member of the group
    starts the same buckets in the same order (a bucket waits for those before it), so their
    collectives pair up. A parameter no member has a gradient for keeps ``grad = None``, as in
    eager (:func:`~vlmcompile.runtime.collectives.sum_gradients`'s rule)."""

    def __init__(self, stages: Mapping[int, torch.nn.Module], group: Any, skip: set[int]):
        self.stages, self.group, self.skip = stages, group, skip
        self.buckets: list[list[torch.nn.Parameter]] = []
        self.bucket_of: dict[int, int] = {}
        self.final_of: dict[int, Action] = {}
        """id(parameter) -> its last backward on this rank this step (B, or W)."""
        self.running: Action | None = None
        """The compute action running now (:meth:`action`)."""
        self.works: list[tuple[Any, torch.Tensor]] | None = None
        """The buckets started this step, in order; None outside a step."""
        self._ready: list[set[int]] = []
        self._buffers: dict[tuple[int, ...], torch.Tensor] = {}
        self.exposed_s = 0.0
        """The last step's wait for its buckets after its last action."""
        watched = {
            id(p): p for s in stages.values() for p in s.parameters() if p.requires_grad and id(p) not in skip
        }
        # The hooks hold the reduction weakly: a runner that is gone takes its buckets with it.
        hook = _weak_hook(weakref.ref(self))
        handles = [p.register_post_accumulate_grad_hook(hook) for p in watched.values() if group is not None]
        weakref.finalize(self, lambda: [h.remove() for h in handles])

    def use_actions(self, actions: Sequence[Action], shared: Sequence[Action]) -> None:
        """Buckets for this rank's action list ``actions``. Their order is ``shared``'s (the plan's
        list of this pipeline rank, the same on every member of the group even where each replica
        runs a schedule of its own): the order their last backwards come in, each stage's layers
        last first. Each parameter is complete after its last backward in ``actions``."""
        if self.group is None:
            return
        finals = [_last_backwards(acts) for acts in (actions, shared)]
        order = sorted(finals[1], key=lambda s: finals[1][s][0])
        owner = {}  # a parameter several stages here hold goes with the last of them
        for s in order:
            owner.update({id(p): s for p in self.stages[s].parameters() if p.requires_grad})
        buckets, seen = [], set(self.skip)
        for s in order:
            for layer in reversed(list(self.stages[s].layers)):  # a backward passes the last layer first
                params = [p for p in layer.parameters() if owner.get(id(p)) == s and id(p) not in seen]
                seen.update(id(p) for p in params)
                if params:
                    buckets.append(params)
        self.buckets = buckets
        self.bucket_of = {id(p): k for k, params in enumerate(buckets) for p in params}
        self.final_of = {}
        for s in sorted(finals[0], key=lambda s: finals[0][s][0]):
            self.final_of.update(
                {id(p): finals[0][s][1] for p in self.stages[s].parameters() if id(p) in self.bucket_of}
            )

    def buffers(self) -> list[torch.Tensor]:
        """The flat buffers the buckets are reduced in (kept between steps)."""
        return list(self._buffers.values())

    def start_step(self) -> None:
        self._ready = [set() for _ in self.buckets]
        self.works = []

    def accumulated(self, p: torch.nn.Parameter) -> None:
        """After an accumulation into ``p.grad``: complete if this is its last backward."""
        k = self.bucket_of.get(id(p))
        if self.works is None or k is None or k < len(self.works) or self.running != self.final_of.get(id(p)):
            return  # not in a step, or not the parameter's last backward
        self._ready[k].add(id(p))
        self._launch_ready()

    @contextlib.contextmanager
    def action(self, action: Action) -> Iterator[None]:
        """Around each compute action: within, its accumulations are watched; after, the
        parameters whose last backward it was are complete."""
        self.running = action
        try:
            yield
        finally:
            self.running = None
        for pid, last in self.final_of.items():
            if last == action:
                self._ready[self.bucket_of[pid]].add(pid)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self.works is not None and len(self.works) < len(self.buckets):
            k = len(self.works)
            params = self.buckets[k]
            if len(self._ready[k]) < len(params):
                return
            flat = flat_gradients(params, self._buffers, tuple(id(p) for p in params))
            self.works.append((dist.all_reduce(flat, group=self.group, async_op=True), flat))

    def finish(self, deadline: Deadline, what: str) -> None:
        """Wait for every bucket and write the sums into the gradients (:attr:`exposed_s`: how
        long that took, the reduction the backwards did not hide)."""
        began = time.perf_counter()
        self._launch_ready()
        if len(self.works) < len(self.buckets):  # every parameter's last backward ran
            raise AssertionError(f"gradient buckets {len(self.works)} to {len(self.buckets)} never completed")
        for (work, flat), params in zip(self.works, self.buckets):
            deadline.wait(work, what)
            write_sums(params, flat)
        self.works = None
        self.exposed_s = time.perf_counter() - began


def _last_backwards(actions: Sequence[Action]) -> dict[int, tuple[int, Action]]:
    """Stage -> (the position, the action) of its last backward (B or W) in ``actions``."""
    return {a.stage: (k, a) for k, a in enumerate(actions) if a.kind in (ActionKind.B, ActionKind.W)}


def _weak_hook(ref: weakref.ref):
    def hook(p: torch.nn.Parameter) -> None:
        reduction = ref()
        if reduction is not None:
            reduction.accumulated(p)

    return hook
