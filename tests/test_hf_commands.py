"""Hugging Face checkpoints from the command line: `jddp-train` with `init_from="hf:DIR"`
fine-tunes a pipelined Llama and the installed `jddp-export` writes what transformers loads; each
careless input is one line, exit code 2, and nothing written."""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

import jddp
from jddp.checkpoints import hf
from jddp.errors import JddpError
from jddp.run import export
from tests.commands_in_one_process import run_commands
from tests.helpers import (
    BeforeRerun,
    assert_error_exit,
    assert_error_output,
    assert_one_line,
    checkout_env,
    config_flags,
    configured,
    safetensors_in,
    snapshot,
    tiny_llama_config,
    xla_flags,
)
from tests.test_multiprocess import launch
from tests.tiny_tokenizer import WORDS, save_tokenizer

JDDP_EXPORT = os.path.join(os.path.dirname(sys.executable), "jddp-export")  # installed beside it
VOCAB = 64


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random Llama (grouped-query attention, untied) in shards with a tokenizer.json
    beside it, and a text file of the tokenizer's words."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=VOCAB)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llama", max_shard_size="20KB")
    save_tokenizer(root / "llama")
    rng = np.random.default_rng(0)
    text = "\n".join(" ".join(rng.choice(WORDS, 10)) for _ in range(200))
    (root / "text.txt").write_text(text)
    return root


def _settings(root, checkpoint="llama") -> dict:
    """A few SGD steps (Adam would turn rounding into visible differences between layouts) of
    the Llama on the text file, tokenized by the checkpoint's tokenizer: {config key: value}."""
    return {
        "model": "llama",
        "init_from": f"hf:{root / checkpoint}",
        "dataset": "text_file",
        "data.text_file": str(root / "text.txt"),
        "data.tokenizer": str(root / "llama"),
        "data.seq_len": 16,
        "global_batch_size": 8,
        "num_train_steps": 4,
        "checkpoint_every": 4,
        "eval_every": 4,
        "log_every": 2,
        "optimizer": "sgd",
        "learning_rate": 0.5,
        "min_lr_ratio": 1.0,  # constant: a run stopped and resumed is the same run
    }


def _train_flags(root, workdir, checkpoint="llama"):
    return [f"--workdir={root / workdir}", *config_flags(_settings(root, checkpoint))]


def _train(root, *flags, workdir="run", **env):
    return subprocess.run(
        [sys.executable, "-m", "jddp.run.train", *_train_flags(root, workdir), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env=checkout_env(**env),
    )


def _export(*args):
    return subprocess.run(
        [JDDP_EXPORT, *map(str, args)], capture_output=True, text=True, timeout=120,
        env=checkout_env(),
    )  # fmt: skip


@pytest.fixture(scope="module")
def pipelined_run(llama_dir):
    """jddp-train from hf:DIR on stage:2,fsdp:4, one process."""
    result = _train(
        llama_dir, "--config.parallel.strategy=zero3", "--config.parallel.mesh=stage:2,fsdp:4"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "initialized from the Hugging Face checkpoint" in result.stderr
    return llama_dir / "run"


def _final_params(workdir):
    from jddp.checkpoints import weights
    from jddp.core import layer_stacks

    return layer_stacks.to_per_layer(weights.load_params(str(workdir)))


def test_finetune_then_export_loads_in_transformers(llama_dir, pipelined_run):
    """The pipelined run's config.json records the model_args config.json filled in; exported
    (float32, and bfloat16 by jddp-export): transformers' logits equal jddp's from the run's
    newest checkpoint, and the checkpoint's tokenizer and special token ids go along."""
    from jddp.models import Llama

    recorded = json.loads((llama_dir / "run" / "config.json").read_text())["model_args"]
    assert recorded["num_kv_heads"] == 2 and recorded["vocab_size"] == VOCAB

    # The installed command writes the bfloat16 export; the float32 one, held to transformers'
    # logits, by the function it calls (`export_run`), here: a process less.
    out, half = llama_dir / "export", llama_dir / "export-bf16"
    flags = ["--max_shard_size=20KB", "--dtype=bfloat16"]
    exported = _export("--format=hf", pipelined_run, half, *flags)
    assert exported.returncode == 0, exported.stderr
    export.export_run(str(pipelined_run), str(out), max_shard_bytes=20_000)
    original = json.loads((llama_dir / "llama" / "config.json").read_text())
    tokenizer = (llama_dir / "llama" / "tokenizer.json").read_bytes()
    for folder in (out, half):
        assert (folder / "model.safetensors.index.json").exists()
        assert (folder / "tokenizer.json").read_bytes() == tokenizer
        written = json.loads((folder / "config.json").read_text())
        assert written["eos_token_id"] == original["eos_token_id"] is not None
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 16))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    ours = Llama(**recorded).apply({"params": _final_params(pipelined_run)}, tokens)
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=1e-5)

    again = _export("--format=hf", pipelined_run, out)  # out is not empty: nothing written
    assert_error_exit(again, "not empty")

    # bfloat16 on disk: each tensor the float32 export's, rounded; it imports back as those.
    full_tensors, half_tensors = safetensors_in(out), safetensors_in(half)
    for name, value in full_tensors.items():
        assert half_tensors[name].dtype == jnp.bfloat16, (name, half_tensors[name].dtype)
        np.testing.assert_array_equal(half_tensors[name], value.astype(jnp.bfloat16))
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(half)  # the command's output
    their_embedding = loaded.get_input_embeddings().weight.detach().float().numpy()
    assert np.array_equal(their_embedding, half_tensors["model.embed_tokens.weight"])
    model = hf.create_model(str(half))
    trainer = jddp.Trainer(model, lambda *_: 0.0, optax.sgd(0.0), input_key="inputs")
    state = hf.load(trainer, trainer.abstract_state({"inputs": tokens}), str(half))
    embedding = np.asarray(state.params["token_embed"]["embedding"])
    want = full_tensors["model.embed_tokens.weight"].astype(jnp.bfloat16).astype(np.float32)
    assert embedding.dtype == np.float32 and np.array_equal(embedding, want)


