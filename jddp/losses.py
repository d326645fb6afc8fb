"""Per-example losses and metrics, `fn(outputs, batch) -> shape (batch,)`: classification and
language models."""

import jax
import jax.numpy as jnp
import optax


def softmax_cross_entropy(logits, batch):
    """Cross-entropy of `logits` against the integer `batch["label"]`, one value per example."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])


def accuracy(logits, batch):
    """1.0 where the arg-max of `logits` is `batch["label"]`, else 0.0."""
    return (jnp.argmax(logits, axis=-1) == batch["label"]).astype(jnp.float32)


def token_cross_entropy(logits, batch):
    """Language models: the mean next-token cross-entropy of each sequence, logits
    (batch, seq_len, vocab) against the integer `batch["targets"]` (batch, seq_len).

    Written as logsumexp minus the target's logit picked by a one-hot product (optax's own
    formula, with its gather replaced): when the logits are split over the vocabulary (tensor
    parallelism), both are reductions over the split axis, and no device gathers whole logits."""
    targets = jax.nn.one_hot(batch["targets"], logits.shape[-1], dtype=logits.dtype)
    target_logits = jnp.sum(logits * targets, axis=-1)
    return (jax.nn.logsumexp(logits, axis=-1) - target_logits).mean(-1)


def token_accuracy(logits, batch):
    """Language models: the fraction of each sequence's next tokens predicted exactly."""
    return (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32).mean(-1)
