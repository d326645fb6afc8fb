"""Packing (`data.packing=true`, jddp/data/packing.py): several instruction examples per row,
kept apart by segment ids and positions that restart per example, train what the same examples
padded one per row train: on one device (GPT's learned positions, Llama's rotary ones with a
sliding window shorter than most examples), on 8 devices with a context axis (the ring) and with
tensor and sequence parallelism; the rows save padding. Documents of tokenized text keep their
windows and are kept apart within them: segment ids and positions at the windows' edges as the
documents' spans say, and the windows train what each document's piece of them trains alone.
Data with nothing to keep apart is one line."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import logging as absl_logging

import jddp
from jddp import data, models
from jddp.core import layer_stacks
from jddp.data import packing
from jddp.errors import ConfigError
from jddp.losses import LOSS_MASK
from jddp.parallel.pipeline.options import PipelineOptions
from jddp.parallel.rules import adapt_preset
from jddp.parallel.strategies import device_mesh_for
from jddp.run.objectives import objective_for
from tests.chat_tokenizer import LLAMA3, save_chat_tokenizer
from tests.helpers import assert_one_line
from tests.reference import assert_trees_close, plain_training
from tests.test_instruction_data import opened, write_jsonl
from tests.tiny_tokenizer import WORDS, save_tokenizer

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


@pytest.fixture(scope="module")
def windowed_llama_reference(splits):
    """`reference_run` of the windowed Llama on the padded rows: computed once for the layouts
    below."""
    spec, padded, _, _ = splits
    return reference_run(model_for(spec, "llama", WINDOW), batches_of(padded))


@pytest.mark.parametrize(
    "mesh,pipeline",
    [
        ("context:2,fsdp:4", None),
        ("data:2,fsdp:2,tensor:2", None),
        ("stage:2,fsdp:4", PipelineOptions(2, "1f1b")),
    ],
)
def test_packed_rows_train_what_padded_rows_train_on_eight_devices(
    splits, windowed_llama_reference, mesh, pipeline
):
    """Llama with a sliding window shorter than most examples on context:2,fsdp:4 (ring
    attention, segment ids split over the context axis as the tokens are) and on
    data:2,fsdp:2,tensor:2 with sequence parallelism, and 1F1B on stage:2,fsdp:4 (each
    micro-batch's ids go with it to every stage), routed by the spec's input_key: 3 steps equal
    the padded rows' plain loop within 1e-5."""
    spec, _, packed, _ = splits
    batch = batches_of(packed)
    rows = -len(batch["inputs"]) % 4  # whole rows of padding, so that fsdp:4 splits the rows
    batch = {name: np.concatenate([x, np.zeros((rows, *x.shape[1:]), x.dtype)]) for name, x in
             batch.items()}  # fmt: skip
    model = model_for(spec, "llama", WINDOW)
    initial, expected, expected_losses = windowed_llama_reference
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


DOC_SEQ_LEN = 12


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """(the opened packed documents, their train rows as the `tokenizers` library encodes them,
    each with its end-of-document id, the packing log line): 30 documents of 1-6 words, every
    sixth of 20 (longer than a window)."""
    root = tmp_path_factory.mktemp("documents")
    folder = save_tokenizer(root / "tokenizer")
    rng = np.random.default_rng(4)
    rows = [" ".join(rng.choice(WORDS, 20 if i % 6 == 0 else rng.integers(1, 7)))
            for i in range(30)]  # fmt: skip
    write_jsonl(root / "rows.jsonl", [{"text": row} for row in rows])
    options = data.DataOptions(
        tokenizer=folder, eval_fraction=0.1, seq_len=DOC_SEQ_LEN, packing=True
    )
    spec = data.get_dataset(f"jsonl:{root}/rows.jsonl", options=options)
    with pytest.MonkeyPatch.context() as patch:  # the log lines opening writes
        lines = []
        patch.setattr(absl_logging, "info", lambda fmt, *args: lines.append(fmt % args))
        split = data.open_dataset(spec, options)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")
    encoded = [tokenizer.encode(row).ids + [eos] for row in rows[:27]]  # 3 held out
    return spec, split, encoded, [line for line in lines if line.startswith("packing")]


def window_batch(split):
    """Every train window from its start (no random offset), through the spec's transform."""
    return split.transform(split.train.read_batch(np.arange(len(split.train))))


def test_documents_are_kept_apart_within_their_windows(documents):
    """Windows of seq_len + 1 tokens every seq_len, as without packing; in each, a token's
    segment is its document's (1 for the one the window starts in), its position counts from its
    document's start or, cut at the window's edge, from the window's; a target counts unless it
    is the next document's first token. Checked against the documents' spans; resume and
    per-process reads stay exact."""
    spec, split, encoded, lines = documents
    batch = window_batch(split)
    stream = np.concatenate(encoded)
    document_of = np.repeat(np.arange(len(encoded)), [len(d) for d in encoded])
    starts = np.cumsum([0] + [len(d) for d in encoded])
    assert spec.packed and spec.model_inputs == {
        "tokens": "inputs", "segment_ids": "segment_ids", "positions": "positions"}  # fmt: skip
    assert len(batch["inputs"]) == (len(stream) - 2 * DOC_SEQ_LEN) // DOC_SEQ_LEN + 1
    cut, crowded = 0, 0
    for row, first in enumerate(range(0, len(batch["inputs"]) * DOC_SEQ_LEN, DOC_SEQ_LEN)):
        span = np.arange(first, first + DOC_SEQ_LEN)
        np.testing.assert_array_equal(batch["inputs"][row], stream[span])
        np.testing.assert_array_equal(batch["targets"][row], stream[span + 1])
        owner = document_of[span]
        np.testing.assert_array_equal(batch["segment_ids"][row], owner - owner[0] + 1)
        expected = span - np.maximum(starts[owner], first)
        np.testing.assert_array_equal(batch["positions"][row], expected)
        np.testing.assert_array_equal(batch[LOSS_MASK][row], document_of[span + 1] == owner)
        cut += starts[owner[0]] < first  # a document that began in an earlier window
        crowded += owner[-1] - owner[0] >= 2
    assert cut >= 5 and crowded >= 3  # both edges, and windows of 3 or more documents

    # With random offsets: a resumed loader continues with the same batch, and two processes
    # read the halves of the one process's batch, segment ids and positions with them.
    def loader(**where):
        return data.train_batches(
            split.train, split.transform, global_batch_size=8, seed=1, **where
        )

    batches = loader()
    next(batches)
    saved, second = batches.get_state(), next(batches)
    again = loader()
    again.set_state(saved)
    resumed = next(again)
    halves = [loader(process_index=i, process_count=2, start_step=1) for i in (0, 1)]
    halves = [next(half) for half in halves]
    for name in ("inputs", "segment_ids", "positions", LOSS_MASK):
        np.testing.assert_array_equal(resumed[name], second[name])
        np.testing.assert_array_equal(np.concatenate([h[name] for h in halves]), second[name])
    assert (second["positions"][:, 0] == 0).all() and second["segment_ids"].max() >= 2
    assert lines == [
        f"packing {spec.name}: 27 train documents of {len(stream) / 27:.1f} tokens on average in "
        f"windows of seq_len + 1 = {DOC_SEQ_LEN + 1} tokens, no padding; attention stays "
        "within each document (a new one starts after each end-of-document token) and positions "
        "restart at each document's start and at each window's"
    ]


def test_packed_windows_train_what_each_documents_piece_trains_alone(documents):
    """GPT (learned positions): 3 SGD steps on the packed windows give, within 1e-5, the losses
    and parameters of the same windows cut into their documents' pieces, each alone in a row
    from position 0 and padded (the mean over the pieces' targets, written here)."""
    spec, split, encoded, _ = documents
    packed = window_batch(split)
    stream = np.concatenate(encoded)
    ends = np.cumsum([len(d) for d in encoded])
    length = DOC_SEQ_LEN + 1
    pieces = []
    for first in range(0, len(packed["inputs"]) * DOC_SEQ_LEN, DOC_SEQ_LEN):
        cuts = [first, *(e for e in ends if first < e < first + length), first + length]
        pieces += [stream[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b - a > 1]
    rows = np.zeros((len(pieces), length), np.int32)
    counted = np.zeros((len(pieces), DOC_SEQ_LEN), np.float32)
    for row, piece in enumerate(pieces):
        rows[row, : len(piece)] = piece
        counted[row, : len(piece) - 1] = 1
    alone = {"inputs": rows[:, :-1], "targets": rows[:, 1:], LOSS_MASK: counted}
    assert counted.sum() == packed[LOSS_MASK].sum()
    model = models.MODELS["gpt"](
        vocab_size=spec.num_classes, num_layers=2, num_heads=2, embed_dim=16,
        max_seq_len=DOC_SEQ_LEN,
    )  # fmt: skip
    initial, expected, expected_losses = reference_run(model, alone)
    params, _, losses = plain_training(
        packed_loss(model), initial, {}, optax.sgd(LR), [packed] * STEPS
    )
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(params, expected)


def test_packing_data_without_documents_or_examples_is_one_line(tmp_path):
    """Before any file is read or written: images, a text file (one document, with or without a
    tokenizer), character-level rows, a single row of text."""
    folder = save_tokenizer(tmp_path / "tokenizer")
    (tmp_path / "corpus.txt").write_text("the quick brown fox\n" * 20)
    write_jsonl(tmp_path / "rows.jsonl", [{"text": "the quick fox"}, {"text": "a dog"}])
    write_jsonl(tmp_path / "one.jsonl", [{"text": "the quick fox"}])
    cases = [
        ("digits", {}, "is not text"),
        ("text_file", {"text_file": str(tmp_path / "nowhere.txt")}, "is one text file"),
        ("text_file", {"text_file": str(tmp_path / "corpus.txt"), "tokenizer": folder},
         "is one text file"),
        (f"jsonl:{tmp_path}/rows.jsonl", {"eval_fraction": 0.5}, "character-level text"),
        (f"jsonl:{tmp_path}/one.jsonl", {"eval_fraction": 0.5, "tokenizer": folder},
         "a single row of text"),
    ]  # fmt: skip
    for name, fields, why in cases:
        options = data.DataOptions(packing=True, **fields)
        with pytest.raises(ConfigError) as error:
            data.get_dataset(name, options=options)
        assert_one_line(error, "data.packing=true keeps documents apart", why, "clear data.packing")
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt", "one.jsonl", "rows.jsonl", "tokenizer"]
