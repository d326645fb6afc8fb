"""Elastic device counts: a run restarted on fewer (or more) devices than it began with trains
the same global batches in the same order, and keeps each device's micro-batch no larger than it
began with by raising gradient accumulation (as DeepSpeed's elastic training does), so the run
fits in memory however far it shrinks. Growing back lowers accumulation again, never below the
config's `grad_accum_steps`.

The micro-batch a run began with is recorded in every checkpoint it writes (`MICRO_BATCH`)."""

import dataclasses

from absl import logging

from jddp.errors import ConfigError

MICRO_BATCH = "micro_batch_per_device"  # checkpoint metadata: the run's first micro-batch


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """The accumulation steps of this start, and the run's micro-batch per device."""

    steps: int
    micro_batch: int


def accumulation(global_batch: int, splits: int, configured: int, saved_meta) -> Accumulation:
    """This start's accumulation: `configured`, unless the global batch over the `splits` that
    share it (devices x pipeline micro-batches) would give each a micro-batch larger than the
    run's first (in `saved_meta`, the newest checkpoint's metadata; None: a fresh run); then the
    smallest number of steps that keeps it at most that."""
    reference = (saved_meta or {}).get(MICRO_BATCH)
    if not reference or global_batch % (splits * configured):  # fresh, or the usual error
        return Accumulation(configured, global_batch // (splits * configured) or 1)
    for steps in range(configured, global_batch // splits + 1):
        parts = splits * steps
        if global_batch % parts == 0 and global_batch // parts <= reference:
            return Accumulation(steps, int(reference))
    raise ConfigError(
        f"global_batch_size={global_batch} does not split over {splits} devices into "
        f"micro-batches of at most {reference} rows (the run's first); run on a device count "
        f"that divides {global_batch} or start a new run"
    )


def note(saved_meta, accum: Accumulation, configured: int, devices: int, processes: int) -> dict:
    """The first metrics record's `elastic` entry (and one log line) when this start runs on
    another device count than the checkpoint it resumes; {} otherwise."""
    saved = (saved_meta or {}).get("devices")
    if saved is None or saved == devices:
        return {}
    logging.warning(
        "elastic: %d devices in %d processes now, %d when the checkpoint was written: gradient "
        "accumulation %d (config: %d) keeps each device's micro-batch at most %d rows and the "
        "global batch as it was",
        devices, processes, saved, accum.steps, configured, accum.micro_batch,
    )  # fmt: skip
    return {
        "elastic": {
            "devices": devices,
            "processes": processes,
            "checkpoint_devices": saved,
            "grad_accum_steps": accum.steps,
            "micro_batch_per_device": accum.micro_batch,
        }
    }
