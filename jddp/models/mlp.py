"""A multi-layer perceptron on flattened inputs."""

from collections.abc import Sequence

import flax.linen as nn


class MLP(nn.Module):
    """Dense + ReLU layers of `hidden_sizes`, then a linear classifier; inputs are flattened."""

    num_classes: int
    hidden_sizes: Sequence[int] = (256, 256)

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.hidden_sizes):
            x = nn.relu(nn.Dense(width, name=f"hidden_{i}")(x))
        return nn.Dense(self.num_classes, name="head")(x)
