"""`parallel.pipeline.*`: how a mesh's `stage` axis is used, checked against the model."""

import dataclasses

from jddp.errors import ConfigError
from jddp.parallel.pipeline.schedule import SCHEDULES, make_schedule

# What a stage keeps of each layer's forward for its backward (`remat`), as jax.checkpoint
# policies name it: the rest is recomputed in the backward, layer by layer.
REMAT = {
    "dots": "the matmuls' outputs and the layer's input (elementwise work recomputed)",
    "none": "everything the backward reads (nothing recomputed)",
    "full": "the layer's input only (its whole forward recomputed)",
}


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """`microbatches` per pipeline (0: as many as stages), `schedule` (`1f1b` or `gpipe`),
    `repeats` (layer groups per device: V > 1 interleaves them, stage s running groups s,
    s + S, ...; see docs/pipeline.md), `remat` (what a stage keeps of each layer's forward for
    its backward, `REMAT`)."""

    microbatches: int = 0
    schedule: str = "1f1b"
    repeats: int = 1
    remat: str = "dots"

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"unknown parallel.pipeline.schedule {self.schedule!r}; choose one of "
                f"{', '.join(SCHEDULES)}"
            )
        if not isinstance(self.microbatches, int) or self.microbatches < 0:
            raise ConfigError(
                f"parallel.pipeline.microbatches={self.microbatches!r} must be >= 0 (0: as many "
                "as stages)"
            )
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ConfigError(
                f"parallel.pipeline.repeats={self.repeats!r} must be an integer >= 1 (1: one "
                "layer group per stage)"
            )
        if self.remat not in REMAT:
            raise ConfigError(
                f"unknown parallel.pipeline.remat {self.remat!r}; choose one of "
                f"{', '.join(REMAT)} (what a stage keeps of each layer's forward)"
            )

    def microbatches_per_step(self, mesh) -> int:
        """Micro-batches each step's batch is cut into on `mesh` (a `DeviceMesh`; without a
        stage axis: 1), known from the options and the mesh alone, before any engine is
        built."""
        return (self.microbatches or mesh.size("stage")) if mesh.stage_axis else 1

    def engine(self, task, mesh):
        """The pipeline engine for `task` over `mesh`'s stage axis; a ConfigError for a model
        with no `Pipelined` stack, layers that do not split into the stages, or too few
        micro-batches."""
        from jddp.parallel.pipeline.engine import Pipeline

        stages = mesh.size("stage")
        if task.stack is None:
            raise ConfigError(
                "parallel.mesh has a stage axis but the model has no stack of identical blocks "
                "to split into stages; wrap them in jddp.parallel.pipeline.Pipelined (the built-in "
                "GPT does), or remove the stage axis"
            )
        layers = task.stack.num_layers
        if layers % (stages * self.repeats):
            raise ConfigError(
                f"the model's {layers} layers do not split into stage={stages} x repeats="
                f"{self.repeats} equal groups; choose stage x repeats that divides {layers}"
            )
        microbatches = self.microbatches_per_step(mesh)
        if microbatches < stages:
            raise ConfigError(
                f"parallel.pipeline.microbatches={microbatches} is fewer than the {stages} "
                f"stages (every stage would idle); use at least {stages}, e.g. {4 * stages}"
            )
        if self.repeats > 1 and microbatches % stages:
            raise ConfigError(
                f"parallel.pipeline.microbatches={microbatches} is not a multiple of the "
                f"{stages} stages, which the interleaved schedule (repeats={self.repeats}) "
                f"takes in groups of {stages}; use {stages * -(-microbatches // stages)}"
            )
        # With 2 layers or more per group the backward is split into two ticks of about a
        # forward's cost each, so that no stage waits for another (schedule.py).
        split = layers // (stages * self.repeats) >= 2
        schedule = make_schedule(self.schedule, stages, microbatches, split, self.repeats)
        return Pipeline(task, schedule, "stage", self.remat)
