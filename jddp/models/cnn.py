"""A small convolutional network for small images (digits, MNIST-sized)."""

from collections.abc import Sequence

import flax.linen as nn


class CNN(nn.Module):
    """3x3 conv + ReLU blocks of `channels`, 2x2 max-pooling after each but the first, then
    a dense layer and a linear classifier."""

    num_classes: int
    channels: Sequence[int] = (32, 64)
    dense_size: int = 128

    @nn.compact
    def __call__(self, x):
        for i, width in enumerate(self.channels):
            x = nn.relu(nn.Conv(width, (3, 3), name=f"conv_{i}")(x))
            if i > 0:
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.dense_size, name="dense")(x))
        return nn.Dense(self.num_classes, name="head")(x)
