"""LoRA held to PEFT on PyTorch: a tiny Hugging Face Llama, the same initial adapters (B nonzero,
so that the first steps already differ from the base model), SGD in float32 on 1 device (20
steps, with a save and restore halfway) and on `data:2,fsdp:2,tensor:2` (zero3) and
`stage:2,fsdp:4` (4 steps); the base bit for bit unchanged, the optimizer state the adapters'
alone; both exports loaded back by PEFT and transformers. With `lora.dropout`, 1 device and both
meshes train what a plain loop drawing every mask by the documented rule trains."""

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from flax import linen as nn
from flax import nnx

import jddp
from jddp.checkpoints import hf, peft_format
from jddp.core import layer_stacks, lora
from jddp.core.tree_paths import path_str
from jddp.models import tensor_rules
from jddp.parallel.rules import adapt_preset
from jddp.run.config import default_config, validate
from jddp.run.objectives import OBJECTIVES
from tests.helpers import configured, safetensors_in, tiny_llama_config
from tests.reference import per_example_ce
from tests.test_dropout import RULE_KEYS, step_keys
from tests.tiny_gpt import mesh_devices

LM = OBJECTIVES["language_model"]
VOCAB, SEQ, BATCH, LR, MOMENTUM = 96, 16, 8, 0.05, 0.9
LORA = jddp.LoRA(rank=4, alpha=8.0)
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A save_pretrained directory of a tiny random Llama (norms perturbed from ones)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB, rms_norm_eps=1e-5))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("lora") / "base"
    model.save_pretrained(path)
    return str(path)


def _tokens(seed: int) -> np.ndarray:
    """Batch `seed`: steps cycle through 2 batches (odd and even seeds), so the loss falls."""
    rng = np.random.default_rng(seed % 2 if seed < 99 else seed)
    return rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)


def _batch(tokens):
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _trainer(path, strategy="ddp", mesh=None, lora_config=LORA):
    """A Trainer of the Llama in `path` with LoRA, on 1 device or on `mesh`."""
    if mesh is None:
        model, placement = hf.create_model(path), {"devices": jax.devices()[:1]}
    else:
        device_mesh = jddp.device_mesh_for(strategy, mesh, mesh_devices(mesh))
        stacked = device_mesh.stage_axis is not None
        model = hf.create_model(path, tensor_axis=device_mesh.tensor_axis, scan_layers=stacked)
        rules = tensor_rules("llama", model, device_mesh.size("tensor"))
        placement = {
            "strategy": strategy,
            "mesh": device_mesh,
            "rules": adapt_preset(rules, device_mesh),
            "min_shard_size": 1,
        }
    optimizer = optax.sgd(LR, momentum=MOMENTUM)
    return jddp.Trainer(
        model, LM.loss_fn, optimizer, input_key="inputs", lora=lora_config, **placement
    )


def _adapters_to_start(trainer, path):
    """The base from `path` and adapters drawn here (B nonzero), placed as the layout says."""
    state = hf.load(trainer, trainer.init(0, _batch(_tokens(0))), path)
    rng = np.random.default_rng(1)

    def start(key_path, like):
        if not lora.is_adapter(key_path):
            return like
        return rng.normal(0, 0.2, like.shape).astype(np.float32)

    per_layer = layer_stacks.to_per_layer(jax.tree.map(np.asarray, state.params))
    drawn = jax.tree_util.tree_map_with_path(start, per_layer)  # the same draws on any layout
    if layer_stacks.is_stacked(hf._shapes(state.params)):
        drawn = layer_stacks.to_stacked(drawn)
    placed = jax.tree.map(lambda x, like: jax.device_put(x, like.sharding), drawn, state.params)
    return state.replace(params=placed)


def _peft_model(path, adapters: dict):
    """PEFT's LoRA on transformers' model from `path`, its adapters set to `adapters` (PEFT's
    names, as jddp's export writes them)."""
    config = peft.LoraConfig(
        r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0, target_modules=HF_TARGETS
    )
    model = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(path), config)
    own = {n.replace(".weight", ".default.weight"): torch.tensor(v) for n, v in adapters.items()}
    result = model.load_state_dict(own, strict=False)
    assert not result.unexpected_keys and not any("lora" in k for k in result.missing_keys)
    return model


def _peft_steps(model, batches) -> list[float]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=LR, momentum=MOMENTUM)
    losses = []
    for tokens in batches:
        loss = model(input_ids=torch.tensor(tokens).long(), labels=torch.tensor(tokens).long()).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def _peft_adapters(model) -> dict[str, np.ndarray]:
    return {
        n.replace(".default.weight", ".weight"): p.detach().numpy()
        for n, p in model.named_parameters()
        if "lora_" in n
    }


