"""What is trained, as the planner sees it: parameter shapes (exact, from `jax.eval_shape` of the
real model), FLOPs per step, and for a transformer its dimensions (what sets activation sizes).

`from_config` reads a jddp experiment config without compiling anything; a published run's
workload is written out from the paper's dimensions with `transformer_params`.
"""

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from jddp.models.moe_dispatch import dispatch_slots
from jddp.models.moe_settings import MoESettings
from jddp.observe.flops import mlp_matmul_params
from jddp.parallel.pipeline.options import PipelineOptions
from jddp.parallel.rules import DEFAULT_MIN_SHARD_SIZE

# Parameters a sequence-parallel GPT applies to activations split along the sequence: their
# gradients are partial sums over tensor (jddp/models/gpt.py).
SEQUENCE_SPLIT_PARAMS = re.compile(r"(^|/)(ln_\d+|ln_f)/|attn/out/bias$|mlp/proj/bias$")
BLOCK = re.compile(r"(?:^|/)block_(\d+)/")


@dataclasses.dataclass(frozen=True)
class Transformer:
    """A decoder's dimensions: what the activation collectives, the attention FLOPs and the
    activation memory depend on."""

    layers: int
    width: int
    heads: int
    mlp_dim: int
    vocab: int
    seq_len: int
    kv_heads: int = 0  # 0: as many as `heads`; 1: multi-query attention
    gated_mlp: bool = False  # SwiGLU: three MLP matrices instead of two
    tied: bool = True
    learned_positions: bool = True
    parallel_block: bool = False  # attention and MLP side by side on one LayerNorm (PaLM)
    biases: bool = True
    head_size: int = 0  # 0: width / heads
    fused_attention: bool = False  # flash attention: no attention probabilities kept
    dropout: bool = False  # dropout on each branch's output (before the residual add)
    attention_dropout: bool = False  # dropout on the attention probabilities
    moe: MoESettings | None = None  # a mixture of experts in every block's MLP

    @property
    def head_dim(self) -> int:
        return self.head_size or self.width // self.heads

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def qkv_columns(self) -> int:
        return self.attention_width + 2 * (self.kv_heads or self.heads) * self.head_dim

    @property
    def expert_width(self) -> int:
        """Units of one MLP a token passes through: an expert's (the dense MLP's without
        experts)."""
        return (self.moe and self.moe.expert_dim) or self.mlp_dim

    @property
    def mlp_units(self) -> int:
        """MLP units one token passes through: its experts' and the shared expert's, or the
        dense MLP's."""
        if self.moe is None:
            return self.mlp_dim
        return self.moe.experts_per_token * self.expert_width + self.moe.shared_expert_dim

    def expert_rows(self, tokens: int, expert_size: int, shares: int) -> int:
        """Rows a device's experts multiply per MoE layer for the device's `tokens` tokens:
        each token's k pairs, or on an expert axis of `expert_size` devices the blocks the
        all-to-all delivers, padded to their worst case (jddp/models/moe_dispatch.py; `shares`:
        into how many shares the global batch's tokens are split)."""
        if expert_size == 1:
            return tokens * self.moe.experts_per_token
        return expert_size * dispatch_slots(self.moe, tokens, tokens * shares, expert_size)

    def mlp_matmul_params(self) -> int:
        """Parameters one token multiplies in a block's MLP (only the experts it takes)."""
        return mlp_matmul_params(self.width, self.mlp_dim, self.gated_mlp, self.moe)

    def layer_matmul_params(self) -> int:
        attention = self.width * self.qkv_columns + self.attention_width * self.width
        return attention + self.mlp_matmul_params()

    def matmul_dims(self, tensor: int = 1) -> tuple[tuple[float, int], ...]:
        """(multiply-adds per token, smallest dimension) of each matmul one device runs with
        the model split `tensor` ways as Megatron splits it (projections by heads and MLP
        columns, the head by vocabulary); a product's token dimension is never its smallest,
        and its backward products have the same three dimensions."""
        h, per_head = self.width, self.attention_width // tensor
        mlp = self.mlp_matmul_params() / tensor
        layer = (
            (h * self.qkv_columns / tensor, min(h, self.qkv_columns // tensor)),
            (per_head * h, min(h, per_head)),
            (mlp, min(h, self.expert_width // tensor)),
            (2 * per_head * self.seq_len, min(self.head_dim, self.seq_len)),  # QK^T and PV
        )
        head = (h * self.vocab / tensor, min(h, self.vocab // tensor))
        return (*((macs * self.layers, dim) for macs, dim in layer), head)

    def train_flops(self, sequences: int) -> float:
        """Model FLOPs of a training step on `sequences` sequences (jddp/observe/flops.py's
        convention: 6 x matmul parameters x tokens + 12 x layers x heads x head size x
        sequence length x tokens)."""
        matmul = self.layers * self.layer_matmul_params() + self.width * self.vocab
        attention = 12 * self.layers * self.attention_width * self.seq_len
        return (6 * matmul + attention) * sequences * self.seq_len

    def elementwise_elements(self, tensor: int = 1, sequence_parallel: bool = False) -> float:
        """Elements one device reads and writes per token and layer in the forward's
        non-matmul ops (memory-bound: they cost bytes, not FLOPs). Each op one read and one
        write per element: the norms and residual adds over the width (split over tensor only
        with sequence parallelism), the MLP activation and the attention probabilities
        (softmax, unless flash attention keeps none) split over tensor, dropout a pass over
        what it drops."""
        h = self.width
        if self.parallel_block:  # one norm; one add of attention, MLP and the residual
            whole = 2 * h + 4 * h + (4 * h if self.dropout else 0)
        else:  # two norms, two residual adds
            whole = 2 * 2 * h + 2 * 3 * h + (2 * 2 * h if self.dropout else 0)
        split = (3 if self.gated_mlp else 2) * self.mlp_units
        if not self.fused_attention:
            split += 2 * self.heads * self.seq_len * (2 if self.attention_dropout else 1)
        return whole / (tensor if sequence_parallel else 1) + split / tensor

    def score_elements(self, tensor: int = 1) -> float:
        """Elements of the attention scores per token and layer that the forward's two
        attention matmuls move through memory where attention is not fused: Q K^T writes the
        scores, the product with the values reads the probabilities (0 with flash attention,
        which keeps them on chip). Their third dimension is a head's size, so these matmuls do
        about head-size FLOPs per byte of scores, below the accelerator presets' ridge points
        for heads up to 160: they run at memory speed (jddp/planner/timing.py)."""
        return 0.0 if self.fused_attention else 2 * self.heads * self.seq_len / tensor

    def tensor_reductions_per_layer(self) -> int:
        """Activation reductions over tensor per layer and pass (forward or backward):
        Megatron's two, or one when attention and MLP share their input and output."""
        return 1 if self.parallel_block else 2


def transformer_params(t: Transformer, dtype=np.float32) -> dict:
    """ShapeDtypeStructs of a transformer's parameters, named as jddp's GPT names them (so
    its tensor-parallel partition rules apply)."""

    def p(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    def dense(fan_in, fan_out):
        return {"kernel": p(fan_in, fan_out), **({"bias": p(fan_out)} if t.biases else {})}

    def norm():
        return {"scale": p(t.width), **({"bias": p(t.width)} if t.biases else {})}

    mlp_columns = (2 if t.gated_mlp else 1) * t.mlp_dim
    attn = {"out": dense(t.attention_width, t.width)}
    if t.kv_heads:  # grouped / multi-query attention: keys and values are not split by head
        attn |= {
            "q": dense(t.width, t.attention_width),
            "kv": dense(t.width, 2 * t.kv_heads * t.head_dim),
        }
    else:
        attn["qkv"] = dense(t.width, t.qkv_columns)
    block = {
        "ln_1": norm(),
        "attn": attn,
        "mlp": {"fc": dense(t.width, mlp_columns), "proj": dense(t.mlp_dim, t.width)},
    }
    if not t.parallel_block:
        block["ln_2"] = norm()
    params = {"token_embed": {"embedding": p(t.vocab, t.width)}, "ln_f": norm()}
    params |= {f"block_{i}": block for i in range(t.layers)}
    if t.learned_positions:
        params["position_embed"] = p(t.seq_len, t.width)
    if not t.tied:
        params["head"] = dense(t.width, t.vocab)
    return params


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: it holds trees
class Workload:
    """One training step's shape. `params`: a tree of ShapeDtypeStructs; `rules_for(mesh)`:
    the partition rules a run on `mesh` (a DeviceMesh) uses; `model_flops`: the MFU numerator
    per step (jddp/observe/flops.py's convention)."""

    name: str
    params: Any
    global_batch: int  # examples (sequences) per step
    model_flops: float
    rules_for: Callable[[Any], tuple] = lambda mesh: ()
    transformer: Transformer | None = None
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE
    grad_accum_steps: int = 1
    recompute: float = 0.0  # fraction of the blocks' forward recomputed in backward (remat: 1)
    compute_bytes: int = 4  # bytes per activation element (bfloat16 compute: 2)
    opt_state: Any = None  # ShapeDtypeStructs of the optimizer state; None: Adam's two moments
    # Paths of the parameters that do not train (LoRA's base): no gradient, no gradient
    # collective, no optimizer state (`opt_state` covers the others alone).
    frozen_params: frozenset = frozenset()
    comm_bytes: int = 0  # bytes per parameter / gradient element on the wire; 0: their own
    grad_comm_bytes: int = 0  # bytes per gradient element reduced (grad_comm_dtype); 0: as above
    microbatches: int = 0  # pipeline micro-batches per step; 0: chosen (jddp/planner/stages.py)
    virtual_stages: int = 1  # pipeline chunks per device (the interleaved schedule)
    # jddp's timetable (gpipe | 1f1b: the same ticks and sends)
    pipeline_schedule: str = PipelineOptions.schedule
    # What a stage keeps of each layer's forward (dots | none | full: full recomputes it)
    pipeline_remat: str = PipelineOptions.remat
    lockstep_pipeline: bool = True  # jddp's engine; False: Megatron-LM's (jddp/planner/stages.py)
    vocab_parallel_loss: bool = False  # jddp's language-model loss and accuracy over tensor
    regather_in_backward: bool = False  # zero3 gathers parameters again for the recompute
    recompute_drops_output: bool = True  # XLA skips a recomputed layer's last reduction
    gathers_whole_model: bool = True  # jddp's zero3 gathers every parameter at once
    # (mesh axis, why the model cannot run on it): a mixture of experts' refusals today
    refused_axes: tuple[tuple[str, str], ...] = ()

    def on(self, layout) -> "Workload":
        """This workload as `layout` runs it: on a stage axis `pipeline_remat=full` recomputes
        every layer's forward in the backward, as the model's own remat does."""
        if layout.stage > 1 and self.pipeline_remat == "full" and not self.recompute:
            return dataclasses.replace(self, recompute=1.0)
        return self

    @property
    def param_count(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.params))

    @property
    def tokens_per_example(self) -> int:
        return self.transformer.seq_len if self.transformer else 1

    def hardware_flops(self) -> float:
        """FLOPs executed per step: the model FLOPs plus the recomputed forward of the blocks
        (remat), the head excluded (it is not recomputed)."""
        if not self.recompute:
            return self.model_flops
        if self.transformer is None:
            return self.model_flops * (3 + self.recompute) / 3
        t = self.transformer
        head = 6 * t.width * t.vocab * self.global_batch * t.seq_len
        blocks = self.model_flops - head
        return head + blocks * (3 + self.recompute) / 3

    def elementwise_bytes(
        self, tensor: int, sequence_parallel: bool, batch_slices: int, stages: int
    ) -> float:
        """Bytes one device moves per step in the blocks' non-matmul ops
        (`Transformer.elementwise_elements`): the forward's, again in the recomputed forward,
        twice in the backward; 0 without a transformer."""
        t = self.transformer
        if t is None:
            return 0.0
        return self._block_pass_bytes(
            t.elementwise_elements(tensor, sequence_parallel), batch_slices, stages
        )

    def score_bytes(self, tensor: int, batch_slices: int, stages: int) -> float:
        """Bytes of attention scores one device's attention matmuls write and read per step
        (`Transformer.score_elements`), counted over the passes as `elementwise_bytes`; 0
        without a transformer."""
        t = self.transformer
        if t is None:
            return 0.0
        return self._block_pass_bytes(t.score_elements(tensor), batch_slices, stages)

    def _block_pass_bytes(self, elements: float, batch_slices: int, stages: int) -> float:
        """`elements` per token and layer of the forward, as bytes one device moves per step:
        the forward's, again in the recomputed forward, twice in the backward."""
        t = self.transformer
        tokens = self.global_batch * t.seq_len / batch_slices
        return tokens * t.layers / stages * elements * self.compute_bytes * (3 + self.recompute)


def block_index(path: str) -> int | None:
    match = BLOCK.search(path)
    return int(match.group(1)) if match else None


def decoder_dimensions(model, seq_len: int) -> Transformer:
    """The Transformer dimensions of a jddp GPT or Llama (jddp/models/decoder.py)."""
    return Transformer(
        layers=model.num_layers,
        width=model.embed_dim,
        heads=model.num_heads,
        mlp_dim=model.hidden_dim,
        vocab=model.vocab_size,
        seq_len=seq_len,
        kv_heads=model.kv_heads if model.kv_heads != model.num_heads else 0,
        gated_mlp=model.gated_mlp,
        tied=model.tie_embeddings,
        learned_positions=model.positions == "learned",
        biases=getattr(model, "attention_bias", True),
        head_size=model.head_size,
        fused_attention=model.attention_impl == "cudnn",
        dropout=model.dropout_rate > 0,
        moe=model.moe,
    )


def refused_axes(model) -> tuple[tuple[str, str], ...]:
    """(axis, the model's own one-line refusal) for each mesh axis a jddp decoder cannot run on:
    `stage` where the model refuses to stack its layers, as a pipeline needs them."""
    from jddp.errors import ConfigError

    try:
        model.clone(scan_layers=True)  # a pipeline stacks the layers
    except ConfigError as e:
        return (("stage", str(e)),)
    return ()


def model_workload(
    model,
    sample_input,
    global_batch: int,
    optimizer=None,
    *,
    name: str = "model",
    lora=None,
    **fields,
) -> Workload:
    """The workload of training a Flax Linen or NNX `model` on `global_batch` examples shaped
    like `sample_input` (one example, batch of 1) per step with `optax` `optimizer` (None:
    Adam's two moments); with `lora` (a `jddp.LoRA`), its adapters too, and the rest frozen:
    gradients and optimizer state for the adapters alone. `fields` set the rest of `Workload`.
    Shapes only: nothing is computed."""
    from jddp.core.lora import split
    from jddp.core.modules import as_functional
    from jddp.core.tree_paths import path_str
    from jddp.models import Decoder
    from jddp.observe import flops

    shape = jax.ShapeDtypeStruct(np.shape(sample_input), np.asarray(sample_input).dtype)
    functional = as_functional(model)  # the trainer's view: the same parameter paths
    if lora:
        lora.check_adaptable(model)
    with lora.adapting(train=False) if lora else contextlib.nullcontext():
        params, _ = jax.eval_shape(
            lambda x: functional.init(
                {"params": jax.random.key(0), "dropout": jax.random.key(1)}, (x,), {}
            ),
            shape,
        )
    trained = params
    if lora:  # as the trainer does: the base has no gradient and no optimizer state
        base, trained = split(params)
        optimizer = optimizer or optax.adam(1e-3)
        frozen = jax.tree_util.tree_leaves_with_path(base)
        fields = {"frozen_params": frozenset(path_str(p) for p, _ in frozen)} | fields
    transformer = None
    if isinstance(model, Decoder):
        transformer = decoder_dimensions(model, shape.shape[1])
        fields = {
            "vocab_parallel_loss": True,
            "recompute": float(model.remat),
            "refused_axes": refused_axes(model),
        } | fields
    global_input = jax.ShapeDtypeStruct((global_batch, *shape.shape[1:]), shape.dtype)
    step_flops = flops.train_step_flops(model, global_input)
    return Workload(
        name=name,
        params=params,
        global_batch=global_batch,
        model_flops=step_flops.per_step if step_flops else 0.0,
        transformer=transformer,
        opt_state=jax.eval_shape(optimizer.init, trained) if optimizer else None,
        **fields,
    )


def from_config(config) -> Workload:
    """The workload a jddp experiment config trains, from shapes only (a language model needs
    no data; other datasets give one example, preparing the dataset if it is not yet)."""
    from jddp import models
    from jddp.parallel.mesh import DeviceMesh
    from jddp.run import factory, optim
    from jddp.run.config import lora_of

    config = factory.with_checkpoint_model_args(config)
    dataset = factory.dataset_spec(config)
    # Axis names as a data x fsdp x tensor mesh gives them: the layouts vary only the sizes.
    tensor_axis = "tensor" if config.model in models.TENSOR_PARALLEL_MODELS else None
    model = models.create_model(
        config.model,
        dataset.num_classes,
        batch_axis_name=("data", "fsdp"),
        tensor_axis=tensor_axis,
        seed=config.seed,  # an own NNX model initializes its parameters from it
        **config.model_args,
    )
    sample_input = factory.sample_batch(config, dataset)[dataset.input_key]

    def rules_for(mesh: DeviceMesh):  # what the trainer gets on that mesh
        return factory.partition_rules(config, mesh, model)

    return model_workload(
        model,
        sample_input,
        config.global_batch_size,
        optim.create_optimizer(config, optim.learning_rate_schedule(config)),
        name=f"{config.model} on {config.dataset}",
        lora=lora_of(config),
        rules_for=rules_for,
        min_shard_size=config.parallel.min_shard_size,
        grad_accum_steps=config.grad_accum_steps,
        compute_bytes=factory.compute_bytes(config),
        grad_comm_bytes=2 if config.parallel.grad_comm_dtype == "bfloat16" else 0,
        microbatches=config.parallel.pipeline.microbatches,
        pipeline_schedule=config.parallel.pipeline.schedule,
        virtual_stages=config.parallel.pipeline.repeats,
        pipeline_remat=config.parallel.pipeline.remat,
    )
