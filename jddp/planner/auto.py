"""`auto` in the planner: what XLA's SPMD partitioner moves when jddp gives it zero3's layout
and one `jax.jit` over the global batch (jddp/parallel/auto.py), and the collectives that
follow.

The rule, read off the compiled programs (jax 0.10, Shardy): where the batch-split activations
meet a weight split over `fsdp` along another dimension, the partitioner keeps the split of the
larger of the two tensors, global sizes compared, and moves the smaller one; on a tie the dot's
(or lookup's) first operand keeps its split (Shardy's aggressive propagation: "prefer the
factor with the larger source tensor", ties by operand index).

- A dense kernel [fan_in, fan_out] against its input rows (the global micro-batch x tokens x
  fan_in, in the compute dtype): kernel <= input: the kernel is gathered over fsdp and its
  gradient reduced, zero3's way; kernel > input: the activations move instead. Measured on the
  MLP 784-1024-1024-10 on fsdp:8, data:2,fsdp:4 and data:4,fsdp:2: both hidden kernels switch
  exactly where the global batch reaches 1,024 rows (128 per device on fsdp:8: the input, 1024
  x 784 floats, equals the first kernel). The output layer (no kernel reads its fan_out) is
  gathered whatever the sizes: the labels split its output rows before any weight is weighed
  (the MLP's 40 KiB head at 1 row per device, whose input is 32 KiB). Other parameters split
  over fsdp (convolutions, embeddings) are gathered.
- A transformer decides once, at the token embedding: the table against the global token ids
  (int32; the table keeps its split on a tie). Ids larger: every weight is gathered. Table at
  least as large (every real language model at any usual batch): the residual stream stays
  split by features over fsdp and the batch is replicated over it, every weight stays where it
  is and the layers all-reduce activations (`feature_split_collectives`). The tiny GPT on
  fsdp:8 switches between 16 and 17 rows per device (its 64 x 32 float table, 8 KiB, is the
  ids of 16 x 8 sequences of 16 tokens).
  Meshes with a tensor axis gather every weight over fsdp (the tiny GPT on fsdp:4,tensor:2 at
  1 and 16 rows per device), beside Megatron's tensor collectives.

What moving activations costs, per kernel, rows = the global micro-batch / data x tokens (the
rows one fsdp group holds):
    split by columns (fsdp on fan_out)  all-gather of its input rows (rows x fan_in); the
        input gradient reduced over fsdp unless it reads the model's input (no other kernel
        outputs fan_in; the reduction is assumed, no measured model has such a kernel inside);
        its bias's gradient (computed split) all-gathered
    split by rows (fsdp on fan_in)      its partial outputs reduced to the batch split
        (rows x fan_out), their gradient all-gathered back (rows x fan_out)
    gathered while others move         the backward still runs from the local shard: the
        output gradient all-gathered (rows x fan_out), the input gradient all-to-all'd back to
        the batch split (rows x fan_in / fsdp)
The weights' own gradients are then whole on each device: only the data axis sums them (their
shards). Byte for byte the compiled MLP's on all three meshes at 1 to 256 rows per device, and
the feature-split tiny GPT's (tests/test_planner_auto.py).

XLA:CPU has no pass that turns a sum followed by a slice into a reduce-scatter: there (a
profile with `partitioner_reduce_scatter=False`) each such reduce-scatter is an all-reduce of
the whole buffer, as the compiled CPU programs show; GPU and TPU compilers emit the
reduce-scatter.

In the feature-split mode each device keeps activations for its fsdp group's whole batch: the
planner counts them as one device of that batch would (jddp/planner/memory_model.py). Not
modelled: that mode also runs attention and the MLP activation on the whole batch on every
device (compute the planner still splits over all of them); a few small reshards XLA adds on
tensor meshes and around a gathered GPT's small parameters (under 1% of its bytes).
"""

import dataclasses
import functools

from jddp.parallel.rules import axes_of
from jddp.planner.collective import BACKWARD, CRITICAL, FORWARD, Collective, merged
from jddp.planner.layouts import Layout
from jddp.planner.shards import ParamShard, param_shards
from jddp.planner.workload import Workload

GATHER, ACTIVATIONS = "gather", "activations"
TOKEN_TABLE = "token_embed/embedding"
TOKEN_BYTES = 4  # int32 token ids


@dataclasses.dataclass(frozen=True)
class Choice:
    """What the partitioner does with one parameter split over fsdp: `gather` it, or move the
    `activations` it meets instead (global bytes of both, as compared)."""

    path: str
    choice: str
    weight_bytes: int
    activation_bytes: int


def _rows(workload: Workload) -> int:
    """Rows of the global micro-batch the partitioner sees (tokens for a transformer)."""
    return workload.global_batch // workload.grad_accum_steps * workload.tokens_per_example


