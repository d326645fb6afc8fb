"""Mixture of experts: the MoE MLP equals a token-by-token reference written here (both router
orders, shared experts, capacity drops by the documented rule) and its auxiliary losses their
formulas; a tiny MoE GPT and Llama train on 8 devices exactly as on one, tokens dropped alike,
with the experts split over an expert axis too (its all-to-all bytes as
jddp/models/moe_dispatch.py counts them); bad settings and layouts are one-line errors."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp import models
from jddp.core import sown
from jddp.errors import ConfigError
from jddp.models import GPT, Llama
from jddp.models.gpt import MLP
from jddp.models.llama import SwiGLU
from jddp.models.moe import MoE, grouped_matmul
from jddp.models.moe_dispatch import all_to_all_bytes
from jddp.models.moe_settings import MoESettings
from jddp.observe.hlo import bytes_by_axes, collective_ops
from jddp.parallel.rules import adapt_preset, validate_rules
from jddp.run.objectives import OBJECTIVES
from tests.helpers import assert_one_line, save_and_restore
from tests.reference import assert_trees_close, plain_training
from tests.tiny_gpt import adamw, token_batches

LM = OBJECTIVES["language_model"]
EMBED, WIDTH = 8, 16


def gelu(h):
    return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))


def silu(h):
    return h / (1 + np.exp(-h))


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def reference_moe(params, x, settings: MoESettings, gated: bool):
    """The MoE MLP token by token in numpy: each token through each of its chosen experts, in
    the global batch's order, an expert past its capacity taking no more tokens."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    tokens = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    k, experts = settings.experts_per_token, settings.num_experts
    capacity = math.ceil(settings.capacity_factor * len(tokens) * k / experts)
    taken = np.zeros(experts, int)
    out, dropped = np.zeros_like(tokens), 0
    for t, token in enumerate(tokens):
        logits = token @ p["router"]
        chosen = np.argsort(-logits, kind="stable")[:k]
        if settings.router_order == "topk_softmax":
            weights = softmax(logits[chosen])
        else:
            weights = softmax(logits)[chosen]
            weights = weights / weights.sum() if settings.normalize_top_k else weights
        for e, w in zip(chosen, weights, strict=True):
            taken[e] += 1
            if settings.dispatch == "capacity" and taken[e] > capacity:
                dropped += 1
                continue
            h = token @ p["experts"]["up"][e]
            h = silu(token @ p["experts"]["gate"][e]) * h if gated else gelu(h)
            out[t] += w * (h @ p["experts"]["down"][e])
        if settings.shared_expert_dim:
            s = p["shared_expert"]
            if gated:
                h = silu(token @ s["gate"]["kernel"]) * (token @ s["up"]["kernel"])
                shared = h @ s["proj"]["kernel"]
            else:
                shared = gelu(token @ s["fc"]["kernel"] + s["fc"]["bias"]) @ s["proj"]["kernel"]
                shared = shared + s["proj"]["bias"]
            if settings.shared_expert_gate:
                shared = shared / (1 + np.exp(-(token @ p["shared_expert_gate"])))
            out[t] += shared
    return out.reshape(x.shape), dropped / (len(tokens) * k)


def reference_aux(router, x, settings: MoESettings):
    """The load-balancing loss E sum_e f_e P_e and the z-loss over every token of `x`."""
    logits = np.asarray(x, np.float64).reshape(-1, x.shape[-1]) @ np.asarray(router, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, : settings.experts_per_token]
    fraction = np.bincount(chosen.ravel(), minlength=settings.num_experts) / len(logits)
    lse = np.log(np.exp(logits).sum(-1))
    return {
        "moe_load_balance_loss": settings.num_experts * np.sum(fraction * probs.mean(0)),
        "moe_z_loss": np.mean(lse**2),
        "moe_expert_load_min": fraction.min(),
        "moe_expert_load_max": fraction.max(),
    }


