"""Model FLOPs of one training step: analytic for the built-in models, XLA's count otherwise.

Convention (the one MFU uses, PaLM appendix B): a matmul of (m, k) by (k, n) is 2mkn FLOPs; a
training step is 3x the forward pass (the backward pass computes two matmuls per forward one);
element-wise work (activations, normalization, softmax, optimizer) is not counted; activation
recomputation (remat) is not counted either, so MFU does not reward it.

- GPT and Llama: 6 x (matmul parameters) x tokens + 12 x layers x (heads x head size) x seq_len x
  tokens, where the matmul parameters are the blocks' kernels and the output projection (tied or
  not), and the attention term counts Q.K^T and attention x V over the whole (unmasked) T x T
  square. A mixture of experts counts the parameters a token multiplies: the router, its k
  experts of E, the shared expert (MaxText's convention; dropped tokens and
  the padding of dispatch buffers are not counted).
- Conv nets and MLPs: every `nn.Conv` and `nn.Dense` layer, 2 x outputs x kernel fan-in.
- Any other module (your own Linen module, an NNX module): the FLOPs XLA counts in the compiled
  forward pass (all ops, element-wise too), times 3.
"""

import dataclasses
import math

import flax.linen as nn
import jax

from jddp.core.modules import as_functional
from jddp.models.cnn import CNN
from jddp.models.decoder import Decoder
from jddp.models.mlp import MLP
from jddp.models.moe_settings import MoESettings
from jddp.models.resnet import ResNet

LAYERWISE_MODELS = (MLP, CNN, ResNet)


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step on a batch, and how they were counted."""

    per_step: float
    method: str  # "analytic (...)" or "xla"


def mlp_matmul_params(width: int, hidden: int, gated: bool, moe: MoESettings | None) -> int:
    """Parameters one token multiplies in a block's MLP: a dense MLP's two (gated: three)
    matrices of `hidden` units; a mixture of experts' router, the `experts_per_token` experts
    it takes (each `expert_dim` wide, 0: `hidden`), not the others, and its shared expert
    with its gate."""
    matrices = 3 if gated else 2
    if moe is None:
        return matrices * width * hidden
    experts = moe.experts_per_token * matrices * width * (moe.expert_dim or hidden)
    shared = matrices * width * moe.shared_expert_dim
    gate = width if moe.shared_expert_dim and moe.shared_expert_gate else 0
    return width * moe.num_experts + experts + shared + gate


def decoder_matmul_params(model: Decoder) -> int:
    """Parameters that multiply activations: per block the attention projections (queries,
    keys and values, output) and the MLP's matrices (a mixture of experts': those a token
    takes); the head."""
    width, attention = model.embed_dim, model.num_heads * model.head_size
    kv = 2 * model.kv_heads * model.head_size
    mlp = mlp_matmul_params(width, model.hidden_dim, model.gated_mlp, model.moe)
    per_block = width * (attention + kv) + attention * width + mlp
    return model.num_layers * per_block + width * model.vocab_size


def decoder_train_flops(model: Decoder, batch_size: int, seq_len: int) -> int:
    """6 N T_total + 12 L (heads x head size) T T_total for `batch_size` sequences of `seq_len`
    tokens."""
    tokens = batch_size * seq_len
    attention = 12 * model.num_layers * model.num_heads * model.head_size * seq_len
    return (6 * decoder_matmul_params(model) + attention) * tokens


def layerwise_forward_flops(model: nn.Module, sample_input, **call_kwargs) -> int:
    """Forward FLOPs of every `nn.Dense` and `nn.Conv` call of a Linen model on `sample_input`
    (shapes only: nothing is computed)."""
    total = 0

    def count(next_fun, args, kwargs, context):
        nonlocal total
        out = next_fun(*args, **kwargs)
        module = context.module
        if context.method_name == "__call__" and isinstance(module, nn.Dense | nn.Conv):
            fan_in = args[0].shape[-1]
            if isinstance(module, nn.Conv):
                fan_in = math.prod(module.kernel_size) * fan_in // module.feature_group_count
            total += 2 * math.prod(out.shape) * fan_in
        return out

    def init(inputs):
        with nn.intercept_methods(count):
            return model.init(jax.random.key(0), inputs, **call_kwargs)

    jax.eval_shape(init, sample_input)
    return total


def xla_forward_flops(model, *inputs, **keyword_inputs) -> float | None:
    """FLOPs XLA counts in the forward pass of a Linen or NNX model called with `inputs` (and
    `keyword_inputs`), or None if it reports none. Compiles the forward pass once."""
    functional = as_functional(model)
    params, model_state = jax.eval_shape(
        lambda args, kwargs: functional.init({"params": jax.random.key(0)}, args, kwargs),
        inputs,
        keyword_inputs,
    )

    def forward(params, model_state, args, kwargs):
        return functional.apply(params, model_state, args, kwargs, train=False)[0]

    compiled = jax.jit(forward).lower(params, model_state, inputs, keyword_inputs).compile()
    return xla_flops(compiled)


def xla_flops(compiled) -> float | None:
    """The `flops` entry of a compiled program's cost analysis (a dict, or a list of one dict in
    older JAX), or None."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else {}
    flops = (analysis or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def train_step_flops(model, *inputs, **keyword_inputs) -> StepFlops | None:
    """Model FLOPs of one training step on a batch of the model's call arguments, arrays or
    shapes of its whole batch (pass the global batch for the global count): `inputs` (the one
    input array, mostly) and `keyword_inputs` (a packed batch's `tokens`, `segment_ids` and
    `positions`: a decoder's FLOPs come from its tokens). None if nothing can count them."""
    if isinstance(model, Decoder):
        tokens = inputs[0] if inputs else keyword_inputs["tokens"]
        flops = decoder_train_flops(model, *tokens.shape[:2])
        return StepFlops(flops, "analytic (6 N tokens + attention)")
    if isinstance(model, LAYERWISE_MODELS) and len(inputs) == 1 and not keyword_inputs:
        kwargs = {"train": False} if isinstance(model, ResNet) else {}
        forward = layerwise_forward_flops(model, inputs[0], **kwargs)
        return StepFlops(3 * forward, "analytic (per layer)")
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (inputs, keyword_inputs)
    )
    forward = xla_forward_flops(model, *shapes[0], **shapes[1])
    return StepFlops(3 * forward, "xla") if forward else None
