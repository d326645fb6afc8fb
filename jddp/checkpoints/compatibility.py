"""Does a saved state fit the state a trainer lays out? Compared from metadata alone, path by
path: structure (empty nodes included: optax's EmptyState, an unused gradient compression state),
shapes and dtypes, with stacked and per-layer blocks compared layer by layer. A state that does
not fit is another model or setup, never damage: `Checkpoints.restore_latest` raises the
ShapeError this gives and moves nothing. Also the parameters' shapes by path (what `init_from`
compares), and how a checkpoint whose layers are stacked differently from this run's is read."""

import jax
import numpy as np

from jddp.core import layer_stacks
from jddp.core.tree_paths import path_str
from jddp.errors import ShapeError

# Per part of the state: what its entries are called, and how a differing one is put right.
_PARTS = {
    "params": ("parameter", "use the model that saved them"),
    "model_state": ("model state entry", "use the model that saved them"),
    "opt_state": (
        "optimizer state entry",
        "use the optimizer that saved them (another optimizer keeps other state)",
    ),
    "comm_state": (
        "gradient compression state entry",
        "use the grad_compression and powersgd_rank they were saved with",
    ),
    "loss_scale": (
        "loss scale entry",
        "use the compute_dtype they were saved with (float16 keeps a loss scale)",
    ),
}


def _is_empty(node) -> bool:
    """An empty node (optax's EmptyState, `{}`, None: orbax saves those as None or `{}`)."""
    return node is None or (isinstance(node, dict | list | tuple) and len(node) == 0)


def state_layout(tree) -> dict[str, tuple | None]:
    """{path: (shape, dtype name)} of every leaf and {path: None} of every empty node of a
    state, an abstract state or a checkpoint's metadata tree, with stacked blocks written per
    layer (stacked and per-layer layouts compare equal)."""
    layout = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_empty)[0]:
        text = path_str(path)
        entry = None if _is_empty(leaf) else (tuple(leaf.shape), _dtype_name(leaf.dtype))
        head, stacked, tail = f"/{text}".partition(f"/{layer_stacks.STACKED}/")
        if not stacked or (entry is not None and not entry[0]):  # a scalar is no stack
            layout[text] = entry
        elif entry is not None:  # an empty node of a stack has no layer count: left out
            for i in range(entry[0][0]):
                layout[f"{head}/{layer_stacks.PER_LAYER}{i}/{tail}".lstrip("/")] = (
                    entry[0][1:],
                    entry[1],
                )
    return layout


def _dtype_name(dtype) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:  # a JAX key dtype, say
        return str(dtype)


def _described(entry) -> str:
    return "empty" if entry is None else f"{entry[1]}{list(entry[0])}"


def state_mismatch(abstract_state, saved_tree, source: str) -> tuple[str, str] | None:
    """(what differs, how to put it right) at the first path where a saved state (`saved_tree`:
    a checkpoint's metadata tree, or a state) differs from `abstract_state` in structure, shape
    or dtype; None if it fits."""
    ours, saved = state_layout(abstract_state), state_layout(saved_tree)

    def below(layout, path):  # the first entry under `path`: a subtree where the other has none
        return next(((p, e) for p, e in layout.items() if p.startswith(f"{path}/")), None)

    def part(path):  # parameters first: a different model shows there before its moments
        order = list(_PARTS)
        top = path.split("/")[0]
        return order.index(top) if top in order else len(order)

    for path in sorted([*ours, *(p for p in saved if p not in ours)], key=part):
        mine, theirs = ours.get(path, "missing"), saved.get(path, "missing")
        if mine == theirs:
            continue
        what, fix = _PARTS.get(path.split("/")[0], ("state entry", "use the setup that saved them"))
        if theirs == "missing" and below(saved, path):
            inner, entry = below(saved, path)
            return (
                f"{what} {path!r} is {_described(mine)} in this state, but {source} holds "
                f"{inner!r} ({_described(entry)}) there",
                fix,
            )
        if mine == "missing" and below(ours, path):
            inner, entry = below(ours, path)
            return (
                f"{what} {path!r} is {_described(theirs)} in {source}, but this state holds "
                f"{inner!r} ({_described(entry)}) there",
                fix,
            )
        if theirs == "missing":
            return f"{source} has no {what} {path!r} (this state's is {_described(mine)})", fix
        if mine == "missing":
            return f"{source} holds {what} {path!r} ({_described(theirs)}), this state none", fix
        return (
            f"{what} {path!r} is {_described(theirs)} in {source} but {_described(mine)} in "
            "this state",
            fix,
        )
    return None


def check_state_matches(abstract_state, saved_tree, source: str, fix: str | None = None) -> None:
    """A one-line ShapeError naming the first path where the saved state differs from
    `abstract_state` (structure, shape or dtype), ending with `fix` (how to go on instead)."""
    found = state_mismatch(abstract_state, saved_tree, source)
    if found:
        mismatch, how = found
        raise ShapeError(
            f"{mismatch}: the checkpoints were saved by another model or setup and are left as "
            f"they are; {how}{', ' + fix if fix else ''}"
        )


def is_misfit(error: Exception) -> bool:
    """Whether orbax refused a restore because the target differs from what was saved (tree
    structure, or a shape it would have to truncate or pad), rather than because of the files."""
    text = str(error)
    return "tree structures do not match" in text or "is not compatible with the stored" in text


def shapes_by_path(tree) -> dict[str, tuple[int, ...]]:
    """{"params/hidden_0/kernel": (64, 256), ...} for any tree of arrays or array metadata."""
    return {
        path_str(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def first_mismatch(expected: dict, actual: dict, source: str) -> str | None:
    """The first parameter whose path or shape differs between two `shapes_by_path` dicts."""
    for path, shape in expected.items():
        if path not in actual:
            return f"{source} has no parameter {path!r} (the model's has shape {shape})"
        if actual[path] != shape:
            return (
                f"parameter {path!r} has shape {actual[path]} in {source} but {shape} in the model"
            )
    for path, shape in actual.items():
        if path not in expected:
            return f"{source} has a parameter {path!r} of shape {shape} that the model lacks"
    return None


def model_mismatch(abstract_state, saved_shapes: dict, source: str) -> str | None:
    """The first path or shape where a checkpoint's state (`saved_shapes`, by path) differs from
    `abstract_state`, layer by layer (stacked and per-layer blocks compare equal); None if it
    fits."""
    return first_mismatch(
        layer_stacks.per_layer_shapes(shapes_by_path(abstract_state)),
        layer_stacks.per_layer_shapes(saved_shapes),
        source,
    )


def restore_layout(abstract_state, saved_shapes):
    """(what to restore into, a function to this run's layout or None): a checkpoint whose
    layers are stacked differently from this run's (a pipelined run's, a plain run's) is read in
    its own layout and converted on the devices, into this run's shardings."""
    ours = layer_stacks.is_stacked(shapes_by_path(abstract_state))
    if layer_stacks.is_stacked(saved_shapes) == ours:
        return abstract_state, None
    target = (
        layer_stacks.to_per_layer(abstract_state)
        if ours
        else layer_stacks.to_stacked(abstract_state)
    )
    shardings = jax.tree.map(lambda x: x.sharding, abstract_state)
    convert = layer_stacks.to_stacked if ours else layer_stacks.to_per_layer
    return target, jax.jit(convert, out_shardings=shardings)
