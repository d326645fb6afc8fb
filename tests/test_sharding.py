"""ZeRO-1/2/3 and hybrid: the same training as one device, ZeRO's memory, exactly the expected
collectives, sharded initialization, and one-line errors for bad meshes and rules."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jddp
from jddp.observe.hlo import collectives, total_bytes
from jddp.observe.memory import peak_bytes
from tests.helpers import compiled_train_step, small_net_trainer
from tests.reference import (
    CLIP_NORM,
    EVEN_PARAMS,
    EvenNet,
    SmallNet,
    assert_trees_close,
    computed_once,
    make_batches,
    optimizer_for,
    per_example_ce,
    reference_training,
    train_and_compare,
)

# (strategy, devices, mesh): every stage on 2, 4 and 8 devices, and hybrid meshes with replicas.
CASES = [(s, n, None) for s in ("zero1", "zero2", "zero3", "hybrid") for n in (2, 4, 8)]
CASES += [("hybrid", 4, "data:2,fsdp:2"), ("hybrid", 8, "data:2,fsdp:4")]
# auto: zero3's layout, the compiler's collectives, on 1 to 8 devices and with replicas.
CASES += [("auto", n, None) for n in (1, 2, 4, 8)] + [("auto", 8, "data:2,fsdp:4")]


def clipped_reference(params, batches):
    """`reference_training` with `optimizer_for(clip=True)`, every case's optimizer."""
    return reference_training(params, optimizer_for(clip=True), batches)


def shared_reference(params, optimizer, batches):
    """The cases start from the same initialization (seed 0): one reference for all of them."""
    return computed_once(clipped_reference, params, batches)


@pytest.mark.parametrize("strategy,num_devices,mesh", CASES)
def test_matches_single_device_reference(strategy, num_devices, mesh):
    """20 steps with accumulation and clipping equal the plain single-device optax loop."""
    optimizer, batches = optimizer_for(clip=True), make_batches()
    trainer = small_net_trainer(
        strategy, num_devices, mesh, optimizer=optimizer, grad_accum_steps=2
    )
    grad_norms = train_and_compare(trainer, optimizer, batches, reference=shared_reference)
    assert max(grad_norms) > CLIP_NORM  # clipping bit
    layout, _ = trainer.strategy.layout()
    sharded = [spec for spec in jax.tree.leaves(layout.opt_state) if tuple(spec)]
    assert bool(sharded) == (num_devices > 1)  # the optimizer state really was sharded
    sharded_params = strategy in ("zero3", "hybrid", "auto") and num_devices > 1
    assert bool(tuple(layout.params["Dense_0"]["kernel"])) == sharded_params


def test_state_fetched_to_host_equals_ddps_and_init_is_the_same():
    batches = make_batches(seed=2)
    host_states = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3", "hybrid"):
        trainer = (
            jddp.Trainer(SmallNet(), per_example_ce, optimizer_for(clip=True))
            if strategy == "ddp"
            else small_net_trainer(strategy, mesh="data:2,fsdp:4" if strategy == "hybrid" else None)
        )
        state = trainer.init(seed=4, sample_batch=batches[0])
        initial = trainer.host_state(state)
        for batch in batches[:8]:
            state, _ = trainer.step(state, batch)
        host_states[strategy] = (initial, trainer.host_state(state))
    ddp_initial, ddp_final = host_states.pop("ddp")
    for strategy, (initial, final) in host_states.items():
        for leaf in jax.tree.leaves(final):
            assert type(leaf) is np.ndarray, strategy
        jax.tree.map(np.testing.assert_array_equal, initial, ddp_initial)  # same seed, same init
        assert_trees_close(final.params, ddp_final.params)
        assert_trees_close(final.opt_state, ddp_final.opt_state)


