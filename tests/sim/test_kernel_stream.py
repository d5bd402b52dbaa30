"""The kernel-level fill rule: encoder kernels spread over their hosts' TP gaps, first in first
out, and what is left at a rider's last host lengthens it."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmcompile.ir.actions import Action
from vlmcompile.sim.kernel_stream import HostFill, KernelStream, host_fills

E0, E1 = Action.from_str("0F0"), Action.from_str("0F1")
H = [Action.from_str(f"5F{j}") for j in range(6)]


def test_a_rider_larger_than_a_gap_spreads_over_its_hosts_without_lengthening_them():
    work = {E0: (2.5, 0.5)}  # compute, collectives
    fills = host_fills({E0: tuple(H[:3])}, [(E0, *H[:3])], work=work.get, capacity=lambda h: (1.0, 4.0))
    assert [round(fills[h].shares[E0], 6) for h in H[:3]] == [0.4, 0.4, 0.2]
    for h in H[:3]:
        assert fills[h].duration(5.0) == pytest.approx(5.0)  # within the gap: the host's own time
    assert sum(f.hidden_compute for f in fills.values()) == pytest.approx(2.5)


def test_what_is_left_at_the_last_host_lengthens_it():
    work = {E0: (2.5, 0.5)}
    fills = host_fills({E0: tuple(H[:2])}, [(E0, *H[:2])], work=work.get, capacity=lambda h: (1.0, 4.0))
    assert fills[H[1]].shares[E0] == pytest.approx(0.6)
    assert fills[H[1]].duration(5.0) == pytest.approx(5.0 + 1.5 - 1.0)
    assert fills[H[1]].hidden_compute == pytest.approx(1.0)


def test_riders_take_a_hosts_gap_first_in_first_out():
    work = {E0: (1.5, 0.0), E1: (1.5, 0.0)}
    hosts = {E0: tuple(H[:3]), E1: tuple(H[:3])}
    fills = host_fills(hosts, [(E0, E1, *H[:3])], work=work.get, capacity=lambda h: (1.0, 4.0))
    assert fills[H[0]].shares == {E0: pytest.approx(2 / 3)}
    assert fills[H[1]].shares == {E0: pytest.approx(1 / 3), E1: pytest.approx(1 / 3)}
    assert fills[H[2]].shares == {E1: pytest.approx(2 / 3)}


def test_a_riders_collectives_need_the_hosts_compute():
    """Encoder TP collectives run only while the LLM computes (Optimus design decision 3)."""
    stream = KernelStream({E0: (1.0, 2.0)}.get)
    stream.open(E0)
    fill = HostFill(gap=5.0, compute=1.0)
    stream.fill(fill)
    assert fill.shares[E0] == pytest.approx(0.5)  # the host's 1.0 of compute carries half its 2.0
    assert fill.duration(6.0) == pytest.approx(6.0)


@settings(max_examples=60, deadline=None)
@given(
    works=st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 3.0)), min_size=1, max_size=4),
    caps=st.lists(st.tuples(st.floats(0.0, 2.0), st.floats(0.1, 6.0)), min_size=4, max_size=4),
    spans=st.lists(st.integers(1, 4), min_size=4, max_size=4),
)
def test_every_riders_work_runs_once_and_only_the_last_host_overflows(works, caps, spans):
    riders = [Action(0, Action.from_str("0F0").kind, j) for j in range(len(works))]
    work = dict(zip(riders, works))
    hosts = {r: tuple(H[: spans[i]]) for i, r in enumerate(riders)}
    fills = host_fills(hosts, [(*riders, *H[:4])], work=work.get, capacity=dict(zip(H, caps)).get)
    for r in riders:
        assert sum(f.shares.get(r, 0.0) for f in fills.values()) == pytest.approx(1.0)
        assert all(h in hosts[r] for h, f in fills.items() if r in f.shares)
    last = {hosts[r][-1] for r in riders}
    for h, f in fills.items():
        if h not in last:  # a host no rider ends in keeps its own time
            assert f.rider_compute <= f.gap + 1e-9 and f.rider_comm <= f.compute + 1e-9
            assert f.duration(f.gap + f.compute) == pytest.approx(f.gap + f.compute)
