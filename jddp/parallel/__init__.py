"""Parallelism: strategies (DDP, ZeRO / FSDP, tensor, pipeline), device meshes, partition rules,
collectives and gradient compression, the pipeline engine."""
