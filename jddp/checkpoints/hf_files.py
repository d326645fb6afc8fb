"""A directory as Hugging Face's `save_pretrained` writes it: `config.json` plus
`model.safetensors`, or shards `model-0000k-of-0000n.safetensors` listed in
`model.safetensors.index.json`. Read lazily (safetensors' `get_slice`: a device's shard of a
tensor is read alone, never the whole file), written whole.

Nothing is downloaded: a path that does not exist is one line, with the command that downloads
a hub model to a local directory.
"""

import contextlib
import json
import os
import re
import shutil
import socket

import numpy as np

from jddp.checkpoints.hf_mapping import QKV_BY_HEAD, TRANSPOSE, Tensor
from jddp.errors import CheckpointError
from jddp.observe.memory import format_bytes
from jddp.runtime import atomic_write

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"
_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")
# safetensors' names of the types jddp reads weights in (cast to the parameters' dtype).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_directory(path: str, what: str) -> None:
    """A CheckpointError unless `path` is a local directory with a config.json."""
    if not os.path.exists(path):
        hint = (
            f"; jddp downloads nothing: fetch the hub model first (`hf download {path} "
            f"--local-dir DIR`) and pass hf:DIR"
            if _HUB_NAME.fullmatch(path)
            else "; pass a directory written by save_pretrained"
        )
        raise CheckpointError(f"{what} {path!r} does not exist{hint}")
    if not os.path.isfile(os.path.join(path, CONFIG)):
        raise CheckpointError(
            f"{what} {path!r} has no {CONFIG}; pass a directory written by save_pretrained"
        )


def read_config(path: str, what: str) -> dict:
    check_directory(path, what)
    try:
        with open(os.path.join(path, CONFIG)) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{what} {path!r}: {CONFIG} is unreadable ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{what} {path!r}: {CONFIG} is not a JSON object")
    return config


def _stays_inside(name: str) -> bool:
    """Whether a file name an index lists is relative and never climbs out (`../`)."""
    normal = os.path.normpath(name)
    return not os.path.isabs(name) and normal != os.pardir and not normal.startswith("../")


