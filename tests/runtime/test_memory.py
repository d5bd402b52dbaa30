"""Peak tensor memory, measured: the CPU allocator's events over a window, plus what was held
before it; a training run reports it next to the plan's prediction."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models import build
from tests.pipeline_helpers import even_plan
from vlmcompile import TrainConfig, compile
from vlmcompile.runtime.memory import StepMemory, held_bytes

MiB = 2**20


def test_a_window_measures_the_most_it_allocated_above_what_was_held_and_prints_nothing(capfd):
    held = [torch.zeros(MiB // 4)]  # 1 MiB, a view of it counts once
    held.append(held[0][:10])
    meter = StepMemory(torch.device("cpu"))
    with meter.window(True, held=held):
        big = torch.ones(4 * MiB // 4)  # 4 MiB
        del big
        small = torch.ones(MiB // 4)  # 1 MiB: less than what was freed
    assert held_bytes(held) == MiB
    assert 5 * MiB <= meter.peak_bytes < 5 * MiB + 64 * 1024, meter.peak_bytes
    out = capfd.readouterr()
    assert "profiler" not in out.err and "USDT" not in out.err, out.err
    with meter.window(False):
        small += 1
    assert meter.peak_bytes is None


@pytest.mark.multiproc
def test_training_reports_each_ranks_peak_beside_the_plans_prediction(tmp_path):
    """The default measures once, on the second step (the first has no optimizer states yet):
    each rank's peak within 10 % of the prediction for the tiny model (states dominate it), in
    the metrics, the JSON lines and the run's summary."""
    model, batch = build("tiny", batch_size=4)
    pipe = compile(model, batch, "cpu:2", log=None)
    plan = even_plan(pipe.layer_graph, pp=2, global_batch=4)
    log = tmp_path / "steps.jsonl"
    result = pipe.train([batch] * 3, TrainConfig(steps=3, log_jsonl=str(log)), plan=plan, timeout_s=60)
    measured = [s.peak_tensor_bytes for s in result.steps]
    assert measured[0] is None and measured[2] is None and len(measured[1]) == 2
    predicted = result.steps[1].predicted_peak_bytes
    for m, p in zip(measured[1], predicted):
        assert abs(p / m - 1) < 0.10, (measured[1], predicted)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[1]["peak_tensor_bytes"] == list(measured[1]) and lines[1]["predicted_peak_bytes"] == list(
        predicted
    )
    assert "tensors at their peak (step 2)" in str(result) and "predicted" in str(result)


@pytest.mark.parametrize("share", [0.75, 0.6])
def test_a_plan_said_to_fit_a_cap_fits_it_when_run(share):
    """The planner holds local ranks' plans to the bytes the runtime keeps (fp32 states), with the
    memory reserve kept for what the model misses, so the plan it says fits a cap below the
    uncapped plan's peak (moving its cut or recomputing) predicts what the runtime predicts, and
    each rank's measured peak stays under the cap."""
    from vlmcompile.cost_models.cluster import Cluster
    from vlmcompile.cost_models.memory import usable_memory_bytes
    from vlmcompile.sim.simulator import peak_memory_bytes

    model, batch = build("tiny", batch_size=8)
    free = compile(model, batch, "cpu:2", log=None)
    cap = share * max(peak_memory_bytes(free.plan, free.layer_graph, Cluster.local_cpu(2)))
    cluster = Cluster.local_cpu(2).with_memory_cap(cap)
    pipe = compile(model, batch, cluster, log=None)
    said = peak_memory_bytes(pipe.plan, pipe.layer_graph, cluster)
    # The model's reserve kept: planned to 95 % of the cap.
    assert max(said) <= usable_memory_bytes(cluster.device.mem_bytes) <= 0.951 * cap
    assert not pipe.plan.same_layout(free.plan)
    result = pipe.train([batch] * 2, TrainConfig(steps=2), timeout_s=60)
    step = result.steps[1]
    torch.testing.assert_close([float(p) for p in step.predicted_peak_bytes], said, rtol=1e-6, atol=1.0)
    for rank, measured in enumerate(step.peak_tensor_bytes):
        assert measured <= cap, f"rank {rank}: {measured / MiB:.3f} MiB held, the cap {cap / MiB:.3f} MiB"
