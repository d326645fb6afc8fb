"""Host memory of importing a Hugging Face checkpoint: jddp's lazy import, each device's shard
of each tensor read alone (`jddp.checkpoints.hf.load`), against reading every tensor whole first.

    python -m experiments.bench.hf_import [--dir DIR] [--repeats 2] [--tiny]

The checkpoint: a random Llama of 1.1B parameters (Llama-3.2-1B's layers: hidden 2048, 16
layers, 32 heads, 8 key/value heads, MLP 8192; vocabulary 32,000, untied), float32 (4.4 GB),
written without PyTorch as `save_pretrained` lays it out: 1 GB safetensors shards, their
`model.safetensors.index.json` and `config.json`. It goes into --dir (default: a folder in the
temporary directory) and is reused when already there. `--tiny`: a 2-layer toy, for a check
that the benchmark runs.

Method. Each import runs in a fresh process with 8 simulated devices (whose memory is the
process's host memory): the jddp model from `hf.create_model(DIR)`, a `jddp.Trainer` under zero3
(mesh fsdp:8, `optax.sgd`), and `trainer.abstract_state` (shapes and shardings only: nothing is
allocated). Right before the import the process gives the free memory malloc keeps back to the
OS (`malloc_trim`, so the import cannot reuse it unseen) and its resident memory is the
baseline; then the parameters are imported into that abstract state's shardings:

- `lazy`: `hf.load(trainer, abstract_state, DIR)`: each device's shard of a tensor read alone
  through safetensors' `get_slice` and copied to its device before the next is read.
- `whole`: every file read whole with `safetensors.numpy.load_file`, then placed with
  `trainer.replace_state` (what an importer without lazy reads does).

What the import holds beyond its own result = peak - baseline - the bytes of the placed shards
(every device's, replicated tensors counted once per device), compared with the largest tensor.
Two peaks are reported. `anon`: anonymous memory (RssAnon), sampled from /proc/PID/status by this
parent process every millisecond (the kernel keeps no peak of it). `RSS`: the kernel's exact peak
resident set (VmHWM), which also counts the checkpoint's file pages that safetensors maps: page
cache the kernel can drop, touched once, and mapped until the import closes its files, so they
make the RSS peak include the whole checkpoint whatever the import holds. Like every jddp entry
point, the imports keep freed host memory for reuse (jddp/runtime/host_memory.py), so the peaks
include free memory the allocator keeps; after the import (host copies dropped) the process
reports that (`kept_by_malloc`) and what is left beyond its shards once `malloc_trim` gives it
back (`left_after_trim`: what the import leaked). Before each import the checkpoint's pages
are dropped from the page cache (posix_fadvise), so "read GB" (/proc/PID/io read_bytes) is what
it read from disk. Variants alternate, order reversed every round; time is the median, memory
the largest of the rounds. Both variants must place the same parameters (a per-tensor checksum).
"""

import argparse
import gc
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from experiments.bench import common
from jddp.run.cli import fail
from jddp.runtime import host_memory

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 2**20
SAMPLE_SEC = 0.001
VARIANTS = ("lazy", "whole")
# Llama-3.2-1B's layer dimensions with a 32k vocabulary (Llama 2's), untied: 1.10B parameters.
LLAMA_1B = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 32000,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
}
SHARD_BYTES = {"full": 10**9, "tiny": 10**5}  # several shards, as a larger model's would be
START, DONE = "importing", "imported"  # the child's markers around the measured import


# ------------------------------------------------------------------------- the checkpoint
def hf_config(dims: dict) -> dict:
    """config.json as transformers writes it for a LlamaForCausalLM of `dims`."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **dims,
        "head_dim": dims["hidden_size"] // dims["num_attention_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
    }


def hf_shapes(dims: dict) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a LlamaForCausalLM's state dict (nn.Linear weights (out, in))."""
    hidden, mlp, vocab = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    kv = dims["num_key_value_heads"] * hidden // dims["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(dims["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (hidden, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, hidden),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.mlp.gate_proj.weight": (mlp, hidden),
            f"{layer}.mlp.up_proj.weight": (mlp, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, mlp),
        }
    return shapes | {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}


