"""Context parallelism on 8 simulated devices: the compiled peak per device as the context axis
grows with the sequence held fixed, and the longest sequence that fits a fixed budget.

    python -m experiments.bench.context [--seq 1024] [--repeats 3] [--steps 2] [--out bench_results]

A GPT of 2 layers x 128 (4 heads, vocabulary 256, rotary positions: no parameter grows with the
sequence), AdamW, zero3 on `data:8/C,context:C` for C = 1, 2, 4, 8: one sequence per data rank
(global batch 8 / C), so every context group holds the same rows, one sequence, and each device
L / C of its tokens. Parameters and optimizer state are replicated over both axes: the same on
every device whatever C. C = 1 is the same code on a ring of one (`data:8,context:1`).

Part 1 (the sequence fixed at `--seq`): per variant (`ring`, `all_gather` attention), the state
and the compiled step's peak per device (XLA's memory analysis), the peak against C = 1's next to
1 / C, the same for the peak less the state (what context parallelism divides), the bytes the
context collectives move per device per step (collective-permutes for the ring, all-gathers for
all_gather, from the compiled HLO), and tokens/s (windows of `--steps` steps, every variant's
interleaved, medians of `--repeats`; against C = 1 as the median over rounds of the paired
step-time ratio, over C: a step of C holds 1 / C of the tokens).

Part 2 (the budget fixed: C = 1's ring peak at `--seq`): for each C and variant the longest
sequence, a multiple of 2C, whose compiled step fits the budget, found by doubling then
bisection (to within 1/64 of it) over compiled memory analyses only; and its ratio to C = 1's.
Draws both parts and the tokens/s to `--picture` (`--from_json OUT/context.json` redraws it
without measuring).
"""

import argparse
import json
import os

import jax
import numpy as np
import optax

import jddp
from experiments.bench import common
from jddp.models import GPT
from jddp.observe.hlo import collective_ops
from jddp.observe.memory import peak_bytes, state_bytes_per_device
from jddp.parallel.strategies import device_mesh_for
from jddp.run.objectives import OBJECTIVES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LM = OBJECTIVES["language_model"]
DEVICES, LAYERS, WIDTH, HEADS, VOCAB = 8, 2, 128, 4, 256
CONTEXTS = (1, 2, 4, 8)
ATTENTIONS = ("ring", "all_gather")
SEARCH_RESOLUTION = 64  # bisection stops within 1/64 of the longest length


def make_trainer(context: int, attention: str, seq: int):
    mesh = device_mesh_for("zero3", f"data:{DEVICES // context},context:{context}", jax.devices())
    model = GPT(
        VOCAB,
        num_layers=LAYERS,
        num_heads=HEADS,
        embed_dim=WIDTH,
        max_seq_len=seq,
        positions="rotary",
        context_axis=mesh.context_axis,
        context_attention=attention,
    )
    return jddp.Trainer(
        model,
        LM.loss_fn,
        optax.adamw(1e-3),
        input_key="inputs",
        strategy="zero3",
        mesh=mesh,
        log_grad_norm=False,
    )


