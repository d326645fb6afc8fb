"""Rotary position embeddings (Su et al., 2021) and the frequency scalings Hugging Face's
`rope_type`s name, equal to transformers' `ROPE_INIT_FUNCTIONS` for the same parameters:

    linear  every frequency divided by `factor` (positions interpolated);
    llama3  Llama 3.1's: wavelengths above original_max_position_embeddings / low_freq_factor
            divided by `factor`, those below ... / high_freq_factor kept, a smooth ramp between;
    yarn    (Peng et al., 2023) a ramp over the dimensions between interpolated and original
            frequencies (beta_fast, beta_slow), and cos / sin scaled by an attention factor.

A scaling is a mapping as config.json's `rope_parameters` writes it, without `rope_theta` (the
model's `rope_base`): {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}. "dynamic" and "longrope"
depend on the sequence's length at run time and are not implemented.
"""

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict

from jddp.errors import ConfigError

# rope_type: (required keys, optional keys)
SCALINGS = {
    "linear": (("factor",), ()),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        (),
    ),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
}
_FLAGS = ("truncate",)  # booleans; every other parameter is a number


def check_scaling(scaling, where: str = "Llama rope_scaling") -> FrozenDict | None:
    """`scaling` (a mapping, or None / empty for plain rotary positions) as a hashable mapping;
    a one-line ConfigError for a type or a parameter jddp does not implement."""
    if not scaling:
        return None
    if not hasattr(scaling, "items"):
        raise ConfigError(
            f"{where}={scaling!r} must be a mapping, as config.json's rope_parameters"
        )
    scaling = dict(scaling.items())
    kind = scaling.get("rope_type")
    if kind not in SCALINGS:
        raise ConfigError(
            f"{where} has rope_type={kind!r}; jddp implements {', '.join(map(repr, SCALINGS))} "
            "(or no rope_scaling for plain rotary positions)"
        )
    required, optional = SCALINGS[kind]
    missing = [k for k in required if scaling.get(k) is None]
    unknown = sorted(set(scaling) - {"rope_type", *required, *optional})
    if missing or unknown:
        problem = f"lacks {missing[0]!r}" if missing else f"has no parameter {unknown[0]!r}"
        raise ConfigError(
            f"{where} of rope_type {kind!r} {problem}; it takes {', '.join(required)}"
            + (f" and optionally {', '.join(optional)}" if optional else "")
        )
    for key, value in scaling.items():
        flag = key in _FLAGS
        if key == "rope_type" or value is None:
            continue
        if isinstance(value, bool) != flag or not isinstance(value, int | float):
            expected = "true or false" if flag else "a number"
            raise ConfigError(f"{where} has {key}={value!r}; expected {expected}")
        if not flag and key not in ("beta_fast", "beta_slow") and not value > 0:
            raise ConfigError(f"{where} has {key}={value!r}; expected a number > 0")
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ConfigError(
            f"{where} has high_freq_factor={scaling['high_freq_factor']} <= low_freq_factor="
            f"{scaling['low_freq_factor']}; Llama 3.1's ramp needs high > low (4 and 1)"
        )
    return FrozenDict(scaling)


def frequencies(head_dim: int, base: float, scaling: Mapping | None = None):
    """(the head_dim / 2 inverse frequencies as float32, the factor cos and sin are scaled by)."""
    inverse = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = scaling["rope_type"] if scaling else None
    if kind == "linear":
        return (inverse / scaling["factor"]).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3(inverse, scaling).astype(np.float32), 1.0
    if kind == "yarn":
        return _yarn(inverse, head_dim, base, scaling)
    return inverse.astype(np.float32), 1.0


def _llama3(inverse: np.ndarray, scaling: Mapping) -> np.ndarray:
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inverse
    scaled = np.where(wavelength > context / low, inverse / factor, inverse)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return np.where(medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inverse: np.ndarray, head_dim: int, base: float, scaling: Mapping):
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def dimension(rotations):  # the dimension that turns `rotations` times over the context
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = dimension(scaling.get("beta_fast") or 32)
    high = dimension(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high += 0.001 if low == high else 0  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of the original (extrapolated) frequency
    mixed = inverse / factor * (1 - kept) + inverse * kept
    return mixed.astype(np.float32), float(attention_factor)


def rotary(
    x: jax.Array, positions: jax.Array, base: float = 10000.0, scaling: Mapping | None = None
) -> jax.Array:
    """x (batch, seq, heads, head_dim) with rotary positions: pairs of channels (i, i +
    head_dim/2) rotated by position x frequency (Hugging Face's `rotate_half` layout), the
    frequencies scaled as `scaling` says. `positions`: (seq,), or (batch, seq) per row (packed
    documents, each from 0)."""
    half = x.shape[-1] // 2
    inverse, factor = frequencies(x.shape[-1], base, scaling)
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inverse)  # (..., seq, half)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return rotated.astype(x.dtype)
