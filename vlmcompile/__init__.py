"""vlmcompile: compile a PyTorch vision-language model into a pipelined training step."""

from vlmcompile.errors import (
    CaptureError,
    ModelError,
    PassError,
    RegionError,
    SampleBatchError,
    VlmCompileError,
)
from vlmcompile.regions import Region

__version__ = "0.1.0"
