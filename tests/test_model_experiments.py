"""The config-driven path for the new models: configs build models of the sizes their names say;
runs log throughput, FLOP/s and MFU (packed runs too), trace chosen steps, and report perplexity
for language models; bad model settings on the command line are one-line errors."""

import glob
import json
import logging
import math
import re
from pydoc_data.topics import topics

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.configs import (
    cifar10_resnet18,
    gpt_1b,
    gpt_124m,
    imagenet_resnet50,
    shakespeare_gpt_tiny,
)
from jddp import data, models
from jddp.errors import JddpError
from jddp.observe import flops
from jddp.run import config as config_lib
from jddp.run.experiment import train_and_evaluate
from tests.helpers import (
    assert_accuracy_over,
    assert_error_exit,
    assert_one_line,
    param_count,
    run_cli,
)
from tests.tiny_tokenizer import VOCAB_SIZE, WORDS, save_tokenizer

# (config, the dataset's number of outputs, one example's input, parameters)
CONFIGS = [
    (cifar10_resnet18, 10, jnp.zeros((1, 32, 32, 3)), 11_173_962),
    (imagenet_resnet50, 1000, jnp.zeros((1, 224, 224, 3)), 25_557_032),
    (shakespeare_gpt_tiny, 65, jnp.zeros((1, 128), jnp.int32), 818_048),
    (gpt_124m, 65, jnp.zeros((1, 1024), jnp.int32), 124_475_904),  # GPT-2 small, vocab 50,304
    (gpt_1b, 65, jnp.zeros((1, 2048), jnp.int32), 1_009_475_584),
]


@pytest.mark.parametrize(
    "module,outputs,sample,expected", CONFIGS, ids=[c[0].__name__.split(".")[-1] for c in CONFIGS]
)
def test_configs_build_models_of_the_sizes_their_names_say(module, outputs, sample, expected):
    config = module.get_config()
    config_lib.validate(config)
    model = models.create_model(config.model, outputs, **config.model_args)
    if config.model == "gpt":
        assert config.data.seq_len == sample.shape[1] <= config.model_args.max_seq_len
    assert param_count(model, sample, train=False) == expected  # shapes only: nothing is allocated


def read_records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_language_model_run_logs_tokens_mfu_and_perplexity(tmp_path):
    # A character corpus from a local file (the `text_file` dataset): Python's language reference.
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("\n".join(topics[name] for name in sorted(topics))[:40_000])
    vocab_size = len(set(text_file.read_text()))
    config = shakespeare_gpt_tiny.get_config()
    config.dataset, config.data.text_file = "text_file", str(text_file)
    config.model_args.update(num_layers=2, embed_dim=32, max_seq_len=32)
    config.data.seq_len = 32
    config.global_batch_size, config.num_train_steps, config.warmup_steps = 32, 40, 5
    config.log_every = config.eval_every = 20
    config.checkpoint_every = 0
    summary = train_and_evaluate(config, str(tmp_path / "run"))

    records = read_records(tmp_path / "run")
    model = models.create_model("gpt", vocab_size, **config.model_args)
    flops_per_token = flops.decoder_train_flops(model, 1, 32) / 32
    for record in records:
        assert record["tokens_per_sec"] == pytest.approx(32 * record["examples_per_sec"])
        per_device = record["tokens_per_sec"] * flops_per_token / 8
        assert record["flops_per_sec_per_device"] == pytest.approx(per_device, rel=1e-9)
        assert 0 < record["mfu"] < 2
        assert record["eval_perplexity"] == pytest.approx(math.exp(record["eval_loss"]))
    assert summary["eval_perplexity"] == pytest.approx(math.exp(summary["eval_loss"]))
    assert records[-1]["eval_loss"] < 0.8 * math.log(vocab_size)  # it learned


