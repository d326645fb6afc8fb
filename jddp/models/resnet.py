"""ResNet-18/34/50/101/152 (v1.5: stride on the 3x3 convolution) with an ImageNet or CIFAR stem.

BatchNorm statistics cover the whole global batch when `batch_axis_name` names the strategy's
batch axes (`jddp.batch_axis_name(strategy, mesh)`: "batch" under ddp, the mesh's `data` and
`fsdp` axes under the mesh strategies; "batch" works under every strategy too). Parameter
names are stable for sharding rules: `stem_conv`, `stage{s}_block{b}/conv{i}`, `.../bn{i}`,
`.../proj_conv`, `head`.
"""

import functools

import flax.linen as nn
import jax.numpy as jnp

from jddp.errors import ConfigError, ShapeError

# depth -> (blocks per stage, bottleneck blocks?)
DEPTHS = {
    18: ((2, 2, 2, 2), False),
    34: ((3, 4, 6, 3), False),
    50: ((3, 4, 6, 3), True),
    101: ((3, 4, 23, 3), True),
    152: ((3, 8, 36, 3), True),
}
STEMS = ("imagenet", "cifar")


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions (basic) or 1x1-3x3-1x1 (bottleneck, 4x expansion), plus a projected
    shortcut where the shape changes. The last BatchNorm's scale starts at zero, so each block
    starts as the identity (Goyal et al., 2017)."""

    width: int
    strides: int
    bottleneck: bool
    norm: type[nn.Module]

    @nn.compact
    def __call__(self, x):
        conv = functools.partial(nn.Conv, use_bias=False)
        if self.bottleneck:
            shapes = [(self.width, 1, 1), (self.width, 3, self.strides), (4 * self.width, 1, 1)]
        else:
            shapes = [(self.width, 3, self.strides), (self.width, 3, 1)]
        y = x
        for i, (features, kernel, strides) in enumerate(shapes, start=1):
            y = conv(features, (kernel, kernel), strides, padding=kernel // 2, name=f"conv{i}")(y)
            last = i == len(shapes)
            scale_init = nn.initializers.zeros if last else nn.initializers.ones
            y = self.norm(scale_init=scale_init, name=f"bn{i}")(y)
            if not last:
                y = nn.relu(y)
        out_features = shapes[-1][0]
        if x.shape[-1] != out_features or self.strides != 1:
            x = conv(out_features, (1, 1), self.strides, name="proj_conv")(x)
            x = self.norm(name="proj_bn")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """ResNet-`depth` for `num_classes`. `stem="imagenet"`: 7x7/2 convolution and 3x3/2
    max-pooling (224x224 inputs); `"cifar"`: one 3x3/1 convolution (32x32 inputs).
    `remat=True` recomputes each block's activations in the backward pass (less memory)."""

    num_classes: int
    depth: int = 50
    stem: str = "imagenet"
    width: int = 64  # channels of the first stage; doubled at every stage
    batch_axis_name: str | None = None
    bn_momentum: float = 0.9
    remat: bool = False

    def __post_init__(self):
        if self.depth not in DEPTHS:
            raise ConfigError(
                f"ResNet depth={self.depth} is not one of {', '.join(map(str, DEPTHS))}; "
                "set model_args.depth"
            )
        if self.stem not in STEMS:
            raise ConfigError(f"ResNet stem={self.stem!r}; choose one of {', '.join(STEMS)}")
        if self.width < 1 or self.num_classes < 1:
            raise ConfigError(
                f"ResNet width={self.width} and num_classes={self.num_classes} must be >= 1"
            )
        super().__post_init__()

    @nn.compact
    def __call__(self, x, train: bool):
        if x.ndim != 4:
            raise ShapeError(
                f"ResNet takes images of shape (batch, height, width, channels), got {x.shape}"
            )
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=self.bn_momentum,
            epsilon=1e-5,
            axis_name=self.batch_axis_name if train else None,
        )
        if self.stem == "imagenet":
            x = nn.Conv(self.width, (7, 7), 2, padding=3, use_bias=False, name="stem_conv")(x)
            x = nn.relu(norm(name="stem_bn")(x))
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        else:
            x = nn.Conv(self.width, (3, 3), 1, padding=1, use_bias=False, name="stem_conv")(x)
            x = nn.relu(norm(name="stem_bn")(x))
        stage_sizes, bottleneck = DEPTHS[self.depth]
        block_cls = nn.remat(ResidualBlock) if self.remat else ResidualBlock
        for stage, num_blocks in enumerate(stage_sizes):
            for block in range(num_blocks):
                x = block_cls(
                    width=self.width * 2**stage,
                    strides=2 if stage > 0 and block == 0 else 1,
                    bottleneck=bottleneck,
                    norm=norm,
                    name=f"stage{stage + 1}_block{block + 1}",
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, name="head")(x)
