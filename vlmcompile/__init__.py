"""vlmcompile: compile a PyTorch vision-language model into a pipelined training step.

>>> import vlmcompile
>>> pipe = vlmcompile.compile(model, sample_batch, cluster="h100x64")
>>> print(pipe.report)
>>> run = pipe.baseline("megatron", tp=8, pp=4, global_batch=32)
>>> print(run.sim)             # predicted step time and bubbles
>>> vlmcompile.train(pipe, batches, vlmcompile.TrainConfig(steps=100))
"""

import importlib
from typing import Any

_EXPORTS = {
    "compile": "vlmcompile.compiler",
    "freeze_layers": "vlmcompile.compiler",
    "Cluster": "vlmcompile.cost_models.cluster",
    "CaptureError": "vlmcompile.ir.errors",
    "ClusterError": "vlmcompile.ir.errors",
    "ModelError": "vlmcompile.ir.errors",
    "PassError": "vlmcompile.ir.errors",
    "PlanError": "vlmcompile.ir.errors",
    "RegionError": "vlmcompile.ir.errors",
    "SampleBatchError": "vlmcompile.ir.errors",
    "VlmCompileError": "vlmcompile.ir.errors",
    "Layer": "vlmcompile.ir.layer_graph",
    "LayerGraph": "vlmcompile.ir.layer_graph",
    "Plan": "vlmcompile.ir.plan",
    "Region": "vlmcompile.ir.regions",
    "CompiledPipeline": "vlmcompile.pipeline",
    "CompileReport": "vlmcompile.pipeline",
    "TrainConfig": "vlmcompile.runtime.trainer",
    "GlobalBatches": "vlmcompile.runtime.data",
    "train": "vlmcompile.pipeline",
    "load_checkpoint": "vlmcompile.runtime.checkpoint",
}
"""Loaded on first use: a local rank imports ``vlmcompile.runtime.launch`` before anything else
(it must arm its parent-death signal at once), and that should not import the compiler."""


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'vlmcompile' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "Cluster",
    "ClusterError",
    "GlobalBatches",
    "Plan",
    "PlanError",
    "CompileReport",
    "CompiledPipeline",
    "Layer",
    "LayerGraph",
    "ModelError",
    "PassError",
    "Region",
    "RegionError",
    "SampleBatchError",
    "VlmCompileError",
    "TrainConfig",
    "compile",
    "freeze_layers",
    "load_checkpoint",
    "train",
]