def write_checkpoint(path: str, dims: dict, shard_bytes: int) -> None:
    """A random Llama of `dims` in save_pretrained's sharded layout, one shard in memory at a
    time; written beside `path` and renamed at the end, so a present `path` is complete."""
    from safetensors.numpy import save_file

    shapes = hf_shapes(dims)
    shards, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = 4 * int(np.prod(shape))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    partial = f"{path.rstrip(os.sep)}.partial"
    os.makedirs(partial, exist_ok=True)
    rng = np.random.default_rng(0)
    files = [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    for file, names in zip(files, shards, strict=True):
        tensors = {}
        for name in names:
            tensor = rng.standard_normal(shapes[name], dtype=np.float32)
            tensor *= 0.02
            if name.endswith("norm.weight"):
                tensor += 1.0
            tensors[name] = tensor
        save_file(tensors, os.path.join(partial, file), metadata={"format": "pt"})
        del tensors
    weight_map = {name: file for file, names in zip(files, shards, strict=True) for name in names}
    total = sum(4 * int(np.prod(s)) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    with open(os.path.join(partial, "config.json"), "w") as f:
        json.dump(hf_config(dims), f, indent=2, sort_keys=True)
    os.rename(partial, path)


def ensure_checkpoint(path: str, dims: dict, shard_bytes: int) -> None:
    """Writes the checkpoint unless `path` already holds one of `dims`; anything else there,
    or a failed write, ends the benchmark in one line."""
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        try:
            with open(config) as f:
                written = json.load(f)
            found = {k: written.get(k) for k in dims}
        except (OSError, ValueError, AttributeError):
            found = "an unreadable config.json"
        if found == dims:
            print(f"reusing the checkpoint in {path}")
            return
        fail(f"--dir {path!r} holds another model ({found}); pass a new --dir")
    if os.path.exists(path):
        fail(f"--dir {path!r} exists and holds no checkpoint; pass a new --dir")
    start = time.perf_counter()
    try:
        write_checkpoint(path, dims, shard_bytes)
    except OSError as e:
        fail(f"cannot write the checkpoint to {path!r}: {e.strerror}; pass another --dir")
    print(f"wrote the checkpoint to {path} in {time.perf_counter() - start:.0f} s")


def tensor_sizes(path: str) -> dict[str, int]:
    """{tensor name: bytes}, from the safetensors headers."""
    from safetensors import safe_open

    sizes = {}
    for file in sorted(checkpoint_files(path)):
        with safe_open(file, "np") as f:
            for name in f.keys():
                sizes[name] = 4 * int(np.prod(f.get_slice(name).get_shape()))
    return sizes


def checkpoint_files(path: str) -> list[str]:
    return [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors")]


def drop_from_page_cache(path: str) -> None:
    """Drops the checkpoint's pages from the page cache, so the next import reads from disk."""
    for file in checkpoint_files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a checkpoint just written) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------- one import (child)
def status(pid="self") -> dict[str, int]:
    """Memory figures of /proc/PID/status, in bytes."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                found[key] = int(value.split()[0]) * 1024
    return found


def disk_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def give_back_free_memory() -> None:
    """Returns the free memory malloc keeps (jddp's programs never trim it) to the OS."""
    gc.collect()
    libc = host_memory.glibc()
    if libc is not None:
        libc.malloc_trim(0)


def whole_params(trainer, path: str):
    """Every tensor read whole into host memory, arranged as jddp's parameters."""
    from safetensors.numpy import load_file

    from jddp.checkpoints import hf_models
    from jddp.core.tree_paths import nest_paths

    tensors = {}
    for file in checkpoint_files(path):
        tensors |= load_file(file)
    model = trainer.task.model
    layout = hf_models.BY_MODEL["llama"].tensors(model)
    return tensors, nest_paths({t.path: t.to_jddp(tensors[t.name]) for t in layout})


def child(variant: str, path: str) -> None:
    """One import in this fresh process; prints the markers, then its figures as JSON."""
    import jax
    import jax.numpy as jnp
    import optax

    import jddp
    from jddp.checkpoints import hf
    from jddp.run.objectives import OBJECTIVES

    lm = OBJECTIVES["language_model"]
    model = hf.create_model(path)
    trainer = jddp.Trainer(
        model, lm.loss_fn, optax.sgd(1e-3), input_key="inputs", strategy="zero3", mesh="fsdp:8"
    )
    tokens = np.zeros((8, 16), np.int32)
    abstract = trainer.abstract_state({"inputs": tokens, "targets": tokens})

    # The baseline holds no free memory that the import could reuse unseen.
    give_back_free_memory()
    before, read_before = status(), disk_read_bytes()
    print(START, flush=True)
    start = time.perf_counter()
    host = tree = None
    if variant == "lazy":
        params = hf.load(trainer, abstract, path).params
    else:
        host, tree = whole_params(trainer, path)
        params = trainer.replace_state(abstract, params=tree).params
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    after, read_after = status(), disk_read_bytes()
    print(DONE, flush=True)

    # What stays: the host copies dropped, then the free memory malloc keeps given back.
    del host, tree
    gc.collect()
    released = status()
    give_back_free_memory()
    trimmed = status()

    placed = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    sums = jax.jit(lambda p: [jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(p)])(params)
    figures = {
        "import_sec": seconds,
        "baseline": before,
        "after": after,
        "released": released,
        "trimmed": trimmed,
        "read_bytes": read_after - read_before,
        "placed_bytes": placed,
        "param_count": sum(x.size for x in jax.tree.leaves(params)),
        "checksums": [float(s) for s in sums],
    }
    print(json.dumps(figures), flush=True)


# ------------------------------------------------------------------------- the parent
def run_child(variant: str, path: str) -> dict:
    """Runs one import in a fresh process, sampling its anonymous memory every `SAMPLE_SEC`
    between its markers; returns its figures with "peak_anon" and "samples"."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
    }
    command = [sys.executable, "-m", "experiments.bench.hf_import", f"--child={variant}"]
    process = subprocess.Popen(
        [*command, f"--dir={path}"], cwd=REPO, env=env, stdout=subprocess.PIPE
    )
    out, lines, measuring = b"", [], False
    peak, samples = 0, 0
    while True:
        ready, _, _ = select.select([process.stdout], [], [], SAMPLE_SEC)
        if measuring:
            try:
                peak = max(peak, status(process.pid)["RssAnon"])
                samples += 1
            except (OSError, KeyError):  # the child has exited
                pass
        if ready:
            chunk = os.read(process.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            out += chunk
            *complete, out = out.split(b"\n")
            for line in complete:
                text = line.decode()
                lines.append(text)
                if text in (START, DONE):
                    measuring = text == START
    if process.wait() != 0 or len(lines) < 3 or lines[-3:-1] != [START, DONE]:
        fail(f"the {variant} import failed (exit code {process.returncode}); see above")
    return json.loads(lines[-1]) | {"peak_anon": peak, "samples": samples}


def beyond_shards(run: dict) -> dict[str, int]:
    """Bytes the import held beyond its baseline and the placed shards: at its peak
    (anonymous, and the whole RSS), and after it, its host copies dropped and malloc trimmed."""
    base, placed = run["baseline"], run["placed_bytes"]
    return {
        "anon": run["peak_anon"] - base["RssAnon"] - placed,
        "rss": run["after"]["VmHWM"] - base["VmRSS"] - placed,
        "kept": run["released"]["RssAnon"] - run["trimmed"]["RssAnon"],
        "left": run["trimmed"]["RssAnon"] - base["RssAnon"] - placed,
    }


def row(variant: str, done: list[dict], largest_bytes: int) -> dict:
    """One variant's figures: the median time, the largest memory of its rounds."""
    worst = {k: max(beyond_shards(run)[k] for run in done) for k in ("anon", "rss", "kept", "left")}
    return {
        "import": variant,
        "import_sec": statistics.median(run["import_sec"] for run in done),
        "read_GB": max(run["read_bytes"] for run in done) / 1e9,
        "peak_anon_beyond_MiB": worst["anon"] / MiB,
        "x_largest_tensor": worst["anon"] / largest_bytes,
        "peak_RSS_beyond_MiB": worst["rss"] / MiB,
        "kept_by_malloc_MiB": worst["kept"] / MiB,
        "left_after_trim_MiB": worst["left"] / MiB,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where the checkpoint is written, or reused")
    parser.add_argument("--repeats", type=int, default=2, help="imports of each variant")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer toy model")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = "tiny" if args.tiny else "full"
    path = args.dir or os.path.join(tempfile.gettempdir(), f"jddp-bench-hf-llama-{size}")
    if args.child:
        return child(args.child, path)
    if args.repeats < 1:
        fail(f"--repeats {args.repeats} imports nothing; pass 1 or more")
    common.check_output_folder(args.out)
    ensure_checkpoint(path, TINY if args.tiny else LLAMA_1B, SHARD_BYTES[size])
    sizes = tensor_sizes(path)
    largest = max(sizes, key=sizes.get)

    runs = {variant: [] for variant in VARIANTS}
    for round_index in range(args.repeats):
        for variant in VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]:
            drop_from_page_cache(path)
            runs[variant].append(run_child(variant, path))
            print(f"round {round_index + 1}: {variant} imported", flush=True)
    checksums = {v: r[0]["checksums"] for v, r in runs.items()}
    if checksums["lazy"] != checksums["whole"]:
        fail("the lazy and the whole import placed different parameters")

    rows = [row(variant, done, sizes[largest]) for variant, done in runs.items()]
    first = runs["lazy"][0]
    extra = {
        "parameters": first["param_count"],
        "checkpoint_GB": sum(sizes.values()) / 1e9,
        "largest_tensor": f"{largest} ({sizes[largest] / MiB:.0f} MiB)",
        "placed_MiB": first["placed_bytes"] / MiB,
        "baseline_anon_MiB": first["baseline"]["RssAnon"] / MiB,
        "min_anon_samples": min(run["samples"] for done in runs.values() for run in done),
        **{
            f"{variant}_by_round": {
                "peak_anon_beyond_MiB": [round(beyond_shards(run)["anon"] / MiB) for run in done],
                "import_sec": [round(run["import_sec"], 1) for run in done],
            }
            for variant, done in runs.items()
        },
        "repeats": args.repeats,
        "checkpoint": path,
    }
    common.report(f"hf_import{'_tiny' if args.tiny else ''}", rows, extra, args.out)


if __name__ == "__main__":
    main()
