"""Own data as random-access tables of named columns: arrays in memory, a user's source of
records, a Parquet file, a Hugging Face `datasets` Dataset (own_formats.py opens each format).

A table is a grain random-access source (`__len__`, `__getitem__` -> a dict record) with what the
loader and the dataset spec also use: `columns`, `read_batch(indices)` (one vectorized read per
step, see loader.py) and `column(name)` (a whole column: the labels, the text). A Parquet table
reads only the columns in use and only the row groups a batch's rows are in; a `datasets` table
stays in its memory-mapped Arrow files and decodes only the rows a batch asks for.
"""

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from jddp.errors import DataError, DataUnreadable, first_line

_COLUMN_CHUNK = 4096  # rows per read when a whole column is read through read_batch
ROW_GROUP_CACHE_BYTES = 64 << 20  # decoded Parquet row groups kept between batches, per table


def is_text(values: np.ndarray) -> bool:
    """A column of strings (numpy's fixed-width `U`, or Python strings in an object array)."""
    return values.dtype.kind == "U" or (
        values.dtype == object and len(values) > 0 and isinstance(values.flat[0], str)
    )


def stacked(name: str, values, where: str) -> np.ndarray:
    """`values` (one per row) as one array, or a DataError naming a ragged or mixed column."""
    if isinstance(values, np.ndarray) and values.dtype != object:
        return values
    values = list(values)
    if values and all(isinstance(v, str) for v in values):
        return np.array(values, dtype=object)  # text
    records = record_lists(values)
    if records is not None:
        return records
    try:
        array = np.asarray(values)
    except ValueError:  # numpy refuses rows of different lengths ("inhomogeneous shape")
        array = None
    if array is None or array.dtype == object:
        shapes = sorted({np.shape(v) for v in values if not isinstance(v, str | type(None))})
        if len(shapes) > 1:
            raise DataError(
                f"column {name!r} of {where} is ragged: its rows have the shapes {shapes[0]} and "
                f"{shapes[1]}; pad or cut them to one shape"
            )
        kinds = sorted({type(v).__name__ for v in values})
        raise DataError(
            f"column {name!r} of {where} mixes {', '.join(kinds)}; every row needs a number, an "
            "array of one shape, or a string"
        )
    return array


def record_lists(values) -> np.ndarray | None:
    """A column whose rows are lists of records (chat messages: {role, content} objects) as an
    object array of lists of dicts; None if it is not one."""
    rows = []
    for value in values:
        if isinstance(value, np.ndarray) and value.dtype == object:
            value = list(value)
        if not isinstance(value, list | tuple) or not all(isinstance(v, Mapping) for v in value):
            return None
        rows.append([dict(record) for record in value])
    if not any(rows):  # empty lists alone: nothing says they would hold records
        return None
    return object_column(rows)


def object_column(rows: list) -> np.ndarray:
    """`rows` as a 1-D object array, one Python object (a list too) per row."""
    column = np.empty(len(rows), dtype=object)
    for index, row in enumerate(rows):
        column[index] = row
    return column


class Table:
    """A random-access source of `columns`; subclasses read rows (`read_batch`)."""

    columns: tuple[str, ...] = ()
    where: str = "the data"

    def __len__(self) -> int:
        raise NotImplementedError

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {name: rows[0] for name, rows in self.read_batch([int(index)]).items()}

    def column(self, name: str) -> np.ndarray:
        """Every row of `name`, read a chunk of rows at a time."""
        selected, size = self.select([name]), _COLUMN_CHUNK
        parts = [
            selected.read_batch(np.arange(start, min(start + size, len(self))))[name]
            for start in range(0, len(self), size)
        ]
        return np.concatenate(parts)

    def select(self, names: Sequence[str]) -> "Table":
        """The same rows with only `names` (read no others)."""
        return Selected(self, tuple(names))

    def declared_classes(self, name: str) -> int | None:
        """The number of classes the format itself records for `name` (a `datasets` ClassLabel)."""
        return None


class Selected(Table):
    """`table` restricted to some of its columns."""

    def __init__(self, table: Table, names: tuple[str, ...]):
        self.table, self.columns, self.where = table, names, table.where

    def __len__(self) -> int:
        return len(self.table)

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        batch = self.table.read_batch(indices)
        return {name: batch[name] for name in self.columns}

    def declared_classes(self, name: str) -> int | None:
        return self.table.declared_classes(name)