class Reader:
    """The tensors of one save_pretrained directory, by name; files are opened on first use
    and closed by `close` (or the `with` block)."""

    def __init__(self, path: str, what: str):
        self.path, self.what = path, f"{what} {path!r}"
        self._open = contextlib.ExitStack()
        self._handles = {}
        self.files = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        """{tensor name: file} from the index, or every tensor of model.safetensors."""
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{self.what}: {INDEX} is unreadable ({e})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{self.what}: {INDEX}'s weight_map is not a JSON object")
            for name in sorted(set(map(str, weight_map.values()))):
                if not _stays_inside(name):
                    raise CheckpointError(
                        f"{self.what}: {INDEX} lists the file {name!r}, outside the directory; "
                        "an index names the shards beside it: download or copy the directory "
                        "again"
                    )
                if not os.path.isfile(os.path.join(self.path, name)):
                    raise CheckpointError(
                        f"{self.what} lacks the shard {name} that {INDEX} lists; download or "
                        "copy the whole directory again"
                    )
            return {k: os.path.join(self.path, v) for k, v in weight_map.items()}
        single = os.path.join(self.path, WEIGHTS)
        if os.path.isfile(single):
            return dict.fromkeys(self._handle(single).keys(), single)
        others = [
            n
            for n in ("pytorch_model.bin", "model.pt")
            if os.path.exists(os.path.join(self.path, n))
        ]
        hint = (
            f" (it has {others[0]}: save it again with save_pretrained(..., "
            "safe_serialization=True))"
            if others
            else ""
        )
        raise CheckpointError(f"{self.what} holds no {WEIGHTS} nor {INDEX}{hint}")

    def _handle(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[file] = self._open.enter_context(safe_open(file, "np"))
            except Exception as e:  # a truncated or foreign file
                raise CheckpointError(
                    f"{self.what}: {file} is not a safetensors file ({e})"
                ) from None
        return self._handles[file]

    def slice(self, name: str):
        """safetensors' lazy slice of tensor `name` (indexing it reads only that part)."""
        return self._handle(self.files[name]).get_slice(name)

    def check(self, tensors: list[Tensor], shapes: dict[str, tuple]) -> None:
        """A CheckpointError naming the first tensor that is missing or of the wrong shape
        for jddp parameters of `shapes` ({per-layer path: shape}); reads headers only."""
        parts = [
            (p, whole.part_shape(shapes[whole.path])) for whole in tensors for p in whole.parts()
        ]
        for tensor, shape in parts:
            if tensor.name not in self.files:
                raise CheckpointError(
                    f"{self.what} has no tensor {tensor.name!r} (jddp's {tensor.path}); is it "
                    "the model config.json describes?"
                )
            expected = tensor.hf_shape(shape)
            source = self.slice(tensor.name)
            if source.get_dtype() not in FLOAT_DTYPES:
                raise CheckpointError(
                    f"{self.what}: tensor {tensor.name!r} is {source.get_dtype()}, not a floating "
                    f"type ({', '.join(FLOAT_DTYPES)}); jddp loads float weights only (for a "
                    "quantized checkpoint, pass its float original)"
                )
            found = tuple(source.get_shape())
            if found != expected:
                raise CheckpointError(
                    f"{self.what}: tensor {tensor.name!r} has shape {found}, config.json makes "
                    f"it {expected}"
                )

    def lazy(self, tensor: Tensor, shape: tuple, dtype) -> "LazyTensor | LazyLayers":
        """jddp's parameter of `shape` read from `tensor` when indexed; stacked experts as
        one LazyTensor per expert (indexing reads only the experts, and the part of each,
        that the index holds)."""
        if tensor.experts:
            part_shape = tensor.part_shape(shape)
            experts = [LazyTensor(self, part, part_shape, dtype) for part in tensor.parts()]
            return LazyLayers(experts)
        return LazyTensor(self, tensor, tuple(shape), np.dtype(dtype))

    def close(self) -> None:
        self._open.close()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LazyTensor:
    """A jddp parameter read from a Hugging Face tensor when indexed: `x[index]` reads only the
    rows and columns of `index` (a device's shard), transposed or reordered to jddp's layout."""

    lazy = True  # jddp.core.state.arranged_like passes it through unread

    def __init__(self, reader: Reader, tensor: Tensor, shape: tuple, dtype):
        self.reader, self.tensor, self.shape, self.dtype = reader, tensor, shape, dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def astype(self, dtype, copy: bool = False) -> "LazyTensor":
        return LazyTensor(self.reader, self.tensor, self.shape, np.dtype(dtype))

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (self.ndim - len(index))
        source = self.reader.slice(self.tensor.name)
        if self.tensor.transform == TRANSPOSE:
            part = source[tuple(reversed(index))].T
        elif self.tensor.transform == QKV_BY_HEAD:  # columns interleave: read it whole
            part = self.tensor.to_jddp(source[:])[index]
        else:
            part = source[index]
        return np.asarray(part).astype(self.dtype, copy=False)

    @staticmethod
    def stacked(layers: list) -> "LazyLayers":
        return LazyLayers(layers)


class LazyLayers:
    """Per-layer (or per-expert) LazyTensors as one stacked parameter (leading axis = layer,
    or expert)."""

    lazy = True

    def __init__(self, layers: list):
        self.layers = layers
        self.shape = (len(layers), *layers[0].shape)
        self.dtype = layers[0].dtype

    def astype(self, dtype, copy: bool = False) -> "LazyLayers":
        return LazyLayers([layer.astype(dtype) for layer in self.layers])

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        chosen = range(len(self.layers))[index[0]]
        rest = index[1:]
        parts = [self.layers[i][rest] for i in chosen]
        if parts:
            return np.stack(parts)
        return np.zeros((0, *self.shape[1:]), self.dtype)


def write(
    path: str,
    config: dict,
    tensors: dict[str, np.ndarray],
    max_shard_bytes: int,
    companions: tuple[str, ...] = (),
    files: tuple[str, str] = (CONFIG, WEIGHTS),
) -> None:
    """`config.json` and the tensors (in order) as `model.safetensors` (`files` names these
    two: PEFT's adapters are `adapter_config.json`, `adapter_model.safetensors`), or as shards
    of at most `max_shard_bytes` (a tensor larger than that gets a shard of its own) with their
    index, and a copy of each `companions` file (a tokenizer's, a generation config). Written into
    `PATH.partial`, this export's own (see `_claim`), made durable and renamed at the end: an
    interrupted export leaves no half directory."""
    shards, current, size = [], {}, 0
    for name, array in tensors.items():
        if current and size + array.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = np.ascontiguousarray(array)
        size += array.nbytes
    shards.append(current)
    partial = f"{path.rstrip(os.sep)}.partial"
    _claim(partial)
    try:
        _write_into(partial, config, shards, companions, files)
        os.remove(os.path.join(partial, PARTIAL_MARKER))
        atomic_write.fsync_tree(partial)
    except BaseException as e:  # a full disk, an interrupt: no half directory is left behind
        shutil.rmtree(partial, ignore_errors=True)
        if not isinstance(e, Exception):
            raise
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        needed = sum(a.nbytes for shard in shards for a in shard.values())
        raise CheckpointError(
            f"writing {path} failed ({reason}); it needs {format_bytes(needed)}: free space or "
            "pass another OUT (nothing was written)"
        ) from None
    if os.path.isdir(path):  # empty (checked by the caller)
        os.rmdir(path)
    os.rename(partial, path)
    atomic_write.fsync_directory(os.path.dirname(os.path.abspath(path)))


# The first file of an export's PATH.partial: "PID HOST" of the process writing it.
PARTIAL_MARKER = ".jddp-export"


def check_partial(path: str) -> None:
    """A CheckpointError, naming it and touching nothing, if `PATH.partial` exists and is not
    a folder a jddp export on this host left when it was killed (its process gone): another
    export's, or someone else's."""
    partial = f"{path.rstrip(os.sep)}.partial"
    if not os.path.lexists(partial):
        return
    holder = _marker(partial)
    if holder is None or not _left_by_dead_process(*holder):
        whose = f"process {holder[0]} on {holder[1]}" if holder else f"no {PARTIAL_MARKER}"
        raise CheckpointError(
            f"{partial} exists and is not this export's ({whose}); remove it if no export is "
            "writing it, or pass another OUT (nothing was written)"
        )


def _claim(partial: str) -> None:
    """Creates `partial` for this export, marked as its own (`check_partial`: one a killed
    export left is removed first, any other is refused)."""
    os.makedirs(os.path.dirname(os.path.abspath(partial)), exist_ok=True)
    try:
        os.mkdir(partial)
    except FileExistsError:
        check_partial(partial.removesuffix(".partial"))
        shutil.rmtree(partial)
        os.mkdir(partial)
    with open(os.path.join(partial, PARTIAL_MARKER), "w") as f:
        f.write(f"{os.getpid()} {socket.gethostname()}\n")


def _marker(partial: str) -> tuple[int, str] | None:
    """(pid, host) of a jddp export's marker in `partial`; None where there is none."""
    try:
        with open(os.path.join(partial, PARTIAL_MARKER), "rb") as f:
            pid, host = f.read(300).decode().split()
        return int(pid), host
    except (OSError, ValueError):
        return None


def _left_by_dead_process(pid: int, host: str) -> bool:
    if host != socket.gethostname():
        return False  # its process cannot be seen from here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's live process
        return False
    return False


def _write_into(partial: str, config: dict, shards: list[dict], companions, files) -> None:
    from safetensors.numpy import save_file

    config_file, weights_file = files
    names = (
        [weights_file]
        if len(shards) == 1
        else [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    )
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, os.path.join(partial, name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(a.nbytes for s in shards for a in s.values())},
            "weight_map": {t: n for n, shard in zip(names, shards, strict=True) for t in shard},
        }
        atomic_write.write_json(os.path.join(partial, INDEX), index, indent=2, sort_keys=True)
    atomic_write.write_json(os.path.join(partial, config_file), config, indent=2, sort_keys=True)
    for file in companions:
        shutil.copyfile(file, os.path.join(partial, os.path.basename(file)))
