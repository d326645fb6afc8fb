"""Input pipeline: the same global batches whatever the process count, every eval example once."""

import numpy as np
import pytest

from jddp import data
from jddp.errors import ConfigError

N = 103  # deliberately prime: no batch size divides it


def indexed_source(n=N):
    """Examples that carry their own index, so a batch tells exactly which examples it holds."""
    return [{"index": np.int64(i), "image": np.full((2, 2), i, np.uint8)} for i in range(n)]


def identity(batch):
    return batch


def take(iterator, count):
    return [next(iterator) for _ in range(count)]


def test_each_epoch_is_a_permutation_from_seed_and_epoch():
    batches = take(data.train_batches(indexed_source(), identity, global_batch_size=N, seed=5), 3)
    epochs = [b["index"] for b in batches]
    for epoch in epochs:
        assert sorted(epoch) == list(range(N))
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled each epoch
    again = take(data.train_batches(indexed_source(), identity, global_batch_size=N, seed=5), 3)
    for a, b in zip(batches, again, strict=True):
        np.testing.assert_array_equal(a["index"], b["index"])
    other_seed = next(data.train_batches(indexed_source(), identity, global_batch_size=N, seed=6))
    assert not np.array_equal(other_seed["index"], epochs[0])


@pytest.mark.parametrize("process_count", [2, 4])
def test_processes_read_disjoint_rows_of_the_same_global_batches(process_count):
    whole = take(data.train_batches(indexed_source(), identity, global_batch_size=16, seed=1), 10)
    parts = [
        take(
            data.train_batches(
                indexed_source(),
                identity,
                global_batch_size=16,
                seed=1,
                process_index=p,
                process_count=process_count,
            ),
            10,
        )
        for p in range(process_count)
    ]
    for step in range(10):
        rows = np.concatenate([parts[p][step]["index"] for p in range(process_count)])
        np.testing.assert_array_equal(rows, whole[step]["index"])


def test_start_step_resumes_the_same_sequence():
    full = take(data.train_batches(indexed_source(), identity, global_batch_size=8, seed=2), 20)
    resumed = take(
        data.train_batches(indexed_source(), identity, global_batch_size=8, seed=2, start_step=13),
        7,
    )
    for a, b in zip(full[13:], resumed, strict=True):
        np.testing.assert_array_equal(a["index"], b["index"])


@pytest.mark.parametrize("batch_size,process_count", [(16, 1), (16, 2), (8, 4), (103, 1), (200, 2)])
def test_eval_batches_hold_every_example_exactly_once(batch_size, process_count):
    per_process = [
        list(
            data.eval_batches(
                indexed_source(),
                identity,
                batch_size=batch_size,
                process_index=p,
                process_count=process_count,
            )
        )
        for p in range(process_count)
    ]
    counts = {len(batches) for batches in per_process}
    assert counts == {-(-N // batch_size)}  # same number of batches in every process
    seen = []
    for batches in per_process:
        for batch in batches:
            assert len(batch["mask"]) == batch_size // process_count  # padded to a fixed size
            seen.extend(batch["index"][batch["mask"] == 1].tolist())
            assert not batch["index"][batch["mask"] == 0].any()  # padding rows are zeros
    assert sorted(seen) == list(range(N))


def test_digits_dataset_prepares_through_tfds_and_splits_fixed():
    spec = data.get_dataset("digits")
    train, test = data.open_splits(spec)
    assert (len(train), len(test)) == (1437, 360)
    batch = spec.preprocess(train[0])
    assert batch["image"].shape == (8, 8, 1) and batch["image"].dtype == np.float32
    assert 0.0 <= batch["image"].min() and batch["image"].max() <= 1.0
    labels = [int(test[i]["label"]) for i in range(len(test))]
    assert set(labels) == set(range(10))
    # Train and test hold different images (a fixed hold-out, not a resample).
    train_images = {train[i]["image"].tobytes() for i in range(len(train))}
    overlap = sum(test[i]["image"].tobytes() in train_images for i in range(len(test)))
    assert overlap == 0


def test_unknown_dataset_lists_names():
    with pytest.raises(ConfigError, match="unknown dataset 'digitz'.*digits"):
        data.get_dataset("digitz")


def test_prefetch_to_device_keeps_order_and_places_each_batch_once():
    placed = []

    def place(batch):
        placed.append(batch)
        return ("placed", batch)

    out = list(data.prefetch_to_device(iter(range(7)), place, size=2))
    assert out == [("placed", i) for i in range(7)]
    assert placed == list(range(7))
