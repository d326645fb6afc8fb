"""FLOP counts equal hand counts, agree with XLA's, and MFU's denominator comes from the right
place."""

import types

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from jddp.models import GPT, MLP, ResNet
from jddp.observe import device_peak, flops
from jddp.observe.throughput import Throughput


def test_mlp_count_is_six_times_weights_times_examples():
    batch = 32
    count = flops.train_step_flops(MLP(10, (256, 128)), jnp.zeros((batch, 8, 8, 1)))
    # Hand count: matmuls 64x256, 256x128, 128x10; 2 FLOPs per multiply-add; backward = 2x.
    assert count.per_step == 3 * 2 * batch * (64 * 256 + 256 * 128 + 128 * 10)
    assert count.method.startswith("analytic")


def test_gpt_count_is_6_n_tokens_plus_attention():
    model = GPT(65, num_layers=2, num_heads=4, embed_dim=32, max_seq_len=16)
    batch, seq = 4, 16
    count = flops.train_step_flops(model, jax.ShapeDtypeStruct((batch, seq), jnp.int32))
    # Hand count per token and layer: qkv 32x96, out 32x32, fc 32x128, proj 128x32; then the
    # (tied) output projection 32x65. Attention: Q.K^T and scores x V, 2 x 2 x seq x width
    # forward per token and layer; training is 3x the forward pass.
    matmul_params = 2 * (32 * 96 + 32 * 32 + 32 * 128 + 128 * 32) + 32 * 65
    assert matmul_params == 26_656
    per_token = 6 * matmul_params + 3 * 2 * (2 * 2 * seq * 32)
    assert count.per_step == per_token * batch * seq == 11_022_336
    # A packed batch's inputs, by keyword: counted from the tokens.
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    assert flops.train_step_flops(model, tokens=ids, segment_ids=ids, positions=ids) == count


def xla_train_flops(model, inputs, targets):
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), inputs))

    def loss(params):
        logits = model.apply(params, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return flops.xla_flops(jax.jit(jax.grad(loss)).lower(params).compile())


def test_gpt_count_agrees_with_xla_on_a_whole_training_step():
    model = GPT(65, num_layers=4, num_heads=4, embed_dim=128, max_seq_len=64)
    tokens = jnp.zeros((4, 64), jnp.int32)
    analytic = flops.train_step_flops(model, tokens).per_step
    xla = xla_train_flops(model, tokens, tokens)
    if xla is None:
        pytest.skip("this XLA backend reports no FLOPs")
    # XLA also counts element-wise work (softmax, GELU, LayerNorm): a little more.
    assert analytic <= xla <= 1.03 * analytic


@pytest.mark.parametrize(
    "depth,expected_gmacs",
    [(18, 1.814), (50, 4.089)],  # torchvision's published GFLOPS (multiply-adds) at 224x224
)
def test_resnet_per_layer_count_matches_the_published_figures(depth, expected_gmacs):
    model = ResNet(1000, depth=depth)
    images = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
    forward = flops.layerwise_forward_flops(model, images, train=False)
    assert forward / 2 / 1e9 == pytest.approx(expected_gmacs, abs=0.001)
    assert flops.train_step_flops(model, images).per_step == 3 * forward
    xla = flops.xla_forward_flops(model, images)
    if xla is not None:  # XLA skips multiply-adds that land on zero padding: a little less
        assert 0.9 * forward <= xla <= forward


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 256, rngs=rngs)
        self.head = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.hidden(x)))


def test_other_modules_are_counted_by_xla():
    count = flops.train_step_flops(NnxMLP(nnx.Rngs(0)), jnp.zeros((16, 64)))
    if count is None:
        pytest.skip("this XLA backend reports no FLOPs")
    assert count.method == "xla"
    matmuls = 3 * 2 * 16 * (64 * 256 + 256 * 10)
    assert matmuls <= count.per_step <= 1.02 * matmuls  # plus biases and ReLU
    # An input given by keyword (a task's input_key={"x": ...}) is counted the same.
    assert flops.train_step_flops(NnxMLP(nnx.Rngs(0)), x=jnp.zeros((16, 64))) == count


def fake_device(kind, platform):
    return types.SimpleNamespace(device_kind=kind, platform=platform)


@pytest.mark.parametrize(
    "kind,platform,dtype,expected",
    [
        ("NVIDIA H200", "gpu", "bfloat16", 989e12),
        ("NVIDIA H100 80GB HBM3", "gpu", "bfloat16", 989e12),
        ("NVIDIA H100 PCIe", "gpu", "bfloat16", 756e12),
        ("NVIDIA A100-SXM4-80GB", "gpu", "float32", 156e12),  # TF32: half the bfloat16 peak
        ("TPU v4", "tpu", "float32", 275e12),
        ("TPU v5 lite", "tpu", "bfloat16", 197e12),
    ],
)
def test_peak_table(kind, platform, dtype, expected):
    peak, source = device_peak.peak_flops_per_device(fake_device(kind, platform), dtype)
    assert peak == expected and "datasheet" in source


def test_peak_of_an_unknown_device_asks_for_the_config_value_which_wins():
    peak, source = device_peak.peak_flops_per_device(fake_device("Mystery X1", "gpu"))
    assert peak is None and "set peak_flops_per_device" in source
    assert device_peak.peak_flops_per_device(fake_device("NVIDIA H200", "gpu"), override=5e14) == (
        5e14,
        "config",
    )


def test_cpu_peak_is_the_measured_matmul_rate_shared_by_the_simulated_devices():
    cpu = jax.devices()[0]
    peak, source = device_peak.peak_flops_per_device(cpu)
    assert "measured" in source
    assert peak == device_peak.measured_matmul_rate(cpu, "float32") / 8 > 0


def test_throughput_rates():
    speed = Throughput(
        examples_per_step=64,
        num_devices=4,
        tokens_per_example=128,
        flops_per_step=8e12,
        peak_flops_per_device=1e12,
    )
    assert speed.rates(steps=10, seconds=40.0) == {
        "examples_per_sec": 16.0,
        "tokens_per_sec": 2048.0,
        "flops_per_sec_per_device": 5e11,
        "mfu": 0.5,
    }
    assert Throughput(examples_per_step=8, num_devices=1).rates(1, 2.0) == {"examples_per_sec": 4}