def _jddp_steps(trainer, state, batches):
    losses = []
    for tokens in batches:
        state, metrics = trainer.step(state, _batch(tokens))
        losses.append(float(metrics["loss"]))
    return state, losses


def _check_against_peft(path, trainer, state, steps, halfway=None):
    """`steps` of jddp from `state` equal PEFT's from the same adapters (`halfway(state)`
    between the two halves: a save and restore); the base unchanged and the optimizer state the
    adapters' alone. Returns jddp's state after them."""
    start = peft_format.adapter_tensors(state.params, trainer.task.model)
    model = _peft_model(path, start)
    batches = [_tokens(seed) for seed in range(1, steps + 1)]
    want_losses = _peft_steps(model, batches)
    state, losses = _jddp_steps(trainer, state, batches[: steps // 2])
    state = halfway(state) if halfway else state
    state, more = _jddp_steps(trainer, state, batches[steps // 2 :])
    np.testing.assert_allclose(losses + more, want_losses, rtol=1e-5)
    assert want_losses[-1] < want_losses[0]  # it trained
    got = peft_format.adapter_tensors(state.params, trainer.task.model)
    want = _peft_adapters(model)
    assert sorted(got) == sorted(want)
    for name in want:
        assert not np.allclose(want[name], start[name]), name  # every adapter moved
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=1e-5, err_msg=name)

    base_now = hf.hf_tensors(lora.split(trainer.host_state(state).params)[0], trainer.task.model)
    for name, value in safetensors_in(path).items():
        assert np.array_equal(base_now[name], value), name  # bit for bit
    shaped = [
        path_str(p) for p, x in jax.tree_util.tree_leaves_with_path(state.opt_state) if x.ndim
    ]
    assert shaped and all(lora.is_adapter(p.split("/")[-1]) for p in shaped), shaped
    return state


def test_one_device_equals_peft_resumes_and_exports_both_ways(base, tmp_path):
    trainer = _trainer(base)
    state = _adapters_to_start(trainer, base)

    def saved_and_restored(state):
        jddp.save(str(tmp_path / "run"), state, trainer=trainer)
        return jddp.restore(str(tmp_path / "run"), trainer, _batch(_tokens(0)))

    state = _check_against_peft(base, trainer, state, 20, saved_and_restored)

    params = trainer.host_state(state).params
    tokens = _tokens(99)
    ours = np.asarray(trainer.task.forward(params, {}, {"inputs": tokens}, train=False)[0])
    peft_format.save(params, trainer.task.model, LORA, str(tmp_path / "adapters"), base_model=base)
    loaded = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(base), str(tmp_path / "adapters")
    ).eval()
    with torch.no_grad():
        theirs = loaded(torch.tensor(tokens).long()).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=1e-5)

    hf.save(lora.merged(params, LORA.scale), trainer.task.model, str(tmp_path / "merged"))
    merged = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        theirs = merged(torch.tensor(tokens).long()).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "strategy,mesh", [("zero3", "data:2,fsdp:2,tensor:2"), ("zero3", "stage:2,fsdp:4")]
)
def test_sharded_base_equals_peft(base, strategy, mesh):
    trainer = _trainer(base, strategy, mesh)
    state = _adapters_to_start(trainer, base)
    state = _check_against_peft(base, trainer, state, 3)
    # The base keeps the layout's sharding (Megatron's column split of q over tensor).
    kernel = state.params["block_0" if "tensor" in mesh else "blocks"]
    if "tensor" in mesh:
        assert "tensor" in str(kernel["attn"]["q"]["kernel"].sharding.spec)


# ------------------------------------------------------------------- the adapters' dropout
# A column-parallel projection (q) and a row-parallel one (down, its input split over `tensor`),
# in each of the two layers: four masks, each its own (fewer targets: a quicker compile).
DROPPING = jddp.LoRA(rank=4, alpha=32.0, dropout=0.5, targets=r"attn/q$|mlp/down$")
DROPOUT_STEPS = 3


class _FirstKey(nn.Module):
    """The first key of a Linen model's `dropout` stream at its top (the decoder's `layer_key`)."""

    def __call__(self):
        return self.make_rng("dropout")


