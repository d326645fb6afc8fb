"""What the calibration times (`python -m experiments.calibrate`).

    matmul rate     the best of a few 2048^3 float32 matmuls through XLA: the whole machine's
                    rate, which the simulated devices share (`shared_compute`)
    memory          DRAM bandwidth from a large elementwise add into a buffer the process holds
                    (what the optimizer update and a step's non-matmul ops pay)
    intra-host      what an all-reduce, all-gather, reduce-scatter and collective-permute
                    among the in-process simulated devices (XLA:CPU) adds to a step, timed
                    between the calibration GPT's blocks as a step runs them, a few sizes
                    each, over all the devices and over pairs; bandwidth, latency per ring
                    step and overhead per op fitted to the ring formulas of
                    jddp/planner/network.py
    inter-host      the same over 2 processes x 2 devices, gloo between them (started with
                    jddp.runtime.launch on 127.0.0.1): what crosses "hosts" when a job runs as
                    several processes (every collective of such a job, on XLA:CPU)
    matmul shapes   every device at once through matmuls whose smallest dimension is 32 to
                    512: the rate by that dimension, relative to the widest (a tensor split
                    narrows a small model's projections; the planner weights each matmul by it)
    efficiency      a small GPT trained by every simulated device at once, each its own copy
                    with no communication: the model FLOPs over (step time less the memory-bound
                    time the planner predicts: non-matmul ops, optimizer) x the matmul rate;
                    again with the layers stacked and scanned (as pipeline stages run them):
                    the ratio is the profile's `stacked_layers_slowdown`

On a shared machine every number moves with the load: calibrate in the same run as what you
compare against (experiments/bench/planner.py does).
"""

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

SIZES = (2**16, 2**18, 2**20, 2**22)  # bytes per device: a small model's parameters
REPEATS = 5
# Collectives are timed between blocks of the calibration GPT (see `collective_seconds`), as
# many as a step of it has, on its tokens spread over the devices measured.
REPEATS_BETWEEN = 7
# Matmul rates by their smallest dimension d: (rows, wide) @ (wide, d) @ (d, wide) per device.
SHAPE_DIMS, SHAPE_OPERAND = (32, 64, 128, 256, 512), (2048, 512)
GLOO_PROCESSES, GLOO_DEVICES_PER_PROCESS = 2, 2  # devices share the cores, as in a job
# Collectives are timed over groups of all the devices and of this many (neighbours in the
# device order: a process's own pair in the gloo job): two ring lengths separate the latency
# per ring step from the overhead per op.
PAIR = 2
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")
CALIBRATION_GPT = dict(num_layers=4, num_heads=8, embed_dim=256, max_seq_len=128)
CALIBRATION_VOCAB, CALIBRATION_BATCH = 1024, 32  # rows over all devices


def _seconds(fn, repeats: int = REPEATS) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after one that compiles and warms up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _median_seconds(fn, repeats: int = REPEATS) -> float:
    return statistics.median(_seconds(fn, repeats))


def memory_bandwidth(megabytes: int = 64) -> float:
    """Bytes/s of `memory_stream`, the best of `REPEATS` passes after a warm-up: a stream's rate
    is its best, a slower repeat measures what else ran (a median can read 9 GB/s where the
    best reads 40)."""
    stream, bytes_per_pass = memory_stream(megabytes)
    return bytes_per_pass / min(_seconds(stream))


def memory_stream(megabytes: int = 64):
    """(stream, bytes): `stream()` computes `c = a + b` over float32 arrays of `megabytes`,
    written into the same `c` every pass (3 arrays' traffic; `a + a` reads one, a third less
    than it counts). A fresh output each pass would land, for several passes or, under
    glibc's own settings (a 64 MiB buffer is always mmapped), for every one, on pages fresh
    from the OS, and measure the page faults instead (16,384 a pass: 0.4-2 GB/s where the
    memory gives ~37)."""
    import jax
    import jax.numpy as jnp

    n = megabytes * 2**20 // 4
    a, b, c = (jax.device_put(jnp.full((n,), v, jnp.float32), jax.devices()[0]) for v in (1, 2, 0))
    # `out` is donated and unread: XLA writes the sum into its buffer (without keep_unused,
    # jit drops the unused argument and nothing is aliased).
    add_into = jax.jit(lambda x, y, out: x + y, donate_argnums=2, keep_unused=True)

    def stream():
        nonlocal c
        c = add_into(a, b, c).block_until_ready()
        return c

    return stream, 3 * n * 4


