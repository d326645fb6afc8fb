"""Seeing a run: model FLOPs and MFU, memory per device, the compiled HLO, metric files, progress
and profiling."""
