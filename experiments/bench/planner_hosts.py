"""A run a team would launch, planned from one host to 128: GPT-3 6.7B's shape (32 layers x
4,096, 32 heads, 2,048 tokens; Brown et al. 2020, Table 2.1) at its published global batch of
2M tokens (1,024 sequences), on 8 to 1,024 H100s in hosts of 8. For each host count the
best plan that fits over the numbers of gradient-accumulation steps that split the batch: its
layout, step, tokens/s, MFU, and the communication it waits for.

    python -m experiments.bench.planner_hosts [--device h100] [--hosts 1,2,8,32,128]
        [--global_batch 1024] [--json]

Shapes only: nothing is compiled; seconds per host count (minutes for the fewest hosts).
"""

import argparse
import json

HOSTS = (1, 2, 4, 8, 16, 32, 64, 128)
MODEL = {"num_layers": 32, "num_heads": 32, "embed_dim": 4096}  # GPT-3 6.7B


def config_for(global_batch: int, grad_accum_steps: int):
    from experiments.configs import gpt_1b

    config = gpt_1b.get_config()
    config.model_args.update(MODEL)
    config.global_batch_size = global_batch
    config.grad_accum_steps = grad_accum_steps
    config.compute_dtype = "bfloat16"  # what a run on H100s trains in
    return config


def best_plan(hosts: int, profile, global_batch: int) -> dict:
    """The fastest fitting plan on `hosts` hosts, over every power-of-2 number of
    gradient-accumulation steps that splits the batch (what a team tunes before launching)."""
    from jddp.planner import search
    from jddp.planner.workload import from_config

    per_host = profile.devices_per_host
    devices = hosts * per_host
    best = None
    accum = 1
    while accum == 1 or global_batch % (accum * devices) == 0:
        workload = from_config(config_for(global_batch, accum))
        row = search.plan(workload, devices, profile, per_host)[0][0]
        if row["fits"] and (best is None or row["predicted_step_s"] < best["predicted_step_s"]):
            best = row | {"hosts": hosts, "grad_accum_steps": accum}
        accum *= 2
    if best is None:
        raise SystemExit(f"nothing fits on {hosts} hosts at a global batch of {global_batch}")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100")
    parser.add_argument("--hosts", default=",".join(map(str, HOSTS)))
    parser.add_argument("--global_batch", type=int, default=1024)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_platforms", "cpu")
    from jddp.planner.devices import get_profile

    profile = get_profile(args.device)
    rows = [best_plan(int(h), profile, args.global_batch) for h in args.hosts.split(",")]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"GPT 6.7B, {args.global_batch} x 2,048 tokens per step, {profile.name} in hosts of "
        f"{profile.devices_per_host}"
    )
    print(
        "| hosts | GPUs | accumulation | best layout | step | tokens/s | MFU | across hosts "
        "per GPU | exposed comm |"
    )
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        waits = r["exposed_comm_s"] | ({"slowest host": r["sync_s"]} if r["sync_s"] else {})
        comm = ", ".join(f"{a} {s * 1e3:.1f} ms" for a, s in waits.items() if s >= 5e-5)
        print(
            f"| {r['hosts']} | {r['hosts'] * profile.devices_per_host} | {r['grad_accum_steps']} "
            f"| {r['layout']} | {r['predicted_step_s']:.2f} s | "
            f"{r['predicted_tokens_per_s']:,.0f} | {r['predicted_mfu']:.1%} | "
            f"{r['bytes_across_hosts'] / 1e9:.2f} GB | {comm or '-'} |"
        )


if __name__ == "__main__":
    main()