def collective_seconds(devices, group: int, sizes=SIZES) -> dict[str, dict[int, float]]:
    """{kind: {bytes per device: seconds}}: what one all-reduce, all-gather, reduce-scatter or
    collective-permute over groups of `group` neighbouring `devices` adds to a step (every
    process calls this with the same global devices). Timed as a step runs them
    (`between_blocks`), less the same blocks without a collective, over the number of blocks.
    On XLA:CPU a collective's copies, gloo's sockets and the thread hand-offs run on the cores
    the compute uses, so it costs more in a step than on idle devices (gloo's 64 KB all-reduce
    between 2 processes x 2 devices: 0.4 ms alone, 2-5 ms between blocks), and the planner
    predicts steps. Windows interleaved, medians."""
    import jax

    mesh = group_mesh(devices, group)
    inputs = block_inputs(mesh)  # one set for every program
    programs = {None: between_blocks(mesh, None, group, inputs)}
    for kind in COLLECTIVES:
        for size in sizes:  # elements divisible by the group: the scatter
            programs[kind, size] = between_blocks(mesh, kind, size // 4 // group * group, inputs)
    runs = {
        key: lambda step=step, args=args: jax.block_until_ready(step(*args))
        for key, (step, args) in programs.items()
    }
    seconds = _interleaved_medians(runs)
    blocks_alone = seconds.pop(None)
    out = {kind: {} for kind in COLLECTIVES}
    for (kind, size), median in seconds.items():
        out[kind][size] = max((median - blocks_alone) / CALIBRATION_GPT["num_layers"], 0.0)
    return out


def _collective(kind: str, x, group: int):
    """`kind` over the mesh axis "x" of `group` devices (inside shard_map)."""
    from jax import lax

    if kind == "all-reduce":
        return lax.psum(x, "x")
    if kind == "all-gather":
        return lax.all_gather(x, "x", tiled=True)
    if kind == "reduce-scatter":
        return lax.psum_scatter(x, "x", tiled=True)
    ring = [(i, (i + 1) % group) for i in range(group)]  # a pipeline's send to the next stage
    return lax.ppermute(x, "x", ring)


def group_mesh(devices, group: int):
    """`devices` in groups of `group` neighbours: the mesh axes ("groups", "x")."""
    from jax.sharding import Mesh

    return Mesh(np.asarray(devices).reshape(-1, group), ("groups", "x"))


def block_inputs(mesh) -> tuple:
    """(activations, *kernels) on every device of `mesh`: its share of the calibration GPT's
    tokens and one block's kernels (`_block`)."""
    rows = CALIBRATION_BATCH * CALIBRATION_GPT["max_seq_len"] // mesh.size
    width = CALIBRATION_GPT["embed_dim"]
    return _per_device(mesh, rows, width), *(_per_device(mesh, *s) for s in _block_shapes(width))


def between_blocks(mesh, kind: str | None, elements: int, inputs: tuple):
    """(step, args): `step(*args)` is one step of every device of `mesh` (`group_mesh`)
    running the calibration GPT's blocks (their norms, projections and MLP; attention's
    products left out) on `inputs` (`block_inputs`), with a collective of `kind` over
    `elements` float32 per device after each block (None: none) over the mesh's axis "x". The
    collective's input depends on the block and the next block on its result, as in a step:
    XLA would combine independent ones into one op (its all-reduce combiner merged the 4 into
    one tuple all-reduce, which timed each at a quarter of an op), and a tensor-parallel step's
    activation reductions cannot be combined."""
    import jax
    from jax.sharding import PartitionSpec as P

    group = mesh.shape["x"]

    def run_blocks(v, x, *w):
        v, x, w = v[0], x[0], [k[0] for k in w]
        for _ in range(CALIBRATION_GPT["num_layers"]):
            x = _block(x, *w)
            if kind is not None:
                x = x + _collective(kind, v + x[0, 0], group)[0]
        return x[None]

    every = P(mesh.axis_names)
    step = jax.jit(
        jax.shard_map(run_blocks, mesh=mesh, in_specs=every, out_specs=every, check_vma=False)
    )
    return step, (_per_device(mesh, elements), *inputs)


def _block_shapes(width: int) -> list[tuple[int, int]]:
    """The kernels of one calibration GPT block: qkv, out, the MLP's fc and proj."""
    return [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)]


def _block(x, qkv, out, fc, proj):
    """A GPT block's work without attention's products: norm, projections, norm, MLP."""
    import jax

    def norm(y):
        centered = y - y.mean(-1, keepdims=True)
        return centered * jax.lax.rsqrt((centered**2).mean(-1, keepdims=True) + 1e-6)

    x = x + (norm(x) @ qkv)[:, : x.shape[-1]] @ out
    return x + jax.nn.gelu(norm(x) @ fc) @ proj


