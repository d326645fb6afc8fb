"""LoRA (Hu et al., 2021) as PEFT computes it, on any Linen model whose projections are modules
holding a 2-D `kernel` (x @ kernel): `y = base(x) + dropout(x) @ A @ B * alpha / rank`.

The model's code is not touched: a Flax method interceptor runs around each targeted module's
`__call__`, creates the adapters `lora_A` (in, rank) and `lora_B` (rank, out) beside its kernel
(so they are stacked with a `Pipelined` stack and sharded with the model by the partition rules)
and adds their product to the module's output. Every other parameter is frozen: the step takes
the gradient with respect to the adapters alone (`split`: `jddp.core.task.Task.trainable`), so
the base has no gradient to reduce or accumulate and no optimizer state. The model also sees it
through `lax.stop_gradient` (`freeze`), for the pipeline engine, which differentiates a layer's
whole parameters (to keep its weights out of the stash) and keeps the adapters' part.

The adapters' dropout masks follow the example and the layer, never the layout: inside a layer
of jddp's decoders they draw from the layer's own key (jddp/core/layer_keys.py), with row keys
(jddp/core/row_keys.py); docs/huggingface.md states the rule. NNX models are refused: they do not
run through Linen's interceptor.
"""

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from jddp.core import layer_keys
from jddp.core.tree_paths import nest_paths, path_str
from jddp.errors import ConfigError

ADAPTERS = ("lora_A", "lora_B")
# The projections of jddp's decoders (Llama, GPT): attention q, k, v, out (GPT's fused qkv) and
# the MLP's gate, up, proj (GPT's fc); PEFT's target_modules for the same layers.
ALL_PROJECTIONS = r"(attn/(q|k|v|qkv|out)|mlp/(gate|up|proj|fc))$"


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Low-rank adapters on the modules whose path (`block_0/attn/q`, slash-separated) matches
    the regex `targets` (searched, like PEFT's `target_modules` string): `rank` (PEFT's `r`),
    `alpha` (`lora_alpha`; the update is scaled by alpha / rank), `dropout` (`lora_dropout`, on
    the adapters' input only). A is drawn as PEFT draws it (Kaiming-uniform, a=sqrt(5)), B is
    zero: the adapted model starts as the base model."""

    rank: int
    alpha: float = 8.0
    dropout: float = 0.0
    targets: str = ALL_PROJECTIONS

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError(f"lora.rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.alpha, int | float) or not self.alpha > 0:
            raise ConfigError(f"lora.alpha must be a number > 0, got {self.alpha!r}")
        if not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        try:
            re.compile(self.targets)
        except (re.error, TypeError) as e:
            raise ConfigError(f"lora.targets {self.targets!r} is not a regex: {e}") from None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    # ------------------------------------------------------------------------- the model
    def check_adaptable(self, model) -> None:
        """A ConfigError for an NNX model: the adapters are added by a Linen method
        interceptor, which NNX modules do not run through."""
        if isinstance(model, nnx.Module):
            raise ConfigError(
                f"lora adapts Linen models only and {type(model).__name__} is an NNX module; "
                "write the model with flax.linen, or build flax.nnx.LoRA layers into it and "
                "train without lora, freezing the rest in the optimizer (optax.multi_transform)"
            )

    @contextlib.contextmanager
    def adapting(self, train: bool):
        """Within it, the targeted modules of any Linen model create and add their adapters
        (with `train`, their dropout draws as `dropout_key` says)."""
        dropping = train and self.dropout > 0
        with nn.intercept_methods(lambda *call: self._adapt(dropping, *call)):
            with layer_keys.wanting(dropping):
                yield

    def _adapt(self, dropping: bool, next_fun, args, kwargs, context):
        y = next_fun(*args, **kwargs)
        module = context.module
        if context.method_name != "__call__" or not re.search(self.targets, path_str_of(module)):
            return y
        if not module.has_variable("params", "kernel"):
            return y
        kernel = module.get_variable("params", "kernel")
        if kernel.ndim != 2:
            return y
        fan_in, fan_out = kernel.shape
        if self.rank > min(fan_in, fan_out):
            raise ConfigError(
                f"lora.rank={self.rank} is larger than {path_str_of(module)}'s kernel "
                f"({fan_in} x {fan_out}); use a rank of at most {min(fan_in, fan_out)}"
            )
        # PEFT's nn.Linear init of A, Kaiming-uniform with a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in)).
        bound = 1.0 / fan_in**0.5
        init_a = lambda key, shape: jax.random.uniform(key, shape, jnp.float32, -bound, bound)  # noqa: E731
        a = module.param("lora_A", init_a, (fan_in, self.rank))
        b = module.param("lora_B", nn.initializers.zeros_init(), (self.rank, fan_out))
        x = args[0]
        if dropping:
            keep = jax.random.bernoulli(dropout_key(module), 1 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1 - self.dropout), 0).astype(x.dtype)
        return y + ((x @ a.astype(x.dtype)) @ b.astype(x.dtype)) * self.scale

    # -------------------------------------------------------------------- the parameters
    def freeze(self, params):
        """`params` with every parameter but the adapters behind `lax.stop_gradient`."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: x if is_adapter(path) else jax.lax.stop_gradient(x), params
        )

    def check_found(self, params) -> None:
        """A ConfigError unless `targets` matched at least one module with a 2-D kernel."""
        if any(is_adapter(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)):
            return
        kernels = sorted(
            path_str(path).rsplit("/", 1)[0]
            for path, x in jax.tree_util.tree_leaves_with_path(params)
            if path_str(path).endswith("/kernel") and x.ndim == 2
        )
        which = f"; its modules with a kernel: {', '.join(kernels[:8])}" if kernels else ""
        raise ConfigError(
            f"lora.targets {self.targets!r} matches no module of the model with a 2-D kernel"
            f"{which}; set --config.lora.targets to a regex over those paths"
        )


