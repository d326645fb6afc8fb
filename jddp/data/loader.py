"""Global batches from a random-access source with grain: deterministic, per-process, read ahead.

Training order: epoch e is the permutation of the split drawn from (seed, e); the epochs are
concatenated and cut into consecutive global batches of G examples. Process p of P reads only rows
[p*G/P, (p+1)*G/P) of each global batch, so the global batch at step s is the same whatever the
number of processes and devices, and resuming at step s is reading batch s. (p, P) is the
trainer's `row_block`: the process index and count, unless processes share batch slices, as
pipeline stages on different hosts do; those pass the same p and read the same rows. Example i
of epoch e is augmented with the key of (seed, e, i) (augment.py), so its augmentation does not
depend on where it lands either.

grain turns "step -> batch" into an iterator that reads ahead in `threads` threads and, with
`workers`, in that many processes. Each step's rows are read with one vectorized call and
transformed as a batch: grain's per-example index path costs ~20 us an example, 10% of a small
model's step on a 2-core host.
"""

from collections.abc import Callable, Iterator

import grain
import numpy as np
from absl import flags

from jddp.data.augment import example_keys
from jddp.data.padding import pad_batch
from jddp.errors import ConfigError, DataError

Batch = dict[str, np.ndarray]
Transform = Callable[[Batch, np.ndarray | None], Batch]
_ENDLESS = 2**62  # grain datasets need a length; no run gets near this many steps


def read_batch(source, indices: np.ndarray) -> Batch:
    """The examples at `indices`, stacked per feature (a list where their shapes differ)."""
    if hasattr(source, "read_batch"):
        return source.read_batch(indices)
    indices = [int(i) for i in indices]
    if hasattr(source, "__getitems__"):
        examples = source.__getitems__(indices)
    else:
        examples = [source[i] for i in indices]
    batch = {}
    for name in examples[0]:
        values = [np.asarray(example[name]) for example in examples]
        same_shape = len({value.shape for value in values}) == 1
        batch[name] = np.stack(values) if same_shape else values
    return batch