def test_two_processes_import_their_shards_and_resume_after_the_checkpoint_moved(
    llama_dir, pipelined_run
):
    """jddp-launch, 2 processes x 4 devices, data:2,fsdp:2,tensor:2: each process reads its
    devices' shards of the checkpoint; 2 steps, then the Hugging Face directory moves and the
    run resumes to step 4 (its model arguments from its own checkpoints): it ends where the
    one-process pipelined run does."""
    shutil.copytree(llama_dir / "llama", llama_dir / "moving")
    mesh = ["--config.parallel.strategy=zero3", "--config.parallel.mesh=data:2,fsdp:2,tensor:2"]
    flags = [*_train_flags(llama_dir, "two-processes", "moving"), *mesh]
    code, output = launch(
        2, 4, sys.executable, "-m", "jddp.run.train", *flags, "--config.num_train_steps=2"
    )
    assert code == 0, output[-3000:]
    os.rename(llama_dir / "moving", llama_dir / "moved")
    before = BeforeRerun(llama_dir / "two-processes")
    assert before.resume_step == 2  # the end of the first launch
    more = "--config.allow_config_change=true"  # to train on past num_train_steps=2
    code, output = launch(2, 4, sys.executable, "-m", "jddp.run.train", *flags, more)
    assert code == 0, output[-3000:]
    before.assert_resumed(log_every=2)
    from tests.reference import assert_trees_close

    assert_trees_close(
        _final_params(llama_dir / "two-processes"), _final_params(pipelined_run), rtol=1e-5
    )


def _broken(root, name: str, damage) -> str:
    """A copy of the Llama directory, damaged by `damage(path)`."""
    path = root / name
    shutil.copytree(root / "llama", path)
    damage(path)
    return str(path)


def _drop_weights(path):
    for file in os.listdir(path):
        if file.endswith(".safetensors") or file.endswith(".json") and file != "config.json":
            os.remove(path / file)


def _shard_of(path, tensor: str) -> str:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def _drop_shard(path):
    os.remove(path / _shard_of(path, "model.norm.weight"))


def _reshape_tensor(path):
    from safetensors.numpy import load_file, save_file

    file = path / _shard_of(path, "model.norm.weight")
    tensors = load_file(file)
    tensors["model.norm.weight"] = np.ones(31, np.float32)
    save_file(tensors, file, metadata={"format": "pt"})


def _train_in_process(root, workdir, overrides: dict):
    """`_train` as a library call: the packaged defaults, `_settings` and `overrides` (dotted
    keys) trained into root / workdir by `train_and_evaluate`, which the command runs."""
    from jddp.run.config import default_config
    from jddp.run.experiment import train_and_evaluate

    config = configured(default_config(), _settings(root) | overrides)
    return train_and_evaluate(config, str(root / workdir))


