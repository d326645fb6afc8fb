"""CIFAR-10 and CIFAR-100 as TFDS's own builders (same name, version, features, splits), prepared
without TensorFlow from the official binary archive: a local copy if found, else downloaded.

Binary format: per image, 1 label byte (CIFAR-100: coarse then fine), then 3 x 32 x 32 bytes of
red, green and blue planes.
"""

import tarfile

import numpy as np
from tensorflow_datasets.image_classification import cifar as tfds_cifar

from jddp.data.source_files import LocalFilesBuilder, png_bytes
from jddp.errors import DataError

IMAGE_BYTES = 3 * 32 * 32


class _CifarBinaryBuilder(LocalFilesBuilder):
    """Reads `_cifar_info` (TFDS's description of the archive) with Python's tarfile."""

    @property
    def SOURCE_FILES(self):  # the LocalFilesBuilder attribute
        return {"archive": self._cifar_info.url.rsplit("/", 1)[-1]}

    @property
    def SOURCE_URLS(self):
        return {"archive": self._cifar_info.url}

    def _split_generators(self, dl_manager):
        info = self._cifar_info
        path = self.source_files(dl_manager)
        files = read_archive(
            path["archive"], info.prefix, f"delete it and get it again: {self.HOW_TO_GET}"
        )
        fix = f"{path['archive']} is incomplete; {self.HOW_TO_GET}"
        for label_key, label_file in zip(info.label_keys, info.label_files, strict=True):
            names = [n for n in _member(files, label_file, fix).decode().split("\n") if n]
            self.info.features[label_key].names = names
        return {
            "train": self._examples("train_", [_member(files, f, fix) for f in info.train_files]),
            "test": self._examples("test_", [_member(files, f, fix) for f in info.test_files]),
        }

    def _examples(self, id_prefix, blobs):
        label_keys = self._cifar_info.label_keys
        record_size = len(label_keys) + IMAGE_BYTES
        index = 0
        for blob in blobs:
            if len(blob) % record_size:
                raise DataError(
                    f"{self.name}: a data file of {len(blob)} bytes is not whole "
                    f"{record_size}-byte records (truncated?); {self.HOW_TO_GET}"
                )
            records = np.frombuffer(blob, np.uint8).reshape(-1, record_size)
            images = records[:, len(label_keys) :].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
            for labels, image in zip(records[:, : len(label_keys)], images, strict=True):
                example = {key: int(label) for key, label in zip(label_keys, labels, strict=True)}
                example.update(id=f"{id_prefix}{index:05d}", image=png_bytes(image))
                yield index, example
                index += 1


def read_archive(path: str, prefix: str, fix: str) -> dict[str, bytes]:
    """{file name: bytes} of the files under `prefix` in the (gzipped) tar archive `path`."""
    files = {}
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                if member.isfile() and member.name.startswith(prefix):
                    files[member.name[len(prefix) :]] = tar.extractfile(member).read()
    except (OSError, EOFError, tarfile.TarError) as e:
        raise DataError(f"{path} is corrupt or truncated ({e}); {fix}") from None
    return files


def _member(files: dict[str, bytes], name: str, fix: str) -> bytes:
    if name not in files:
        raise DataError(f"{name} is missing: {fix}")
    return files[name]


class Cifar10(_CifarBinaryBuilder, tfds_cifar.Cifar10, skip_registration=True):
    name = "cifar10"
    HOW_TO_GET = (
        "put cifar-10-binary.tar.gz (from https://www.cs.toronto.edu/~kriz/cifar.html) in "
        "--config.data.manual_dir"
    )


class Cifar100(_CifarBinaryBuilder, tfds_cifar.Cifar100, skip_registration=True):
    name = "cifar100"
    HOW_TO_GET = (
        "put cifar-100-binary.tar.gz (from https://www.cs.toronto.edu/~kriz/cifar.html) in "
        "--config.data.manual_dir"
    )
