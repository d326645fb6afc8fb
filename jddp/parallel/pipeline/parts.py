"""The model in the three parts a pipeline runs apart: what comes before its `Pipelined` stack
(embedding), one layer of the stack, what comes after (head, loss). Each part runs the model's
own code (jddp/parallel/pipeline/layers.py stops the stack or feeds it its output)."""

import jax

from jddp.core import sown
from jddp.core.task import Task
from jddp.parallel.pipeline import layers


class ModelParts:
    """`task`'s model taken apart at its stack: what comes before it, each of its layers (with
    the arguments the model calls it with on a micro-batch, `capture`), what comes after."""

    def __init__(self, task: Task):
        self.task = task

    def capture(self, rest, batch, rng) -> layers.StackCall:
        """How the model calls its stack on a micro-batch: the stack's input (compute dtype;
        embedding and whatever else comes before the stack) and its layers' key. What follows
        the stack is traced but unused (XLA drops it)."""
        with layers.capture_stack() as split:
            self.task.forward(rest, {}, batch, train=True, rng=rng)
        return split.call

    def before(self, rest, batch, rng):
        """The stack's input for a micro-batch."""
        return self.capture(rest, batch, rng).inputs

    def after(self, rest, outputs, batch, rng):
        """(the loss's weighted values averaged over the micro-batch's examples, the `Totals`
        of loss and metrics) from the stack's output. The weights do not depend on the
        parameters, so the gradient of the former, divided by the whole global batch's mean
        weight where the step updates (`Task.apply_gradients`), is the weighted mean's."""
        with layers.inject_stack(outputs):
            logits, _ = self.task.forward(rest, {}, batch, train=True, rng=rng)
        totals = self.task.totals(logits, batch)
        return totals.sums["loss"], totals

    def layer(self, layer_params, x, rng, call: layers.StackCall, index):
        """(output, what it sowed) of layer `index` of the stack (`layer_params` already in the
        compute dtype) on `x`, with the arguments of the micro-batch's `call` (`capture`:
        per-row ones, such as packed documents' ids, are the micro-batch's): it gets
        `fold_in(call.layer_key, index)` as its last argument when the model gave its stack a
        key (see `Pipelined`). What it sowed: (the sum of its sown losses or None, its sown
        metrics), jddp/core/sown.py."""
        args, layer_key = call.args, call.layer_key
        if layer_key is not None:
            args = (*args, jax.random.fold_in(layer_key, index))
        key = jax.random.fold_in(rng, index)
        with self.task.adapting(train=True), self.task.binding_axes():
            params = {"params": self.task.frozen(layer_params)}
            y, reports = call.block.apply(
                params, x, *args, rngs={"dropout": key}, mutable=list(sown.COLLECTIONS)
            )
        return y, (sown.sown_loss(reports), sown.sown_metrics(reports))
