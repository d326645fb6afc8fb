"""Mixtral, Qwen2-MoE (with its gated shared expert) and Qwen3-MoE (q/k norms) checkpoints, each
with a sliding window, in and out, held to transformers itself: tiny random one-layer models
saved with save_pretrained (one tensor per expert on disk), imported with the logits and
gradients of transformers, fine-tuned on 8 devices as on one, exported and loaded back by
transformers."""

import collections
import json
import re

import jax
import numpy as np
import optax
import pytest
import torch
import transformers

import jddp
from jddp.checkpoints import hf, hf_files
from jddp.core import sown
from jddp.models import Llama
from jddp.run.objectives import OBJECTIVES
from tests.helpers import assert_one_line, safetensors_in
from tests.reference import assert_trees_close
from tests.tiny_gpt import adamw, mesh_devices

LM = OBJECTIVES["language_model"]
VOCAB, SEQ, BATCH = 64, 12, 8
DIMS = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    router_aux_loss_coef=0.02,
)
WINDOW = 5  # a sliding window shorter than the sequences
SLIDING = {"use_sliding_window": True, "sliding_window": WINDOW}
FAMILIES = {  # name: (config class, model class, its own fields)
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {"num_local_experts": 4, "sliding_window": WINDOW},
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        {"num_experts": 4, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12}
        | SLIDING,  # one layer: Qwen2-MoE's every other layer is every layer
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {"num_experts": 4, "moe_intermediate_size": 8, "norm_topk_prob": True, "head_dim": 8}
        | SLIDING,
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: save_pretrained directory}. Norms and biases are perturbed from their initial
    ones and zeros, and routers and experts scaled up from transformers' 0.02, so that a
    misplaced tensor shows and routing decides the logits."""
    root = tmp_path_factory.mktemp("hf_moe")
    torch.manual_seed(0)
    found = {}
    for name, (config_class, model_class, fields) in FAMILIES.items():
        model = model_class(config_class(**DIMS, **fields))
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if "norm" in param_name or "bias" in param_name:
                    p.add_(torch.randn_like(p) * 0.1)
                elif ".gate." in param_name:  # the router
                    p.mul_(50)
                elif "expert" in param_name:
                    p.mul_(10)
        model.save_pretrained(root / name)
        found[name] = str(root / name)
    return found


def _tokens(seed: int, rows: int = BATCH) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)


def _batch(tokens):
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _in_memory(tensors: dict) -> dict:
    """Tensors by their on-disk names (one per expert) as transformers 5 holds them in memory:
    each layer's experts stacked, gate and up joined (`experts.gate_up_proj`, (experts, 2 x
    width, hidden)), `experts.down_proj`; Mixtral's `block_sparse_moe` named `mlp`."""
    found, experts = {}, collections.defaultdict(dict)
    for name, value in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        expert = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if expert:
            experts[expert[1]][int(expert[2]), expert[3]] = value
        else:
            found[name] = value
    for prefix, parts in experts.items():
        gate, up, down = (
            ("w1", "w3", "w2") if (0, "w1") in parts else ("gate_proj", "up_proj", "down_proj")
        )
        count = 1 + max(e for e, _ in parts)
        joined = [np.concatenate([parts[e, gate], parts[e, up]]) for e in range(count)]
        found[f"{prefix}.gate_up_proj"] = np.stack(joined)
        found[f"{prefix}.down_proj"] = np.stack([parts[e, down] for e in range(count)])
    return found


STEPS, MESH = 2, "data:2,fsdp:4"


