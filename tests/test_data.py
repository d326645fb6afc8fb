"""Input pipeline: the same global batches whatever the process count, resumable from a saved
state, every eval example once."""

import json

import numpy as np
import pytest

from jddp import data
from jddp.errors import ConfigError, DataError

N = 103  # deliberately prime: no batch size divides it


def indexed_source(n=N):
    """Examples that carry their own index, so a batch tells exactly which examples it holds."""
    return [{"index": np.int64(i), "image": np.full((2, 2), i, np.uint8)} for i in range(n)]


def identity(batch, keys=None):
    return batch


def take(iterator, count):
    return [next(iterator) for _ in range(count)]


def batches(count, source=None, **kwargs):
    kwargs = {"global_batch_size": 16, "seed": 1, **kwargs}
    return take(data.train_batches(source or indexed_source(), identity, **kwargs), count)


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for name in x:
            np.testing.assert_array_equal(x[name], y[name])


def test_each_epoch_is_a_permutation_from_seed_and_epoch():
    epochs = [b["index"] for b in batches(3, global_batch_size=N, seed=5)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(N))
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled each epoch
    assert_same_batches(
        batches(3, global_batch_size=N, seed=5), batches(3, global_batch_size=N, seed=5)
    )
    other_seed = batches(1, global_batch_size=N, seed=6)[0]["index"]
    assert not np.array_equal(other_seed, epochs[0])


def test_batches_run_across_epoch_boundaries_without_dropping_examples():
    # 16 does not divide 103: global batch 6 holds the end of epoch 0 and the start of epoch 1.
    stream = np.concatenate([b["index"] for b in batches(13)])  # 208 = 2 x 103 + 2 examples
    assert sorted(stream[:N]) == list(range(N)) and sorted(stream[N : 2 * N]) == list(range(N))


@pytest.mark.parametrize("process_count", [2, 4])
def test_processes_read_disjoint_rows_of_the_same_global_batches(process_count):
    whole = batches(10)
    parts = [
        batches(10, process_index=p, process_count=process_count) for p in range(process_count)
    ]
    for step in range(10):
        rows = np.concatenate([parts[p][step]["index"] for p in range(process_count)])
        np.testing.assert_array_equal(rows, whole[step]["index"])


def test_start_step_resumes_the_same_sequence():
    full = batches(20, global_batch_size=8, seed=2)
    assert_same_batches(full[13:], batches(7, global_batch_size=8, seed=2, start_step=13))


def test_saved_state_restores_the_batches_after_the_last_one_consumed():
    """Through device prefetch: batches queued on the devices but not yet consumed are read again
    after a restore; the state survives JSON; a restored pipeline may split over 2 processes."""
    reference = batches(12)
    placed = data.prefetch_to_device(
        data.train_batches(indexed_source(), identity, global_batch_size=16, seed=1),
        place=lambda batch: batch,
        size=2,
    )
    assert_same_batches(take(placed, 7), reference[:7])
    state = json.loads(json.dumps(placed.get_state()))
    assert state["step"] == 7  # 7 consumed, though 9 were read and placed

    restored = data.prefetch_to_device(
        data.train_batches(indexed_source(), identity, global_batch_size=16, seed=1), lambda b: b
    )
    restored.set_state(state)
    assert_same_batches(take(restored, 5), reference[7:12])

    halves = []
    for p in range(2):
        pipeline = data.train_batches(
            indexed_source(), identity, global_batch_size=16, seed=1, process_index=p,
            process_count=2,
        )  # fmt: skip
        pipeline.set_state(state)
        halves.append(take(pipeline, 5))
    for step in range(5):
        rows = np.concatenate([halves[0][step]["index"], halves[1][step]["index"]])
        np.testing.assert_array_equal(rows, reference[7 + step]["index"])


def test_state_of_another_run_is_refused():
    saved = data.train_batches(indexed_source(), identity, global_batch_size=16, seed=1)
    next(saved)
    other = data.train_batches(indexed_source(), identity, global_batch_size=32, seed=1)
    with pytest.raises(DataError, match=r"global_batch_size was 16, is 32.*config of the saved"):
        other.set_state(saved.get_state())


def test_loader_worker_processes_give_the_same_batches():
    source = data.ArraySource({"index": np.arange(N), "image": np.zeros((N, 2, 2))})
    reference = batches(9, source=source)
    with_workers = data.train_batches(
        source, identity, global_batch_size=16, seed=1, start_step=2, workers=2
    )
    try:
        assert_same_batches(take(with_workers, 7), reference[2:9])  # across an epoch boundary
    finally:
        with_workers.close()


def test_batch_that_does_not_split_over_processes_is_refused():
    with pytest.raises(ConfigError, match="global_batch_size=10 does not split over 4 processes"):
        data.train_batches(
            indexed_source(), identity, global_batch_size=10, seed=0, process_count=4
        )


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
    for batches_of_process in per_process:
        for batch in batches_of_process:
            assert len(batch["mask"]) == batch_size // process_count  # padded to a fixed size
            seen.extend(batch["index"][batch["mask"] == 1].tolist())
            assert not batch["index"][batch["mask"] == 0].any()  # padding rows are zeros
    assert sorted(seen) == list(range(N))


def test_digits_dataset_prepares_through_tfds_and_splits_fixed():
    dataset = data.open_dataset(data.get_dataset("digits"))
    train, test = dataset.train, dataset.eval
    assert (len(train), len(test)) == (1437, 360)
    batch = dataset.sample_batch()
    assert batch["image"].shape == (1, 8, 8, 1) and batch["image"].dtype == np.float32
    assert 0.0 <= batch["image"].min() and batch["image"].max() <= 1.0
    labels = [int(test[i]["label"]) for i in range(len(test))]
    assert set(labels) == set(range(10))
    # Train and test hold different images (a fixed hold-out, not a resample).
    train_images = {train[i]["image"].tobytes() for i in range(len(train))}
    overlap = sum(test[i]["image"].tobytes() in train_images for i in range(len(test)))
    assert overlap == 0


def test_unknown_dataset_lists_close_names():
    with pytest.raises(ConfigError, match="unknown dataset 'digitz'.*digits"):
        data.get_dataset("digitz")
    with pytest.raises(ConfigError, match=r"'fashion_mnst' \(close: fashion_mnist"):
        data.get_dataset("fashion_mnst")


def test_prefetch_to_device_keeps_order_and_places_each_batch_once():
    placed = []

    def place(batch):
        placed.append(batch)
        return ("placed", batch)

    out = list(data.prefetch_to_device(iter(range(7)), place, size=2))
    assert out == [("placed", i) for i in range(7)]
    assert placed == list(range(7))
