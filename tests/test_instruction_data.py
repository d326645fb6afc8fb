"""Instruction data (chat `messages`, `prompt` / `completion`): each row rendered by the
tokenizer's chat template gives transformers' `apply_chat_template` ids; the loss counts the
assistant's tokens (transformers' assistant mask, TRL's completion mask); its mean is over the
counted tokens of the whole global batch, equal on 8 devices to a plain loop's hand-written masked
mean; bad rows and settings are one line, before anything is written."""

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers

import jddp
from experiments.configs import llama_chat_sft
from jddp import data, models
from jddp.errors import ConfigError, DataError, JddpError
from jddp.parallel.pipeline.options import PipelineOptions
from jddp.run import export
from jddp.run.experiment import train_and_evaluate
from jddp.run.objectives import objective_for
from tests.chat_tokenizer import (
    CHATML,
    CHATML_MARKED_TEMPLATE,
    LLAMA3,
    save_chat_tokenizer,
)
from tests.helpers import assert_one_line, configured, tiny_llama_config
from tests.reference import assert_trees_close, plain_training

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant", "content": "Waves fold into foam, salt wind over grey water."},
        {"role": "user", "content": "Ça va?"},
        {"role": "assistant", "content": " Très bien, merci. "},
    ],
    [
        {"role": "user", "content": "Translate 'good morning' to German, and answer briefly."},
        {"role": "assistant", "content": "Guten Morgen."},
    ],
]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def opened(name, tokenizer, seq_len=512, **options):
    """(the spec, its train and eval splits) of own data `name` with `tokenizer`."""
    options = data.DataOptions(tokenizer=tokenizer, seq_len=seq_len, **options)
    spec = data.get_dataset(name, options=options)
    return spec, data.open_dataset(spec, options)


def rows_of(split) -> list[tuple[list, list]]:
    """Each row of an instruction split, unpadded: (its token ids, its counted flags)."""
    starts = split.starts
    return [
        (split.tokens[a:b].tolist(), split.counted[a:b].tolist())
        for a, b in zip(starts[:-1], starts[1:], strict=True)
    ]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "llama3": save_chat_tokenizer(root / "llama3", LLAMA3),
        "chatml": save_chat_tokenizer(root / "chatml", CHATML),
        "marked": save_chat_tokenizer(root / "marked", CHATML, CHATML_MARKED_TEMPLATE),
    }


