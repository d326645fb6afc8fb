"""How gradients cross devices: exactly in float32, as bfloat16 on the wire, or compressed with
PowerSGD. `GradComm` is the per-device side of every strategy's gradient reduction.

float32 (default): the exact mean, as `jddp/parallel/collectives.py` computes it.

bfloat16: each device rounds its gradient to bfloat16 once and the values cross devices as
bfloat16 (2 bytes), in one of two implementations (`collectives`, chosen once per strategy from
the devices' platform; jddp/parallel/collectives.py):

- `native` (GPU, TPU): XLA's own bfloat16 `psum` and `psum_scatter`, which NCCL and TPUs run on
  bfloat16 buffers; the runtime sums in bfloat16 or wider.
- `cpu` (XLA:CPU): XLA:CPU rewrites bfloat16 all-reduce, reduce-scatter and even all-to-all and
  all-gather into float32 ones moving 4 bytes a value (compiled HLO, jax 0.10.2), so the values
  travel as uint16 bit patterns, which cross untouched: a reduce-scatter is an all-to-all (each
  device receives its slice of every device's gradient) and a float32 sum; an all-reduce is
  that, the sums rounded to bfloat16 once more, and an all-gather.

The error bound of the `cpu` path (and of `native` on XLA:CPU, which sums the promoted values in
float32), per entry, with m and a the mean and the mean absolute value of the N devices' float32
values, u = 2^-8 (bfloat16's unit roundoff) and e = 2^-24 (float32's):
    reduce-scatter  |result - m| <= u*a + 2*N*e*a + e*|m|
    all-reduce      |result - m| <= u*(a + |m|) + (u^2 + 2*N*e)*a + 2*e*|m|
(input rounding u*a; N-1 float32 additions; one more rounding u*|sum| for the all-reduce; the
final division by N). hybrid's all-reduce of per-group reduce-scatters rounds once more: u*a more;
so does `native`'s reduce-scatter, whose result is bfloat16. A runtime that adds in bfloat16
(NCCL's ring) rounds each partial sum: up to (N-1)*u*a more, as PyTorch's bf16 compress hook.

PowerSGD (Vogels et al., 2019; PyTorch's `powerSGD_hook`): a gradient viewed as an m x n matrix
(outputs x inputs, as PyTorch views its weights; see `matrix_shape`) plus the device's error
feedback, M = g + e, crosses devices as two all-reduced means instead of itself: P = mean(M Q),
orthonormalized, then Q = mean(M^T P); the update uses P Q^T and each device keeps
e = M - P Q^T. Q starts random and is warm-started from the previous step. A tensor is compressed
only when r(m+n) times MIN_COMPRESSION_RATE is below mn (vectors, biases and small matrices go
uncompressed, in the same all-reduce as the P factors). Since P and Q are means, a step depends on
the per-device errors only through their mean: the devices keep their own errors while training
(their mean would take the full all-reduce PowerSGD avoids), and `TrainState.comm_state` holds
the mean whenever it leaves the strategy (checkpoints, host copies), which restores exactly onto
any device count.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jddp.core.tree_paths import nest_paths, path_str
from jddp.errors import ConfigError
from jddp.parallel.collectives import (
    check_collectives,
    fused_pmean,
    gather,
    resolve_collectives,
    scatter_sum,
    spans_devices,
)

GRAD_COMM_DTYPES = ("float32", "bfloat16")
GRAD_COMPRESSIONS = ("none", "powersgd")
MIN_COMPRESSION_RATE = 2.0  # PyTorch's default: compress when it moves under half the values
_TINY = float(jnp.finfo(jnp.float32).tiny)


def _by_path(tree) -> dict:
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def matrix_shape(shape) -> tuple[int, int] | None:
    """A gradient of `shape` as PowerSGD sees it, (outputs, inputs): the last dimension of a
    Flax kernel (Dense (in, out), conv (h, w, in, out)) by all the others, as PyTorch views its
    (out, in, ...) weights. The orientation decides which factor is warm-started: Q, over the
    inputs. (Stored and computed on transposed, in the kernel's own layout: see `_powersgd`.)"""
    if len(shape) < 2:
        return None
    return shape[-1], math.prod(shape[:-1])


@dataclasses.dataclass(frozen=True)
class GradComm:
    """How a strategy averages gradients across devices (see the module docstring).

    `collectives` is "auto" until `on(devices)` resolves it to "cpu" or "native" (strategies do,
    once, when they are built), with `spans_processes` then whether the devices do."""

    dtype: str = "float32"
    compression: str = "none"
    powersgd_rank: int = 4
    powersgd_start_step: int = 0
    collectives: str = "auto"
    spans_processes: bool = False

    def __post_init__(self):
        check_collectives(self.collectives)
        if self.dtype not in GRAD_COMM_DTYPES:
            raise ConfigError(
                f"parallel.grad_comm_dtype must be one of {', '.join(GRAD_COMM_DTYPES)}, "
                f"got {self.dtype!r}"
            )
        if self.compression not in GRAD_COMPRESSIONS:
            raise ConfigError(
                f"parallel.grad_compression must be one of {', '.join(GRAD_COMPRESSIONS)}, "
                f"got {self.compression!r}"
            )
        for key in ("powersgd_rank", "powersgd_start_step"):
            value, low = getattr(self, key), int(key == "powersgd_rank")
            if not isinstance(value, int) or value < low:
                raise ConfigError(
                    f"parallel.{key} must be an integer >= {low}, got {value!r}; "
                    f"set --config.parallel.{key}"
                )
        if self.powersgd and self.dtype != "float32":
            raise ConfigError(
                "parallel.grad_compression=powersgd sends its small factors in float32; "
                "set parallel.grad_comm_dtype=float32 (or grad_compression=none for bfloat16)"
            )

    @property
    def powersgd(self) -> bool:
        return self.compression == "powersgd"

    def on(self, devices) -> "GradComm":
        """This configuration for a strategy over `devices`: `collectives` resolved for their
        platform (see jddp/parallel/collectives.py)."""
        return dataclasses.replace(
            self,
            collectives=resolve_collectives(self.collectives, devices),
            spans_processes=len({d.process_index for d in devices}) > 1,
        )

    @property
    def bit_patterns(self) -> bool:
        """Whether bfloat16 crosses as uint16 bit patterns (XLA:CPU: see the module docstring)."""
        return self._resolved() == "cpu" and self.dtype == "bfloat16"

    @property
    def flat_buffers(self) -> bool:
        """Whether small tensors cross processes packed into flat buffers (gloo pays per
        buffer: `collectives.fused_pmean`); XLA's tuple all-reduce otherwise."""
        return self._resolved() == "cpu" and self.spans_processes

    def _resolved(self) -> str:
        """The choice `on` made; unresolved (a GradComm used outside a strategy), the default
        backend's."""
        if self.collectives == "auto":
            return resolve_collectives("auto", jax.devices()[:1])
        return self.collectives

    def compressed_rank(self, shape) -> int:
        """The rank a gradient of `shape` is compressed to; 0: it is reduced uncompressed."""
        matrix = matrix_shape(shape)
        if not self.powersgd or matrix is None:
            return 0
        m, n = matrix
        rank = min(m, n, self.powersgd_rank)
        return rank if rank * (m + n) * MIN_COMPRESSION_RATE < m * n else 0

    # --------------------------------------------------------------------------- state
    def init_state(self, params, key: jax.Array) -> dict:
        """The comm_state to start from: {} without PowerSGD; else per compressed parameter a
        random Q (inputs x r) and a zero mean error, transposed (inputs x outputs), under its
        path."""
        if not self.powersgd:
            return {}
        q, error = {}, {}
        for index, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
            rank = self.compressed_rank(leaf.shape)
            if rank:
                m, n = matrix_shape(leaf.shape)
                name = path_str(path)
                q[name] = jax.random.normal(jax.random.fold_in(key, index), (n, rank))
                error[name] = jnp.zeros((n, m), jnp.float32)
        return {"q": nest_paths(q), "error": nest_paths(error)}

    # ---------------------------------------------------- inside a per-device program
    def mean(self, grads, extras, comm_state, axes, step):
        """(gradients averaged over `axes` as configured, `extras` averaged exactly in float32,
        the next comm_state). Extras are metrics and model state; with float32 gradients they
        share one all-reduce."""
        if self.powersgd and comm_state:
            compressed = lambda: self._powersgd(grads, extras, comm_state, axes)  # noqa: E731
            if self.powersgd_start_step == 0:
                return compressed()

            def exact():
                return (*self.pmean((grads, extras), axes), comm_state)

            return lax.cond(step < self.powersgd_start_step, exact, compressed)
        if self.dtype == "bfloat16":
            return self._pmean_bf16(grads, axes), self.pmean(extras, axes), comm_state
        grads, extras = self.pmean((grads, extras), axes)
        return grads, extras, comm_state

    def pmean(self, tree, axes):
        """The exact float32 mean of `tree`'s float leaves over `axes` (metrics, model state),
        packed into flat buffers where this choice does (`flat_buffers`)."""
        return fused_pmean(tree, axes, flat_buffers=self.flat_buffers)

    def _pmean_bf16(self, tree, axes):
        """`pmean` with bfloat16 on the wire."""
        if not self.bit_patterns:
            return fused_pmean(tree, axes, pmean_bf16_native)
        return fused_pmean(tree, axes, pmean_bf16, flat_buffers=self.flat_buffers)

    def psum(self, x, axes):
        """`lax.psum(x, axes)` in this dtype."""
        if not spans_devices(axes):
            return x
        if self.dtype != "bfloat16":
            return lax.psum(x, axes)
        return psum_bf16(x, axes) if self.bit_patterns else psum_bf16_native(x, axes)

    def scatter_sum(self, x, spec: P):
        """`collectives.scatter_sum` in this dtype."""
        if self.dtype != "bfloat16":
            return scatter_sum(x, spec)
        reduce_scatter = _reduce_scatter_bf16 if self.bit_patterns else _reduce_scatter_native
        for dim, axes in enumerate(spec):
            if spans_devices(axes):
                x = reduce_scatter(x, axes, dim)
        return x

    def gather(self, x, spec: P):
        """`collectives.gather` whose gradient (a reduce-scatter) is in this dtype (ZeRO-3)."""
        if self.dtype != "bfloat16":
            return gather(x, spec)

        @jax.custom_vjp
        def gathered(x):
            return gather(x, spec)

        gathered.defvjp(
            lambda x: (gather(x, spec), None), lambda _, g: (self.scatter_sum(g, spec),)
        )
        return gathered(x)

    def _powersgd(self, grads, extras, comm_state, axes):
        """PowerSGD on M^T, the kernel's own layout (inputs x outputs), so that no large matrix
        is ever transposed: XLA:CPU copies a transpose, and runs M^T-style products (contracting
        a large matrix's leading dimension into a small result with a transposed layout) 5-25x
        slower than the same bytes read the other way (2048 x 2048). The same program on every
        platform: nothing here is slower elsewhere for it."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
        qs, errors = _by_path(comm_state["q"]), _by_path(comm_state["error"])
        names = [path_str(path) for path, _ in leaves]
        transposed = {  # M^T = (g + e)^T
            name: g.reshape(errors[name].shape) + errors[name]
            for name, (_, g) in zip(names, leaves, strict=True)
            if name in qs
        }
        rest = [g for name, (_, g) in zip(names, leaves, strict=True) if name not in qs]
        # One all-reduce: the uncompressed tensors, the extras and every P (as P^T = Q^T M^T;
        # the barrier keeps XLA from laying the product out transposed for the QR below).
        ps = {
            name: lax.optimization_barrier(_t_matmul(qs[name], m)) for name, m in transposed.items()
        }
        rest, extras, ps = self.pmean((rest, extras, ps), axes)
        ps = {name: lax.optimization_barrier(orthonormal_columns(p.T)) for name, p in ps.items()}
        # The second: every Q = M^T P.
        qs = self.pmean({name: m @ ps[name] for name, m in transposed.items()}, axes)
        approx = {name: qs[name] @ ps[name].T for name in transposed}  # (P Q^T)^T
        rest = iter(rest)
        out = [
            approx[name].reshape(g.shape) if name in approx else next(rest)
            for name, (_, g) in zip(names, leaves, strict=True)
        ]
        errors = {name: m - approx[name] for name, m in transposed.items()}
        new_state = {"q": nest_paths(qs), "error": nest_paths(errors)}
        return jax.tree.unflatten(jax.tree.structure(grads), out), extras, new_state


def _t_matmul(a, b):
    """a^T b, contracting the leading dimensions."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())))


def orthonormal_columns(p):
    """An orthonormal basis of the columns of `p` (m x r, r <= m, r small): Gram-Schmidt with
    every projection done twice ("twice is enough": orthogonal to float32 precision even when
    `p` has rank below r, as when a gradient's rank is below r; a single pass normalizes
    rounding noise that is not orthogonal and sends back gradients 30-100% wrong). An all-zero
    column stays zero. Not `jnp.linalg.qr`: XLA:CPU's QR of 2048 x 16 takes 150 ms a device on 8
    simulated devices (and r small makes this cheap on any platform)."""
    columns = []
    for i in range(p.shape[1]):
        column = p[:, i]
        if columns:
            basis = jnp.stack(columns, axis=1)
            for _ in range(2):
                column = column - basis @ (column @ basis)
        columns.append(column / jnp.maximum(jnp.linalg.norm(column), _TINY))
    return jnp.stack(columns, axis=1)


# --------------------------------------- bfloat16 as bit patterns (XLA:CPU, gloo: `cpu`)
def _to_wire(x):
    return lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def _from_wire(bits):
    return lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)


