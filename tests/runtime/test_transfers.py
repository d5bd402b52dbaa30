"""Ordered transfers (what NCCL needs: messages paired by order, not tag) on gloo with every tag
0, so gloo pairs them by order too: every plan shape trains like eager, and the pair order is
one both ranks can follow."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.pipeline_helpers import check_equal_to_eager, even_plan, first_forwards_swapped, separate_plan
from tests.runtime.test_executor import CASES, SEPARATE, _pipe
from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.program import Transfer, transfer_order
from vlmcompile.runtime.launch import launch
from vlmcompile.runtime.timed_steps import one_step


def _ordered_step(pipe, plan, batch):
    runner = pipe.runner(plan, timeout_s=30)
    runner.transfers = "ordered"
    return launch(one_step, runner, runner.parallel.world_size, args=(batch,), timeout_s=30)


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES) + list(SEPARATE))
def test_ordered_transfers_train_like_eager(case):
    if case in CASES:
        name, options = CASES[case]
        model, batch, pipe = _pipe(name)
        plan = even_plan(pipe.layer_graph, global_batch=4, **options)
    else:
        name, options = SEPARATE[case]
        model, batch, pipe = _pipe(name, batch_size=options["global_batch"])
        plan = separate_plan(pipe.layer_graph, **options)
    check_equal_to_eager(model, batch, _ordered_step(pipe, plan, batch))


def _swapped(pipe):
    plan = first_forwards_swapped(even_plan(pipe.layer_graph, pp=2, global_batch=4))
    plan.validate(pipe.layer_graph)
    return plan


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_ordered_transfers_pair_values_a_rank_needs_in_another_order_than_they_are_sent():
    model, batch, pipe = _pipe("tiny")
    check_equal_to_eager(model, batch, _ordered_step(pipe, _swapped(pipe), batch))


def test_the_pair_order_is_the_senders_order_not_the_receivers():
    """Rank 0 sends microbatch 1's activations before microbatch 0's, rank 1 needs them the other
    way round: receives posted in rank 1's own order would pair with the wrong messages where
    messages pair by order. Both ranks issue the pair's transfers in one order, each rank's sends
    in its own action order."""
    _, _, pipe = _pipe("tiny")
    plan = _swapped(pipe)
    order = transfer_order(plan)
    pair = order[0][1]
    assert pair == order[1][0]
    for src in (0, 1):
        position = {a: k for k, a in enumerate(plan.actions[src])}
        produced = [position[Action(t.stage, t.kind, t.microbatch)] for t in pair if t.src == src]
        assert produced == sorted(produced), "a rank's sends follow its own action order"
    receiver = {a: k for k, a in enumerate(plan.actions[1])}
    needed = [receiver[t.consumer] for t in pair if t.dst == 1]
    assert needed != sorted(needed)
    assert {t.kind for t in pair} == {ActionKind.F, ActionKind.B}


# ---- the ordered protocol against a model of NCCL -------------------------------------------
# gloo cannot show a deadlock NCCL would have: NCCL runs a communicator's p2p on one stream, in
# issue order, and an operation there completes only when the peer's matching one reaches the
# head of the peer's stream. The model below runs the executor's ordered protocol (per-pair
# communicators, one group per transfer, shape headers as their own group, receives posted
# ahead) on such streams, for several steps, and fails on a deadlock or a mismatched pairing.


@dataclasses.dataclass
class _Lists:
    """What ``transfer_order`` reads of a plan: its action lists."""

    actions: tuple
    num_stages: int
    ahead: frozenset = frozenset()

    def carried(self):
        return {}

    def rank_of_action(self):
        return {a: r for r, acts in enumerate(self.actions) for a in acts}

    def split_backward(self):
        return frozenset()

    def hosts_of(self):
        return {}


def _run_on_nccl_model(plan, steps: int = 2, order=None) -> None:
    F, B = ActionKind.F, ActionKind.B
    ranks, last = len(plan.actions), plan.num_stages - 1
    rank_of = plan.rank_of_action()
    order = order or transfer_order(plan)
    streams: dict[tuple[int, int], list] = {}  # (rank, peer) -> [(op, label)] in issue order
    done: set = set()
    sent_header: set = set()
    known: set = set()

    def issue(rank, peer, op, label):
        streams.setdefault((rank, peer), []).append((op, label))
        return (rank, peer, op, label)

    def rank_program(r):
        channels = order.get(r, {})
        cursor, outbox, inbox, headers, sends, saved = {}, {}, {}, {}, [], set()

        def advance(peer, until):
            channel = channels.get(peer, [])
            k = cursor.get(peer, 0)
            while k < len(channel):
                t = channel[k]
                if t.src == r:
                    if t not in outbox:
                        return
                    if outbox.pop(t):
                        sends.append(issue(r, peer, "send", ("header", t)))
                    sends.append(issue(r, peer, "send", ("data", t)))
                else:
                    if t.kind is B:
                        assert (t.stage - 1, t.microbatch) in saved, (
                            f"rank {r}: {t}'s shapes before its forward"
                        )
                    elif (t.stage, t.src, t.dst) not in known:
                        if t not in headers:
                            headers[t] = issue(r, peer, "recv", ("header", t))
                        if until is None:
                            return
                        yield headers.pop(t)
                        known.add((t.stage, t.src, t.dst))
                    inbox[t] = issue(r, peer, "recv", ("data", t))
                k += 1
                cursor[peer] = k
                if t == until:
                    return

        def receive(t):
            if t not in inbox:
                yield from advance(t.src, t)
            yield inbox.pop(t)

        def offer(t):
            key = (t.stage, t.src, t.dst)
            outbox[t] = t.kind is F and key not in sent_header
            sent_header.add(key)
            yield from advance(t.dst, t)

        for a in plan.actions[r]:
            for peer in channels:
                yield from advance(peer, None)
            s, i = a.stage, a.microbatch
            step = 1 if a.kind is F else -1
            if (a.kind is F and s > 0) or (a.kind is B and s < last):
                source = Action(s - step, a.kind, i)
                if rank_of[source] != r:
                    yield from receive(Transfer(a.kind, source.stage, i, rank_of[source], r))
            if a.kind is F and s < last:
                saved.add((s, i))
            if a.kind is B and s < last:
                saved.discard((s, i))
            if (a.kind is F and s < last) or (a.kind is B and s > 0):
                target = Action(s + step, a.kind, i)
                if rank_of[target] != r:
                    yield from offer(Transfer(a.kind, s, i, r, rank_of[target]))
        yield from sends
        assert not outbox and not inbox, f"rank {r} ended the step with transfers left"

    def match() -> bool:
        moved = False
        for (r, peer), queue in streams.items():
            if not queue:
                continue
            op, label = queue[0]
            other = streams.get((peer, r), [])
            if other and other[0][1] == label and other[0][0] != op:
                done.update({(r, peer, op, label), (peer, r, other[0][0], label)})
                queue.pop(0)
                other.pop(0)
                moved = True
        return moved

    for step in range(steps):
        done.clear()  # a step issues the same transfers as the one before
        programs = {r: rank_program(r) for r in range(ranks)}
        waiting = dict.fromkeys(range(ranks))
        while programs:
            moved = match()
            for r in list(programs):
                while waiting[r] is None or waiting[r] in done:
                    try:
                        waiting[r] = next(programs[r])
                        moved = True
                    except StopIteration:
                        del programs[r]
                        break
            if not moved:
                heads = {k: q[:2] for k, q in streams.items() if q}
                raise AssertionError(f"step {step}: the ranks deadlock: {waiting}; stream heads {heads}")
        left = {k: q for k, q in streams.items() if q}
        assert not left, f"step {step}: never received: {left}"


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved v2", "interleaved v3"])
def test_ordered_transfers_never_deadlock_on_nccls_streams(schedule, pp):
    from vlmcompile.planning import schedules

    for m in (pp, 2 * pp, 3 * pp):
        if schedule.startswith("interleaved"):
            v = int(schedule[-1])
            plan = _Lists(schedules.interleaved_one_f_one_b(pp, m, v), pp * v)
        else:
            make = schedules.gpipe if schedule == "gpipe" else schedules.one_f_one_b
            plan = _Lists(make(pp, m), pp)
        _run_on_nccl_model(plan)


@pytest.mark.parametrize(
    "options",
    [
        dict(pp=3, encoder_pp=1, chunks=1),
        dict(pp=3, encoder_pp=3, chunks=1),
        dict(pp=3, encoder_pp=1, chunks=3),
        dict(pp=2, encoder_pp=1, chunks=2, dp=2),
    ],
    ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()),
)
def test_ordered_transfers_never_deadlock_with_replicated_encoders(options):
    _, _, pipe = _pipe("tiny", batch_size=12)
    _run_on_nccl_model(separate_plan(pipe.layer_graph, global_batch=12, **options))


def test_the_nccl_model_catches_a_wrong_order():
    """The model is not vacuous: the pair order reversed (each side still agreeing with the
    other) makes a rank wait for a value whose producer waits for it."""
    _, _, pipe = _pipe("tiny")
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)
    _run_on_nccl_model(plan)
    reversed_order = {
        r: {peer: ts[::-1] for peer, ts in peers.items()} for r, peers in transfer_order(plan).items()
    }
    with pytest.raises(AssertionError, match="deadlock|before its forward"):
        _run_on_nccl_model(plan, order=reversed_order)


@pytest.mark.parametrize(
    "value",
    [
        torch.arange(6, dtype=torch.int16).reshape(2, 3),
        torch.tensor(7, dtype=torch.int16),
        torch.ones(2, 2, dtype=torch.complex64),
    ],
)
def test_what_goes_on_the_wire_shares_the_buffer_in_a_type_every_backend_has(value):
    """NCCL has no int16, gloo no complex: both travel as a view of the same storage, so a
    receive into the view fills the buffer."""
    from vlmcompile.runtime.wire import wire as on_the_wire

    wire = on_the_wire(value)
    assert wire.dtype in (torch.uint8, torch.float32)
    assert wire.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
    wire.copy_(on_the_wire(torch.zeros_like(value)))
    assert not value.any()