def test_chat_rows_are_transformers_ids_with_the_assistant_counted(tokenizers, tmp_path, caplog):
    """jsonl, Parquet and `datasets` rows of messages give apply_chat_template's ids; the counted
    tokens are transformers' assistant mask (of the same template with {% generation %} markers)
    whether the template has markers or not; a row longer than seq_len is cut at its end."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": c} for c in CONVERSATIONS]
    jsonl = write_jsonl(tmp_path / "chat.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "chat_hf")
    marked = transformers.AutoTokenizer.from_pretrained(tokenizers["marked"])
    for style in ("llama3", "chatml", "marked"):
        reference = transformers.AutoTokenizer.from_pretrained(tokenizers[style])
        spec, splits = opened(f"jsonl:{jsonl}", tokenizers[style], eval_path=jsonl)
        assert spec.loss_mask and spec.num_classes == len(reference)
        for (ids, counted), conversation in zip(rows_of(splits.train), CONVERSATIONS, strict=True):
            assert ids == reference.apply_chat_template(conversation)["input_ids"]
            if style == "llama3":  # the assistant's words and end of turn, nothing else
                counted_text = reference.decode([i for i, c in zip(ids, counted, strict=True) if c])
                answers = [
                    m["content"].strip() + "<|eot_id|>"
                    for m in conversation
                    if m["role"] == "assistant"
                ]
                assert counted_text == "".join(answers)
            else:
                expected = marked.apply_chat_template(
                    conversation, return_assistant_tokens_mask=True
                )["assistant_masks"]
                assert counted == list(expected)
        assert splits.train.counts.cut == 0
    batch = splits.transform(splits.train.read_batch([1, 0]))
    first = rows_of(splits.train)[1]
    np.testing.assert_array_equal(batch["inputs"][0, : len(first[0]) - 1], first[0][:-1])
    np.testing.assert_array_equal(batch["targets"][0, : len(first[0]) - 1], first[0][1:])
    np.testing.assert_array_equal(batch["loss_mask"][0, : len(first[0]) - 1], first[1][1:])
    assert not batch["loss_mask"][0, len(first[0]) - 1 :].any()  # padding never counts

    whole = rows_of(opened(f"jsonl:{jsonl}", tokenizers["chatml"], eval_path=jsonl)[1].train)
    short = max(len(ids) for ids, _ in whole) - 6  # the longest row is cut, its answer begun
    longer = sum(len(ids) > short + 1 for ids, _ in whole)
    for name in (f"parquet:{tmp_path / 'chat.parquet'}", f"hf:{tmp_path / 'chat_hf'}"):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            _, splits = opened(name, tokenizers["chatml"], short, eval_fraction=0.3)
        kept = {tuple(ids) for ids, _ in rows_of(splits.train)}
        assert kept <= {tuple(ids[: short + 1]) for ids, _ in whole} and len(kept) == 2
        assert splits.train.counts.cut + splits.eval.counts.cut == longer >= 1
        assert "instruction data" in caplog.text and "cut at the end" in caplog.text


def test_prompt_completion_rows_are_trls(tokenizers, tmp_path):
    """Strings: the text prompt + completion + EOS, the completion counted (TRL's standard
    prompt/completion); lists of messages: the chat template, counted after the prompt's
    generation prompt (TRL's conversational prompt/completion)."""
    path = tokenizers["llama3"]
    reference = transformers.AutoTokenizer.from_pretrained(path)
    plain = [
        {"prompt": "Translate 'good morning' to German:\n", "completion": "Guten Morgen."},
        {"prompt": "What is the capital of France?\n", "completion": "Paris.<|eot_id|>"},
    ]
    name = write_jsonl(tmp_path / "plain.jsonl", plain)
    spec, splits = opened(f"jsonl:{name}", path, eval_path=name)
    assert spec.chat_template is None  # plain text needs no template
    for (ids, counted), row in zip(rows_of(splits.train), plain, strict=True):
        completion = row["completion"].removesuffix("<|eot_id|>") + "<|eot_id|>"
        expected = reference(row["prompt"] + completion)["input_ids"]
        prompt_length = len(reference(row["prompt"])["input_ids"])
        assert ids == expected
        assert counted == [0] * prompt_length + [1] * (len(expected) - prompt_length)

    chats = [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS]
    name = write_jsonl(tmp_path / "chats.jsonl", chats)
    _, splits = opened(f"jsonl:{name}", path, eval_path=name)
    for (ids, counted), row in zip(rows_of(splits.train), chats, strict=True):
        expected = reference.apply_chat_template(row["prompt"] + row["completion"])["input_ids"]
        prompt_length = len(
            reference.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]
        )
        assert ids == expected
        assert counted == [0] * prompt_length + [1] * (len(expected) - prompt_length)
    _, everything = opened(f"jsonl:{name}", path, eval_path=name, loss_on="all")
    assert all(all(counted) for _, counted in rows_of(everything.train))


SEQ_LEN, BATCH, STEPS = 32, 8, 2

# (mesh, layers, pipeline): zero3 on 8 devices without stages, and interleaved 1F1B on 2 stages
# (two one-layer groups each), whose micro-batches are one row per replica: as uneven as rows get.
LAYOUTS = {
    "data:2,fsdp:4": ("data:2,fsdp:4", 1, None),
    "stage:2,fsdp:4 interleaved 1f1b": ("stage:2,fsdp:4", 4, PipelineOptions(2, "1f1b", 2)),
}


