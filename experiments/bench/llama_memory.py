"""The planner's memory per device for chat fine-tuning Llama 3.2 1B, Llama 3.1 8B and Llama 3.1
70B on 8 x 80 GB GPUs: the full fine-tune (`llama_chat_sft`) against LoRA (`llama_chat_lora`).

    python -m experiments.bench.llama_memory [--devices 8] [--device h100] [--out bench_results]

Nothing is downloaded or compiled: each model's config.json is written from its published
values (vocabulary 128,256; layers, width, heads, key/value heads, MLP width, Llama 3.1's rotary
scaling; tied embeddings for 3.2 1B) into a temporary folder, and the recipe's config points
`init_from` at it (the planner reads only config.json), with its batch (32 sequences of 2,048
tokens), remat and bfloat16 compute. The planner's own dataset stands in for the chat file
(`shakespeare_char`, loss on every token): the memory depends on the shapes, not on the text.
Rows: the recipe's layout (zero3 over every device), with one device's parameters, gradients,
optimizer state, activations and the parameters zero3 gathers for the step, and the planner's
best layout.
"""

import argparse
import json
import os
import tempfile

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_ROPE["original_max_position_embeddings"] = 8192
COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
}
MODELS = {  # the published config.json of each (meta-llama on the Hugging Face Hub)
    "Llama 3.2 1B": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        rope_scaling=LLAMA3_ROPE | {"factor": 32.0},
    ),
    "Llama 3.1 8B": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        rope_scaling=LLAMA3_ROPE | {"factor": 8.0},
    ),
    "Llama 3.1 70B": dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        rope_scaling=LLAMA3_ROPE | {"factor": 8.0},
    ),
}  # fmt: skip
RECIPES = {"full": "llama_chat_sft", "LoRA": "llama_chat_lora"}
GIB = 2**30


def recipe_config(recipe: str, checkpoint: str):
    """The example config `recipe` with its model from `checkpoint`'s config.json and the
    planner's built-in text in place of the chat file."""
    import importlib

    config = importlib.import_module(f"experiments.configs.{recipe}").get_config()
    config.init_from = f"hf:{checkpoint}"
    config.dataset = "shakespeare_char"
    config.data.tokenizer = ""
    config.data.loss_on = "all"
    config.data.eval_fraction = 0.0
    return config


def plan_rows(devices: int, device: str, folder: str) -> list[dict]:
    from jddp.planner import search
    from jddp.planner.devices import get_profile
    from jddp.planner.workload import from_config
    from jddp.run.config import validate

    profile = get_profile(device)
    recipe_layout = f"zero3 fsdp:{devices}"
    rows = []
    for model, shape in MODELS.items():
        checkpoint = os.path.join(folder, model.replace(" ", "-"))
        os.makedirs(checkpoint, exist_ok=True)
        with open(os.path.join(checkpoint, "config.json"), "w") as f:
            json.dump(COMMON | shape, f)
        for kind, recipe in RECIPES.items():
            config = recipe_config(recipe, checkpoint)
            validate(config)
            workload = from_config(config)
            planned, _ = search.plan(
                workload, devices, profile, min(devices, profile.devices_per_host)
            )
            best = planned[0]
            (ours,) = [r for r in planned if r["layout"] == recipe_layout]
            state = ours["state_bytes"]
            parts = state["params"] + state["grads"] + state["optimizer"]
            parts += ours["activation_bytes"]
            rows.append(
                {
                    "model": model,
                    "fine-tune": kind,
                    "layout": recipe_layout,
                    "params_GiB": state["params"] / GIB,
                    "grads_GiB": state["grads"] / GIB,
                    "optimizer_GiB": state["optimizer"] / GIB,
                    "activations_GiB": ours["activation_bytes"] / GIB,
                    # zero3 gathers the whole model at the step's start: the rest of the total
                    "gathered_GiB": (ours["bytes_per_device"] - parts) / GIB,
                    "total_GiB": ours["bytes_per_device"] / GIB,
                    "fits": ours["fits"],
                    "best_layout": best["layout"],
                    "best_GiB": best["bytes_per_device"] / GIB,
                    "best_fits": best["fits"],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--device", default="h100")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    import jax

    jax.config.update("jax_platforms", "cpu")  # shapes only: no accelerator is needed
    from experiments.bench.common import check_output_folder, report

    check_output_folder(args.out)
    with tempfile.TemporaryDirectory() as folder:
        rows = plan_rows(args.devices, args.device, folder)
    extra = {"devices": args.devices, "device": args.device, "seq_len": 2048, "global_batch": 32}
    report("llama_memory", rows, extra, args.out)


if __name__ == "__main__":
    main()
