"""The experiment config: its keys and defaults, and the checks that reject bad values early.

Experiment files (`experiments/configs/NAME.py` in the repository) start from `default_config()`
and override. Every key here is part of the contract with users; every key is on docs/configs.md.
This file is itself a config file (`get_config()`: the defaults, an MLP on the UCI digits), the
one the installed `python -m jddp.plan` reads when given no `--config`.
"""

import dataclasses
import math

import ml_collections

from jddp.core.lora import LoRA
from jddp.data.datasets import DataOptions
from jddp.errors import ConfigError
from jddp.observe.writers import check_writers
from jddp.parallel.grad_reduction import GradComm
from jddp.parallel.pipeline.options import PipelineOptions
from jddp.parallel.rules import DEFAULT_MIN_SHARD_SIZE


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # What to train.
    c.model = "mlp"
    c.model_args = ml_collections.ConfigDict()  # fields of the model class, e.g. hidden_sizes
    c.dataset = "digits"
    # Where data lives and how it is read: the fields of jddp.data.DataOptions, with its
    # defaults (data_dir, manual_dir, text_file, tokenizer, eos_token, seq_len, image_size,
    # augment, cache_max_mb, threads, workers, device_prefetch); for own data (dataset
    # "npz:PATH", "jsonl:PATH", "parquet:PATH", "hf:PATH" or "package.module:function") also
    # input_key, target_key, num_classes, eval_path and eval_fraction, and for instruction data
    # (chat messages, prompt/completion) loss_on (checked where the data is opened).
    c.data = ml_collections.ConfigDict(dataclasses.asdict(DataOptions()))
    # Batches and steps. global_batch_size is the whole step's batch over all devices.
    c.global_batch_size = 128
    c.eval_batch_size = 0  # 0 = global_batch_size
    c.grad_accum_steps = 1
    c.num_train_steps = 1000
    c.seed = 0
    # Optimizer: warmup + cosine decay, decoupled weight decay, global-norm clipping.
    c.optimizer = "adamw"
    c.learning_rate = 1e-3
    c.warmup_steps = 0
    c.min_lr_ratio = 0.0
    c.weight_decay = 0.0
    c.grad_clip_norm = 0.0  # 0 = no clipping
    c.adam_b1 = 0.9
    c.adam_b2 = 0.999
    c.momentum = 0.9  # sgd only
    c.compute_dtype = "float32"  # or bfloat16: activations and matmuls; float32 master weights
    c.log_grad_norm = True  # log the global norm of the averaged gradient (one extra pass)
    # Where records go besides WORKDIR/metrics.jsonl: trackers, comma-separated, of
    # tensorboard | wandb | mlflow ("" = none); W&B and MLflow are extras (jddp[wandb],
    # jddp[mlflow]) configured by their own environment variables (docs/trackers.md).
    c.log = ml_collections.ConfigDict()
    c.log.writers = "tensorboard"
    # Cadence, in steps.
    c.log_every = 50
    c.eval_every = 500
    # Checkpoints (WORKDIR/checkpoints): every N steps and at the end; 0 = none at all.
    c.checkpoint_every = 500
    c.max_to_keep = 3
    # halt: stop, keep the last good checkpoint | skip: drop that update | rollback: restore the
    # newest checkpoint and skip the batches since it (jddp/runtime/rollback.py)
    c.nan_policy = "halt"
    c.spike_factor = 0.0  # rollback: also on a loss this many times its recent median (0: off)
    c.spike_window = 32  # ... the median of this many recent losses
    c.max_rollbacks = 3  # ... stop after this many rollbacks in a row to one checkpoint
    # Seconds without a finished training step (after the first) before every process writes
    # its threads' stacks to WORKDIR/hang-<process>.txt and the job exits; 0 = off; unset (None)
    # = adaptive: 20x the median step, at least 10 minutes and twice the first step.
    c.hang_timeout_s = ml_collections.config_dict.placeholder(float)
    c.init_from = ""  # a workdir or checkpoint/export dir whose parameters start this run
    c.init_from_optimizer = False  # ... and its optimizer state too
    c.allow_config_change = False  # resume checkpoints written by another model config
    # Performance: MFU's denominator and a profiler trace of chosen steps.
    c.peak_flops_per_device = 0.0  # 0 = datasheet table (GPU/TPU) or measured matmul rate (CPU)
    c.profile_start_step = 0  # 0 = off; else trace this step and the next profile_num_steps - 1
    c.profile_num_steps = 3
    # Parallelism.
    c.parallel = ml_collections.ConfigDict()
    c.parallel.strategy = "ddp"  # ddp | zero1 | zero2 | zero3 (= fsdp) | hybrid | auto
    # Mesh strategies only. "ROLE:SIZE,..." over the roles data, fsdp, tensor, stage, context,
    # major to minor; one size may be -1; "" = the strategy's default ("fsdp:-1"; hybrid:
    # "data:<processes>,fsdp:-1").
    c.parallel.mesh = ""
    # ((regex over the parameter path, spec), ...), first match wins; then (".*", "fsdp"). Empty
    # on a mesh with a tensor axis: the model's tensor-parallel preset (GPT: Megatron's layout).
    c.parallel.rules = ()
    c.parallel.min_shard_size = DEFAULT_MIN_SHARD_SIZE  # elements; smaller stay replicated
    c.parallel.sequence_parallel = False  # GPT: split activations along the sequence over tensor
    c.parallel.allow_cross_host_tensor = False  # a tensor axis spanning processes is refused
    # A mesh with a context axis: how attention sees the whole sequence, ring | all_gather.
    c.parallel.context_attention = "ring"
    c.parallel.allow_cross_host_context = False  # a context axis spanning processes is refused
    # A mesh with a stage axis: micro-batches per pipeline (0 = stages), 1f1b | gpipe, repeats,
    # what a stage keeps of each layer's forward for its backward (dots | none | full).
    c.parallel.pipeline = ml_collections.ConfigDict()
    c.parallel.pipeline.microbatches = PipelineOptions.microbatches
    c.parallel.pipeline.schedule = PipelineOptions.schedule
    c.parallel.pipeline.repeats = PipelineOptions.repeats
    c.parallel.pipeline.remat = PipelineOptions.remat
    # How gradients cross devices (jddp/parallel/grad_reduction.py): float32 | bfloat16 on the
    # wire; grad_compression none | powersgd (ddp only): rank-r factors with error feedback,
    # uncompressed for the first powersgd_start_step steps.
    c.parallel.grad_comm_dtype = GradComm.dtype
    c.parallel.grad_compression = GradComm.compression
    c.parallel.powersgd_rank = GradComm.powersgd_rank
    c.parallel.powersgd_start_step = GradComm.powersgd_start_step
    # auto | cpu | native: XLA:CPU's and gloo's workarounds (cpu) or XLA's own collectives
    # (native); auto picks by the devices' platform (jddp/parallel/collectives.py).
    c.parallel.collectives = GradComm.collectives
    # LoRA (jddp/core/lora.py): rank 0 = off (every parameter trains); else low-rank adapters of
    # this rank on the modules whose path (block_0/attn/q) the regex `targets` matches, scaled
    # by alpha / rank, dropout on their input; every other parameter frozen.
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 0
    c.lora.alpha = LoRA.alpha
    c.lora.dropout = LoRA.dropout
    c.lora.targets = LoRA.targets
    return c


