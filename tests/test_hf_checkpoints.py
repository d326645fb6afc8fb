"""Hugging Face checkpoints in and out, held to transformers itself: tiny random Llama (grouped
and multi-query attention, untied; Llama 3.1's rotary scaling), Qwen2, Qwen3, Mistral (sliding
window) and GPT-2 models made by transformers on PyTorch (CPU), saved with save_pretrained
(unsharded and sharded), imported under each layout, fine-tuned, exported and loaded back by
transformers."""

import hashlib
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers

import jddp
from jddp import models as jddp_models
from jddp.checkpoints import hf, hf_files
from jddp.core import layer_stacks
from jddp.models import tensor_rules
from jddp.parallel.rules import adapt_preset
from jddp.run.objectives import OBJECTIVES
from tests.helpers import safetensors_in, tiny_llama_config
from tests.reference import assert_trees_close, plain_training
from tests.tiny_gpt import adamw, mesh_devices

LM = OBJECTIVES["language_model"]
VOCAB, SEQ, BATCH, STEPS = 96, 16, 16, 20
LAYOUTS = {  # name: (strategy, mesh, sequence parallelism)
    "1 device": ("ddp", None, False),
    "fsdp:8": ("zero3", "fsdp:8", False),
    "data:2,fsdp:2,tensor:2": ("zero3", "data:2,fsdp:2,tensor:2", False),
    "data:2,fsdp:2,tensor:2 sp": ("zero3", "data:2,fsdp:2,tensor:2", True),
    "stage:2,fsdp:4": ("zero3", "stage:2,fsdp:4", False),
}


def _llama(kv_heads: int, biases: bool, tied: bool = False):
    config = tiny_llama_config(
        vocab_size=VOCAB,
        num_key_value_heads=kv_heads,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        attention_bias=biases,
        mlp_bias=biases,
    )
    return transformers.LlamaForCausalLM(config)


# Llama 3.1's scaling with rope_theta=100 and head_dim 8: wavelengths 6.3 (kept: below 32 / 4),
# 20 (on the ramp) and 63, 199 (divided by the factor: above 32 / 1).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 100.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
WINDOW = 5  # a sliding window well below SEQ


def _family(name: str):
    """The tiny transformers model of each family the `llama` model reads, with the feature
    that family adds on (and a rotary scaling on some)."""
    fields = tiny_llama_config(vocab_size=VOCAB, rms_norm_eps=1e-5).to_dict()
    fields = {k: fields[k] for k in ("vocab_size", "hidden_size", "intermediate_size")} | {
        k: fields[k]
        for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        + ("max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
    }
    sliding = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0}
    if name == "llama3":
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**fields, rope_parameters=LLAMA3_ROPE)
        )
    if name == "qwen2":  # q/k/v biases, YaRN, a window on every layer
        yarn = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0}
        yarn["original_max_position_embeddings"] = 16
        config = transformers.Qwen2Config(**fields, rope_parameters=yarn, **sliding)
        return transformers.Qwen2ForCausalLM(config)
    if name == "qwen3":  # q/k norms, head_dim 16 x 4 heads != hidden_size 32, linear scaling
        linear = {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}
        config = transformers.Qwen3Config(**fields, head_dim=16, rope_parameters=linear)
        return transformers.Qwen3ForCausalLM(config)
    if name == "mistral":
        config = transformers.MistralConfig(**fields, sliding_window=WINDOW)
        return transformers.MistralForCausalLM(config)
    # qwen3-all: every field the families add at once (llama3 scaling, biases on q, k, v and
    # out, q/k norms, a window)
    config = transformers.Qwen3Config(
        **fields, rope_parameters=LLAMA3_ROPE, attention_bias=True, **sliding
    )
    return transformers.Qwen3ForCausalLM(config)


