"""Llama: Llama 3.2 1B's published size (remat: test_gpt.py); bfloat16 compute under tensor and
sequence parallelism with one key/value head trains with float32 master weights; bad dimensions
are one-line errors. (Its equality with transformers under every layout: test_hf_checkpoints.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.models import Llama, llama
from jddp.parallel.rules import adapt_preset
from jddp.run.objectives import OBJECTIVES
from tests.helpers import param_count
from tests.tiny_gpt import mesh_devices, token_batches

LM = OBJECTIVES["language_model"]


def tiny_llama(**fields) -> Llama:
    dims = dict(num_layers=2, num_heads=4, num_kv_heads=1, embed_dim=32, mlp_dim=64)
    return Llama(64, max_seq_len=16, **(dims | fields))


def test_llama_3_2_1b_has_the_published_parameter_count():
    model = Llama(
        128256,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        embed_dim=2048,
        mlp_dim=8192,
        tie_embeddings=True,
        rope_base=500000.0,
    )
    assert param_count(model, jnp.zeros((1, 8), jnp.int32)) == 1_235_814_400


def test_bfloat16_compute_with_sequence_parallelism_and_one_kv_head_learns():
    """One key/value head does not split over tensor=2: its kernels stay whole over tensor and
    every rank computes them; bfloat16 activations, float32 parameters and moments."""
    mesh = jddp.device_mesh_for("zero3", "data:2,fsdp:2,tensor:2", mesh_devices("fsdp:8"))
    model = tiny_llama(tensor_axis="tensor", sequence_parallel=True)
    trainer = jddp.Trainer(
        model,
        LM.loss_fn,
        optax.adam(3e-3),
        input_key="inputs",
        strategy="zero3",
        mesh=mesh,
        rules=adapt_preset(llama.tensor_parallel_rules(model.kv_heads, 2), mesh),
        min_shard_size=1,
        compute_dtype="bfloat16",
    )
    batches = token_batches(steps=30)
    state = trainer.init(0, batches[0])
    assert "tensor" not in str(state.params["block_0"]["attn"]["k"]["kernel"].sharding.spec)
    assert "tensor" in str(state.params["block_0"]["attn"]["q"]["kernel"].sharding.spec)
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3


BAD_DIMENSIONS = [
    (dict(num_kv_heads=3), "num_kv_heads=3 does not divide num_heads=4"),
    (dict(num_heads=5), "num_heads=5 does not divide embed_dim=32; change num_heads, or set"),
    (dict(head_dim=7), "rotary positions need an even head size, got 7"),
    (dict(positions="learned"), "positions='learned'; choose one of ('rotary',)"),
    (dict(num_kv_heads=-1), "num_kv_heads=-1 must be >= 0"),
    (dict(rope_base=0.0), "norm_eps and rope_base must be > 0"),
    (dict(sliding_window=-1), "sliding_window=-1 must be >= 0"),
    (
        dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        "rope_type='dynamic'; jddp implements 'linear', 'llama3', 'yarn'",
    ),
    (dict(rope_scaling={"rope_type": "linear", "factr": 2.0}), "lacks 'factor'; it takes factor"),
    (dict(rope_scaling={"rope_type": "linear", "factor": "2"}), "factor='2'; expected a number"),
]


@pytest.mark.parametrize("kwargs,message", BAD_DIMENSIONS, ids=lambda x: str(x)[:24])
def test_inconsistent_dimensions_are_one_line_config_errors(kwargs, message):
    with pytest.raises(jddp.ConfigError) as raised:
        tiny_llama(**kwargs)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_tensor_axis_the_query_heads_do_not_split_over_is_refused():
    from jddp import models

    with pytest.raises(jddp.ConfigError, match="Llama num_heads=4 does not split over tensor=8"):
        models.create_model("llama", 64, tensor_axis="tensor", tensor_size=8, num_heads=4)