class Rows(Table):
    """The rows `rows` of `table`, in that order (a held-out split, or what it leaves)."""

    def __init__(self, table: Table, rows: np.ndarray):
        self.table, self.rows = table, np.asarray(rows, np.int64)
        self.columns, self.where = table.columns, table.where

    def __len__(self) -> int:
        return len(self.rows)

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        return self.table.read_batch(self.rows[np.asarray(indices, np.int64)])

    def column(self, name: str) -> np.ndarray:
        return self.table.column(name)[self.rows]

    def select(self, names: Sequence[str]) -> Table:
        return Rows(self.table.select(names), self.rows)

    def declared_classes(self, name: str) -> int | None:
        return self.table.declared_classes(name)


class ArrayTable(Table):
    """Rows of one array per column, in memory (npz, JSON Lines, a function's dict of arrays).

    `reopen` ((function, args)) rebuilds it from its file in a loader worker process instead of
    pickling the arrays."""

    def __init__(self, arrays: Mapping[str, np.ndarray], where: str, reopen=None):
        if not arrays:
            raise DataError(f"{where} holds no arrays")
        arrays = {str(name): stacked(str(name), array, where) for name, array in arrays.items()}
        for name, array in arrays.items():
            if array.ndim == 0:
                raise DataError(
                    f"array {name!r} of {where} is a scalar; every array needs one row per "
                    "example along its first axis"
                )
        lengths = {name: len(array) for name, array in arrays.items()}
        if len(set(lengths.values())) > 1:
            listed = ", ".join(f"{name}: {n}" for name, n in lengths.items())
            raise DataError(
                f"the arrays of {where} have different numbers of rows ({listed}); every array "
                "needs one row per example along its first axis"
            )
        self.arrays, self.where, self.columns = arrays, where, tuple(arrays)
        self._length, self._reopen = next(iter(lengths.values())), reopen
        if not self._length:
            raise DataError(f"{where} holds no rows")

    def __reduce__(self):
        if self._reopen is not None:
            return self._reopen
        return ArrayTable, (self.arrays, self.where)

    def __len__(self) -> int:
        return self._length

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, np.int64)
        return {name: array[indices] for name, array in self.arrays.items()}

    def column(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def select(self, names: Sequence[str]) -> Table:
        return ArrayTable({name: self.arrays[name] for name in names}, self.where)


class RecordTable(Table):
    """A user's random-access source of dict records (grain's protocol)."""

    def __init__(self, source, where: str):
        self.source, self.where = source, where
        if not len(source):
            raise DataError(f"{where} holds no records")
        try:
            first = source[0]
        except Exception as e:  # the user's own code failed: say where, in one line
            raise DataError(f"{where}[0] failed: {type(e).__name__}: {first_line(e)}") from None
        if not isinstance(first, Mapping):
            raise DataError(
                f"{where}[0] is a {type(first).__name__}; records must be dicts of arrays, e.g. "
                "{'x': features, 'label': 3}"
            )
        self.columns = tuple(first)

    def __len__(self) -> int:
        return len(self.source)

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        from jddp.data.loader import read_batch  # the loader's own reading of a grain source

        batch = read_batch(self.source, np.asarray(indices, np.int64))
        return {name: stacked(name, values, self.where) for name, values in batch.items()}


class ParquetTable(Table):
    """A Parquet file's `columns` (only those), read a row group at a time: a batch decodes only
    the row groups its rows are in, one after the other, and the most recently used stay decoded
    up to `ROW_GROUP_CACHE_BYTES` (a small file is decoded once; a large one never whole)."""

    def __init__(self, path: str, where: str, columns: tuple[str, ...] | None = None):
        import pyarrow.parquet as pq

        self.path, self.where = path, where
        try:
            metadata = pq.read_metadata(path)
            schema = metadata.schema.to_arrow_schema()
        except Exception as e:  # pyarrow's ArrowInvalid / OSError: not Parquet, truncated
            raise DataError(
                f"{where} is not a readable Parquet file ({first_line(e)}); write one with "
                "pandas' DataFrame.to_parquet or pyarrow.parquet.write_table"
            ) from None
        self.columns = tuple(columns) if columns is not None else tuple(schema.names)
        sizes = [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]
        self._group_first = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._length = metadata.num_rows
        if not self._length:
            raise DataError(f"{where} holds no rows")
        self._file, self._decoded, self._lock = None, OrderedDict(), threading.Lock()
        self.row_groups_read = 0  # decodes so far (a row group decoded again counts again)

    def __reduce__(self):  # loader workers open the file themselves
        return ParquetTable, (self.path, self.where, self.columns)

    def __len__(self) -> int:
        return self._length

    @property
    def decoded_bytes(self) -> int:
        """The bytes of the row groups kept decoded now."""
        return sum(table.nbytes for table in self._decoded.values())

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        import pyarrow as pa

        indices = np.asarray(indices, np.int64)
        groups = np.searchsorted(self._group_first, indices, "right") - 1
        pieces = []
        with self._lock:  # loader threads share the file and the decoded row groups
            for group in np.unique(groups) if len(indices) else [0]:  # no rows: group 0's types
                rows = indices[groups == group] - self._group_first[group]
                pieces.append(self._row_group(int(group)).take(rows))
                self._forget(ROW_GROUP_CACHE_BYTES)
        # The pieces hold the batch's rows grouped by row group: put them back in batch order.
        table = pa.concat_tables(pieces).take(np.argsort(np.argsort(groups, kind="stable")))
        return {name: arrow_to_numpy(table.column(name), name, self.where) for name in self.columns}

    def column(self, name: str) -> np.ndarray:
        groups = range(len(self._group_first) - 1)
        with self._lock:
            parts = [self._read(group, [name]).column(name) for group in groups]
        return np.concatenate([arrow_to_numpy(part, name, self.where) for part in parts])

    def select(self, names: Sequence[str]) -> Table:
        return ParquetTable(self.path, self.where, tuple(names))

    def _row_group(self, group: int):
        """Row group `group`'s columns, decoded now or kept from before (the newest last)."""
        table = self._decoded.pop(group, None)
        if table is None:
            table = self._read(group, list(self.columns))
            self.row_groups_read += 1
        self._decoded[group] = table
        return table

    def _forget(self, keep_bytes: int) -> None:
        """Drop the least recently used row groups until those kept fit in `keep_bytes`."""
        while self._decoded and self.decoded_bytes > keep_bytes:
            self._decoded.popitem(last=False)

    def _read(self, group: int, columns: list[str]):
        import pyarrow.parquet as pq

        try:
            if self._file is None:
                self._file = pq.ParquetFile(self.path)
            return self._file.read_row_group(group, columns=columns)
        except OSError as e:
            if e.errno is not None:  # the file system's error: a later try may read it
                raise DataUnreadable(
                    f"{self.where} cannot be read: {first_line(e)}; run again once it can"
                ) from None
            raise DataError(f"{self.where} cannot be read: {first_line(e)}") from None
        except Exception as e:  # a damaged row group
            raise DataError(f"{self.where} cannot be read: {first_line(e)}") from None


def arrow_to_numpy(array, name: str, where: str) -> np.ndarray:
    """An Arrow column as numpy: lists of one length become an axis, strings an object array."""
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise DataError(
            f"column {name!r} of {where} has {array.null_count} missing values; fill or drop them"
        )
    kind = array.type
    listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    if listed and pa.types.is_struct(kind.value_type):  # lists of records (chat messages)
        return object_column(array.to_pylist())
    if listed or pa.types.is_fixed_size_list(kind):
        lengths = np.unique(array.value_lengths().to_numpy()) if len(array) else np.array([0])
        if len(lengths) > 1:
            raise DataError(
                f"column {name!r} of {where} is ragged: its rows have {lengths[0]} and "
                f"{lengths[1]} values; pad or cut them to one length"
            )
        values = arrow_to_numpy(array.flatten(), name, where)
        return values.reshape(len(array), int(lengths[0]), *values.shape[1:])
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return np.array(array.to_pylist(), dtype=object)
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
        raise DataError(
            f"column {name!r} of {where} holds {kind}; columns must be numbers, lists of numbers "
            "or strings"
        )
    return array.to_numpy(zero_copy_only=False)


class HfTable(Table):
    """A Hugging Face `datasets.Dataset`: its Arrow files stay memory-mapped; a batch is decoded by
    `datasets`' own numpy formatting (images to arrays, ClassLabel to ints)."""

    def __init__(self, dataset, where: str):
        self.dataset = dataset.with_format("numpy")
        self.where, self.columns = where, tuple(dataset.column_names)
        if not len(dataset):
            raise DataError(f"{where} holds no rows")

    def __len__(self) -> int:
        return len(self.dataset)

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        batch = self.dataset[[int(i) for i in indices]]
        return {name: stacked(name, batch[name], self.where) for name in self.columns}

    def select(self, names: Sequence[str]) -> Table:
        return HfTable(self.dataset.select_columns(list(names)), self.where)

    def declared_classes(self, name: str) -> int | None:
        feature = self.dataset.features.get(name)
        return feature.num_classes if type(feature).__name__ == "ClassLabel" else None