def lora_of(config) -> LoRA | None:
    """The config's `LoRA`, or None with `lora.rank` 0; a ConfigError names a bad key."""
    settings = config.lora
    rank = settings.rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ConfigError(
            f"lora.rank must be an integer >= 0 (0: no LoRA), got {rank!r}; set --config.lora.rank"
        )
    if rank == 0:
        return None
    return LoRA(
        rank=settings.rank,
        alpha=settings.alpha,
        dropout=settings.dropout,
        targets=settings.targets,
    )


def get_config() -> ml_collections.ConfigDict:
    """The defaults as an experiment: what `--config=<this file>` loads."""
    return default_config()


_POSITIVE_INTS = (
    "global_batch_size",
    "num_train_steps",
    "grad_accum_steps",
    "log_every",
    "eval_every",
    "spike_window",
    "max_rollbacks",
)
_NON_NEGATIVE = (
    "eval_batch_size",
    "checkpoint_every",
    "warmup_steps",
    "weight_decay",
    "grad_clip_norm",
    "peak_flops_per_device",
    "profile_start_step",
    "profile_num_steps",
)
# Real-valued keys with a bounded range: (low, high, whether high itself is allowed).
_RANGES = {
    "min_lr_ratio": (0.0, 1.0, True),
    "adam_b1": (0.0, 1.0, False),  # a decay of 1 never forgets; optax divides by 1 - b^t = 0
    "adam_b2": (0.0, 1.0, False),
    "momentum": (0.0, 1.0, False),
}
NAN_POLICIES = ("halt", "skip", "rollback")
_MAX_SEED = 2**63 - 1  # jax.random.key takes a signed 64-bit seed

