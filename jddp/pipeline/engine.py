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
from jddp.errors import ConfigError, ShapeError
from jddp.pipeline import layers
from jddp.pipeline.schedule import BACKWARD, FORWARD, IDLE, Schedule

# What idle slots hold and idle sends carry. 0.0; the bubble test sets NaN to prove that no
# idle value ever reaches a result.
BUBBLE_FILL = 0.0


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


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

    def _stage(self, stage_params, x, rng):
        """This stage's layers of the stack, in order, on `x`."""
        first = lax.axis_index(self.axis) * self.layers_per_stage
        params = cast_floats(stage_params, self.task.compute_dtype)
        call = self._call

        def layer(x, inputs):
            index, layer_params = inputs
            key = jax.random.fold_in(rng, first + index)
            y = call.block.apply({"params": layer_params}, x, *call.args, rngs={"dropout": key})
            return y, None

        x, _ = lax.scan(layer, x, (jnp.arange(self.layers_per_stage), params))
        return x

    # ------------------------------------------------------------------------- gradients
    def grads(self, params, model_state, batch, rng):
        """Mean gradient and metrics over `batch`, with `grad_accum_steps` pipelines of the
        schedule's micro-batches each (same signature and result as `Task.local_grads`)."""
        if model_state:
            raise ConfigError(
                "pipeline parallelism does not take models with mutable state (BatchNorm "
                "statistics); remove the stage axis from parallel.mesh"
            )
        steps, micro = self.task.grad_accum_steps, self.schedule.microbatches
        size = batch[self.task.input_key].shape[0]
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
        stacked, rest = split_stack(params, self.stack.path)
        tables = {
            name: jnp.asarray(getattr(sched, name))
            for name in ("op", "microbatch", "stash", "read", "arrive_forward", "arrive_backward")
        }

        def take(m):
            return jax.tree.map(lambda x: x[m], microbatches)

        def key(m):
            return jax.random.fold_in(rng, m)

        self._find_call(rest, take(0), key(0))

        # Shapes of what moves and what is kept, from one abstract micro-batch.
        x_shape = jax.eval_shape(self._pre, rest, take(0), key(0))
        residuals = jax.eval_shape(
            lambda sp, x: jax.vjp(lambda sp, x: self._stage(sp, x, key(0)), sp, x)[1],
            stacked,
            x_shape,
        )
        pullback_tree = jax.tree.structure(residuals)

        def fill(shape, slots):
            return jnp.full((slots, *shape.shape), BUBBLE_FILL, shape.dtype)

        carry = {
            "stash": [fill(r, sched.stash_slots) for r in jax.tree.leaves(residuals)],
            "inbox_f": fill(x_shape, sched.forward_slots),
            "inbox_b": fill(x_shape, max(sched.backward_slots, 1)),
            "grad_stack": jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), stacked),
            "grad_rest": jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), rest),
            "metrics": {name: jnp.zeros((), jnp.float32) for name in ("loss", *self.task.metrics)},
        }
        last = stage == S - 1
        idle_send = jnp.full(x_shape.shape, BUBBLE_FILL, x_shape.dtype)
        add = lambda a, b: jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)  # noqa: E731

        def forward(carry, t):
            m = tables["microbatch"][t, stage]
            batch = take(m)
            x = lax.cond(
                stage == 0,
                lambda: self._pre(rest, batch, key(m)),
                lambda: carry["inbox_f"][tables["read"][t, stage]],
            )
            y, pullback = jax.vjp(lambda sp, x: self._stage(sp, x, key(m)), stacked, x)
            slot = tables["stash"][t, stage]
            carry = dict(carry)
            carry["stash"] = [
                buffer.at[slot].set(leaf)
                for buffer, leaf in zip(carry["stash"], jax.tree.leaves(pullback), strict=True)
            ]

            def head(carry):
                (loss, metrics), post_pullback = _vjp_with_aux(
                    lambda rest, y: self._post(rest, y, batch, key(m)), rest, y
                )
                d_rest, dy = post_pullback(jnp.asarray(1.0 / M, loss.dtype))
                carry = dict(carry)
                carry["grad_rest"] = add(carry["grad_rest"], d_rest)
                carry["metrics"] = add(carry["metrics"], jax.tree.map(lambda v: v / M, metrics))
                slot = tables["arrive_backward"][t, stage]
                carry["inbox_b"] = carry["inbox_b"].at[slot].set(dy.astype(x_shape.dtype))
                return carry

            carry = lax.cond(last, head, lambda c: c, carry)
            return carry, jnp.where(last, idle_send, y), idle_send

        def backward(carry, t):
            m = tables["microbatch"][t, stage]
            slot = tables["stash"][t, stage]
            pullback = jax.tree.unflatten(pullback_tree, [b[slot] for b in carry["stash"]])
            cotangent = carry["inbox_b"][tables["read"][t, stage]]
            d_stack, dx = pullback(cotangent)
            carry = dict(carry)
            carry["grad_stack"] = add(carry["grad_stack"], d_stack)

            def embedding(carry):
                _, pre_pullback = jax.vjp(lambda rest: self._pre(rest, take(m), key(m)), rest)
                (d_rest,) = pre_pullback(dx)
                return {**carry, "grad_rest": add(carry["grad_rest"], d_rest)}

            carry = lax.cond(stage == 0, embedding, lambda c: c, carry)
            return carry, idle_send, jnp.where(stage == 0, idle_send, dx)

        def idle(carry, t):
            del t
            return carry, idle_send, idle_send

        def tick(carry, t):
            carry, send_f, send_b = lax.switch(
                tables["op"][t, stage], [idle, forward, backward], carry, t
            )
            received_f = lax.ppermute(send_f, axis, [(i, i + 1) for i in range(S - 1)])
            received_b = lax.ppermute(send_b, axis, [(i + 1, i) for i in range(S - 1)])
            slot_f, slot_b = tables["arrive_forward"][t, stage], tables["arrive_backward"][t, stage]
            carry = dict(carry)
            carry["inbox_f"] = lax.cond(
                slot_f >= 0,
                lambda box: box.at[slot_f].set(received_f),
                lambda box: box,
                carry["inbox_f"],
            )
            carry["inbox_b"] = lax.cond(
                (slot_b >= 0) & ~last,  # the last stage put its own cotangent there already
                lambda box: box.at[slot_b].set(received_b),
                lambda box: box,
                carry["inbox_b"],
            )
            return carry, None

        carry, _ = lax.scan(tick, carry, jnp.arange(sched.ticks))
        # The replicated parts' gradients and the metrics live on the first and last stage.
        grad_rest, metrics = lax.psum((carry["grad_rest"], carry["metrics"]), axis)
        return join_stack(grad_rest, carry["grad_stack"], self.stack.path), metrics


def _vjp_with_aux(fn, *primals):
    """jax.vjp of `fn` returning (value, aux), as ((value, aux), pullback of value)."""
    value, pullback, aux = jax.vjp(lambda *p: fn(*p), *primals, has_aux=True)
    return (value, aux), pullback


assert IDLE == 0 and FORWARD == 1 and BACKWARD == 2  # the order lax.switch takes the branches
