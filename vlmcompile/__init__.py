"""vlmcompile: compile a PyTorch vision-language model into a pipelined training step.

>>> import vlmcompile
>>> pipe = vlmcompile.compile(model, sample_batch)
>>> print(pipe.report)
"""

from vlmcompile.compiler import CompiledPipeline, CompileReport, compile
from vlmcompile.errors import (
    CaptureError,
    ModelError,
    PassError,
    RegionError,
    SampleBatchError,
    VlmCompileError,
)
from vlmcompile.layer_graph import Layer, LayerGraph
from vlmcompile.regions import Region

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
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
