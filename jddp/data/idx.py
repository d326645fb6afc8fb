"""The IDX files of MNIST and Fashion-MNIST, read and checked: a bad file is one clear error.

IDX: two zero bytes, a type code (0x08 = unsigned byte), the number of dimensions, each dimension
as a big-endian uint32, then the values. The files usually come gzip-compressed.
"""

import gzip
import math
import struct
import zlib

import numpy as np

from jddp.errors import DataError

_UNSIGNED_BYTE = 0x08


def read_idx(path: str, ndim: int, fix: str) -> np.ndarray:
    """The uint8 array in the IDX file `path` (gzip or not), which must have `ndim` dimensions;
    `fix` ends the error message if the file is corrupt or truncated."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path} is corrupt or truncated ({e}); {fix}") from None
    header_size = 4 + 4 * ndim
    if len(raw) < header_size or raw[:2] != b"\0\0" or raw[2] != _UNSIGNED_BYTE or raw[3] != ndim:
        raise DataError(
            f"{path} is not an IDX file of {ndim}-dimensional unsigned bytes "
            f"(header {raw[:4].hex() or 'empty'}); {fix}"
        )
    shape = struct.unpack(f">{ndim}I", raw[4:header_size])
    values = raw[header_size:]
    if len(values) != math.prod(shape):
        raise DataError(
            f"{path} is truncated or corrupt: its header promises {math.prod(shape)} values "
            f"{tuple(shape)} but it holds {len(values)}; {fix}"
        )
    return np.frombuffer(values, np.uint8).reshape(shape)


def read_images_and_labels(
    images_path: str, labels_path: str, image_size: int, num_classes: int, fix: str
) -> tuple[np.ndarray, np.ndarray]:
    """(N, size, size, 1) images and (N,) labels from a pair of IDX files, checked to agree."""
    images = read_idx(images_path, 3, fix)
    labels = read_idx(labels_path, 1, fix)
    if images.shape[1:] != (image_size, image_size):
        raise DataError(
            f"{images_path} holds {images.shape[1]}x{images.shape[2]} images, expected "
            f"{image_size}x{image_size}; {fix}"
        )
    if len(images) != len(labels):
        raise DataError(
            f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} "
            f"labels; {fix}"
        )
    if labels.size and labels.max() >= num_classes:
        raise DataError(
            f"{labels_path} holds label {labels.max()}, expected 0..{num_classes - 1}; {fix}"
        )
    return images[..., None], labels