def test_eval_with_sharded_parameters_counts_every_example_once():
    rng = np.random.default_rng(5)
    examples = {
        "image": rng.normal(size=(77, 4, 3)).astype(np.float32),
        "label": rng.integers(0, 5, size=77).astype(np.int32),
    }
    trainer = small_net_trainer("zero3", metrics={"accuracy": jddp.losses.accuracy})
    state = trainer.init(seed=0, sample_batch=examples)
    for batch in make_batches()[:3]:
        state, _ = trainer.step(state, batch)
    result = trainer.evaluate(
        state, [{k: v[i : i + 20] for k, v in examples.items()} for i in range(0, 77, 20)]
    )
    logits = SmallNet().apply({"params": trainer.host_state(state).params}, examples["image"])
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, examples["label"])
    assert result["count"] == 77
    np.testing.assert_allclose(result["loss"], float(expected.mean()), rtol=1e-5)
    np.testing.assert_allclose(
        result["accuracy"], np.mean(np.argmax(logits, -1) == examples["label"]), rtol=1e-6
    )


def even_trainer(strategy, **kwargs):
    if strategy == "ddp":
        return jddp.Trainer(EvenNet(), per_example_ce, optax.adam(1e-3), **kwargs)
    return small_net_trainer(strategy, model=EvenNet(), optimizer=optax.adam(1e-3), **kwargs)


@pytest.mark.parametrize(
    "strategy,bytes_per_param",
    [("ddp", 12), ("zero1", 4 + 8 / 8), ("zero2", 4 + 8 / 8), ("zero3", 12 / 8), ("auto", 12 / 8)],
)
def test_persistent_bytes_per_device_follow_the_zero_formula(strategy, bytes_per_param):
    trainer = even_trainer(strategy)
    batch = make_batches()[0]
    state = trainer.init(seed=0, sample_batch=batch)
    report = trainer.memory_report(state, batch)
    expected = bytes_per_param * EVEN_PARAMS  # fp32 Adam: 4 (params) + 8 (two moments)
    assert report["state_bytes_per_device"] == pytest.approx(expected, rel=0.02)
    assert report["peak_bytes_per_device"] >= report["state_bytes_per_device"]