def _rule_loss(model, base, adapters, tokens, key_data, rate):
    """Mean cross-entropy of `model` (jddp's Llama, no LoRA) with the adapters added here, each
    mask drawn by the documented rule: the adapters on module `within` (`attn/q`) of layer i
    draw from fold_in(fold_in(K, i), crc32(within)), K the top of the `dropout` stream."""
    top = _FirstKey().apply(
        {}, rngs={"dropout": jax.random.wrap_key_data(key_data, impl=RULE_KEYS)}
    )
    flat = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(adapters)}
    modules = {name.rsplit("/", 1)[0] for name in flat}
    per_module = {m: (flat[f"{m}/lora_A"], flat[f"{m}/lora_B"]) for m in modules}

    def add_adapters(next_fun, args, kwargs, context):
        y = next_fun(*args, **kwargs)
        where = "/".join(context.module.path)
        if context.method_name != "__call__" or where not in per_module:
            return y
        layer, within = where.split("/", 1)
        key = jax.random.fold_in(top, int(layer.removeprefix("block_")))
        key = jax.random.fold_in(key, zlib.crc32(within.encode()))
        x = args[0]
        keep = jax.random.bernoulli(key, 1 - rate, x.shape)
        a, b = per_module[where]
        return y + (jnp.where(keep, x / (1 - rate), 0) @ a @ b) * DROPPING.scale

    with nn.intercept_methods(add_adapters):
        logits = model.apply({"params": base}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@pytest.fixture(scope="module")
def dropout_rule(base):
    """A 1-device trainer with DROPPING and its state to start from; the rule's losses and
    final adapters (per layer) over DROPOUT_STEPS SGD steps from there, in a plain loop."""
    trainer = _trainer(base, lora_config=DROPPING)
    state = _adapters_to_start(trainer, base)
    base_params, adapters = lora.split(trainer.host_state(state).params)
    model, optimizer = hf.create_model(base), optax.sgd(LR, momentum=MOMENTUM)

    @jax.jit
    def step(adapters, opt_state, tokens, key_data, rate):
        loss_fn = lambda a: _rule_loss(model, base_params, a, tokens, key_data, rate)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(adapters)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return loss, optax.apply_updates(adapters, updates), opt_state

    opt_state, losses = optimizer.init(adapters), []
    keys = [jax.random.key_data(k) for k in step_keys(DROPOUT_STEPS)]
    no_dropout = step(adapters, opt_state, _tokens(1), keys[0], np.float32(0))[0]
    for seed, key_data in enumerate(keys, start=1):
        loss, adapters, opt_state = step(
            adapters, opt_state, _tokens(seed), key_data, np.float32(DROPPING.dropout)
        )
        losses.append(float(loss))
    assert abs(float(no_dropout) - losses[0]) > 1e-4  # the masks drop: 20x the tolerance
    return trainer, state, losses, jax.device_get(adapters)


@pytest.mark.parametrize(
    "strategy,mesh",
    [("ddp", None), ("zero3", "data:2,fsdp:2,tensor:2"), ("zero3", "stage:2,fsdp:4")],
)
def test_adapter_dropout_draws_by_the_rule_on_every_layout(base, dropout_rule, strategy, mesh):
    """With lora.dropout > 0, one device, a tensor mesh and a pipeline (stacked layers) train
    what a plain loop that draws every mask by the documented rule trains."""
    trainer, state, want_losses, want_adapters = dropout_rule
    if mesh:
        trainer = _trainer(base, strategy, mesh, lora_config=DROPPING)
        state = _adapters_to_start(trainer, base)
    state, losses = _jddp_steps(trainer, state, [_tokens(s) for s in range(1, DROPOUT_STEPS + 1)])
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _, adapters = lora.split(layer_stacks.to_per_layer(trainer.host_state(state).params))
    close = lambda got, want: np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)  # noqa: E731
    jax.tree.map(close, adapters, want_adapters)


class _NnxIdentity(nnx.Module):
    """An NNX model (no parameters: nothing to compute before the check)."""

    def __call__(self, x):
        return x


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: jddp.LoRA(rank=-1), "lora.rank must be a positive integer"),
        (lambda: jddp.LoRA(rank=4, dropout=1.0), "lora.dropout must be in [0, 1)"),
        (lambda: jddp.LoRA(rank=4, targets="("), "is not a regex"),
        (
            lambda: jddp.Trainer(_NnxIdentity(), per_example_ce, optax.sgd(0.1), lora=LORA),
            "lora adapts Linen models only and _NnxIdentity is an NNX module",
        ),
        (
            lambda: validate(configured(default_config(), {"lora.rank": -1})),
            "lora.rank must be an integer >= 0",
        ),
        (
            lambda: validate(
                configured(default_config(), {"lora.rank": 4, "parallel.sequence_parallel": True})
            ),
            "lora does not run under parallel.sequence_parallel",
        ),
    ],
)
def test_bad_settings_are_one_line(make, message):
    with pytest.raises(jddp.ConfigError, match=re.escape(message)):
        make()


