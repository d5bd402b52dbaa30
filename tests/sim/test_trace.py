"""The simulated step's timelines: a Chrome trace in the Trace Event Format (every action, its TP
collectives nested at its end, the DP stream, the bubbles) and a PNG."""

import json

import pytest

from tests.sim_helpers import bubble_plan_with_tp, rider_and_host
from vlmcompile.sim.simulator import simulate
from vlmcompile.sim.trace import chrome_trace, write_chrome_trace, write_png


def test_chrome_trace_follows_the_trace_event_format(demo_plan, demo_run, tmp_path):
    path = tmp_path / "trace.json"
    write_chrome_trace(demo_plan, demo_run, path)
    data = json.loads(path.read_text())
    assert set(data) >= {"traceEvents", "displayTimeUnit"}
    assert data["displayTimeUnit"] in ("ms", "ns")
    phases = set()
    for e in data["traceEvents"]:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        phases.add(e["ph"])
        if e["ph"] == "X":
            assert isinstance(e["ts"], float | int) and e["ts"] >= 0
            assert isinstance(e["dur"], float | int) and e["dur"] >= 0
        elif e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index") and "args" in e
        else:
            pytest.fail(f"unexpected phase {e['ph']}")
    assert phases == {"X", "M"}
    actions = [e for e in data["traceEvents"] if e["ph"] == "X" and e.get("cat") in ("F", "B", "I", "W")]
    assert len(actions) == len(demo_run.runs)
    # the last action ends at the step's last compute, in microseconds
    end_us = max(e["ts"] + e["dur"] for e in actions)
    assert end_us == pytest.approx(max(r.end_s for r in demo_run.runs) * 1e6)
    assert chrome_trace(demo_plan, demo_run)["otherData"]["note"].startswith("simulated")


def test_png_timeline_is_written(demo_plan, demo_run, tmp_path):
    path = tmp_path / "timeline.png"
    write_png(demo_plan, demo_run, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


# ---- kernel level: encoder actions inside an LLM action's TP gaps -------------------------------
def test_tp_collectives_nest_at_the_end_of_their_action(demo_plan, demo_run):
    events = [e for e in chrome_trace(demo_plan, demo_run)["traceEvents"] if e["ph"] == "X"]
    actions = {(e["pid"], e["ts"]): e for e in events if e["cat"] in ("F", "B")}
    collectives = [e for e in events if e["cat"] == "tp_comm"]
    assert collectives, "TP = 2: every action has TP collectives"
    for tp in collectives:
        host = next(
            a for (pid, ts), a in actions.items() if pid == tp["pid"] and ts <= tp["ts"] < ts + a["dur"]
        )
        assert tp["ts"] + tp["dur"] == pytest.approx(host["ts"] + host["dur"])
    dp = [e for e in events if e["cat"] == "dp"]
    assert {e["name"] for e in dp} <= {"all_gather", "reduce_scatter"} and dp


def test_the_trace_shows_kernel_level_encoder_work_apart(demo_graph, tmp_path):
    cluster, plan = bubble_plan_with_tp(demo_graph)
    fused, rider, _ = rider_and_host(plan)
    sim = simulate(fused, demo_graph, cluster)
    events = chrome_trace(fused, sim)["traceEvents"]
    inside = [e for e in events if e.get("cat") == "kernel-level encoder"]
    assert [e["name"] for e in inside] == [str(rider)]
    write_png(fused, sim, tmp_path / "trace.png")
    assert (tmp_path / "trace.png").stat().st_size > 10_000