CASES = [  # (settings, gated): both router orders, shared experts, capacity drops
    (MoESettings(4, 2, normalize_top_k=False, shared_expert_dim=6), True),
    (MoESettings(4, 3, router_order="topk_softmax", shared_expert_dim=6), False),
    (MoESettings(4, 2, shared_expert_dim=6, shared_expert_gate=False, z_loss_weight=0.1), True),
    (MoESettings(4, 1, dispatch="capacity", capacity_factor=0.75), False),
]


def test_moe_mlp_equals_a_token_by_token_reference_and_its_losses_their_formulas():
    x = jax.random.normal(jax.random.key(0), (3, 8, EMBED))
    for settings, gated in CASES:
        dense = functools.partial(SwiGLU, use_bias=False, residual_init_std=0.02)
        if not gated:
            dense = functools.partial(MLP, residual_init_std=0.02)
        moe = MoE(settings, WIDTH, gated, 0.02, dense, layers=2)
        params = jax.jit(moe.init)(jax.random.key(1), x)["params"]
        # Wider weights than a fresh model's, so that routing and experts matter.
        params = jax.tree.map(lambda a: a * 20, params)
        apply = jax.jit(functools.partial(moe.apply, mutable=list(sown.COLLECTIONS)))
        y, reports = apply({"params": params}, x)
        expected, dropped = reference_moe(params, x, settings, gated)
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        metrics = sown.sown_metrics(reports)
        aux = reference_aux(params["router"], x, settings)
        if settings.dispatch == "capacity":
            assert dropped > 0
            aux["moe_dropped_fraction"] = dropped
        assert set(metrics) == set(aux)
        for name, value in aux.items():
            assert float(metrics[name]) == pytest.approx(value, rel=1e-5), name
        weighted = settings.load_balance_weight * aux["moe_load_balance_loss"]
        weighted = (weighted + settings.z_loss_weight * aux["moe_z_loss"]) / 2
        assert float(sown.sown_loss(reports)) == pytest.approx(weighted, rel=1e-5)

    # Under vmap (auto's batch axes) the experts run as one masked product: the same rows.
    rows, weights = x.reshape(-1, EMBED)[:10], jax.random.normal(jax.random.key(2), (3, EMBED, 5))
    sizes = jnp.array([3, 0, 5])  # the last 2 rows in no group: zeros
    np.testing.assert_allclose(
        grouped_matmul(rows, weights, sizes, masked=True),
        grouped_matmul(rows, weights, sizes, masked=False),
        rtol=1e-6,
        atol=1e-6,
    )

    # Two layers' reports make one number each: min, max, mean; their losses add up.
    names = ("moe_expert_load_min", "moe_expert_load_max", "moe_z_loss")
    two = {sown.METRICS: {f"block_{i}": {n: (v,) for n in names} for i, v in enumerate((1.0, 3.0))}}
    assert sown.sown_metrics(two) == {
        "moe_expert_load_min": 1.0,
        "moe_expert_load_max": 3.0,
        "moe_z_loss": 2.0,
    }
    assert sown.sown_loss({sown.LOSSES: {"a": {"moe": (1.0,)}, "b": {"moe": (2.0,)}}}) == 3.0


MOE = {"num_experts": 8, "experts_per_token": 2, "z_loss_weight": 1e-3}
SHARED = MOE | {"shared_expert_dim": 16}
# Capacity small enough that on expert:8 it bounds what a device sends (moe_dispatch.py).
CAPACITY = MOE | {"dispatch": "capacity", "capacity_factor": 0.25}


def tiny_moe(family, moe, **fields):
    cls = GPT if family == "gpt" else Llama
    dims = dict(vocab_size=64, num_layers=1, num_heads=4, embed_dim=32, max_seq_len=16)
    return cls(**dims, mlp_dim=32, moe=moe, **fields)


def moe_trainer(model, strategy, mesh=None):
    options = {"mesh": mesh, "min_shard_size": 1} if mesh else {}
    if mesh and "tensor" in mesh:  # the model's Megatron layout, experts' MLPs included
        device_mesh = jddp.device_mesh_for(strategy, mesh, jax.devices()[:8])
        family = "gpt" if isinstance(model, GPT) else "llama"
        preset = models.tensor_rules(family, model, device_mesh.size("tensor"))
        options |= {"mesh": device_mesh, "rules": adapt_preset(preset, device_mesh)}
    return jddp.Trainer(
        model,
        LM.loss_fn,
        adamw(),
        input_key=LM.input_key,
        strategy=strategy,
        devices=jax.devices()[:8],
        **options,
    )


