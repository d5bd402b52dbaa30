"""vlmcompile: compile a PyTorch vision-language model into a pipelined training step.

>>> import vlmcompile
>>> pipe = vlmcompile.compile(model, sample_batch, cluster="h100x64")
>>> print(pipe.report)
>>> run = pipe.baseline("megatron", tp=8, pp=4, global_batch=32)
>>> print(run.sim)             # predicted step time and bubbles
"""

from vlmcompile.compiler import compile
from vlmcompile.cost_models.cluster import Cluster
from vlmcompile.ir.errors import (
    CaptureError,
    ClusterError,
    ModelError,
    PassError,
    PlanError,
    RegionError,
    SampleBatchError,
    VlmCompileError,
)
from vlmcompile.ir.layer_graph import Layer, LayerGraph
from vlmcompile.ir.plan import Plan
from vlmcompile.ir.regions import Region
from vlmcompile.pipeline import CompiledPipeline, CompileReport

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "Cluster",
    "ClusterError",
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
    "compile",
]