def _is_kernel(p: ParamShard) -> bool:
    return len(p.shape) == 2 and p.path.endswith("kernel")


def _by_columns(p: ParamShard) -> bool:
    """Whether a kernel is split over fsdp along its output dimension (Megatron's column
    split), not its input one."""
    return len(p.spec) > 1 and "fsdp" in axes_of(p.spec[1])


def choices(workload: Workload, layout: Layout) -> tuple[Choice, ...]:
    """The partitioner's choice for every parameter `layout` splits over fsdp."""
    if layout.fsdp == 1:
        return ()
    return _choices(workload, layout.fsdp, layout.tensor)


@functools.lru_cache(maxsize=1024)
def _choices(workload: Workload, fsdp: int, tensor: int) -> tuple[Choice, ...]:
    shards = param_shards(workload, Layout("auto", fsdp=fsdp, tensor=tensor))
    split = [p for p in shards if p.split_over("fsdp")]
    t = workload.transformer
    if t is not None:
        table = next((p.nbytes for p in shards if p.path == TOKEN_TABLE), 0)
        ids = _rows(workload) * TOKEN_BYTES
        mode = GATHER if tensor > 1 or ids > table else ACTIVATIONS
        return tuple(Choice(p.path, mode, p.nbytes, ids) for p in split)
    fan_ins = {p.shape[0] for p in shards if _is_kernel(p)}
    out = []
    for p in split:
        if _is_kernel(p):
            inputs = _rows(workload) * p.shape[0] * workload.compute_bytes
            # The output layer's rows are split as the labels are before any weight is
            # weighed (Shardy propagates through element-wise ops first): it is gathered.
            output_layer = p.shape[1] not in fan_ins
            choice = GATHER if p.nbytes <= inputs or output_layer else ACTIVATIONS
            out.append(Choice(p.path, choice, p.nbytes, inputs))
        else:
            out.append(Choice(p.path, GATHER, p.nbytes, 0))
    return tuple(out)


def auto_collectives(
    workload: Workload, layout: Layout, reduce_scatter: bool = True
) -> list[Collective]:
    """Every collective of one `auto` step (no stage axis), the tensor axis's Megatron
    collectives excepted (jddp/planner/comm.py adds those). `reduce_scatter=False`: XLA:CPU's
    lowering (module doc)."""
    return list(_auto_collectives(workload, layout, reduce_scatter))