@pytest.mark.parametrize("mesh,layers,pipeline", LAYOUTS.values(), ids=LAYOUTS)
def test_masked_loss_on_eight_devices_is_the_hand_written_mean(
    tokenizers, tmp_path, mesh, layers, pipeline
):
    """zero3 on 8 devices, with and without pipeline stages, trains and evaluates a tiny Llama
    to what a plain one-device optax loop gives whose loss is the mean over every counted token
    of the global batch, written here from the mask; rows count 3 to 13 tokens, so a mean of
    means would differ. The training metrics are the hand-written ones too: the masked
    accuracy, and a row loss weighted by a `weight_key` entry whose weights span 1 to 64."""
    rng = np.random.default_rng(0)
    words = "waves fold into foam salt wind over grey water".split()
    rows = []
    for i in range(BATCH * STEPS):
        answer = " ".join(rng.choice(words, int(rng.integers(1, 9)) if i % 3 else 1))
        question = " ".join(rng.choice(words, int(rng.integers(1, 3))))
        rows.append({"messages": [{"role": "user", "content": question},
                                  {"role": "assistant", "content": answer}]})  # fmt: skip
    name = write_jsonl(tmp_path / "train.jsonl", rows)
    spec, splits = opened(f"jsonl:{name}", tokenizers["llama3"], SEQ_LEN, eval_path=name)
    row_weights = np.float32(2.0) ** rng.integers(0, 7, BATCH)
    batches = [
        splits.transform(splits.train.read_batch(np.arange(s * BATCH, (s + 1) * BATCH)))
        | {"row_weight": row_weights}
        for s in range(STEPS)
    ]
    counts = np.concatenate([b["loss_mask"].sum(1) for b in batches])
    assert counts.min() <= 3 and counts.max() >= 10

    model = models.MODELS["llama"](
        vocab_size=spec.num_classes, num_layers=layers, num_heads=2, embed_dim=16,
        max_seq_len=SEQ_LEN, scan_layers=pipeline is not None,
    )  # fmt: skip
    initial = jax.jit(model.init)(jax.random.key(1), batches[0]["inputs"][:1])["params"]
    optimizer = optax.sgd(0.5)

    def masked_mean(params, batch):
        return hand_written(params, batch)["loss"]

    @jax.jit
    def hand_written(params, batch):
        """The masked mean loss and accuracy, the row loss weighted by `row_weight`, and the
        mean of each row's masked mean (what an unweighted mean would give)."""
        logits = model.apply({"params": params}, batch["inputs"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        mask, weights = batch["loss_mask"], batch["row_weight"]
        hits = jnp.argmax(logits, -1) == batch["targets"]
        return {
            "loss": jnp.sum(losses * mask) / jnp.sum(mask),
            "accuracy": jnp.sum(hits * mask) / jnp.sum(mask),
            "row_loss": jnp.sum(losses.mean(-1) * weights) / jnp.sum(weights),
            "mean_of_means": jnp.mean(jnp.sum(losses * mask, 1) / jnp.sum(mask, 1)),
        }

    reference, _, losses = plain_training(
        lambda p, s, b: (masked_mean(p, b), s), initial, {}, optimizer, batches
    )
    objective = objective_for(spec.kind, masked=spec.loss_mask)
    trainer = jddp.Trainer(
        model, objective.loss_fn, optimizer, input_key="inputs", strategy="zero3", mesh=mesh,
        metrics={**objective.metrics, "row_loss": jddp.losses.token_cross_entropy},
        weight_key="row_weight", pipeline=pipeline, min_shard_size=1,
    )  # fmt: skip
    state = trainer.replace_state(trainer.init(0, batches[0]), params=initial)
    history = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        history.append({name: float(metrics[name]) for name in ("loss", "accuracy", "row_loss")})
    final = trainer.host_state(state).params
    assert_trees_close(final, reference)
    np.testing.assert_allclose([h["loss"] for h in history], losses, rtol=1e-5)
    first = hand_written(initial, batches[0])  # the first step's metrics, from the start
    for name in ("accuracy", "row_loss"):
        np.testing.assert_allclose(history[0][name], first[name], rtol=1e-5, err_msg=name)

    if pipeline is not None:
        return  # evaluation runs the whole model on every stage, as without stages
    # Eval over a ragged last batch: the same mean over every counted token.
    evaluated = trainer.evaluate(state, [batches[0], {k: v[:5] for k, v in batches[1].items()}])
    whole = {k: np.concatenate([batches[0][k], batches[1][k][:5]]) for k in batches[0]}
    expected = hand_written(final, whole)
    np.testing.assert_allclose(evaluated["loss"], expected["loss"], rtol=1e-5)
    # what an unweighted mean would give
    assert abs(expected["mean_of_means"] - evaluated["loss"]) > 1e-3


def test_bad_rows_and_settings_are_one_line_before_anything_is_written(tokenizers, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"messages": c} for c in CONVERSATIONS])
    no_template = save_chat_tokenizer(tmp_path / "plain_tokenizer", CHATML, template="")

    def rows(name, *rows_):
        return f"jsonl:{write_jsonl(tmp_path / f'{name}.jsonl', rows_)}"

    user_only = [{"role": "user", "content": "Hi"}]
    cases = {
        "no template": (f"jsonl:{good}", {"tokenizer": no_template}, ["has no chat_template"]),
        "role refused": (
            rows("role", {"messages": [*CONVERSATIONS[0], {"role": "tool", "content": "4"}]}),
            {},
            ["row 0", "refuses it", "Unknown role: tool"],
        ),
        "no assistant": (
            rows("user", {"messages": CONVERSATIONS[0]}, {"messages": user_only}),
            {},
            ["row 1", "no assistant turn", "data.loss_on=all"],
        ),
        "prompt fills seq_len": (
            f"jsonl:{good}",
            {"seq_len": 12},
            ["row 0", "nothing counted within data.seq_len=12"],
        ),
        "no role": (
            rows("norole", {"messages": [{"content": "Hi"}, *CONVERSATIONS[0][1:]]}),
            {},
            ["row 0", "message 0 has no role"],
        ),
        "text messages": (rows("text", {"messages": "Hi"}), {}, ["lists of {role, content}"]),
        "mixed": (
            rows("mixed", {"prompt": "Hi", "completion": [{"role": "assistant", "content": "x"}]}),
            {},
            ["row 0", "its prompt is a str and its completion a list"],
        ),
        "mixed rows": (
            rows("rows", {"messages": user_only}, {"messages": "Hi"}),
            {},
            ["mixes list, str"],
        ),
        "loss_on": (f"jsonl:{good}", {"loss_on": "answers"}, ["completion or all"]),
        "no tokenizer": (f"jsonl:{good}", {"tokenizer": ""}, ["set --config.data.tokenizer"]),
        "text with completion": (
            "shakespeare_char",
            {"tokenizer": "", "loss_on": "completion"},
            ["has no completion"],
        ),
    }
    for case, (name, overrides, words) in cases.items():
        options = {"tokenizer": tokenizers["chatml"], "seq_len": 128}
        if name.startswith("jsonl:"):  # evaluated on its own rows
            options["eval_path"] = name.removeprefix("jsonl:")
        options |= overrides
        with pytest.raises(JddpError) as error:
            opened(name, **options)
        assert isinstance(error.value, ConfigError | DataError), case
        assert_one_line(error, *words)


