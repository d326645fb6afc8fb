"""Packing (`data.packing=true`, jddp/data/packing.py): several instruction examples per row,
kept apart by segment ids and positions that restart per example, train what the same examples
padded one per row train: on one device (GPT's learned positions, Llama's rotary ones with a
sliding window shorter than most examples), on 8 devices with a context axis (the ring) and with
tensor and sequence parallelism; the rows save padding; bad settings are one line."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp import data, models
from jddp.core import layer_stacks
from jddp.data import packing
from jddp.errors import ConfigError
from jddp.parallel.pipeline.options import PipelineOptions
from jddp.parallel.rules import adapt_preset
from jddp.parallel.strategies import device_mesh_for
from jddp.run.objectives import objective_for
from tests.chat_tokenizer import LLAMA3, save_chat_tokenizer
from tests.reference import assert_trees_close, plain_training
from tests.test_instruction_data import opened, write_jsonl

SEQ_LEN, WINDOW, STEPS, LR = 64, 24, 3, 0.1
SCALE = 3.0  # on the initial weights (see reference_run)


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    """(spec, padded rows, packed rows) of 14 short chats, and the packing log line."""
    root = tmp_path_factory.mktemp("packing")
    tokenizer = save_chat_tokenizer(root / "llama3", LLAMA3)
    rng = np.random.default_rng(0)
    words = "waves fold into foam salt wind over grey water".split()
    rows = [
        {"messages": [{"role": "user", "content": " ".join(rng.choice(words, 1 + i % 2))},
                      {"role": "assistant", "content": " ".join(rng.choice(words, 1 + i % 5))}]}
        for i in range(14)
    ]  # fmt: skip
    name = write_jsonl(root / "chats.jsonl", rows)
    # Every token counts, those next to a boundary between examples too.
    _, padded = opened(f"jsonl:{name}", tokenizer, SEQ_LEN, eval_path=name, loss_on="all")
    spec, packed = opened(
        f"jsonl:{name}", tokenizer, SEQ_LEN, eval_path=name, loss_on="all", packing=True
    )
    line = packing.summary(spec.name, packed.train)  # what opening it logs
    return spec, padded, packed, line


def batches_of(split):
    return split.transform(split.train.read_batch(np.arange(len(split.train))))


def model_for(spec, family, window=0, **fields):
    common = dict(vocab_size=spec.num_classes, num_layers=2, num_heads=2, embed_dim=16)
    if family == "gpt":
        return models.MODELS["gpt"](**common, max_seq_len=SEQ_LEN, **fields)
    return models.MODELS["llama"](
        **common, num_kv_heads=1, max_seq_len=SEQ_LEN, sliding_window=window, **fields
    )


def reference_run(model, batch):
    """STEPS of SGD on one device from the initial weights x SCALE over the padded batch (one
    example per row): the mean loss over its counted tokens, written here from the mask."""
    initial = jax.jit(model.init)(jax.random.key(1), batch["inputs"][:1])["params"]
    # GPT-2's initial weights (0.02) attend almost uniformly to almost nothing; larger ones
    # make what each token attends to matter to the loss
    initial = jax.tree.map(lambda x: x * SCALE, initial)

    def masked_mean(params, state, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(losses * batch["loss_mask"]) / jnp.sum(batch["loss_mask"]), state

    params, _, losses = plain_training(masked_mean, initial, {}, optax.sgd(LR), [batch] * STEPS)
    return initial, params, losses


def packed_loss(model):
    def loss(params, state, batch):
        logits = model.apply(
            {"params": params},
            batch["inputs"],
            segment_ids=batch["segment_ids"],
            positions=batch["positions"],
        )
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(losses * batch["loss_mask"]) / jnp.sum(batch["loss_mask"]), state

    return loss


def test_rows_are_packed_greedily_in_order_and_save_padding(splits):
    """Each row holds consecutive examples, their tokens unchanged, each starting at position 0
    with its own segment id; a row closes at the first example that does not fit; the loss
    counts what the padded rows count, less nothing; the log line gives the padding saved."""
    _, padded, packed, line = splits
    lengths = [int(padded.train.starts[i + 1] - padded.train.starts[i]) for i in range(14)]
    assert len(packed.train) < len(padded.train)
    following = 0
    for index in range(len(packed.train)):
        row = packed.train[index]
        segments = row["segments"]
        for segment in range(1, segments.max() + 1):
            where = np.flatnonzero(segments == segment)
            n = lengths[following]
            np.testing.assert_array_equal(row["positions"][where], np.arange(n))
            start = padded.train.starts[following]
            expected = padded.train.tokens[start : start + n]
            np.testing.assert_array_equal(row["tokens"][where], expected)
            following += 1
        if following < len(lengths):  # the next example would not have fit
            assert (segments > 0).sum() + lengths[following] > SEQ_LEN + 1
    assert following == 14
    one, many = batches_of(padded), batches_of(packed)
    assert many["loss_mask"].sum() == one["loss_mask"].sum()
    used = int(padded.train.starts[-1])
    assert line.startswith("packing jsonl:")
    assert f"14 train examples in {len(packed.train)} rows of {SEQ_LEN + 1} tokens" in line
    assert f"{1 - used / (len(packed.train) * (SEQ_LEN + 1)):.1%} of the tokens" in line
    assert f"{1 - used / (14 * (SEQ_LEN + 1)):.1%} with one example per row" in line


def test_packed_rows_train_what_padded_rows_train_on_one_device(splits):
    """GPT (learned positions; Llama's rotary ones and its window: on 8 devices below): 3 SGD
    steps on the packed rows give the padded rows' losses and parameters within 1e-5; without
    the segment ids the same rows train something else."""
    spec, padded, packed, _ = splits
    model = model_for(spec, "gpt")
    initial, expected, expected_losses = reference_run(model, batches_of(padded))
    params, _, losses = plain_training(
        packed_loss(model), initial, {}, optax.sgd(LR), [batches_of(packed)] * STEPS
    )
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(params, expected)
    # Without segment ids the examples see each other.
    batch = {k: v for k, v in batches_of(packed).items() if k != "segment_ids"}
    crossing = lambda p, s, b: packed_loss(model)(p, s, b | {"segment_ids": None})  # noqa: E731
    _, _, losses = plain_training(crossing, initial, {}, optax.sgd(LR), [batch] * STEPS)
    assert abs(losses[0] - expected_losses[0]) > 1e-3


@pytest.mark.parametrize(
    "mesh,pipeline",
    [
        ("context:2,fsdp:4", None),
        ("data:2,fsdp:2,tensor:2", None),
        ("stage:2,fsdp:4", PipelineOptions(2, "1f1b")),
    ],
)
def test_packed_rows_train_what_padded_rows_train_on_eight_devices(splits, mesh, pipeline):
    """Llama with a sliding window shorter than most examples on context:2,fsdp:4 (ring
    attention, segment ids split over the context axis as the tokens are) and on
    data:2,fsdp:2,tensor:2 with sequence parallelism, and 1F1B on stage:2,fsdp:4 (each
    micro-batch's ids go with it to every stage), routed by the spec's input_key: 3 steps equal
    the padded rows' plain loop within 1e-5."""
    spec, padded, packed, _ = splits
    batch = batches_of(packed)
    rows = -len(batch["inputs"]) % 4  # whole rows of padding, so that fsdp:4 splits the rows
    batch = {name: np.concatenate([x, np.zeros((rows, *x.shape[1:]), x.dtype)]) for name, x in
             batch.items()}  # fmt: skip
    model = model_for(spec, "llama", WINDOW)
    initial, expected, expected_losses = reference_run(model, batches_of(padded))
    mesh = device_mesh_for("zero3", mesh, jax.devices())
    layout = {"context_axis": "context"} if mesh.context_axis else {"sequence_parallel": True}
    layout["scan_layers"] = pipeline is not None

    trainer = jddp.Trainer(
        model.clone(tensor_axis=mesh.tensor_axis, **layout),
        objective_for(spec.kind, masked=True).loss_fn,
        optax.sgd(LR),
        input_key=spec.model_inputs,
        strategy="zero3",
        mesh=mesh,
        rules=adapt_preset(models.tensor_rules("llama", model, mesh.size("tensor")), mesh),
        min_shard_size=1,
        pipeline=pipeline,
    )
    stacked = pipeline is not None  # a stage holds its layers stacked: the same parameters
    start = layer_stacks.to_stacked(initial) if stacked else initial
    state = trainer.replace_state(trainer.init(0, batch), params=start)
    losses = []
    for _ in range(STEPS):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    params = trainer.host_state(state).params
    params = layer_stacks.to_per_layer(params) if stacked else params
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(params, expected)


def test_packing_data_without_examples_is_one_line():
    with pytest.raises(ConfigError, match=r"^data.packing=true packs instruction data.*clear"):
        data.get_dataset("digits", options=data.DataOptions(packing=True))
