"""Per-layer and stacked parameter layouts, and conversion between them, so that checkpoints
move between pipelined (stacked) runs and plain ones; and the order in which an interleaved
pipeline's stages hold a stack's layers; and taking a stack out of a parameter tree and putting it
back (`split_stack`, `join_stack`).

A model's blocks are either per layer, `block_0/...`, `block_1/...` (GPT's default), or stacked
along a leading layer axis under `blocks/...` (`scan_layers`, and always under a `stage` axis).
The conversion applies wherever those names appear in a state: parameters, and the optimizer's
moments that mirror them.
"""

import contextlib
import contextvars
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jddp.core.tree_paths import path_str

PER_LAYER, STACKED = "block_", "blocks"
_PER_LAYER_KEY = re.compile(rf"^{PER_LAYER}(\d+)$")


def is_stacked(shapes: dict[str, tuple]) -> bool:
    """Whether a `{path: shape}` dict (jddp.checkpoints.compatibility.shapes_by_path) holds stacked
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
# With V repeats the L layers form V S groups of L / (V S), and stage s runs groups s, s + S, ...,
# s + (V - 1) S. A state holds them so (Megatron-LM's virtual stages, MaxText's circular
# layers): its stack's leading axis, split over `stage` in consecutive blocks, lists stage 0's
# groups, then stage 1's, ...; `TrainState.layer_order` = (S, V) says so. Checkpoints, exports
# and `host_state` see the model's order, whatever the repeats.


def _reordered(x, first: int, second: int):
    """`x` with its leading axis, read as (first, second, L / (first second)) blocks, written
    as (second, first, ...)."""
    head = x.reshape(first, second, -1, *x.shape[1:])
    return jnp.swapaxes(head, 0, 1).reshape(x.shape)


def in_stage_order(x, stages: int, repeats: int):
    """A stacked leaf (L, ...) in the model's layer order to the stages' order: group g =
    r S + s moves to stage s's slot r."""
    return _reordered(x, repeats, stages)


def in_model_order(x, stages: int, repeats: int):
    """`in_stage_order` undone."""
    return _reordered(x, stages, repeats)


def reorder_state(state, order, *, stack_path: tuple[str, ...], num_layers: int):
    """`state` (a TrainState) with its stack's leaves (at `stack_path`, `num_layers` long), the
    parameters' and every optimizer leaf that mirrors them, in `order`: (S, V) the stages'
    order, None the model's."""
    if state.layer_order == order:
        return state
    prefix = "/".join(stack_path) + "/"
    stacked = {
        path_str(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(state.params)
        if path_str(path).startswith(prefix)
    }

    # A leaf mirrors a stack parameter when its path ends with the parameter's, as in
    # rules.mirror_specs; here by the leading layer axis, not the whole shape, so that factored
    # moments (Adafactor's rows and columns) move with their layers too.
    def move(path, x):
        parts = path_str(path).split("/")
        mirrors = any("/".join(parts[i:]) in stacked for i in range(len(parts)))
        if not mirrors or not x.shape or x.shape[0] != num_layers:
            return x
        if state.layer_order is not None:
            x = in_model_order(x, *state.layer_order)
        return x if order is None else in_stage_order(x, *order)

    params, opt_state = (
        jax.tree_util.tree_map_with_path(move, tree) for tree in (state.params, state.opt_state)
    )
    return state.replace(params=params, opt_state=opt_state, layer_order=order)


def split_stack(params, path):
    """(the stacked parameters at `path`, every other parameter)."""
    rest = dict(params)
    node = rest
    for key in path[:-1]:
        node[key] = dict(node[key])
        node = node[key]
    stacked = node.pop(path[-1])
    return stacked, rest


def join_stack(rest, stacked, path):
    """`rest` with `stacked` put back at `path` (a part of the parameters, such as LoRA's
    adapters, may lack the nodes above it, or hold nothing in the stack: then none is added)."""
    if not jax.tree.leaves(stacked):
        return rest
    tree = dict(rest)
    node = tree
    for key in path[:-1]:
        node[key] = dict(node.get(key, {}))
        node = node[key]
    node[path[-1]] = stacked
    return tree


@dataclasses.dataclass(frozen=True)
class Stack:
    """Where a model's stacked layers live (`path` of their parameters) and how many there are."""

    path: tuple[str, ...]
    num_layers: int


_FOUND: contextvars.ContextVar = contextvars.ContextVar("jddp_stacks_found", default=None)


@contextlib.contextmanager
def finding_stacks():
    """Within this context, every stack of layers that initializes (a `Pipelined` module) appends
    its `Stack` to the list this yields."""
    found = []
    token = _FOUND.set(found)
    try:
        yield found
    finally:
        _FOUND.reset(token)


def stack_initialized(stack: Stack) -> None:
    """Called by a stack of layers as it initializes: recorded where `finding_stacks` listens."""
    found = _FOUND.get()
    if found is not None:
        found.append(stack)
