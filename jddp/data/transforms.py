"""Per-dataset preprocessing: a batch of raw examples -> the arrays the model and loss take.

A transform is `fn(batch, keys)`: `keys` holds one augmentation key per example in training
(see augment.py) and is None in evaluation. Transforms are small frozen dataclasses, so grain can
pickle them into its worker processes.
"""

import dataclasses

import numpy as np

from jddp.data import augment

# Channel statistics of the training images, in [0, 1] units.
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
EVAL_CROP_PADDING = 32  # ImageNet eval: centre crop of size/(size+32) of the shorter side


def _labels(batch) -> np.ndarray:
    return np.asarray(batch["label"], np.int32)


@dataclasses.dataclass(frozen=True)
class ScaleImages:
    """uint8 pixels to float32 in [0, 1]; no augmentation (MNIST-like digits and clothes)."""

    def __call__(self, batch, keys=None) -> dict[str, np.ndarray]:
        return {"image": np.asarray(batch["image"], np.float32) / 255.0, "label": _labels(batch)}


@dataclasses.dataclass(frozen=True)
class StandardizeImages:
    """Pixels standardized per channel; in training (with `augment`) first a random crop of the
    image zero-padded by `crop_padding` pixels and a random left-right flip (CIFAR)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool = True
    crop_padding: int = 4

    def __call__(self, batch, keys=None) -> dict[str, np.ndarray]:
        images = np.asarray(batch["image"])
        if keys is not None and self.augment:
            images = augment.random_crop_and_flip(images, keys, self.crop_padding)
        return {"image": _standardize(images, self.mean, self.std), "label": _labels(batch)}


def _standardize(images: np.ndarray, mean, std) -> np.ndarray:
    mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    return images.astype(np.float32) * (np.float32(1 / 255) / std) - mean / std


@dataclasses.dataclass(frozen=True)
class ImagenetImages:
    """Images of any size to `image_size` squares: in training (with `augment`) a random crop of
    8-100% of the area and a random flip, in evaluation a centre crop; then standardized."""

    image_size: int = 224
    augment: bool = True

    def __call__(self, batch, keys=None) -> dict[str, np.ndarray]:
        images = batch["image"]
        if keys is not None and self.augment:
            crops = [self._random_crop(image, key) for image, key in zip(images, keys, strict=True)]
        else:
            crops = [self._centre_crop(image) for image in images]
        images = np.stack(crops)
        return {"image": _standardize(images, IMAGENET_MEAN, IMAGENET_STD), "label": _labels(batch)}

    def _resize(self, image: np.ndarray) -> np.ndarray:
        from PIL import Image  # the loader's workers import it once, on first use

        size = (self.image_size, self.image_size)
        return np.asarray(Image.fromarray(image).resize(size, Image.Resampling.BICUBIC))

    def _random_crop(self, image: np.ndarray, key: np.uint64) -> np.ndarray:
        top, left, height, width = augment.inception_crop_box(*image.shape[:2], key)
        crop = self._resize(image[top : top + height, left : left + width])
        flip = augment.uniform(np.array([key]), 13)[0] < 0.5
        return crop[:, ::-1] if flip else crop

    def _centre_crop(self, image: np.ndarray) -> np.ndarray:
        height, width = image.shape[:2]
        side = int(self.image_size / (self.image_size + EVAL_CROP_PADDING) * min(height, width))
        top, left = (height - side + 1) // 2, (width - side + 1) // 2
        return self._resize(image[top : top + side, left : left + side])


@dataclasses.dataclass(frozen=True)
class NextCharacter:
    """Token windows to `inputs` and `targets` (the inputs shifted by one), `seq_len` each.

    Training rows hold 2 x seq_len tokens and a window of seq_len + 1 is cut at a random offset
    (with `augment`; else at 0); evaluation rows hold exactly seq_len + 1 tokens.
    """

    seq_len: int
    augment: bool = True

    def __call__(self, batch, keys=None) -> dict[str, np.ndarray]:
        tokens = np.asarray(batch["tokens"])
        if keys is not None and self.augment:
            window = augment.random_window(tokens, keys, self.seq_len + 1)
        else:
            window = tokens[:, : self.seq_len + 1]
        window = window.astype(np.int32)
        return {"inputs": window[:, :-1], "targets": window[:, 1:]}
