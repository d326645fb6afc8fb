"""Own data for tests: the same rows written as each file format jddp reads, and the order the
loader reads them in, for references written apart from jddp (docs/data.md, "Own data" and "The
input pipeline")."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


# ------------------------------------------------------------------------------------ the files
def write_jsonl(path, columns: dict) -> None:
    """One JSON object per row: {column: the row's value (a list for a vector)}."""
    with open(path, "w") as f:
        for i in range(len(next(iter(columns.values())))):
            f.write(json.dumps({key: value[i].tolist() for key, value in columns.items()}) + "\n")


def write_parquet(path, columns: dict) -> None:
    """One Parquet column per column; a vector column as a list column."""
    table = {key: list(value) if value.ndim > 1 else value for key, value in columns.items()}
    pq.write_table(pa.table(table), path)


def write_files(folder, splits: dict) -> None:
    """Each of `splits` ({name: columns}) as FOLDER/NAME.npz, NAME.jsonl and NAME.parquet."""
    for name, columns in splits.items():
        np.savez(os.path.join(folder, f"{name}.npz"), **columns)
        write_jsonl(os.path.join(folder, f"{name}.jsonl"), columns)
        write_parquet(os.path.join(folder, f"{name}.parquet"), columns)


def write_hf(path, splits: dict, features=None) -> None:
    """`splits` as a Hugging Face `datasets` DatasetDict saved with `save_to_disk` at `path`
    (`features` inferred from the arrays unless given)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict(columns, features=features)
            for name, columns in splits.items()
        }
    ).save_to_disk(str(path))


# ---------------------------------------------------------------------------- the loader's order
def global_batch_rows(num_rows: int, global_batch_size: int, steps: int, seed: int = 0):
    """The row indices of each step's global batch, an array (steps, global_batch_size): epoch e
    is `np.random.default_rng([seed, e]).permutation(num_rows)`; epochs are concatenated and cut
    into consecutive global batches."""
    epochs = -(-steps * global_batch_size // num_rows)  # as many as the steps reach into
    order = np.concatenate(
        [np.random.default_rng([seed, e]).permutation(num_rows) for e in range(epochs)]
    )
    return order[: steps * global_batch_size].reshape(steps, global_batch_size)


def as_loaded(columns: dict) -> dict:
    """`columns` as own data reaches the model: integers int32, floats (and booleans) float32."""
    return {
        key: np.asarray(value, np.int32 if np.issubdtype(value.dtype, np.integer) else np.float32)
        for key, value in columns.items()
    }


def global_batches(columns: dict, global_batch_size: int, steps: int, seed: int = 0) -> list:
    """Each step's global batch of `columns` (arrays of one length, rows along the first axis),
    in the loader's order and dtypes."""
    num_rows = len(next(iter(columns.values())))
    loaded = as_loaded(columns)
    return [
        {key: value[rows] for key, value in loaded.items()}
        for rows in global_batch_rows(num_rows, global_batch_size, steps, seed)
    ]
