"""Our 1F1B and interleaved 1F1B action orders against megatron-core's own schedule tables
(``megatron.core.pipeline_parallel.schedules``: ``get_pp_rank_microbatches``,
``get_schedule_table``; ``megatron.core.transformer.cuda_graphs.convert_schedule_table_to_order``),
run without torch.distributed: they read the pipeline sizes from the communicator we hand them."""

import warnings
from types import SimpleNamespace

import pytest

from vlmcompile.ir.actions import ActionKind
from vlmcompile.planning.schedules import interleaved_one_f_one_b, one_f_one_b

with warnings.catch_warnings():  # no Transformer Engine / Apex here: it says so and falls back
    warnings.simplefilter("ignore")
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order


def megatron_order(p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """(F or B, microbatch, model chunk) in the order megatron-core runs them on ``rank``, with
    its default microbatch group of p per virtual stage."""
    group = p
    comm = SimpleNamespace(
        pp_group=SimpleNamespace(size=lambda: p, rank=lambda: rank),
        virtual_pipeline_model_parallel_size=v if v > 1 else None,
    )
    _, _, warmup, _ = get_pp_rank_microbatches(m, v, group, p2p_communicator=comm)
    if v == 1:  # forward_backward_pipelining_without_interleaving: warm-up, 1F1B, cool-down
        order = [("F", k, 0) for k in range(warmup)]
        for k in range(m - warmup):
            order += [("F", k + warmup, 0), ("B", k, 0)]
        return order + [("B", k, 0) for k in range(m - warmup, m)]
    table = get_schedule_table(m, v, group)
    order, f, b = [], 0, 0
    for step in convert_schedule_table_to_order(warmup, v, table):
        if step > 0:  # forward k runs table[k]
            order.append(("F", *table[f]))
            f += 1
        else:  # backward k runs table[k]'s microbatch on the chunks in reverse
            microbatch, chunk = table[b]
            order.append(("B", microbatch, v - 1 - chunk))
            b += 1
    return order


def ours(p: int, v: int, m: int) -> list[list[tuple[str, int, int]]]:
    actions = interleaved_one_f_one_b(p, m, v) if v > 1 else one_f_one_b(p, m)
    kinds = {ActionKind.F: "F", ActionKind.B: "B"}
    return [[(kinds[a.kind], a.microbatch, a.stage // p) for a in rank] for rank in actions]


@pytest.mark.parametrize(
    ("p", "v", "m"),
    [
        (2, 1, 4),
        (4, 1, 8),
        (4, 1, 3),
        (2, 2, 4),
        (2, 2, 8),
        (4, 2, 8),
        (2, 3, 6),
        (4, 3, 12),
        (8, 2, 16),
        (4, 4, 4),
    ],
)
def test_action_order_is_megatron_cores(p, v, m):
    mine = ours(p, v, m)
    for rank in range(p):
        assert mine[rank] == megatron_order(p, v, m, rank), f"rank {rank}"
