"""The pipeline engine: one replica's gradients, its model split into stages over a mesh axis.

Runs inside the strategy's per-device program (a shard_map manual over `stage` and the batch
axes; `tensor` stays with the compiler). Every device is one stage and holds that stage's layers
of the `Pipelined` stack; the parts before and after the stack (embedding, head, loss) are
replicated over the stages and run on the first and last stage only (parts.py). A `lax.scan`
over the schedule's ticks does, on every stage at once, what the timetable says (schedule.py,
ticks.py): a forward keeps each layer's `jax.vjp` residuals (less its weights) in a stash slot
(stash.py), a backward calls the layers' pullbacks, the last first, on the cotangent from the
next stage; activations go forward and cotangents back by one `ppermute` each per tick, both
once the stage's whole tick is done (sends.py).

Gradients are summed over micro-batches on each stage, the replicated parts' summed over the
stages, and returned unreduced over the batch axes: the strategy reduces them once per step.
They are the trainable parameters' alone (`Task.trainable`: with LoRA the adapters): a frozen
weight's cotangent is a zero that no buffer keeps, so XLA never computes it.
"""

import jax
import jax.numpy as jnp
from jax import lax

from jddp.core import row_keys, sown
from jddp.core.layer_stacks import join_stack, split_stack
from jddp.core.task import Task, cast_floats
from jddp.errors import ShapeError
from jddp.parallel.pipeline.parts import ModelParts
from jddp.parallel.pipeline.schedule import Schedule, bubble_fraction
from jddp.parallel.pipeline.ticks import StageTicks

# What idle slots hold and idle sends carry. 0.0; tests/test_pipeline.py sets NaN in the cases
# with the most idle ticks, to prove that no idle value ever reaches a result.
BUBBLE_FILL = 0.0


class Pipeline:
    """The gradients of `task` on a replica's batch, over `schedule` on mesh axis `axis`."""

    def __init__(self, task: Task, schedule: Schedule, axis: str, remat: str = "dots"):
        self.task, self.schedule, self.axis, self.remat = task, schedule, axis, remat
        self.stack = task.stack  # where the stacked layers are, and how many
        self.repeats = schedule.repeats  # layer groups (chunks) per stage
        self.model_parts = ModelParts(task)

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

    # ------------------------------------------------------------------------- gradients
    def grads(self, params, model_state, batch, rng):
        """(gradient, `Totals`, mutable collections) of `batch`, with `grad_accum_steps`
        pipelines of the schedule's micro-batches each: the same signature and result as
        `Task.local_grads` (the gradient of the loss's weighted values averaged over the
        examples, before the step divides it by the mean weight)."""
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

        def accumulate(grad_sum, inputs):
            index, microbatches = inputs
            part_rng = row_keys.sub_batch_key(rng, index * part, part)
            grads, totals = self._pipeline(groups, rest, microbatches, part_rng)
            return jax.tree.map(jnp.add, grad_sum, grads), totals

        trainable = self.task.trainable
        zeros = jax.tree.map(
            lambda p: jnp.zeros(p.shape, jnp.float32), (trainable(groups), trainable(rest))
        )
        # Each step's `Totals` (scalars) stacked: no zeros to build whose structure only a
        # trace of the loss knows.
        (grad_groups, grad_rest), totals = lax.scan(accumulate, zeros, (jnp.arange(steps), parts))
        held = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), grad_groups)
        grads = join_stack(grad_rest, held, self.stack.path)
        mean = lambda tree: jax.tree.map(lambda x: x / steps, tree)  # noqa: E731
        return mean(grads), mean(jax.tree.map(lambda x: x.sum(0), totals)), model_state

    def _pipeline(self, groups, rest, microbatches, rng):
        """((gradients of the stage's layer groups, of the other parameters), `Totals`):
        gradients (of their trainable parts) of the loss's weighted values averaged over the
        examples of one pipeline of `microbatches` (leading axis M); `groups`: (chunk, layer,
        ...) per leaf."""
        # Cast to the compute dtype once, here: a cast inside the stage would leave the cast
        # copies of the weights among each micro-batch's stashed residuals.
        params = cast_floats(groups, self.task.compute_dtype)
        stage = StageTicks(
            self.model_parts,
            self.schedule,
            self.axis,
            self.remat,
            params,
            rest,
            microbatches,
            rng,
            BUBBLE_FILL,
        )
        buffers, _ = lax.scan(stage.tick, stage.start(), jnp.arange(self.schedule.ticks))
        # The replicated parts' gradients and the `Totals` live on the first and last stage.
        grad_rest, totals = lax.psum((buffers.grad_rest, buffers.metrics), self.axis)
        reported = self._sown_metrics(buffers.sown)
        return (buffers.grads, grad_rest), totals.replace(sums={**reported, **totals.sums})

    def _sown_metrics(self, per_stage) -> dict:
        """What the layers sowed as metrics, each micro-batch's combined over the stages' layers
        as `sown.combine` says, averaged over the micro-batches: the number `Task` reports for
        an accumulation step of the same micro-batch (jddp/core/sown.py)."""
        reported = {}
        for name, values in per_stage.items():
            values = sown.over_axis(name, values, self.axis)
            mean = sown.combine(name) == "mean"
            reported[name] = values.mean() / (self.stack.num_layers if mean else 1)
        return reported