def test_the_chat_sft_example_fine_tunes_a_hugging_face_llama(tokenizers, tmp_path, caplog):
    """experiments/configs/llama_chat_sft.py with its paths pointed at a tiny Llama saved by
    transformers, whose tokenizer keeps its template in chat_template.jinja (as transformers
    saves it now), and a jsonl of messages: trains, evaluates, and exports a model whose
    tokenizer renders the same chats in transformers."""
    import torch

    torch.manual_seed(0)
    checkpoint = tmp_path / "llama"
    transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=384)).save_pretrained(checkpoint)
    reference = transformers.AutoTokenizer.from_pretrained(tokenizers["llama3"])
    reference.save_pretrained(checkpoint)
    assert os.path.exists(checkpoint / "chat_template.jinja")
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS * 8])
    config = configured(
        llama_chat_sft.get_config(),
        {"init_from": f"hf:{checkpoint}", "data.tokenizer": str(checkpoint),
         "dataset": f"jsonl:{chats}", "data.seq_len": 64, "global_batch_size": 8,
         "num_train_steps": 2, "warmup_steps": 0, "eval_every": 2, "checkpoint_every": 2,
         "log_every": 1, "log.writers": "", "compute_dtype": "float32"},
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        summary = train_and_evaluate(config, str(tmp_path / "run"))
    assert np.isfinite(summary["eval_loss"]) and summary["eval_perplexity"] > 1
    assert "instruction data" in caplog.text and "(messages)" in caplog.text

    export.export_run(str(tmp_path / "run"), str(tmp_path / "hf"), max_shard_bytes=1 << 30)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for conversation in CONVERSATIONS:
        ids = exported.apply_chat_template(conversation)["input_ids"]
        assert ids == reference.apply_chat_template(conversation)["input_ids"]