class _CountedReads:
    """safetensors' lazy slice of tensor `name`, adding the elements each read returns to
    `reads[name]`."""

    def __init__(self, source, name: str, reads: collections.Counter):
        self.source, self.name, self.reads = source, name, reads

    def __getattr__(self, attr):
        return getattr(self.source, attr)

    def __getitem__(self, index):
        part = self.source[index]
        self.reads[self.name] += np.asarray(part).size
        return part


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_checkpoint_equals_transformers_finetunes_on_8_devices_and_exports(
    checkpoints, tmp_path, monkeypatch, name
):
    """The experts' settings come from config.json. Imported under zero3 on data:2,fsdp:4,
    each device reading only its shard of each tensor (its part of its experts): on one
    device, the logits and the loss's gradient of every tensor equal transformers' with the
    load-balancing loss (1e-5; one layer, where transformers' loss over the layers' pooled
    counts is jddp's mean over layers); fine-tuned 2 steps, the single-device optax loop's
    parameters (1e-5); exported untrained, the original tensors bit for bit; exported
    fine-tuned, transformers loads it as the same family with jddp's logits."""
    path = checkpoints[name]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, output_router_logits=True)
    tokens = _tokens(0)
    inputs = torch.tensor(tokens[:, :-1], dtype=torch.long)
    targets = torch.tensor(tokens[:, 1:], dtype=torch.long)
    out = hf_model(inputs)  # the router's counts over the inputs alone, as jddp's
    their_ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    coefficient = hf_model.config.router_aux_loss_coef
    their_loss = their_ce + coefficient * out.aux_loss
    their_loss.backward()
    their_grads = {n: p.grad.numpy() for n, p in hf_model.named_parameters()}
    their_logits = out.logits.detach().numpy()

    device_mesh = jddp.device_mesh_for("zero3", MESH, mesh_devices(MESH))
    model = hf.create_model(path, batch_axis_name=device_mesh.batch_axes)
    moe = model.moe
    assert (moe.num_experts, moe.experts_per_token) == (4, 2)
    assert moe.load_balance_weight == coefficient == 0.02
    assert moe.normalize_top_k == (name != "qwen2_moe")  # Mixtral's always, Qwen's by config
    assert moe.expert_dim == (0 if name == "mixtral" else 8)
    assert moe.shared_expert_dim == (12 if name == "qwen2_moe" else 0)
    reads = collections.Counter()
    real_slice = hf_files.Reader.slice
    monkeypatch.setattr(
        hf_files.Reader, "slice", lambda r, n: _CountedReads(real_slice(r, n), n, reads)
    )
    trainer = jddp.Trainer(
        model,
        LM.loss_fn,
        adamw(),
        input_key="inputs",
        strategy="zero3",
        mesh=device_mesh,
        min_shard_size=1,
    )
    batches = [_batch(tokens)] + [_batch(_tokens(seed)) for seed in range(1, STEPS)]
    state = hf.load(trainer, trainer.init(0, batches[0]), path)
    # Each device read its own shard of each parameter, once: no tensor whole on every device.
    held = sum(s.data.size for x in jax.tree.leaves(state.params) for s in x.addressable_shards)
    assert sum(reads.values()) == held < 8 * sum(x.size for x in jax.tree.leaves(state.params))
    params = jax.device_get(state.params)

    reference = model.clone(batch_axis_name=None)  # one device, the whole batch
    optimizer = adamw()

    @jax.jit
    def reference_step(params, opt_state, batch):
        """The single-device optax step; its loss, logits and gradients besides."""

        def loss_fn(params):
            logits, reports = reference.apply(
                {"params": params}, batch["inputs"], mutable=list(sown.COLLECTIONS)
            )
            return LM.loss_fn(logits, batch).mean() + sown.sown_loss(reports), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, logits, grads

    opt_state = optimizer.init(params)
    _, _, loss, logits, grads = reference_step(params, opt_state, batches[0])
    np.testing.assert_allclose(logits, their_logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(loss, float(their_loss.detach()), rtol=1e-5)
    ours = _in_memory(hf.hf_tensors(grads, model))
    assert sorted(ours) == sorted(their_grads)
    for tensor, grad in their_grads.items():
        np.testing.assert_allclose(ours[tensor], grad, atol=1e-5, rtol=1e-5, err_msg=tensor)

    hf.save(params, model, str(tmp_path / "untrained"), like=path)
    written = json.loads((tmp_path / "untrained" / "config.json").read_text())
    assert written["model_type"] == name
    assert written["architectures"] == [type(hf_model).__name__]
    original, exported = safetensors_in(path), safetensors_in(tmp_path / "untrained")
    assert sorted(original) == sorted(exported)
    for tensor, value in original.items():
        assert np.array_equal(exported[tensor], value), tensor
    assert written["router_aux_loss_coef"] == coefficient

    expected = params
    for step, batch in enumerate(batches):
        state, metrics = trainer.step(state, batch)
        expected, opt_state, *_ = reference_step(expected, opt_state, batch)
        if step == 0:  # the step's loss is the cross-entropy alone
            assert float(metrics["loss"]) == pytest.approx(float(their_ce.detach()), rel=1e-5)
    trained = jax.device_get(trainer.host_state(state).params)
    assert_trees_close(trained, jax.device_get(expected))

    hf.save(trained, model, str(tmp_path / "finetuned"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "finetuned")
    assert type(reloaded) is type(hf_model)
    ours = reference_step(trained, opt_state, batches[0])[3]
    theirs = _hf_logits(reloaded, tokens[:, :-1])
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=1e-5)


def _config_json(model_type: str, **entries) -> dict:
    base = {"model_type": model_type, "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8}
    base |= {"num_hidden_layers": 2, "num_attention_heads": 2, "num_experts_per_tok": 2}
    return (
        base
        | {"num_experts": 4, "moe_intermediate_size": 4, "shared_expert_intermediate_size": 4}
        | entries
    )


@pytest.mark.parametrize(
    "entries,words",
    [
        (
            {"model_type": "qwen2_moe", "mlp_only_layers": [1]},
            ["dense MLP layers", "mlp_only_layers=[1]", "decoder_sparse_step 1"],
        ),
        (
            {"model_type": "qwen3_moe", "decoder_sparse_step": 2},
            ["dense MLP layers", "decoder_sparse_step=2"],
        ),
        (
            {"model_type": "qwen2_moe", "use_sliding_window": True, "sliding_window": 4},
            ["every other layer below max_window_layers=28", "layer_types"],
        ),
        (
            {"model_type": "mixtral", "router_jitter_noise": 0.1},
            ["router_jitter_noise=0.1", "does not implement"],
        ),
        ({"model_type": "qwen2_moe", "num_experts": 0}, ["num_experts=0", "positive integer"]),
        (
            {"model_type": "qwen3_moe", "num_experts_per_tok": 5},
            ["experts_per_token=5", "between 1 and num_experts=4"],
        ),
    ],
    ids=lambda x: str(x)[:40],
)
def test_moe_configs_jddp_cannot_build_are_one_line(tmp_path, entries, words):
    (tmp_path / "config.json").write_text(json.dumps(_config_json(**entries)))
    with pytest.raises(jddp.ConfigError) as raised:
        hf.create_model(str(tmp_path))
    assert_one_line(raised, *words)


def test_a_config_chooses_dispatch_and_loss_weights_over_the_checkpoints_and_no_more(tmp_path):
    """model_args.moe may set how tokens are dispatched and the auxiliary losses' weights; the
    experts themselves are the checkpoint's. A model no MoE family holds is refused before
    anything is written."""
    (tmp_path / "config.json").write_text(json.dumps(_config_json("mixtral")))
    init_from = f"hf:{tmp_path}"
    chosen = {"dispatch": "capacity", "capacity_factor": 2.0, "load_balance_weight": 0.0}
    args = hf.resolved_model_args("llama", {"moe": chosen | {"num_experts": 4}}, init_from)
    assert args["moe"]["num_experts"] == 4 and args["moe"]["normalize_top_k"]
    assert {k: args["moe"][k] for k in chosen} == chosen
    with pytest.raises(jddp.ConfigError) as raised:
        hf.resolved_model_args("llama", {"moe": {"num_experts": 8}}, init_from)
    assert_one_line(raised, "moe.num_experts=8 (config.json: 4)", "remove them from model_args")

    model = Llama(
        8, num_heads=2, embed_dim=8, moe={"num_experts": 4, "router_order": "topk_softmax"}
    )
    with pytest.raises(jddp.ConfigError) as raised:
        hf.save({}, model, str(tmp_path / "out"))
    assert_one_line(raised, "this Llama has moe, topk_softmax", "no Hugging Face family")
    assert not (tmp_path / "out").exists()