class _TrainStep:
    """Step s -> this process's rows of global batch s, read and transformed (picklable)."""

    def __init__(self, source, transform, global_batch_size, seed, process_index, process_count):
        self.source, self.transform, self.seed = source, transform, seed
        self.rows = global_batch_size // process_count
        self.global_batch_size, self.first_row = global_batch_size, process_index * self.rows
        self._permutations: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of epoch `epoch`; the last two are kept (a batch rarely spans more)."""
        permutations = self._permutations
        if epoch not in permutations:
            # `permutation(n)` shuffles an int64 arange; int32 gets the same order in half the
            # memory (a large text file has millions of windows).
            count = len(self.source)
            order = np.arange(count, dtype=np.int32 if count < 2**31 else np.int64)
            np.random.default_rng([self.seed % 2**64, epoch]).shuffle(order)
            permutations = {e: p for e, p in permutations.items() if e >= epoch - 1}
            permutations[epoch] = order
            self._permutations = permutations  # one assignment: safe across loader threads
        return permutations[epoch]

    def __getstate__(self):  # worker processes recompute permutations rather than unpickle them
        return {**self.__dict__, "_permutations": {}}

    def __call__(self, step: int) -> Batch:
        start = step * self.global_batch_size + self.first_row
        epochs, offsets = np.divmod(np.arange(start, start + self.rows), len(self.source))
        indices = np.empty(self.rows, np.int64)
        for epoch in np.unique(epochs):
            rows = epochs == epoch
            indices[rows] = self.permutation(int(epoch))[offsets[rows]]
        batch = read_batch(self.source, indices)
        return self.transform(batch, example_keys(self.seed, epochs, indices))


class TrainBatches(Iterator[Batch]):
    """Endless iterator over this process's rows of global batch `start_step`, then the next...

    `get_state()` is a small JSON-able dict (the next step, and what fixes the order);
    `set_state(state)` continues from it, with any number of devices, processes or workers.
    """

    def __init__(self, step_fn: _TrainStep, start_step: int, threads: int, workers: int):
        self._step_fn, self._threads, self._workers = step_fn, threads, workers
        self._step, self._iterator = start_step, None

    def _open(self):
        batches = grain.MapDataset.range(self._step, _ENDLESS).map(self._step_fn)
        batches = batches.to_iter_dataset(_read_options(self._threads))
        if self._workers:
            if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; a library user
                flags.FLAGS.mark_as_parsed()  # (or a test) may not have parsed any
            options = grain.MultiprocessingOptions(num_workers=self._workers)
            batches = batches.mp_prefetch(options)
        return iter(batches)

    def __next__(self) -> Batch:
        if self._iterator is None:  # opened on first use: set_state before then costs nothing
            self._iterator = self._open()
        batch = next(self._iterator)
        if self._workers:
            # Out of grain's shared memory at once: a device array made from it on CPU would alias
            # (and hold) the block, which then outlives the run ("leaked shared_memory objects").
            batch = {name: np.array(x) for name, x in batch.items()}
        self._step += 1
        return batch

    def get_state(self) -> dict:
        fn = self._step_fn
        return {
            "step": self._step,
            "seed": fn.seed,
            "global_batch_size": fn.global_batch_size,
            "num_examples": len(fn.source),
        }

    def misfit(self, state: dict) -> list[str]:
        """How a saved `state` does not fit this iterator ("seed was 0, is 1"); [] if it fits."""
        mine = self.get_state()
        return [
            f"{key} was {state.get(key)!r}, is {mine[key]!r}"
            for key in mine
            if key != "step" and state.get(key) != mine[key]
        ]

    def set_state(self, state: dict) -> None:
        misfit = self.misfit(state)
        if misfit:
            raise DataError(
                f"the saved input pipeline state does not fit this run: {', '.join(misfit)}; "
                "resume with the config of the saved run"
            )
        self.close()
        self._step = int(state["step"])

    def close(self) -> None:
        if self._iterator is not None and hasattr(self._iterator, "close"):
            self._iterator.close()
        self._iterator = None


def _read_options(threads: int) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=max(threads, 1), prefetch_buffer_size=2 * max(threads, 1))


def _check_split(batch_size: int, process_count: int, key: str) -> None:
    if batch_size % process_count:
        raise ConfigError(
            f"{key}={batch_size} does not split over {process_count} processes; use a multiple "
            f"of {process_count}"
        )


def train_batches(
    source,
    transform: Transform,
    *,
    global_batch_size: int,
    seed: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    threads: int = 1,
    workers: int = 0,
) -> TrainBatches:
    """This process's rows of global batch `start_step`, then the next... (see the module doc)."""
    _check_split(global_batch_size, process_count, "global_batch_size")
    step_fn = _TrainStep(source, transform, global_batch_size, seed, process_index, process_count)
    return TrainBatches(step_fn, start_step, threads, workers)


class _EvalBatch:
    """Batch b -> this process's rows of examples [b*E, (b+1)*E), padded and masked."""

    def __init__(self, source, transform, batch_size, process_index, process_count):
        self.source, self.transform = source, transform
        self.batch_size, self.rows = batch_size, batch_size // process_count
        self.first_row = process_index * self.rows

    def __call__(self, b: int) -> Batch:
        start = b * self.batch_size + self.first_row
        indices = np.arange(start, min(start + self.rows, len(self.source)))
        # A process past the end still yields an all-padding batch: its shapes from example 0.
        batch = self.transform(read_batch(self.source, indices if len(indices) else [0]))
        if not len(indices):
            batch = {name: x[:0] for name, x in batch.items()}
        return pad_batch(batch, self.rows)


def eval_batches(
    source,
    transform: Transform,
    *,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    threads: int = 1,
) -> Iterator[Batch]:
    """Every example of `source` once, in order, as `mask`ed global batches of `batch_size`.

    The last batch is zero-padded; every process yields the same number of batches (all padding
    where it has no rows left), so collectives in the eval step always line up.
    """
    _check_split(batch_size, process_count, "eval_batch_size")
    num_batches = -(-len(source) // batch_size)
    load = _EvalBatch(source, transform, batch_size, process_index, process_count)
    batches = grain.MapDataset.range(num_batches).map(load)
    return iter(batches.to_iter_dataset(_read_options(threads)))
