"""Parameter paths as strings: `block_0/attn/qkv/kernel`, the spelling partition rules, error
messages and checkpoint checks use for a leaf of a tree."""

import jax


def path_str(path) -> str:
    """A `jax.tree_util` key path as `a/b/c`."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def nest_paths(flat: dict) -> dict:
    """{"a/b": x} -> {"a": {"b": x}}: a tree from leaves keyed by `path_str` paths."""
    tree = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree
