"""What a dataset's task asks of training: the loss, the metrics, the model input, eval extras.

A dataset spec's `kind` (`classification` or `language_model`) names its objective:
`objective_for(spec.kind, masked=spec.loss_mask)` (instruction data's loss counts only the targets
its `loss_mask` marks); its `num_classes` (for a language model, the vocabulary size) is the
number of model outputs.
"""

import dataclasses
import math
from collections.abc import Mapping

from jddp import losses
from jddp.core.task import PerExampleFn
from jddp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Objective:
    kind: str
    loss_fn: PerExampleFn
    metrics: Mapping[str, PerExampleFn]
    input_key: str

    def tokens_per_example(self, batch) -> int:
        """Tokens in one example (language models: its sequence length), else 0."""
        return batch[self.input_key].shape[1] if self.kind == "language_model" else 0

    def eval_extras(self, eval_metrics: Mapping[str, float]) -> dict[str, float]:
        """Metrics derived from the eval means: perplexity = exp(mean token loss)."""
        if self.kind == "language_model":
            return {"perplexity": math.exp(min(eval_metrics["loss"], 700.0))}
        return {}


OBJECTIVES = {
    "classification": Objective(
        "classification",
        losses.softmax_cross_entropy,
        {"accuracy": losses.accuracy},
        input_key="image",
    ),
    # Every sequence has the same length, so the mean of per-sequence mean token losses is the
    # mean token loss, and exp of the eval loss is the perplexity.
    "language_model": Objective(
        "language_model",
        losses.token_cross_entropy,
        {"accuracy": losses.token_accuracy},
        input_key="inputs",
    ),
}
# Instruction data: loss and accuracy are (sums, counts) per sequence, so their means are over the
# counted tokens of the whole global batch (jddp/core/weighted.py), on any layout; exp of the eval
# loss is the perplexity of those tokens.
MASKED_LANGUAGE_MODEL = Objective(
    "language_model",
    losses.masked_token_cross_entropy,
    {"accuracy": losses.masked_token_accuracy},
    input_key="inputs",
)


def objective_for(kind: str, masked: bool = False) -> Objective:
    """The objective of a task `kind`; `masked`: a language model's loss over the targets its
    batch's `loss_mask` counts."""
    if kind not in OBJECTIVES:
        raise ConfigError(f"unknown task kind {kind!r}; choose one of {', '.join(OBJECTIVES)}")
    if masked:
        if kind != "language_model":
            raise ConfigError(f"a loss mask applies to language models, not to {kind!r}")
        return MASKED_LANGUAGE_MODEL
    return OBJECTIVES[kind]
