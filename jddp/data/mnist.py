"""MNIST and Fashion-MNIST as TFDS's own builders (same name, version, features, splits), prepared
without TensorFlow from the four standard IDX files: local ones if found, else downloaded.

Fashion-MNIST is found where Debian's `dataset-fashion-mnist` package installs it.
"""

from tensorflow_datasets.image_classification import mnist as tfds_mnist

from jddp.data.idx import read_images_and_labels
from jddp.data.source_files import LocalFilesBuilder, png_bytes

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


class _IdxBuilder(LocalFilesBuilder):
    """Reads the IDX files of `IDX_FILES` (checked: a bad file is one error line)."""

    SOURCE_FILES = IDX_FILES

    @property
    def SOURCE_URLS(self):  # the LocalFilesBuilder attribute
        return {key: self.URL + name for key, name in IDX_FILES.items()}

    def _split_generators(self, dl_manager):
        paths = self.source_files(dl_manager)
        fix = f"delete it and get it again: {self.HOW_TO_GET}"
        splits = {}
        for split in ("train", "test"):
            images, labels = read_images_and_labels(
                paths[f"{split}_images"],
                paths[f"{split}_labels"],
                tfds_mnist.MNIST_IMAGE_SHAPE[0],
                tfds_mnist.MNIST_NUM_CLASSES,
                fix,
            )
            splits[split] = self._examples(images, labels)
        return splits

    def _examples(self, images, labels):
        for index, (image, label) in enumerate(zip(images, labels, strict=True)):
            yield index, {"image": png_bytes(image), "label": int(label)}


class Mnist(_IdxBuilder, tfds_mnist.MNIST, skip_registration=True):
    name = "mnist"
    HOW_TO_GET = (
        "put train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz "
        f"and t10k-labels-idx1-ubyte.gz (from {tfds_mnist.MNIST.URL}) in --config.data.manual_dir"
    )


class FashionMnist(_IdxBuilder, tfds_mnist.FashionMNIST, skip_registration=True):
    name = "fashion_mnist"
    DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
    SYSTEM_DIRS = (DEBIAN_DIR,)
    HOW_TO_GET = (
        "run `apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or put the 4 IDX files "
        "(train-images-idx3-ubyte.gz, ...; github.com/zalandoresearch/fashion-mnist) in "
        "--config.data.manual_dir"
    )
