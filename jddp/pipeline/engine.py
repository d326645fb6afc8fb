"""The pipeline engine: one replica's gradients, its model split into stages over a mesh axis.

Runs inside the strategy's per-device program (a shard_map manual over `stage` and the batch
axes; `tensor` stays with the compiler). Every device is one stage and holds that stage's layers
of the `Pipelined` stack; the parts before and after the stack (embedding, head, loss) are
replicated over the stages and run on the first and last stage only. A `lax.scan` over the
schedule's ticks does, on every stage at once, what the timetable says (jddp/pipeline/
schedule.py): a forward keeps `jax.vjp`'s residuals in a stash slot, a backward calls the
pullback with the cotangent from the next stage; activations go forward and cotangents back by
one `ppermute` each per tick. Nothing is recomputed: the stash holds what an ordinary backward
pass would, for the micro-batches in flight (GPipe: all M; 1F1B: at most S).

Gradients are summed over micro-batches on each stage, the replicated parts' summed over the
stages, and returned unreduced over the batch axes: the strategy reduces them once per step.
"""

import jax
import jax.numpy as jnp
from jax import lax

from jddp.core import Task, cast_floats
from jddp.errors import ShapeError
from jddp.pipeline import layers
from jddp.pipeline.schedule import (
    BACKWARD_HIGH,
    BACKWARD_LOW,
    FORWARD,
    IDLE,
    Schedule,
    bubble_fraction,
)

# What idle slots hold and idle sends carry. 0.0; the bubble test sets NaN to prove that no
# idle value ever reaches a result.
BUBBLE_FILL = 0.0


def split_stack(params, path):
    """(the stacked parameters at `path`, every other parameter)."""
    rest = dict(params)
    node = rest
    for key in path[:-1]:
        node[key] = dict(node[key])
        node = node[key]
    stacked = node.pop(path[-1])
    return stacked, rest


def join_stack(rest, stacked, path):
    """`rest` with `stacked` put back at `path`."""
    tree = dict(rest)
    node = tree
    for key in path[:-1]:
        node[key] = dict(node[key])
        node = node[key]
    node[path[-1]] = stacked
    return tree


