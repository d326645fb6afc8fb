"""Small splits decoded once into numpy files, so every later read is an array index.

Decoding a TFDS example without TensorFlow (protobuf parse, PNG decode with Pillow) costs ~0.3 ms;
an epoch of Fashion-MNIST would spend 20 s in it. A split whose features all have fixed shapes is
decoded once into one `.npy` file per feature beside the TFDS files (`<data_dir>/decoded/...`);
runs and loader processes then memory-map the files and share them through the page cache.
"""

import json
import os
import shutil

import numpy as np

from jddp.runtime import atomic_write

_DONE = "complete.json"


class ArraySource:
    """A random-access source whose examples are rows of one array per feature."""

    def __init__(self, arrays: dict[str, np.ndarray], folder: str | None = None):
        lengths = {len(array) for array in arrays.values()}
        if len(lengths) != 1:
            raise ValueError(f"features disagree on the number of examples: {sorted(lengths)}")
        self._arrays, self._folder = arrays, folder
        (self._length,) = lengths

    @classmethod
    def load(cls, folder: str) -> "ArraySource":
        with open(os.path.join(folder, _DONE)) as f:
            names = json.load(f)["features"]
        path = lambda name: os.path.join(folder, f"{name}.npy")  # noqa: E731
        arrays = {name: np.load(path(name), mmap_mode="r") for name in names}
        return cls(arrays, folder)

    def __reduce__(self):
        # Loader worker processes get the folder and map the same files, not a pickled copy.
        if self._folder is not None:
            return ArraySource.load, (self._folder,)
        return ArraySource, (self._arrays,)

    def __len__(self) -> int:
        return self._length

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, np.int64)
        return {name: np.asarray(array[indices]) for name, array in self._arrays.items()}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {name: np.asarray(array[index]) for name, array in self._arrays.items()}


def is_decoded(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, _DONE))


def decoded_split(source, folder: str, features, chunk_size: int = 2048) -> ArraySource:
    """`source` (a TFDS data source) decoded into `folder` on first use, then memory-mapped.

    The caller holds the dataset's lock; files are written to a temporary folder and renamed.
    """
    if not is_decoded(folder):
        partial = folder + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        columns: dict[str, list] = {name: [] for name in features}
        for start in range(0, len(source), chunk_size):
            examples = source.__getitems__(list(range(start, min(start + chunk_size, len(source)))))
            for name in features:
                columns[name].extend(example[name] for example in examples)
        for name, values in columns.items():
            np.save(os.path.join(partial, f"{name}.npy"), np.stack(values))
        done = {"features": list(features), "num_examples": len(source)}
        # fsynced with the arrays next, before the folder's rename says "decoded"
        atomic_write.write_json(os.path.join(partial, _DONE), done, durable=False)
        atomic_write.fsync_tree(partial)  # the arrays on disk before the name says "decoded"
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(partial, folder)
        atomic_write.fsync_directory(os.path.dirname(os.path.abspath(folder)))
    return ArraySource.load(folder)
