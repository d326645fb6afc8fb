"""Global batches from a random-access source with grain: deterministic, per-process, read ahead.

Training order: epoch e is the permutation of the split drawn from (seed, e); the epochs are
concatenated and cut into consecutive global batches. Process p of P reads only rows
[p*G/P, (p+1)*G/P) of each global batch, so the global batch is the same whatever the number of
processes and devices, and resuming at step s is indexing from batch s.
"""

from collections.abc import Callable, Iterator

import grain
import numpy as np

from jddp.data.padding import pad_batch

Example = dict[str, np.ndarray]


def _read_options(threads: int) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4 * threads)


def train_batches(
    source,
    preprocess: Callable[[Example], Example],
    *,
    global_batch_size: int,
    seed: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    threads: int = 4,
) -> Iterator[Example]:
    """Endless iterator over this process's rows of global batch `start_step`, then the next..."""
    rows = global_batch_size // process_count
    batches = (
        grain.MapDataset.source(source)
        .shuffle(seed=seed % 2**32)
        .repeat()
        .batch(rows)
        .map(preprocess)
    )
    mine = batches[process_index::process_count][start_step:]
    return iter(mine.to_iter_dataset(_read_options(threads)))


def eval_batches(
    source,
    preprocess: Callable[[Example], Example],
    *,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    threads: int = 4,
) -> Iterator[Example]:
    """Every example of `source` once, in order, as `mask`ed global batches of `batch_size`.

    The last batch is zero-padded; every process yields the same number of batches (all padding
    where it has no rows left), so collectives in the eval step always line up.
    """
    rows = batch_size // process_count
    num_batches = -(-len(source) // batch_size)
    batched = grain.MapDataset.source(source).batch(rows, drop_remainder=False).map(preprocess)
    template = {name: x[:0] for name, x in batched[0].items()}
    yielded = 0
    for batch in batched[process_index::process_count].to_iter_dataset(_read_options(threads)):
        yield pad_batch(batch, rows)
        yielded += 1
    for _ in range(num_batches - yielded):
        yield pad_batch(template, rows)
