"""Stage modules moved to a device: parameters and the devices their captured graphs name."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from tests.models import build, needs_transformers
from tests.pipeline_helpers import even_plan
from vlmcompile import compile
from vlmcompile.passes.codegen.stages import codegen_for
from vlmcompile.runtime.stage import move_stage


def _named_devices(stage) -> list[str]:
    return [
        str(n.kwargs["device"])
        for m in stage.modules()
        if isinstance(m, fx.GraphModule)
        for n in m.graph.nodes
        if n.kwargs.get("device") is not None
    ]


@needs_transformers
@pytest.mark.hf
def test_a_moved_stage_names_its_new_device_in_its_graphs():
    """transformers' LLaVA captures ``arange(device=cpu)`` and device assertions: moved to another
    device (meta here: this machine has no GPU), the graphs name that device, and their code too."""
    model, batch = build("hf-llava")
    pipe = compile(model, batch, log=None)
    stages = codegen_for(
        pipe.gm, even_plan(pipe.layer_graph, pp=2, global_batch=2), model=model, sample_batch=batch
    ).stages
    assert any(d == "cpu" for s in stages for d in _named_devices(s)), "the capture names the CPU"
    for stage in stages:
        move_stage(stage, torch.device("meta"))
        assert all(p.device.type == "meta" for p in stage.parameters())
        assert set(_named_devices(stage)) <= {"meta"}
        codes = [m.code for m in stage.modules() if isinstance(m, fx.GraphModule)]
        assert not any("device(type='cpu')" in c or "device = 'cpu'" in c for c in codes)