DATA_8, ZERO3 = ("ddp", None), ("zero3", "data:2,fsdp:4")
# Expert parallelism: the experts split over `expert`, tokens sent to them by all-to-all
# (under `auto`, the compiler's collectives).
EXPERT_8, EXPERT_FSDP = ("zero3", "expert:8"), ("zero3", "expert:4,fsdp:2")
AUTO = ("auto", "expert:2,fsdp:4")
# The experts' MLPs split over tensor as Megatron's, with sequence parallelism.
EXPERT_TENSOR = ("zero3", "data:2,expert:2,tensor:2")
EXPERT_CONTEXT = ("zero3", "expert:2,context:2,fsdp:2")


@pytest.mark.parametrize(
    "family,moe,layouts,counted",  # counted: the layouts whose all-to-all bytes are checked
    [
        ("gpt", CAPACITY, (DATA_8, EXPERT_8, EXPERT_FSDP, EXPERT_TENSOR, EXPERT_CONTEXT), (1, 4)),
        ("llama", SHARED, (AUTO, EXPERT_8, EXPERT_FSDP, EXPERT_TENSOR, EXPERT_CONTEXT), (2,)),
    ],
    ids=["gpt-capacity", "llama-dropless"],
)
@pytest.mark.filterwarnings("ignore:parallel.mesh .data.2,expert.2,tensor.2. gives zero3")
def test_a_moe_decoder_on_8_devices_trains_what_one_device_trains(
    family, moe, layouts, counted, tmp_path
):
    """Each layout trains the one-device run's losses, statistics and parameters; a checkpoint
    saved after the first step on expert:4,fsdp:2 restores onto expert:8 (another expert-axis
    size) bit for bit and its second step ends where one device's does."""
    batches = token_batches(steps=2)
    axes = {"batch_axis_name": "batch", "expert_axis": "expert"}
    # Fields of the model's own for the mesh's axes: under sequence parallelism, context.
    by_axis = {
        "tensor": {"tensor_axis": "tensor", "sequence_parallel": True},
        "context": {"context_axis": "context"},
    }
    reference = tiny_moe(family, moe)  # no batch axes: one device holds the whole batch
    params = reference.init(jax.random.key(0), batches[0]["inputs"][:1])["params"]
    forward = one_device_forward(reference)

    def loss_fn(params, model_state, batch):
        ce, extra, _ = forward(params, batch)
        return ce + extra, model_state

    expected, _, _ = plain_training(loss_fn, params, {}, adamw(), batches)
    trainers = {}
    for strategy, mesh in layouts:
        fields = [by_axis[axis] for axis in by_axis if axis in (mesh or "")]
        model = tiny_moe(family, moe, **axes, **{k: v for f in fields for k, v in f.items()})
        trainer = moe_trainer(model, strategy, mesh)
        state = trainer.init(seed=0, sample_batch=batches[0])
        state = trainer.replace_state(state, params=params)
        trainers[strategy, mesh] = trainer
        for step, batch in enumerate(batches):
            ce, _, reported = forward(trainer.host_state(state).params, batch)
            state, metrics = trainer.step(state, batch)
            if step == 0 and (strategy, mesh) == EXPERT_FSDP:
                reader = trainers[EXPERT_8]
                resumed = resume_on_another_expert_axis(trainer, state, reader, batches, tmp_path)
                assert_trees_close(reader.host_state(resumed).params, expected)
            assert float(metrics["loss"]) == pytest.approx(float(ce), rel=1e-5)
            assert set(reported) <= set(metrics)
            for name, value in reported.items():
                assert float(metrics[name]) == pytest.approx(float(value), rel=1e-5), name
        assert_trees_close(trainer.host_state(state).params, expected)
        if (strategy, mesh) in [layouts[i] for i in counted]:
            assert_all_to_all_bytes(trainer, state, batches[0], MoESettings(**moe))
    if moe.get("dispatch") == "capacity":
        assert float(metrics["moe_dropped_fraction"]) > 0


