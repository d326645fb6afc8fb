"""Small splits read once into memory, so each later read is an array index, not a decode."""

import numpy as np


class InMemorySource:
    """A random-access source whose examples live in one numpy array per feature."""

    def __init__(self, source, chunk_size: int = 4096):
        columns: dict[str, list] = {}
        for start in range(0, len(source), chunk_size):
            indices = list(range(start, min(start + chunk_size, len(source))))
            for example in source.__getitems__(indices):
                for name, value in example.items():
                    columns.setdefault(name, []).append(value)
        self._arrays = {name: np.stack(values) for name, values in columns.items()}
        self._length = len(source)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {name: array[index] for name, array in self._arrays.items()}

    def __getitems__(self, indices) -> list[dict[str, np.ndarray]]:
        return [self[i] for i in indices]
