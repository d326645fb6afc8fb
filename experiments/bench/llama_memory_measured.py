"""Measured bytes per device of a full fine-tune against LoRA on 8 simulated CPU devices, beside
the planner's prediction for the same config and layout: the measured side of llama_memory.

    python -m experiments.bench.llama_memory_measured [--out bench_results]

The model is Llama 3.2 1B's shape scaled down to compile in seconds on a 2-core CPU (4 layers,
width 256, 8 query and 2 key/value heads, Llama 3's rotary scaling, tied embeddings, vocabulary
4,096), written as a config.json that the recipes `llama_chat_sft` (full) and `llama_chat_lora`
(rank 16 on every projection) point `init_from` at, with llama_memory's stand-ins for the chat
file; sequences of 128 tokens, global batch 16. For each layout (zero3 `fsdp:8`,
`data:2,fsdp:2,tensor:2`, `stage:2,fsdp:4`) the trainer the CLI would build is initialized and
placed (random weights: the bytes depend on the shapes alone) and its step compiled, nothing
trained. Per device (the first):
- params / optimizer: bytes of the placed state's addressable shards;
- grads: bytes of the trainable parameters' shards (the gradient takes their layout; XLA does not
  report it apart: it lives in the step's temporaries);
- peak / temp: the compiled step's peak and temporaries by XLA's memory_analysis;
- the planner's params, grads, optimizer state and total (state + activations + what zero3
  gathers) for the same config and layout (`jddp.planner.search.plan_row`), and measured /
  predicted (the total against the compiled peak).
"""

import argparse
import json
import os
import sys
import tempfile

if __name__ == "__main__":  # before jax is imported: the 8 devices this benchmark measures on
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

from experiments.bench.llama_memory import COMMON, LLAMA3_ROPE, RECIPES, recipe_config

DEVICES = 8
SMALL_LLAMA = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
    max_position_embeddings=2048, rope_scaling=LLAMA3_ROPE | {"factor": 32.0},
)  # fmt: skip
SEQ_LEN, GLOBAL_BATCH = 128, 16
LAYOUTS = {  # the planner's name of each zero3 layout: its mesh sizes
    "zero3 fsdp:8": dict(fsdp=8),
    "zero3 data:2,fsdp:2,tensor:2": dict(data=2, fsdp=2, tensor=2),
    "zero3 stage:2,fsdp:4": dict(stage=2, fsdp=4),
}
KIB = 2**10


def small_config(recipe: str, checkpoint: str):
    """`recipe`'s config for the small model at this benchmark's batch, model_args completed
    from its config.json as the CLI completes them."""
    from jddp.run import factory
    from jddp.run.config import validate

    config = recipe_config(recipe, checkpoint)
    config.data.seq_len = SEQ_LEN
    config.global_batch_size = GLOBAL_BATCH
    validate(config)
    return factory.with_checkpoint_model_args(config)


def measure(config, sizes: dict) -> dict:
    """One device's measured bytes for `config` on the zero3 mesh of `sizes`."""
    import numpy as np

    from jddp.core.lora import split
    from jddp.observe.memory import peak_bytes, state_bytes_per_device
    from jddp.run import factory

    mesh = ",".join(f"{axis}:{n}" for axis, n in sizes.items())
    dataset = factory.dataset_spec(config)
    trainer = factory.build_trainer(config, dataset, strategy="zero3", mesh=mesh)
    sample = factory.sample_batch(config, dataset)
    state = trainer.init(seed=0, sample_batch=sample)
    placed = trainer.place_batch({k: np.repeat(v, GLOBAL_BATCH, axis=0) for k, v in sample.items()})
    compiled = trainer.strategy.lower_train_step(state, placed.arrays).compile()
    trained = split(state.params)[1] if config.lora.rank else state.params
    return {
        "params": state_bytes_per_device(state.params),
        "grads": state_bytes_per_device(trained),
        "optimizer": state_bytes_per_device(state.opt_state),
        "peak": peak_bytes(compiled),  # what Trainer.memory_report reports
        "temp": compiled.memory_analysis().temp_size_in_bytes,
    }


def predict(config, sizes: dict) -> dict:
    """The planner's bytes per device for `config` on the zero3 mesh of `sizes`."""
    from jddp.planner.devices import get_profile
    from jddp.planner.layouts import Layout
    from jddp.planner.search import plan_row
    from jddp.planner.workload import from_config

    profile = get_profile("h100")  # the bytes do not depend on the device; the timing is unused
    row = plan_row(from_config(config), Layout("zero3", **sizes), profile, DEVICES)
    state = sum(row["state_bytes"].values())
    activations = row["activation_bytes"] or 0
    return row["state_bytes"] | {
        "activations": activations,
        "gathered": row["bytes_per_device"] - state - activations,  # what zero3 gathers
        "total": row["bytes_per_device"],
        "layout": row["layout"],
    }


def rows_for(folder: str) -> list[dict]:
    checkpoint = os.path.join(folder, "small-llama")
    os.makedirs(checkpoint)
    with open(os.path.join(checkpoint, "config.json"), "w") as f:
        json.dump(COMMON | SMALL_LLAMA, f)
    rows = []
    for kind, recipe in RECIPES.items():
        config = small_config(recipe, checkpoint)
        for name, sizes in LAYOUTS.items():
            measured, predicted = measure(config, sizes), predict(config, sizes)
            assert predicted["layout"] == name, (predicted["layout"], name)
            row = {"fine-tune": kind, "layout": name}
            for part in ("params", "grads", "optimizer"):
                row[f"{part}_KiB"] = measured[part] / KIB
                row[f"{part}_planned_KiB"] = predicted[part] / KIB
                row[f"{part}_ratio"] = measured[part] / predicted[part]
            row["temp_KiB"] = measured["temp"] / KIB
            row["peak_KiB"] = measured["peak"] / KIB
            row["activations_planned_KiB"] = predicted["activations"] / KIB
            row["gathered_planned_KiB"] = predicted["gathered"] / KIB
            row["total_planned_KiB"] = predicted["total"] / KIB
            row["peak_ratio"] = measured["peak"] / predicted["total"]
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    import jax

    from experiments.bench.common import check_output_folder, report

    check_output_folder(args.out)
    if jax.device_count() != DEVICES:
        sys.exit(f"needs {DEVICES} devices, has {jax.device_count()}: run it as a script")
    with tempfile.TemporaryDirectory() as folder:
        rows = rows_for(folder)
    extra = {"devices": DEVICES, "seq_len": SEQ_LEN, "global_batch": GLOBAL_BATCH}
    report("llama_memory_measured", rows, extra | {"model": SMALL_LLAMA}, args.out)


if __name__ == "__main__":
    main()
