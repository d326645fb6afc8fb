"""Per-example losses and metrics for classification: `fn(logits, batch) -> shape (batch,)`."""

import jax.numpy as jnp
import optax


def softmax_cross_entropy(logits, batch):
    """Cross-entropy of `logits` against the integer `batch["label"]`, one value per example."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])


def accuracy(logits, batch):
    """1.0 where the arg-max of `logits` is `batch["label"]`, else 0.0."""
    return (jnp.argmax(logits, axis=-1) == batch["label"]).astype(jnp.float32)
