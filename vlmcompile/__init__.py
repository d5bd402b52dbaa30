"""vlmcompile: compile a PyTorch vision-language model into a pipelined training step.

>>> import vlmcompile
>>> pipe = vlmcompile.compile(model, sample_batch, cluster="h100x64")
>>> print(pipe.report)
>>> run = pipe.baseline("megatron", tp=8, pp=4, global_batch=32)
>>> print(run.sim)             # predicted step time and bubbles
"""

from vlmcompile.cluster import Cluster
from vlmcompile.compiler import CompiledPipeline, CompileReport, compile
from vlmcompile.errors import (
    CaptureError,
    ClusterError,
    ModelError,
    PassError,
    PlanError,
    RegionError,
    SampleBatchError,
    VlmCompileError,
)
from vlmcompile.layer_graph import Layer, LayerGraph
from vlmcompile.plan import Plan
from vlmcompile.regions import Region

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