FAMILIES = ("llama3", "qwen2", "qwen3", "mistral")


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: save_pretrained directory}: grouped-query untied Llama (sharded and not),
    multi-query tied Llama with biases, GPT-2 (sharded), each of `FAMILIES` and "qwen3-all"
    (sharded). Norms (q/k norms too) and biases are perturbed from their initial ones and
    zeros, so that a misplaced one shows."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    made = {
        "llama": (_llama(2, False), None),
        "llama-sharded": (_llama(2, False), "20KB"),
        "llama-mqa": (_llama(1, True, tied=True), None),
        "gpt2": (_gpt2(), "20KB"),
        **{name: (_family(name), None) for name in FAMILIES},
        "qwen3-all": (_family("qwen3-all"), "20KB"),
    }
    found = {}
    for name, (model, shard) in made.items():
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if "norm" in param_name or "ln" in param_name or "bias" in param_name:
                    p.add_(torch.randn_like(p) * 0.1)
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(root / name, **kwargs)
        found[name] = str(root / name)
    assert len([f for f in os.listdir(found["llama-sharded"]) if f.endswith(".safetensors")]) > 1
    return found


def _tokens(seed: int, rows: int = BATCH) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)


def _batch(tokens):
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _hf_logits_and_loss(model, tokens):
    """transformers' logits for `tokens` and its own loss with them as labels (shifted inside)."""
    with torch.no_grad():
        out = model(torch.tensor(tokens, dtype=torch.long), labels=torch.tensor(tokens).long())
    return out.logits.numpy(), float(out.loss)


def _trainer(path, layout):
    strategy, mesh, sp = LAYOUTS[layout]
    if mesh is None:
        model = hf.create_model(path)
        return jddp.Trainer(
            model, LM.loss_fn, adamw(), input_key="inputs", devices=jax.devices()[:1]
        )
    device_mesh = jddp.device_mesh_for(strategy, mesh, mesh_devices(mesh))
    model = hf.create_model(
        path,
        tensor_axis=device_mesh.tensor_axis,
        sequence_parallel=sp,
        scan_layers=device_mesh.stage_axis is not None,
    )
    rules = tensor_rules(hf.model_args(path)[0], model, device_mesh.size("tensor"))
    return jddp.Trainer(
        model,
        LM.loss_fn,
        adamw(),
        input_key="inputs",
        strategy=strategy,
        mesh=device_mesh,
        rules=adapt_preset(rules, device_mesh),
        min_shard_size=1,
    )


def _plain(model):
    """The same model unsplit and unrolled: the single-device reference's."""
    return model.clone(tensor_axis=None, sequence_parallel=False, scan_layers=False)


def _per_layer(params):
    return layer_stacks.to_per_layer(jax.tree.map(np.asarray, params))


# Each checkpoint on the layouts that read, place or run it differently. Sequence parallelism
# changes the activations only, not which shard of a tensor each device reads: a model on
# data:2,fsdp:2,tensor:2 is read the same with it or without it, so each model appears on that
# mesh once (the Llama without it, the others with it), and GPT-2's shards split over fsdp are
# read on fsdp:2 (there) and fsdp:4 (stage:2,fsdp:4); the Llama on fsdp:8 reads sharded files.
CASES = [
    ("llama", "1 device"),
    ("llama-sharded", "fsdp:8"),
    ("llama", "data:2,fsdp:2,tensor:2"),  # 2 key/value heads: split over tensor
    # every field the families add, at once (a superset of the plain Llama's layout)
    ("qwen3-all", "data:2,fsdp:2,tensor:2 sp"),
    ("qwen3-all", "stage:2,fsdp:4"),
    ("llama-mqa", "data:2,fsdp:2,tensor:2 sp"),  # one key/value head: replicated over tensor
    ("gpt2", "1 device"),
    ("gpt2", "data:2,fsdp:2,tensor:2 sp"),  # its fused q/k/v kernel split over tensor
    ("gpt2", "stage:2,fsdp:4"),
]


_REFERENCES = {}


def fine_tuned_reference(plain, params, batches):
    """(parameters, losses) of the single-device optax loop training `plain` from `params` on
    `batches`; computed once per model and parameters (the layouts of a checkpoint import the
    same ones)."""
    leaves = (np.asarray(x).tobytes() for x in jax.tree.leaves([params, batches]))
    key = (repr(plain), hashlib.sha256(b"".join(leaves)).hexdigest())
    if key not in _REFERENCES:

        def loss_fn(p, model_state, batch):
            logits = plain.apply({"params": p}, batch["inputs"])
            return LM.loss_fn(logits, batch).mean(), model_state

        expected, _, expected_losses = plain_training(loss_fn, params, {}, adamw(), batches)
        _REFERENCES[key] = expected, expected_losses
    return _REFERENCES[key]


