"""What a stage keeps of each layer's forward for its backward (the residuals of `jax.vjp`),
and where: the stash, one slot per micro-batch in flight (GPipe: all M; 1F1B: at most S).

A layer's pullback holds its parameters and its residuals. The parameters are every
micro-batch's alike, so only the residuals are stashed (stashed, the parameters would copy the
stage's weights into every slot); the backward rebuilds the pullback from both. What the
residuals are is the `remat` policy's choice (jddp/parallel/pipeline/options.py `REMAT`): by
default each layer's input and matmul outputs, the elementwise work between them recomputed in
the backward. Keeping everything (`none`) makes the stash 3-4 times larger for a GPT block, and
its copies in and out cost more time than the recomputation (docs/benchmarks.md).
"""

import jax
import jax.numpy as jnp
from jax import checkpoint_policies as policies
from jax import lax

# jax.checkpoint's policy for each `remat` (None: no checkpoint, everything is kept).
REMAT_POLICIES = {"dots": policies.dots_saveable, "none": None, "full": policies.nothing_saveable}


class LayerTape:
    """A layer's forward under `jax.vjp` (within jax.checkpoint's `policy`), its pullback split
    into the layer's parameters and the residuals to stash, and the pullback rebuilt from both.
    Every trace of the layer must give the pullback the first trace laid out (`layout`)."""

    def __init__(self, policy):
        self.policy = policy
        # For each pullback leaf, the index of the parameter it is (None: a residual), and the
        # pullback's treedef: from the first trace.
        self.layout = None

    def forward(self, fn, own, x):
        """(y, the residuals to stash, aux) of `fn(own, x) = (y, aux)`: `own` is the layer's
        parameters; the pullback is y's (aux, such as the metrics a layer sowed, has none)."""
        if self.policy is not None:
            fn = jax.checkpoint(fn, policy=self.policy)
        y, pullback, aux = jax.vjp(fn, own, x, has_aux=True)
        ids = {id(p): n for n, p in enumerate(jax.tree.leaves(own))}
        leaves, tree = jax.tree.flatten(pullback)
        which = [ids.get(id(leaf)) for leaf in leaves]
        if self.layout is None:
            self.layout = (which, tree)
        assert self.layout[0] == which, "the pullback's parameters changed between traces"
        return y, [leaf for leaf, n in zip(leaves, which, strict=True) if n is None], aux

    def pullback(self, residuals, own):
        """The layer's pullback from its stashed `residuals` and its parameters `own`."""
        which, tree = self.layout
        own, residuals = jax.tree.leaves(own), iter(residuals)
        leaves = [next(residuals) if n is None else own[n] for n in which]
        return jax.tree.unflatten(tree, leaves)


def choose_tape(remat: str, residual_shapes) -> tuple[LayerTape, list]:
    """(the tape of `remat`'s policy, its residuals' shapes); `residual_shapes(tape)` traces a
    layer through `tape`. The policy only adds recomputation: a layer that keeps less by itself
    (a model's own remat, which an outer policy would override) is left as it is."""

    def traced(policy):
        tape = LayerTape(policy)
        return tape, residual_shapes(tape)

    def nbytes(shapes):
        return sum(r.size * r.dtype.itemsize for r in shapes)

    policy = REMAT_POLICIES[remat]
    if policy is not None and nbytes(traced(policy)[1]) >= nbytes(traced(None)[1]):
        policy = None
    return traced(policy)  # the last trace: the layout every later one must match


def put(buffer, value, *index):
    """`buffer` with `value` at `index` (leading axes), updated in place."""
    start = (*index, *([0] * value.ndim))
    return lax.dynamic_update_slice(buffer, value[(None,) * len(index)], start)


class Stash:
    """A stage's stash: per residual leaf one buffer (slot, layer of the chunk, ...), written by
    a forward one layer at a time and read back by the backward, layer by layer."""

    def __init__(self, tape: LayerTape, shapes, slots: int, layers: int):
        self.tape, self.shapes, self.slots, self.layers = tape, shapes, slots, layers

    def empty(self, fill) -> list:
        """The buffers, every slot holding `fill`."""
        return [jnp.full((self.slots, self.layers, *r.shape), fill, r.dtype) for r in self.shapes]

    def write(self, buffers, residuals, slot, layer) -> list:
        """`buffers` with a layer's `residuals` (from `tape.forward`) at (`slot`, `layer`)."""
        return [put(buf, v, slot, layer) for buf, v in zip(buffers, residuals, strict=True)]

    def read(self, buffers, slot, layer) -> list:
        """The residuals at (`slot`, `layer`)."""
        return [buf[slot, layer] for buf in buffers]