def dropout_key(module: nn.Module) -> jax.Array:
    """The key of a targeted module's dropout mask: inside a layer of jddp's decoders, the
    layer's key folded with the module's path within the layer (jddp/core/layer_keys.py: the
    same whether the layers are unrolled, stacked or pipelined); elsewhere (a user's Linen
    model) the module's `dropout` stream. Both are row keys in training (jddp/core/row_keys.py):
    the mask's rows are the examples' own on every device count."""
    key = layer_keys.key_for(module)
    return module.make_rng("dropout") if key is None else key


def path_str_of(module: nn.Module) -> str:
    return "/".join(str(part) for part in module.path)


def is_adapter(path) -> bool:
    """Whether a parameter's key path (or its slash-joined string) is a LoRA adapter."""
    name = path if isinstance(path, str) else path_str(path)
    return name.rsplit("/", 1)[-1] in ADAPTERS


def split(params) -> tuple[dict, dict]:
    """(the base parameters, the adapters), each as a nested dict of `params`' structure; of
    any tree shaped like the parameters or a part of them (gradients, specs, one layer's)."""
    flat = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    base = nest_paths({k: v for k, v in flat.items() if not is_adapter(k)})
    adapters = nest_paths({k: v for k, v in flat.items() if is_adapter(k)})
    return base, adapters


def joined(base, adapters) -> dict:
    """The parameters `split` took apart."""
    flat = {}
    for tree in (base, adapters):
        flat.update({path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)})
    return nest_paths(flat)


def merged(params, scale: float):
    """`params` (host arrays, any layout) with each adapted kernel replaced by kernel +
    scale * A @ B and the adapters dropped: an ordinary model's parameters."""

    def merge(tree):
        if not isinstance(tree, dict):
            return tree
        if "lora_A" in tree:
            rest = {k: v for k, v in tree.items() if k not in ADAPTERS}
            a, b = tree["lora_A"], tree["lora_B"]
            rest["kernel"] = rest["kernel"] + scale * np.matmul(a, b)
            return rest
        return {k: merge(v) for k, v in tree.items()}

    return merge(params)
