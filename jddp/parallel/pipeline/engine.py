"""The pipeline engine: one replica's gradients, its model split into stages over a mesh axis.

Runs inside the strategy's per-device program (a shard_map manual over `stage` and the batch
axes; `tensor` stays with the compiler). Every device is one stage and holds that stage's layers
of the `Pipelined` stack; the parts before and after the stack (embedding, head, loss) are
replicated over the stages and run on the first and last stage only. A `lax.scan` over the
schedule's ticks does, on every stage at once, what the timetable says (jddp/parallel/pipeline/
schedule.py): a forward keeps each layer's `jax.vjp` residuals (less its weights, which every
micro-batch shares) in a stash slot, a backward calls the layers' pullbacks, the last first, on
the cotangent from the next stage; activations go forward and cotangents back by one `ppermute`
each per tick, both once the stage's whole tick is done (`after_each_other`).
The stash holds, for the micro-batches in flight (GPipe: all M; 1F1B: at most S), what the
`remat` policy keeps (jddp/parallel/pipeline/options.py `REMAT`): by default each layer's input
and matmul outputs, the elementwise work between them recomputed in the backward (a layer that
keeps less by itself, under a model's own remat, is left as it is). Keeping everything (`none`)
makes the stash 3-4 times larger for a GPT block, and its copies in and out cost more time than
the recomputation (docs/benchmarks.md).

Gradients are summed over micro-batches on each stage, the replicated parts' summed over the
stages, and returned unreduced over the batch axes: the strategy reduces them once per step.
"""

import jax
import jax.numpy as jnp
from jax import checkpoint_policies as policies
from jax import lax

from jddp.core import row_keys
from jddp.core.layer_stacks import join_stack, split_stack
from jddp.core.task import Task, cast_floats
from jddp.errors import ShapeError
from jddp.parallel.pipeline import layers
from jddp.parallel.pipeline.schedule import (
    BACKWARD_HIGH,
    BACKWARD_LOW,
    FORWARD,
    TABLES,
    Schedule,
    bubble_fraction,
)

# What idle slots hold and idle sends carry. 0.0; the bubble test sets NaN to prove that no
# idle value ever reaches a result.
BUBBLE_FILL = 0.0

# jax.checkpoint's policy for each `remat` (None: no checkpoint, everything is kept).
REMAT_POLICIES = {"dots": policies.dots_saveable, "none": None, "full": policies.nothing_saveable}


