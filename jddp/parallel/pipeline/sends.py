"""What the stages send each other at the end of every tick, and the inboxes where it waits:
activations forward and cotangents back, one `ppermute` each; with chunks (repeats > 1) around
a ring, the last stage's output going on to the first stage's next chunk, cotangents the other
way."""

import jax.numpy as jnp
from jax import lax


def ring(stages: int, repeats: int) -> list[tuple[int, int]]:
    """(source, destination) of the forward sends: each stage to the next, and with chunks the
    last to the first."""
    return [(i, i + 1) for i in range(stages - 1)] + ([(stages - 1, 0)] if repeats > 1 else [])


def exchange(send_forward, send_backward, busy, axis: str, pairs):
    """(what arrives from the previous stage, what arrives from the next) over `axis`, sent once
    both sends are computed (`after_each_other`; `busy` is true)."""
    send_forward, send_backward = after_each_other(send_forward, send_backward, busy)
    received_forward = lax.ppermute(send_forward, axis, pairs)
    received_backward = lax.ppermute(send_backward, axis, [(j, i) for i, j in pairs])
    return received_forward, received_backward


def after_each_other(a, b, always):
    """(a, b), each computed only once both are: `always` is true, but only known at run time.

    A send is a rendezvous with the neighbour that holds its thread until the neighbour
    arrives. Issued as soon as its own value is ready, a stage's forward send would wait there
    for the neighbour's forward while the stage's own backward waits for a thread (XLA:CPU runs
    every device's operations on one pool of a thread per core): a stage running a forward and its
    neighbour a backward in one tick, 1F1B's every steady tick, would take turns instead of
    running at once. `lax.optimization_barrier` orders nothing here: XLA:CPU schedules by
    the buffers an operation reads, and the barrier's outputs are its inputs' buffers. Kept on
    every platform: elsewhere it costs two selects."""
    return jnp.where(always, a, b), jnp.where(always, b, a)


def inbox(shape, slots: int, fill):
    """An inbox of `slots` slots of `shape` (a ShapeDtypeStruct) holding `fill`, and a spare
    slot last, which takes what is stored when nothing arrives (`stored`)."""
    return jnp.full((slots + 1, *shape.shape), fill, shape.dtype)


def stored(buffer, slot, value, store):
    """`buffer` with `value` at `slot` where `store`, else at the spare slot."""
    return buffer.at[jnp.where(store, slot, buffer.shape[0] - 1)].set(value)
