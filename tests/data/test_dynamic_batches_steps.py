"""The steps benchmarks/dynamic_batches.py times: packed steps take every sample once, in
stream order, within each microbatch's tokens, and a stream too short is said, not padded out."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vlmcompile.data.balance import SampleSizes

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def _module():
    sys.path.insert(0, str(BENCHMARKS))  # its own imports (readme_section) live beside it
    try:
        spec = importlib.util.spec_from_file_location("dynamic_batches", BENCHMARKS / "dynamic_batches.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["dynamic_batches"] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("method", ["tokens", "greedy"])
def test_packed_steps_take_every_sample_once_within_the_budget(method):
    bench = _module()
    rng = np.random.default_rng(0)
    sizes = SampleSizes(rng.integers(50, 900, 3000), rng.integers(0, 9, 3000))
    planned = SimpleNamespace(microbatches=4, replicas=2, capacity=1024, global_batch=16)
    steps = bench.packed_steps(sizes, planned, 20, method)
    seen = [i for step in steps for row in step for i in row]
    assert len(seen) == len(set(seen)) and len(steps) == 20
    assert all(len(step) == 8 for step in steps)
    assert all(sum(int(sizes.llm_tokens[i]) for i in row) <= 1024 for step in steps for row in step)
    assert max(seen) < 3000 and sorted(seen)[: len(seen) // 2] == list(range(len(seen) // 2))
    with pytest.raises(RuntimeError, match="the sample stream ran out"):
        bench.packed_steps(SampleSizes(sizes.llm_tokens[:30], sizes.vision_rows[:30]), planned, 20, method)
    megatron = bench.megatron_steps(sizes, planned, 3)
    assert [len(mb) for mb in megatron[0]] == [2] * 8 and megatron[1][0] == [16, 17]