def _per_device(mesh, *shape):
    """A float32 array of `shape` on each device of `mesh` (stacked along all its axes)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    local = np.full((len(mesh.local_devices), *shape), 0.01, np.float32)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P(mesh.axis_names)), local)


def _interleaved_medians(runs: dict) -> dict:
    """{key: median seconds of `runs[key]()`}: each compiled and warmed up, then timed in
    `REPEATS_BETWEEN` rounds that take every run in turn (the machine's drift hits them all)."""
    times = {key: [] for key in runs}
    for run in runs.values():
        run()
    for _ in range(REPEATS_BETWEEN):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            run()
            times[key].append((time.perf_counter() - start) / 2)
    return {key: statistics.median(t) for key, t in times.items()}


def matmul_shape_rates(devices) -> tuple[tuple[int, float], ...]:
    """((d, rate), ...) for each d of `SHAPE_DIMS`: every device at once runs the forward and
    backward of `(rows, wide) @ (wide, d)`, tanh, `@ (d, wide)` (a layer's projections split
    over tensor); the rate in FLOP/s relative to that at the widest d. Interleaved windows,
    medians."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("x",))
    rows, wide = SHAPE_OPERAND

    def loss(x, a, b):
        return jax.numpy.sum(jax.numpy.tanh(x @ a) @ b)

    def grads(x, a, b):
        return jax.tree.map(lambda g: g[None], jax.grad(loss, (0, 1, 2))(x[0], a[0], b[0]))

    step = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = _per_device(mesh, rows, wide)
    runs = {}
    for d in SHAPE_DIMS:
        a, b = _per_device(mesh, wide, d), _per_device(mesh, d, wide)
        runs[d] = lambda a=a, b=b: jax.block_until_ready(step(x, a, b))
    rates = {d: d / t for d, t in _interleaved_medians(runs).items()}  # FLOPs: linear in d
    return tuple((d, rates[d] / rates[SHAPE_DIMS[-1]]) for d in SHAPE_DIMS)


class GptCopies(NamedTuple):
    run: Callable[[], None]  # one step of every copy, finished when it returns
    workload: Any  # the planner's view of the same training
    compiled_text: Callable[[], str]  # the step's compiled HLO (what one device runs)


def gpt_copies_step(devices, scan_layers: bool = False) -> GptCopies:
    """Every device of `devices` training its own copy of the calibration GPT (see
    `gpt_efficiency`)."""
    import jax
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jddp.core.task import jit_init
    from jddp.losses import token_cross_entropy
    from jddp.models import GPT
    from jddp.planner.workload import model_workload

    n, seq = len(devices), CALIBRATION_GPT["max_seq_len"]
    model = GPT(CALIBRATION_VOCAB, **CALIBRATION_GPT, scan_layers=scan_layers)
    optimizer = optax.adamw(1e-3)
    rows = max(1, CALIBRATION_BATCH // n) * n
    tokens = np.random.default_rng(0).integers(0, CALIBRATION_VOCAB, (rows, seq + 1))
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}

    def init():
        params = model.init(jax.random.key(0), batch["inputs"][:1])["params"]
        return params, optimizer.init(params)

    def own_step(params, opt_state, rows):  # one device's copy: no collective anywhere
        def loss(p):
            return token_cross_entropy(model.apply({"params": p}, rows["inputs"]), rows).mean()

        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    mesh = Mesh(np.asarray(devices), ("x",))
    per_device = NamedSharding(mesh, P("x"))
    copies = jit_init(
        lambda: jax.tree.map(lambda x: jax.numpy.stack([x] * n), init()), out_shardings=per_device
    )
    unstacked = jax.shard_map(
        lambda state, rows: jax.tree.map(
            lambda x: x[None], own_step(*jax.tree.map(lambda x: x[0], state), rows)
        ),
        mesh=mesh,
        in_specs=(P("x"), P("x")),
        out_specs=P("x"),
    )
    step = jax.jit(unstacked, donate_argnums=0)
    # Each process places the rows of its own devices: the copies may span a job's processes.
    per_copy = rows // n
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    local = {
        k: np.concatenate([v[i * per_copy : (i + 1) * per_copy] for i in mine])
        for k, v in batch.items()
    }
    placed = {
        k: jax.make_array_from_process_local_data(per_device, v, batch[k].shape)
        for k, v in local.items()
    }
    holder = [copies]

    def run():
        holder[0] = step(holder[0], placed)
        jax.block_until_ready(holder[0])

    def compiled_text() -> str:
        return step.lower(holder[0], placed).compile().as_text()

    workload = model_workload(model, batch["inputs"][:1], rows, optimizer, min_shard_size=1)
    return GptCopies(run, workload, compiled_text)