def one_device_forward(reference):
    """(cross-entropy, the sown losses, the sown metrics) of a whole batch on one device."""

    @jax.jit
    def forward(params, batch):
        logits, reports = reference.apply(
            {"params": params}, batch["inputs"], mutable=list(sown.COLLECTIONS)
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        return ce, sown.sown_loss(reports), sown.sown_metrics(reports)

    return forward


@pytest.mark.parametrize(
    "moe,meshes",
    [(CAPACITY, ("stage:2,expert:4", "stage:2,fsdp:4")), (MOE, ("stage:2,expert:4",))],
    ids=["capacity", "dropless"],
)
def test_moe_layers_in_a_pipeline_train_what_one_device_trains_micro_batch_by_micro_batch(
    moe, meshes
):
    """On a pipeline (2 stages, 2 micro-batches, 4 replicas; experts split over expert or
    whole), the 2 layers' auxiliary losses and metrics are each global micro-batch's, as with
    accumulation on one device: the losses, statistics and parameters are one device's fed
    those micro-batches, with tokens dropped (capacity) and without (dropless)."""
    batches, replicas, micro = token_batches(steps=2), 4, 2
    dims = dict(vocab_size=64, num_layers=2, num_heads=4, embed_dim=32, max_seq_len=16)
    reference = GPT(**dims, mlp_dim=32, moe=moe, scan_layers=True)  # stacked, as stages
    params = reference.init(jax.random.key(0), batches[0]["inputs"][:1])["params"]
    forward = one_device_forward(reference)
    rows = len(batches[0]["inputs"]) // replicas // micro
    # Global micro-batch m: micro-batch m of every replica, the replicas in order.
    order = [
        np.concatenate([np.arange(rows) + (d * micro + m) * rows for d in range(replicas)])
        for m in range(micro)
    ]

    def micro_batched(params, batch):
        """(loss trained, cross-entropy, sown metrics), each averaged over the micro-batches."""
        outs = [forward(params, jax.tree.map(lambda x, o=o: x[o], batch)) for o in order]
        loss = sum(ce + extra for ce, extra, _ in outs) / micro
        ce = sum(ce for ce, _, _ in outs) / micro
        return loss, ce, jax.tree.map(lambda *v: sum(v) / micro, *(m for _, _, m in outs))

    expected, _, _ = plain_training(
        lambda p, s, b: (micro_batched(p, b)[0], s), params, {}, adamw(), batches
    )
    axes = {"batch_axis_name": "batch", "expert_axis": "expert"}
    model = reference.clone(**axes)
    for mesh in meshes:
        trainer = moe_trainer(model, "zero3", mesh)
        state = trainer.init(seed=0, sample_batch=batches[0])
        state = trainer.replace_state(state, params=params)
        for batch in batches:
            _, ce, reported = micro_batched(trainer.host_state(state).params, batch)
            state, metrics = trainer.step(state, batch)
            assert float(metrics["loss"]) == pytest.approx(float(ce), rel=1e-5)
            assert set(reported) == set(metrics) - {"loss", "grad_norm"} and reported
            for name, value in reported.items():
                assert float(metrics[name]) == pytest.approx(float(value), rel=1e-5), name
        assert_trees_close(trainer.host_state(state).params, expected)


def resume_on_another_expert_axis(writer, state, reader, batches, tmp_path):
    """`state` (after the first of `batches`) saved by `writer` and restored by `reader`, on
    another expert-axis size, is the same state; returns it after `reader`'s second step."""
    saved = writer.host_state(state)
    _, restored, _ = save_and_restore(writer, state, reader, batches[0], str(tmp_path), step=1)
    jax.tree.map(np.testing.assert_array_equal, reader.host_state(restored), saved)
    return reader.step(restored, batches[1])[0]


def assert_all_to_all_bytes(trainer, state, batch, settings: MoESettings):
    """The compiled step's all-to-alls move over `expert` what `all_to_all_bytes` says."""
    device_mesh = trainer.strategy.device_mesh
    placed = trainer.place_batch(batch).arrays
    text = trainer.strategy.lower_train_step(state, placed).compile().as_text()
    axes = device_mesh.axis_names
    ids = np.vectorize(lambda d: d.id)(device_mesh.mesh.devices)
    moved = {key: n for key, n in bytes_by_axes(collective_ops(text), ids, axes).items()}
    rows, seq_len = batch["inputs"].shape
    shares = device_mesh.batch_slices * device_mesh.size("context")  # of the global tokens
    expected = all_to_all_bytes(
        settings,
        tokens_per_device=rows * seq_len // shares,
        batch_slices=shares,
        embed_dim=32,
        expert_size=device_mesh.size("expert"),
    )
    assert moved[(("expert",), "all-to-all")] == expected  # one MoE layer
    assert {kind for _, kind in moved} >= {"all-to-all"}


@pytest.mark.parametrize(
    "moe,fields,words",
    [
        ({"num_experts": -1}, {}, ["num_experts=-1", ">= 0"]),
        ({"num_experts": 4, "experts_per_token": 5}, {}, ["experts_per_token=5", "between 1"]),
        ({"num_experts": 4, "capacity_factor": 0}, {}, ["capacity_factor=0", "> 0"]),
        ({"num_experts": 4, "dispatch": "drop"}, {}, ["dispatch='drop'", "dropless, capacity"]),
        ({"num_experts": 4, "router_order": "top"}, {}, ["router_order='top'", "softmax_topk"]),
        ({"num_expert": 4}, {}, ["no field 'num_expert'", "did you mean 'num_experts'"]),
    ],
    ids=lambda x: str(x)[:30],
)
def test_bad_moe_settings_are_one_line_config_errors(moe, fields, words):
    with pytest.raises(ConfigError) as error:
        tiny_moe("gpt", moe, **fields)
    assert_one_line(error, "model_args.moe" if not fields else "", *words)


@pytest.mark.parametrize(
    "moe,expert_axis,mesh,words",
    [
        ({"num_experts": 6}, "expert", "expert:4,fsdp:2", ["6 experts", "expert:4", "multiple"]),
        (None, "expert", "expert:8", ["expert:8", "no mixture of experts", "model_args.moe"]),
        (MOE, None, "expert:8", ["expert_axis is not set", "expert_axis='expert'"]),
    ],
    ids=["indivisible", "dense-model", "axis-not-given"],
)
def test_an_expert_axis_that_cannot_hold_the_experts_is_refused_before_a_step(
    moe, expert_axis, mesh, words
):
    batch = token_batches(steps=1)[0]
    trainer = moe_trainer(tiny_moe("gpt", moe, expert_axis=expert_axis), "zero3", mesh)
    with pytest.raises(ConfigError) as error:
        state = trainer.abstract_state(batch)  # the layout: checked without computing
        trainer.strategy.lower_train_step(state, trainer.strategy.abstract_batch(batch))
    assert_one_line(error, *words)


def test_a_partition_rule_naming_the_expert_axis_is_refused():
    mesh = jddp.device_mesh_for("zero3", "expert:4,fsdp:2", jax.devices()[:8])
    with pytest.raises(ConfigError) as error:
        validate_rules((("head/kernel", "expert"),), mesh)
    assert_one_line(error, "names the expert axis", "shard over fsdp or tensor")


def test_auxiliary_losses_with_a_weighted_loss_are_refused_when_the_step_is_traced():
    batch = token_batches(steps=1, size=2)[0]
    batch["weight"] = np.ones(2, np.float32)
    trainer = jddp.Trainer(
        tiny_moe("gpt", MOE),
        LM.loss_fn,
        adamw(),
        input_key=LM.input_key,
        weight_key="weight",
        devices=jax.devices()[:1],
    )
    state, _ = trainer.task.abstract_state(batch)  # shapes only: refused before compiling
    with pytest.raises(ConfigError) as error:
        jax.eval_shape(trainer.task.local_grads, state.params, {}, batch, jax.random.key(0))
    assert_one_line(error, "weighted loss", "not", "yet", "weights to 0")
