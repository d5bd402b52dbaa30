"""vlmcompile: compile a PyTorch vision-language model into a pipelined training step.

>>> import vlmcompile
>>> pipe = vlmcompile.compile(model, sample_batch, cluster="h100x64")
>>> print(pipe.report)
>>> run = pipe.baseline("megatron", tp=8, pp=4, global_batch=32)
>>> print(run.sim)             # predicted step time and bubbles
>>> vlmcompile.train(pipe, batches, vlmcompile.TrainConfig(steps=100))

The modules here are the top of the import order (docs/architecture.md tours the rest):

* ``compiler`` - ``compile``: the pass list, run by ``pass_runner`` (numbered passes that explain themselves).
* ``compiled_pipeline`` - what ``compile`` returns: :class:`CompiledPipeline`, and a rank's runner for a plan.
* ``model_source`` - ``--model`` / ``--data`` as ``pkg.module:function``: a user's model and samples.
* ``cli`` (and ``__main__``) - the command line; ``train_command`` is ``vlmcompile train``; ``demo`` is ``vlmcompile demo``.

Below them, in import order: ``ir`` (the data every stage hands the next), ``cost_models`` and
``sim`` (what a plan costs; its simulated step), ``planning`` (requests, CP-SAT models, schedules,
bounds), ``passes`` (capture, annotate, our planning passes, the baselines, codegen), and beside
them ``graph`` (FX machinery), ``data`` (samples of any shape), ``models`` (the zoo),
``families`` (every model family in one spec each: regions, sample layout, image features, tiny
model) and ``runtime`` (a plan run on torch.distributed).
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
    "CompiledPipeline": "vlmcompile.compiled_pipeline",
    "CompileReport": "vlmcompile.compiled_pipeline",
    "TrainConfig": "vlmcompile.runtime.train_loop",
    "GlobalBatches": "vlmcompile.runtime.global_batches",
    "train": "vlmcompile.compiled_pipeline",
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
