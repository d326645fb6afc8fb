"""The benchmarks' warm-up: timed windows start once the process has stopped taking fresh
memory from the OS (experiments/bench/common.py)."""

import mmap

import pytest

from experiments.bench import common

KEPT = []  # memory a window keeps alive, so each piece is memory the process did not hold
PAGES = 4 * common.SETTLED_FAULTS


def take_fresh_pages() -> mmap.mmap:
    """`PAGES` pages the process did not hold, each written (small pages even where the kernel
    would back an anonymous mapping with huge ones)."""
    memory = mmap.mmap(-1, PAGES * mmap.PAGESIZE)
    memory.madvise(mmap.MADV_NOHUGEPAGE)
    memory[:: mmap.PAGESIZE] = b"\x01" * PAGES
    return memory


def window_growing_for(calls: int):
    """A window whose first `calls` runs each take `PAGES` fresh pages (4x
    `SETTLED_FAULTS`), then nothing; returns (window, runs so far)."""
    runs = [0]

    def window() -> float:
        runs[0] += 1
        if runs[0] <= calls:
            KEPT.append(take_fresh_pages())
        return 0.0

    return window, runs


@pytest.fixture(autouse=True)
def _release_kept_memory():
    yield
    KEPT.clear()


def test_warm_up_runs_until_no_window_takes_fresh_pages():
    growing, runs = window_growing_for(3)
    steady, steady_runs = window_growing_for(0)
    rounds = common.warm_up({"growing": growing, "steady": steady})
    assert rounds == 4  # 3 rounds taking memory, then one that took none
    assert runs[0] == steady_runs[0] == 4
    assert common.interleaved_medians({"growing": growing}, 2)["growing"]["minor_faults"] < (
        common.SETTLED_FAULTS
    )


def test_warm_up_runs_every_window_once_more_and_stops_at_the_cap():
    steady, runs = window_growing_for(0)
    assert common.warm_up({"steady": steady}) == 2  # compile round, then one timed as settled
    forever, runs = window_growing_for(100)
    assert common.warm_up({"forever": forever}) == common.MAX_WARM_UP_ROUNDS
    assert runs[0] == common.MAX_WARM_UP_ROUNDS


def test_processes_that_disagree_keep_warming_up():
    steady, runs = window_growing_for(0)
    votes = []

    def another_process_still_growing(settled):
        votes.append(list(settled))
        return False

    assert common.warm_up({"steady": steady}, agree=another_process_still_growing) == (
        common.MAX_WARM_UP_ROUNDS
    )
    assert votes == [[True]] * (common.MAX_WARM_UP_ROUNDS - 1)


def test_each_variant_is_timed_right_between_its_references():
    """A fake clock: each window returns the tick it ran at, so a variant's reference "beside"
    it must be the mean of the ticks just before and just after, and no window may be missed
    or run twice in a row for nothing."""
    ticks, order = iter(range(1000)), []

    def window(name):
        def run() -> float:
            order.append(name)
            return float(next(ticks))

        return run

    variants = {name: window(name) for name in ("a", "b", "pipeline")}
    references = {name: window(name) for name in ("flat", "stacked")}

    def references_of(name):
        return ("flat", "stacked") if name == "pipeline" else ("flat",)

    timings = common.between_references(variants, references, references_of, repeats=2)
    one_round = ["flat", "a", "flat", "b", "flat", "stacked", "pipeline", "flat", "stacked"]
    assert order == one_round * 2
    assert timings["a"]["all_sec"] == [1.0, 10.0]
    assert timings["a"]["beside"] == {"flat": [1.0, 10.0]}  # ticks 0 and 2, 9 and 11
    assert timings["pipeline"]["all_sec"] == [6.0, 15.0]
    assert timings["pipeline"]["beside"] == {"flat": [5.5, 14.5], "stacked": [6.5, 15.5]}
    assert timings["stacked"]["median_sec"] == 11.0  # its windows at 5, 8, 14, 17
