"""ImageNet 2012 (ILSVRC) as TFDS's own `imagenet2012` builder, prepared without TensorFlow.

As in TFDS, the archives must be downloaded by hand (registration at image-net.org) into the
manual dir: `--config.data.manual_dir`, else TFDS's `<data_dir>/downloads/manual`. What TFDS
does with TensorFlow here (checking files, reading the archives, fixing the 22 CMYK JPEGs and the
one PNG) is done with tarfile and Pillow; everything else is TFDS's builder, unchanged.
"""

import io
import tarfile

import tensorflow_datasets as tfds
from tensorflow_datasets.datasets.imagenet2012 import imagenet2012_dataset_builder as tfds_imagenet

from jddp.data.source_files import LocalFilesBuilder
from jddp.errors import DataError

# TFDS's list of validation labels, one per image in the sorted order of the file names.
VALIDATION_LABELS = "datasets/imagenet2012/validation_labels.txt"
ARCHIVES = {"train": "ILSVRC2012_img_train.tar", "validation": "ILSVRC2012_img_val.tar"}


class Imagenet2012(LocalFilesBuilder, tfds_imagenet.Builder, skip_registration=True):
    name = "imagenet2012"
    SOURCE_FILES = ARCHIVES
    HOW_TO_GET = (
        "register at https://image-net.org/download-images, download ILSVRC2012_img_train.tar "
        "and ILSVRC2012_img_val.tar and put both in --config.data.manual_dir"
    )

    @classmethod
    def get_metadata(cls):
        return tfds_imagenet.Builder.get_metadata()  # TFDS's description, read from its package

    def _split_generators(self, dl_manager):
        paths = self.source_files(dl_manager)
        return [
            tfds.core.SplitGenerator(name="train", gen_kwargs={"archive": _tar(paths["train"])}),
            tfds.core.SplitGenerator(
                name="validation",
                gen_kwargs={
                    "archive": _tar(paths["validation"]),
                    "validation_labels": validation_labels(paths["validation"]),
                },
            ),
        ]

    def _fix_image(self, image_fname, image):
        if image_fname in tfds_imagenet.CMYK_IMAGES or image_fname in tfds_imagenet.PNG_IMAGES:
            return io.BytesIO(rgb_jpeg(image.read()))
        return image


def _tar(path: str):
    """(name, file object) for each file of the tar archive `path`, streamed."""
    try:
        with open(path, "rb") as f:
            yield from tfds.download.iter_archive(f, tfds.download.ExtractMethod.TAR_STREAM)
    except (OSError, tarfile.TarError) as e:
        raise DataError(f"{path} is corrupt or truncated ({e}); download it again") from None


def validation_labels(val_path: str) -> dict[str, str]:
    """{image file name: synset} for the validation archive."""
    labels = tfds.core.tfds_path(VALIDATION_LABELS).read_text().strip().splitlines()
    try:
        with tarfile.open(val_path) as tar:
            names = sorted(tar.getnames())
    except (OSError, tarfile.TarError) as e:
        raise DataError(f"{val_path} is corrupt or truncated ({e}); download it again") from None
    return dict(zip(names, labels, strict=False))


def rgb_jpeg(image_bytes: bytes) -> bytes:
    """A CMYK JPEG or a PNG as an RGB JPEG (quality 100), as TFDS converts them."""
    from PIL import Image

    buffer = io.BytesIO()
    with Image.open(io.BytesIO(image_bytes)) as image:
        image.convert("RGB").save(buffer, format="JPEG", quality=100)
    return buffer.getvalue()