class Pipeline:
    """The gradients of `task` on a replica's batch, over `schedule` on mesh axis `axis`."""

    def __init__(self, task: Task, schedule: Schedule, axis: str):
        self.task, self.schedule, self.axis = task, schedule, axis
        self.stack = task.stack  # where the stacked layers are, and how many
        self.layers_per_stage = self.stack.num_layers // schedule.stages
        self._call = None  # the stack's block and extra arguments, found at the first trace

    def describe(self) -> dict:
        """The schedule, its micro-batches and the bubble fraction it implies (the log and
        the first metrics record)."""
        sched = self.schedule
        return {
            "pipeline_schedule": sched.name,
            "pipeline_stages": sched.stages,
            "pipeline_microbatches": sched.microbatches,
            "pipeline_bubble": bubble_fraction(sched.stages, sched.microbatches),
        }

    def _find_call(self, rest, batch, rng) -> layers.StackCall:
        """How the model calls its stack in training (its block and arguments): traced once."""
        if self._call is None:
            with layers.capture_stack() as split:
                jax.eval_shape(
                    lambda rest, batch: self.task.forward(rest, {}, batch, train=True, rng=rng),
                    rest,
                    batch,
                )
            self._call = split.call
        return self._call

    # -------------------------------------------------------------- the model's three parts
    def _pre(self, rest, batch, rng):
        """The stack's input (compute dtype) for a micro-batch: embedding and whatever else
        comes before the stack; what follows it is traced but unused (XLA drops it)."""
        with layers.capture_stack() as split:
            self.task.forward(rest, {}, batch, train=True, rng=rng)
        return split.call.inputs

    def _post(self, rest, outputs, batch, rng):
        """(mean loss, metric means) of a micro-batch from the stack's output."""
        with layers.inject_stack(outputs):
            logits, _ = self.task.forward(rest, {}, batch, train=True, rng=rng)
        values = self.task.per_example(logits, batch)
        means = {name: jnp.mean(v.astype(jnp.float32)) for name, v in values.items()}
        return means["loss"], means

    def _stage(self, stage_params, x, rng, offset: int = 0):
        """Layers of this stage, from its `offset`-th on (as many as `stage_params` holds), in
        order, on `x`."""
        first = lax.axis_index(self.axis) * self.layers_per_stage + offset
        params = cast_floats(stage_params, self.task.compute_dtype)
        call = self._call

        def layer(x, inputs):
            index, layer_params = inputs
            key = jax.random.fold_in(rng, first + index)
            y = call.block.apply({"params": layer_params}, x, *call.args, rngs={"dropout": key})
            return y, None

        count = jax.tree.leaves(stage_params)[0].shape[0]
        x, _ = lax.scan(layer, x, (jnp.arange(count), params))
        return x

    # ------------------------------------------------------------------------- gradients
    def grads(self, params, model_state, batch, rng):
        """Mean gradient and metrics over `batch`, with `grad_accum_steps` pipelines of the
        schedule's micro-batches each (same signature and result as `Task.local_grads`)."""
        steps, micro = self.task.grad_accum_steps, self.schedule.microbatches
        size = self.task.batch_rows(batch)
        if size % (steps * micro):
            raise ShapeError(
                f"a replica's batch of {size} examples does not split into grad_accum_steps x "
                f"microbatches = {steps} x {micro}; make global_batch_size divisible by the "
                f"batch slices x {steps * micro}"
            )
        parts = jax.tree.map(lambda x: x.reshape(steps, micro, -1, *x.shape[1:]), batch)

        def accumulate(carry, inputs):
            index, microbatches = inputs
            grads, metrics = self._pipeline(params, microbatches, jax.random.fold_in(rng, index))
            add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
            return (add(carry[0], grads), add(carry[1], metrics)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        metric_zeros = {name: jnp.zeros((), jnp.float32) for name in ("loss", *self.task.metrics)}
        (grads, metrics), _ = lax.scan(
            accumulate, (zeros, metric_zeros), (jnp.arange(steps), parts)
        )
        mean = lambda tree: jax.tree.map(lambda x: x / steps, tree)  # noqa: E731
        return mean(grads), mean(metrics), model_state

    def _pipeline(self, params, microbatches, rng):
        """Summed-over-micro-batches gradients (of the mean loss) and metric means of one
        pipeline of `microbatches` (leading axis M)."""
        sched, axis = self.schedule, self.axis
        S, M = sched.stages, sched.microbatches
        stage = lax.axis_index(axis)
        last = stage == S - 1
        stacked, rest = split_stack(params, self.stack.path)
        # The stage's layers in two halves: the backward of each is one tick (schedule.py).
        low = self.layers_per_stage // 2 if sched.split_backward else 0
        halves = [
            jax.tree.map(lambda x, a=a, b=b: x[a:b], stacked) for a, b in ((0, low), (low, None))
        ]
        names = ("op", "microbatch", "stash", "read", "middle", "arrive_forward", "arrive_backward")
        tables = {name: jnp.asarray(getattr(sched, name)) for name in names}

        def take(m):
            return jax.tree.map(lambda x: x[m], microbatches)

        def key(m):
            return jax.random.fold_in(rng, m)

        def half_vjp(h, x, m):
            """(output, pullback) of half `h` (0: first layers, 1: the rest) on `x`."""
            offset = low if h else 0
            return jax.vjp(lambda p, x: self._stage(p, x, key(m), offset), halves[h], x)

        self._find_call(rest, take(0), key(0))
        # Shapes of what moves and what is kept, from one abstract micro-batch.
        x_shape = jax.eval_shape(self._pre, rest, take(0), key(0))
        used = [1] if low == 0 else [0, 1]
        pullbacks = {h: jax.eval_shape(lambda x, h=h: half_vjp(h, x, 0)[1], x_shape) for h in used}
        trees = {h: jax.tree.structure(pullbacks[h]) for h in used}

        # Every buffer has one spare slot past the schedule's: a tick that stores nothing
        # stores there. The buffers never enter the tick's lax.switch (only slices read from
        # them, and what the branch computed, cross it): a branch handing a whole buffer back
        # made XLA copy it, every tick (GPipe at M = 8 took 6.8x ddp's step, now 2.05x).
        def fill(shape, slots):
            return jnp.full((slots + 1, *shape.shape), BUBBLE_FILL, shape.dtype)

        zeros = lambda tree: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), tree)  # noqa: E731
        add = lambda a, b: jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)  # noqa: E731
        residual_shapes = {h: jax.tree.leaves(pullbacks[h]) for h in used}
        carry = {
            "stash": {h: [fill(r, sched.stash_slots) for r in residual_shapes[h]] for h in used},
            "inbox_f": fill(x_shape, sched.forward_slots),
            "inbox_b": fill(x_shape, sched.backward_slots),
            "middle": fill(x_shape, sched.middle_slots),
            "grad_halves": [zeros(halves[0]), zeros(halves[1])],
            "grad_rest": zeros(rest),
            "metrics": {name: jnp.zeros((), jnp.float32) for name in ("loss", *self.task.metrics)},
        }
        idle_send = jnp.full(x_shape.shape, BUBBLE_FILL, x_shape.dtype)

        def nothing():
            """A branch's result before it does anything: no residuals, gradients, metrics,
            cotangent for the middle buffer or sends."""
            return {
                "residuals": {
                    h: [jnp.zeros(r.shape, r.dtype) for r in residual_shapes[h]] for h in used
                },
                "grad_halves": [zeros(halves[0]), zeros(halves[1])],
                "grad_rest": zeros(rest),
                "metrics": jax.tree.map(jnp.zeros_like, carry["metrics"]),
                "middle": idle_send,
                "send_f": idle_send,
                "send_b": idle_send,
                "own_cotangent": idle_send,
            }

        def forward(reads, m):
            out = nothing()
            batch = take(m)
            x = lax.cond(
                stage == 0, lambda: self._pre(rest, batch, key(m)), lambda: reads["inbox_f"]
            )
            for h in used:
                x, pullback = half_vjp(h, x, m)
                out["residuals"][h] = jax.tree.leaves(pullback)

            def head():  # the last stage: head, loss, and the cotangent it sends itself
                (loss, metrics), post_pullback = _vjp_with_aux(
                    lambda rest, y: self._post(rest, y, batch, key(m)), rest, x
                )
                d_rest, dy = post_pullback(jnp.asarray(1.0 / M, loss.dtype))
                metrics = jax.tree.map(lambda v: v / M, metrics)
                return add(zeros(rest), d_rest), metrics, dy.astype(x_shape.dtype)

            def not_last():
                return out["grad_rest"], out["metrics"], idle_send

            out["grad_rest"], out["metrics"], out["own_cotangent"] = lax.cond(last, head, not_last)
            out["send_f"] = jnp.where(last, idle_send, x)
            return out

        def send_back(out, m, dx):
            """The first stage takes `dx` into the embedding's gradients; the others send it."""

            def embedding():
                _, pre_pullback = jax.vjp(lambda rest: self._pre(rest, take(m), key(m)), rest)
                return add(zeros(rest), pre_pullback(dx)[0])

            out["grad_rest"] = lax.cond(stage == 0, embedding, lambda: out["grad_rest"])
            out["send_b"] = jnp.where(stage == 0, idle_send, dx)
            return out

        def backward_half(reads, h, cotangent):
            out = nothing()
            pullback = jax.tree.unflatten(trees[h], reads["stash"][h])
            d_half, d_x = pullback(cotangent)
            out["grad_halves"][h] = add(out["grad_halves"][h], d_half)
            return out, d_x

        def backward_high(reads, m):
            out, d_x = backward_half(reads, 1, reads["inbox_b"])
            if low == 0:  # the whole backward in one tick
                return send_back(out, m, d_x)
            out["middle"] = d_x
            return out

        def backward_low(reads, m):
            if low == 0:
                return nothing()
            out, d_x = backward_half(reads, 0, reads["middle"])
            return send_back(out, m, d_x)

        def idle(reads, m):
            del reads, m
            return nothing()

        def stored(buffer, slot, value, store):
            """`buffer` with `value` at `slot` where `store`, else at the spare slot."""
            return buffer.at[jnp.where(store, slot, buffer.shape[0] - 1)].set(value)

        def tick(carry, t):
            op, read = tables["op"][t, stage], tables["read"][t, stage]
            slot = tables["stash"][t, stage]
            reads = {
                "stash": {h: [buf[slot] for buf in carry["stash"][h]] for h in used},
                "inbox_f": carry["inbox_f"][read],
                "inbox_b": carry["inbox_b"][read],
                "middle": carry["middle"][read],
            }
            branches = [idle, forward, backward_high, backward_low]
            out = lax.switch(op, branches, reads, tables["microbatch"][t, stage])
            received_f = lax.ppermute(out["send_f"], axis, [(i, i + 1) for i in range(S - 1)])
            received_b = lax.ppermute(out["send_b"], axis, [(i + 1, i) for i in range(S - 1)])
            slot_f, slot_b = tables["arrive_forward"][t, stage], tables["arrive_backward"][t, stage]
            # The last stage's own output cotangent (from its forward) arrives in its inbox.
            arrived_b = jnp.where(last, out["own_cotangent"], received_b)
            carry = {
                "stash": {
                    h: [
                        stored(buf, slot, value, op == FORWARD)
                        for buf, value in zip(carry["stash"][h], out["residuals"][h], strict=True)
                    ]
                    for h in used
                },
                "inbox_f": stored(carry["inbox_f"], slot_f, received_f, slot_f >= 0),
                "inbox_b": stored(carry["inbox_b"], slot_b, arrived_b, slot_b >= 0),
                "middle": stored(
                    carry["middle"],
                    tables["middle"][t, stage],
                    out["middle"],
                    (op == BACKWARD_HIGH) & (low > 0),
                ),
                "grad_halves": add(carry["grad_halves"], out["grad_halves"]),
                "grad_rest": add(carry["grad_rest"], out["grad_rest"]),
                "metrics": add(carry["metrics"], out["metrics"]),
            }
            return carry, None

        carry, _ = lax.scan(tick, carry, jnp.arange(sched.ticks))
        grad_stack = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *carry["grad_halves"])
        # The replicated parts' gradients and the metrics live on the first and last stage.
        grad_rest, metrics = lax.psum((carry["grad_rest"], carry["metrics"]), axis)
        return join_stack(grad_rest, grad_stack, self.stack.path), metrics


def _vjp_with_aux(fn, *primals):
    """jax.vjp of `fn` returning (value, aux), as ((value, aux), pullback of value)."""
    value, pullback, aux = jax.vjp(fn, *primals, has_aux=True)
    return (value, aux), pullback


# The order lax.switch takes the branches in.
assert (IDLE, FORWARD, BACKWARD_HIGH, BACKWARD_LOW) == (0, 1, 2, 3)
