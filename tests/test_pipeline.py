"""Pipeline parallelism: GPipe and 1F1B over a stage axis, alone and with data, fsdp and tensor,
train what one device trains; their bubbles never reach a result; 1F1B holds fewer activations."""

import functools
import math
import re

import jax
import numpy as np
import optax
import pytest

import jddp
from jddp.core.tree_paths import path_str
from jddp.observe import hlo
from jddp.observe.memory import peak_bytes
from jddp.parallel.pipeline import engine
from jddp.parallel.pipeline.options import PipelineOptions
from jddp.parallel.pipeline.schedule import (
    BACKWARD_HIGH,
    FORWARD,
    SCHEDULES,
    bubble_fraction,
    make_schedule,
)
from tests.helpers import compiled_train_step, save_and_restore
from tests.reference import (
    SmallNet,
    assert_optimizer_states_close,
    assert_trees_close,
    make_batches,
    per_example_ce,
    plain_training,
)
from tests.tiny_gpt import (
    HEADS,
    SEQ,
    WIDTH,
    check_against_reference,
    gpt_trainer,
    plain_init,
    run,
    tiny_gpt,
    token_batches,
)

LAYERS, BATCH = 4, 32  # 4 layers split into 2 or 4 stages; 32 rows: 16 micro-batches x 2 steps


def pipeline_trainer(
    mesh, schedule, microbatches, strategy="zero1", repeats=1, remat="dots", **kwargs
):
    pipeline = PipelineOptions(microbatches, schedule, repeats, remat)
    layers = kwargs.pop("layers", LAYERS)
    return gpt_trainer(
        strategy, mesh, layers=layers, pipeline=pipeline, grad_accum_steps=2, **kwargs
    )


# Both schedules on 2 stages (2 layers each: the backward in two ticks) and on 4 (1 layer
# each: in one), each with M = S and with M = 4S micro-batches between them; with fsdp, ZeRO-3
# (parameters gathered inside the stages) and ZeRO-1. A data axis is outside the schedule (each
# replica runs its own timetable, the gradient all-reduce comes after the loop): one case of it.
# What a stage keeps for its backward (`remat`) changes what it recomputes, not the result: the
# default, `dots`, is every other case's; `none` and `full` each on 2 layers a stage under 1F1B.
# Bubbles never reach a result: in the two cases with M = S (the most idle ticks: 3 in 7 on 4
# stages) idle ticks send, and empty buffer slots hold, NaN instead of zeros (`engine.BUBBLE_FILL`).
NAN = math.nan
CASES = [
    ("stage:2", "gpipe", 2, "zero1", "dots", NAN),
    ("stage:2", "1f1b", 8, "zero1", "none", 0.0),
    ("stage:4", "gpipe", 16, "zero1", "dots", 0.0),
    ("stage:4", "1f1b", 4, "zero1", "dots", NAN),
]
CASES += [
    ("data:2,stage:2", "1f1b", 4, "zero1", "full", 0.0),
    ("stage:2,fsdp:2", "1f1b", 4, "zero3", "dots", 0.0),
    ("stage:2,fsdp:2,tensor:2", "1f1b", 4, "zero1", "dots", 0.0),  # sequence parallel in stages
]


