import pytest

from vlmcompile.ir.actions import ActionKind
from vlmcompile.ir.placement import Placement
from vlmcompile.planning.schedules import make_schedule
from vlmcompile.sim.in_flight import in_flight, pattern_bytes


@pytest.mark.parametrize(
    ("schedule", "v", "most"),
    [
        ("gpipe", 1, lambda p, m, r: m),
        ("1f1b", 1, lambda p, m, r: min(p - r, m)),
        ("zero_bubble", 1, None),
        ("interleaved_1f1b", 2, None),
    ],
)
def test_every_microbatch_is_held_from_its_forward_to_its_last_backward(schedule, v, most):
    p, m = 4, 8
    for rank, actions in enumerate(make_schedule(schedule, Placement(p, v), m)):
        patterns = list(in_flight(actions))
        assert len(patterns) == len(actions)
        forwards = 0
        for action, (live, busy) in zip(actions, patterns):
            held = dict(live)
            forwards += action.kind is ActionKind.F
            assert all(0 < n <= m for n in held.values())
            assert sum(held.values()) <= forwards
            if action.kind is ActionKind.F:
                assert held[action.stage] >= 1 and busy == -1
            elif action.kind in (ActionKind.B, ActionKind.I):
                assert busy == action.stage and held[action.stage] >= 1
            else:
                assert busy == -1
        # After the last action every microbatch is released: the last one holds only itself.
        last_live, _ = patterns[-1]
        assert sum(n for _, n in last_live) == 1
        if most is not None:
            assert max(dict(live).get(rank, 0) for live, _ in patterns) == most(p, m, rank)


def test_pattern_bytes_counts_kept_bytes_per_microbatch_and_the_running_transient():
    keep, transient = [10.0, 100.0], [1.0, 7.0]
    assert pattern_bytes((((0, 2), (1, 3)), -1), keep, transient) == 320.0
    assert pattern_bytes((((0, 2), (1, 3)), -1), keep, transient) + 7.0 == pattern_bytes(
        (((0, 2), (1, 3)), 1), keep, transient
    )