PARAM_BYTES = 4 * EVEN_PARAMS


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "hybrid"])
def test_compiled_step_holds_exactly_the_strategys_collectives(strategy):
    mesh = "data:2,fsdp:4" if strategy == "hybrid" else None
    trainer = even_trainer(strategy, **({"mesh": mesh} if mesh else {}))
    ops = collectives(compiled_train_step(trainer, make_batches()[0]).as_text())
    kinds = {kind for kind, _, _ in ops}
    assert kinds <= {"all-reduce", "reduce-scatter", "all-gather"}, kinds
    all_reduce = total_bytes(ops, "all-reduce")  # scalars (loss, norm partials) left out
    scatter, gather = total_bytes(ops, "reduce-scatter"), total_bytes(ops, "all-gather")
    if strategy == "ddp":
        assert (all_reduce, scatter, gather) == (PARAM_BYTES, 0, 0)
    elif strategy == "zero1":  # averaged gradient everywhere, then the updated shards gathered
        assert (all_reduce, scatter, gather) == (PARAM_BYTES, 0, PARAM_BYTES)
    elif strategy == "zero2":  # no device ever holds the whole averaged gradient
        assert (all_reduce, scatter, gather) == (0, PARAM_BYTES // 8, PARAM_BYTES)
    elif strategy == "zero3":  # parameters gathered for forward/backward, gradients scattered
        assert (all_reduce, scatter, gather) == (0, PARAM_BYTES // 8, PARAM_BYTES)
    else:  # hybrid 2x4: zero3 inside each group of 4, shard-sized gradients averaged across 2
        assert (all_reduce, scatter, gather) == (PARAM_BYTES // 4, PARAM_BYTES // 4, PARAM_BYTES)


def test_auto_holds_zero3s_state_and_moves_rows_not_weights_when_rows_are_few():
    """auto keeps zero3's layout (the same bytes on every device) and lets the partitioner
    choose: with 4 rows per device, moving activations costs far less than zero3's all-gather of
    every weight and reduce-scatter of every gradient, and that is what the compiled step does."""
    batch = make_batches()[0]
    moved = {}
    for strategy in ("zero3", "auto"):
        trainer = even_trainer(strategy)
        state = trainer.init(seed=0, sample_batch=batch)
        report = trainer.memory_report(state, batch)
        moved[strategy] = report["comm_bytes_per_step"]
        # 12 bytes a parameter over 8 devices, and a few replicated counters
        assert report["state_bytes_per_device"] == pytest.approx(12 * EVEN_PARAMS / 8, rel=1e-3)
    assert trainer.strategy.layout()[0].params["Dense_1"]["kernel"] == P("fsdp")
    assert moved["auto"] < moved["zero3"] / 2, moved


def test_zero3_initializes_into_shards_without_a_whole_copy():
    trainer = even_trainer("zero3")
    sample = make_batches()[0]["image"][:1]
    trainer.abstract_state(make_batches()[0])  # lays the state out
    compiled = trainer.strategy.lower_init(0, sample).compile()
    # Each device produces its own 1/8 of parameters and moments (1.5 bytes per parameter) plus
    # temporaries; at no point does it hold a whole copy of the parameters (4 bytes each).
    assert peak_bytes(compiled) < PARAM_BYTES
    zero1 = even_trainer("zero1", min_shard_size=2**40)
    zero1.abstract_state(make_batches()[0])
    replicated = zero1.strategy.lower_init(0, sample)
    assert peak_bytes(replicated.compile()) >= 3 * PARAM_BYTES  # the contrast: a full copy
    state = trainer.init(seed=0, sample_batch=make_batches()[0])
    for leaf in jax.tree.leaves(state.params):
        assert leaf.addressable_shards[0].data.size == leaf.size // 8


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"strategy": "zero3", "mesh": "fsdp:3"}, r"fsdp=3 = 3 devices but 8 are present"),
        ({"strategy": "hybrid", "mesh": "data:3,fsdp:-1"}, r"8 devices do not divide"),
        ({"strategy": "zero2", "mesh": "fsdp"}, r"'fsdp' is not ROLE:SIZE"),
        ({"strategy": "ddp", "mesh": "fsdp:8"}, r"does not apply to ddp"),
        ({"strategy": "zero1", "rules": [("kernel", "model")]}, r"names mesh axis 'model'.*fsdp"),
        ({"strategy": "zero1", "rules": [("kernel", "x", "y")]}, r"not a \(regex, spec\) pair"),
        ({"strategy": "auto", "mesh": "stage:2,fsdp:4"}, r"auto does not run pipelines"),
        ({"strategy": "auto", "grad_comm_dtype": "bfloat16"}, r"does not apply to auto"),
    ],
)
def test_bad_mesh_or_rule_is_a_one_line_config_error(kwargs, message):
    with pytest.raises(jddp.ConfigError, match=message) as info:
        trainer = (
            small_net_trainer(**kwargs)
            if kwargs["strategy"] != "ddp"
            else jddp.Trainer(SmallNet(), per_example_ce, optax.sgd(0.1), **kwargs)
        )
        trainer.init(seed=0, sample_batch=make_batches()[0])
    assert "\n" not in str(info.value)


def test_rule_that_does_not_divide_names_the_parameter_and_sizes():
    trainer = small_net_trainer("zero3", rules=[("Dense_1/kernel", "None,fsdp")])
    with pytest.raises(jddp.ConfigError) as info:
        trainer.init(seed=0, sample_batch=make_batches()[0])
    message = str(info.value)
    for part in ("'Dense_1/kernel'", "(24, 5)", "dimension 1", "size 5", "size 8"):
        assert part in message, message


def test_explicit_rules_override_the_default_and_first_match_wins():
    rules = [("Dense_0/kernel", "replicate"), ("Dense_0/.*", "fsdp"), ("kernel", "replicate")]
    trainer = small_net_trainer("zero3", rules=rules)
    state = trainer.init(seed=0, sample_batch=make_batches()[0])
    specs = jax.tree.map(lambda x: tuple(x.sharding.spec), state.params)
    assert specs["Dense_0"]["kernel"] == ()  # first rule
    assert specs["Dense_0"]["bias"] == ("fsdp",)  # second rule
    assert specs["Dense_1"]["kernel"] == ()  # third rule
    assert specs["Dense_1"]["bias"] == ()  # default fsdp: 5 does not divide by 8
