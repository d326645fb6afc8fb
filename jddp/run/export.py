"""`jddp-export --format=hf WORKDIR OUT`: the newest checkpoint of a run (any strategy, mesh or
pipeline) written as a Hugging Face model directory, which
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads as it is (a LoRA run's adapters
merged into the kernels). `--format=peft`: a LoRA run's adapters alone, in PEFT's format, which
`peft.PeftModel.from_pretrained(base, OUT)` loads. Also `python -m jddp.run.export`. A mistake
(no checkpoint, a model without a Hugging Face layout, an OUT that is not empty) is one line and
exit code 2, with nothing written."""

import argparse
import os

from jddp.checkpoints.hf import EXPORT_DTYPES
from jddp.errors import CheckpointError, ConfigError, JddpError
from jddp.run.cli import fail, fail_with, parse_amount, quiet_program

FORMATS = ("hf", "peft")


def export_run(
    workdir: str, out: str, *, max_shard_bytes: int, dtype: str = "float32", form: str = "hf"
) -> tuple[str, list[str]]:
    """Writes the newest checkpoint of the run in `workdir` to `out` as a Hugging Face model,
    with the run's tokenizer files and the special token ids and generation config of the
    checkpoint it started from (where they still are); returns (the checkpoint it read, the
    files it copied)."""
    from jddp import models
    from jddp.checkpoints import hf, peft_format, weights
    from jddp.checkpoints.peek import peek_latest
    from jddp.core import lora
    from jddp.run.config import default_config, lora_of

    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(workdir):
        raise CheckpointError(f"{workdir} does not exist; pass the --workdir of a jddp run")
    found = peek_latest(directory)
    if found is None:
        raise CheckpointError(
            f"{workdir} holds no checkpoint; pass the --workdir of a run that saved one "
            "(checkpoint_every > 0)"
        )
    config = found[0].get("config") or {}
    name, args = config.get("model"), dict(config.get("model_args") or {})
    if name not in ("gpt", "llama"):
        raise ConfigError(
            f"{workdir} trained model {name!r}; jddp exports its gpt and llama models to "
            "Hugging Face"
        )
    settings = default_config()
    settings.lora.update(config.get("lora") or {})
    adapters = lora_of(settings)
    if form == "peft" and adapters is None:
        raise ConfigError(
            f"{workdir} trained no LoRA adapters (lora.rank 0); export it with --format=hf"
        )
    hf.check_output(out)
    saved = weights.load_weights(workdir)
    params = saved.params
    args.setdefault("vocab_size", params["token_embed"]["embedding"].shape[0])
    args.pop("scan_layers", None)  # the layout of the layers; Hugging Face has one
    init_from = config.get("init_from") or ""
    model = models.MODELS[name](**args)
    if form == "peft":
        base = hf.directory(init_from) if hf.is_hf(init_from) else ""
        peft_format.save(params, model, adapters, out, base_model=base, dtype=dtype)
        return saved.source, []
    if adapters is not None:
        params = lora.merged(params, adapters.scale)
    copied = hf.save(
        params,
        model,
        out,
        max_shard_bytes,
        like=hf.directory(init_from) if hf.is_hf(init_from) else None,
        tokenizer=(config.get("data") or {}).get("tokenizer") or None,
        dtype=dtype,
    )
    return saved.source, copied


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jddp-export",
        description="Write the newest checkpoint of a jddp run as a Hugging Face model "
        "directory (config.json + safetensors).",
    )
    parser.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help="hf: Hugging Face (LoRA merged); peft: the LoRA adapters alone",
    )
    parser.add_argument("workdir", help="the --workdir of a jddp run")
    parser.add_argument("out", help="a new (or empty) directory to write")
    parser.add_argument(
        "--max_shard_size",
        default="5GB",
        help="safetensors files above this size are split into shards with an index (5GB)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=EXPORT_DTYPES,
        help="the tensors' type on disk (training keeps float32 weights)",
    )
    parser.error = _usage_error
    return parser


def _usage_error(message: str):
    fail(f"{message} (see jddp-export --help)")


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    shard_bytes = int(parse_amount("max_shard_size", args.max_shard_size))
    if shard_bytes < 1:
        fail(f"--max_shard_size={args.max_shard_size!r} must be at least 1 byte; write e.g. 5GB")
    quiet_program()
    try:
        source, copied = export_run(
            args.workdir, args.out, max_shard_bytes=shard_bytes, dtype=args.dtype, form=args.format
        )
    except (JddpError, OSError) as e:  # a mistake (2), or the file system's refusal (75)
        fail_with(e)
    print(f"wrote {args.out} from {source}")
    for file in copied:
        print(f"  with a copy of {file}")


if __name__ == "__main__":
    main()