def test_a_packed_run_logs_rows_tokens_and_mfu(tmp_path, caplog):
    """Documents packed into their windows (`data.packing=true`, the model taking tokens,
    segment ids and positions): FLOPs counted from the tokens, MFU in every record and on the
    progress line, which counts the batch's rows as rows."""
    folder = save_tokenizer(tmp_path / "tokenizer")
    rng = np.random.default_rng(0)
    rows = [{"text": " ".join(rng.choice(WORDS, rng.integers(2, 12)))} for _ in range(60)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = shakespeare_gpt_tiny.get_config()
    config.dataset = f"jsonl:{tmp_path}/rows.jsonl"
    config.data.update(tokenizer=folder, packing=True, eval_fraction=0.2, seq_len=16)
    config.model_args.update(num_layers=1, embed_dim=16, num_heads=2, max_seq_len=16)
    config.global_batch_size, config.num_train_steps, config.warmup_steps = 8, 2, 0
    config.log_every, config.eval_every, config.checkpoint_every = 1, 2, 0
    with caplog.at_level(logging.INFO):
        train_and_evaluate(config, str(tmp_path / "run"))

    model = models.create_model("gpt", VOCAB_SIZE, **config.model_args)
    step_flops = flops.decoder_train_flops(model, 8, 16)
    assert f"model FLOPs per step: {step_flops:.4g} (analytic" in caplog.text
    records = read_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["tokens_per_sec"] == pytest.approx(16 * record["examples_per_sec"])
        per_device = record["examples_per_sec"] / 8 * step_flops / 8
        assert record["flops_per_sec_per_device"] == pytest.approx(per_device, rel=1e-9)
        assert 0 < record["mfu"] < 2
    progress = [m for m in caplog.messages if m.startswith("step 2/2")]
    assert len(progress) == 1 and re.search(r" rows/s .* tokens/s  MFU \d", progress[0])


def test_resnet_run_with_remat_logs_mfu_and_traces_the_chosen_steps(tmp_path):
    config = cifar10_resnet18.get_config()
    config.dataset = "digits"  # 8x8 grey images: no download; the CIFAR stem takes any size
    config.model_args.update(width=4, remat=True)
    config.compute_dtype = "float32"
    config.global_batch_size, config.num_train_steps, config.warmup_steps = 64, 6, 0
    config.log_every, config.eval_every = 2, 6
    config.profile_start_step, config.profile_num_steps = 3, 2
    summary = train_and_evaluate(config, str(tmp_path / "run"))

    model = models.create_model("resnet", 10, **config.model_args)
    per_example = flops.train_step_flops(model, jnp.zeros((1, 8, 8, 1))).per_step
    records = read_records(tmp_path / "run")
    assert [r["step"] for r in records] == [2, 4, 6]
    for record in records:
        per_device = record["examples_per_sec"] * per_example / 8
        assert record["flops_per_sec_per_device"] == pytest.approx(per_device, rel=1e-9)
        assert 0 < record["mfu"] < 2
    digits = data.open_dataset(data.get_dataset("digits"))
    assert_accuracy_over(summary["eval_accuracy"], len(digits.eval))
    assert summary["eval_accuracy"] == records[-1]["eval_accuracy"]  # the final evaluation
    (trace_dir,) = glob.glob(str(tmp_path / "run" / "profile" / "plugins" / "profile" / "*"))
    assert glob.glob(f"{trace_dir}/*.xplane.pb")  # TensorBoard's profile plugin
    assert glob.glob(f"{trace_dir}/perfetto_trace.json.gz")  # ui.perfetto.dev


def test_bad_model_settings_are_one_line_cli_errors(tmp_path):
    """The command's one line and exit code 2 for the GPT's model settings; the ResNet's, found
    by the same checks the command runs (`train_and_evaluate`), as the library's one-line error
    with exit code 2: a second process start would prove the same conversion again."""
    workdir = tmp_path / "run"
    result = run_cli(
        "--config=experiments/configs/shakespeare_gpt_tiny.py",
        "--config.dataset=digits",
        "--config.model_args.num_heads=5",
        f"--workdir={workdir}",
    )
    assert_error_exit(result, "num_heads=5 does not divide embed_dim=128", "use num_heads 4 or 8")
    assert not workdir.exists()

    config = cifar10_resnet18.get_config()
    config.dataset = "digits"
    config.model_args.depth = 20
    with pytest.raises(JddpError) as error:
        train_and_evaluate(config, str(workdir))
    assert error.value.exit_code == 2
    assert_one_line(error, "depth=20", "18, 34, 50")
    assert not workdir.exists()
