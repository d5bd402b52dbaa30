"""Ordered transfers (what NCCL needs: messages paired by order, not tag) on gloo with every tag
0, so gloo pairs them by order too: every plan shape trains like eager, and the pair order is
one both ranks can follow."""

from __future__ import annotations

import pytest

from tests.pipeline_helpers import check_equal_to_eager, even_plan, first_forwards_swapped, separate_plan
from tests.runtime.test_executor import CASES, SEPARATE, _pipe
from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.runtime.launch import launch
from vlmcompile.runtime.training import one_step
from vlmcompile.runtime.transfers import transfer_order


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