def test_targets_matching_nothing_and_too_large_ranks_are_one_line(base, tmp_path):
    for lora_config, message in [
        (jddp.LoRA(rank=4, targets="nothing_here"), "matches no module of the model"),
        (jddp.LoRA(rank=64, targets="attn/q$"), "is larger than block_0/attn/q's kernel"),
    ]:
        with pytest.raises(jddp.ConfigError, match=message) as raised:
            _trainer(base, lora_config=lora_config).init(0, _batch(_tokens(0)))
        assert "\n" not in str(raised.value)
    model = hf.create_model(base)
    params = model.init(jax.random.key(0), _tokens(0))["params"]
    with pytest.raises(jddp.CheckpointError, match="hold no LoRA adapters"):
        peft_format.save(params, model, LORA, str(tmp_path / "adapters"))
    assert not (tmp_path / "adapters").exists()


def test_a_checkpoint_written_before_lora_resumes_without_it():
    """A config saved before `lora` existed counts as lora.rank 0: no change, unless set."""
    from jddp.run import resume

    config = default_config()
    saved = config.to_dict()
    saved.pop("lora")
    assert resume.config_changes(saved, config) == {}
    config.lora.rank = 4
    assert resume.config_changes(saved, config) == {"lora.rank": [0, 4]}


def test_the_planner_counts_optimizer_state_for_the_adapters_alone(base):
    from jddp.planner import memory_model, workload
    from jddp.planner.layouts import Layout

    model, tokens = hf.create_model(base), _tokens(0)[:1, :-1]
    full = workload.model_workload(model, tokens, BATCH, optax.adam(1e-3))
    adapted = workload.model_workload(model, tokens, BATCH, optax.adam(1e-3), lora=LORA)
    _, adapters = lora.split(adapted.params)
    adapter_bytes = sum(x.size * 4 for x in jax.tree.leaves(adapters))
    layout = Layout("zero3", fsdp=1)
    before, after = (memory_model.state_bytes(w, layout) for w in (full, adapted))
    assert after.params == before.params + adapter_bytes
    assert after.optimizer - 4 == 2 * adapter_bytes < before.optimizer  # Adam's count: 4 bytes


def test_the_chat_lora_recipe_trains_adapters_that_peft_and_transformers_load(tmp_path):
    """experiments/configs/llama_chat_lora.py (zero3 on 8 devices) on a tiny Llama saved by
    transformers with a Llama 3-style chat tokenizer and a jsonl of conversations: trains the
    adapters, and its two exports, loaded by PEFT onto the checkpoint and by transformers,
    compute the same logits, other than the base's."""
    import json

    from experiments.configs import llama_chat_lora
    from jddp.run import export
    from jddp.run.experiment import train_and_evaluate
    from tests.chat_tokenizer import LLAMA3, save_chat_tokenizer

    torch.manual_seed(0)
    checkpoint = str(tmp_path / "llama")
    transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=384)).save_pretrained(checkpoint)
    save_chat_tokenizer(checkpoint, LLAMA3)
    chats = tmp_path / "chat.jsonl"
    rows = [
        [{"role": "user", "content": f"What is the capital of {c}?"},
         {"role": "assistant", "content": f"The capital of {c} is {city}."}]
        for c, city in [("France", "Paris"), ("Italy", "Rome")] * 8
    ]  # fmt: skip
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    config = configured(
        llama_chat_lora.get_config(),
        {"init_from": f"hf:{checkpoint}", "data.tokenizer": checkpoint, "dataset": f"jsonl:{chats}",
         "data.seq_len": 32, "global_batch_size": 8, "num_train_steps": 2, "warmup_steps": 0,
         "eval_every": 2, "checkpoint_every": 2, "log.writers": "",
         "compute_dtype": "float32", "model_args.remat": False},
    )  # fmt: skip
    train_and_evaluate(config, str(tmp_path / "run"))
    export.export_run(str(tmp_path / "run"), str(tmp_path / "merged"), max_shard_bytes=10**9)
    export.export_run(
        str(tmp_path / "run"), str(tmp_path / "peft"), max_shard_bytes=10**9, form="peft"
    )

    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (16, 32)
    tokens = torch.tensor(np.random.default_rng(0).integers(0, 384, (2, 16)))
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        before = base(tokens).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
        theirs = adapted(tokens).logits.numpy()
    targeted = {name.split(".")[-1] for name in adapted.base_model.targeted_module_names}
    assert targeted == set(HF_TARGETS)  # every attention and MLP projection
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        ours = merged(tokens).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=1e-5)
    assert np.abs(ours - before).max() > 1e-4  # the adapters moved from B = 0