def token_batch(context: int, seq: int) -> dict:
    rows = DEVICES // context  # one sequence per data rank
    tokens = np.random.default_rng(0).integers(0, VOCAB, (rows, seq + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def compiled_step(trainer, batch):
    """The step compiled for `batch`'s shapes (nothing is computed)."""
    state = trainer.abstract_state(batch)
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    return trainer.strategy.lower_train_step(state, trainer.strategy.abstract_batch(shapes))


def peak_at(context: int, attention: str, seq: int) -> int:
    trainer = make_trainer(context, attention, seq)
    return peak_bytes(compiled_step(trainer, token_batch(context, seq)).compile())


def context_bytes(hlo_text: str) -> int:
    """Bytes one device's context collectives receive per step: the ring's collective-permutes,
    all_gather's all-gathers (zero3 over data and context gathers no parameter)."""
    kinds = ("collective-permute", "all-gather")
    return sum(
        op.executions * sum(op.sizes)
        for op in collective_ops(hlo_text)
        if op.kind in kinds and (op.groups is None or len(op.groups[0]) > 1)  # C = 1's are no-ops
    )


def longest_fitting(context: int, attention: str, budget: int, start: int) -> tuple[int, int]:
    """(the longest multiple of 2C whose step's peak fits `budget`, compiles run)."""
    quantum = 2 * context
    compiles = 0

    def fits(seq):
        nonlocal compiles
        compiles += 1
        return peak_at(context, attention, seq) <= budget

    low = max(quantum, start // quantum * quantum)
    if not fits(low):
        high = low
        while not fits(low := max(quantum, low // 2 // quantum * quantum)):
            high = low
            if low == quantum:
                return 0, compiles
    else:
        high = 2 * low
        while fits(high):
            low, high = high, 2 * high
    while high - low > max(quantum, low // SEARCH_RESOLUTION):
        middle = (low + high) // 2 // quantum * quantum
        if middle in (low, high):
            break
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, compiles


def plot(document: dict, path: str) -> None:
    """Three panels: the peak against C (the sequence fixed), the longest sequence in the budget
    against C, and tokens/s against C."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    rows, budget_rows = document["rows"], document["budget_rows"]
    contexts = np.array(CONTEXTS)
    figure, (peak, longest, speed) = plt.subplots(1, 3, figsize=(15, 4))
    for attention, marker in zip(ATTENTIONS, "os", strict=True):
        mine = [r for r in rows if r["attention"] == attention]
        peak.plot(contexts, [r["peak_MiB"] for r in mine], marker=marker, label=attention)
        speed.plot(contexts, [r["tokens_per_s"] for r in mine], marker=marker, label=attention)
        mine = [r for r in budget_rows if r["attention"] == attention]
        longest.plot(contexts, [r["longest_seq"] for r in mine], marker=marker, label=attention)
    ring = [r for r in rows if r["attention"] == "ring"]
    peak.plot(contexts, ring[0]["peak_MiB"] / contexts, "k--", label="ring C=1 / C")
    peak.axhline(ring[0]["state_MiB"], color="grey", linestyle=":", label="state (replicated)")
    peak.set(yscale="log", ylabel="MiB per device")
    peak.set_title(f"compiled peak per device, sequence {document['seq']}")
    base = budget_rows[0]["longest_seq"]
    longest.plot(contexts, base * contexts, "k--", label="C x ring C=1")
    longest.set(yscale="log", ylabel="tokens")
    longest.set_title(f"longest sequence in {budget_rows[0]['budget_MiB']:.0f} MiB per device")
    speed.set(ylim=(0, None), ylabel="tokens/s (8 simulated devices, 2 cores)")
    speed.set_title(f"throughput, sequence {document['seq']}")
    for ax in (peak, longest, speed):
        ax.set_xscale("log")
        ax.set_xticks(contexts, [str(c) for c in CONTEXTS])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("context size C (mesh data:8/C,context:C)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024, help="the fixed sequence length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed window")
    parser.add_argument("--attention", default=",".join(ATTENTIONS), help="ring,all_gather")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--picture", default=os.path.join(REPO, "docs", "context.png"))
    parser.add_argument("--from_json", help="draw the picture from a context.json; measure nothing")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            plot(json.load(f), args.picture)
        print(f"wrote {args.picture}")
        return
    attentions = tuple(a for a in args.attention.split(",") if a)
    if any(a not in ATTENTIONS for a in attentions) or args.seq % (2 * max(CONTEXTS)):
        common._fail(f"--attention takes {ATTENTIONS}; --seq a multiple of {2 * max(CONTEXTS)}")
    common.check_output_folder(args.out)
    common.check_output_folder(os.path.dirname(os.path.abspath(args.picture)))
    jax.config.update("jax_num_cpu_devices", DEVICES)

    # Part 1: the sequence fixed.
    runs, rows = {}, []
    for attention in attentions:
        for context in CONTEXTS:
            name = f"{attention} C={context}"
            trainer = make_trainer(context, attention, args.seq)
            batch = token_batch(context, args.seq)
            state = trainer.init(seed=0, sample_batch=batch)
            placed = trainer.place_batch(batch)
            compiled = trainer.strategy.lower_train_step(state, placed.arrays).compile()
            runs[name] = [trainer, state, placed]
            rows.append(
                {
                    "attention": attention,
                    "C": context,
                    "mesh": f"data:{DEVICES // context},context:{context}",
                    "state_MiB": state_bytes_per_device(state) / 2**20,
                    "peak_MiB": peak_bytes(compiled) / 2**20,
                    "context_MiB_per_step": context_bytes(compiled.as_text()) / 2**20,
                }
            )
    for row in rows:
        first = next(r for r in rows if r["attention"] == row["attention"] and r["C"] == 1)
        row["peak_vs_C1"] = row["peak_MiB"] / first["peak_MiB"]
        row["one_over_C"] = 1 / row["C"]
        row["above_state_vs_C1"] = (row["peak_MiB"] - row["state_MiB"]) / (
            first["peak_MiB"] - first["state_MiB"]
        )
    windows = common.trainer_windows(runs, args.steps)
    common.warm_up(windows)
    timings = common.interleaved_medians(windows, args.repeats)
    for row in rows:
        name = f"{row['attention']} C={row['C']}"
        tokens = DEVICES // row["C"] * args.seq * args.steps
        row["tokens_per_s"] = tokens / timings[name]["median_sec"]
        # A step of C carries 1 / C of C = 1's tokens: the paired step-time ratio over C.
        first = f"{row['attention']} C=1"
        row["tokens_per_s_vs_C1"] = common.paired_ratio(timings, name, first) / row["C"]
    del runs, windows

    # Part 2: the budget fixed.
    budget = peak_at(1, "ring", args.seq)
    budget_rows = []
    for attention in attentions:
        for context in CONTEXTS:
            longest, compiles = longest_fitting(context, attention, budget, args.seq * context)
            budget_rows.append(
                {
                    "attention": attention,
                    "C": context,
                    "budget_MiB": budget / 2**20,
                    "longest_seq": longest,
                    "compiles": compiles,
                }
            )
            print(f"budget {budget / 2**20:.1f} MiB, {attention} C={context}: {longest} tokens")
    for row in budget_rows:
        first = next(r for r in budget_rows if r["attention"] == row["attention"] and r["C"] == 1)
        row["vs_C1"] = row["longest_seq"] / first["longest_seq"] if first["longest_seq"] else 0.0

    extra = {
        "model": f"GPT {LAYERS}x{WIDTH}, {HEADS} heads, vocab {VOCAB}, rotary",
        "seq": args.seq,
        "devices": DEVICES,
        "budget_rows": budget_rows,
        "repeats": args.repeats,
        "steps": args.steps,
    }
    if attentions == ATTENTIONS:
        plot({"rows": rows, **extra}, args.picture)
        print(f"wrote {args.picture}")
    common.report("context", rows, extra, args.out)


if __name__ == "__main__":
    main()
