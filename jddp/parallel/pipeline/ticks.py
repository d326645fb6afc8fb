"""One stage's part of a pipeline, tick by tick: what the timetable (schedule.py) says it runs
at each tick (a forward, a backward half, or nothing), then the sends to its neighbours
(sends.py), over buffers carried from tick to tick (`Buffers`).

The big buffers (stash, gradients) go through a tick's conditionals and are updated in place,
one layer at a time, by the branch that computes (XLA leaves a buffer that a branch returns
unchanged where it is): a scan's stacked outputs would be a fresh buffer, zeroed and copied every
tick. Branches return no zeros the size of a micro-batch's residuals or of the parameters: only
sends and activations. The small buffers (inboxes, middle) take what arrives after the
conditionals, at a spare slot when nothing arrives.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jddp.core import row_keys, sown
from jddp.core.weighted import Totals
from jddp.parallel.pipeline import sends
from jddp.parallel.pipeline.parts import ModelParts
from jddp.parallel.pipeline.schedule import (
    BACKWARD_HIGH,
    BACKWARD_LOW,
    FORWARD,
    TABLES,
    Schedule,
)
from jddp.parallel.pipeline.stash import Stash, choose_tape


class Buffers(NamedTuple):
    """What a stage carries from tick to tick."""

    # Gradients (float32) of the trainable parameters (`Task.trainable`) outside the stack,
    grad_rest: Any
    grads: Any  # and of the stage's layer groups, (chunk, layer, ...) per leaf
    inbox_b: jax.Array  # cotangents from the next stage (and the last stage's own), (slot, ...)
    inbox_f: jax.Array  # activations from the previous stage, (slot, ...)
    metrics: Totals  # loss and metrics, each micro-batch's / M summed (weighted.py)
    # What the stage's layers sowed as metrics (jddp/core/sown.py), per micro-batch (M,): the
    # min, max or sum over its layers, as `sown.combine` says.
    sown: dict
    middle: jax.Array  # cotangents between the backward's two halves, (slot, ...)
    stash: list  # the stash's buffers (stash.py)


def _add(a, b):
    return jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)


def _at(tree, *index):
    """The entry at `index` of every leaf."""
    return jax.tree.map(lambda x: x[index], tree)


class StageTicks:
    """The stage `lax.axis_index(axis)`'s ticks over one pipeline of `microbatches` (leading
    axis M): `params` its layer groups (chunk, layer, ...) in the compute dtype, `rest` the
    parameters outside the stack, `fill` what idle slots hold and idle sends carry."""

    def __init__(
        self,
        parts: ModelParts,
        schedule: Schedule,
        axis: str,
        remat: str,
        params,
        rest,
        microbatches,
        rng,
        fill,
    ):
        self.parts, self.schedule, self.axis = parts, schedule, axis
        self.params, self.rest, self.microbatches, self.rng = params, rest, microbatches, rng
        self.fill = fill
        self.trainable = parts.task.trainable  # the part of each gradient that is kept
        self.stage = lax.axis_index(axis)
        self.chunk_layers = jax.tree.leaves(params)[0].shape[1]
        # Each chunk's layers in two halves, [0, low) and [low, layers): the backward of each
        # is one tick (schedule.py).
        self.low = self.chunk_layers // 2 if schedule.split_backward else 0
        self.tables = {name: jnp.asarray(getattr(schedule, name)) for name in TABLES}
        self.rows = parts.task.batch_rows(self.take(0))
        # Shapes of what moves and what is kept, from one abstract micro-batch.
        self.x_shape = jax.eval_shape(parts.before, rest, self.take(0), self.key(0))
        self.tape, residual_shapes = choose_tape(
            remat,
            lambda tape: jax.eval_shape(
                lambda x: self.layer_forward(
                    tape, x, parts.capture(rest, self.take(0), self.key(0)), 0, 0, 0
                )[1],
                self.x_shape,
            ),
        )
        self.stash = Stash(self.tape, residual_shapes, schedule.stash_slots, self.chunk_layers)
        # What a layer sows: a loss (its output is then (y, loss)), metrics.
        output, _, self.sown_shapes = jax.eval_shape(
            lambda x: self.layer_forward(
                self.tape, x, parts.capture(rest, self.take(0), self.key(0)), 0, 0, 0
            ),
            self.x_shape,
        )
        self.sows_loss = isinstance(output, tuple)
        # Which names are weighted: the structure of a micro-batch's `Totals`.
        self.totals_shapes = jax.eval_shape(
            lambda x: parts.after(rest, x, self.take(0), self.key(0))[1], self.x_shape
        )
        self.idle_send = jnp.full(self.x_shape.shape, fill, self.x_shape.dtype)
        self.pairs = sends.ring(schedule.stages, schedule.repeats)

    def take(self, m):
        """Micro-batch `m`."""
        return jax.tree.map(lambda x: x[m], self.microbatches)

    def key(self, m):
        """Micro-batch `m`'s key: its rows of the pipeline's."""
        return row_keys.sub_batch_key(self.rng, m * self.rows, self.rows)

    def start(self) -> Buffers:
        """The buffers before the first tick: every slot `fill`, gradients and `Totals` zero."""
        sched, x_shape = self.schedule, self.x_shape
        zeros = lambda tree: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), tree)  # noqa: E731
        return Buffers(
            stash=self.stash.empty(self.fill),
            inbox_f=sends.inbox(x_shape, sched.forward_slots, self.fill),
            inbox_b=sends.inbox(x_shape, sched.backward_slots, self.fill),
            middle=sends.inbox(x_shape, sched.middle_slots, self.fill),
            grads=zeros(self.trainable(self.params)),
            grad_rest=zeros(self.trainable(self.rest)),
            metrics=zeros(self.totals_shapes),
            sown={
                name: jnp.full(sched.microbatches, sown.start(name), jnp.float32)
                for name in self.sown_shapes
            },
        )

    # ------------------------------------------------------------------------- one tick
    def tick(self, buffers: Buffers, t):
        """Tick `t`: what the timetable gives this stage, then the sends; what arrives is
        stored in the inboxes."""
        op, read, slot, m, r = (
            self.tables[name][t, self.stage]
            for name in ("op", "read", "stash", "microbatch", "chunk")
        )
        (stash, grad_rest, metrics, sown_metrics), send_f, own = lax.cond(
            op == FORWARD,
            self.forward,
            self.no_forward,
            (buffers.stash, buffers.grad_rest, buffers.metrics, buffers.sown),
            buffers.inbox_f[read],
            slot,
            m,
            r,
        )
        # Two conditionals of two branches, not one switch of three: XLA copies every buffer
        # that a three-way switch passes through. BACKWARD_HIGH: the later half's backward (or
        # the whole one); BACKWARD_LOW: the first half's, from the middle.
        grads, grad_rest, middle, send_b = lax.cond(
            op == BACKWARD_HIGH,
            functools.partial(self.backward, 1),
            self.no_backward,
            buffers.grads,
            grad_rest,
            stash,
            buffers.inbox_b[read],
            slot,
            m,
            r,
        )
        if self.low > 0:
            grads, grad_rest, _, send_b_low = lax.cond(
                op == BACKWARD_LOW,
                functools.partial(self.backward, 0),
                self.no_backward,
                grads,
                grad_rest,
                stash,
                buffers.middle[read],
                slot,
                m,
                r,
            )
            send_b = jnp.where(op == BACKWARD_LOW, send_b_low, send_b)
        received = sends.exchange(send_f, send_b, op >= 0, self.axis, self.pairs)
        buffers = buffers._replace(
            stash=stash, grads=grads, grad_rest=grad_rest, metrics=metrics, sown=sown_metrics
        )
        return self.receive(buffers, t, op, received, own, middle), None

    def receive(self, buffers: Buffers, t, op, received, own, middle) -> Buffers:
        """`buffers` with what arrives at the end of tick `t` in the inbox slots the timetable
        gives: from the neighbours (`received`: forward, backward), the last stage's own output
        cotangent from its forward (`own`), the first backward half's cotangent (`middle`)."""
        at = lambda name: self.tables[name][t, self.stage]  # noqa: E731
        slot_f, slot_b, slot_own = at("arrive_forward"), at("arrive_backward"), at("arrive_own")
        inbox_b = sends.stored(buffers.inbox_b, slot_b, received[1], slot_b >= 0)
        high = (op == BACKWARD_HIGH) & (self.low > 0)
        return buffers._replace(
            inbox_f=sends.stored(buffers.inbox_f, slot_f, received[0], slot_f >= 0),
            inbox_b=sends.stored(inbox_b, slot_own, own, slot_own >= 0),
            middle=sends.stored(buffers.middle, at("middle"), middle, high),
        )

    # --------------------------------------------------------------------------- forward
    def layer_forward(self, tape, x, call, m, r, i):
        """(output, residuals to stash, the metrics it sowed) of layer `i` of chunk `r` on `x`
        for micro-batch `m` (whose stack `call` gives the layers' arguments), through `tape`;
        the output is (y, its sown loss) where the layer sows one."""
        own = _at(self.params, r, i)
        # The layer's index in the whole stack: chunk r of stage s is the model's group r S + s.
        index = (r * self.schedule.stages + self.stage) * self.chunk_layers + i

        def fn(p, x):
            y, (loss, metrics) = self.parts.layer(p, x, self.key(m), call, index)
            return (y if loss is None else (y, loss)), metrics

        return tape.forward(fn, own, x)

    def forward(self, kept, x_in, slot, m, r):
        """Forward of micro-batch `m` through chunk `r` (from `x_in`, or from the embedding on
        the model's first group): residuals into the stash at `slot`; after the model's last
        group, head and loss too. Returns ((stash, grad_rest, metrics), the send forward, the
        own output cotangent)."""
        stash, grad_rest, metrics, sown_metrics = kept
        batch, sched = self.take(m), self.schedule
        first = (self.stage == 0) & (r == 0)
        last = (self.stage == sched.stages - 1) & (r == sched.repeats - 1)
        x = lax.cond(first, lambda: self.parts.before(self.rest, batch, self.key(m)), lambda: x_in)
        call = self.parts.capture(self.rest, batch, self.key(m))

        def layer(carry, i):
            x, stash, sown_m = carry
            y, residuals, reported = self.layer_forward(self.tape, x, call, m, r, i)
            y = y[0] if self.sows_loss else y  # the loss's cotangent is the backward's
            sown_m = {name: sown.fold(name, sown_m[name], reported[name]) for name in sown_m}
            return (y, self.stash.write(stash, residuals, slot, i), sown_m), None

        this_micro = {name: values[m] for name, values in sown_metrics.items()}
        (x, stash, this_micro), _ = lax.scan(
            layer, (x, stash, this_micro), jnp.arange(self.chunk_layers)
        )
        sown_metrics = {name: v.at[m].set(this_micro[name]) for name, v in sown_metrics.items()}
        grad_rest, metrics, own = lax.cond(
            last, functools.partial(self.head, x, batch, m), self.no_head, grad_rest, metrics
        )
        return (stash, grad_rest, metrics, sown_metrics), jnp.where(last, self.idle_send, x), own

    def head(self, x, batch, m, grad_rest, metrics):
        """Head and loss of micro-batch `m` on the stack's output `x`: (grad_rest, metrics)
        with its share of the pipeline's `Totals` added, and the cotangent the last stage sends
        itself. The gradient is the weighted loss sum's, as `Task.local_grads` gives it."""
        M = self.schedule.microbatches
        (loss, totals), pullback = _vjp_with_aux(
            lambda rest, y: self.parts.after(rest, y, batch, self.key(m)), self.rest, x
        )
        d_rest, dy = pullback(jnp.asarray(1.0 / M, loss.dtype))
        totals = jax.tree.map(lambda v: v / M, totals)
        d_rest = self.trainable(d_rest)
        return _add(grad_rest, d_rest), _add(metrics, totals), dy.astype(self.x_shape.dtype)

    def no_head(self, grad_rest, metrics):
        return grad_rest, metrics, self.idle_send

    def no_forward(self, kept, x_in, slot, m, r):
        del x_in, slot, m, r
        return kept, self.idle_send, self.idle_send

    # -------------------------------------------------------------------------- backward
    def backward(self, half, grads, grad_rest, stash, cotangent, slot, m, r):
        """The backward of `half` (0: layers [0, low), 1: [low, layers)) of micro-batch `m`
        through chunk `r` from its residuals at `slot` and `cotangent`, layer by layer from
        the last, its gradients added in place. Returns (grads, grad_rest, the cotangent for
        the middle, the send back)."""

        # A sown loss is added to each micro-batch's loss, which the pipeline averages.
        d_loss = jnp.asarray(1.0 / self.schedule.microbatches, jnp.float32)

        def layer(carry, i):
            d_y, grads = carry
            pullback = self.tape.pullback(self.stash.read(stash, slot, i), _at(self.params, r, i))
            d_own, d_x = pullback((d_y, d_loss) if self.sows_loss else d_y)
            d_own = self.trainable(d_own)
            # A scatter-add: XLA fuses the read, add and write (a slice and a `put` would copy
            # the layer's gradients out first).
            grads = jax.tree.map(lambda g, d: g.at[r, i].add(d.astype(g.dtype)), grads, d_own)
            return (d_x, grads), None

        layers = jnp.arange(self.low, self.chunk_layers) if half else jnp.arange(self.low)
        (d_x, grads), _ = lax.scan(layer, (cotangent, grads), layers, reverse=True)
        if half == 1 and self.low > 0:  # the first of two backward ticks
            return grads, grad_rest, d_x, self.idle_send

        def embedding(grad_rest):  # the model's first group: into the embedding's gradients
            _, pullback = jax.vjp(
                lambda rest: self.parts.before(rest, self.take(m), self.key(m)), self.rest
            )
            return _add(grad_rest, self.trainable(pullback(d_x)[0]))

        first = (self.stage == 0) & (r == 0)
        grad_rest = lax.cond(first, embedding, lambda g: g, grad_rest)
        return grads, grad_rest, self.idle_send, jnp.where(first, self.idle_send, d_x)

    def no_backward(self, grads, grad_rest, stash, cotangent, slot, m, r):
        del stash, cotangent, slot, m, r
        return grads, grad_rest, self.idle_send, self.idle_send


def _vjp_with_aux(fn, *primals):
    """jax.vjp of `fn` returning (value, aux), as ((value, aux), pullback of value)."""
    value, pullback, aux = jax.vjp(fn, *primals, has_aux=True)
    return (value, aux), pullback
