"""Per-layer and stacked parameter layouts, and conversion between them, so that checkpoints
move between pipelined (stacked) runs and plain ones.

A model's blocks are either per layer, `block_0/...`, `block_1/...` (GPT's default), or stacked
along a leading layer axis under `blocks/...` (`scan_layers`, and always under a `stage` axis).
The conversion applies wherever those names appear in a state: parameters, and the optimizer's
moments that mirror them.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PER_LAYER, STACKED = "block_", "blocks"
_PER_LAYER_KEY = re.compile(rf"^{PER_LAYER}(\d+)$")


def is_stacked(shapes: dict[str, tuple]) -> bool:
    """Whether a `{path: shape}` dict (jddp.checkpoints.store.shapes_by_path) holds stacked
    blocks."""
    return any(f"/{STACKED}/" in f"/{path}" for path in shapes)


def per_layer_shapes(shapes: dict[str, tuple]) -> dict[str, tuple]:
    """`shapes` with every stacked `blocks/...` entry of shape (L, ...) written as L per-layer
    entries `block_{i}/...` (for comparing a checkpoint with a model in the other layout)."""
    out = {}
    for path, shape in shapes.items():
        marker = f"/{STACKED}/"
        if marker not in f"/{path}":
            out[path] = tuple(shape)
            continue
        head, tail = f"/{path}".split(marker, 1)
        for i in range(shape[0]):
            out[f"{head}/{PER_LAYER}{i}/{tail}".lstrip("/")] = tuple(shape[1:])
    return dict(sorted(out.items()))


def _stack(leaves):
    first = leaves[0]
    if hasattr(first, "stacked"):  # parameters read when indexed (jddp.checkpoints.hf_files)
        return first.stacked(leaves)
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = first.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, P(None, *sharding.spec))
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
    if isinstance(first, np.ndarray):
        return np.stack(leaves)
    return jnp.stack(leaves)


def _unstack(leaf, num_layers):
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
        return [jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)] * num_layers
    return [leaf[i] for i in range(num_layers)]


def _convert(tree, to_stacked: bool):
    if isinstance(tree, dict):
        tree = {key: _convert(value, to_stacked) for key, value in tree.items()}
        layers = sorted(
            (int(m.group(1)), key) for key in tree if (m := _PER_LAYER_KEY.match(str(key)))
        )
        if to_stacked and layers:
            stacked = jax.tree.map(
                lambda *leaves: _stack(leaves), *(tree[key] for _, key in layers)
            )
            rest = {k: v for k, v in tree.items() if not _PER_LAYER_KEY.match(str(k))}
            return {**rest, STACKED: stacked}
        if not to_stacked and STACKED in tree:
            leaves, treedef = jax.tree.flatten(tree[STACKED])
            num_layers = leaves[0].shape[0]
            columns = [_unstack(leaf, num_layers) for leaf in leaves]
            per_layer = {
                f"{PER_LAYER}{i}": jax.tree.unflatten(treedef, [c[i] for c in columns])
                for i in range(num_layers)
            }
            rest = {k: v for k, v in tree.items() if k != STACKED}
            return {**rest, **per_layer}
        return tree
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple (optax states)
        return type(tree)(*(_convert(value, to_stacked) for value in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_convert(value, to_stacked) for value in tree)
    if hasattr(tree, "replace") and hasattr(tree, "__dataclass_fields__"):  # TrainState
        names = tree.__dataclass_fields__
        return tree.replace(**{name: _convert(getattr(tree, name), to_stacked) for name in names})
    return tree


def to_stacked(tree):
    """`tree` (arrays, host arrays or ShapeDtypeStructs) with per-layer blocks stacked."""
    return _convert(tree, to_stacked=True)


def to_per_layer(tree):
    """`tree` with stacked blocks split into per-layer entries."""
    return _convert(tree, to_stacked=False)


# ------------------------------------------------------------ interleaved stages (repeats > 1)
# A state keeps its stack in layer order, split over `stage` in consecutive blocks: checkpoints,
# evaluation and exports see the same layout whatever the repeats. With V repeats the L layers
# form V S groups of L / (V S); stage s holds groups s V to s V + V - 1 but runs groups s, s + S,
# ..., s + (V - 1) S. One all-to-all over the stages per step trades them (and one trades their
# gradients back); with V = 1 nothing moves.


def _exchange_tables(stages: int, repeats: int):
    """Static index tables for the trade of layer groups: per stage, which of its held groups
    goes out in each (destination, slot) of the all-to-all (`send`, -1: padding), and where
    each group it runs arrives (`take`: (source, slot) per chunk)."""
    S, V = stages, repeats
    slots_needed = -(-V // S)
    send = -np.ones((S, S, slots_needed), np.int32)
    take = np.zeros((S, V, 2), np.int32)
    for s in range(S):
        used = [0] * S
        for q in range(V):
            group = s * V + q
            dest, chunk = group % S, group // S
            send[s, dest, used[dest]] = q
            take[dest, chunk] = (s, used[dest])
            used[dest] += 1
    return send, take


def run_groups(held, axis: str, stages: int, repeats: int):
    """The layer groups this stage runs, (V, L / (V S), ...) per leaf, from the groups it holds
    (its consecutive L / S layers, per leaf), inside a program manual over `axis`."""
    send, take = _exchange_tables(stages, repeats)
    stage = jax.lax.axis_index(axis)

    def trade(x):
        x = x.reshape(repeats, -1, *x.shape[1:])
        if repeats == 1:
            return x
        outgoing = x[jnp.asarray(np.maximum(send, 0))[stage]]  # (S, slots, group, ...)
        arrived = jax.lax.all_to_all(outgoing, axis, 0, 0)
        source, slot = (jnp.asarray(take[..., i])[stage] for i in (0, 1))
        return arrived[source, slot]

    return jax.tree.map(trade, held)


def held_groups(running, axis: str, stages: int, repeats: int):
    """`run_groups` backwards: per leaf, (V, L / (V S), ...) values of the groups this stage runs
    (their gradients) to (L / S, ...) of the groups it holds."""
    send, take = _exchange_tables(stages, repeats)
    stage = jax.lax.axis_index(axis)
    # Where each (destination, slot) of the forward trade came from, as a chunk of the receiver.
    back = -np.ones_like(send)
    for t in range(stages):
        for chunk, (source, slot) in enumerate(take[t]):
            back[t, source, slot] = chunk

    def trade(x):
        if repeats > 1:
            chunks = jnp.asarray(back)[stage]  # (S, slots): which chunk goes to each source
            outgoing = jnp.where(
                (chunks >= 0).reshape(*chunks.shape, *[1] * (x.ndim - 1)),
                x[jnp.maximum(chunks, 0)],
                0,
            )
            arrived = jax.lax.all_to_all(outgoing, axis, 0, 0)  # [dest, slot] as sent
            q = np.arange(repeats)
            groups = stage * repeats + q
            sent = jnp.asarray(send)[stage]  # (S, slots) -> held group index or -1
            # held group q went to destination (s V + q) % S at the slot where `send` put it
            dest = groups % stages
            slot = jnp.argmax(sent[dest] == q[:, None], axis=1)
            x = arrived[dest, slot]
        return x.reshape(-1, *x.shape[2:])

    return jax.tree.map(trade, running)