class Pipeline:
    """The gradients of `task` on a replica's batch, over `schedule` on mesh axis `axis`."""

    def __init__(self, task: Task, schedule: Schedule, axis: str, remat: str = "dots"):
        self.task, self.schedule, self.axis, self.remat = task, schedule, axis, remat
        self.stack = task.stack  # where the stacked layers are, and how many
        self.repeats = schedule.repeats  # layer groups (chunks) per stage
        self.layers_per_chunk = self.stack.num_layers // (schedule.stages * schedule.repeats)
        self._call = None  # the stack's block and extra arguments, found at the first trace

    def describe(self) -> dict:
        """The schedule, its micro-batches and the bubble fraction it implies (the log and
        the first metrics record)."""
        sched = self.schedule
        return {
            "pipeline_schedule": sched.name,
            "pipeline_stages": sched.stages,
            "pipeline_microbatches": sched.microbatches,
            "pipeline_repeats": sched.repeats,
            "pipeline_remat": self.remat,
            "pipeline_bubble": bubble_fraction(sched.stages, sched.microbatches, sched.repeats),
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
    def _capture(self, rest, batch, rng) -> layers.StackCall:
        """How the model calls its stack on a micro-batch: the stack's input (compute dtype;
        embedding and whatever else comes before the stack) and its layers' key. What follows
        the stack is traced but unused (XLA drops it)."""
        with layers.capture_stack() as split:
            self.task.forward(rest, {}, batch, train=True, rng=rng)
        return split.call

    def _pre(self, rest, batch, rng):
        """The stack's input for a micro-batch."""
        return self._capture(rest, batch, rng).inputs

    def _post(self, rest, outputs, batch, rng):
        """(mean loss, metric means) of a micro-batch from the stack's output."""
        with layers.inject_stack(outputs):
            logits, _ = self.task.forward(rest, {}, batch, train=True, rng=rng)
        values = self.task.per_example(logits, batch)
        means = {name: jnp.mean(v.astype(jnp.float32)) for name, v in values.items()}
        return means["loss"], means

    def _layer(self, layer_params, x, rng, layer_key, index):
        """Layer `index` of the stack (`layer_params` already in the compute dtype) on `x`: it
        gets `fold_in(layer_key, index)` as its last argument when the model gave its stack a
        key (see `Pipelined`)."""
        call = self._call
        args = call.args
        if layer_key is not None:
            args = (*args, jax.random.fold_in(layer_key, index))
        key = jax.random.fold_in(rng, index)
        return call.block.apply({"params": layer_params}, x, *args, rngs={"dropout": key})

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
        rng, part = row_keys.as_row_key(rng, size), size // steps
        # The layer groups this stage runs, held in the stages' order: its V groups in a row.
        stacked, rest = split_stack(params, self.stack.path)
        groups = jax.tree.map(lambda x: x.reshape(self.repeats, -1, *x.shape[1:]), stacked)

        def accumulate(carry, inputs):
            index, microbatches = inputs
            part_rng = row_keys.sub_batch_key(rng, index * part, part)
            grads, metrics = self._pipeline(groups, rest, microbatches, part_rng)
            add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
            return (add(carry[0], grads), add(carry[1], metrics)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), (groups, rest))
        metric_zeros = {name: jnp.zeros((), jnp.float32) for name in ("loss", *self.task.metrics)}
        ((grad_groups, grad_rest), metrics), _ = lax.scan(
            accumulate, (zeros, metric_zeros), (jnp.arange(steps), parts)
        )
        held = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), grad_groups)
        grads = join_stack(grad_rest, held, self.stack.path)
        mean = lambda tree: jax.tree.map(lambda x: x / steps, tree)  # noqa: E731
        return mean(grads), mean(metrics), model_state

    def _pipeline(self, groups, rest, microbatches, rng):
        """((gradients of the stage's layer groups, of the other parameters), metric means):
        gradients of the mean loss summed over the micro-batches of one pipeline of
        `microbatches` (leading axis M); `groups`: (chunk, layer, ...) per leaf."""
        sched, axis = self.schedule, self.axis
        S, M, V = sched.stages, sched.microbatches, sched.repeats
        L = self.layers_per_chunk
        stage = lax.axis_index(axis)
        # Each chunk's layers in two halves, [0, low) and [low, L): the backward of each is one
        # tick (schedule.py). Cast to the compute dtype once, here: a cast inside the stage
        # would leave the cast copies of the weights among each micro-batch's stashed residuals.
        low = L // 2 if sched.split_backward else 0
        params = cast_floats(groups, self.task.compute_dtype)
        tables = {name: jnp.asarray(getattr(sched, name)) for name in TABLES}

        def take(m):
            return jax.tree.map(lambda x: x[m], microbatches)

        rows = self.task.batch_rows(take(0))

        def key(m):  # the micro-batch's rows of the pipeline's
            return row_keys.sub_batch_key(rng, m * rows, rows)

        def at(tree, *index):  # the entry at `index` of every leaf
            return jax.tree.map(lambda x: x[index], tree)

        def layer_vjp(x, layer_key, m, r, i):
            """(output, residuals to stash) of layer `i` of chunk `r` on `x`: the pullback's
            leaves (what the remat policy keeps) less the layer's own parameters, which every
            micro-batch shares (stashed, they would copy the stage's weights into every
            slot)."""
            own = at(params, r, i)
            index = (r * S + stage) * L + i  # in the whole stack
            fn = lambda p, x: self._layer(p, x, key(m), layer_key, index)  # noqa: E731
            if shared["policy"] is not None:
                fn = jax.checkpoint(fn, policy=shared["policy"])
            y, pullback = jax.vjp(fn, own, x)
            ids = {id(p): n for n, p in enumerate(jax.tree.leaves(own))}
            leaves, tree = jax.tree.flatten(pullback)
            which = [ids.get(id(leaf)) for leaf in leaves]
            # Traced alike each time: the stash is laid out from the first trace.
            first = shared.setdefault("layer", (which, tree))[0]
            assert first == which, "the pullback's parameters changed between traces"
            return y, [leaf for leaf, n in zip(leaves, which, strict=True) if n is None]

        def pullback_of(residuals, r, i):
            """The pullback of layer `i` of chunk `r` from its stashed residuals and its
            parameters."""
            which, tree = shared["layer"]
            own, residuals = jax.tree.leaves(at(params, r, i)), iter(residuals)
            leaves = [next(residuals) if n is None else own[n] for n in which]
            return jax.tree.unflatten(tree, leaves)

        self._find_call(rest, take(0), key(0))
        # Shapes of what moves and what is kept, from one abstract micro-batch.
        x_shape = jax.eval_shape(self._pre, rest, take(0), key(0))
        # "policy": jax.checkpoint's around each layer; "layer": for each pullback leaf, the
        # parameter it is or None, and the pullback's treedef.
        shared = {}
        layer_key_shape = jax.eval_shape(lambda: self._capture(rest, take(0), key(0)).layer_key)

        def residuals(policy):  # a layer's residual shapes under `policy`, recorded in `shared`
            shared.clear()
            shared["policy"] = policy
            return jax.eval_shape(
                lambda x, k: layer_vjp(x, k, 0, 0, 0)[1], x_shape, layer_key_shape
            )

        def nbytes(shapes):
            return sum(r.size * r.dtype.itemsize for r in shapes)

        # The policy only adds recomputation: a layer that keeps less by itself (a model's
        # own remat, which an outer policy would override) is left as it is.
        policy = REMAT_POLICIES[self.remat]
        if policy is not None and nbytes(residuals(policy)) >= nbytes(residuals(None)):
            policy = None
        residual_shapes = residuals(policy)  # the last trace: what `shared` keeps

        # The big buffers (stash, gradients) go through a tick's conditionals and are updated
        # in place, one layer at a time, by the branch that computes (XLA leaves a buffer that
        # a branch returns unchanged where it is): a scan's stacked outputs would be a fresh
        # buffer, zeroed and copied every tick. Branches return no zeros the size of a
        # micro-batch's residuals or of the parameters: only sends and activations. The small
        # buffers (inboxes, middle) take what arrives after the conditionals, at a spare slot
        # when nothing arrives.
        def fill(shape, slots, spare=1):
            return jnp.full((slots + spare, *shape.shape), BUBBLE_FILL, shape.dtype)

        zeros = lambda tree: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), tree)  # noqa: E731
        add = lambda a, b: jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)  # noqa: E731
        carry = {
            # Per residual leaf: (slot, layer of the chunk, ...).
            "stash": [
                jnp.full((sched.stash_slots, L, *r.shape), BUBBLE_FILL, r.dtype)
                for r in residual_shapes
            ],
            "inbox_f": fill(x_shape, sched.forward_slots),
            "inbox_b": fill(x_shape, sched.backward_slots),
            "middle": fill(x_shape, sched.middle_slots),
            "grads": zeros(params),
            "grad_rest": zeros(rest),
            "metrics": {name: jnp.zeros((), jnp.float32) for name in ("loss", *self.task.metrics)},
        }
        idle_send = jnp.full(x_shape.shape, BUBBLE_FILL, x_shape.dtype)

        def put(buffer, value, *index):  # `value` at `index` (leading axes) of `buffer`, in place
            start = (*index, *([0] * value.ndim))
            return lax.dynamic_update_slice(buffer, value[(None,) * len(index)], start)

        def forward(kept, x_in, slot, m, r):
            """Forward of micro-batch `m` through chunk `r`: residuals into the stash at
            `slot`; after the model's last group, head and loss too. Returns (kept, send
            forward, own output cotangent)."""
            stash, grad_rest, metrics = kept
            batch = take(m)
            first = (stage == 0) & (r == 0)
            last = (stage == S - 1) & (r == V - 1)
            x = lax.cond(first, lambda: self._pre(rest, batch, key(m)), lambda: x_in)
            layer_key = self._capture(rest, batch, key(m)).layer_key

            def layer(carry, i):
                x, stash = carry
                y, residuals = layer_vjp(x, layer_key, m, r, i)
                stash = [put(buf, v, slot, i) for buf, v in zip(stash, residuals, strict=True)]
                return (y, stash), None

            (x, stash), _ = lax.scan(layer, (x, stash), jnp.arange(L))

            def head(grad_rest, metrics):  # the cotangent the last stage sends itself
                (loss, means), post_pullback = _vjp_with_aux(
                    lambda rest, y: self._post(rest, y, batch, key(m)), rest, x
                )
                d_rest, dy = post_pullback(jnp.asarray(1.0 / M, loss.dtype))
                means = jax.tree.map(lambda v: v / M, means)
                return add(grad_rest, d_rest), add(metrics, means), dy.astype(x_shape.dtype)

            def not_last(grad_rest, metrics):
                return grad_rest, metrics, idle_send

            grad_rest, metrics, own = lax.cond(last, head, not_last, grad_rest, metrics)
            return (stash, grad_rest, metrics), jnp.where(last, idle_send, x), own

        def no_forward(kept, x_in, slot, m, r):
            del x_in, slot, m, r
            return kept, idle_send, idle_send

        def backward(h):
            """The backward of half `h` (0: layers [0, low), 1: [low, L)) of micro-batch `m`
            from its residuals at `slot` and `cotangent`, layer by layer from the last, its
            gradients added in place. Returns (grads, grad_rest, d_x for the middle buffer,
            send back)."""

            def run(grads, grad_rest, stash, cotangent, slot, m, r):
                def layer(carry, i):
                    d_y, grads = carry
                    pullback = pullback_of([buf[slot, i] for buf in stash], r, i)
                    d_own, d_x = pullback(d_y)
                    # A scatter-add: XLA fuses the read, add and write (a slice and `put` would
                    # copy the layer's gradients out first).
                    grads = jax.tree.map(
                        lambda g, d: g.at[r, i].add(d.astype(g.dtype)), grads, d_own
                    )
                    return (d_x, grads), None

                layers = jnp.arange(low, L) if h else jnp.arange(low)
                (d_x, grads), _ = lax.scan(layer, (cotangent, grads), layers, reverse=True)
                if h == 1 and low > 0:  # the first of two backward ticks
                    return grads, grad_rest, d_x, idle_send

                def embedding(grad_rest):  # the first stage: into the embedding's gradients
                    _, pre_pullback = jax.vjp(lambda r: self._pre(r, take(m), key(m)), rest)
                    return add(grad_rest, pre_pullback(d_x)[0])

                first = (stage == 0) & (r == 0)
                grad_rest = lax.cond(first, embedding, lambda g: g, grad_rest)
                return grads, grad_rest, idle_send, jnp.where(first, idle_send, d_x)

            return run

        def no_backward(grads, grad_rest, stash, cotangent, slot, m, r):
            del stash, cotangent, slot, m, r
            return grads, grad_rest, idle_send, idle_send

        def stored(buffer, slot, value, store):
            """`buffer` with `value` at `slot` where `store`, else at the spare slot."""
            return buffer.at[jnp.where(store, slot, buffer.shape[0] - 1)].set(value)

        def tick(carry, t):
            op, read = tables["op"][t, stage], tables["read"][t, stage]
            slot, m = tables["stash"][t, stage], tables["microbatch"][t, stage]
            r = tables["chunk"][t, stage]
            kept, send_f, own = lax.cond(
                op == FORWARD,
                forward,
                no_forward,
                (carry["stash"], carry["grad_rest"], carry["metrics"]),
                carry["inbox_f"][read],
                slot,
                m,
                r,
            )
            stash, grad_rest, metrics = kept
            # Two conditionals of two branches, not one switch of three: XLA copies every
            # buffer that a three-way switch passes through. BACKWARD_HIGH: the later half's
            # backward (or the whole one); BACKWARD_LOW: the first half's, from the middle.
            grads, grad_rest, middle, send_b = lax.cond(
                op == BACKWARD_HIGH,
                backward(1),
                no_backward,
                carry["grads"],
                grad_rest,
                stash,
                carry["inbox_b"][read],
                slot,
                m,
                r,
            )
            if low > 0:
                grads, grad_rest, _, send_b_low = lax.cond(
                    op == BACKWARD_LOW,
                    backward(0),
                    no_backward,
                    grads,
                    grad_rest,
                    stash,
                    carry["middle"][read],
                    slot,
                    m,
                    r,
                )
                send_b = jnp.where(op == BACKWARD_LOW, send_b_low, send_b)
            # To the next stage; with chunks, around a ring (the last stage's output goes on
            # to the first stage's next chunk, cotangents the other way).
            send_f, send_b = after_each_other(send_f, send_b, op >= 0)
            received_f = lax.ppermute(send_f, axis, forward_pairs)
            received_b = lax.ppermute(send_b, axis, [(j, i) for i, j in forward_pairs])
            slot_f, slot_b = tables["arrive_forward"][t, stage], tables["arrive_backward"][t, stage]
            slot_own = tables["arrive_own"][t, stage]
            # The last stage's own output cotangent (from its forward) arrives in its inbox.
            inbox_b = stored(carry["inbox_b"], slot_b, received_b, slot_b >= 0)
            carry = {
                "stash": stash,
                "inbox_f": stored(carry["inbox_f"], slot_f, received_f, slot_f >= 0),
                "inbox_b": stored(inbox_b, slot_own, own, slot_own >= 0),
                "middle": stored(
                    carry["middle"],
                    tables["middle"][t, stage],
                    middle,
                    (op == BACKWARD_HIGH) & (low > 0),
                ),
                "grads": grads,
                "grad_rest": grad_rest,
                "metrics": metrics,
            }
            return carry, None

        forward_pairs = [(i, i + 1) for i in range(S - 1)] + ([(S - 1, 0)] if V > 1 else [])
        carry, _ = lax.scan(tick, carry, jnp.arange(sched.ticks))
        # The replicated parts' gradients and the metrics live on the first and last stage.
        grad_rest, metrics = lax.psum((carry["grad_rest"], carry["metrics"]), axis)
        return (carry["grads"], grad_rest), metrics


def after_each_other(a, b, always):
    """(a, b), each computed only once both are: `always` is true, but only known at run time.

    A send is a rendezvous with the neighbour that holds its thread until the neighbour
    arrives. Issued as soon as its own value is ready, a stage's forward send would wait there
    for the neighbour's forward while the stage's own backward waits for a thread (XLA:CPU runs
    every device's operations on one pool of a thread per core): a stage running a forward and its
    neighbour a backward in one tick, 1F1B's every steady tick, would take turns instead of
    running at once. `lax.optimization_barrier` orders nothing here: XLA:CPU schedules by
    the buffers an operation reads, and the barrier's outputs are its inputs' buffers."""
    return jnp.where(always, a, b), jnp.where(always, b, a)


def _vjp_with_aux(fn, *primals):
    """jax.vjp of `fn` returning (value, aux), as ((value, aux), pullback of value)."""
    value, pullback, aux = jax.vjp(fn, *primals, has_aux=True)
    return (value, aux), pullback