@pytest.mark.parametrize("name,layout", CASES)
def test_import_finetune_export(checkpoints, tmp_path, name, layout):
    """Imported under `layout`: the same logits and loss as transformers (1e-5); exported
    untrained: the original tensors bit for bit; fine-tuned 20 steps: the single-device optax
    loop's parameters and losses (1e-5); exported and loaded by transformers: jddp's logits and
    loss."""
    path = checkpoints[name]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokens = _tokens(0)
    want_logits, want_loss = _hf_logits_and_loss(hf_model, tokens)

    trainer = _trainer(path, layout)
    state = hf.load(trainer, trainer.init(0, _batch(tokens)), path)
    params = _per_layer(state.params)
    plain = _plain(trainer.task.model)
    logits = plain.apply({"params": params}, tokens)
    np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=1e-5)
    # ... and the layout's own forward pass (its loss over the batch) agrees with transformers.
    eval_loss = trainer.evaluate(state, [_batch(tokens)])["loss"]
    np.testing.assert_allclose(eval_loss, want_loss, rtol=1e-5)
    if name != "gpt2" and "tensor" in layout:  # 2 key/value heads split, 1 does not
        spec = state.params["block_0"]["attn"]["k"]["kernel"].sharding.spec
        assert ("tensor" in str(spec)) == (name != "llama-mqa"), spec

    hf.save(state.params, trainer.task.model, str(tmp_path / "untrained"), max_shard_bytes=10**4)
    original, exported = safetensors_in(path), safetensors_in(tmp_path / "untrained")
    assert sorted(original) == sorted(exported)
    for tensor, value in original.items():
        assert exported[tensor].dtype == value.dtype and np.array_equal(exported[tensor], value)

    batches = [_batch(_tokens(seed)) for seed in range(1, STEPS + 1)]
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))

    expected, expected_losses = fine_tuned_reference(plain, params, batches)
    trained = _per_layer(state.params)
    assert_trees_close(trained, expected)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)

    out = tmp_path / "finetuned"
    hf.save(state.params, trainer.task.model, str(out))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    test_tokens = _tokens(99)
    theirs, their_loss = _hf_logits_and_loss(reloaded, test_tokens)
    ours = plain.apply({"params": trained}, test_tokens)
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=1e-5)
    our_loss = float(LM.loss_fn(ours[:, :-1], _batch(test_tokens)).mean())
    np.testing.assert_allclose(their_loss, our_loss, rtol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_equals_transformers_and_exports_as_itself(checkpoints, tmp_path, name):
    """Imported on 1 device: logits and the loss's gradient of every tensor equal transformers'
    (1e-5); exported (as `jddp-export` does, beside the original): config.json names the same
    family, and transformers loads it with the same logits."""
    path = checkpoints[name]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tokens = _tokens(0)
    ids = torch.tensor(tokens, dtype=torch.long)
    out = hf_model(ids, labels=ids)
    out.loss.backward()
    their_grads = {n: p.grad.numpy() for n, p in hf_model.named_parameters()}

    trainer = _trainer(path, "1 device")
    model = trainer.task.model
    params = _per_layer(hf.load(trainer, trainer.abstract_state(_batch(tokens)), path).params)

    @jax.jit
    def loss_and_logits(params):
        logits = model.apply({"params": params}, tokens)
        return LM.loss_fn(logits[:, :-1], _batch(tokens)).mean(), logits

    (loss, logits), grads = jax.value_and_grad(loss_and_logits, has_aux=True)(params)
    np.testing.assert_allclose(logits, out.logits.detach().numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(loss, float(out.loss.detach()), rtol=1e-5)
    ours = hf.hf_tensors(grads, model)
    assert sorted(ours) == sorted(their_grads)
    for tensor, grad in their_grads.items():
        np.testing.assert_allclose(ours[tensor], grad, atol=1e-5, rtol=1e-5, err_msg=tensor)

    hf.save(params, model, str(tmp_path / "out"), like=path)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == hf_model.config.model_type
    assert config["architectures"] == [type(hf_model).__name__]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    test_tokens = _tokens(99)
    theirs, _ = _hf_logits_and_loss(reloaded, test_tokens)
    np.testing.assert_allclose(theirs, model.apply({"params": params}, test_tokens), atol=1e-5)


def test_rotary_frequencies_equal_transformers():
    """jddp's rotary frequencies and cos/sin factor equal transformers' ROPE_INIT_FUNCTIONS for
    each scaling, YaRN's options too (head_dim 16, 1e-6 relative)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jddp.models import rotary

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    scalings = [
        {"rope_type": "linear", "factor": 4.0},
        {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
        yarn,
        yarn | {"beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},
        yarn | {"truncate": False, "attention_factor": 1.5},
    ]
    for scaling in scalings:
        parameters = {"rope_theta": 5000.0, **scaling}
        config = transformers.LlamaConfig(
            hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
            rope_parameters=parameters,
        )  # fmt: skip
        theirs, their_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
        ours, our_factor = rotary.frequencies(16, 5000.0, rotary.check_scaling(scaling))
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6, err_msg=str(scaling))
        assert our_factor == pytest.approx(their_factor, rel=1e-12), scaling


def _config_json(**entries) -> dict:
    base = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8}
    return base | {"num_hidden_layers": 1, "num_attention_heads": 2} | entries


@pytest.mark.parametrize(
    "entries,message",
    [
        ({"model_type": "bert"}, "model_type='bert'; jddp reads gpt2, llama, mistral, mixtral"),
        ({"rope_scaling": {"rope_type": "longrope"}}, "rope_type='longrope', which jddp's model"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks 'low_freq_factor'"),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor=0.5",
        ),  # fmt: skip
        ({"hidden_act": "gelu"}, "hidden_act='gelu', which jddp's model does not implement"),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4}
            | {"num_hidden_layers": 2, "max_window_layers": 1},
            "slides its attention window on some layers only (layer_types, max_window_layers=1)",
        ),
        ({"num_hidden_layers": None}, "num_hidden_layers=None; expected a positive integer"),
        ({"hidden_size": "8"}, "hidden_size='8'; expected a positive integer"),
    ],
    ids=lambda x: str(x)[:20],
)
def test_configs_jddp_cannot_build_are_one_line(tmp_path, entries, message):
    (tmp_path / "config.json").write_text(json.dumps(_config_json(**entries)))
    with pytest.raises(jddp.ConfigError) as raised:
        hf.create_model(str(tmp_path))
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "model,message",
    [
        (jddp_models.GPT(8, positions="rotary"), "learned positions and tied embeddings"),
        (jddp_models.MLP(num_classes=8), "MLP has no Hugging Face layout"),
        (
            jddp_models.Llama(8, num_heads=2, embed_dim=8, qk_norm=True, qkv_bias=True),
            "this Llama has qk_norm, qkv_bias, which no Hugging Face family jddp writes holds",
        ),
    ],
    ids=["rotary gpt", "mlp", "llama of no family"],
)
def test_models_without_a_hugging_face_layout_are_refused_before_writing(tmp_path, model, message):
    with pytest.raises(jddp.ConfigError) as raised:
        hf.save({}, model, str(tmp_path / "out"))
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()


class _CountedSlice:
    """safetensors' lazy slice of one tensor, recording how many of its elements each read
    returns (what indexing it reads from the file)."""

    def __init__(self, source, reads: list):
        self.source, self.reads = source, reads

    def __getattr__(self, name):
        return getattr(self.source, name)

    def __getitem__(self, index):
        part = self.source[index]
        self.reads.append(np.asarray(part).size)
        return part


def test_each_device_reads_only_its_shard_of_each_tensor(checkpoints, monkeypatch):
    """Imported under fsdp:8 (every tensor split 8 ways): each tensor is read in 8 pieces of an
    eighth, never whole, and the pieces together are the file's tensors once."""
    path = checkpoints["llama"]
    reads, sizes = {}, {}
    real_slice = hf_files.Reader.slice

    def counted_slice(reader, name):
        source = real_slice(reader, name)
        sizes[name] = int(np.prod(source.get_shape()))
        return _CountedSlice(source, reads.setdefault(name, []))

    monkeypatch.setattr(hf_files.Reader, "slice", counted_slice)
    trainer = _trainer(path, "fsdp:8")
    hf.load(trainer, trainer.abstract_state(_batch(_tokens(0))), path)
    assert sorted(reads) == sorted(safetensors_in(path))
    for name, pieces in reads.items():
        assert pieces == [sizes[name] // 8] * 8, (name, sizes[name], pieces)
