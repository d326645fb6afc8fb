"""Own data in bounded memory (docs/data.md, "What stays in memory"): a text file is read a
window at a time, never whole, and a Parquet file a row group at a time; the batches are the
ones the whole file gives, checked against references computed here from the raw files."""

import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jddp import data
from jddp.data import tables, text
from jddp.data.loader import eval_batches, train_batches
from jddp.errors import DataError
from tests.helpers import assert_one_line, run_in_fresh_process

SEQ_LEN = 16
ALPHABETS = {"ascii": "abcdefgh ,.\n", "utf8": "hé wörld\n€😀"}  # 1- to 4-byte characters


def unchanged(batch, keys=None):
    return batch


def reference_tokens(corpus: str) -> np.ndarray:
    """The corpus's token ids by hand: character -> its rank among the sorted distinct ones."""
    rank = {character: i for i, character in enumerate(sorted(set(corpus)))}
    return np.array([rank[character] for character in corpus], np.int32)


def reference_windows(tokens: np.ndarray, length: int) -> np.ndarray:
    """Every window of `length` tokens, one every SEQ_LEN, in order."""
    starts = range(0, len(tokens) - length + 1, SEQ_LEN)
    return np.stack([tokens[start : start + length] for start in starts])


@pytest.mark.parametrize("alphabet", ALPHABETS)
def test_text_file_batches_are_the_windows_of_the_whole_file(alphabet, tmp_path, monkeypatch):
    # Scan chunks and index blocks far smaller than a file, so reads cross both, and chunks
    # end inside characters.
    monkeypatch.setattr(text, "SCAN_CHUNK_BYTES", 256)
    monkeypatch.setattr(text, "INDEX_BLOCK_BYTES", 64)
    corpus = "".join(np.random.default_rng(0).choice(list(ALPHABETS[alphabet]), 6000))
    path = tmp_path / "corpus.txt"
    path.write_text(corpus, encoding="utf-8")
    options = data.DataOptions(text_file=str(path), seq_len=SEQ_LEN)
    spec = data.get_dataset("text_file", options=options)
    assert spec.vocabulary == "".join(sorted(set(corpus)))
    dataset = data.open_dataset(spec, options)

    tokens = reference_tokens(corpus)
    cut = int(len(corpus) * 0.9)
    train, test = reference_windows(tokens[:cut], 2 * SEQ_LEN), reference_windows(tokens[cut:], 17)
    assert len(dataset.train) == len(train) and len(dataset.eval) == len(test)
    every = dataset.train.read_batch(np.arange(len(train)))["tokens"]
    assert every.dtype == np.int32
    np.testing.assert_array_equal(every, train)
    # Tokens in memory (own data's text) are kept a byte each, and read as int32 all the same.
    in_memory = text.language_model_windows(
        text.encode(corpus[:cut], spec.vocabulary, ""), SEQ_LEN, True, ""
    )
    assert in_memory.tokens.nbytes == cut
    batch = in_memory.read_batch(np.arange(len(train)))["tokens"]
    assert batch.dtype == np.int32
    np.testing.assert_array_equal(batch, train)
    np.testing.assert_array_equal(dataset.eval.read_batch(np.arange(len(test)))["tokens"], test)

    # The loader's rows of process 1 of 2: epoch 0's permutation drawn from (seed, 0).
    order = np.random.default_rng([3, 0]).permutation(len(train))
    batches = train_batches(
        dataset.train, unchanged, global_batch_size=8, seed=3, process_index=1, process_count=2
    )
    for step in range(3):
        rows = order[step * 8 + 4 : step * 8 + 8]
        np.testing.assert_array_equal(next(batches)["tokens"], train[rows])
    last = list(eval_batches(dataset.eval, unchanged, batch_size=8))[-1]
    np.testing.assert_array_equal(last["tokens"][last["mask"] > 0], test[-(len(test) % 8 or 8) :])

    # A loader worker gets the index, not the text, and reads the same windows.
    shipped = pickle.dumps(dataset.train)
    assert corpus[:200].encode() not in shipped
    np.testing.assert_array_equal(pickle.loads(shipped).read_batch([5, 2])["tokens"], train[[5, 2]])

    # A file changed under a run is one line, not other windows.
    with open(path, "a", encoding="utf-8") as f:
        f.write("Z" + corpus[:100])  # and a new character
    with pytest.raises(DataError) as error:
        pickle.loads(shipped).read_batch([0])
    assert_one_line(error, "changed since it was read")
    with pytest.raises(DataError) as error:
        data.open_dataset(spec, options)
    assert_one_line(error, "changed since its vocabulary was read")


