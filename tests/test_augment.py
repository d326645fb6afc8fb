"""Augmentation: example i of epoch e gets the same crop and flip whatever the batch size or
process split, the crops are the CIFAR recipe, text windows are the corpus shifted by one."""

import numpy as np
import pytest
from PIL import Image

from jddp import data
from jddp.data import augment, text, transforms

N = 37  # examples in the synthetic split; no batch size below divides it
PAD = 4


def unique_images(n=N, size=8, seed=0):
    """Random images (each unique) whose label is their index, so a batch names its examples."""
    rng = np.random.default_rng(seed)
    return data.ArraySource(
        {"image": rng.integers(0, 256, (n, size, size, 3), np.uint8), "label": np.arange(n)}
    )


class RawCrops:
    """The CIFAR crop and flip without standardization, so outputs compare to the raw pixels."""

    def __call__(self, batch, keys=None):
        images = batch["image"]
        if keys is not None:
            images = augment.random_crop_and_flip(images, keys, PAD)
        return {"image": images, "label": np.asarray(batch["label"])}


def augmented_by_example(global_batch_size, process_count, steps):
    """{(epoch, example index): augmented image} over `steps` global batches."""
    source = unique_images()
    rows = [
        [
            next(iterator)
            for _ in range(steps)
        ]
        for iterator in (
            data.train_batches(
                source, RawCrops(), global_batch_size=global_batch_size, seed=3,
                process_index=p, process_count=process_count,
            )
            for p in range(process_count)
        )
    ]  # fmt: skip
    seen = {}
    for step in range(steps):
        batch_images = np.concatenate([rows[p][step]["image"] for p in range(process_count)])
        batch_labels = np.concatenate([rows[p][step]["label"] for p in range(process_count)])
        for row, (image, label) in enumerate(zip(batch_images, batch_labels, strict=True)):
            epoch = (step * global_batch_size + row) // N
            seen[(epoch, int(label))] = image
    return seen


def reference_crops(image):
    """Every crop of the zero-padded image and its mirror: what the recipe may produce."""
    height, width = image.shape[:2]
    padded = np.pad(image, ((PAD, PAD), (PAD, PAD), (0, 0)))
    for top in range(2 * PAD + 1):
        for left in range(2 * PAD + 1):
            crop = padded[top : top + height, left : left + width]
            yield (top, left, False), crop
            yield (top, left, True), crop[:, ::-1]


def test_augmentation_of_an_example_does_not_depend_on_batching():
    base = augmented_by_example(global_batch_size=8, process_count=1, steps=14)  # ~3 epochs
    for global_batch_size, process_count in [(12, 2), (4, 4), (36, 1)]:
        steps = len(base) // global_batch_size
        other = augmented_by_example(global_batch_size, process_count, steps)
        common = base.keys() & other.keys()
        assert len(common) >= 100
        for key in common:
            np.testing.assert_array_equal(other[key], base[key], err_msg=str(key))


def test_crops_and_flips_follow_the_cifar_recipe():
    source = unique_images()
    seen = augmented_by_example(global_batch_size=8, process_count=1, steps=14)
    choices = []
    for (epoch, index), image in seen.items():
        matches = [
            c for c, crop in reference_crops(source[index]["image"]) if np.array_equal(crop, image)
        ]
        assert matches, f"example {index} of epoch {epoch} is no crop of its padded image"
        choices.append(matches[0])
    offsets = {(top, left) for top, left, _ in choices}
    flips = [flip for _, _, flip in choices]
    assert len(offsets) > 40 and 0.3 < np.mean(flips) < 0.7  # spread over 81 offsets, half flipped
    # A new epoch, a new augmentation for most examples.
    changed = [not np.array_equal(seen[(0, i)], seen[(1, i)]) for i in range(N)]
    assert np.mean(changed) > 0.8


def test_example_keys_are_distinct_and_depend_on_all_three_inputs():
    epochs, indices = np.meshgrid(np.arange(50), np.arange(2000), indexing="ij")
    keys = augment.example_keys(7, epochs.ravel(), indices.ravel())
    assert len(np.unique(keys)) == keys.size
    assert not np.array_equal(keys, augment.example_keys(8, epochs.ravel(), indices.ravel()))
    draws = augment.uniform(keys, 0)
    assert 0 <= draws.min() and draws.max() < 1 and abs(draws.mean() - 0.5) < 0.01


def test_eval_and_unaugmented_training_leave_images_alone():
    source = unique_images()
    batch = source.read_batch(np.arange(5))
    standardize = transforms.StandardizeImages((0.5, 0.5, 0.5), (0.25, 0.25, 0.25), augment=False)
    keys = augment.example_keys(0, np.zeros(5), np.arange(5))
    expected = (batch["image"] / 255.0 - 0.5) / 0.25
    np.testing.assert_allclose(standardize(batch, keys)["image"], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(standardize(batch)["image"], expected, rtol=1e-6, atol=1e-6)


def test_imagenet_crops_are_deterministic_per_key_and_eval_is_a_centre_crop():
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), np.uint8) for h, w in [(60, 90), (97, 41)]]
    transform = transforms.ImagenetImages(image_size=32)
    keys = augment.example_keys(0, np.zeros(2), np.arange(2))
    batch = {"image": images, "label": np.array([3, 4])}
    first, again = transform(batch, keys), transform(batch, keys)
    np.testing.assert_array_equal(first["image"], again["image"])
    assert first["image"].shape == (2, 32, 32, 3) and first["image"].dtype == np.float32
    other_epoch = transform(batch, augment.example_keys(0, np.ones(2), np.arange(2)))
    assert not np.array_equal(first["image"], other_epoch["image"])

    # Eval: the centre square of 32/64 of the shorter side, resized (PIL, bicubic), standardized.
    side = int(32 / 64 * 60)
    top, left = (60 - side + 1) // 2, (90 - side + 1) // 2
    crop = Image.fromarray(images[0][top : top + side, left : left + side])
    pixels = np.asarray(crop.resize((32, 32), Image.Resampling.BICUBIC)) / 255.0
    expected = (pixels - transforms.IMAGENET_MEAN) / transforms.IMAGENET_STD
    np.testing.assert_allclose(transform(batch)["image"][0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("augmented", [True, False])
def test_text_windows_are_the_corpus_shifted_by_one(augmented):
    corpus = "".join(np.random.default_rng(0).choice(list("abcdef \n"), 5000))
    vocabulary = "".join(sorted(set(corpus)))
    tokens = text.encode(corpus, vocabulary, "corpus")
    seq_len = 16
    train = text.language_model_windows(tokens, seq_len, True, "corpus")
    transform = transforms.NextCharacter(seq_len, augment=augmented)
    pipeline = data.train_batches(train, transform, global_batch_size=64, seed=0)
    starts = set()
    for _ in range(10):
        batch = next(pipeline)
        assert batch["inputs"].shape == (64, seq_len) and batch["inputs"].dtype == np.int32
        for inputs, targets in zip(batch["inputs"], batch["targets"], strict=True):
            window = text.decode(inputs, vocabulary) + text.decode(targets[-1:], vocabulary)
            assert text.decode(targets, vocabulary) == window[1:]
            start = corpus.find(window)
            assert start >= 0
            starts.add(start % seq_len)
    assert (len(starts) > 8) if augmented else (starts == {0})
