"""How the values of a plan's transfers move between two ranks: the ``SEND`` and ``RECV`` entries
of a lowered list (:mod:`vlmcompile.ir.program`) carried out, and each consumer's wait.

* :class:`TaggedTransport` (gloo): each message by its tag, each receive posted where its
  ``RECV`` stands (:data:`~vlmcompile.ir.program.RECEIVE_AHEAD` actions before its consumer), so
  gloo's own thread moves it while the rank computes.
* :class:`OrderedTransport` (NCCL ignores tags: the k-th send from a to b meets the k-th
  receive b posts from a, and a pair's sends and receives run on one stream in the order
  issued): every transfer between two ranks, either way, issued in one order both follow
  (:func:`~vlmcompile.ir.program.transfer_order`), on the pair's own process group, each as one
  batched isend/irecv group.

Either way a stage's first activations for a peer bring a shape header
(:mod:`vlmcompile.runtime.wire`); later ones take their shapes from it, or from the shape plan of a
packed pipeline. Every wait has the runner's deadline and names the peer it waits for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from vlmcompile.ir.actions import ActionKind
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.program import Transfer
from vlmcompile.runtime.collectives import Deadline, RankLostError
from vlmcompile.runtime.wire import (
    MAX_VALUES,
    ORDERED_HEADER,
    Meta,
    header,
    meta_of,
    parse_header,
    sendable,
    wire,
)

Work = tuple[Any, str, int]
"""A posted send or receive: (its work, what it moves, the peer's global rank)."""


@dataclass
class Exchange:
    """One step's transfers in flight on this rank."""

    sends: list[Work] = field(default_factory=list)
    """Posted sends, waited for at the end of the step."""
    posted: dict[Transfer, tuple[list[torch.Tensor], list[Work]]] = field(default_factory=dict)
    """Transfer -> the buffers and receives posted for it."""
    pending: set[Transfer] = field(default_factory=set)
    """Tagged: receives whose ``RECV`` came before their shapes were known."""
    outbox: dict[Transfer, tuple[torch.Tensor | None, list[torch.Tensor]]] = field(default_factory=dict)
    """Ordered: values produced, not yet issued (a transfer before them is not issued yet)."""
    headers: dict[Transfer, tuple[torch.Tensor, list[Work]]] = field(default_factory=dict)
    """Ordered: shape headers whose receive is issued, before their activations'."""
    cursor: dict[int, int] = field(default_factory=dict)
    """Ordered: per peer pipeline rank, how many of the pair's transfers were issued."""


@dataclass
class Buffers:
    """Where a receive's buffer shapes come from, set by the runner for a step."""

    planned: Callable[[int, int], list[tuple[int, ...]] | None]
    """(sending stage, microbatch) -> the shapes of its values from the shape plan, or None."""
    outputs: Callable[[int, int], list[torch.Tensor]]
    """(stage, microbatch) -> the floating outputs of this rank's forward (a gradient's shapes)."""


class Transport:
    """What both transports share: peers, deadlines, shape headers, receive buffers."""

    FIXED_HEADER = False
    """Whether a shape header has one fixed size (its receive is posted before the shapes are known)."""

    def __init__(
        self, pp_rank: int, global_rank: Callable[[int], int], rank: int, timeout_s: float, device, plan
    ):
        self.pp_rank = pp_rank
        self.peer = global_rank
        """Pipeline rank -> the global rank of this replica's rank there."""
        self.rank, self.timeout_s, self.device, self.plan = rank, timeout_s, device, plan
        self.meta: dict[tuple[int, int, int], Meta] = {}
        """Per (sending stage, sending pipeline rank, receiving pipeline rank): (shape, dtype, is a
        Python number) of each value sent (a replicated stage sends to, and receives from, several
        ranks, and may do both with one peer)."""
        self.buffers: Buffers | None = None

    def wait(self, work, what: str, peer: int | None = None) -> None:
        Deadline(self.rank, self.timeout_s).wait(work, what, peer)

    def lost(self, what: str, err: BaseException, peer: int | None) -> RankLostError:
        return Deadline(self.rank, self.timeout_s).lost(what, err, peer)

    def finish(self, ex: Exchange) -> None:
        """Wait for the step's sends."""
        for work, what, peer in ex.sends:
            self.wait(work, what, peer)

    def _outgoing(self, t: Transfer, values: tuple, names) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The tensors of ``t`` to send, and its shape header when it is the pair's first."""
        if t.kind is not ActionKind.F:  # input gradients
            return [x.detach().contiguous() for x in values], None
        out, scalar = sendable(t.stage, names, values, self.device)
        planned = self.buffers.planned(t.stage, t.microbatch)
        if planned is not None and planned != [tuple(x.shape) for x in out]:
            raise PlanError(
                f"stage {t.stage} made values of shapes {[list(x.shape) for x in out]} for microbatch "
                f"{t.microbatch}, where the shape plan says {[list(p) for p in planned]}: the capture does not "
                "hold for this microbatch; report this"
            )
        head = None
        if (t.stage, t.src, t.dst) not in self.meta:
            self.meta[(t.stage, t.src, t.dst)] = meta_of(out, scalar)
            head = header(t.stage, out, scalar, self.device, ordered=self.FIXED_HEADER)
        return [x.detach().contiguous() for x in out], head

    def _receive_buffers(self, t: Transfer) -> list[torch.Tensor] | None:
        """Buffers for ``t``, or None for activations whose shapes have not arrived."""
        if t.kind is not ActionKind.F:  # input gradients
            return [
                torch.empty(o.shape, dtype=o.dtype, device=o.device)
                for o in self.buffers.outputs(t.stage - 1, t.microbatch)
            ]
        meta = self.meta.get((t.stage, t.src, t.dst))
        if meta is None:
            return None
        planned = self.buffers.planned(t.stage, t.microbatch)
        shapes = planned if planned is not None else [shape for shape, _, _ in meta]
        return [
            torch.empty(shape, dtype=dtype, device=self.device) for shape, (_, dtype, _) in zip(shapes, meta)
        ]

    def _values(self, t: Transfer, buffers: list[torch.Tensor]) -> tuple:
        """The received values (activations' Python numbers as numbers again)."""
        if t.kind is not ActionKind.F:  # input gradients
            return tuple(buffers)
        meta = self.meta[(t.stage, t.src, t.dst)]
        return tuple(b.item() if flag else b for b, (_, _, flag) in zip(buffers, meta))


class TaggedTransport(Transport):
    """Messages met by tag (gloo)."""

    def _tag(self, t: Transfer, k: int, microbatch: int | None = None) -> int:
        mb = t.microbatch if microbatch is None else microbatch
        return ((t.stage * 2 + (t.kind is not ActionKind.F)) * self.plan.num_microbatches + mb) * 1024 + k

    def _ops(
        self, op, tensors, t: Transfer, pp_rank: int, what: str, first: int = 0, microbatch=None
    ) -> list[Work]:
        peer = self.peer(pp_rank)
        direction = "to" if op is dist.isend else "from"
        verb = "sending" if op is dist.isend else "receiving"
        works = []
        for k, x in enumerate(tensors):
            try:
                work = op(wire(x), peer, tag=self._tag(t, first + k, microbatch))
            except RuntimeError as err:
                raise self.lost(
                    f"the connection failed {verb} {what} {direction} rank {peer}", err, peer
                ) from None
            works.append((work, f"{what} {direction} rank {peer}", peer))
        return works

    def before(self, ex: Exchange) -> None:
        """Post the receives whose ``RECV`` came before their shapes, now that they are known."""
        for t in sorted(t for t in ex.pending if (t.stage, t.src, t.dst) in self.meta):
            ex.pending.discard(t)
            self.post(t, ex)

    def send(self, t: Transfer, values: tuple, names, ex: Exchange) -> None:
        payload, head = self._outgoing(t, values, names)
        if head is not None:
            size = torch.tensor([head.numel()], dtype=torch.int64, device=self.device)
            # Tagged as microbatch 0 whichever microbatch goes first: the receiving rank may run
            # its microbatches in another order.
            ex.sends += self._ops(
                dist.isend, (size, head), t, t.dst, f"stage {t.stage}'s activation shapes", MAX_VALUES, 0
            )
        ex.sends += self._ops(dist.isend, payload, t, t.dst, str(t))

    def post(self, t: Transfer, ex: Exchange) -> None:
        """Post ``t``'s receive (once its shapes are known: a stage's first activations bring a
        header, which their consumer fetches)."""
        buffers = self._receive_buffers(t)
        if buffers is None:
            ex.pending.add(t)
            return
        ex.posted[t] = (buffers, self._ops(dist.irecv, buffers, t, t.src, str(t)))

    def take(self, t: Transfer, ex: Exchange) -> tuple:
        """``t``'s values, waited for (its header fetched first if it brings one)."""
        if t.kind is ActionKind.F and (t.stage, t.src, t.dst) not in self.meta:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
            what = f"stage {t.stage}'s activation shapes"
            self._wait_all(self._ops(dist.irecv, (size,), t, t.src, what, MAX_VALUES, 0))
            head = torch.zeros(int(size), dtype=torch.int64, device=self.device)
            self._wait_all(self._ops(dist.irecv, (head,), t, t.src, what, MAX_VALUES + 1, 0))
            self.meta[(t.stage, t.src, t.dst)] = parse_header(head)
        if t not in ex.posted:
            ex.pending.discard(t)
            self.post(t, ex)
        buffers, works = ex.posted.pop(t)
        self._wait_all(works)
        return self._values(t, buffers)

    def _wait_all(self, works: list[Work]) -> None:
        for work, what, peer in works:
            self.wait(work, what, peer)


class OrderedTransport(Transport):
    """Every transfer of a pair issued in the pair's one order (NCCL)."""

    FIXED_HEADER = True

    def __init__(self, *args, channels: dict[int, list[Transfer]], pair_groups: dict[int, Any]):
        super().__init__(*args)
        self.channels = channels
        """Peer pipeline rank -> the transfers between us in the order both issue them."""
        self.pair_groups = pair_groups

    def before(self, ex: Exchange) -> None:
        """Issue what can go now, with every peer, without waiting."""
        for peer_pp in self.channels:
            self._advance(peer_pp, ex, until=None)

    def send(self, t: Transfer, values: tuple, names, ex: Exchange) -> None:
        """A value produced for another rank (with its shape header the first time): issued now,
        after whatever comes before it between us."""
        payload, head = self._outgoing(t, values, names)
        ex.outbox[t] = (head, payload)
        self._advance(t.dst, ex, until=t)

    def post(self, t: Transfer, ex: Exchange) -> None:
        """Issue the pair's transfers as far as they go without waiting (up to ``t`` at most)."""
        self._advance(t.src, ex, until=None)

    def take(self, t: Transfer, ex: Exchange) -> tuple:
        """``t``'s values, waited for (issuing its receive, and what comes before it, if not done yet)."""
        if t not in ex.posted:
            self._advance(t.src, ex, until=t)
        buffers, works = ex.posted.pop(t)
        for work, what, peer in works:
            self.wait(work, what, peer)
        return self._values(t, buffers)

    def _advance(self, peer_pp: int, ex: Exchange, until: Transfer | None) -> None:
        """Issue the transfers between this rank and ``peer_pp`` in their order, up to ``until``
        (waiting for a shape header on the way if need be), or without ``until`` as far as they
        can go without waiting: to a value this rank has not produced yet or to activations whose
        shapes have not arrived. A transfer's tensors go as one batched isend/irecv group (its
        shape header, when it has one, as a group before them, on both sides alike), and each
        waits for its own group only."""
        channel = self.channels.get(peer_pp, ())
        k = ex.cursor.get(peer_pp, 0)
        while k < len(channel):
            t = channel[k]
            if t.src == self.pp_rank:
                if t not in ex.outbox:
                    break
                head, payload = ex.outbox.pop(t)
                if head is not None:
                    self._issue(peer_pp, dist.isend, [head], ex.sends, f"{t}'s shapes")
                self._issue(peer_pp, dist.isend, payload, ex.sends, str(t))
            else:
                buffers = self._receive_buffers(t)
                if buffers is None:  # the activations' shapes come in their header, first
                    if t not in ex.headers:
                        head = torch.empty(ORDERED_HEADER, dtype=torch.int64, device=self.device)
                        ex.headers[t] = (head, [])
                        self._issue(peer_pp, dist.irecv, [head], ex.headers[t][1], f"{t}'s shapes")
                    if until is None:
                        break
                    head, works = ex.headers.pop(t)
                    for work, what, peer in works:
                        self.wait(work, what, peer)
                    self.meta[(t.stage, t.src, t.dst)] = parse_header(head)
                    buffers = self._receive_buffers(t)
                ex.posted[t] = (buffers, [])
                self._issue(peer_pp, dist.irecv, buffers, ex.posted[t][1], str(t))
            k += 1
            ex.cursor[peer_pp] = k
            if t == until:
                break

    def _issue(self, peer_pp: int, op, tensors: list[torch.Tensor], into: list, what: str) -> None:
        """One batched group of ``op`` (isend or irecv) of ``tensors`` with ``peer_pp``, on the
        pair's own process group; its work goes to ``into``."""
        if not tensors:
            return
        peer = self.peer(peer_pp)
        direction = "to" if op is dist.isend else "from"
        try:
            works = dist.batch_isend_irecv(
                [dist.P2POp(op, wire(x), peer, self.pair_groups[peer_pp]) for x in tensors]
            )
        except RuntimeError as err:
            raise self.lost(
                f"the connection failed moving {what} {direction} rank {peer}", err, peer
            ) from None
        # NCCL hands back one work for the whole group, gloo one per tensor.
        for work in works:
            into.append((work, f"{what} {direction} rank {peer}", peer))
