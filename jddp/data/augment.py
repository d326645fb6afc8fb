"""Random augmentations whose every draw depends only on (seed, epoch, example index).

Example i of the split in epoch e gets the key `example_keys(seed, e, i)`; each random number an
augmentation needs is a counter-based hash of that key and a stream number. So the same example
gets the same crop and flip whatever the batch size, the device or process count, or the loader
thread or worker process that happens to read it, and a resumed run draws what the uninterrupted
run drew. The draws for a whole batch are one vectorized hash.
"""

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = 2**64 - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijection of uint64 that scatters nearby inputs."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def example_keys(seed: int, epochs, indices) -> np.ndarray:
    """One uint64 key per example, from the run's seed, the epoch and the example's index."""
    epochs = np.asarray(epochs).astype(np.uint64)
    indices = np.asarray(indices).astype(np.uint64)
    with np.errstate(over="ignore"):
        key = _mix(np.full(indices.shape, seed & _MASK64, np.uint64) + _GOLDEN)
        key = _mix(key ^ (epochs + _GOLDEN))
        return _mix(key ^ (indices + _GOLDEN))


def uniform(keys: np.ndarray, stream: int) -> np.ndarray:
    """A float64 in [0, 1) per key; different streams give independent draws."""
    with np.errstate(over="ignore"):
        bits = _mix(keys ^ (np.uint64(stream + 1) * _GOLDEN))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def integers(keys: np.ndarray, stream: int, high) -> np.ndarray:
    """An int64 in [0, high) per key."""
    return np.minimum((uniform(keys, stream) * high).astype(np.int64), np.asarray(high) - 1)


def random_crop_and_flip(images: np.ndarray, keys: np.ndarray, padding: int) -> np.ndarray:
    """Each image zero-padded by `padding` pixels, cropped back to its size at a random offset,
    and mirrored left-right with probability 1/2 (the CIFAR recipe). Shape (B, H, W, C)."""
    batch, height, width, _ = images.shape
    padded = np.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    top = integers(keys, 0, 2 * padding + 1)
    left = integers(keys, 1, 2 * padding + 1)
    flip = uniform(keys, 2) < 0.5
    out = np.empty_like(images)
    for i in range(batch):  # a slice per image: 3x faster than one fancy-index gather
        crop = padded[i, top[i] : top[i] + height, left[i] : left[i] + width]
        out[i] = crop[:, ::-1] if flip[i] else crop
    return out


def random_window(sequences: np.ndarray, keys: np.ndarray, length: int) -> np.ndarray:
    """A window of `length` items at a random offset in each row of (B, L): a crop, for text."""
    starts = integers(keys, 0, sequences.shape[1] - length + 1)
    return sequences[np.arange(len(sequences))[:, None], starts[:, None] + np.arange(length)]


def inception_crop_box(height: int, width: int, key: np.uint64) -> tuple[int, int, int, int]:
    """(top, left, crop height, crop width): 8-100% of the area, aspect ratio 3/4..4/3, the
    Inception / ResNet recipe; the centre square if ten tries find no box that fits."""
    draws = uniform(np.full(30, key, np.uint64) ^ np.arange(30, dtype=np.uint64), 0)
    area = height * width
    for attempt in range(10):
        u_area, u_ratio, u_pos = draws[3 * attempt : 3 * attempt + 3]
        target = area * (0.08 + 0.92 * u_area)
        ratio = np.exp(np.log(3 / 4) + u_ratio * (np.log(4 / 3) - np.log(3 / 4)))
        crop_w = int(round(np.sqrt(target * ratio)))
        crop_h = int(round(np.sqrt(target / ratio)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            top = int(u_pos * (height - crop_h + 1))
            left = int(uniform(np.array([key]), 3 + attempt)[0] * (width - crop_w + 1))
            return top, left, crop_h, crop_w
    side = min(height, width)
    return (height - side) // 2, (width - side) // 2, side, side
