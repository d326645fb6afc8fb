"""Sequence parallelism (Megatron-SP): the same numerics as one device on every mesh, its
reduce-scatter / all-gather pairs instead of all-reduces, and less activation memory."""

import pytest

from jddp.observe.memory import peak_bytes
from tests.helpers import compiled_train_step
from tests.tiny_gpt import (
    BATCH,
    LAYERS,
    SEQ,
    SEQUENCE_CASES,
    WIDTH,
    assert_copies_identical,
    gpt_trainer,
    tensor_group_ops,
    token_batches,
    train_and_compare,
)


@pytest.mark.parametrize("mesh,strategy", SEQUENCE_CASES)
def test_gpt_with_sequence_parallelism_matches_one_device(mesh, strategy):
    _, state = train_and_compare(mesh, strategy, sp=True)
    assert_copies_identical(state)


def test_compiled_step_pairs_reduce_scatter_with_all_gather_and_holds_less():
    """fsdp:2,tensor:4 under zero3: each all-reduce of the activations becomes a reduce-scatter
    along the sequence plus an all-gather, on the tensor groups: per block 2 + 2 forward and
    2 + 2 backward, one pair more for the vocabulary-parallel embedding and head; no all-reduce
    of activations is left. The compiled step's peak is lower than without SP."""
    batch = token_batches(steps=1)[0]
    activation = (BATCH // 2) * SEQ * WIDTH * 4
    peaks = {}
    for sp in (False, True):  # the peaks as Trainer.memory_report reads them (no state needed)
        trainer = gpt_trainer("zero3", "fsdp:2,tensor:4", sp)
        peaks[sp] = peak_bytes(compiled_train_step(trainer, batch))
    ops = tensor_group_ops(trainer, trainer.abstract_state(batch), batch, tensor=4)
    pairs = 4 * LAYERS + 2
    assert sorted(op for op in ops if op[1] >= activation // 4) == sorted(
        [("all-gather", activation)] * pairs + [("reduce-scatter", activation // 4)] * pairs
    )
    assert peaks[True] < peaks[False]
