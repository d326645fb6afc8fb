"""What every Hugging Face family's mapping is made of: one jddp parameter and the tensor (or,
for stacked experts, the tensors) of `model.safetensors` it comes from, with the transform
between them (`Tensor`); and config.json's fields read with a one-line error (`count`,
`require`).

Hugging Face's `nn.Linear` weights are (out, in) and jddp's kernels (in, out): those are
transposed. GPT-2's fused `c_attn` holds all query columns, then all keys, then all values,
where jddp's `qkv` holds each head's q, k, v together (`QKV_BY_HEAD`). A mixture of experts'
weights are one jddp parameter stacked on a leading expert dimension and one Hugging Face
tensor per expert (`Tensor.experts`).
"""

import dataclasses

import numpy as np

from jddp.errors import ConfigError

TRANSPOSE, QKV_BY_HEAD = "transpose", "qkv_by_head"


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One jddp parameter (its per-layer path) and the Hugging Face tensor it comes from; with
    `experts` > 0, the parameter stacks that many tensors, `name` holding "{e}" for the
    expert's index (`parts`)."""

    path: str  # "block_0/attn/q/kernel"
    name: str  # "model.layers.0.self_attn.q_proj.weight"
    transform: str = ""  # "", TRANSPOSE, or QKV_BY_HEAD
    heads: int = 0  # QKV_BY_HEAD: the number of heads
    experts: int = 0  # > 0: one tensor per expert, stacked on jddp's leading dimension

    def parts(self) -> list["Tensor"]:
        """The single tensors this parameter is made of: itself, or one per expert (each the
        parameter's slice [e])."""
        if not self.experts:
            return [self]
        return [
            dataclasses.replace(self, name=self.name.format(e=e), experts=0)
            for e in range(self.experts)
        ]

    def part_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The jddp shape of one of `parts` for a parameter of `shape`."""
        return tuple(shape[1:]) if self.experts else tuple(shape)

    def to_jddp(self, hf: np.ndarray) -> np.ndarray:
        if self.transform == TRANSPOSE:
            return hf.T
        if self.transform == QKV_BY_HEAD:  # [...][part, head, dim] -> [...][head, part, dim]
            lead = hf.shape[:-1]
            split = hf.reshape(*lead, 3, self.heads, -1)
            return np.swapaxes(split, -3, -2).reshape(*lead, -1)
        return hf

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        if self.transform == TRANSPOSE:
            return ours.T
        if self.transform == QKV_BY_HEAD:
            lead = ours.shape[:-1]
            split = ours.reshape(*lead, self.heads, 3, -1)
            return np.swapaxes(split, -3, -2).reshape(*lead, -1)
        return ours

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face tensor's shape for a jddp parameter (one of `parts`) of `shape`."""
        return tuple(reversed(shape)) if self.transform == TRANSPOSE else tuple(shape)


def require(hf: dict, where: str, **expected) -> None:
    """A ConfigError for a config.json setting jddp's model does not have."""
    for key, allowed in expected.items():
        value = hf.get(key, allowed[0])
        if value not in allowed:
            raise ConfigError(
                f"{where} has {key}={value!r}, which jddp's model does not implement "
                f"(it supports {' or '.join(map(repr, allowed))})"
            )


def count(hf: dict, key: str, where: str, default: int | None = None) -> int:
    """config.json's `key`, a positive integer (a dimension or a count); `default` where it is
    absent or null."""
    if key not in hf and default is None:
        raise ConfigError(f"{where} has no {key!r}; is it a save_pretrained config.json?")
    value = hf.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} has {key}={value!r}; expected a positive integer")
    return value