# Peak resident memory while a 200 MiB text file is opened and batches are read, against the
# resident memory before (the whole file tokenized at once took 3.8 GB here).
FLAT_TEXT = """
import json
import numpy as np
from jddp import data
from jddp.data.loader import train_batches

def megabytes(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))

options = data.DataOptions(text_file=PATH, seq_len=64)
before = megabytes("VmRSS:")
spec = data.get_dataset("text_file", options=options)
dataset = data.open_dataset(spec, options)
batches = train_batches(dataset.train, lambda batch, keys: batch, global_batch_size=32, seed=0)
batch = [next(batches) for _ in range(3)][-1]
peak = megabytes("VmHWM:")
order = np.random.default_rng([0, 0]).permutation(len(dataset.train))[64:96]
print(json.dumps({"grown_mb": peak - before, "windows": len(dataset.train),
                  "vocabulary": spec.vocabulary, "tokens": batch["tokens"].tolist(),
                  "starts": (order * 64).tolist()}))
"""
FLAT_BOUND_MB = 64


def test_a_200_mb_text_file_is_read_in_flat_memory(tmp_path):
    piece = np.random.default_rng(0).choice(np.frombuffer(b"abcdefgh ,.\n", np.uint8), 2**20)
    path = tmp_path / "big.txt"
    with open(path, "wb") as f:
        for _ in range(200):  # 200 MiB
            f.write(piece.tobytes())
    try:
        result = run_in_fresh_process(FLAT_TEXT.replace("PATH", repr(str(path))))
        windows = []
        with open(path, "rb") as f:  # the third batch's windows, straight from the bytes
            for start in result["starts"]:
                f.seek(start)
                windows.append(f.read(128))
    finally:
        path.unlink()  # pytest keeps the last runs' tmp_path folders
    assert result["grown_mb"] < FLAT_BOUND_MB, result["grown_mb"]

    size, vocabulary = 200 * 2**20, sorted(set(piece.tobytes().decode()))
    assert result["vocabulary"] == "".join(vocabulary)
    assert result["windows"] == (int(size * 0.9) - 128) // 64 + 1
    rank = {ord(character): i for i, character in enumerate(vocabulary)}
    assert result["tokens"] == [[rank[octet] for octet in window] for window in windows]


def test_parquet_is_read_a_row_group_at_a_time(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 64)).astype(np.float32)
    label = rng.integers(0, 10, 2000)
    path = str(tmp_path / "rows.parquet")
    pq.write_table(pa.table({"x": list(x), "label": label}), path, row_group_size=100)
    group_bytes = pq.ParquetFile(path).read_row_group(0).nbytes

    # Kept decoded between batches: at most two row groups.
    monkeypatch.setattr(tables, "ROW_GROUP_CACHE_BYTES", 2 * group_bytes)
    table = tables.ParquetTable(path, "rows.parquet")
    rows = np.array([1234, 305, 399, 1201, 300])  # row groups 12 and 3, out of order
    batch = table.read_batch(rows)
    np.testing.assert_array_equal(batch["x"], x[rows])
    np.testing.assert_array_equal(batch["label"], label[rows])
    assert table.row_groups_read == 2
    assert len(table.read_batch([])["label"]) == 0

    shuffled = rng.permutation(2000)[:64]
    batch = table.read_batch(shuffled)
    np.testing.assert_array_equal(batch["x"], x[shuffled])
    touched = len(np.unique(shuffled // 100))
    assert table.row_groups_read <= 2 + touched
    assert table.decoded_bytes <= tables.ROW_GROUP_CACHE_BYTES

    # In order (evaluation), each row group is decoded once.
    in_order = tables.ParquetTable(path, "rows.parquet").select(["label"])
    every = np.concatenate(
        [in_order.read_batch(np.arange(i, i + 50))["label"] for i in range(0, 2000, 50)]
    )
    np.testing.assert_array_equal(every, label)
    assert in_order.row_groups_read == 20
