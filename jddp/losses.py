"""Per-example losses and metrics, `fn(outputs, batch) -> shape (batch,)` (or a pair of such,
(weighted sums, weights): jddp/core/weighted.py): classification and language models."""

import jax
import jax.numpy as jnp
import optax

LOSS_MASK = "loss_mask"  # the batch entry that says which targets count (instruction data)


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
    return _token_losses(logits, batch["targets"]).mean(-1)


def token_accuracy(logits, batch):
    """Language models: the fraction of each sequence's next tokens predicted exactly."""
    return _token_hits(logits, batch["targets"]).mean(-1)


def masked_token_cross_entropy(logits, batch):
    """Language models whose `batch[LOSS_MASK]` (batch, seq_len) says which targets count: per
    sequence, (the sum of its counted tokens' cross-entropies, how many count). Summed over the
    global batch and divided, the mean over every counted token, however many each row has."""
    mask = jnp.asarray(batch[LOSS_MASK], logits.dtype)
    return jnp.sum(_token_losses(logits, batch["targets"]) * mask, -1), jnp.sum(mask, -1)


def masked_token_accuracy(logits, batch):
    """Of the counted targets (`batch[LOSS_MASK]`), (those predicted exactly, how many count)."""
    mask = jnp.asarray(batch[LOSS_MASK], jnp.float32)
    return jnp.sum(_token_hits(logits, batch["targets"]) * mask, -1), jnp.sum(mask, -1)


def _token_losses(logits, targets):
    """(batch, seq_len) cross-entropies (see token_cross_entropy)."""
    one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * one_hot, axis=-1)


def _token_hits(logits, targets):
    return (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
