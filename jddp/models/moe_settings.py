"""What a decoder's mixture-of-experts MLP is: `model_args.moe`, checked once, in one line per
mistake (jddp/models/moe.py builds it)."""

import dataclasses
import difflib
import math

from jddp.errors import ConfigError

ROUTER_ORDERS = ("softmax_topk", "topk_softmax")
DISPATCHES = ("dropless", "capacity")


@dataclasses.dataclass(frozen=True)
class MoESettings:
    """A block's MLP as `num_experts` experts of which each token takes `experts_per_token`.

    `router_order`: "softmax_topk" (Mixtral, Qwen-MoE: softmax over every expert, then the top
    k; their weights renormalized to sum to 1 when `normalize_top_k`, as Mixtral always and
    Qwen-MoE's `norm_topk_prob` do) or "topk_softmax" (the top k logits, then a softmax over
    them). `dispatch`: "dropless" (every token reaches its experts) or "capacity" (each expert
    takes at most ceil(capacity_factor x tokens x k / experts) of the global batch's tokens,
    the first ones in the global batch's order). `expert_dim`: each expert's width (0: the
    model's `mlp_dim`); `shared_expert_dim` > 0 adds a dense MLP every token takes, scaled by a
    sigmoid gate when `shared_expert_gate` (Qwen2-MoE's). The load-balancing loss and the
    router z-loss, means over the MoE layers, are added to the training loss with these weights.
    """

    num_experts: int = 0
    experts_per_token: int = 2
    router_order: str = "softmax_topk"
    normalize_top_k: bool = True
    dispatch: str = "dropless"
    capacity_factor: float = 1.0
    expert_dim: int = 0
    shared_expert_dim: int = 0
    shared_expert_gate: bool = True
    load_balance_weight: float = 0.01
    z_loss_weight: float = 0.0

    def __post_init__(self):
        _check(self)

    def capacity(self, tokens: int) -> int:
        """How many of `tokens` (the global batch's) one expert takes in capacity mode."""
        return math.ceil(self.capacity_factor * tokens * self.experts_per_token / self.num_experts)


def moe_settings(given) -> MoESettings | None:
    """`model_args.moe` (a mapping, a `MoESettings`, or None / empty / num_experts=0 for a dense
    MLP) as settings, or None for a dense model."""
    if not given:
        return None
    if not isinstance(given, MoESettings):
        if not hasattr(given, "items"):
            raise ConfigError(
                f"model_args.moe={given!r} must be a mapping such as {{'num_experts': 8}}"
            )
        given = dict(given.items())
        fields = [f.name for f in dataclasses.fields(MoESettings)]
        for name in given:
            if name not in fields:
                close = difflib.get_close_matches(name, fields, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"model_args.moe has no field {name!r}{hint}; its fields are "
                    f"{', '.join(fields)}"
                )
        given = MoESettings(**given)
    return given if given.num_experts else None


def _check(s: MoESettings) -> None:
    where = "model_args.moe"
    for name in ("num_experts", "expert_dim", "shared_expert_dim"):
        if getattr(s, name) < 0:
            raise ConfigError(f"{where}.{name}={getattr(s, name)} must be >= 0 (0: none/default)")
    if s.num_experts and not 1 <= s.experts_per_token <= s.num_experts:
        raise ConfigError(
            f"{where}.experts_per_token={s.experts_per_token} must be between 1 and "
            f"num_experts={s.num_experts}"
        )
    for name, value, choices in (
        ("router_order", s.router_order, ROUTER_ORDERS),
        ("dispatch", s.dispatch, DISPATCHES),
    ):
        if value not in choices:
            raise ConfigError(f"{where}.{name}={value!r}; choose one of {', '.join(choices)}")
    if not s.capacity_factor > 0:
        raise ConfigError(
            f"{where}.capacity_factor={s.capacity_factor} must be > 0 (1.0: each expert takes "
            "its even share of the tokens)"
        )
    for name in ("load_balance_weight", "z_loss_weight"):
        if not getattr(s, name) >= 0:
            raise ConfigError(f"{where}.{name}={getattr(s, name)} must be >= 0")
