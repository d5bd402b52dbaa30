import io

import pytest

from vlmcompile.ir.errors import PassError, SampleBatchError, VlmCompileError
from vlmcompile.pass_runner import Pass, PassRunner


def _record(name):
    def run(state):
        state.append(name)

    return run


def test_runs_in_order_prints_the_numbered_list_and_times():
    log = io.StringIO()
    state: list[str] = []
    report = PassRunner([Pass("a", _record("a")), Pass("b", _record("b"))], log=log).run(state)
    assert state == ["a", "b"]
    assert "passes: 1 a, 2 b" in log.getvalue() and "[2/2] b done in" in log.getvalue()
    assert [t.name for t in report.timings] == ["a", "b"] and all(t.time_s >= 0 for t in report.timings)


def test_disabled_passes_are_skipped_and_unknown_names_rejected():
    state: list[str] = []
    report = PassRunner([Pass("a", _record("a")), Pass("b", _record("b"))], disabled=["a"], log=None).run(
        state
    )
    assert state == ["b"] and report.timings[0].time_s is None and "disabled" in str(report)
    with pytest.raises(VlmCompileError, match=r"unknown pass\(es\) \['c'\]; the passes are \['a', 'b'\]"):
        PassRunner([Pass("a", _record("a")), Pass("b", _record("b"))], disabled=["c"])


def test_a_failure_names_the_pass_and_those_already_run():
    def boom(state):
        raise RuntimeError("kaput")

    runner = PassRunner([Pass("a", _record("a")), Pass("b", boom)], log=None)
    with pytest.raises(
        PassError, match=r"pass 2 'b' failed \(RuntimeError: kaput\); passes already run: a"
    ) as err:
        runner.run([])
    assert isinstance(err.value.__cause__, RuntimeError)

    def bad_input(state):
        raise SampleBatchError("bad key")

    with pytest.raises(SampleBatchError, match=r"bad key \(in pass 2 'b'; passes already run: a\)"):
        PassRunner([Pass("a", _record("a")), Pass("b", bad_input)], log=None).run([])