def test_careless_inputs_are_one_line_and_write_nothing(llama_dir, capsys):
    """Two mistakes through the command's entry point, both in one process (its flags, one line
    and exit code 2; pipelined_run starts the command itself); the others, each
    found by the same checks of `train_and_evaluate` that the command reports that way, as the
    library's one-line error with exit code 2 (a process start each would cost seconds)."""
    root = llama_dir
    on_the_command_line = {
        "contradiction": (
            ["--config.model_args.num_layers=3", "--config.model_args.dropout_rate=0.1"],
            ["num_layers=3", "config.json: 2", "remove them from model_args"],
        ),
        "characters": (["--config.data.tokenizer="], ["tokenized by characters", "tokenizer.json"]),
    }
    in_the_library = {
        "other model": ({"model": "gpt"}, ["holds a llama model", "model='llama'"]),
        "no weights": (
            {"init_from": f"hf:{_broken(root, 'no-weights', _drop_weights)}"},
            ["holds no model.safetensors"],
        ),
        "missing shard": (
            {"init_from": f"hf:{_broken(root, 'no-shard', _drop_shard)}"},
            ["lacks the shard " + _shard_of(root / "llama", "model.norm.weight")],
        ),
        "wrong shape": (
            {"init_from": f"hf:{_broken(root, 'reshaped', _reshape_tensor)}"},
            ["'model.norm.weight' has shape (31,)", "(32,)"],
        ),
        "hub name": ({"init_from": "hf:meta-llama/Llama-3.2-1B"}, ["downloads nothing"]),
        "optimizer": ({"init_from_optimizer": True}, ["weights only"]),
    }
    before = snapshot(root)
    commands = [
        ["jddp.run.train", *_train_flags(root, name), *flags]
        for name, (flags, _) in on_the_command_line.items()
    ]
    with ThreadPoolExecutor(1) as pool:  # both commands in one process, beside the library's
        results = pool.submit(run_commands, commands)
        for name, (overrides, words) in in_the_library.items():
            with pytest.raises(JddpError) as error:
                _train_in_process(root, name.replace(" ", "-"), overrides)
            assert error.value.exit_code == 2, name
            assert_one_line(error, *words)
        for result, (_, words) in zip(results.result(), on_the_command_line.values(), strict=True):
            assert_error_exit(result, *words)
    assert snapshot(root) == before  # no workdir made, no checkpoint touched

    # jddp-export's: its parser's in-process (one line, exit 2); the rest as the library's
    # one-line errors, which the command reports as the "not empty" one above.
    with pytest.raises(SystemExit) as exited:
        export.main(["--format=onnx", str(root), str(root / "out")])
    assert exited.value.code == 2
    assert_error_output(capsys.readouterr().err, "invalid choice")
    for workdir, words in ((root / "nowhere", "does not exist"), (root, "holds no checkpoint")):
        with pytest.raises(JddpError) as error:
            export.export_run(str(workdir), str(root / "out"), max_shard_bytes=1)
        assert error.value.exit_code == 2
        assert_one_line(error, words)
    assert snapshot(root) == before


def test_lora_run_exports_merged_weights_and_peft_adapters(llama_dir, tmp_path):
    """jddp-train with config.lora from hf:DIR: the base stays the checkpoint's, bit for bit;
    `--format=hf` (merged) loads in transformers and `--format=peft` in PEFT on the original
    checkpoint, both with the run's logits."""
    import peft

    from jddp.core.lora import LoRA, split
    from jddp.models import Llama

    one_device = xla_flags(1)
    flags = ("--config.lora.rank=4", "--config.lora.alpha=16")
    result = _train(llama_dir, *flags, workdir="lora", XLA_FLAGS=one_device)
    assert result.returncode == 0, result.stderr[-3000:]
    run = llama_dir / "lora"
    export.export_run(str(run), str(tmp_path / "merged"), max_shard_bytes=10**9)
    export.export_run(str(run), str(tmp_path / "peft"), max_shard_bytes=10**9, form="peft")
    params = _final_params(run)
    base, adapters = split(params)
    recorded = json.loads((run / "config.json").read_text())["model_args"]
    model = Llama(**recorded)
    original = safetensors_in(llama_dir / "llama")
    for name, value in hf.hf_tensors(base, model).items():
        assert np.array_equal(value, original[name]), name
    assert np.abs(adapters["block_0"]["attn"]["q"]["lora_B"]).max() > 0  # trained from zero
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 16))
    with LoRA(rank=4, alpha=16).adapting(train=False):
        ours = model.apply({"params": params}, tokens)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    on_base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir / "llama")
    with_adapters = peft.PeftModel.from_pretrained(on_base, tmp_path / "peft").eval()
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16
    for theirs in (merged, with_adapters):
        with torch.no_grad():
            logits = theirs(torch.tensor(tokens)).logits.numpy()
        np.testing.assert_allclose(logits, ours, atol=1e-5, rtol=1e-5)
