"""ZeRO-1/2/3 over the `fsdp` axis, replicas over `data`, tensor parallelism over `tensor`: one
strategy on a `jax.sharding.Mesh` whose axes have roles (jddp/parallel/mesh.py).

Each step is one `jax.jit` with explicit in/out shardings and donated state. Inside it a
`shard_map`, manual over the batch axes (`data`, `fsdp`), runs the shared core on every device's
slice of the batch and performs exactly the ZeRO stage's collectives, written out, so every
platform runs these and no others (XLA:CPU turns a sharding constraint on the gradients into an
all-reduce plus a slice, twice the bytes of a reduce-scatter). How they run in bfloat16 and
across processes follows `parallel.collectives` (jddp/parallel/collectives.py). The `tensor`
axis stays automatic: parameters arrive split by the partition rules and XLA's SPMD partitioner
inserts Megatron's activation all-reduces, so any Flax module is tensor-parallel without a
change. The optimizer update then runs at the jit level on sharded arrays, so global-norm
clipping sees the whole gradient and each device updates only what it holds.

    stage   parameters  gradients         optimizer  collectives per step over fsdp
    zero1   replicated  all-reduced       sharded    all-reduce grads, all-gather params
    zero2   replicated  reduce-scattered  sharded    reduce-scatter grads, all-gather params
    zero3   sharded     reduce-scattered  sharded    all-gather params, reduce-scatter grads

Over `data` gradients (or their shards) are all-reduced; over `tensor` each parameter is split
as its rule says, under every stage. Over `context` the state is replicated as over `data`: the
per-device program is manual over it too, each context rank takes its two chunks of every
sequence (jddp/parallel/context.py), and gradients and metrics are averaged over it. `expert` is
a batch axis to every parameter but a mixture of experts' experts, which are split over it
(jddp/parallel/rules.py): their gradients are summed over the other batch axes only, and no ZeRO
collective runs over it (the model's all-to-alls do: jddp/models/moe_dispatch.py).

`fsdp` is another name for `zero3`; `hybrid` is zero3 whose default mesh shards within a host and
replicates across hosts (`data:<hosts>,fsdp:<devices per host>`, whatever the processes per host;
on CPU each process counts as a host: jddp/runtime/processes.py `host_of_processes`).
"""

import dataclasses
import functools

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jddp.core import layer_stacks
from jddp.core.layer_stacks import join_stack, split_stack
from jddp.core.state import TrainState
from jddp.core.task import Stack, Task, check_rows_divide, init_compiler_options, init_key
from jddp.errors import ConfigError
from jddp.parallel import context
from jddp.parallel.collectives import gather
from jddp.parallel.grad_reduction import GradComm
from jddp.parallel.mesh import DeviceMesh
from jddp.parallel.pipeline.options import PipelineOptions
from jddp.parallel.rules import (
    DEFAULT_MIN_SHARD_SIZE,
    mirror_specs,
    param_specs,
    restrict,
    spec_axes,
    validate_rules,
)

# stage -> (parameters sharded over fsdp, gradients sharded over fsdp)
STAGES = {"zero1": (False, False), "zero2": (False, True), "zero3": (True, True)}
STAGE_OF = {
    "zero1": "zero1",
    "zero2": "zero2",
    "zero3": "zero3",
    "fsdp": "zero3",
    "hybrid": "zero3",
    "auto": "zero3",  # zero3's layout, the compiler's collectives (jddp/parallel/auto.py)
}


def default_mesh_spec(name: str, hosts: int = 1) -> str:
    """The mesh `name` runs on when none is written, over devices ordered host by host
    (`mesh.by_host`): hybrid shards within a host and replicates across the `hosts` (FSDP's
    HYBRID_SHARD); the others shard over every device."""
    return f"data:{hosts},fsdp:-1" if name == "hybrid" else "fsdp:-1"


