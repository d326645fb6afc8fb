"""Keeping the next batches on the devices while the current step runs (double buffering)."""

import collections
from collections.abc import Callable, Iterator
from typing import Any


class DevicePrefetch(Iterator):
    """Yields `place(batch)` for each batch, with `size` placed batches queued ahead.

    `place` (a `jax.device_put`) returns at once and copies in the background, so the copy of
    batch k+1 overlaps step k. If `batches` has `get_state()`, so does this iterator: the state
    after the last batch it *yielded* (batches still queued are read again after a restore).
    """

    def __init__(self, batches: Iterator, place: Callable[[Any], Any], size: int = 2):
        self._batches, self._place, self._size = batches, place, size
        self._queue = collections.deque()
        self._state = self._inner_state()

    def _inner_state(self):
        return self._batches.get_state() if hasattr(self._batches, "get_state") else None

    def __next__(self):
        while len(self._queue) <= self._size:
            try:
                batch = next(self._batches)
            except StopIteration:
                break
            self._queue.append((self._place(batch), self._inner_state()))
        if not self._queue:
            raise StopIteration
        placed, self._state = self._queue.popleft()
        return placed

    def get_state(self):
        return self._state

    def set_state(self, state) -> None:
        self._queue.clear()
        self._batches.set_state(state)
        self._state = state


def prefetch_to_device(batches: Iterator, place: Callable[[Any], Any], size: int = 2):
    """`DevicePrefetch(batches, place, size)`."""
    return DevicePrefetch(batches, place, size)
