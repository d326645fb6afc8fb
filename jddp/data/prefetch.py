"""Keeping the next batches on the devices while the current step runs (double buffering)."""

import collections
from collections.abc import Callable, Iterator
from typing import Any


def prefetch_to_device(batches: Iterator, place: Callable[[Any], Any], size: int = 2) -> Iterator:
    """Yields `place(batch)` for each batch, with `size` placed batches queued ahead.

    `place` (a `jax.device_put`) returns at once and copies in the background, so the copy of
    batch k+1 overlaps step k.
    """
    queue = collections.deque()
    for batch in batches:
        queue.append(place(batch))
        if len(queue) > size:
            yield queue.popleft()
    while queue:
        yield queue.popleft()