_DATA_MINIMUMS = {
    "seq_len": 1,
    "image_size": 1,
    "threads": 1,
    "workers": 0,
    "device_prefetch": 1,
    "num_classes": 0,
}


def _is_finite_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def validate(config: ml_collections.ConfigDict) -> None:
    """Raises ConfigError, naming the key and the fix, for the first bad value found."""
    missing = [key for key in default_config() if key not in config]
    if missing:
        raise ConfigError(
            f"config lacks {', '.join(missing)}; "
            "start get_config() from jddp.run.config.default_config()"
        )
    for key in _POSITIVE_INTS:
        value = config[key]
        if not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"{key} must be a positive integer, got {value!r}; set --config.{key}"
            )
    for key in _NON_NEGATIVE:
        if not _is_finite_number(config[key]) or config[key] < 0:
            raise ConfigError(
                f"{key} must be a finite number >= 0, got {config[key]!r}; set --config.{key}"
            )
    hang = config.hang_timeout_s
    if hang is not None and (not _is_finite_number(hang) or hang < 0):
        raise ConfigError(
            f"hang_timeout_s must be a finite number >= 0 (0: off), or unset (adaptive), got "
            f"{hang!r}; set --config.hang_timeout_s"
        )
    if not _is_finite_number(config.learning_rate) or config.learning_rate <= 0:
        raise ConfigError(
            f"learning_rate must be a finite number > 0, got {config.learning_rate!r}; set "
            "--config.learning_rate"
        )
    for key, (low, high, high_allowed) in _RANGES.items():
        value = config[key]
        if (
            not _is_finite_number(value)
            or not low <= value <= high
            or (value == high and not high_allowed)
        ):
            interval = f"[{low:g}, {high:g}{']' if high_allowed else ')'}"
            raise ConfigError(f"{key} must be in {interval}, got {value!r}; set --config.{key}")
    seed = config.seed
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= _MAX_SEED:
        # Checked here, not first in trainer.init: by then the workdir would exist.
        raise ConfigError(
            f"seed must be an integer from 0 to 2**63 - 1, got {seed!r}; set --config.seed"
        )
    if config.nan_policy not in NAN_POLICIES:
        raise ConfigError(
            f"nan_policy must be one of {', '.join(NAN_POLICIES)}, got {config.nan_policy!r}"
        )
    if config.nan_policy == "rollback" and config.checkpoint_every <= 0:
        raise ConfigError(
            "nan_policy=rollback restores checkpoints: set --config.checkpoint_every above 0"
        )
    if not (config.spike_factor == 0 or config.spike_factor > 1):
        raise ConfigError(
            f"spike_factor must be 0 (off) or above 1, got {config.spike_factor!r}; set "
            "--config.spike_factor"
        )
    if config.max_to_keep < 1:
        raise ConfigError(f"max_to_keep must be >= 1, got {config.max_to_keep}")
    if not isinstance(config.log.writers, str):
        raise ConfigError(
            f"log.writers must be a string of comma-separated names, got {config.log.writers!r}"
        )
    check_writers(config.log.writers, "log.writers")
    if lora_of(config) and config.parallel.sequence_parallel:
        raise ConfigError(
            "lora does not run under parallel.sequence_parallel yet (the adapters would see "
            "one rank's part of the sequence); set --config.parallel.sequence_parallel=False"
        )
    for key, low in _DATA_MINIMUMS.items():
        value = config.data.get(key, low)
        if not isinstance(value, int) or value < low:
            raise ConfigError(
                f"data.{key} must be an integer >= {low}, got {value!r}; set --config.data.{key}"
            )