@functools.lru_cache(maxsize=1024)
def _auto_collectives(workload: Workload, layout: Layout, reduce_scatter: bool):
    fsdp, data = ("fsdp",), tuple(a for a in ("data",) if layout.sizes[a] > 1)
    batch = data + (fsdp if layout.fsdp > 1 else ())
    n, tensor = layout.fsdp, layout.tensor
    rows = _rows(workload) // layout.data  # one fsdp group's rows per micro-batch
    accum, cb = workload.grad_accum_steps, workload.compute_bytes
    picked = {c.path: c.choice for c in choices(workload, layout)}
    shards = param_shards(workload, layout)
    out = []

    def add(kind, axes, nbytes, count, phase, what):
        if axes and nbytes:
            out.append(Collective(kind, axes, nbytes, count, phase, what))

    def reduce_to_split(nbytes, count, phase, what):  # a sum over fsdp, kept split
        if reduce_scatter:
            add("reduce-scatter", fsdp, nbytes // n, count, phase, what)
        else:
            add("all-reduce", fsdp, nbytes, count, phase, what)

    moved = ACTIVATIONS in picked.values()
    feature_split = moved and workload.transformer is not None
    if feature_split:
        out += feature_split_collectives(workload, layout)
    fan_outs = {p.shape[1] for p in shards if _is_kernel(p)}
    column_biases = {  # biases of kernels split by columns that move activations
        p.path.removesuffix("kernel") + "bias"
        for p in shards
        if _is_kernel(p)
        and picked.get(p.path) == ACTIVATIONS
        and _by_columns(p)
        and not feature_split
    }

    for p in shards:
        wire = workload.comm_bytes or p.itemsize
        whole = p.elements * wire // (tensor if p.split_over("tensor") else 1)
        choice = picked.get(p.path)
        grads = whole if p.trains else 0  # frozen (LoRA's base): no gradient (`add` skips 0)
        if tensor > 1 and not p.split_over("tensor"):
            # computed from partial sums over tensor, as under zero3 (jddp/planner/comm.py)
            add("all-reduce", ("tensor",), grads // (n if choice else 1), 1, BACKWARD, "grads")
        if choice is None:  # not split over fsdp: its gradient is summed over the batch ...
            if p.path in column_biases:  # ... or, computed split, its shards summed over
                add("all-reduce", data, grads // n, 1, BACKWARD, "gradient shards")  # data
                add("all-gather", fsdp, grads, accum, BACKWARD, "bias gradients")  # and gathered
            else:  # (feature-split, each fsdp group holds its whole batch)
                add("all-reduce", data if feature_split else batch, grads, 1, BACKWARD, "grads")
            continue
        add("all-reduce", data, grads // n, 1, BACKWARD, "gradient shards")
        if choice == GATHER:
            # A tied token table is gathered, and its gradient summed, once per use (HLO);
            # with remat and accumulation assumed as under zero3 (jddp/planner/comm.py).
            t = workload.transformer
            uses = 2 if p.path == TOKEN_TABLE and t is not None and t.tied else 1
            gathers = 2 if workload.regather_in_backward else 1
            add("all-gather", fsdp, whole, uses * gathers, FORWARD, "parameters")
            reduce_to_split(grads, uses * accum, BACKWARD, "gradients")
            if moved and _is_kernel(p) and not feature_split:  # backward from the local shard
                fan_in, fan_out = p.shape
                add("all-gather", fsdp, rows * fan_out * cb, accum, CRITICAL, "activations")
                add("all-to-all", fsdp, rows * fan_in * cb // n, accum, CRITICAL, "activations")
        elif not feature_split:  # (a feature-split transformer's: counted per layer above)
            fan_in, fan_out = p.shape
            if _by_columns(p):  # split by columns: the input rows gathered
                add("all-gather", fsdp, rows * fan_in * cb, accum, CRITICAL, "activations")
                if fan_in in fan_outs:  # not the model's input: its gradient is summed
                    reduce_to_split(rows * fan_in * cb, accum, CRITICAL, "activations")
            else:  # split by rows: partial outputs summed, their gradient gathered
                reduce_to_split(rows * fan_out * cb, accum, CRITICAL, "activations")
                add("all-gather", fsdp, rows * fan_out * cb, accum, CRITICAL, "activations")
    return tuple(merged(out))


def feature_split(workload: Workload, layout: Layout) -> bool:
    """Whether a transformer keeps its features split over fsdp, its batch whole (module doc)."""
    picked = {c.choice for c in choices(workload, layout)}
    return workload.transformer is not None and ACTIVATIONS in picked


def feature_split_collectives(workload: Workload, layout: Layout) -> list[Collective]:
    """A transformer whose residual stream stays split by features over fsdp, the batch whole
    on each device of an fsdp group (rows x tokens = R T), per micro-batch, as the compiled
    tiny GPT shows (1 and 2 layers, byte for byte): the token ids (int32) and the lookup's
    mask (1 byte) gathered; each LayerNorm's mean and variance (2 R T float32) all-reduced,
    forward and backward; forward the attention input projection's (R T qkv) and the MLP's
    first (R T mlp) partial outputs and the logits (R T vocab) all-reduced; backward the
    logits' gradient all-gathered and the MLP's (R T mlp) and attention output's (R T width)
    input gradients all-reduced. A recomputed forward repeats its reductions (assumed)."""
    t = workload.transformer
    fsdp = ("fsdp",)
    tokens = workload.global_batch // (layout.data * workload.grad_accum_steps) * t.seq_len
    cb, accum = workload.compute_bytes, workload.grad_accum_steps
    mlp = (2 if t.gated_mlp else 1) * t.mlp_dim
    norms = 2 * t.layers + 1 if not t.parallel_block else t.layers + 1
    forward = 1 + workload.recompute
    c = functools.partial(Collective, axes=fsdp)
    return [
        c(kind="all-gather", nbytes=tokens * TOKEN_BYTES, count=accum, phase=CRITICAL,
          what="token ids"),
        c(kind="all-gather", nbytes=tokens, count=accum, phase=CRITICAL, what="lookup mask"),
        c(kind="all-reduce", nbytes=2 * tokens * 4, count=norms * (1 + forward) * accum,
          phase=CRITICAL, what="norm statistics"),
        c(kind="all-reduce", nbytes=tokens * t.qkv_columns * cb,
          count=t.layers * forward * accum, phase=CRITICAL, what="activations"),
        c(kind="all-reduce", nbytes=tokens * mlp * cb, count=t.layers * forward * accum,
          phase=CRITICAL, what="activations"),
        c(kind="all-reduce", nbytes=tokens * t.vocab * cb, count=accum, phase=CRITICAL,
          what="logits"),
        c(kind="all-gather", nbytes=tokens * t.vocab * cb, count=accum, phase=CRITICAL,
          what="logits"),
        c(kind="all-reduce", nbytes=tokens * t.mlp_dim * cb, count=t.layers * accum,
          phase=CRITICAL, what="activations"),
        c(kind="all-reduce", nbytes=tokens * t.attention_width * cb, count=t.layers * accum,
          phase=CRITICAL, what="activations"),
    ]  # fmt: skip
