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
