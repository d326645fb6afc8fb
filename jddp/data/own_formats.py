"""Each own-data format opened as splits ({"train": table, ...}): NumPy archives, JSON Lines,
Parquet, Hugging Face `datasets` saved with `save_to_disk`, and whatever a user's function returns.

An npz archive's arrays and a JSON Lines file are read once into memory (JSON has no random
access); Parquet and `datasets` tables read lazily (tables.py). Every problem with a file is one
DataError line naming the file.
"""

import json
import os
import zipfile
from collections.abc import Mapping

import numpy as np

from jddp.data.tables import ArrayTable, HfTable, ParquetTable, RecordTable, Table
from jddp.errors import ConfigError, DataError, first_line

HF_INSTALL = "pip install 'jddp[hf]'"


def _check_file(path: str, where: str) -> None:
    if os.path.isdir(path):
        raise DataError(f"{where} is a directory; pass the path of a file")
    if not os.path.exists(path):
        raise DataError(f"{where} does not exist; check the path (relative paths start at the cwd)")


def read_npz(path: str, where: str) -> dict[str, Table]:
    """{"train": the archive's arrays}, each split along its first axis."""
    _check_file(path, where)
    if not zipfile.is_zipfile(path):  # np.load would try to unpickle it
        with open(path, "rb") as f:
            single = f.read(6) == b"\x93NUMPY"
        what = "a single array (.npy)" if single else "not a NumPy archive (.npz)"
        raise DataError(f"{where} is {what}; save one with np.savez(PATH, x=inputs, label=labels)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except ValueError as e:  # allow_pickle: an object array inside
        raise DataError(
            f"{where} holds object arrays, which need pickle ({first_line(e)}); save text as a "
            "string array (np.array(texts, dtype=str)) and numbers as numeric arrays"
        ) from None
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"{where} is not a readable NumPy archive: {first_line(e)}") from None
    arrays = {n: a.astype(object) if a.dtype.kind == "U" else a for n, a in arrays.items()}
    return {"train": ArrayTable(arrays, where, reopen=(_reopen_npz, (path, where)))}


def _reopen_npz(path: str, where: str) -> ArrayTable:
    return read_npz(path, where)["train"]


def read_jsonl(path: str, where: str) -> dict[str, Table]:
    """{"train": one row per line}: each line a JSON object with the same keys."""
    _check_file(path, where)
    rows, keys = [], None
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where} line {number} is not JSON ({e.msg})") from None
                if not isinstance(record, dict):
                    raise DataError(
                        f"{where} line {number} is a JSON {type(record).__name__}, not an "
                        'object; write one object per line, e.g. {"x": [0.5, 1.0], "label": 1}'
                    )
                if keys is None:
                    keys = list(record)
                elif set(record) != set(keys):
                    raise DataError(
                        f"{where} line {number} has the keys {sorted(record)}, the first line "
                        f"{sorted(keys)}; every line needs the same keys"
                    )
                rows.append(record)
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{where} cannot be read: {e.strerror}") from None
    if not rows:
        raise DataError(f"{where} holds no rows; write one JSON object per line")
    return {"train": ArrayTable({key: [row[key] for row in rows] for key in keys}, where)}


def read_parquet(path: str, where: str) -> dict[str, Table]:
    """{"train": the file's rows}."""
    _check_file(path, where)
    return {"train": ParquetTable(path, where)}


def read_hf(path: str, where: str) -> dict[str, Table]:
    """The splits of a `datasets` Dataset ({"train": ...}) or DatasetDict saved with
    `save_to_disk`; read locally, nothing is downloaded."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{where} needs the Hugging Face `datasets` package: {HF_INSTALL}"
        ) from None
    if not os.path.isdir(path):
        raise DataError(
            f"{where} is not a directory; hf: reads a dataset saved with save_to_disk(PATH) "
            "(nothing is downloaded)"
        )
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:  # FileNotFoundError: not a saved dataset; others: damaged files
        raise DataError(
            f"{where} is not a dataset saved with save_to_disk ({first_line(e)}); save one with "
            "Dataset.save_to_disk(PATH) or DatasetDict.save_to_disk(PATH)"
        ) from None
    if isinstance(loaded, Mapping):  # a DatasetDict
        return {str(split): HfTable(ds, f"{where} split {split}") for split, ds in loaded.items()}
    return {"train": HfTable(loaded, where)}


def from_returned(value, where: str) -> dict[str, Table]:
    """What a user's dataset function returned, as splits: a dict of arrays or a random-access
    source (one split, "train"), or a dict of splits ({"train": ..., "test": ...}) of either."""
    if isinstance(value, Mapping) and value:
        if all(isinstance(v, Mapping) or _is_source(v) for v in value.values()):
            return {str(k): _as_table(v, f"{where} split {k}") for k, v in value.items()}
        return {"train": _as_table(value, where)}
    if _is_source(value):
        return {"train": _as_table(value, where)}
    raise DataError(
        f"{where} returned {type(value).__name__ if value is not None else 'None'}; return a "
        "dict of arrays, a random-access source (__len__, __getitem__ giving dict records), or a "
        "dict of splits of either"
    )


def _is_source(value) -> bool:
    """grain's random-access protocol, and not an array or a plain sequence of values."""
    plain = isinstance(value, Mapping | np.ndarray | list | tuple | str | bytes)
    return hasattr(value, "__len__") and hasattr(value, "__getitem__") and not plain


def _as_table(value, where: str) -> Table:
    if type(value).__module__.startswith("datasets.") and hasattr(value, "column_names"):
        return HfTable(value, where)  # a `datasets.Dataset` built in memory
    if isinstance(value, Mapping):
        return ArrayTable(value, where)
    return RecordTable(value, where)