def unsharded_warning(name: str, mesh: DeviceMesh, hosts: int) -> str | None:
    """The warning for a mesh whose fsdp groups are one device while it has replicas over
    `data` (each replica then holds the whole state: ddp's memory, ZeRO's collectives), naming
    the mesh to use over `hosts` hosts; None for any other mesh."""
    data = mesh.size("data")
    if mesh.size("fsdp") > 1 or data == 1:
        return None
    replicas = hosts if data % hosts == 0 and data > hosts else 1
    sizes = {"data": replicas, "fsdp": data // replicas}
    axes = [(role, sizes.get(role, size)) for role, size in mesh.mesh.shape.items()]
    if "fsdp" not in mesh.mesh.shape:
        axes.insert(list(mesh.mesh.shape).index("data") + 1, ("fsdp", sizes["fsdp"]))
    better = ",".join(f"{role}:{size}" for role, size in axes if role != "data" or size > 1)
    return (
        f"parallel.mesh {mesh.describe()!r} gives {name} fsdp groups of one device: nothing is "
        f"sharded over fsdp and every one of the {data} replicas holds the whole optimizer state; "
        f"use {better!r} (fsdp within a host, replicas across hosts)"
    )


def check_mesh_for(name: str, mesh: DeviceMesh) -> None:
    """A ConfigError for a mesh on which `name` would shard nothing (a `data` axis alone only
    replicates: that is ddp's layout)."""
    roles = (mesh.fsdp_axis, mesh.tensor_axis, mesh.stage_axis, mesh.context_axis)
    if not any(roles) and not mesh.expert_axis:
        raise ConfigError(
            f"parallel.mesh {mesh.describe()!r} has no fsdp, tensor, stage, context or expert "
            f"axis, so {name} would shard nothing (data only replicates); write 'fsdp:-1', or "
            "e.g. 'data:2,fsdp:-1' for replicas of sharded groups"
        )


class ZeroStrategy:
    """One ZeRO stage (with replicas and tensor parallelism) over a mesh of every device of
    every process, or of the devices given."""

    def __init__(
        self,
        task: Task,
        mesh: DeviceMesh,
        *,
        name: str,
        rules=(),
        min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
        pipeline: PipelineOptions | None = None,
        grad_comm: GradComm | None = None,
    ):
        check_mesh_for(name, mesh)
        self.name = name
        self.task = task
        self.device_mesh = mesh
        self.mesh = mesh.mesh
        self.batch_axes = mesh.batch_axes
        # The batch axes ZeRO shards the state over: all but `expert`, which splits only the
        # experts, by the partition rules, and over which nothing is gathered or scattered.
        self.shard_axes = tuple(a for a in self.batch_axes if a != "expert")
        self.shard_params, self.shard_grads = STAGES[STAGE_OF[name]]
        self.rules = validate_rules(rules, mesh)
        # The collectives' implementation, for these devices' platform, chosen once.
        self.grad_comm = (grad_comm or GradComm()).on(list(self.mesh.devices.flat))
        self.min_shard_size = min_shard_size
        self.pipeline_options = pipeline or PipelineOptions()
        # Axes the per-device program splits by hand: the batch axes, the pipeline stages, the
        # sequence's chunks; gradients and metrics are averaged over the batch axes and context.
        self.manual_axes = self.batch_axes + (("stage",) if mesh.stage_axis else ())
        self.context_axis = mesh.context_axis
        self.manual_axes += (self.context_axis,) if self.context_axis else ()
        self.mean_axes = self.batch_axes + ((self.context_axis,) if self.context_axis else ())
        self.pipeline = None  # the engine, when the mesh has a stage axis (set by prepare)
        self._replicated = NamedSharding(self.mesh, P())
        self._batch_sharding = NamedSharding(self.mesh, P(self.batch_axes or None))
        self._row_block = mesh.row_block()  # checked now: a mesh that cannot be fed fails here

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    # ---------------------------------------------------------------------------- layout
    def prepare(self, abstract_state: TrainState, stack: Stack | None = None) -> None:
        """The state's layout and the jitted steps for states shaped like `abstract_state`, whose
        model holds its `Pipelined` layers at `stack` (None: it has none)."""
        if stack != self.task.stack:  # the task as laid out: the pipeline splits its stack
            self.task = dataclasses.replace(self.task, stack=stack)
        if self.device_mesh.stage_axis:
            if jax.tree.leaves(abstract_state.model_state):
                raise ConfigError(
                    "pipeline parallelism does not take models with mutable state (BatchNorm "
                    "statistics); remove the stage axis from parallel.mesh"
                )
            self.pipeline = self.pipeline_options.engine(self.task, self.device_mesh)
        if self.context_axis:
            context.check_model(self.task.model, self.context_axis)
        full = param_specs(
            abstract_state.params,
            self.rules,
            self.device_mesh,
            self.min_shard_size,
            stack.path if stack else (),
        )
        self._check_axes_used(full)
        whole_over_fsdp = jax.tree.map(lambda s: restrict(s, ("tensor", "stage", "expert")), full)
        # Gradients and optimizer state cover the trainable parameters alone (LoRA's adapters).
        trainable = self.task.trainable
        self._specs = TrainState(
            step=P(),
            params=full if self.shard_params else whole_over_fsdp,
            opt_state=mirror_specs(
                abstract_state.opt_state, trainable(abstract_state.params), trainable(full)
            ),
            model_state=jax.tree.map(lambda _: P(), abstract_state.model_state),
            rng=P(),
            nonfinite_steps=P(),
            loss_scale=jax.tree.map(lambda _: P(), abstract_state.loss_scale),
            comm_state=jax.tree.map(lambda _: P(), abstract_state.comm_state),
        )
        self._grad_specs = trainable(full if self.shard_grads else whole_over_fsdp)
        self._state_shardings = jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec), self._specs
        )
        # What the per-device program sees split: the manual axes' part of each spec (tensor is
        # left to the compiler), and of that the part over the batch axes (ZeRO's collectives).
        part = lambda tree, axes: jax.tree.map(lambda s: restrict(s, axes), tree)  # noqa: E731
        self._manual_params = part(self._specs.params, self.manual_axes)
        self._manual_grads = part(self._grad_specs, self.manual_axes)
        self._fsdp_params = part(self._specs.params, self.shard_axes)
        self._whole_params = part(self._specs.params, self._gathered_for_eval)
        self._tensor_specs = jax.tree.map(lambda s: restrict(s, ("tensor",)), full)
        self._grad_tensor_specs = trainable(self._tensor_specs)
        # An interleaved pipeline holds its stack in its stages' order (core/layer_stacks.py): each
        # stage's layer groups at rest where it runs them; checkpoints get the model's order.
        schedule = self.pipeline.schedule if self.pipeline else None
        self._order = (
            (schedule.stages, schedule.repeats) if schedule and schedule.repeats > 1 else None
        )
        held = self._state_shardings.replace(layer_order=self._order)
        reorder = functools.partial(
            layer_stacks.reorder_state,
            stack_path=stack.path if stack else (),
            num_layers=stack.num_layers if stack else 0,
        )
        self._to_held = jax.jit(
            lambda state: reorder(state, self._order), out_shardings=held, donate_argnums=0
        )
        self._to_model = jax.jit(
            lambda state: reorder(state, None), out_shardings=self._state_shardings
        )
        # In the model's order, as every layout draws it; `_to_held` moves it after, in a program
        # of its own: fused with the draws, the move changed how XLA:CPU rounded some (1 ulp).
        self._init = jax.jit(self.task.init_state, out_shardings=self._state_shardings)
        self._train_step = jax.jit(
            self._train,
            in_shardings=(held, self._batch_sharding),
            out_shardings=(held, self._replicated),
            donate_argnums=0,
        )
        self._eval_steps = {}  # by the state's layer order
        self._abstract_state = abstract_state

    def _check_axes_used(self, specs) -> None:
        """A ConfigError for a tensor or expert axis that no parameter is split over."""
        unused = {
            "tensor": "no partition rule splits a parameter over tensor, so every tensor rank "
            "would hold and compute everything; add rules such as ('attn/qkv/kernel', "
            "'fsdp,tensor'), ('attn/out/kernel', 'tensor,fsdp') (the built-in GPT has them as a "
            "preset)",
            "expert": "the model has no mixture of experts (no experts/{gate,up,down} weights "
            "to split over it); set model_args.moe (e.g. {'num_experts': 8}), or use a data or "
            "fsdp axis instead of expert",
        }
        for role, why in unused.items():
            size = self.device_mesh.size(role)
            if size > 1 and not any(role in spec_axes(s) for s in jax.tree.leaves(specs)):
                raise ConfigError(f"parallel.mesh has {role}:{size} but {why}")

    @property
    def _gathered_for_eval(self) -> tuple[str, ...]:
        """The manual axes eval gathers parameters over: all but `expert` (the model's
        all-to-alls reach the experts where they are)."""
        return tuple(a for a in self.manual_axes if a != "expert")

    def state_shardings(self) -> TrainState:
        return self._state_shardings

    def layout(self) -> tuple[TrainState, object]:
        return self._specs, self._grad_specs

    def abstract_batch(self, batch):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._batch_sharding), batch
        )

    # ------------------------------------------------------------ per-device programs
    def _per_device(self, fn, in_specs, out_specs):
        """`fn` as a shard_map that is manual over the batch axes and leaves tensor to XLA."""
        if not self.manual_axes:  # tensor parallelism alone: nothing is split by hand
            return fn
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=set(self.manual_axes),
            # Per-device gradients as under pmap: every collective is written out below.
            check_vma=False,
        )

    def _gather_params(self, params, over_stages: bool = False):
        """Parameters whole over fsdp (and with `over_stages`, every stage's layers)."""
        # Training gathers with the gradient communication's reduce-scatter as its derivative.
        on_shards = self._on_tensor_shards(gather if over_stages else self.grad_comm.gather)
        specs = self._whole_params if over_stages else self._fsdp_params
        return jax.tree.map(on_shards, params, specs, self._tensor_specs)

    def _on_tensor_shards(self, collective):
        """`collective(x, spec)` (over the batch axes) applied to each device's own tensor
        shard of `x`. Under the partitioner a collective over a manual axis needs its operand
        whole over the automatic ones (an fsdp all-gather of a tensor-split kernel became an
        all-gather over tensor first); inside a shard_map manual over tensor as well, the
        collective sees the local shard only."""
        if self.device_mesh.size("tensor") == 1:
            return lambda x, spec, _: collective(x, spec)

        def on_shards(x, spec, tensor_spec):
            return jax.shard_map(
                lambda shard: collective(shard, spec),
                in_specs=tensor_spec,
                out_specs=tensor_spec,
                axis_names={"tensor"},
                check_vma=False,
            )(x)

        return on_shards

    def _reduce_grads(self, grads):
        """Per-device gradients to the mean over the batch slices, laid out as `_grad_specs`."""

        def reduce(grad, spec):
            # zero3 got the reduce-scatter from AD of the gather (the pipeline gathers first)
            if not self.shard_params or self.pipeline:
                grad = self.grad_comm.scatter_sum(grad, restrict(spec, self.shard_axes))
            # An expert's gradient already holds every token its devices sent it: summed over
            # the other batch axes only.
            rest = tuple(a for a in self.mean_axes if a not in spec_axes(spec))
            summed = self.grad_comm.psum(grad, rest) if rest else grad
            return summed / self._contributions

        on_shards = self._on_tensor_shards(reduce)
        return jax.tree.map(on_shards, grads, self._manual_grads, self._grad_tensor_specs)

    @property
    def _contributions(self) -> int:
        """How many per-device gradients make one step's: a batch slice's, a sequence chunk's."""
        return self.device_mesh.batch_slices * self.device_mesh.size("context")

    def _pmean(self, tree):
        return self.grad_comm.pmean(tree, self.mean_axes) if self.mean_axes else tree

    def _own_tokens(self, batch):
        """`batch` as this device holds it: under context parallelism its rank's chunks."""
        if not self.context_axis:
            return batch
        length = batch[self.task.inputs.entries[0]].shape[1]
        return context.split_batch(batch, length, self.context_axis)

    def _per_device_grads(self, params, model_state, step_key, batch, loss_scale):
        index = lax.axis_index(self.batch_axes) if self.batch_axes else 0
        rng = self.task.slice_key(step_key, index, batch)  # the same on every stage, tensor rank
        if self.context_axis:  # dropout masks drawn as for the whole sequence
            rng = context.chunks_key(rng, batch[self.task.inputs.entries[0]], self.context_axis)
            batch = self._own_tokens(batch)
        if self.pipeline:  # parameters gathered once per step, not per micro-batch
            params = self._gather_params(params) if self.shard_params else params
            grads, metrics, model_state = self.pipeline.grads(params, model_state, batch, rng)
        else:
            params_fn = self._gather_params if self.shard_params else None
            grads, metrics, model_state = self.task.local_grads(
                params, model_state, batch, rng, params_fn, loss_scale
            )
        return self._reduce_grads(grads), self._pmean(metrics), self._pmean(model_state)

    def _train(self, state: TrainState, batch):
        grads, metrics, model_state = self._per_device(
            self._per_device_grads,
            in_specs=(self._manual_params, self._specs.model_state, P(), P(self.batch_axes), P()),
            out_specs=(self._manual_grads, P(), self._specs.model_state),
        )(state.params, state.model_state, state.step_key(), batch, state.loss_scale)
        return self.task.apply_gradients(state, grads, model_state, metrics)

    def _eval(self, state: TrainState, batch):
        def per_device(params, model_state, batch):
            if self.shard_params or self.pipeline:  # eval runs the whole model on every stage
                params = self._gather_params(params, over_stages=True)
            if state.layer_order:  # every stage's groups, in the model's order
                stacked, rest = split_stack(params, self.task.stack.path)
                in_order = lambda x: layer_stacks.in_model_order(x, *state.layer_order)  # noqa: E731
                params = join_stack(rest, jax.tree.map(in_order, stacked), self.task.stack.path)
            sums = self.task.eval_sums(params, model_state, self._own_tokens(batch))
            sums = lax.psum(sums, self.batch_axes) if self.batch_axes else sums
            # every context rank counts the same examples, each over its share of the tokens
            return lax.pmean(sums, self.context_axis) if self.context_axis else sums

        return self._per_device(
            per_device,
            in_specs=(self._manual_params, self._specs.model_state, P(self.batch_axes)),
            out_specs=P(),
        )(state.params, state.model_state, batch)

    # ----------------------------------------------------------------------- placement
    def init_state(self, seed: int, sample_input) -> TrainState:
        """Initialize directly into the shardings: no device ever holds the whole sharded state.
        An interleaved pipeline's stack then moves to its stages' order."""
        compiled = self.lower_init(seed, sample_input).compile(init_compiler_options())
        state = compiled(init_key(seed), sample_input)
        return state if self._order is None else self._to_held(state)

    def lower_init(self, seed: int, sample_input):
        """The initialization lowered with the state's shardings as its output shardings.

        With JAX's partitionable threefry each device draws only its own shard, and the values
        equal an unsharded initialization from the same seed."""
        return self._init.lower(init_key(seed), sample_input)

    def row_block(self) -> tuple[int, int]:
        return self._row_block

    def place_batch(self, batch):
        """This process's rows of a global batch (its `row_block`), as global arrays split over
        the batch axes."""
        _, blocks = self.row_block()
        local_slices = self.device_mesh.batch_slices // blocks

        def rows(x):
            x = np.asarray(x)
            check_rows_divide(x.shape[0], local_slices)
            return x

        batch = jax.tree.map(rows, batch)
        shapes = jax.tree.map(lambda x: (x.shape[0] * blocks, *x.shape[1:]), batch)
        # One call for the whole batch: on one process, one device_put of every entry.
        return jax.make_array_from_process_local_data(self._batch_sharding, batch, shapes)

    def global_state(self, state: TrainState) -> TrainState:
        # jit's outputs already span every process's devices; in the model's layer order
        return state if state.layer_order is None else self._to_model(state)

    def consolidate(self, state: TrainState) -> TrainState:
        return state  # no per-device state: PowerSGD runs under ddp only

    def host_state(self, state: TrainState) -> TrainState:
        """The whole state as host numpy arrays (gathered from the shards), in the model's
        layer order."""
        state = self.global_state(state)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return multihost_utils.process_allgather(state, tiled=True)
        return jax.device_get(state)

    # ---------------------------------------------------------------------------- steps
    # Traced with the mesh as the context mesh: models place tensor-parallel pieces on it.
    def train_step(self, state: TrainState, batch):
        with jax.set_mesh(self.mesh):
            if state.layer_order != self._order:  # restored or replaced: the model's order
                state = self._to_held(state)
            return self._train_step(state, batch)

    def eval_step(self, state: TrainState, batch):
        order = state.layer_order
        if order not in self._eval_steps:
            self._eval_steps[order] = jax.jit(
                self._eval,
                in_shardings=(
                    self._state_shardings.replace(layer_order=order),
                    self._batch_sharding,
                ),
                out_shardings=self._replicated,
            )
        with jax.set_mesh(self.mesh):
            return self._eval_steps[order](state, batch)

    def lower_train_step(self, state, batch):
        with jax.set_mesh(self.mesh):
            return self._train_step.lower(state.replace(layer_order=self._order), batch)
