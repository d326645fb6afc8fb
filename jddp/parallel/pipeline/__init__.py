"""Pipeline parallelism: `Pipelined` stacks of blocks, their schedules, and the SPMD engine
that runs them over a mesh's `stage` axis."""

from jddp.parallel.pipeline.layers import Pipelined
from jddp.parallel.pipeline.options import PipelineOptions

__all__ = ["PipelineOptions", "Pipelined"]
