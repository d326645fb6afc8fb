"""The UCI handwritten digits that scikit-learn ships, as a TFDS dataset builder.

It prepares itself from the copy inside scikit-learn (no download) into array_record files, so the
default experiment reads its data through `tfds.data_source` exactly as a real dataset does.
"""

import numpy as np
import tensorflow_datasets as tfds

TEST_SIZE = 360  # a fixed hold-out: 20% of 1,797, chosen by a seeded permutation
SPLIT_SEED = 0


class UciDigits(tfds.core.GeneratorBasedBuilder):
    """1,797 8x8 grey-scale digits (1,437 train, 360 test), pixels scaled from 0..16 to 0..255."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release, from sklearn.datasets.load_digits."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Optical recognition of handwritten digits (UCI), as bundled by sklearn.",
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://archive.ics.uci.edu/dataset/80",
        )

    def _split_generators(self, dl_manager):
        from sklearn.datasets import load_digits  # only needed while preparing

        digits = load_digits()
        order = np.random.default_rng(SPLIT_SEED).permutation(len(digits.target))
        return {
            "train": self._generate_examples(digits, order[TEST_SIZE:]),
            "test": self._generate_examples(digits, order[:TEST_SIZE]),
        }

    def _generate_examples(self, digits, indices):
        for i in indices:
            image = np.round(digits.images[i] * (255 / 16)).astype(np.uint8)[..., None]
            yield int(i), {"image": image, "label": int(digits.target[i])}
