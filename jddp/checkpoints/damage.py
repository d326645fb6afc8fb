"""Whether a checkpoint's own files show damage, judged from the files and never from the text
of the error a read ended with: a checkpoint is set aside only on this proof.

Damage is a file that orbax's commit wrote and that is now missing, shorter than the index says,
or unparsable: the step's commit marker and metadata, each item's metadata, and the OCDBT index
of the state's arrays (its manifest and B-tree nodes, which give every array chunk's file, offset
and length; each chunk's file must be that long). Reading files, not interpreting errors, keeps a
flaky file system, a full memory or a runtime error from being taken for damage."""

import json
import os
import re

import tensorstore as ts

STATE, META = "state", "meta"
COMMIT_MARKER = "commit_success.txt"  # orbax writes it last, before the step's atomic rename
_JSON_FILES = ("_CHECKPOINT_METADATA", f"{META}/metadata", f"{STATE}/_METADATA")
# An OCDBT location: "value:ocdbt.process_0/:d/ec25ae57:241851:1230" (kind, the prefix of its
# database, its file under it, offset, length); B-tree nodes are "btreenode::d/b338:0:7185".
_ZSTD_MAGIC = bytes.fromhex("28b52ffd")
_LOCATION = re.compile(r"^(value|btreenode):([^:]*):(.+):(\d+):(\d+)$")


def damage_in(step_dir: str) -> str | None:
    """What shows that checkpoint `step_dir` is damaged, as a phrase ("state/d/ab12 is 312
    bytes, shorter than the 1230 its index needs"), or None when its files are complete. A file
    this process may not read raises the OSError (that is not damage)."""
    step_dir = os.path.abspath(step_dir)  # tensorstore's file driver, as orbax, wants one
    for name in (COMMIT_MARKER, f"{STATE}/{COMMIT_MARKER}", f"{META}/{COMMIT_MARKER}"):
        if not os.path.isfile(os.path.join(step_dir, name)):
            return f"its commit marker {name} is missing"
    parsed = {}
    for name in _JSON_FILES:
        found = _read_json(step_dir, name)
        if isinstance(found, str):
            return found
        parsed[name] = found
    return _state_index_damage(os.path.join(step_dir, STATE), parsed[f"{STATE}/_METADATA"])


def _read_json(step_dir: str, name: str):
    """The parsed file (a JSON object), or a phrase saying why it is damaged."""
    try:
        with open(os.path.join(step_dir, name), "rb") as f:
            parsed = json.loads(f.read())
    except FileNotFoundError:
        return f"{name} is missing"
    except ValueError:
        return f"{name} is not valid JSON"
    return parsed if isinstance(parsed, dict) else f"{name} is not a JSON object"


def _file_damage(state_dir: str, location: str, magic: bytes = b"") -> str | None:
    """Why the file an OCDBT location points into cannot hold it (or, with `magic`, does not
    start the value with it), or None."""
    kind, prefix, relative, offset, length = _LOCATION.match(location).groups()
    path = os.path.join(state_dir, prefix, relative)
    name = os.path.relpath(path, os.path.dirname(state_dir))
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return f"{name} is missing"
    end = int(offset) + int(length)
    if size < end:
        return f"{name} is {size} bytes, shorter than the {end} its index needs"
    with open(path, "rb") as f:  # a node is read whole: one that cannot be read is no proof
        f.seek(int(offset))
        start = f.read(int(length) if kind == "btreenode" else len(magic))
    if not start.startswith(magic):
        return f"{name} holds no compressed chunk at byte {offset} (overwritten)"
    return None


def _state_index_damage(state_dir: str, metadata: dict) -> str | None:
    """Damage to the state's OCDBT index or to the files it points into; None if complete."""
    manifest = os.path.join(state_dir, "manifest.ocdbt")
    if not os.path.isfile(manifest):
        return f"{STATE}/manifest.ocdbt is missing"
    with open(manifest, "rb") as f:
        f.read()  # readable to its end: a failure to parse it below is its content's
    store = ts.KvStore.open({"driver": "file", "path": state_dir + os.sep}).result()
    try:
        versions = ts.ocdbt.dump(store).result()["versions"]
    except ValueError:
        return f"{STATE}/manifest.ocdbt cannot be parsed"
    if not versions:
        return f"{STATE}/manifest.ocdbt records no arrays"
    entries, nodes = [], [versions[-1]["root"]["location"]]
    while nodes:  # the B-tree, node by node
        node = nodes.pop()
        if problem := _file_damage(state_dir, node):
            return problem
        try:
            found = ts.ocdbt.dump(store, node).result()["entries"]
        except ValueError:
            return f"the index node {node.split(':')[2]} cannot be parsed"
        children = [_child(e) for e in found]
        nodes += [c for c in children if c]
        entries += [e for e, c in zip(found, children, strict=True) if not c]
    zarr = {e["key"][: -len(b"/.zarray")]: e for e in entries if e["key"].endswith(b"/.zarray")}
    for array in _saved_arrays(metadata):
        if array.encode() not in zarr:
            return f"the array {array} is missing from {STATE}'s index"
    for entry in entries:  # every chunk stored apart from the index
        array = entry["key"].rsplit(b"/", 1)[0]
        location = entry.get("indirect_value")
        if location and (problem := _file_damage(state_dir, location, _magic(zarr.get(array)))):
            return problem
    return None


def _child(entry: dict) -> str | None:
    """The location of the node an interior node's entry points to; None for a leaf's entry."""
    return next(
        (v for v in entry.values() if isinstance(v, str) and v.startswith("btreenode:")), None
    )


def _magic(zarray_entry: dict | None) -> bytes:
    """The bytes each chunk of an array starts with (zstd's frame magic, when its `.zarray`
    says zstd), else b""."""
    try:
        compressor = json.loads(zarray_entry["inline_value"])["compressor"] or {}
    except (TypeError, KeyError, ValueError):
        return b""
    return _ZSTD_MAGIC if compressor.get("id") == "zstd" else b""


def _saved_arrays(metadata: dict):
    """The OCDBT names ("params.head.kernel") of the arrays `_METADATA` says were saved."""
    for leaf in (metadata.get("tree_metadata") or {}).values():
        value = leaf.get("value_metadata") or {}
        if value.get("value_type") in ("jax.Array", "np.ndarray") and not value.get(
            "skip_deserialize"
        ):
            yield ".".join(str(k["key"]) for k in leaf["key_metadata"])
