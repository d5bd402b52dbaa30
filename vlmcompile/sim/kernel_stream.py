"""How kernel-level encoder work spreads over the LLM actions it runs inside (Optimus sec. 4.2,
``AssignKernels``, and design decision 3).

An LLM action with tensor parallelism leaves two streams idle part of the time: the compute
stream while its TP collectives run (its *gap*), and the communication stream while it
computes. A kernel-level encoder action runs its compute kernels in the gaps and its own TP
collectives during the LLM's compute, spread over one or more consecutive LLM actions of its
rank (its hosts, ``Plan.kernel_level``). The spread is fluid: kernels are small against a layer
(a ViT-22B layer is ~1.1 ms of compute, a GPT-175B layer's TP gap ~1.2 ms in four pieces), so a
host takes any fraction of a rider's work. The kernels of one rank run first in, first out:
the rider listed first gets a host's capacity first. Whatever of a rider is left at its last
host runs there beyond the gap and lengthens the host (its compute after the host's, its
collectives after the host's compute).

This is the one rule for it: the simulator times plans with it and the list scheduler
(:func:`vlmcompile.planning.bubble_schedule.greedy`) places riders with it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from vlmcompile.ir.actions import Action

EPS = 1e-9
"""A share left below this is done (floating-point residue of the fill)."""


@dataclass(slots=True)
class HostFill:
    """One host's capacity and what the riders took of it."""

    gap: float
    """The host's TP collectives: compute-stream time the riders' compute may fill."""
    compute: float
    """The host's compute: communication-stream time the riders' collectives may fill."""
    rider_compute: float = 0.0
    rider_comm: float = 0.0
    shares: dict[Action, float] = field(default_factory=dict)
    """Rider -> the share of its work run in this host."""

    @property
    def gap_left(self) -> float:
        return max(0.0, self.gap - self.rider_compute)

    @property
    def compute_left(self) -> float:
        return max(0.0, self.compute - self.rider_comm)

    @property
    def hidden_compute(self) -> float:
        """Rider compute run inside the gap (the rest lengthened the host)."""
        return min(self.rider_compute, self.gap)

    def duration(self, own: float) -> float:
        """The host's interval with its riders: the longer of the compute stream (its own time,
        collectives included, plus rider compute beyond the gap) and the communication stream
        (its collectives plus the riders')."""
        return max(own + max(0.0, self.rider_compute - self.gap), self.gap + self.rider_comm)

    def take(self, rider: Action, share: float, work: tuple[float, float]) -> None:
        self.shares[rider] = self.shares.get(rider, 0.0) + share
        self.rider_compute += share * work[0]
        self.rider_comm += share * work[1]


class KernelStream:
    """One rank's open kernel-level actions, first in first out, each with the share of its work
    still to run."""

    def __init__(self, work: Callable[[Action], tuple[float, float]]):
        self.work = work
        """Rider -> (compute, TP collectives) of its whole action."""
        self.remaining: dict[Action, float] = {}

    def open(self, rider: Action) -> None:
        self.remaining[rider] = 1.0

    def fill(self, host: HostFill, closing: Collection[Action] = ()) -> list[Action]:
        """Give the host's capacity to the open riders in order; a rider in ``closing`` (this is
        its last host) runs what is left of it here whatever the capacity. Returns the riders
        finished in this host."""
        finished = []
        for rider, left in list(self.remaining.items()):
            compute, comm = self.work(rider)
            share = min(
                left,
                host.gap_left / compute if compute > 0 else left,
                host.compute_left / comm if comm > 0 else left,
            )
            if rider in closing:
                share = left
            if share > 0:
                host.take(rider, share, (compute, comm))
            left -= share
            if left <= EPS:
                del self.remaining[rider]
                finished.append(rider)
            else:
                self.remaining[rider] = left
        return finished


def host_fills(
    hosts: dict[Action, tuple[Action, ...]],
    actions: list[tuple[Action, ...]] | tuple[tuple[Action, ...], ...],
    *,
    work: Callable[[Action], tuple[float, float]],
    capacity: Callable[[Action], tuple[float, float]],
) -> dict[Action, HostFill]:
    """Every host's fill for a plan's kernel-level actions (``Plan.hosts_of``): per rank, riders
    open at their first host and close at their last, in list order.

    Args:
        work: a rider's (compute, TP collectives).
        capacity: a host's (TP collectives, compute).
    """
    first: dict[Action, list[Action]] = {}
    last: dict[Action, set[Action]] = {}
    for rider, span in hosts.items():
        first.setdefault(span[0], []).append(rider)
        last.setdefault(span[-1], set()).add(rider)
    spanned = {host for span in hosts.values() for host in span}
    fills: dict[Action, HostFill] = {}
    for acts in actions:
        stream = KernelStream(work)
        step = {a: i for i, a in enumerate(acts)}
        for a in acts:
            if a not in spanned:
                continue
            opening = first.get(a, [])
            for rider in sorted(opening, key=step.__getitem__):
                stream.open(rider)
            gap, compute = capacity(a)
            fill = fills[a] = HostFill(gap, compute)
            stream.fill(fill, last.get(a, ()))
    return fills