@pytest.mark.parametrize("mesh,schedule,microbatches,strategy,remat,fill", CASES)
def test_pipeline_matches_one_device(
    mesh, schedule, microbatches, strategy, remat, fill, monkeypatch
):
    """20 steps, AdamW, clipping, 2 accumulation steps of M micro-batches each: every loss, the
    parameters and the optimizer state equal the single-device loop's; each stage's devices
    hold its layers only."""
    monkeypatch.setattr(engine, "BUBBLE_FILL", fill)
    trainer = pipeline_trainer(
        mesh, schedule, microbatches, strategy, remat=remat, sp="tensor" in mesh
    )
    state = check_against_reference(trainer, token_batches(size=BATCH), layers=LAYERS)
    kernel = state.params["blocks"]["mlp"]["fc"]["kernel"]  # (layer, in, out)
    assert ("fsdp" in str(kernel.sharding.spec)) == (strategy == "zero3"), kernel.sharding
    stages = trainer.strategy.pipeline.schedule.stages
    assert {s.data.shape[0] for s in kernel.addressable_shards} == {LAYERS // stages}


# Interleaved (repeats V > 1): stage s runs the layer groups s, s + S, ...; 4 layers make 2 x 2
# groups of one layer (the backward in one tick), 8 layers 2 x 2 groups of two (in two ticks)
# or 4 x 2 of one.
INTERLEAVED = [  # 1F1B with one-layer groups on stage:2: the data:2 case below
    ("stage:2", "gpipe", 2, 4, 4, "zero1"),
    ("stage:2", "1f1b", 2, 8, 4, "zero1"),
    ("stage:4", "1f1b", 2, 8, 4, "zero1"),
    ("stage:2", "1f1b", 4, 8, 4, "zero1"),
    ("data:2,stage:2", "1f1b", 2, 4, 4, "zero1"),
    ("stage:2,fsdp:2", "gpipe", 2, 8, 4, "zero3"),
]


def assert_held_in_stage_order(state, host, names, split=True):
    """Each stacked leaf of `state` whose path ends with one of `names` (parameters or optimizer
    state) holds its layers in the stages' order, stage s's groups s, s + S, ... in a row,
    whichever part each device holds; `host` (the model's order) gives the layers. `split`:
    each stage's devices hold only its own layers."""
    stages, repeats = state.layer_order
    for name in names:
        held, in_order = (
            next(x for p, x in jax.tree_util.tree_leaves_with_path(s) if path_str(p).endswith(name))
            for s in (state, host)
        )
        groups = np.split(np.asarray(in_order), stages * repeats)
        expected = np.concatenate(
            [groups[s + r * stages] for s in range(stages) for r in range(repeats)]
        )
        for shard in held.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
            assert not split or shard.data.shape[0] == len(expected) // stages, shard.index


# The 8-layer cases train on seed 1's batches, the 4-layer ones on seed 0's (as the cases above):
# no seed is special (second moments near zero are compared as tests/reference.py
# `assert_optimizer_states_close` says), and each single-device reference is computed once.
SEEDED = [(*case, case[3] // 4 - 1) for case in INTERLEAVED]


@pytest.mark.parametrize("mesh,schedule,repeats,layers,microbatches,strategy,seed", SEEDED)
def test_interleaved_pipeline_matches_one_device(
    mesh, schedule, repeats, layers, microbatches, strategy, seed
):
    """Interleaved schedules, 20 steps as above: every loss, the parameters and the optimizer
    state (in the model's layer order) equal the single-device loop's; at rest stage s holds
    the layer groups it runs, s, s + S, ..., and so do its Adam moments."""
    trainer = pipeline_trainer(mesh, schedule, microbatches, strategy, repeats, layers=layers)
    batches = token_batches(seed=seed, size=BATCH)
    state = check_against_reference(trainer, batches, layers=layers)
    assert state.layer_order == (trainer.strategy.pipeline.schedule.stages, repeats)
    names = ("params/blocks/mlp/fc/kernel", "mu/blocks/mlp/fc/kernel")
    assert_held_in_stage_order(state, trainer.host_state(state), names)


def adafactor():
    # Factored (rows and columns) from 16 up, so that every kernel of the stack is factored and
    # no layer axis (4 long) is; eps 1e-6 (1e-30 by default) for the reason tests/tiny_gpt.py's
    # `adamw` takes eps 1e-3: unfactored moments (biases) would turn rounding noise in a
    # near-zero gradient into a step of the learning rate's size.
    return optax.adafactor(0.1, min_dim_size_to_factor=16, eps=1e-6)


def test_adafactors_factored_moments_move_with_their_layers(tmp_path):
    """Interleaved 1F1B (stage:2, 2 groups of one layer per stage), Adafactor, 6 steps: the
    parameters and Adafactor's state (factored row and column moments of every stacked kernel,
    in the model's layer order) equal a plain single-device optax loop's; the devices hold those
    moments in the stages' order, as they hold the layers; a checkpoint restores onto one device
    without stages (the stack in the model's order) exactly."""
    batches = token_batches(steps=6, size=BATCH)
    trainer = pipeline_trainer("stage:2", "1f1b", 4, repeats=2, optimizer=adafactor())
    initial, state, losses = run(trainer, batches)
    model = tiny_gpt(layers=LAYERS, scan_layers=True)

    def loss_fn(params, model_state, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return ce.mean(), model_state

    plain = plain_init(layers=LAYERS, stacked=True)
    jax.tree.map(np.testing.assert_array_equal, initial, plain)
    params, _, expected, opt_state = plain_training(
        loss_fn, plain, {}, adafactor(), batches, with_opt_state=True
    )
    host = trainer.host_state(state)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_trees_close(host.params, params)
    assert_optimizer_states_close(host.opt_state, opt_state)
    assert expected[-1] < 0.9 * expected[0]  # it learned something
    factored = [
        f"{m}/blocks/{k}/kernel" for m in ("v_row", "v_col") for k in ("mlp/fc", "attn/qkv")
    ]
    shapes = {path_str(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(host.opt_state)}
    assert all(shapes[f"0/{name}"][0] == LAYERS for name in factored), shapes
    assert_held_in_stage_order(state, host, factored, split=False)
    # Onto the stack in the model's order; per-layer blocks would also need Adafactor's
    # placeholders (shape (1,), for the moments an unfactored leaf has not) kept whole.
    plain_trainer = gpt_trainer(
        "ddp", None, layers=LAYERS, scan=True, optimizer=adafactor(), devices=jax.devices()[:1]
    )
    _, restored, _ = save_and_restore(trainer, state, plain_trainer, batches[0], str(tmp_path))
    jax.tree.map(np.testing.assert_array_equal, plain_trainer.host_state(restored), host)


@pytest.mark.parametrize("split", [True, False], ids=["2 layers per group", "1 layer per group"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_interleaved_timetables_idle_as_the_bubble_formula_says(name, split):
    """With V layer groups per stage, each micro-batch's forward and backward runs once per
    group on every stage, the bubble is (S - 1) / (V M + S - 1) (1F1B with one-layer groups:
    at least that), and 1F1B keeps at most Megatron-LM's (V - 1) S + 2 (S - 1) + 1 micro-batch
    groups' activations, GPipe all V M."""
    for stages, microbatches in ((2, 2), (2, 8), (3, 6), (4, 4), (4, 16), (8, 32)):
        for repeats in (2, 3, 4):
            schedule = make_schedule(name, stages, microbatches, split, repeats)
            for op in (FORWARD, BACKWARD_HIGH):
                for chunk in range(repeats):
                    on_chunk = (schedule.op == op) & (schedule.chunk == chunk)
                    assert (on_chunk.sum(axis=0) == microbatches).all()
            formula = (stages - 1) / (repeats * microbatches + stages - 1)
            bubble = schedule.bubble(layers_per_chunk=2 if split else 1)
            if split or name == "gpipe":
                assert bubble == pytest.approx(formula), (stages, microbatches, repeats)
            else:
                assert bubble >= formula
            in_flight = (repeats - 1) * stages + 2 * (stages - 1) + 1
            stash = min(in_flight, repeats * microbatches) if name == "1f1b" else None
            assert schedule.stash_slots == (stash or repeats * microbatches)


@pytest.mark.parametrize("split", [True, False], ids=["2 layers per stage", "1 layer per stage"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_timetables_idle_as_the_bubble_formula_says_and_1f1b_holds_s_minus_s(name, split):
    """Every timetable runs each micro-batch's forward and backward once per stage, idles
    (S - 1) / (M + S - 1) of the time (a backward costing two forwards), and 1F1B never keeps
    more than S - s micro-batches on stage s (its stash); with one layer per stage 1F1B's
    lockstep ticks wait for the longer backward."""
    for stages, microbatches in ((2, 2), (2, 8), (4, 4), (4, 16), (8, 32)):
        schedule = make_schedule(name, stages, microbatches, split)
        for op in (FORWARD, BACKWARD_HIGH):
            assert ((schedule.op == op).sum(axis=0) == microbatches).all()
        formula = bubble_fraction(stages, microbatches)
        bubble = schedule.bubble(layers_per_chunk=2 if split else 1)
        if split or name == "gpipe":
            assert bubble == pytest.approx(formula)
        else:
            assert bubble >= formula
        stash = stages if name == "1f1b" else microbatches
        assert schedule.stash_slots == stash


@functools.cache
def compiled_step(mesh, schedule, microbatches, repeats=1):
    """({computation name: HLO text} of the compiled step, the loop over ticks' body, {loop
    body: the computations it reaches}) of `pipeline_trainer(...)`: compiled once per module."""
    trainer = pipeline_trainer(mesh, schedule, microbatches, repeats=repeats)
    compiled = compiled_train_step(trainer, token_batches(size=BATCH)[0])
    comps = hlo.computations(compiled.as_text())
    bodies = {b for t in comps.values() for b in re.findall(r"body=%([\w.\-]+)", t)}
    reach = {b: hlo.reachable(comps, [b]) for b in bodies}
    ticks = min(
        (b for b in bodies if any("collective-permute(" in comps[c] for c in reach[b])),
        key=lambda b: len(reach[b]),
    )
    return comps, ticks, reach


def loop_collectives(*program):
    """(collectives inside the micro-batch loop, collectives outside every loop) of the
    compiled step of `pipeline_trainer(*program)`, as (kind, bytes, device groups)."""
    comps, ticks, reach = compiled_step(*program)
    inside = [op for name in reach[ticks] for op in hlo.collectives_with_groups(comps[name])]
    in_loops = set().union(*reach.values())
    outside = [
        op for name in set(comps) - in_loops for op in hlo.collectives_with_groups(comps[name])
    ]
    return inside, outside


def test_only_neighbouring_stages_talk_inside_the_micro_batch_loop():
    """data:2,stage:2: inside the loop over ticks, exactly two collective-permutes (activations
    forward, cotangents back) of one micro-batch's activations, between the devices of each
    data replica's two stages; the gradient all-reduce over data happens once, after the loop."""
    inside, outside = loop_collectives("data:2,stage:2", "1f1b", 4)
    rows = BATCH // 2 // 2 // 4  # per replica, per accumulation step, per micro-batch
    activation = rows * 16 * 32 * 4  # rows x sequence x width, float32
    stage_pairs = {(0, 1), (1, 0), (2, 3), (3, 2)}  # devices [[0, 1], [2, 3]]: (data, stage)
    assert sorted((k, b) for k, b, _ in inside) == [("collective-permute", activation)] * 2
    assert all(set(g) <= stage_pairs for _, _, g in inside)
    data_groups = [(0, 2), (1, 3)]
    assert any(k == "all-reduce" and g == data_groups for k, _, g in outside)


def test_interleaved_stages_hold_their_groups_so_no_layer_crosses_stages():
    """stage:2 with 2 groups per stage: the stages trade activations and cotangents inside the
    loop (collective-permutes, around the ring), and no parameter or gradient of the stack
    crosses the stages in the step: no all-to-all and no all-gather anywhere."""
    inside, outside = loop_collectives("stage:2", "1f1b", 4, 2)
    assert {k for k, _, _ in inside} == {"collective-permute"}
    assert not {k for k, _, _ in inside + outside} & {"all-to-all", "all-gather"}


def operands_of(computation: str) -> dict[str, set[str]]:
    """{instruction: the instructions of `computation` (HLO text) it reads}."""
    lines = re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\s[\w\-]+\((.*)$", computation, re.M)
    names = {name for name, _ in lines}
    return {name: set(re.findall(r"%([\w.\-]+)", rest)) & names for name, rest in lines}


@pytest.mark.parametrize(
    "program,conditionals",
    [
        (("data:2,stage:2", "1f1b", 4), 3),  # 2 layers a stage: forward, two backward halves
        (("stage:2", "1f1b", 4, 2), 2),  # interleaved, 1 layer a group: forward, backward
    ],
)
def test_a_stage_sends_only_once_its_whole_tick_is_done(program, conditionals):
    """In a steady 1F1B tick one stage runs a forward and its neighbour a backward. Each send
    is a rendezvous with the neighbour; issued as soon as the forward is done, it would hold the
    stage there, its thread taken, until the neighbour's backward had run, and the two would
    take turns (1F1B's step took 1.2x GPipe's on 2 one-core devices). So in the loop's body
    every collective-permute reads, through its operands, every conditional (the forward and
    each backward half): plain 1F1B (backward in two ticks) and interleaved."""
    comps, ticks, _ = compiled_step(*program)
    body = comps[ticks]
    reads = operands_of(body)
    branches = {n for n in reads if re.search(rf"%{re.escape(n)} = .* conditional\(", body)}
    sends = {n for n in reads if re.search(rf"%{re.escape(n)} = .* collective-permute\(", body)}
    assert len(sends) == 2 and len(branches) == conditionals, body
    for send in sends:
        seen, todo = set(), [send]
        while todo:
            for operand in reads[todo.pop()] - seen:
                seen.add(operand)
                todo.append(operand)
        assert branches <= seen, (send, branches - seen)


def stage_batch(microbatches):
    """One batch of `microbatches` micro-batches of 4 rows."""
    return token_batches(steps=1, size=4 * microbatches)[0]


@functools.cache  # all four arguments always given: one cache entry per program
def stage_trainer(schedule, microbatches, remat, model_remat):
    """stage:2 over the 4-layer tiny GPT (with its own `remat` as `model_remat`) in
    `microbatches` micro-batches of 4 rows."""
    pipeline = PipelineOptions(microbatches, schedule, 1, remat)
    return gpt_trainer("zero1", "stage:2", layers=LAYERS, pipeline=pipeline, remat=model_remat)


@functools.cache
def peak(*program):
    """The compiled step's peak bytes per device (as `Trainer.memory_report` reads it) of
    `stage_trainer(*program)`, lowered for the state's shapes and shardings: the peak is the
    program's, so no state is initialized."""
    return peak_bytes(compiled_train_step(stage_trainer(*program), stage_batch(program[1])))


def kept_per_microbatch(remat, model_remat=False):
    """What GPipe's peak grows by per micro-batch from M = 4 to 8: one micro-batch's stash."""
    return (peak("gpipe", 8, remat, model_remat) - peak("gpipe", 4, remat, model_remat)) / 4


def test_each_stage_holds_its_layers_and_1f1b_holds_fewer_activations_than_gpipe():
    """stage:2 with micro-batches of 4 rows: every device holds 2 of the 4 layers. At M = 4S = 8
    micro-batches GPipe keeps all 8 micro-batches' activations for the backward, 1F1B at most
    2: its compiled peak is lower by about 6 micro-batches' worth. (The state's shapes and
    shardings, which the compiled step is lowered for: a state that holds them is every
    `test_pipeline_matches_one_device` case's.)"""
    shapes = stage_trainer("1f1b", 8, "dots", False).abstract_state(stage_batch(8))
    kernel = shapes.params["blocks"]["mlp"]["fc"]["kernel"]
    assert kernel.shape[0] == LAYERS
    assert kernel.sharding.shard_shape(kernel.shape)[0] == LAYERS // 2
    per_microbatch = kept_per_microbatch("dots")
    saved = peak("gpipe", 8, "dots", False) - peak("1f1b", 8, "dots", False)
    assert per_microbatch > 0 and saved == pytest.approx(6 * per_microbatch, rel=0.25)


def test_remat_keeps_what_the_planner_counts_for_a_gpt_block():
    """A micro-batch's share of the peak on a stage of 2 layers, besides one more activation in
    an inbox slot and its tokens: under `full` each layer's input (an activation: 4 rows x SEQ
    tokens x WIDTH float32s); under `dots` also the matmuls' outputs, s b h (20 + 2 a s / h)
    16-bit bytes a layer (jddp/planner/memory_model.py), under a third of what `none` keeps
    (the GELU's, softmax's and norms' intermediates as well). A model's own remat keeps each
    layer's input under `dots` too: the policy only adds recomputation."""
    activation, tokens = 4 * SEQ * WIDTH * 4, 2 * 4 * SEQ * 4
    full, dots, none = map(kept_per_microbatch, ("full", "dots", "none"))
    assert full == pytest.approx(3 * activation + tokens, rel=0.02)
    dots_per_layer = activation / 2 * (20 + 2 * HEADS * SEQ / WIDTH)
    assert dots == pytest.approx(2 * dots_per_layer + activation + tokens, rel=0.02)
    assert dots < none / 3, (dots, none)
    assert kept_per_microbatch("dots", True) == pytest.approx(full, abs=64)


def small_gpt_trainer(mesh, **options):
    return gpt_trainer(
        "zero1", mesh, layers=options.pop("layers", LAYERS), pipeline=PipelineOptions(**options)
    )


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: small_gpt_trainer("stage:2", layers=3), "3 layers do not split into stage=2"),
        (lambda: small_gpt_trainer("stage:4", microbatches=2), "fewer than the 4 stages"),
        (lambda: small_gpt_trainer("stage:2", microbatches=3), "batch slices x micro-batches"),
        (lambda: PipelineOptions(schedule="zigzag"), "unknown parallel.pipeline.schedule"),
        (lambda: PipelineOptions(repeats=0), "repeats=0 must be an integer >= 1"),
        (lambda: PipelineOptions(remat="selective"), "unknown parallel.pipeline.remat"),
        (
            lambda: small_gpt_trainer("stage:2", layers=6, repeats=2, microbatches=4),
            "6 layers do not split into stage=2 x repeats=2",
        ),
        (
            lambda: small_gpt_trainer("stage:2", repeats=2, microbatches=3),
            "not a multiple of the 2 stages",
        ),
        (
            lambda: jddp.Trainer(
                SmallNet(), per_example_ce, optax.sgd(0.1), strategy="zero1", mesh="stage:2,fsdp:4"
            ),
            "no stack of identical blocks",
        ),
    ],
)
def test_pipelines_that_cannot_work_are_one_line_config_errors(build, message):
    with pytest.raises(jddp.ConfigError) as info:
        trainer = build()
        sample = token_batches(steps=1, size=BATCH)[0] if hasattr(trainer, "task") else None
        if sample is not None and trainer.task.input_key == "image":
            sample = make_batches()[0]
        trainer.check_layout(sample, 32)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_float16_loss_scaling_under_a_pipeline_is_a_one_line_config_error():
    with pytest.raises(jddp.ConfigError, match="float16") as info:
        gpt_trainer("zero1", "stage:2", compute_dtype="float16")
    assert "\n" not in str(info.value)