def _sum_received(x, axes, count: int):
    """Rows of `x` (count, ...) go to device i; returns the float32 sum of the rows this device
    received. The rows are added one by one: XLA:CPU runs a reduce over the leading axis of the
    converted values 10x slower than these elementwise adds."""
    # Each destination's rows converted on their own: XLA:CPU splits an all-to-all's operand
    # into one buffer per destination anyway, so converting the whole operand first would be one
    # more pass over the gradient.
    wire = jnp.concatenate([_to_wire(x[row : row + 1]) for row in range(count)])
    received = lax.all_to_all(wire, axes, 0, 0, tiled=True)
    total = _from_wire(received[0])
    for row in range(1, count):
        total = total + _from_wire(received[row])
    return total


def _reduce_scatter_bf16(x, axes, dim: int):
    """`lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)` with bfloat16 on the wire
    and a float32 sum."""
    count = lax.axis_size(axes)
    moved = jnp.moveaxis(x, dim, 0)
    rows = moved.reshape(count, moved.shape[0] // count, *moved.shape[1:])
    return jnp.moveaxis(_sum_received(rows, axes, count), 0, dim)


def psum_bf16(x, axes):
    """`lax.psum(x, axes)` with bfloat16 on the wire: all-to-all, float32 sum, all-gather."""
    count = lax.axis_size(axes)
    flat = x.ravel()
    padded = jnp.pad(flat, (0, -flat.size % count))
    mine = _sum_received(padded.reshape(count, -1), axes, count)
    full = _from_wire(lax.all_gather(_to_wire(mine), axes, tiled=True))
    return full[: flat.size].reshape(x.shape)


def pmean_bf16(values, axes):
    """The mean of `values` (a list of arrays, or one flat buffer) with `psum_bf16`."""
    count = lax.axis_size(axes)
    return jax.tree.map(lambda x: psum_bf16(x, axes) / count, values)


# ------------------------------------------------- bfloat16, XLA's own (GPU, TPU: `native`)
def psum_bf16_native(x, axes):
    """`lax.psum(x, axes)` of `x` rounded to bfloat16: one all-reduce of bfloat16 buffers."""
    return lax.psum(x.astype(jnp.bfloat16), axes).astype(x.dtype)


def pmean_bf16_native(values, axes):
    """The mean of `values` with bfloat16 all-reduces, one per tensor, which XLA combines."""
    count = lax.axis_size(axes)
    summed = lax.psum(jax.tree.map(lambda x: x.astype(jnp.bfloat16), values), axes)
    return jax.tree.map(lambda s, x: s.astype(x.dtype) / count, summed, values)


def _reduce_scatter_native(x, axes, dim: int):
    """`lax.psum_scatter` of `x` rounded to bfloat16: one reduce-scatter of bfloat16 buffers."""
    summed = lax.psum_scatter(x.astype(jnp.bfloat16), axes, scatter_dimension=dim, tiled=True)
    return summed.astype(x.dtype)
